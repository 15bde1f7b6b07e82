//! Every metric pgwarden records, and [`prometheus_builder`] (feature
//! `prometheus`).
//!
//! pgwarden records through the [`metrics`] facade only, so any recorder
//! works. Handles are registered when a [`crate::Pool`] is built: install your
//! recorder (for example with [`prometheus_builder`]) before building the
//! pool.
//!
//! Labels are bounded: `pool` (the pool's name), `lane`, `reason`, `result`,
//! `state`, `policy`, `statement`, and the lease or job names that the application
//! declares (every other lease name counts under one fixed value, `_other`).
//!
//! Histogram buckets (seconds): `pgwarden_hold_duration_seconds` uses
//! 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600; every
//! other `*_duration_seconds` uses 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
//! 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30.
//!
//! | name | kind | what it counts |
//! |---|---|---|
//! | `pgwarden_connections` | gauge | Connections by `state` (`idle`, `in_use`). |
//! | `pgwarden_connections_max` | gauge | The pool's maximum size. |
//! | `pgwarden_lane_in_use` | gauge | Connections in use per `lane`. |
//! | `pgwarden_lane_reserved` | gauge | Connections reserved per `lane`. |
//! | `pgwarden_lane_max` | gauge | Maximum connections per `lane`. |
//! | `pgwarden_lane_pending` | gauge | Checkouts waiting per `lane`. |
//! | `pgwarden_acquire_duration_seconds` | histogram | Time from asking for a connection to getting it, per `lane`. |
//! | `pgwarden_acquire_failures_total` | counter | Checkouts that failed, per `lane` and `reason` (`timeout`: the caller's bound ran out; `refused`: the budget said no; `backend`: deadpool could not give a connection, or had none for an admitted checkout; `closed`: the pool is closed). |
//! | `pgwarden_budget_overruns_total` | counter | Session-lock checkouts past the budget, per `policy` (`refuse`: refused, `warn`: admitted). |
//! | `pgwarden_hold_duration_seconds` | histogram | How long connections were held, per `lane`, recorded at return. |
//! | `pgwarden_oldest_hold_seconds` | gauge | Age of the oldest connection out, per `lane` (0 when none is out). |
//! | `pgwarden_long_holds_total` | counter | Holds that passed the long-hold threshold, per `lane`. |
//! | `pgwarden_session_locks_held` | gauge | Session advisory locks held through pgwarden's guards (re-entries count). |
//! | `pgwarden_session_lock_connections` | gauge | Connections pinned by session advisory locks. |
//! | `pgwarden_census_advisory_locks` | gauge | Advisory locks on this pool's backends, seen by the last census. |
//! | `pgwarden_census_idle_advisory_locks` | gauge | Advisory locks on connections idle in the pool, seen by the last census. |
//! | `pgwarden_census_leaks_total` | counter | Leaked advisory locks found on idle pooled connections (connections discarded). |
//! | `pgwarden_census_duration_seconds` | histogram | Time one census pass took (`pg_locks` read and matched). |
//! | `pgwarden_housekeeping_panics_total` | counter | Panics caught in the housekeeping or census task (the task goes on). |
//! | `pgwarden_readiness_duration_seconds` | histogram | Readiness probe latency. |
//! | `pgwarden_readiness_failures_total` | counter | Readiness probe failures, per `reason` (`timeout`, `error`). |
//! | `pgwarden_leases_held` | gauge | Leases held by this process. |
//! | `pgwarden_lease_acquired_total` | counter | Leases acquired, per `lease`. |
//! | `pgwarden_lease_skipped_total` | counter | Lease acquisitions skipped because another holder had it, per `lease`. |
//! | `pgwarden_lease_renewals_total` | counter | Lease renewals per `result` (`ok`, `lost`, `error`). |
//! | `pgwarden_lease_renewal_duration_seconds` | histogram | Latency of one (batched) renewal statement. |
//! | `pgwarden_lease_renew_interval_seconds` | gauge | The shortest renewal interval of the leases held (TTL/4 by default). |
//! | `pgwarden_lease_lost_total` | counter | Leases lost, per `lease` and `reason` (`taken`: a renewal touched no row; `deadline`: no renewal succeeded in time). |
//! | `pgwarden_lease_takeovers_total` | counter | Leases taken over from an expired holder, per `lease`. |
//! | `pgwarden_lease_renewer_panics_total` | counter | Panics caught in the lease renewer; renewal goes on. |
//! | `pgwarden_lease_job_panics_total` | counter | Scheduled job runs that panicked, per `lease` (the job's name: `job` is Prometheus's own label); the job runs again next period. |
//! | `pgwarden_lease_purged_total` | counter | Lease rows purged: released or expired for longer than the purge age. |
//! | `pgwarden_lease_statement_timeouts_total` | counter | Lease statements that did not finish in time and were cancelled on the server, per `statement` (`acquisition`, `busy check`, `renewal`, `release`, `purge`, `install`). |
//! | `pgwarden_requests_shed_total` | counter | Requests the load-shedding layer (`pgwarden::http::ShedLayer`, feature `http`) answered with 503 at once, per `reason` (`busy`: the wait the request lane's queue implies is over the bound; `closed`: the pool is closed). |
//! | `pgwarden_requests_admitted_total` | counter | Requests the load-shedding layer let through. |

