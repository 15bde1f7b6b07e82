//! The state one [`Leases`](super::Leases) instance shares with its
//! guards and its renewer ([`Inner`]), and the lost signal it fires. Its
//! other methods live with what they use: statements in `statement.rs`,
//! acquisitions in `acquire.rs`, releases in `release.rs`, renewal in
//! `renewer.rs` and `batch.rs`.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{Notify, OnceCell};

use super::metrics::LeaseMetrics;
use super::metrics::LeaseStats;
use super::options::{PurgeSettings, Settings};
use super::registry::Registry;
use super::table::Statements;
use super::table::TableName;
use super::term::LeaseState;
use crate::lost::LostReason;
use crate::pool::Pool;

pub(crate) struct Inner {
    pub(crate) pool: Pool,
    pub(crate) pool_name: Arc<str>,
    pub(crate) table: TableName,
    pub(crate) sql: Statements,
    pub(crate) auto_install: bool,
    pub(crate) installed: OnceCell<()>,
    pub(crate) statement_timeout: Duration,
    pub(crate) purge: PurgeSettings,
    pub(crate) registry: Mutex<Registry>,
    pub(crate) wake: Arc<Notify>,
    /// True while a renewer task exists; its task clears it when dropped
    /// (it ended, or its runtime is gone).
    pub(crate) renewer_alive: Arc<AtomicBool>,
    /// Set once the server refused a named prepared statement.
    pub(crate) unnamed_only: AtomicBool,
    pub(crate) detect_started: AtomicBool,
    /// Counts, updated under one lock so a snapshot is consistent.
    pub(crate) stats: Mutex<LeaseStats>,
    pub(crate) metrics: LeaseMetrics,
    /// When this instance was made: the origin of `blocked_logged`.
    pub(crate) created: Instant,
    /// When a blocked take-over was last logged (since `created`).
    pub(crate) blocked_logged: Mutex<Option<Duration>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Lets the renewer task see that its instance is gone, and end.
        self.wake.notify_one();
    }
}

impl Inner {
    pub(crate) fn new(pool: Pool, pool_name: &str, s: Settings) -> Inner {
        let metrics = LeaseMetrics::register(pool_name);
        for name in &s.declared {
            metrics.declare(name, name);
        }
        Inner {
            pool,
            pool_name: pool_name.into(),
            sql: Statements::new(&s.table, s.statement_timeout),
            table: s.table,
            auto_install: s.auto_install,
            installed: OnceCell::new(),
            statement_timeout: s.statement_timeout,
            purge: s.purge,
            registry: Mutex::new(Registry::default()),
            wake: Arc::new(Notify::new()),
            renewer_alive: Arc::new(AtomicBool::new(false)),
            unnamed_only: AtomicBool::new(false),
            detect_started: AtomicBool::new(false),
            stats: Mutex::new(LeaseStats::default()),
            metrics,
            created: Instant::now(),
            blocked_logged: Mutex::new(None),
        }
    }

    pub(crate) fn pool(&self) -> Pool {
        self.pool.clone()
    }

    pub(crate) fn count_statement(&self) {
        self.stats.lock().statements += 1;
    }
    /// Fires the lost signal of a lease: logged and counted once.
    pub(crate) fn mark_lost(&self, state: &LeaseState, reason: LostReason) {
        if !state.lose(reason) {
            return;
        }
        self.metrics.lost(&state.name, reason);
        tracing::warn!(
            pool = %self.pool_name,
            lease = %state.name,
            token = state.token,
            reason = reason.as_str(),
            "lease lost: {reason}; a job still running under it may overlap with the next holder"
        );
    }

    /// The lost reason of a lease, firing [`LostReason::Deadline`] first if
    /// its local deadline has passed.
    pub(crate) fn check_lost(&self, state: &LeaseState) -> Option<LostReason> {
        if let Some(r) = state.lost_reason() {
            return Some(r);
        }
        if state.past_deadline(Instant::now()) {
            self.mark_lost(state, LostReason::Deadline);
        }
        state.lost_reason()
    }
}
