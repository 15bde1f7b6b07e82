//! What one [`Leases`](super::Leases) instance counts: its metrics
//! ([`LeaseMetrics`], handles registered once, `lease` labels bounded) and
//! its stats ([`LeaseStats`], the counts read by [`Leases::stats`]).
//!
//! [`Leases::stats`]: super::Leases::stats
//!
//! A lease name is a label value only when it was declared up front: on the
//! builder ([`LeasesBuilder::declare`](super::LeasesBuilder::declare)), or
//! as a [`Scheduler`](super::Scheduler) job (a per-node job counts under its
//! job name, never its host). Every other name counts under
//! [`UNDECLARED_LEASE`], so that leases named after users, tenants or
//! requests cannot grow the exposition without bound.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram};
use parking_lot::RwLock;

use crate::lost::LostReason;
use crate::metrics::{
    describe, LEASES_HELD, LEASE_ACQUIRED, LEASE_JOB_PANICS, LEASE_LOST, LEASE_PURGED,
    LEASE_RENEWALS, LEASE_RENEWAL_DURATION, LEASE_RENEWER_PANICS, LEASE_RENEW_INTERVAL,
    LEASE_SKIPPED, LEASE_STATEMENT_TIMEOUTS, LEASE_TAKEOVERS, LEASE_TAKEOVERS_BLOCKED,
};

/// The `lease` label value of every lease name that was not declared.
pub(crate) const UNDECLARED_LEASE: &str = "_other";

/// The statements of `pgwarden_lease_statement_timeouts_total{statement}`.
const STATEMENTS: [&str; 6] = [
    "acquisition",
    "busy check",
    "renewal",
    "release",
    "purge",
    "install",
];

/// The counters of one label value.
#[derive(Debug)]
pub(crate) struct NameMetrics {
    acquired: Counter,
    skipped: Counter,
    takeovers: Counter,
    takeovers_blocked: Counter,
    /// By [`LostReason`]: taken, deadline, expired, released, revoked.
    lost: [Counter; 5],
}

impl NameMetrics {
    fn register(pool: &str, label: &str) -> NameMetrics {
        let c = |name: &'static str| metrics::counter!(name, "pool" => pool.to_owned(), "lease" => label.to_owned());
        let lost = |r: LostReason| metrics::counter!(LEASE_LOST, "pool" => pool.to_owned(), "lease" => label.to_owned(), "reason" => r.as_str());
        NameMetrics {
            acquired: c(LEASE_ACQUIRED),
            skipped: c(LEASE_SKIPPED),
            takeovers: c(LEASE_TAKEOVERS),
            takeovers_blocked: c(LEASE_TAKEOVERS_BLOCKED),
            lost: [
                lost(LostReason::Taken),
                lost(LostReason::Deadline),
                lost(LostReason::Expired),
                lost(LostReason::Released),
                lost(LostReason::Revoked),
            ],
        }
    }
}

/// Handles of one lease table's instance.
#[derive(Debug)]
pub(crate) struct LeaseMetrics {
    pool: String,
    pub(crate) held: Gauge,
    pub(crate) renew_ok: Counter,
    pub(crate) renew_lost: Counter,
    pub(crate) renew_error: Counter,
    pub(crate) renewal: Histogram,
    pub(crate) renew_interval: Gauge,
    pub(crate) renewer_panics: Counter,
    pub(crate) purged: Counter,
    timeouts: [Counter; STATEMENTS.len()],
    /// Declared lease names and the counters of their label.
    names: RwLock<HashMap<String, Arc<NameMetrics>>>,
    other: Arc<NameMetrics>,
}

impl LeaseMetrics {
    pub(crate) fn register(pool: &str) -> LeaseMetrics {
        describe();
        let p = pool.to_owned();
        let renewals = |result: &'static str| metrics::counter!(LEASE_RENEWALS, "pool" => p.clone(), "result" => result);
        LeaseMetrics {
            held: metrics::gauge!(LEASES_HELD, "pool" => p.clone()),
            renew_ok: renewals("ok"),
            renew_lost: renewals("lost"),
            renew_error: renewals("error"),
            renewal: metrics::histogram!(LEASE_RENEWAL_DURATION, "pool" => p.clone()),
            renew_interval: metrics::gauge!(LEASE_RENEW_INTERVAL, "pool" => p.clone()),
            renewer_panics: metrics::counter!(LEASE_RENEWER_PANICS, "pool" => p.clone()),
            purged: metrics::counter!(LEASE_PURGED, "pool" => p.clone()),
            timeouts: STATEMENTS.map(|s| {
                metrics::counter!(LEASE_STATEMENT_TIMEOUTS, "pool" => p.clone(), "statement" => s)
            }),
            names: RwLock::new(HashMap::new()),
            other: Arc::new(NameMetrics::register(pool, UNDECLARED_LEASE)),
            pool: p,
        }
    }