use metrics::{
    describe_counter, describe_gauge, describe_histogram, Counter, Gauge, Histogram, Unit,
};

use crate::admission::Lane;

/// Connections by `state` (`idle`, `in_use`).
pub(crate) const CONNECTIONS: &str = "pgwarden_connections";
/// The pool's maximum size.
pub(crate) const CONNECTIONS_MAX: &str = "pgwarden_connections_max";
/// Connections in use per `lane`.
pub(crate) const LANE_IN_USE: &str = "pgwarden_lane_in_use";
/// Connections reserved per `lane`.
pub(crate) const LANE_RESERVED: &str = "pgwarden_lane_reserved";
/// Maximum connections per `lane`.
pub(crate) const LANE_MAX: &str = "pgwarden_lane_max";
/// Checkouts waiting per `lane`.
pub(crate) const LANE_PENDING: &str = "pgwarden_lane_pending";
/// Time from asking for a connection to getting it, per `lane`.
pub(crate) const ACQUIRE_DURATION: &str = "pgwarden_acquire_duration_seconds";
/// Checkouts that failed, per `lane` and `reason` (`timeout`: the caller's
/// bound ran out; `refused`: the budget said no; `backend`: deadpool could
/// not give a connection, or had none for an admitted checkout; `closed`:
/// the pool is closed).
pub(crate) const ACQUIRE_FAILURES: &str = "pgwarden_acquire_failures_total";
/// Session-lock checkouts past the budget, per `policy` (`refuse`: refused, `warn`: admitted).
pub(crate) const BUDGET_OVERRUNS: &str = "pgwarden_budget_overruns_total";
/// How long connections were held, per `lane`, recorded at return.
pub(crate) const HOLD_DURATION: &str = "pgwarden_hold_duration_seconds";
/// Age of the oldest connection out, per `lane` (0 when none is out).
pub(crate) const OLDEST_HOLD: &str = "pgwarden_oldest_hold_seconds";
/// Holds that passed the long-hold threshold, per `lane`.
pub(crate) const LONG_HOLDS: &str = "pgwarden_long_holds_total";
/// Session advisory locks held through pgwarden's guards (re-entries count).
pub(crate) const SESSION_LOCKS_HELD: &str = "pgwarden_session_locks_held";
/// Connections pinned by session advisory locks.
pub(crate) const SESSION_LOCK_CONNECTIONS: &str = "pgwarden_session_lock_connections";
/// Advisory locks on this pool's backends, seen by the last census.
pub(crate) const CENSUS_LOCKS: &str = "pgwarden_census_advisory_locks";
/// Advisory locks on connections idle in the pool, seen by the last census.
pub(crate) const CENSUS_IDLE_LOCKS: &str = "pgwarden_census_idle_advisory_locks";
/// Leaked advisory locks found on idle pooled connections (connections discarded).
pub(crate) const CENSUS_LEAKS: &str = "pgwarden_census_leaks_total";
/// Time one census pass took (`pg_locks` read and matched).
pub(crate) const CENSUS_DURATION: &str = "pgwarden_census_duration_seconds";
/// Panics caught in the housekeeping or census task (the task goes on).
pub(crate) const HOUSEKEEPING_PANICS: &str = "pgwarden_housekeeping_panics_total";
/// Readiness probe latency.
pub(crate) const READINESS_DURATION: &str = "pgwarden_readiness_duration_seconds";
/// Readiness probe failures, per `reason` (`timeout`, `error`).
pub(crate) const READINESS_FAILURES: &str = "pgwarden_readiness_failures_total";
/// Leases held by this process.
pub(crate) const LEASES_HELD: &str = "pgwarden_leases_held";
/// Leases acquired, per `lease`.
pub(crate) const LEASE_ACQUIRED: &str = "pgwarden_lease_acquired_total";
/// Lease acquisitions skipped because another holder had it, per `lease`.
pub(crate) const LEASE_SKIPPED: &str = "pgwarden_lease_skipped_total";
/// Lease renewals per `result` (`ok`, `lost`, `error`).
pub(crate) const LEASE_RENEWALS: &str = "pgwarden_lease_renewals_total";
/// Latency of one (batched) renewal statement.
pub(crate) const LEASE_RENEWAL_DURATION: &str = "pgwarden_lease_renewal_duration_seconds";
/// The shortest renewal interval of the leases held (TTL/4 by default).
pub(crate) const LEASE_RENEW_INTERVAL: &str = "pgwarden_lease_renew_interval_seconds";
/// Leases lost, per `lease` and `reason` (`taken`: a renewal touched no row; `deadline`: no renewal succeeded in time).
pub(crate) const LEASE_LOST: &str = "pgwarden_lease_lost_total";
/// Leases taken over from an expired holder, per `lease`.
pub(crate) const LEASE_TAKEOVERS: &str = "pgwarden_lease_takeovers_total";
/// Take-overs of an expired lease that met a lock on its row (a fenced
/// transaction of the expired term, or another session holding the row) and
/// answered busy, per `lease`.
pub(crate) const LEASE_TAKEOVERS_BLOCKED: &str = "pgwarden_lease_takeovers_blocked_total";
/// Panics caught in the lease renewer; renewal goes on.
pub(crate) const LEASE_RENEWER_PANICS: &str = "pgwarden_lease_renewer_panics_total";
/// Scheduled job runs that panicked, per `lease` (the job's name: `job` is
/// Prometheus's own label); the job runs again next period.
pub(crate) const LEASE_JOB_PANICS: &str = "pgwarden_lease_job_panics_total";
/// Lease rows purged: released or expired for longer than the purge age.
pub(crate) const LEASE_PURGED: &str = "pgwarden_lease_purged_total";
/// Lease statements that did not finish in time and were cancelled on the
/// server, per `statement` (`acquisition`, `busy check`, `renewal`, `release`, `purge`, `install`).
pub(crate) const LEASE_STATEMENT_TIMEOUTS: &str = "pgwarden_lease_statement_timeouts_total";
/// Requests the load-shedding layer (`pgwarden::http::ShedLayer`, feature
/// `http`) answered with 503 at once, per `reason` (`busy`: the wait the
/// request lane's queue implies is over the bound; `closed`: the pool is
/// closed).
pub(crate) const REQUESTS_SHED: &str = "pgwarden_requests_shed_total";
/// Requests the load-shedding layer let through.
pub(crate) const REQUESTS_ADMITTED: &str = "pgwarden_requests_admitted_total";

