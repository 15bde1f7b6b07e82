//! A lease holder paused inside a fenced transaction, and what it does to
//! a healthy instance: the scenario of the readiness-reserve test
//! (`tests/it/readiness_reserve.rs`) and of benchmark row 7.
//!
//! Instance B holds lease `x` and sits in a transaction after
//! `lease.fence(tx)` (a GC pause, a stopped process). Instance A (pool of
//! 4) runs contenders polling `acquire("x", None)`, whose statement blocks on
//! B's row lock; request traffic that keeps its request lane full; its own
//! unrelated leases (TTL 2 s, renewed every 500 ms); and the readiness probe
//! every 100 ms with a 1 s bound. Public API only, on any backend
//! ([`Backend`], `tests/it/support/backend.rs`: the readiness-reserve test
//! runs it on every backend, the benchmark on deadpool).
//!
//! [`run_raw`] is the same scenario on raw deadpool, the design users run
//! today: session advisory locks (`pg_advisory_lock`) held on pooled
//! connections, contenders polling `pg_try_advisory_lock` on their own
//! checkouts, and the probe a checkout + `SELECT 1` on the same pool.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgwarden::LeaseOptions;
use pgwarden_testing::TestDb;

use crate::support::backend::Backend;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The scenario's knobs.
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    /// Instance A's pool size.
    pub pool: usize,
    /// How long B sits in its fenced transaction.
    pub hold: Duration,
    /// Tasks polling `acquire("x", None)` on A.
    pub contenders: usize,
    /// Tasks looping `get` + a 2 ms statement on A.
    pub request_tasks: usize,
    /// A's own leases.
    pub own_leases: usize,
    /// Their TTL.
    pub own_ttl: Duration,
    /// Probe period and bound.
    pub probe_every: Duration,
    pub probe_bound: Duration,
}

impl Default for Setup {
    fn default() -> Setup {
        Setup {
            pool: 4,
            hold: Duration::from_secs(10),
            contenders: 3,
            request_tasks: 8,
            own_leases: 3,
            own_ttl: Duration::from_secs(2),
            probe_every: Duration::from_millis(100),
            probe_bound: Duration::from_secs(1),
        }
    }
}

/// What A went through.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Probe latencies; a failed probe counts as the bound.
    pub probes: Vec<Duration>,
    pub probes_ok: usize,
    /// A's own leases lost during the hold.
    pub own_lost: usize,
    /// Renewals of A's leases during the hold, and failed renewal statements.
    pub renewed: u64,
    pub renewal_failures: u64,
    /// Contenders' `acquire("x", None)` calls that returned, and of those
    /// errors (statement timeouts, checkout timeouts).
    pub attempts: usize,
    pub attempt_errors: usize,
    /// Request checkouts that ran their statement.
    pub requests: usize,
}

impl Outcome {
    /// Adds another round's figures to these.
    pub fn merge(&mut self, o: Outcome) {
        self.probes.extend(o.probes);
        self.probes_ok += o.probes_ok;
        self.own_lost += o.own_lost;
        self.renewed += o.renewed;
        self.renewal_failures += o.renewal_failures;
        self.attempts += o.attempts;
        self.attempt_errors += o.attempt_errors;
        self.requests += o.requests;
    }

    /// One line: readiness success and p99, own leases lost.
    pub fn summary(&self) -> String {
        let pct = 100.0 * self.probes_ok as f64 / self.probes.len().max(1) as f64;
        format!(
            "readiness {pct:.1} % of {}, p99 {:.1} ms; own leases lost {}",
            self.probes.len(),
            self.probe_percentile(99.0).as_secs_f64() * 1000.0,
            self.own_lost
        )
    }

    /// The `p`-th percentile of the probe latencies (nearest rank).
    pub fn probe_percentile(&self, p: f64) -> Duration {
        let mut v = self.probes.clone();
        v.sort();
        if v.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
        v[rank.clamp(1, v.len()) - 1]
    }
}

/// A request's statement: 2 ms of server time (a simple query, as the raw
/// side's).
const REQUEST: &str = "SELECT pg_sleep(0.002)";

