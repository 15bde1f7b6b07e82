//! Workload 3: the incident under load.
//!
//! Pool 8. Request traffic saturates the request lane (32 tasks, each
//! checking out a connection for a 10 ms query), four exclusive background
//! jobs run in a loop (take the job's lock or lease, then do the work under
//! it: four 50 ms queries, each on a connection asked from the pool, then
//! release and pause 100 ms), and a readiness probe fires every 100 ms
//! (`SELECT 1`, bounded by 1 s, the readiness bound). Three sides, rounds
//! interleaved, the order rotating (A B C, B C A, C A B, …):
//!
//! - A: raw deadpool, each job holding `pg_try_advisory_lock` on its own
//!   pooled connection while its work asks for another (the code of the incident);
//! - B: pgwarden, the same jobs on budgeted session locks
//!   (`session_lock` with no wait; the default budget of a pool of 8 is 2, so two
//!   jobs run and the others are refused and retry after the pause);
//! - C: pgwarden, the same jobs on table leases (`Leases::acquire`, one attempt).
//!
//! Each pgwarden side is compared with A as ratios over the rounds (the
//! n-th round of a side paired with A's n-th): readiness success, readiness
//! p99, request throughput, and jobs completed (runs that did their four
//! units of work within the round; skips and refusals are not jobs done).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgwarden::{Namespace, Pool};
use pgwarden_testing::TestServer;

use crate::ab::{all, median, percentile, Compared};
use crate::{BoxError, Row, Settings};

const POOL: usize = 8;
const REQUEST_TASKS: usize = 32;
const REQUEST_SQL: &str = "SELECT pg_sleep(0.01)";
const JOBS: [&str; 4] = ["cleanup", "alerts", "mail-checks", "uptime-node-a"];
const WORK_UNITS: usize = 4;
const WORK_SQL: &str = "SELECT pg_sleep(0.05)";
const JOB_PAUSE: Duration = Duration::from_millis(100);
const PROBE_EVERY: Duration = Duration::from_millis(100);
const PROBE_BOUND: Duration = Duration::from_secs(1);
/// Targets, pgwarden against raw deadpool: readiness success at least as
/// high, a readiness p99 at most half, request throughput and jobs
/// completed per second at least 0.95 times.
const READY_TARGET: f64 = 1.0;
const P99_TARGET: f64 = 0.5;
const REQUESTS_TARGET: f64 = 0.95;
const JOBS_TARGET: f64 = 0.95;
const JOBS_NS: Namespace = Namespace::new(1);

/// Rounds per side and the length of one round.
fn plan(s: Settings) -> (usize, Duration) {
    if s.smoke {
        (1, Duration::from_millis(1500))
    } else {
        // 5 × 6 s: 30 s and 300 probes per side.
        (5, Duration::from_secs(6))
    }
}

pub fn describe(s: Settings) -> String {
    let (rounds, round) = plan(s);
    format!(
        "3: pool {POOL}; {REQUEST_TASKS} request tasks looping `get` + `{REQUEST_SQL}`; \
         jobs {JOBS:?} looping: take the lock or lease, {WORK_UNITS} × (`get` + `{WORK_SQL}`), \
         release, pause {JOB_PAUSE:?} (also after a skip or refusal); readiness probe every \
         {PROBE_EVERY:?} (`SELECT 1`, pgwarden: `Pool::readiness`; bound {PROBE_BOUND:?}, a probe \
         past it counts as failed and as {PROBE_BOUND:?} in the p99); {rounds} round(s) of \
         {round:?} per side, interleaved raw, session locks, leases, the order rotating; pgwarden \
         pools with default limits (request max 7, session-lock budget 2, probe reserve 1); \
         jobs completed = runs that finished their work within the round; ratios over rounds \
         paired by index (each side's n-th round with raw's n-th); 3as, 3bs (feature `sqlx-0_8`, \
         `--only 3s`): the same on sqlx 0.8, raw `sqlx::PgPool` (`max_connections({POOL})`) with \
         the job's `pg_try_advisory_lock` on a pooled connection against `pgwarden::sqlx::Pool` \
         over another such pool, statements as `sqlx::query(…).execute(&pool)`"
    )
}

#[derive(Clone)]
enum Side {
    Raw(deadpool_postgres::Pool),
    Locks(Pool),
    /// The pool, and its one lease table.
    Leases(Pool, pgwarden::Leases),
    /// Rows 3as and 3bs: the same three sides on sqlx 0.8.
    #[cfg(feature = "sqlx-0_8")]
    SqlxRaw(sqlx08::PgPool),
    #[cfg(feature = "sqlx-0_8")]
    SqlxLocks(crate::warden_sqlx::Pool),
    #[cfg(feature = "sqlx-0_8")]
    SqlxLeases(crate::warden_sqlx::Pool, pgwarden::Leases<sqlx08::PgPool>),
}