/// Bucket bounds (seconds) for acquire, hold, readiness and renewal latencies.
pub(crate) const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0,
];
/// Bucket bounds (seconds) for hold durations, which run longer.
pub(crate) const HOLD_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];

/// Describes every metric once (idempotent; called by `Pool` builds).
pub(crate) fn describe() {
    describe_gauge!(
        CONNECTIONS,
        Unit::Count,
        "Connections by state (idle, in_use)."
    );
    describe_gauge!(CONNECTIONS_MAX, Unit::Count, "The pool's maximum size.");
    describe_gauge!(LANE_IN_USE, Unit::Count, "Connections in use per lane.");
    describe_gauge!(LANE_RESERVED, Unit::Count, "Connections reserved per lane.");
    describe_gauge!(LANE_MAX, Unit::Count, "Maximum connections per lane.");
    describe_gauge!(LANE_PENDING, Unit::Count, "Checkouts waiting per lane.");
    describe_histogram!(
        ACQUIRE_DURATION,
        Unit::Seconds,
        "Time to get a connection, per lane."
    );
    describe_counter!(
        ACQUIRE_FAILURES,
        Unit::Count,
        "Failed checkouts per lane and reason."
    );
    describe_counter!(
        BUDGET_OVERRUNS,
        Unit::Count,
        "Session-lock checkouts past the budget, per policy."
    );
    describe_histogram!(
        HOLD_DURATION,
        Unit::Seconds,
        "How long connections were held, per lane."
    );
    describe_gauge!(
        OLDEST_HOLD,
        Unit::Seconds,
        "Age of the oldest connection out, per lane."
    );
    describe_counter!(
        LONG_HOLDS,
        Unit::Count,
        "Holds past the long-hold threshold, per lane."
    );
    describe_gauge!(
        SESSION_LOCKS_HELD,
        Unit::Count,
        "Session advisory locks held through pgwarden."
    );
    describe_gauge!(
        SESSION_LOCK_CONNECTIONS,
        Unit::Count,
        "Connections pinned by session advisory locks."
    );
    describe_gauge!(
        CENSUS_LOCKS,
        Unit::Count,
        "Advisory locks on this pool's backends (last census)."
    );
    describe_gauge!(
        CENSUS_IDLE_LOCKS,
        Unit::Count,
        "Advisory locks on idle pooled connections (last census)."
    );
    describe_counter!(
        CENSUS_LEAKS,
        Unit::Count,
        "Leaked advisory locks found on idle pooled connections."
    );
    describe_histogram!(CENSUS_DURATION, Unit::Seconds, "Time one census pass took.");
    describe_counter!(
        HOUSEKEEPING_PANICS,
        Unit::Count,
        "Panics caught in the housekeeping or census task."
    );
    describe_histogram!(
        READINESS_DURATION,
        Unit::Seconds,
        "Readiness probe latency."
    );
    describe_counter!(
        READINESS_FAILURES,
        Unit::Count,
        "Readiness probe failures per reason."
    );
    describe_gauge!(LEASES_HELD, Unit::Count, "Leases held by this process.");
    describe_counter!(LEASE_ACQUIRED, Unit::Count, "Leases acquired per lease.");
    describe_counter!(
        LEASE_SKIPPED,
        Unit::Count,
        "Lease acquisitions skipped (held elsewhere) per lease."
    );
    describe_counter!(LEASE_RENEWALS, Unit::Count, "Lease renewals per result.");
    describe_histogram!(
        LEASE_RENEWAL_DURATION,
        Unit::Seconds,
        "Latency of one batched renewal statement."
    );
    describe_gauge!(
        LEASE_RENEW_INTERVAL,
        Unit::Seconds,
        "Shortest renewal interval of the leases held."
    );
    describe_counter!(LEASE_LOST, Unit::Count, "Leases lost per lease and reason.");
    describe_counter!(
        REQUESTS_SHED,
        Unit::Count,
        "Requests shed (503 at once) by the load-shedding layer, per reason."
    );
    describe_counter!(
        REQUESTS_ADMITTED,
        Unit::Count,
        "Requests the load-shedding layer let through."
    );
    describe_counter!(
        LEASE_TAKEOVERS,
        Unit::Count,
        "Leases taken over from an expired holder."
    );
    describe_counter!(
        LEASE_TAKEOVERS_BLOCKED,
        Unit::Count,
        "Take-overs of an expired lease blocked by a lock on its row (answered busy), per lease."
    );
    describe_counter!(
        LEASE_RENEWER_PANICS,
        Unit::Count,
        "Panics caught in the lease renewer (renewal goes on)."
    );
    describe_counter!(
        LEASE_JOB_PANICS,
        Unit::Count,
        "Scheduled job runs that panicked, per job (lease label)."
    );
    describe_counter!(LEASE_PURGED, Unit::Count, "Lease rows purged.");
    describe_counter!(
        LEASE_STATEMENT_TIMEOUTS,
        Unit::Count,
        "Lease statements timed out and cancelled on the server, per statement."
    );
}

