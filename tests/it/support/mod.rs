//! The shared support module of the integration tests (the `it` binary
//! declares it once; each test module names it with `use crate::support;`):
//!
//! * here: a fresh database on the shared throwaway server ([`db`]), a
//!   plain admin connection, a pool builder, raw-SQL views of `pg_locks`
//!   and `pg_stat_activity`, log capture, and the harness's bounded waits
//!   ([`eventually`], [`within`]) and fault guard ([`Stopped`]);
//! * [`recorder`]: pools built under a local metrics recorder, metric
//!   snapshots and lookups;
//! * [`leases`]: lease-test pools named by `application_name`, their
//!   backends, the two-holder fixture, and views of the lease table;
//! * [`pooler`]: load through PgBouncer or PostgreSQL, pools through
//!   PgBouncer, detection figures from the logs;
//! * [`service`] and [`promql`]: the `service` example run as real
//!   processes, and PromQL against a real Prometheus;
//! * [`http`]: a plain async HTTP/1.1 client, timed;
//! * [`stalls`]: stalls of a test's own runtime, which excuse a missed
//!   period in the scheduler's liveness checks.
#![allow(dead_code, unused_imports)]

#[macro_use]
pub mod backend;
pub mod http;
pub mod leases;
pub mod pooler;
pub mod promql;
pub mod recorder;
#[macro_use]
pub mod service;
pub mod stalls;

use std::collections::HashMap;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgwarden::{Pool, PoolBuilder};
use pgwarden_testing::{TestDb, TestServer};
use tokio_postgres::Client;

pub use pgwarden_testing::{eventually, within, Stopped};
pub use recorder::{
    counter, gauge, histogram, metric, metrics_now, snapshot, watch, with_recorder,
};

/// A fresh database on the shared throwaway server (or `DATABASE_URL`'s).
pub async fn db() -> TestDb {
    TestServer::shared()
        .expect("throwaway PostgreSQL")
        .create_database()
        .await
        .expect("fresh database")
}

/// A server of the test's own (the external one where `DATABASE_URL` names
/// it) and a fresh database on it: for a test whose load (a filled lock
/// table, a storm of cut connects) must not reach the other tests of the
/// shared server. Keep the server while the database is used.
pub async fn own_db() -> (TestServer, TestDb) {
    let server = tokio::task::spawn_blocking(TestServer::start)
        .await
        .expect("server start task")
        .expect("throwaway PostgreSQL");
    let db = server.create_database().await.expect("fresh database");
    (server, db)
}

/// A pool of `size` on `db`, straight to PostgreSQL (no pooler probe), no
/// periodic census, housekeeping on demand only.
pub fn builder(db: &TestDb, size: usize) -> PoolBuilder {
    Pool::builder(db.deadpool(size).expect("deadpool"))
        .pooler(pgwarden::PoolerMode::Direct)
        .wait_timeout(Duration::from_secs(5))
        .housekeeping_interval(Duration::from_secs(3600))
        .census_interval(None)
}

/// Advisory locks in the current database: (pid, classid, objid, objsubid, granted).
pub async fn raw_locks(c: &Client) -> Vec<(i32, u32, u32, i16, bool)> {
    c.query(
        "SELECT pid, classid, objid, objsubid, granted FROM pg_locks \
          WHERE locktype = 'advisory' \
            AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        &[],
    )
    .await
    .expect("pg_locks")
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
    .collect()
}

/// Whether another session could take `key` exclusively now (taken and
/// given back at once, on `c`).
pub async fn free(c: &Client, key: pgwarden::LockKey) -> bool {
    let (lock, unlock, params): (&str, &str, Vec<&(dyn tokio_postgres::types::ToSql + Sync)>) =
        match &key {
            pgwarden::LockKey::Single(k) => (
                "SELECT pg_try_advisory_lock($1)",
                "SELECT pg_advisory_unlock($1)",
                vec![k],
            ),
            pgwarden::LockKey::Pair(a, b) => (
                "SELECT pg_try_advisory_lock($1, $2)",
                "SELECT pg_advisory_unlock($1, $2)",
                vec![a, b],
            ),
        };
    let got: bool = c.query_one(lock, &params).await.expect("try lock").get(0);
    if got {
        c.query_one(unlock, &params).await.expect("unlock");
    }
    got
}