/// One run of a job under a table lease, on either pool's leases.
macro_rules! lease_run {
    ($side:expr, $leases:expr, $job:expr) => {
        match $leases
            .acquire($job, &pgwarden::LeaseOptions::default(), None)
            .await?
        {
            Some(lease) => {
                let worked = $side.work().await;
                lease.release().await?;
                worked.map(|()| true)
            }
            None => Ok(false),
        }
    };
}

/// One run of a job on pgwarden's budgeted session locks, on either pool.
macro_rules! session_lock_run {
    ($side:expr, $pool:expr, $job:expr) => {
        match $pool
            .session_lock(JOBS_NS.named($job), pgwarden::LockMode::Exclusive, None)
            .await
        {
            Ok(Some(lock)) => {
                let worked = $side.work().await;
                lock.unlock().await?;
                worked.map(|()| true)
            }
            Ok(None) => Ok(false),
            Err(e) if e.is_budget_exhausted() => Ok(false),
            Err(e) => Err(e.into()),
        }
    };
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    runs: AtomicU64,
    skips: AtomicU64,
    errors: AtomicU64,
}

impl Side {
    async fn query(&self, sql: &str) -> Result<(), BoxError> {
        match self {
            Side::Raw(p) => {
                p.get().await?.simple_query(sql).await?;
            }
            Side::Locks(p) | Side::Leases(p, _) => {
                p.get().await?.simple_query(sql).await?;
            }
            #[cfg(feature = "sqlx-0_8")]
            Side::SqlxRaw(p) => {
                sqlx08::query(sql).execute(p).await?;
            }
            #[cfg(feature = "sqlx-0_8")]
            Side::SqlxLocks(p) | Side::SqlxLeases(p, _) => {
                sqlx08::query(sql).execute(p).await?;
            }
        }
        Ok(())
    }

    async fn work(&self) -> Result<(), BoxError> {
        for _ in 0..WORK_UNITS {
            self.query(WORK_SQL).await?;
        }
        Ok(())
    }

    /// One run of `job`: true when it ran, false when it skipped (held
    /// elsewhere, or refused by the session-lock budget).
    async fn job_run(&self, job: &str) -> Result<bool, BoxError> {
        match self {
            Side::Raw(p) => {
                let conn = p.get().await?;
                let got: bool = conn
                    .query_one("SELECT pg_try_advisory_lock(hashtext($1))", &[&job])
                    .await?
                    .get(0);
                if !got {
                    return Ok(false);
                }
                let worked = self.work().await;
                conn.query_one("SELECT pg_advisory_unlock(hashtext($1))", &[&job])
                    .await?;
                worked.map(|()| true)
            }
            Side::Locks(p) => session_lock_run!(self, p, job),
            Side::Leases(_, leases) => lease_run!(self, leases, job),
            #[cfg(feature = "sqlx-0_8")]
            Side::SqlxRaw(p) => {
                // The incident's code on sqlx: the lock on a pooled
                // connection kept while the work asks for others.
                let mut conn = p.acquire().await?;
                let got: bool = sqlx08::query_scalar("SELECT pg_try_advisory_lock(hashtext($1))")
                    .bind(job)
                    .fetch_one(&mut *conn)
                    .await?;
                if !got {
                    return Ok(false);
                }
                let worked = self.work().await;
                sqlx08::query("SELECT pg_advisory_unlock(hashtext($1))")
                    .bind(job)
                    .execute(&mut *conn)
                    .await?;
                worked.map(|()| true)
            }
            #[cfg(feature = "sqlx-0_8")]
            Side::SqlxLocks(p) => session_lock_run!(self, p, job),
            #[cfg(feature = "sqlx-0_8")]
            Side::SqlxLeases(_, leases) => lease_run!(self, leases, job),
        }
    }