/// Handles of one lane, registered once per pool.
#[derive(Clone, Debug)]
pub(crate) struct LaneMetrics {
    pub(crate) in_use: Gauge,
    pub(crate) pending: Gauge,
    pub(crate) acquire: Histogram,
    pub(crate) hold: Histogram,
    pub(crate) oldest: Gauge,
    pub(crate) long_holds: Counter,
    pub(crate) fail_timeout: Counter,
    pub(crate) fail_refused: Counter,
    pub(crate) fail_backend: Counter,
    pub(crate) fail_closed: Counter,
}

/// Handles of one pool, registered once at build.
#[derive(Clone, Debug)]
pub(crate) struct PoolMetrics {
    pub(crate) lanes: [LaneMetrics; Lane::COUNT],
    pub(crate) idle: Gauge,
    pub(crate) in_use: Gauge,
    pub(crate) overrun_refuse: Counter,
    pub(crate) overrun_warn: Counter,
    pub(crate) session_locks_held: Gauge,
    pub(crate) session_lock_connections: Gauge,
    pub(crate) census_locks: Gauge,
    pub(crate) census_idle_locks: Gauge,
    pub(crate) census_leaks: Counter,
    pub(crate) census_duration: Histogram,
    pub(crate) housekeeping_panics: Counter,
    pub(crate) readiness: Histogram,
    pub(crate) readiness_timeout: Counter,
    pub(crate) readiness_error: Counter,
}

