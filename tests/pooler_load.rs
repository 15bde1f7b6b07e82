//! Pooler detection under load: a real PgBouncer in transaction mode with 32
//! clients running short transactions the whole time, and PostgreSQL itself
//! under the same load. Every try builds a fresh pool, so detection runs
//! every time.
#![cfg(feature = "testing")]

mod support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgwarden::testing::{require_tool, PgBouncer, TestServer};
use pgwarden::{LockKey, Pool, Pooler};
use support::*;
use tokio::task::JoinHandle;
use tokio_postgres::Client;

const T: Duration = Duration::from_secs(5);
const TRIES: usize = 100;
const LOAD_CLIENTS: usize = 32;

/// Clients running short transactions in a loop until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    tasks: Vec<JoinHandle<Result<(), tokio_postgres::Error>>>,
}

impl Load {
    fn start(clients: Vec<Client>) -> Load {
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
    fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// Waits until the load runs (every client past its first transactions).
    async fn running(&self) {
        let want = 4 * self.tasks.len() as u64;
        eventually(T, "load running", || async { self.done() >= want }).await;
    }

    /// Stops the clients; each must have run without error. Returns the
    /// transactions done.
    async fn stop(self) -> u64 {
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

fn bouncer(db: &pgwarden::testing::TestDb) -> Option<PgBouncer> {
    if !require_tool("pgbouncer").expect("pgbouncer is required on CI") {
        return None;
    }
    Some(PgBouncer::start(TestServer::shared().unwrap(), db).expect("pgbouncer"))
}

async fn loaded_bouncer(db: &pgwarden::testing::TestDb, b: &PgBouncer) -> Load {
    let _ = db;
    let mut clients = Vec::new();
    for _ in 0..LOAD_CLIENTS {
        clients.push(b.connect().await.expect("load client through pgbouncer"));
    }
    let load = Load::start(clients);
    load.running().await;
    load
}

fn through(b: &PgBouncer) -> Pool {
    Pool::builder(b.deadpool(4).unwrap())
        .wait_timeout(T)
        .housekeeping_interval(Duration::from_secs(3600))
        .census_interval(None)
        .build()
        .unwrap()
}

/// Statements each detection ran, from its log line.
fn statements(logs: &Logs) -> Vec<usize> {
    logs.text()
        .lines()
        .filter(|l| l.contains("pooler detected"))
        .filter_map(|l| {
            let s = l.split("statements=").nth(1)?;
            s.split_whitespace().next()?.parse().ok()
        })
        .collect()
}

fn summary(mut times: Vec<Duration>) -> String {
    times.sort();
    let p = |q: f64| times[((times.len() - 1) as f64 * q) as usize];
    format!(
        "median {:?}, p99 {:?}, max {:?}",
        p(0.5),
        p(0.99),
        times[times.len() - 1]
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loaded_pgbouncer_is_a_transaction_pooler_every_time() {
    let db = db().await;
    let Some(bouncer) = bouncer(&db) else { return };
    let load = loaded_bouncer(&db, &bouncer).await;
    let logs = Logs::default();
    let _log = tracing::subscriber::set_default(logs.subscriber());
    let before = load.done();
    let mut times = Vec::new();
    for i in 0..TRIES {
        let pool = through(&bouncer);
        let start = Instant::now();
        let found = pool.detect_pooler().await.unwrap();
        times.push(start.elapsed());
        assert_eq!(found, Pooler::Transaction, "try {i}");
        pool.close();
    }
    let during = load.done() - before;
    let total = load.stop().await;
    let counts = statements(&logs);
    assert_eq!(counts.len(), TRIES, "one detection per try");
    assert!(
        during >= TRIES as u64,
        "the load ran during the tries: {during}"
    );
    let mut hist = std::collections::BTreeMap::new();
    for c in &counts {
        *hist.entry(*c).or_insert(0) += 1;
    }
    eprintln!(
        "{TRIES}/{TRIES} transaction pooler; detection {}; statements to proof {hist:?}; \
         load: {during} transactions during the tries ({total} in all)",
        summary(times)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_locks_through_a_loaded_pgbouncer_are_never_granted() {
    let db = db().await;
    let Some(bouncer) = bouncer(&db) else { return };
    let load = loaded_bouncer(&db, &bouncer).await;
    let mut times = Vec::new();
    for i in 0..TRIES {
        let pool = through(&bouncer);
        let key = LockKey::Pair(9, i as i32);
        let start = Instant::now();
        let got = match i % 3 {
            0 => pool.session_lock(key, T).await.map(Some),
            1 => pool.try_session_lock(key).await,
            _ => pool.session_lock_shared(key, T).await.map(Some),
        };
        times.push(start.elapsed());
        match got {
            Err(e) => assert!(e.is_behind_pooler(), "try {i}: {e}"),
            Ok(lock) => {
                panic!("try {i}: session lock granted through a transaction pooler: {lock:?}")
            }
        }
        assert_eq!(pool.pooler(), Pooler::Transaction, "try {i}");
        pool.close();
    }
    load.stop().await;
    // On the server itself: no advisory lock on any backend.
    let raw = db.connect().await.unwrap();
    let left = raw_locks(&raw).await;
    assert!(
        left.is_empty(),
        "advisory locks left on the server: {left:?}"
    );
    eprintln!("{TRIES}/{TRIES} refused (BehindPooler); {}", summary(times));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loaded_postgres_is_direct_every_time() {
    let db = db().await;
    let mut clients = Vec::new();
    for _ in 0..LOAD_CLIENTS {
        clients.push(db.connect().await.unwrap());
    }
    let load = Load::start(clients);
    load.running().await;
    let logs = Logs::default();
    let _log = tracing::subscriber::set_default(logs.subscriber());
    let mut times = Vec::new();
    for i in 0..TRIES {
        let pool = Pool::builder(db.deadpool(4).unwrap())
            .wait_timeout(T)
            .housekeeping_interval(Duration::from_secs(3600))
            .census_interval(None)
            .build()
            .unwrap();
        let start = Instant::now();
        let found = pool.detect_pooler().await.unwrap();
        times.push(start.elapsed());
        assert_eq!(found, Pooler::Direct, "try {i}");
        pool.close();
    }
    load.stop().await;
    let counts = statements(&logs);
    assert_eq!(
        counts,
        vec![2; TRIES],
        "one statement per connection, every time"
    );
    eprintln!("{TRIES}/{TRIES} direct; detection {}", summary(times));
}
