//! The budgeted pool against a real PostgreSQL: drop-in use, lanes, waits,
//! timeouts, refusals, readiness.

use crate::support;

use std::time::Duration;

use deadpool_postgres::{GenericClient, PoolError};
use pgwarden::{BudgetPolicy, CheckoutError, Error, Lane, LockKey, LockMode, Pool, SessionLock};
use pgwarden_testing::TestDb;
use support::{db, within};

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

#[tokio::test]
async fn request_timeout_carries_the_status_and_get_keeps_deadpool_error() {
    let db = db().await;
    let pool = Pool::builder(db.deadpool(3).unwrap())
        .wait_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    // Request max is N - control reserve = 2.
    let a = pool.get().await.unwrap();
    let b = pool.get().await.unwrap();
    let e = pool.get().await.unwrap_err();
    assert!(
        matches!(e, PoolError::Timeout(deadpool_postgres::TimeoutType::Wait)),
        "{e:?}"
    );
    let e = pool
        .get_within(Duration::from_millis(200))
        .await
        .unwrap_err();
    match &e {
        Error::Checkout(CheckoutError::Timeout {
            lane,
            waited,
            status,
            ..
        }) => {
            assert_eq!(*lane, Lane::Request);
            assert!(*waited >= Duration::from_millis(200));
            assert_eq!(status.lane(Lane::Request).in_use, 2);
            assert_eq!(status.lane(Lane::Request).waiting, 1);
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    let msg = e.to_string();
    assert!(
        msg.contains("request 2/2") && msg.contains("waiting 1"),
        "{msg}"
    );
    // The control reserve is still there: readiness answers.
    pool.readiness(Duration::from_secs(60)).await.unwrap();
    assert_eq!(pool.status().waiting, 0);
    drop((a, b));
}

#[tokio::test]
async fn a_cancelled_waiter_leaves_no_trace() {
    let (_db, pool) = pool(2).await;
    let a = pool.get().await.unwrap();
    let waiting = pool.get();
    let r = tokio::time::timeout(Duration::from_millis(50), waiting).await;
    assert!(
        r.is_err(),
        "the request lane of a pool of 2 has one connection"
    );
    let s = pool.status();
    assert_eq!((s.waiting, s.in_use), (0, 1));
    drop(a);
    // Nothing was handed to the dropped waiter: the connection is available.
    let c = tokio::time::timeout(Duration::from_secs(60), pool.get())
        .await
        .unwrap()
        .unwrap();
    drop(c);
    assert_eq!(pool.status().in_use, 0);
}

/// A queued checkout granted while nobody polls it, then dropped without
/// reading its grant: the grant goes back, and the connection is there for
/// the next checkout.
#[tokio::test]
async fn a_checkout_dropped_after_its_grant_gives_it_back() {
    use futures_util::FutureExt;
    let (_db, pool) = pool(2).await;
    let a = pool.get().await.unwrap();
    let mut waiting = Box::pin(pool.get());
    assert!((&mut waiting).now_or_never().is_none());
    assert_eq!(pool.status().waiting, 1);
    // Granted to `waiting` as the connection comes back; not polled since.
    drop(a);
    let s = pool.status();
    assert_eq!(
        (s.waiting, s.in_use),
        (0, 1),
        "the grant went to the waiter"
    );
    drop(waiting);
    let s = pool.status();
    assert_eq!(
        (s.waiting, s.in_use),
        (0, 0),
        "the dropped checkout kept its grant"
    );
    let c = tokio::time::timeout(Duration::from_secs(2), pool.get())
        .await
        .expect("the next checkout waited")
        .unwrap();
    drop(c);
}

/// Many checkouts on few connections, on two worker threads, each given
/// up at a point of its own: after one poll and a yield (granted or not
/// meanwhile), at a timeout that races its grant, or not at all. Whatever the interleaving, every grant ends in a
/// served checkout or goes back: afterwards nothing is in use or waiting,
/// and the next checkout is served at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkouts_given_up_at_any_point_under_contention_leave_no_trace() {
    use futures_util::FutureExt;
    const TASKS: u64 = 24;
    const ROUNDS: u64 = 150;
    let (_db, pool) = pool(4).await;
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let pool = pool.clone();
            tokio::spawn(async move {
                // A small generator of its own per task: the same run each time.
                let mut x = t.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                let mut next = move || {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x
                };
                // Checkouts given up before they were served.
                let mut given_up = 0u32;
                for _ in 0..ROUNDS {
                    match next() % 4 {
                        0 => {
                            let c = pool.get().await.expect("a checkout with time to wait");
                            c.simple_query("SELECT 1").await.expect("SELECT 1");
                        }
                        1 => {
                            let wait = Duration::from_micros(next() % 2_000);
                            match tokio::time::timeout(wait, pool.get()).await {
                                Ok(r) => drop(r.expect("a checkout within its bound")),
                                Err(_) => given_up += 1,
                            }
                        }
                        2 => {
                            // Queued, then left unpolled while others run
                            // (and may grant it), then dropped unread.
                            let mut get = Box::pin(pool.get());
                            if let Some(r) = (&mut get).now_or_never() {
                                drop(r.expect("a checkout admitted at once"));
                            } else {
                                tokio::task::yield_now().await;
                                drop(get);
                                given_up += 1;
                            }
                        }
                        _ => {
                            let c = pool.get().await.expect("a checkout with time to wait");
                            tokio::task::yield_now().await;
                            drop(c);
                        }
                    }
                }
                given_up
            })
        })
        .collect();
    let mut given_up = 0;
    for t in tasks {
        given_up += tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("a task still waiting after 60 s: a grant was lost")
            .unwrap();
    }
    // 24 tasks on the request lane's 3 connections: many queue.
    assert!(given_up > 0, "no checkout was given up: nothing was tried");
    let s = pool.status();
    assert_eq!(
        (s.in_use, s.waiting),
        (0, 0),
        "checkouts given up left a trace: {s:?}"
    );
    // The request lane's three connections, together: none kept by a
    // checkout given up (the pool's wait timeout is 5 s).
    let mut held = Vec::new();
    for _ in 0..3 {
        let c = tokio::time::timeout(Duration::from_secs(2), pool.get())
            .await
            .expect("a connection of the lane is still counted in use")
            .unwrap();
        held.push(c);
    }
    drop(held);
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
async fn control_lane_answers_while_request_traffic_saturates() {
    // The request waiters wait up to an hour: a probe queued behind them
    // would hang past the guard below (no clock on the machine's speed).
    let hour = Duration::from_secs(3600);
    let db = db().await;
    let pool = Pool::builder(db.deadpool(4).unwrap())
        .name("test")
        .wait_timeout(hour)
        .build()
        .unwrap();
    let held: Vec<_> = futures_util::future::join_all((0..3).map(|_| pool.get())).await;
    let held: Vec<_> = held.into_iter().map(Result::unwrap).collect();
    // More request work queues behind them...
    let queued: Vec<_> = (0..4)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move { pool.get().await.map(drop) })
        })
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while pool.status().lane(Lane::Request).waiting < 4 {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::task::yield_now().await;
    }
    // ...and the probe still answers, every time, with the queue still
    // there.
    for _ in 0..5 {
        within(
            Duration::from_secs(60),
            "the probe answers past the queued request work",
            pool.readiness(hour),
        )
        .await
        .unwrap();
        assert_eq!(pool.status().lane(Lane::Request).waiting, 4);
    }
    drop(held);
    for q in queued {
        q.await.unwrap().unwrap();
    }
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