/// Whether a backend with this pid is alive.
pub async fn alive(c: &Client, pid: i32) -> bool {
    c.query_one(
        "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
        &[&pid],
    )
    .await
    .expect("pg_stat_activity")
    .get::<_, i64>(0)
        > 0
}

/// A `tracing` writer into a shared buffer.
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// A subscriber that writes here, to install with `set_default` (this
    /// thread) or `set_global_default`.
    ///
    /// `tracing` caches whether a callsite is enabled, process-wide, when it
    /// is first hit; while one dispatcher only is registered, it asks the
    /// default of the thread that hit it (tokio-rs/tracing#3611). A sibling
    /// test without a subscriber hitting a pgwarden log line first would
    /// disable it here too. A second dispatcher, registered for the life of
    /// the process and interested in everything, makes `tracing` ask every
    /// registered dispatcher instead.
    pub fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync + use<> {
        self.subscriber_at(tracing::Level::DEBUG)
    }

    /// [`Logs::subscriber`] with events up to `level` only.
    pub fn subscriber_at(
        &self,
        level: tracing::Level,
    ) -> impl tracing::Subscriber + Send + Sync + use<> {
        static ANCHOR: std::sync::OnceLock<tracing::Dispatch> = std::sync::OnceLock::new();
        ANCHOR.get_or_init(|| tracing::Dispatch::new(tracing_subscriber::registry()));
        let w = self.clone();
        tracing_subscriber::fmt()
            .with_writer(move || w.clone())
            .with_ansi(false)
            .with_max_level(level)
            .finish()
    }
}

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The process-wide log of the `it` binary: one global subscriber (INFO and
/// above), installed at first use. A thread's own subscriber (`set_default`)
/// misses events from the runtime's worker threads and from callsites
/// another test's thread registered first; this one sees them all, from
/// every test of the process, so tests tell their lines apart by pool name
/// (`pool=<name>`). One function for every module: a process has one global
/// subscriber.
pub fn logs() -> &'static Logs {
    static LOGS: std::sync::OnceLock<Logs> = std::sync::OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Logs::default();
        tracing::subscriber::set_global_default(logs.subscriber_at(tracing::Level::INFO))
            .expect("support::logs installs the only global subscriber");
        logs
    })
}

/// A plain connection to `db` for the test's own queries.
pub async fn admin(db: &TestDb) -> Client {
    db.connect().await.expect("admin connection")
}

/// Lane status by name, for messages.
pub fn lanes(pool: &Pool) -> HashMap<String, usize> {
    pool.status()
        .lanes
        .iter()
        .map(|l| (l.lane.to_string(), l.in_use))
        .collect()
}

/// The backend that waits on the server for advisory lock `objid` in this
/// database (the variants of a test run at once, each in its own), if any.
pub async fn lock_waiter(raw: &Client, objid: i64) -> Option<i32> {
    raw.query_opt(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objid = $1::bigint::oid \
           AND NOT granted \
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        &[&objid],
    )
    .await
    .unwrap()
    .map(|r| r.get(0))
}

/// Drives `fut` until its lock statement waits on the server for `objid`,
/// then drops it (cancelled while waiting: an event, not a clock), and
/// returns the waiting backend's pid; `None` when `fut` finished first.
pub async fn cancel_once_waiting<F: std::future::Future>(
    raw: &Client,
    objid: i64,
    fut: F,
) -> Option<i32> {
    tokio::select! {
        _ = fut => None,
        pid = async {
            loop {
                if let Some(pid) = lock_waiter(raw, objid).await {
                    break pid;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        } => Some(pid),
    }
}
