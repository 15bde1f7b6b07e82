//! Lease tests' helpers: deadpool pools with a known `application_name`
//! (for the tests that stay deadpool-only; a backend-generic test names its
//! pool with `support::backend::{named, pool_on}`), views of the lease
//! table and of the holders' backends, and the lease options the fault
//! tests share.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pgwarden::{LeaseOptions, Leases, Pool, PoolerMode};
use pgwarden_testing::TestDb;
use tokio_postgres::types::Type;
use tokio_postgres::Client;

/// A pgwarden pool of `size` on `db`, its backends named `app` in
/// `pg_stat_activity.application_name`.
pub fn pool(db: &TestDb, size: usize, app: &str) -> Pool {
    pool_with(db.pg_config(), size, app)
}

/// The same, connecting with `config` (another user, PgBouncer).
pub fn pool_with(config: tokio_postgres::Config, size: usize, app: &str) -> Pool {
    pool_behind(config, size, app, PoolerMode::Auto)
}

/// The same, its pooler configured as `pooler` (`Auto`: detected).
pub fn pool_behind(
    mut config: tokio_postgres::Config,
    size: usize,
    app: &str,
    pooler: PoolerMode,
) -> Pool {
    config.application_name(app);
    let inner = pgwarden_testing::deadpool(config, size).expect("deadpool");
    let mut builder = Pool::builder(inner)
        .name(app)
        .wait_timeout(Duration::from_secs(5));
    if pooler != PoolerMode::Auto {
        builder = builder.pooler(pooler);
    }
    builder.build().expect("pgwarden pool")
}

/// Backend pids of the connections named `app`.
pub async fn backends(admin: &Client, app: &str) -> Vec<i32> {
    admin
        .query_typed(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1",
            &[(&app, Type::TEXT)],
        )
        .await
        .expect("pg_stat_activity")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// The number of backends named `app` waiting on a lock, or running a
/// statement at all (`active`).
pub async fn busy_backends(admin: &Client, app: &str) -> (i64, i64) {
    let row = admin
        .query_typed_one(
            "SELECT count(*) FILTER (WHERE wait_event_type = 'Lock'),
                    count(*) FILTER (WHERE state = 'active')
               FROM pg_stat_activity WHERE application_name = $1",
            &[(&app, Type::TEXT)],
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
            &[(name, Type::TEXT)],
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

/// The default lease table's names, in order (released rows included).
pub async fn names(admin: &Client) -> Vec<String> {
    admin
        .query_typed("SELECT name FROM pgwarden_leases ORDER BY name", &[])
        .await
        .expect("lease names")
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect()
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
