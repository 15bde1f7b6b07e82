//! Shared helpers of the lease tests: fresh databases, pools with a known
//! `application_name` (to find their backends), stopping backends with
//! SIGSTOP, and bounded waits.

#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pgwarden::testing::{TestDb, TestServer};
use pgwarden::{LeaseOptions, Pool, Pooler};
use tokio_postgres::types::Type;
use tokio_postgres::Client;

/// A fresh database on the shared throwaway server.
pub async fn db() -> TestDb {
    TestServer::shared()
        .expect("throwaway PostgreSQL")
        .create_database()
        .await
        .expect("fresh database")
}

/// A pgwarden pool of `size` on `db`, its backends named `app` in
/// `pg_stat_activity.application_name`.
pub fn pool(db: &TestDb, size: usize, app: &str) -> Pool {
    pool_with(db.pg_config(), size, app)
}

/// The same, connecting with `config` (another user, PgBouncer).
pub fn pool_with(config: tokio_postgres::Config, size: usize, app: &str) -> Pool {
    pool_behind(config, size, app, Pooler::Auto)
}

/// The same, its pooler configured as `pooler`.
pub fn pool_behind(
    mut config: tokio_postgres::Config,
    size: usize,
    app: &str,
    pooler: Pooler,
) -> Pool {
    config.application_name(app);
    let mgr = deadpool_postgres::Manager::from_config(
        config,
        tokio_postgres::NoTls,
        deadpool_postgres::ManagerConfig {
            recycling_method: deadpool_postgres::RecyclingMethod::Fast,
        },
    );
    let inner = deadpool_postgres::Pool::builder(mgr)
        .max_size(size)
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
        .expect("deadpool");
    let mut builder = Pool::builder(inner)
        .name(app)
        .wait_timeout(Duration::from_secs(5));
    if pooler != Pooler::Auto {
        builder = builder.pooler(pooler);
    }
    builder.build().expect("pgwarden pool")
}

/// Backend pids of the connections named `app`.
pub async fn backends(admin: &Client, app: &str) -> Vec<i32> {
    admin
        .query_typed(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1",
            &[(&app, tokio_postgres::types::Type::TEXT)],
        )
        .await
        .expect("pg_stat_activity")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Backends stopped with SIGSTOP; continued (SIGCONT) on drop, whatever
/// happens in the test.
pub struct Stopped(Vec<i32>);

impl Stopped {
    pub fn stop(pids: Vec<i32>) -> Stopped {
        assert!(!pids.is_empty(), "no backend to stop");
        for &pid in &pids {
            let rc = kill(pid, libc::SIGSTOP);
            assert_eq!(rc, 0, "SIGSTOP {pid}: {}", std::io::Error::last_os_error());
        }
        Stopped(pids)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        for &pid in &self.0 {
            kill(pid, libc::SIGCONT);
        }
    }
}

fn kill(pid: i32, sig: i32) -> i32 {
    // SAFETY: kill(2) has no memory-safety preconditions. The pid is a
    // backend of the test's own server, read from pg_stat_activity; the test
    // process runs as root (or as the server's user), so it may signal it.
    unsafe { libc::kill(pid, sig) }
}

/// Awaits `fut`, failing the test after `limit`.
pub async fn within<T>(limit: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: not done within {limit:?}"),
    }
}

/// Polls `cond` every 20 ms until it holds, failing the test after `limit`.
pub async fn until<F, Fut>(limit: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    while !cond().await {
        assert!(start.elapsed() < limit, "{what}: not true within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A plain connection to `db` for the test's own queries.
pub async fn admin(db: &TestDb) -> Client {
    db.connect().await.expect("admin connection")
}

/// A postmaster and every process it started (backends, background
/// workers), read from `/proc`.
pub fn server_processes(postmaster: i32) -> Vec<i32> {
    let mut pids = vec![postmaster];
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid …: comm may hold spaces, so split after ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<i32>().ok());
        if ppid == Some(postmaster) {
            pids.push(pid);
        }
    }
    pids
}

/// The number of backends named `app` waiting on a lock, or running a
/// statement at all (`active`).
pub async fn busy_backends(admin: &Client, app: &str) -> (i64, i64) {
    let row = admin
        .query_typed_one(
            "SELECT count(*) FILTER (WHERE wait_event_type = 'Lock'),
                    count(*) FILTER (WHERE state = 'active')
               FROM pg_stat_activity WHERE application_name = $1",
            &[(&app, tokio_postgres::types::Type::TEXT)],
        )
        .await
        .expect("pg_stat_activity");
    (row.get(0), row.get(1))
}

/// A session that holds `FOR UPDATE` (or another lock clause) on lease rows
/// in an open transaction: what a slow writer or a stale holder's fenced
/// transaction does. Rolled back on drop of the client.
pub async fn lock_rows(db: &TestDb, table: &str, names: &[&str], clause: &str) -> Client {
    let c = db.connect().await.expect("locker connection");
    c.batch_execute("BEGIN").await.expect("BEGIN");
    for name in names {
        c.query_typed(
            &format!("SELECT 1 FROM {table} WHERE name = $1 {clause}"),
            &[(name, tokio_postgres::types::Type::TEXT)],
        )
        .await
        .expect("lock the row");
    }
    c
}

/// Renewed every 1 s, lost 1 s before the database could let anyone in (a
/// wide margin: the tests assert that order on a loaded machine).
pub fn short() -> LeaseOptions {
    let s = Duration::from_secs(1);
    LeaseOptions::new(3 * s).renew_every(s).safety_margin(s)
}

/// The current term of `name` in the default table, if held (a released
/// row has holder '').
pub async fn row(admin: &Client, name: &str) -> Option<(String, i64)> {
    admin
        .query_typed_opt(
            "SELECT holder, token FROM pgwarden_leases WHERE name = $1 AND holder <> ''",
            &[(&name, Type::TEXT)],
        )
        .await
        .expect("lease row")
        .map(|r| (r.get(0), r.get(1)))
}

/// The lease's expiry in the database, as wall-clock time (the server runs
/// on this machine: one clock).
pub async fn expiry(client: &Client, name: &str) -> SystemTime {
    let secs: f64 = client
        .query_typed_one(
            "SELECT extract(epoch FROM expires_at)::float8 FROM pgwarden_leases WHERE name = $1",
            &[(&name, Type::TEXT)],
        )
        .await
        .expect("lease expiry")
        .get(0);
    UNIX_EPOCH + Duration::from_secs_f64(secs)
}

/// How long before `expiry` the signal came (negative: after), in seconds.
pub fn ahead(lost: SystemTime, expiry: SystemTime) -> f64 {
    match expiry.duration_since(lost) {
        Ok(d) => d.as_secs_f64(),
        Err(e) => -e.duration().as_secs_f64(),
    }
}

/// Inserts, by hand, an expired term of `name` held by `holder` in the
/// default table: what a holder that crashed or was cut off leaves.
pub async fn insert_expired(admin: &Client, name: &str, holder: &str) {
    admin
        .query_typed(
            "INSERT INTO pgwarden_leases (name, holder, token, expires_at)
             VALUES ($1, $2, nextval('pgwarden_leases_token_seq'), now() - interval '1 s')",
            &[(&name, Type::TEXT), (&holder, Type::TEXT)],
        )
        .await
        .expect("an expired term");
}
