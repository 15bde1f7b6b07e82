//! The budgeted deadpool pool against a real PostgreSQL: drop-in use,
//! session-lock refusals, a checkout dropped while its connection is made.
//! The shell's behaviour on every backend (waits, timeouts, the probe
//! reserve, discard) is in `backends.rs`.

use crate::support;

use std::time::Duration;

use deadpool_postgres::{GenericClient, PoolError};
use pgwarden::{BudgetPolicy, CheckoutError, Error, Lane, LockKey, LockMode, Pool, SessionLock};
use pgwarden_testing::TestDb;
use support::db;

/// A session lock on key `n`, tried once: the session-lock lane, budgeted.
#[track_caller]
fn lock(
    pool: &Pool,
    n: i64,
) -> impl std::future::Future<Output = Result<Option<SessionLock>, Error>> + '_ {
    pool.session_lock(LockKey::Single(n), LockMode::Exclusive, None)
}

async fn pool(size: usize) -> (TestDb, Pool) {
    let db = db().await;
    let pool = Pool::builder(db.deadpool(size).unwrap())
        .name("test")
        .wait_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    (db, pool)
}

// ---- drop-in: code written against deadpool, with only the pool type changed ----

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error(transparent)]
    Db(#[from] tokio_postgres::Error),
}

#[derive(Clone, Debug)]
struct AppState {
    pool: Pool,
}

async fn count_rows(client: &impl GenericClient) -> Result<i64, AppError> {
    let stmt = client.prepare_cached("SELECT count(*) FROM items").await?;
    Ok(client.query_one(&stmt, &[]).await?.get(0))
}

async fn handler(state: AppState, name: &str) -> Result<i64, AppError> {
    let mut client = state.pool.get().await?;
    let stmt = client
        .prepare_cached("INSERT INTO items (name) VALUES ($1) RETURNING id")
        .await?;
    let tx = client.transaction().await?;
    let id: i64 = tx.query_one(&stmt, &[&name]).await?.get(0);
    tx.commit().await?;
    let rows = client
        .query("SELECT name FROM items WHERE id = $1", &[&id])
        .await?;
    assert_eq!(rows[0].get::<_, String>(0), name);
    count_rows(&*client).await
}

fn assert_send_sync<T: Send + Sync>() {}

#[tokio::test]
async fn deadpool_code_runs_through_conn_unchanged() {
    assert_send_sync::<Pool>();
    assert_send_sync::<pgwarden::Client>();
    let (_db, pool) = pool(4).await;
    pool.get()
        .await
        .unwrap()
        .batch_execute("CREATE TABLE items (id bigserial PRIMARY KEY, name text NOT NULL)")
        .await
        .unwrap();
    let state = AppState { pool: pool.clone() };
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            tokio::spawn(handler(
                state.clone(),
                Box::leak(format!("item-{i}").into_boxed_str()),
            ))
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let c = pool.get().await.unwrap();
    assert_eq!(count_rows(&*c).await.unwrap(), 8);
    // A rolled-back transaction leaves nothing behind.
    drop(c);
    let mut c = pool.get().await.unwrap();
    let tx = c.transaction().await.unwrap();
    tx.execute("INSERT INTO items (name) VALUES ('x')", &[])
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(count_rows(&*c).await.unwrap(), 8);
    assert!(format!("{state:?}").contains("Pool"));
}