    /// Declares `lease`, labelled `label` (its own name, or a per-node job's
    /// job name). Idempotent.
    pub(crate) fn declare(&self, lease: &str, label: &str) {
        if self.names.read().contains_key(lease) {
            return;
        }
        let m = Arc::new(NameMetrics::register(&self.pool, label));
        self.names.write().entry(lease.to_owned()).or_insert(m);
    }

    fn with<R>(&self, lease: &str, f: impl FnOnce(&NameMetrics) -> R) -> R {
        let names = self.names.read();
        f(names.get(lease).map_or(&*self.other, |m| &**m))
    }

    pub(crate) fn acquired(&self, lease: &str) {
        self.with(lease, |m| m.acquired.increment(1));
    }

    pub(crate) fn skipped(&self, lease: &str) {
        self.with(lease, |m| m.skipped.increment(1));
    }

    pub(crate) fn takeover(&self, lease: &str) {
        self.with(lease, |m| m.takeovers.increment(1));
    }

    pub(crate) fn takeover_blocked(&self, lease: &str) {
        self.with(lease, |m| m.takeovers_blocked.increment(1));
    }

    pub(crate) fn lost(&self, lease: &str, reason: LostReason) {
        let i = match reason {
            LostReason::Taken => 0,
            LostReason::Deadline => 1,
            LostReason::Expired => 2,
            LostReason::Released => 3,
            LostReason::Revoked => 4,
        };
        self.with(lease, |m| m.lost[i].increment(1));
    }

    /// A lease statement timed out and was cancelled.
    pub(crate) fn timed_out(&self, statement: &'static str) {
        if let Some(i) = STATEMENTS.iter().position(|s| *s == statement) {
            self.timeouts[i].increment(1);
        }
    }

    /// The panic counter of a scheduled job (declared by the scheduler),
    /// labelled `lease` by its job name (`job` is Prometheus's own label).
    pub(crate) fn job_panics(&self, job: &str) -> Counter {
        metrics::counter!(LEASE_JOB_PANICS, "pool" => self.pool.clone(), "lease" => job.to_owned())
    }
}

/// What a [`Leases`](super::Leases) instance has done, for logs and tests.
///
/// ```no_run
/// # fn demo(leases: pgwarden::Leases) {
/// let s = leases.stats();
/// println!("{} held, {} renewal failures", s.held, s.renewal_failures);
/// # }
/// ```
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseStats {
    /// Leases held now.
    pub held: usize,
    /// Statements sent: acquisitions, busy checks, renewals, releases,
    /// fences, purges and installs.
    pub statements: u64,
    /// Renewal statements sent (each renews a batch).
    pub renewal_statements: u64,
    /// Lease renewals that succeeded, summed over batches.
    pub renewed: u64,
    /// Leases in the last renewal statement that succeeded.
    pub last_batch: usize,
    /// How long that statement took, checkout included.
    pub last_renewal: Duration,
    /// Renewal attempts that failed (a database or pool error, a timeout):
    /// retried with back-off until the local deadline.
    pub renewal_failures: u64,
    /// Rows deleted by purges.
    pub purged: u64,
    /// Purge statements sent (marks and sweeps).
    pub purge_statements: u64,
    /// Purge rounds that deleted nothing because a session that held the
    /// lease table when the purge last looked still held it (see
    /// [`LeasesBuilder::purge`](super::LeasesBuilder::purge)).
    pub purges_waited: u64,
    /// Acquisitions waiting now to go to the server together, in the next
    /// statement (see [`Leases::acquire`](super::Leases::acquire),
    /// "Overlapping acquisitions").
    pub acquisitions_waiting: usize,
    /// Acquisitions sent in one statement with others, summed.
    pub gathered: u64,
    /// The statements that carried them.
    pub gathered_statements: u64,
    /// Take-overs of an expired lease that met a lock on its row and
    /// answered busy (see [`Leases::acquire`](super::Leases::acquire)).
    pub takeovers_blocked: u64,
}
