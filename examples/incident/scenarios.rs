//! The incident, scenario by scenario: shared by `examples/incident`
//! and `tests/it/incident.rs`.

use std::fmt;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use pgwarden::{BudgetPolicy, Namespace};
use pgwarden_testing::TestDb;

/// The application's lock namespace for its background jobs, declared once.
pub const JOBS_NS: Namespace = Namespace::new(1);

/// Four background jobs of a typical service: three cluster-wide, one per node.
pub const JOBS: [&str; 4] = ["cleanup", "alerts", "mail-checks", "uptime-node-a"];
/// The pool size of the instance that left rotation.
pub const POOL_SIZE: usize = 4;
/// The readiness probe's bound.
pub const PROBE_BOUND: Duration = Duration::from_secs(1);
/// How many readiness probes each scenario runs while the locks are held.
pub const PROBES: usize = 5;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What one scenario did.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub scenario: String,
    /// Jobs that got their lock (or lease).
    pub granted: usize,
    /// Jobs refused with a typed error.
    pub refused: usize,
    /// Readiness probes that answered within the bound.
    pub probes_ok: usize,
    pub probes: usize,
    /// The slowest probe (a failed probe counts as its bound).
    pub worst_probe: Duration,
    /// Jobs whose work (a query on a request connection) completed.
    pub work_done: usize,
    /// Pool waiters seen while the work asked for connections.
    pub waiting_seen: usize,
    /// Connections checked out between statements, once the jobs held their locks or leases.
    pub held_between_statements: usize,
}

impl Outcome {
    fn new(scenario: impl Into<String>) -> Outcome {
        Outcome {
            scenario: scenario.into(),
            granted: 0,
            refused: 0,
            probes_ok: 0,
            probes: 0,
            worst_probe: Duration::ZERO,
            work_done: 0,
            waiting_seen: 0,
            held_between_statements: 0,
        }
    }
}

/// The side-by-side table.
pub struct Table<'a>(pub &'a [Outcome]);

impl fmt::Display for Table<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "| scenario | locks or leases granted | refused | readiness probes ok ({:?} bound) | slowest probe | work completed | conns held between statements |",
            PROBE_BOUND
        )?;
        writeln!(f, "|---|---|---|---|---|---|---|")?;
        for o in self.0 {
            let work = if o.waiting_seen > 0 {
                format!(
                    "{} of {} (pool waiting: {})",
                    o.work_done, o.granted, o.waiting_seen
                )
            } else {
                format!("{} of {}", o.work_done, o.granted)
            };
            writeln!(
                f,
                "| {} | {} of {} | {} | {}/{} ok | {:.1?} | {} | {} |",
                o.scenario,
                o.granted,
                JOBS.len(),
                o.refused,
                o.probes_ok,
                o.probes,
                o.worst_probe,
                work,
                o.held_between_statements
            )?;
        }
        Ok(())
    }
}