#[tokio::test]
async fn builds_from_url_and_config() {
    let db = db().await;
    let p = Pool::from_url(&db.url(), 3)
        .unwrap()
        .name("from-url")
        .build()
        .unwrap();
    assert_eq!(p.status().max, 3);
    let v: i32 = p
        .get()
        .await
        .unwrap()
        .query_one("SELECT 7", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(v, 7);

    let pg = db.pg_config();
    let mut cfg = deadpool_postgres::Config::new();
    cfg.host = pg.get_hosts().first().map(|h| match h {
        tokio_postgres::config::Host::Unix(p) => p.to_string_lossy().into_owned(),
        tokio_postgres::config::Host::Tcp(h) => h.clone(),
    });
    cfg.port = pg.get_ports().first().copied();
    cfg.user = pg.get_user().map(str::to_owned);
    cfg.dbname = Some(db.name().to_owned());
    cfg.pool = Some(deadpool_postgres::PoolConfig::new(5));
    let p = Pool::from_config(&cfg).unwrap().build().unwrap();
    assert_eq!(p.status().max, 5);
    p.readiness(Duration::from_secs(60)).await.unwrap();

    assert!(matches!(
        Pool::from_url("postgres://[::1", 2),
        Err(pgwarden::BuildError::InvalidUrl(_))
    ));
    let e = Pool::builder(db.deadpool(1).unwrap()).build().unwrap_err();
    assert!(
        matches!(
            e,
            pgwarden::BuildError::Limits(pgwarden::LimitsError::TooSmall { size: 1 })
        ),
        "{e}"
    );
    let e = Pool::builder(db.deadpool(4).unwrap())
        .name("bad name; drop table")
        .build()
        .unwrap_err();
    assert!(matches!(e, pgwarden::BuildError::InvalidName(_)));
}

#[tokio::test]
async fn conn_knows_lane_pid_site_and_age() {
    let (_db, pool) = pool(3).await;
    let before = std::time::Instant::now();
    let line = line!() + 1;
    let c = pool.get().await.unwrap();
    assert_eq!(c.lane(), Lane::Request);
    assert_eq!(c.site().file(), file!());
    assert_eq!(c.site().line(), line);
    assert!(c.since() >= before);
    let pid: i32 = c
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(c.pid(), pid);
    let held = lock(&pool, 1).await.unwrap().unwrap();
    let ctl = held.client();
    assert_eq!(ctl.lane(), Lane::SessionLock);
    assert_ne!(ctl.pid(), c.pid());
    let s = pool.status();
    assert_eq!(
        (
            s.in_use,
            s.lane(Lane::Request).in_use,
            s.lane(Lane::SessionLock).in_use
        ),
        (2, 1, 1)
    );
    drop(c);
    // A connection reused: handed out within the call that checked it out
    // (its time is the one deadpool reads as it recycles the connection).
    let before = std::time::Instant::now();
    let c = pool.get().await.unwrap();
    let after = std::time::Instant::now();
    assert_eq!(c.pid(), pid, "the idle connection is reused");
    assert!(
        before <= c.since() && c.since() <= after,
        "handed out at {:?}, called {:?} to {:?}",
        c.since(),
        before,
        after
    );
    drop(c);
    held.unlock().await.unwrap();
    assert_eq!(pool.status().in_use, 0);
}

/// A checkout dropped while deadpool makes its connection (the link
/// partitioned: the connection's start-up gets no answer) gives its
/// admission back: nothing stays counted in use, and the pool serves the
/// next checkout once the link heals.
#[tokio::test]
async fn a_checkout_dropped_while_its_connection_is_made_leaves_no_trace() {
    let server = pgwarden_testing::TestServer::shared().expect("throwaway PostgreSQL");
    let db = server.create_database().await.unwrap();
    let proxy = pgwarden_testing::Proxy::start(server).expect("proxy");
    let pool = Pool::builder(proxy.deadpool(&db, 2).unwrap())
        .name("dropped-while-connecting")
        .census_interval(None)
        .build()
        .unwrap();
    proxy.blackhole();
    let getting = pool.get_within(Duration::from_secs(30));
    let r = tokio::time::timeout(Duration::from_millis(300), getting).await;
    assert!(r.is_err(), "a connection was made through a partition");
    let s = pool.status();
    assert_eq!(
        (s.waiting, s.in_use),
        (0, 0),
        "the dropped checkout still counts: {s}"
    );
    proxy.heal();
    let c = tokio::time::timeout(Duration::from_secs(60), pool.get())
        .await
        .expect("a checkout after the partition healed (60 s: only against a hang)")
        .expect("a connection after the partition healed");
    assert_eq!(pool.status().in_use, 1);
    drop(c);
    assert_eq!(pool.status().in_use, 0);
}

#[tokio::test]
async fn session_lock_lane_refuses_past_its_budget_naming_the_holders() {
    let (_db, pool) = pool(4).await;
    let line = line!() + 1;
    let first = lock(&pool, 1).await.unwrap().unwrap();
    let e = lock(&pool, 2).await.unwrap_err();
    assert!(e.is_budget_exhausted());
    let msg = e.to_string();
    assert!(
        msg.contains("session_lock budget exhausted: 1 of 1 in use"),
        "{msg}"
    );
    assert!(
        msg.contains(&format!("{}:{line}", file!())),
        "names the holder's call site: {msg}"
    );
    assert!(
        msg.contains("lease") && msg.contains("transaction-scoped lock"),
        "{msg}"
    );
    // A refusal changes nothing.
    assert_eq!(pool.status().lane(Lane::SessionLock).in_use, 1);
    drop(first);
    let again = lock(&pool, 2).await.unwrap().unwrap();
    again.unlock().await.unwrap();
}

#[tokio::test]
async fn warn_policy_admits_up_to_the_hard_floor() {
    let db = db().await;
    let pool = Pool::builder(db.deadpool(4).unwrap())
        .policy(BudgetPolicy::Warn)
        .build()
        .unwrap();
    let a = lock(&pool, 1).await.unwrap().unwrap();
    let b = lock(&pool, 2).await.unwrap().unwrap();
    let e = lock(&pool, 3).await.unwrap_err();
    match &e {
        Error::Checkout(CheckoutError::BudgetExhausted {
            hard_floor,
            limit,
            in_use,
            holders,
            ..
        }) => {
            assert!(*hard_floor);
            assert_eq!((*limit, *in_use, holders.len()), (2, 2, 2));
        }
        other => panic!("{other:?}"),
    }
    // The work under both locks still gets a connection, and readiness answers.
    let w = pool.get().await.unwrap();
    w.simple_query("SELECT 1").await.unwrap();
    pool.readiness(Duration::from_secs(60)).await.unwrap();
    drop((a, b, w));
}