/// Runs the scenario once on `db` (a fresh database), on backend `B`'s
/// pools on the shipped defaults (named `<name>-<backend>`: the variants of
/// a test run at once).
pub async fn run<B: Backend>(db: &TestDb, s: Setup) -> Result<Outcome, BoxError> {
    let name = |n: &str| format!("{n}-{}", B::NAME);
    let pool_b = B::build_named(db, 4, Some(&name("paused-holder")));
    let b = B::leases(&pool_b);
    B::install(&b).await?;
    let opts_x = LeaseOptions::new(Duration::from_secs(60));
    let held = B::acquire(&b, "x", &opts_x, None)
        .await?
        .ok_or("lease x is free at the start")?;
    let pool_a = B::build_named(db, s.pool, Some(&name("healthy")));
    let a = B::leases(&pool_a);
    let mut own = Vec::new();
    for i in 0..s.own_leases {
        let opts = LeaseOptions::new(s.own_ttl);
        let name = format!("own-{i}");
        own.push(
            B::acquire(&a, &name, &opts, None)
                .await?
                .ok_or("own lease free")?,
        );
    }
    let before = B::lease_stats(&a);

    // B pauses inside its fenced transaction.
    let mut source_b = B::tx_source(&pool_b).await;
    let tx = B::begin(&mut source_b, None).await;
    let tx = B::fence(&held, tx).await?;

    let stop = Arc::new(AtomicBool::new(false));
    let attempts = Arc::new(AtomicUsize::new(0));
    let attempt_errors = Arc::new(AtomicUsize::new(0));
    let requests = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..s.contenders {
        let (a, stop, opts_x) = (a.clone(), stop.clone(), opts_x.clone());
        let (attempts, errors) = (attempts.clone(), attempt_errors.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                match B::acquire(&a, "x", &opts_x, None).await {
                    Ok(Some(l)) => drop(B::release(l).await),
                    Ok(None) => {}
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                attempts.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }));
    }
    for _ in 0..s.request_tasks {
        let (pool, stop, requests) = (pool_a.clone(), stop.clone(), requests.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(mut c) = B::get(&pool).await {
                    if B::try_run(&mut c, REQUEST).await.is_ok() {
                        requests.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }

    let mut out = Outcome::default();
    let start = Instant::now();
    let mut tick = tokio::time::interval(s.probe_every);
    while start.elapsed() < s.hold {
        tick.tick().await;
        let t = Instant::now();
        match B::readiness(&pool_a, s.probe_bound).await {
            Ok(_) => {
                out.probes_ok += 1;
                out.probes.push(t.elapsed());
            }
            Err(_) => out.probes.push(t.elapsed().max(s.probe_bound)),
        }
    }
    out.own_lost = own.iter().filter(|l| l.is_lost()).count();
    let after = B::lease_stats(&a);
    out.renewed = after.renewed - before.renewed;
    out.renewal_failures = after.renewal_failures - before.renewal_failures;

    // B wakes up and commits; everything winds down.
    B::fx_commit(tx).await?;
    drop(source_b);
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(15), t).await;
    }
    out.attempts = attempts.load(Ordering::Relaxed);
    out.attempt_errors = attempt_errors.load(Ordering::Relaxed);
    out.requests = requests.load(Ordering::Relaxed);
    for l in own {
        let _ = B::release(l).await;
    }
    let _ = B::release(held).await;
    Ok(out)
}

/// The raw design's lock statements: a job name hashed to its key.
const TRY_LOCK: &str = "SELECT pg_try_advisory_lock(hashtext($1))";
const UNLOCK: &str = "SELECT pg_advisory_unlock(hashtext($1))";

/// Runs the scenario once on `db` with raw deadpool and session advisory
/// locks: instance B (its own raw pool) holds the session lock on `x` on a
/// pooled connection and sits 10 s inside a transaction on that connection;
/// instance A (a raw pool of `s.pool`) holds `s.own_leases` job locks of its
/// own, each a session lock on a connection it keeps checked out, runs
/// `s.contenders` tasks polling `pg_try_advisory_lock('x')` on their own
/// checkouts, the request tasks, and the probe (`get` + `SELECT 1` within
/// the bound) on the same pool.
pub async fn run_raw(db: &TestDb, s: Setup) -> Result<Outcome, BoxError> {
    let pool_b = db.deadpool(4)?;
    let mut conn_b = pool_b.get().await?;
    let got: bool = conn_b.query_one(TRY_LOCK, &[&"x"]).await?.get(0);
    if !got {
        return Err("lock x is free at the start".into());
    }
    let pool_a = db.deadpool(s.pool)?;
    // A's own jobs: each keeps its connection while it holds its lock.
    let mut own = Vec::new();
    for i in 0..s.own_leases {
        let c = pool_a.get().await?;
        let name = format!("own-{i}");
        let got: bool = c.query_one(TRY_LOCK, &[&name]).await?.get(0);
        if !got {
            return Err(format!("own lock {name} is free at the start").into());
        }
        own.push((c, name));
    }

    // B pauses inside a transaction, its session lock held.
    let tx = conn_b.transaction().await?;
    tx.execute("SELECT 1", &[]).await?;

    let stop = Arc::new(AtomicBool::new(false));
    let attempts = Arc::new(AtomicUsize::new(0));
    let attempt_errors = Arc::new(AtomicUsize::new(0));
    let requests = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..s.contenders {
        let (pool, stop) = (pool_a.clone(), stop.clone());
        let (attempts, errors) = (attempts.clone(), attempt_errors.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let attempt = async {
                    let c = pool.get().await?;
                    let got: bool = c.query_one(TRY_LOCK, &[&"x"]).await?.get(0);
                    if got {
                        c.query_one(UNLOCK, &[&"x"]).await?;
                    }
                    Ok::<_, BoxError>(())
                };
                if attempt.await.is_err() {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
                attempts.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }));
    }
    for _ in 0..s.request_tasks {
        let (pool, stop, requests) = (pool_a.clone(), stop.clone(), requests.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(c) = pool.get().await {
                    if c.simple_query(REQUEST).await.is_ok() {
                        requests.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }

    let mut out = Outcome::default();
    let start = Instant::now();
    let mut tick = tokio::time::interval(s.probe_every);
    while start.elapsed() < s.hold {
        tick.tick().await;
        let t = Instant::now();
        let probe = tokio::time::timeout(s.probe_bound, async {
            pool_a.get().await?.simple_query("SELECT 1").await?;
            Ok::<_, BoxError>(())
        })
        .await;
        match probe {
            Ok(Ok(())) => {
                out.probes_ok += 1;
                out.probes.push(t.elapsed());
            }
            _ => out.probes.push(t.elapsed().max(s.probe_bound)),
        }
    }
    // A session lock is lost with its connection.
    out.own_lost = own.iter().filter(|(c, _)| c.is_closed()).count();

    tx.commit().await?;
    conn_b.query_one(UNLOCK, &[&"x"]).await?;
    drop(conn_b);
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(15), t).await;
    }
    out.attempts = attempts.load(Ordering::Relaxed);
    out.attempt_errors = attempt_errors.load(Ordering::Relaxed);
    out.requests = requests.load(Ordering::Relaxed);
    for (c, name) in own {
        let _ = c.query_one(UNLOCK, &[&name]).await;
    }
    Ok(out)
}