/// Raw deadpool, max size 4: each job takes `pg_try_advisory_lock` and keeps
/// its connection, as a hand-written "try exclusive" helper does.
pub async fn raw_deadpool(db: &TestDb) -> Result<Outcome, BoxError> {
    let pool = db.deadpool(POOL_SIZE)?;
    let mut out = Outcome::new(format!("raw deadpool, pool {POOL_SIZE}"));
    let attempts = join_all(JOBS.map(|job| {
        let pool = pool.clone();
        async move {
            let conn = tokio::time::timeout(PROBE_BOUND, pool.get()).await??;
            let ok: bool = conn
                .query_one("SELECT pg_try_advisory_lock(hashtext($1))", &[&job])
                .await?
                .get(0);
            Ok::<_, BoxError>((job, conn, ok))
        }
    }))
    .await;
    let mut holders = Vec::new();
    for a in attempts {
        let (job, conn, ok) = a?;
        if ok {
            out.granted += 1;
        }
        holders.push((job, conn));
    }
    out.held_between_statements = pool.status().size - pool.status().available;
    // The readiness probe: SELECT 1 within 1 s.
    for _ in 0..PROBES.min(2) {
        let start = Instant::now();
        let probe = tokio::time::timeout(PROBE_BOUND, async {
            let c = pool.get().await?;
            c.simple_query("SELECT 1").await?;
            Ok::<_, BoxError>(())
        })
        .await;
        out.probes += 1;
        if matches!(probe, Ok(Ok(()))) {
            out.probes_ok += 1;
        }
        out.worst_probe = out.worst_probe.max(start.elapsed());
    }
    // The work under each lock asks the pool for a connection, bounded.
    let work = join_all(holders.iter().map(|_| {
        let pool = pool.clone();
        async move {
            let c = tokio::time::timeout(PROBE_BOUND, pool.get())
                .await
                .ok()?
                .ok()?;
            c.simple_query("SELECT count(*) FROM pg_class").await.ok()
        }
    }));
    let watch = async {
        let deadline = Instant::now() + PROBE_BOUND;
        let mut seen = 0;
        while Instant::now() < deadline {
            seen = seen.max(pool.status().waiting);
            if seen >= holders.len() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        seen
    };
    let (done, seen) = tokio::join!(work, watch);
    out.work_done = done.iter().filter(|d| d.is_some()).count();
    out.waiting_seen = seen;
    for (job, conn) in holders {
        conn.query_one("SELECT pg_advisory_unlock(hashtext($1))", &[&job])
            .await?;
    }
    Ok(out)
}

/// The pgwarden scenarios, one source for every backend: each backend's
/// module gives `Pool`, `builder(db)` (a pool builder of `POOL_SIZE` over
/// its own pool), `work(&pool)` (a request connection within 5 s and a
/// query on it), `LABEL` and `SUFFIX`.
macro_rules! pgwarden_scenarios {
    () => {
        /// pgwarden, pool of 4, the same four jobs with the same intent: each takes a
        /// budgeted session lock (`session_lock` with no wait), which checks out its
        /// connection on the session-lock lane.
        pub async fn pgwarden_session_locks(
            db: &TestDb,
            policy: BudgetPolicy,
        ) -> Result<Outcome, BoxError> {
            let pool = builder(db)?
                .name(format!("incident-{policy}{SUFFIX}"))
                .policy(policy)
                .build()?;
            let mut out = Outcome::new(format!(
                "pgwarden{LABEL} session locks, policy {policy}, pool {POOL_SIZE}"
            ));
            let attempts = join_all(JOBS.map(|job| {
                let pool = pool.clone();
                async move {
                    pool.session_lock(JOBS_NS.named(job), pgwarden::LockMode::Exclusive, None)
                        .await
                }
            }))
            .await;
            let mut holders = Vec::new();
            for a in attempts {
                match a {
                    Ok(Some(lock)) => {
                        out.granted += 1;
                        holders.push(lock);
                    }
                    Ok(None) => return Err("lock held by another session".into()),
                    Err(e) if e.is_budget_exhausted() => out.refused += 1,
                    Err(e) => return Err(e.into()),
                }
            }
            out.held_between_statements = pool.status().in_use;
            probe_and_work(&pool, holders.len(), &mut out).await;
            for lock in holders {
                // Unlocks on the connection that holds it; a refused unlock is an error.
                lock.unlock().await?;
            }
            Ok(out)
        }

        /// pgwarden, pool of 4, the same four jobs on table leases (one attempt
        /// each with `Leases::acquire`, "run this on one instance only" answered by a
        /// lease): no connection is held between statements.
        pub async fn pgwarden_leases(db: &TestDb) -> Result<Outcome, BoxError> {
            let pool = builder(db)?
                .name(format!("incident-leases{SUFFIX}"))
                .build()?;
            let mut out = Outcome::new(format!("pgwarden{LABEL} table leases, pool {POOL_SIZE}"));
            // At start-up, as a service does: otherwise the leases' first use runs
            // the detection in the background, on a control connection that can
            // still be out when the connections are counted below.
            pool.detect_pooler().await?;
            let leases = pgwarden::Leases::new(&pool);
            let opts = pgwarden::LeaseOptions::default();
            let attempts = join_all(JOBS.map(|job| leases.acquire(job, &opts, None))).await;
            let mut held = Vec::new();
            for a in attempts {
                match a? {
                    Some(lease) => {
                        out.granted += 1;
                        held.push(lease);
                    }
                    None => out.refused += 1,
                }
            }
            // Between statements: leases pin nothing. (A sqlx return runs in
            // a task of its own: the last statement's connection may still
            // be on its way back for a moment; at most 2 s.)
            let until = Instant::now() + 2 * PROBE_BOUND;
            while pool.status().in_use > 0 && Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            out.held_between_statements = pool.status().in_use;
            probe_and_work(&pool, held.len(), &mut out).await;
            for lease in held {
                lease.release().await?;
            }
            Ok(out)
        }

        /// While the jobs hold their locks or leases: the readiness probe, `PROBES`
        /// times, then each holder's work on a request connection.
        async fn probe_and_work(pool: &Pool, holders: usize, out: &mut Outcome) {
            for _ in 0..PROBES {
                out.probes += 1;
                match pool.readiness(PROBE_BOUND).await {
                    Ok(took) => {
                        out.probes_ok += 1;
                        out.worst_probe = out.worst_probe.max(took);
                    }
                    Err(_) => out.worst_probe = out.worst_probe.max(PROBE_BOUND),
                }
            }
            let work = join_all((0..holders).map(|_| work(pool))).await;
            out.work_done = work.iter().filter(|d| d.is_some()).count();
        }
    };
}

/// The deadpool side (the README's incident).
mod on_deadpool {
    use super::*;
    use pgwarden::Pool;

    const LABEL: &str = "";
    const SUFFIX: &str = "";

    fn builder(db: &TestDb) -> Result<pgwarden::PoolBuilder, BoxError> {
        Ok(Pool::builder(db.deadpool(POOL_SIZE)?))
    }

    async fn work(pool: &Pool) -> Option<()> {
        let c = tokio::time::timeout(5 * PROBE_BOUND, pool.get())
            .await
            .ok()?
            .ok()?;
        c.simple_query("SELECT count(*) FROM pg_class").await.ok()?;
        Some(())
    }

    pgwarden_scenarios!();
}
pub use on_deadpool::{pgwarden_leases, pgwarden_session_locks};

/// The same incident on sqlx (features `sqlx-0_8` / `sqlx-0_9`; the 0.9
/// one when both are on): raw `sqlx::PgPool` with sqlx's own
/// `PgAdvisoryLock`, then pgwarden's sqlx pool, from the same source as the
/// deadpool side.
#[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
pub mod on_sqlx {
    use super::*;
    #[cfg(all(feature = "sqlx-0_8", not(feature = "sqlx-0_9")))]
    use sqlx08 as sqlx;
    #[cfg(feature = "sqlx-0_9")]
    use sqlx09 as sqlx;

    use pgwarden::sqlx::Pool;
    use sqlx::postgres::{PgAdvisoryLock, PgConnectOptions, PgPoolOptions};

    const LABEL: &str = " (sqlx)";
    const SUFFIX: &str = "-sqlx";

    /// `db` as sqlx options.
    fn options(db: &TestDb) -> PgConnectOptions {
        let cfg = db.pg_config();
        let mut o = PgConnectOptions::new_without_pgpass()
            .port(cfg.get_ports().first().copied().unwrap_or(5432))
            .username(cfg.get_user().unwrap_or("postgres"))
            .database(cfg.get_dbname().unwrap_or("postgres"));
        match cfg.get_hosts().first() {
            Some(tokio_postgres::config::Host::Unix(p)) => o = o.socket(p),
            Some(tokio_postgres::config::Host::Tcp(h)) => o = o.host(h),
            None => {}
        }
        o
    }

    /// A raw sqlx pool of `POOL_SIZE` on `db`.
    fn raw_pool(db: &TestDb) -> sqlx::PgPool {
        PgPoolOptions::new()
            .max_connections(POOL_SIZE as u32)
            .connect_lazy_with(options(db))
    }

    fn builder(db: &TestDb) -> Result<pgwarden::PoolBuilder<sqlx::PgPool>, BoxError> {
        Ok(Pool::builder(raw_pool(db)))
    }

    async fn work(pool: &Pool) -> Option<()> {
        let mut c = tokio::time::timeout(5 * PROBE_BOUND, pool.acquire())
            .await
            .ok()?
            .ok()?;
        sqlx::query("SELECT count(*) FROM pg_class")
            .fetch_one(&mut *c)
            .await
            .ok()?;
        Some(())
    }

    pgwarden_scenarios!();

    /// Raw sqlx, max 4 connections: each job takes sqlx's own
    /// `PgAdvisoryLock` with `try_acquire`, which keeps its connection for as
    /// long as the lock is held.
    pub async fn raw_sqlx(db: &TestDb) -> Result<Outcome, BoxError> {
        let pool = raw_pool(db);
        let mut out = Outcome::new(format!("raw sqlx PgAdvisoryLock, pool {POOL_SIZE}"));
        let locks = JOBS.map(PgAdvisoryLock::new);
        let attempts = join_all(locks.iter().map(|lock| {
            let pool = pool.clone();
            async move {
                let conn = pool.acquire().await?;
                Ok::<_, BoxError>(lock.try_acquire(conn).await?)
            }
        }))
        .await;
        let mut holders = Vec::new();
        for a in attempts {
            match a? {
                sqlx::Either::Left(guard) => {
                    out.granted += 1;
                    holders.push(guard);
                }
                sqlx::Either::Right(_conn) => {}
            }
        }
        out.held_between_statements = pool.size() as usize - pool.num_idle();
        for _ in 0..PROBES.min(2) {
            let start = Instant::now();
            let probe = tokio::time::timeout(PROBE_BOUND, async {
                let mut c = pool.acquire().await?;
                sqlx::query("SELECT 1").execute(&mut *c).await?;
                Ok::<_, BoxError>(())
            })
            .await;
            out.probes += 1;
            if matches!(probe, Ok(Ok(()))) {
                out.probes_ok += 1;
            }
            out.worst_probe = out.worst_probe.max(start.elapsed());
        }
        let work = join_all(holders.iter().map(|_| async {
            let mut c = tokio::time::timeout(PROBE_BOUND, pool.acquire())
                .await
                .ok()?
                .ok()?;
            sqlx::query("SELECT count(*) FROM pg_class")
                .fetch_one(&mut *c)
                .await
                .ok()
        }))
        .await;
        out.work_done = work.iter().filter(|d| d.is_some()).count();
        for guard in holders {
            guard.release_now().await?;
        }
        Ok(out)
    }
}

/// Did pgwarden behave as claimed? Returns what it did not do.
pub fn check(o: &Outcome, expect_granted: usize) -> Vec<String> {
    let mut bad = Vec::new();
    if o.granted != expect_granted {
        bad.push(format!(
            "{}: {} locks granted, expected {expect_granted}",
            o.scenario, o.granted
        ));
    }
    if o.granted + o.refused != JOBS.len() {
        bad.push(format!(
            "{}: {} jobs neither granted nor refused",
            o.scenario,
            JOBS.len() - o.granted - o.refused
        ));
    }
    if o.probes_ok != o.probes || o.probes == 0 {
        bad.push(format!(
            "{}: readiness {}/{} ok",
            o.scenario, o.probes_ok, o.probes
        ));
    }
    if o.worst_probe >= PROBE_BOUND {
        bad.push(format!("{}: slowest probe {:?}", o.scenario, o.worst_probe));
    }
    if o.work_done != o.granted {
        bad.push(format!(
            "{}: work completed {} of {}",
            o.scenario, o.work_done, o.granted
        ));
    }
    bad
}
