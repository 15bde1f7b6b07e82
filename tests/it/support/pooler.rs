//! Helpers of the pooler tests: load (clients running short transactions
//! in a loop), pools through PgBouncer, figures from detection logs.
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgwarden::PoolerMode;
use pgwarden_testing::{require_tool, PgBouncer, PoolMode, TestDb, TestServer};
use tokio::task::JoinHandle;
use tokio_postgres::Client;

use super::backend::{Backend, Settings};
use super::eventually;

pub const T: Duration = Duration::from_secs(5);
/// The checkout bound of [`fresh`]'s pools: a guard against a hang, not
/// a figure under test. With `T` (5 s) a detection's first checkout through
/// the loaded session pooler timed out at its pid (`BackendPid`, the pool
/// still empty) in 2 of 4 runs with both cores busy or on 12 threads: the
/// loaded tests start together, last, and the server forks behind them.
pub const POOL_WAIT: Duration = Duration::from_secs(30);
/// Clients of the load.
pub const LOAD_CLIENTS: usize = 32;

/// Detections per loaded-pooler test: `POOLER_TRIES`, 50 by default (100
/// until stop 41: the loaded tests were a quarter of the suite's
/// test-seconds; a long run sets more).
pub fn tries() -> usize {
    std::env::var("POOLER_TRIES")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(50)
}

/// Clients running short transactions in a loop until stopped.
pub struct Load {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    tasks: Vec<JoinHandle<Result<(), tokio_postgres::Error>>>,
}

impl Load {
    pub fn start(clients: Vec<Client>) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let tasks = clients
            .into_iter()
            .map(|mut c| {
                let (stop, done) = (stop.clone(), done.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let tx = c.transaction().await?;
                        tx.query_typed("SELECT pg_backend_pid()", &[]).await?;
                        tx.commit().await?;
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(())
                })
            })
            .collect();
        Load { stop, done, tasks }
    }

    /// Transactions done so far.
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// Waits until the load runs (every client past its first transactions).
    pub async fn running(&self) {
        let want = 4 * self.tasks.len() as u64;
        eventually(T, "load running", || async { self.done() >= want }).await;
    }

    /// Stops the clients; each must have run without error. Returns the
    /// transactions done.
    pub async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            tokio::time::timeout(T, t)
                .await
                .expect("load client stops")
                .expect("load client task")
                .expect("load client ran without error");
        }
        self.done.load(Ordering::Relaxed)
    }
}

/// PgBouncer in `mode` with `pool_size` server connections in front of
/// `db`; `None` where PgBouncer is not installed (and not on CI).
pub fn bouncer(db: &TestDb, pool_size: usize, mode: PoolMode) -> Option<PgBouncer> {
    if !require_tool("pgbouncer").expect("pgbouncer is required on CI") {
        return None;
    }
    let server = TestServer::shared().expect("throwaway PostgreSQL");
    Some(PgBouncer::start_with_mode(server, db, pool_size, mode).expect("pgbouncer"))
}

/// The load through PgBouncer, running.
pub async fn load_through(b: &PgBouncer) -> Load {
    let mut clients = Vec::new();
    for _ in 0..LOAD_CLIENTS {
        clients.push(b.connect().await.expect("load client through pgbouncer"));
    }
    let load = Load::start(clients);
    load.running().await;
    load
}

/// A fresh pool of 4 of backend `B` named `name` (`<name>-<backend>`),
/// pooler `Auto` (detection runs on it), no census: straight to the
/// server, or through PgBouncer.
pub fn fresh<B: Backend>(on: On<'_>, name: &str) -> B::Pool {
    let name: &'static str = Box::leak(name.to_owned().into_boxed_str());
    let s = Settings::new(name, 4)
        .wait(POOL_WAIT)
        .pooler(PoolerMode::Auto);
    match on {
        On::Db(db) => B::build(db, &s),
        On::Bouncer(b) => B::build_through(b, &s),
    }
}

/// Where [`fresh`] connects.
#[derive(Clone, Copy)]
pub enum On<'a> {
    Db(&'a TestDb),
    Bouncer(&'a PgBouncer),
}

/// [`fresh`] through PgBouncer.
pub fn through<B: Backend>(b: &PgBouncer, name: &str) -> B::Pool {
    fresh::<B>(On::Bouncer(b), name)
}

/// Statements each detection of the pools of backend `B` named
/// `prefix…` ran, from its log line.
pub fn statements<B: Backend>(prefix: &str) -> Vec<usize> {
    let suffix = format!("-{}", B::NAME);
    super::logs()
        .text()
        .lines()
        .filter(|l| l.contains("pooler detected"))
        .filter(|l| {
            let pool = l
                .split("pool=")
                .nth(1)
                .and_then(|s| s.split_whitespace().next());
            pool.is_some_and(|p| p.starts_with(prefix) && p.ends_with(&suffix))
        })
        .filter_map(|l| {
            let s = l.split("statements=").nth(1)?;
            s.split_whitespace().next()?.parse().ok()
        })
        .collect()
}

/// Median, p99 and maximum.
pub fn summary(mut times: Vec<Duration>) -> String {
    times.sort();
    let p = |q: f64| times[((times.len() - 1) as f64 * q) as usize];
    format!(
        "median {:?}, p99 {:?}, max {:?}",
        p(0.5),
        p(0.99),
        times[times.len() - 1]
    )
}

/// Detections (and locks, in `pooler_session`) run at once by the loaded
/// tests: each sqlx detection is the whole motion probe, and 100 one after
/// another took 47 s.
pub const PARALLEL: usize = 4;

/// `tries` detections, [`PARALLEL`] at a time, each on a fresh pool
/// `pool(i)` and asserted `Direct`, then closed: their times.
pub async fn direct_detections<B: Backend>(
    tries: usize,
    pool: impl Fn(usize) -> B::Pool,
) -> Vec<Duration> {
    use futures_util::StreamExt;
    let times: Vec<_> = futures_util::stream::iter(0..tries)
        .map(|i| {
            let pool = pool(i);
            async move {
                let start = std::time::Instant::now();
                let found = B::detect_pooler(&pool).await.unwrap();
                let took = start.elapsed();
                assert_eq!(found, PoolerMode::Direct, "try {i}");
                B::close(&pool).await;
                took
            }
        })
        .buffer_unordered(PARALLEL)
        .collect()
        .await;
    assert_eq!(times.len(), tries);
    times
}