    /// One readiness probe: its latency, or `None` when it failed or took
    /// longer than the bound.
    async fn probe(&self) -> Option<Duration> {
        let start = Instant::now();
        let ok = match self {
            Side::Raw(p) => tokio::time::timeout(PROBE_BOUND, async {
                p.get().await?.simple_query("SELECT 1").await?;
                Ok::<_, BoxError>(())
            })
            .await
            .is_ok_and(|r| r.is_ok()),
            Side::Locks(p) | Side::Leases(p, _) => p.readiness(PROBE_BOUND).await.is_ok(),
            #[cfg(feature = "sqlx-0_8")]
            Side::SqlxRaw(p) => tokio::time::timeout(PROBE_BOUND, async {
                let mut c = p.acquire().await?;
                sqlx08::query("SELECT 1").execute(&mut *c).await?;
                Ok::<_, BoxError>(())
            })
            .await
            .is_ok_and(|r| r.is_ok()),
            #[cfg(feature = "sqlx-0_8")]
            Side::SqlxLocks(p) | Side::SqlxLeases(p, _) => p.readiness(PROBE_BOUND).await.is_ok(),
        };
        let took = start.elapsed();
        (ok && took <= PROBE_BOUND).then_some(took)
    }
}

#[derive(Default)]
struct SideOut {
    /// Request throughput of each round, ops/s.
    rates: Vec<f64>,
    /// Jobs completed per second, readiness success share and readiness
    /// p99 (ms) of each round.
    jobs_rates: Vec<f64>,
    ready: Vec<f64>,
    p99s: Vec<f64>,
    runs: u64,
    skips: u64,
    errors: u64,
    secs: f64,
    probes: Vec<Option<Duration>>,
}

fn ready_share(probes: &[Option<Duration>]) -> f64 {
    probes.iter().filter(|p| p.is_some()).count() as f64 / probes.len().max(1) as f64
}

/// p99 latency in ms, a failed probe counted as the bound.
fn p99_ms(probes: &[Option<Duration>]) -> f64 {
    let v: Vec<f64> = probes
        .iter()
        .map(|p| p.unwrap_or(PROBE_BOUND).as_secs_f64() * 1e3)
        .collect();
    percentile(&v, 99.0)
}

impl SideOut {
    fn cell(&self, label: &str) -> String {
        let p99 = p99_ms(&self.probes);
        let p99 = if p99 >= PROBE_BOUND.as_secs_f64() * 1e3 {
            format!("≥ {} ms (failed probes)", PROBE_BOUND.as_millis())
        } else {
            format!("{p99:.1} ms")
        };
        format!(
            "{label}: readiness {:.1} % of {}, p99 {p99}; {:.0} req/s; {:.1} jobs completed/s",
            100.0 * ready_share(&self.probes),
            self.probes.len(),
            median(&self.rates),
            self.runs as f64 / self.secs
        )
    }

    fn jobs(&self) -> String {
        let mut s = format!(
            "{:.1} jobs completed/s, {:.1} skips or refusals/s",
            self.runs as f64 / self.secs,
            self.skips as f64 / self.secs
        );
        if self.errors > 0 {
            s.push_str(&format!(", {} errors", self.errors));
        }
        s
    }
}

