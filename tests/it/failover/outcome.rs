//! What the failover scenario ([`super::scenario`]) saw, and its one run
//! per test binary and backend.

use std::collections::BTreeSet;
use std::sync::OnceLock;
use std::time::Duration;

use pgwarden::LostReason;
use pgwarden_testing::Replication;

use super::common::{Row, WriteError};
use super::together::{self, every_backend, Results};
use crate::support::backend::Backend;

/// What the scenario saw. Instants are turned into durations from the crash
/// or the promotion.
#[derive(Debug)]
pub struct Outcome {
    pub old_port: u16,
    pub new_port: u16,
    /// `pg_promote` until `pg_is_in_recovery()` answered false.
    pub promote_took: Duration,
    /// Crash (stop issued) until the promotion completed.
    pub outage: Duration,
    /// From the promotion call to the first request served by the new
    /// primary (the harness sees the promotion complete by polling
    /// `pg_is_in_recovery()`, so the pool may be served before it returns).
    pub served_after_promote_call: Option<Duration>,
    /// Ports that served requests before the crash, and after the promotion.
    pub ports_before: BTreeSet<u16>,
    pub ports_after: BTreeSet<u16>,
    pub requests_ok: usize,
    pub requests_failed: usize,
    /// Lease rows (name, holder, token) on the old primary just before the
    /// crash, and on the new one as soon as it was promoted.
    pub rows_before: Vec<(String, String, i64)>,
    pub rows_at_promotion: Vec<(String, String, i64)>,
    /// The long lease (TTL 60 s, renewed every 250 ms): holder and token.
    pub long: (String, i64),
    pub long_lost: Option<LostReason>,
    /// When renewals were seen to move its `expires_at` on the new primary,
    /// after the promotion.
    pub long_renewed_after_promotion: Option<Duration>,
    pub long_fenced_write_after: Result<Row, WriteError>,
    pub long_release: Result<(), String>,
    /// The short lease (TTL 2 s): holder, token, lost signal, when it fired.
    pub short: (String, i64),
    pub short_lost: Option<LostReason>,
    pub short_lost_after_crash: Option<Duration>,
    /// The short lease's local deadline (where `lost()` fires) past the
    /// moment the primary was down.
    pub short_deadline_past_stop: Duration,
    /// Its take-over by the other instance on the new primary: token and
    /// the holder it took over from.
    pub short_takeover: Option<(i64, Option<String>)>,
    /// The sequence on the old primary before the crash and on the replica
    /// just before the promotion: (last_value, log_cnt); its cache size.
    pub seq_primary_before_crash: (i64, i64),
    pub seq_replica_before_promotion: (i64, i64),
    pub seq_cache: i64,
    /// Tokens received before the promotion call, and after it. The old
    /// primary was gone by then (its stop returned, and the short lease's
    /// deadline passed since), so every token of the second group was drawn
    /// on the new primary.
    pub tokens_before: Vec<i64>,
    pub tokens_after: Vec<i64>,
    pub job_runs_after: usize,
    /// Every fenced row on the new primary, in commit order, and the writes
    /// acknowledged before the crash / after the promotion.
    pub fenced: Vec<Row>,
    pub acked_before_crash: Vec<Row>,
    pub acked_after_promotion: Vec<Row>,
    /// The session lock: advisory locks on the new primary with its key,
    /// whether another session could take it there, what `unlock()` said,
    /// and whether its lane emptied.
    pub lock_rows_on_new_primary: i64,
    pub lock_free_on_new_primary: bool,
    pub unlock: Result<(), String>,
    pub unlock_was_closed_connection: bool,
    pub session_lane_emptied: bool,
}

/// The outcome of the scenario on backend `B`: every backend's run goes at
/// once on one cluster, started by the first test that asks (the others
/// wait for it).
pub fn outcome<B: Backend>() -> &'static Outcome {
    static RUNS: OnceLock<Results<Outcome>> = OnceLock::new();
    let all = together::results(&RUNS, Replication::Synchronous, || {
        every_backend!("scenario", super::scenario::run)
    });
    together::result(all, &format!("scenario::{}", B::NAME))
}
