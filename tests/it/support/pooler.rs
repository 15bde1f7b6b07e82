//! Helpers of the pooler tests: load (clients running short transactions
//! in a loop), pools through PgBouncer, figures from detection logs.
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgwarden::Pool;
use pgwarden_testing::{require_tool, PgBouncer, PoolMode, TestDb, TestServer};
use tokio::task::JoinHandle;
use tokio_postgres::Client;

use super::eventually;

pub const T: Duration = Duration::from_secs(5);
/// Clients of the load.
pub const LOAD_CLIENTS: usize = 32;

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

/// A fresh pool of 4 through PgBouncer named `name`, pooler `Auto`:
/// detection runs on it.
pub fn through(b: &PgBouncer, name: &str) -> Pool {
    Pool::builder(b.deadpool(4).unwrap())
        .name(name)
        .wait_timeout(T)
        .housekeeping_interval(Duration::from_secs(3600))
        .census_interval(None)
        .build()
        .unwrap()
}

/// Statements each detection of pools named `prefix…` ran, from its log line.
pub fn statements(prefix: &str) -> Vec<usize> {
    let pool = format!("pool={prefix}");
    super::logs()
        .text()
        .lines()
        .filter(|l| l.contains("pooler detected") && l.contains(&pool))
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