async fn round(side: &Side, dur: Duration, out: &mut SideOut) {
    let c = Arc::new(Counters::default());
    let start = Instant::now();
    let deadline = start + dur;
    let mut tasks = Vec::new();
    for _ in 0..REQUEST_TASKS {
        let (side, c) = (side.clone(), c.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                match side.query(REQUEST_SQL).await {
                    Ok(()) if Instant::now() <= deadline => {
                        c.requests.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(()) => {}
                    Err(_) => {
                        c.errors.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
        }));
    }
    for job in JOBS {
        let (side, c) = (side.clone(), c.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                let counter = match side.job_run(job).await {
                    Ok(true) if Instant::now() <= deadline => &c.runs,
                    // Finished after the round: neither completed in it nor skipped.
                    Ok(true) => continue,
                    Ok(false) => &c.skips,
                    Err(_) => &c.errors,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(JOB_PAUSE).await;
            }
        }));
    }
    let mut probes = Vec::new();
    let mut tick = tokio::time::interval(PROBE_EVERY);
    loop {
        tick.tick().await;
        if Instant::now() >= deadline {
            break;
        }
        let side = side.clone();
        probes.push(tokio::spawn(async move { side.probe().await }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let mut these = Vec::new();
    for p in probes {
        these.push(p.await.ok().flatten());
    }
    out.ready.push(ready_share(&these));
    out.p99s.push(p99_ms(&these));
    out.probes.extend(these);
    let secs = dur.as_secs_f64();
    out.rates
        .push(c.requests.load(Ordering::Relaxed) as f64 / secs);
    out.jobs_rates
        .push(c.runs.load(Ordering::Relaxed) as f64 / secs);
    out.runs += c.runs.load(Ordering::Relaxed);
    out.skips += c.skips.load(Ordering::Relaxed);
    out.errors += c.errors.load(Ordering::Relaxed);
    out.secs += dur.as_secs_f64();
}

pub async fn incident(server: &TestServer, s: Settings) -> Result<Vec<Row>, BoxError> {
    let db = server.create_database().await?;
    let sides = [
        Side::Raw(db.deadpool(POOL)?),
        Side::Locks(
            Pool::builder(db.deadpool(POOL)?)
                .name("bench-incident-locks")
                .build()?,
        ),
        {
            let pool = Pool::builder(db.deadpool(POOL)?)
                .name("bench-incident-leases")
                .build()?;
            let leases = pgwarden::Leases::new(&pool);
            Side::Leases(pool, leases)
        },
    ];
    if let Side::Leases(_, leases) = &sides[2] {
        leases.install().await?;
    }
    compare(&sides, s, "raw deadpool", "", ["3a", "3b"]).await
}

/// Rows 3as and 3bs: the incident on sqlx 0.8, raw `sqlx::PgPool` with
/// the lock held on a pooled connection (A) against `pgwarden::sqlx::Pool`
/// with budgeted session locks and with table leases, each over a raw pool
/// of the same size.
#[cfg(feature = "sqlx-0_8")]
pub async fn incident_sqlx(server: &TestServer, s: Settings) -> Result<Vec<Row>, BoxError> {
    let db = server.create_database().await?;
    let raw = || {
        sqlx08::postgres::PgPoolOptions::new()
            .max_connections(POOL as u32)
            .connect_lazy_with(crate::sqlx_options(&db))
    };
    let warden = |name: &str| crate::warden_sqlx::Pool::builder(raw()).name(name).build();
    let leases_pool = warden("bench-incident-sqlx-leases")?;
    let leases = pgwarden::Leases::new(&leases_pool);
    leases.install().await?;
    let sides = [
        Side::SqlxRaw(raw()),
        Side::SqlxLocks(warden("bench-incident-sqlx-locks")?),
        Side::SqlxLeases(leases_pool, leases),
    ];
    compare(&sides, s, "raw sqlx", " on sqlx 0.8", ["3as", "3bs"]).await
}

/// Runs the three sides (raw first) interleaved and compares each
/// pgwarden side with the raw one.
async fn compare(
    sides: &[Side; 3],
    s: Settings,
    raw_label: &str,
    on: &str,
    ids: [&'static str; 2],
) -> Result<Vec<Row>, BoxError> {
    // Warm-up, not recorded: every side opens its connections.
    for side in sides {
        round(side, Duration::from_millis(300), &mut SideOut::default()).await;
    }
    let (rounds, dur) = plan(s);
    let mut outs: [SideOut; 3] = Default::default();
    for n in 0..rounds {
        for k in 0..sides.len() {
            let i = (n + k) % sides.len();
            round(&sides[i], dur, &mut outs[i]).await;
        }
    }
    let [raw, locks, leases] = &outs;
    let row = |id: &'static str, label: &str, b: &SideOut| {
        let ready = Compared::new(&raw.ready, &b.ready);
        let p99 = Compared::new(&raw.p99s, &b.p99s);
        let requests = Compared::new(&raw.rates, &b.rates);
        let jobs = Compared::new(&raw.jobs_rates, &b.jobs_rates);
        let verdict = all(&[
            ready.at_least(READY_TARGET),
            p99.at_most(P99_TARGET),
            requests.at_least(REQUESTS_TARGET),
            jobs.at_least(JOBS_TARGET),
        ]);
        Row {
            id,
            workload: format!(
                "incident under load{on}, pool {POOL}: raw session advisory locks vs pgwarden {label}"
            ),
            a: raw.cell(raw_label),
            b: b.cell(&format!("pgwarden {label}")),
            ratio: format!(
                "readiness {:.3}; p99 {:.3}; requests {:.3}; jobs completed {:.3}",
                ready.pairs, p99.pairs, requests.pairs, jobs.pairs
            ),
            target: "readiness ≥ 1.0; p99 ≤ 0.5; requests ≥ 0.95; jobs completed ≥ 0.95",
            met: (!s.smoke).then_some(verdict).flatten(),
            notes: format!(
                "jobs: raw {}; pgwarden {}; readiness: {}; p99: {}; requests: {}; jobs completed: {}",
                raw.jobs(),
                b.jobs(),
                ready.spread(),
                p99.spread(),
                requests.spread(),
                jobs.spread()
            ),
        }
    };
    Ok(vec![
        row(ids[0], "budgeted session locks", locks),
        row(ids[1], "table leases", leases),
    ])
}
