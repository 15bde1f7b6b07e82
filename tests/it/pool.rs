//! The budgeted pool against a real PostgreSQL: session-lock refusals and
//! a checkout dropped while its connection is made on every backend;
//! deadpool's own drop-in use and its builders (`from_url`, `from_config`
//! over deadpool's `Config`) on deadpool alone (the sqlx pool's drop-in
//! use is in `sqlx_pool.rs`). The shell's behaviour on every backend
//! (waits, timeouts, the probe reserve, discard) is in `backends.rs`.

use crate::support;

use std::time::Duration;

use deadpool_postgres::{GenericClient, PoolError};
use pgwarden::{BudgetPolicy, CheckoutError, Error, Lane, LockKey, LockMode, Pool};
use pgwarden_testing::TestDb;
use support::backend::{settled, Backend, Settings};
use support::db;

/// A session lock on key `n`, tried once: the session-lock lane, budgeted.
#[track_caller]
fn lock<B: Backend>(
    pool: &B::Pool,
    n: i64,
) -> impl std::future::Future<Output = Result<Option<B::Lock>, Error>> + '_ {
    B::session_lock(pool, LockKey::Single(n), LockMode::Exclusive, None)
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

backends!(a_checkout_dropped_while_its_connection_is_made_leaves_no_trace);
/// A checkout dropped while the wrapped pool makes its connection (the link
/// partitioned: the connection's start-up gets no answer) gives its
/// admission back: nothing stays counted in use, and the pool serves the
/// next checkout once the link heals.
async fn a_checkout_dropped_while_its_connection_is_made_leaves_no_trace<B: Backend>() {
    let server = pgwarden_testing::TestServer::shared().expect("throwaway PostgreSQL");
    let db = server.create_database().await.unwrap();
    let proxy = pgwarden_testing::Proxy::start(server).expect("proxy");
    let s = Settings::new("dropped-while-connecting", 2);
    let pool = B::build_on(&proxy.pg_config(&db), &s);
    proxy.blackhole();
    let getting = B::get_within(&pool, Duration::from_secs(30));
    let r = tokio::time::timeout(Duration::from_millis(300), getting).await;
    assert!(r.is_err(), "a connection was made through a partition");
    let s = B::status(&pool);
    assert_eq!(
        (s.waiting, s.in_use),
        (0, 0),
        "the dropped checkout still counts: {s}"
    );
    proxy.heal();
    let c = tokio::time::timeout(Duration::from_secs(60), B::get(&pool))
        .await
        .expect("a checkout after the partition healed (60 s: only against a hang)")
        .expect("a connection after the partition healed");
    assert_eq!(B::status(&pool).in_use, 1);
    drop(c);
    settled::<B>(&pool).await;
}

backends!(session_lock_lane_refuses_past_its_budget_naming_the_holders);
async fn session_lock_lane_refuses_past_its_budget_naming_the_holders<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("budget-names", 4));
    let line = line!() + 1;
    let first = lock::<B>(&pool, 1).await.unwrap().unwrap();
    let e = lock::<B>(&pool, 2).await.unwrap_err();
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
    assert_eq!(B::status(&pool).lane(Lane::SessionLock).in_use, 1);
    drop(first);
    let again = lock::<B>(&pool, 2).await.unwrap().unwrap();
    B::unlock(again).await.unwrap();
}

backends!(warn_policy_admits_up_to_the_hard_floor);
async fn warn_policy_admits_up_to_the_hard_floor<B: Backend>() {
    let db = db().await;
    let mut s = Settings::new("warn-floor", 4);
    s.policy = BudgetPolicy::Warn;
    let pool = B::build(&db, &s);
    let a = lock::<B>(&pool, 1).await.unwrap().unwrap();
    let b = lock::<B>(&pool, 2).await.unwrap().unwrap();
    let e = lock::<B>(&pool, 3).await.unwrap_err();
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
    let mut w = B::get(&pool).await.unwrap();
    B::select_1(&mut w).await;
    B::readiness(&pool, Duration::from_secs(60)).await.unwrap();
    drop((a, b, w));
}