impl PoolMetrics {
    pub(crate) fn register(pool: &str, limits: &crate::admission::Limits) -> PoolMetrics {
        describe();
        let p = pool.to_owned();
        let lane = |lane: Lane| {
            let l = lane.as_str();
            let fail = |reason: &'static str| metrics::counter!(ACQUIRE_FAILURES, "pool" => p.clone(), "lane" => l, "reason" => reason);
            let lim = limits.lane(lane);
            metrics::gauge!(LANE_RESERVED, "pool" => p.clone(), "lane" => l)
                .set(lim.reserved as f64);
            metrics::gauge!(LANE_MAX, "pool" => p.clone(), "lane" => l).set(lim.max as f64);
            LaneMetrics {
                in_use: metrics::gauge!(LANE_IN_USE, "pool" => p.clone(), "lane" => l),
                pending: metrics::gauge!(LANE_PENDING, "pool" => p.clone(), "lane" => l),
                acquire: metrics::histogram!(ACQUIRE_DURATION, "pool" => p.clone(), "lane" => l),
                hold: metrics::histogram!(HOLD_DURATION, "pool" => p.clone(), "lane" => l),
                oldest: metrics::gauge!(OLDEST_HOLD, "pool" => p.clone(), "lane" => l),
                long_holds: metrics::counter!(LONG_HOLDS, "pool" => p.clone(), "lane" => l),
                fail_timeout: fail("timeout"),
                fail_refused: fail("refused"),
                fail_backend: fail("backend"),
                fail_closed: fail("closed"),
            }
        };
        let lanes = Lane::ALL.map(lane);
        metrics::gauge!(CONNECTIONS_MAX, "pool" => p.clone()).set(limits.size() as f64);
        PoolMetrics {
            lanes,
            idle: metrics::gauge!(CONNECTIONS, "pool" => p.clone(), "state" => "idle"),
            in_use: metrics::gauge!(CONNECTIONS, "pool" => p.clone(), "state" => "in_use"),
            overrun_refuse: metrics::counter!(BUDGET_OVERRUNS, "pool" => p.clone(), "lane" => Lane::SessionLock.as_str(), "policy" => "refuse"),
            overrun_warn: metrics::counter!(BUDGET_OVERRUNS, "pool" => p.clone(), "lane" => Lane::SessionLock.as_str(), "policy" => "warn"),
            session_locks_held: metrics::gauge!(SESSION_LOCKS_HELD, "pool" => p.clone()),
            session_lock_connections: metrics::gauge!(SESSION_LOCK_CONNECTIONS, "pool" => p.clone()),
            census_locks: metrics::gauge!(CENSUS_LOCKS, "pool" => p.clone()),
            census_idle_locks: metrics::gauge!(CENSUS_IDLE_LOCKS, "pool" => p.clone()),
            census_leaks: metrics::counter!(CENSUS_LEAKS, "pool" => p.clone()),
            census_duration: metrics::histogram!(CENSUS_DURATION, "pool" => p.clone()),
            housekeeping_panics: metrics::counter!(HOUSEKEEPING_PANICS, "pool" => p.clone()),
            readiness: metrics::histogram!(READINESS_DURATION, "pool" => p.clone()),
            readiness_timeout: metrics::counter!(READINESS_FAILURES, "pool" => p.clone(), "reason" => "timeout"),
            readiness_error: metrics::counter!(READINESS_FAILURES, "pool" => p, "reason" => "error"),
        }
    }

    pub(crate) fn lane(&self, lane: Lane) -> &LaneMetrics {
        &self.lanes[lane.idx()]
    }
}

/// A `PrometheusBuilder` with pgwarden's histogram buckets set (without them
/// the exporter renders summaries, which `histogram_quantile` cannot use).
/// Add your own settings (an HTTP listener, global labels), install it, and
/// serve the handle's `render()` on your `/metrics` route; do it before
/// building pools.
///
/// ```no_run
/// # fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let handle = pgwarden::metrics::prometheus_builder()?.install_recorder()?;
/// let exposition: String = handle.render(); // the /metrics body
/// # Ok(()) }
/// ```
#[cfg(feature = "prometheus")]
pub fn prometheus_builder(
) -> Result<metrics_exporter_prometheus::PrometheusBuilder, metrics_exporter_prometheus::BuildError>
{
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(HOLD_DURATION.into()), HOLD_BUCKETS)?
        .set_buckets_for_metric(Matcher::Suffix("_duration_seconds".into()), LATENCY_BUCKETS)
}