#[tokio::test]
async fn discard_closes_the_backend() {
    let (db, pool) = pool(3).await;
    let c = pool.get().await.unwrap();
    let pid = c.pid();
    c.discard();
    assert_eq!(pool.status().in_use, 0);
    let watcher = db.connect().await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let n: i64 = watcher
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )
            .await
            .unwrap()
            .get(0);
        if n == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "backend {pid} still alive"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The pool opens a new connection in its place.
    let c = pool.get().await.unwrap();
    assert_ne!(c.pid(), pid);
}

#[tokio::test]
async fn a_readiness_bound_of_zero_answers_at_once_and_closes_nothing() {
    let (_db, pool) = pool(2).await;
    pool.readiness(Duration::from_secs(5)).await.unwrap();
    let before = pool.status();
    assert_eq!(
        before.size, 1,
        "the probe opened one connection: {before:?}"
    );
    let err = pool.readiness(Duration::ZERO).await.unwrap_err();
    assert!(
        matches!(err, Error::Checkout(CheckoutError::ReadinessTimeout(d)) if d.is_zero()),
        "{err}"
    );
    let after = pool.status();
    assert_eq!(
        (after.size, after.idle, after.in_use),
        (1, 1, 0),
        "a bound of zero checks nothing out and closes no healthy connection: {after:?}"
    );
}
