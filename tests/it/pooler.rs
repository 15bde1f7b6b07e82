//! Transaction poolers, on every backend: detection against PostgreSQL and
//! a real PgBouncer in transaction mode; behind it session locks are
//! refused and everything else pgwarden does works (its statements are
//! unnamed or simple).

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgwarden::{LockKey, LockMode, PoolerMode};
use pgwarden_testing::{require_tool, PgBouncer, TestServer};
use support::backend::{settled, Backend, Settings};
use support::*;

const T: Duration = Duration::from_secs(5);

backends!(direct_postgres_is_detected_direct);
async fn direct_postgres_is_detected_direct<B: Backend>() {
    let db = db().await;
    let pool = B::build(
        &db,
        &Settings::new("detect-direct", 4).pooler(PoolerMode::Auto),
    );
    assert_eq!(
        B::status(&pool).size,
        0,
        "not probed yet: no connection opened"
    );
    assert_eq!(B::detect_pooler(&pool).await.unwrap(), PoolerMode::Direct);
    assert_eq!(B::detect_pooler(&pool).await.unwrap(), PoolerMode::Direct);
    settled::<B>(&pool).await;
    // The probe sets nothing in the session (an earlier one did).
    let mut c = B::get(&pool).await.unwrap();
    let left = B::count(
        &mut c,
        "SELECT count(*) FROM (SELECT nullif(current_setting('pgwarden.probe', true), '') AS v) s \
          WHERE v IS NOT NULL",
    )
    .await;
    assert_eq!(left, 0);
}

backends!(lazy_detection_at_the_first_session_lock_allows_it_direct);
async fn lazy_detection_at_the_first_session_lock_allows_it_direct<B: Backend>() {
    let db = db().await;
    let pool = B::build(
        &db,
        &Settings::new("detect-lazy", 4).pooler(PoolerMode::Auto),
    );
    let lock = B::session_lock(&pool, LockKey::Single(1), LockMode::Exclusive, Some(T))
        .await
        .unwrap()
        .expect("a wait grants the lock or fails");
    assert_eq!(B::detect_pooler(&pool).await.unwrap(), PoolerMode::Direct);
    B::unlock(lock).await.unwrap();
    settled::<B>(&pool).await;
}

backends!(configured_transaction_pooler_refuses_session_locks_without_a_probe);
async fn configured_transaction_pooler_refuses_session_locks_without_a_probe<B: Backend>() {
    let db = db().await;
    let pool = B::build(
        &db,
        &Settings::new("configured-tx", 4).pooler(PoolerMode::Transaction),
    );
    let e = B::session_lock(&pool, LockKey::Single(1), LockMode::Exclusive, None)
        .await
        .unwrap_err();
    assert!(e.is_behind_pooler(), "{e}");
    assert!(e.to_string().contains("(configured)"), "{e}");
    assert_eq!(B::status(&pool).size, 0, "refused before any checkout");
    assert_eq!(
        B::detect_pooler(&pool).await.unwrap(),
        PoolerMode::Transaction
    );
}

fn bouncer(db: &pgwarden_testing::TestDb) -> Option<PgBouncer> {
    if !require_tool("pgbouncer").expect("pgbouncer is required on CI") {
        return None;
    }
    Some(PgBouncer::start(TestServer::shared().unwrap(), db).expect("pgbouncer"))
}

/// A pool of `size` of backend `B` through `b`, left to detect its pooler.
fn through<B: Backend>(b: &PgBouncer, size: usize) -> B::Pool {
    let s = Settings::new("through", size)
        .wait(T)
        .pooler(PoolerMode::Auto);
    B::build_through(b, &s)
}

backends!(behind_pgbouncer_session_locks_are_refused_and_the_rest_works);
async fn behind_pgbouncer_session_locks_are_refused_and_the_rest_works<B: Backend>() {
    let db = db().await;
    let Some(bouncer) = bouncer(&db) else { return };

    // Detected lazily, at the first session lock.
    let pool = through::<B>(&bouncer, 4);
    let e = B::session_lock(&pool, LockKey::Single(5), LockMode::Exclusive, Some(T))
        .await
        .unwrap_err();
    assert!(e.is_behind_pooler(), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("(detected)") && msg.contains("with_xact_lock") && msg.contains("lease"),
        "{msg}"
    );
    assert_eq!(
        B::detect_pooler(&pool).await.unwrap(),
        PoolerMode::Transaction
    );
    assert!(
        B::session_lock(&pool, LockKey::Single(5), LockMode::Shared, None)
            .await
            .unwrap_err()
            .is_behind_pooler()
    );
    settled::<B>(&pool).await;

    // Detected on demand.
    let pool = through::<B>(&bouncer, 4);
    assert_eq!(
        B::detect_pooler(&pool).await.unwrap(),
        PoolerMode::Transaction
    );

    // Transaction locks work, and serialise.
    let raw = db.connect().await.unwrap();
    raw.batch_execute("CREATE TABLE counter (n int NOT NULL); INSERT INTO counter VALUES (0)")
        .await
        .unwrap();
    // Each read-modify-write with a window (`Backend::xact_count`).
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move { B::xact_count(&pool, LockKey::Pair(2, 1), T, false).await })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let n: i32 = raw
        .query_one("SELECT n FROM counter", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 8);

    let mut src = B::tx_source(&pool).await;
    let mut tx = B::begin(&mut src, None).await;
    assert!(
        B::tx_xact_lock(&mut tx, LockKey::Single(6), LockMode::Exclusive, None)
            .await
            .unwrap()
    );
    assert!(!free(&raw, LockKey::Single(6)).await);
    B::tx_commit(tx).await.unwrap();
    drop(src);

    // migrate_once and the census, through the pooler.
    let ran = Arc::new(AtomicUsize::new(0));
    for _ in 0..2 {
        B::migrate(&pool, "bouncer/0001", T, ran.clone())
            .await
            .unwrap();
    }
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    raw.execute("SELECT pg_advisory_lock(7)", &[])
        .await
        .unwrap();
    let census = B::census(&pool).await.unwrap();
    assert!(
        census.locks.iter().any(|l| l.key == LockKey::Single(7)),
        "{census:?}"
    );
    assert_eq!(
        census.ours().count(),
        0,
        "pids mean nothing behind a pooler"
    );
    assert!(B::readiness(&pool, T).await.is_ok());
}

/// A pool told it goes straight to PostgreSQL, through PgBouncer in
/// transaction mode with two server connections: the test pins them with
/// raw transactions so that the guard's unlock lands on the other one.
struct Pinned<B: Backend> {
    bouncer: PgBouncer,
    raw: tokio_postgres::Client,
    pool: B::Pool,
}

impl<B: Backend> Pinned<B> {
    async fn new(db: &pgwarden_testing::TestDb, unlock_timeout: Duration) -> Option<Pinned<B>> {
        if !require_tool("pgbouncer").expect("pgbouncer is required on CI") {
            return None;
        }
        let server = TestServer::shared().unwrap();
        let bouncer = PgBouncer::start_with_pool_size(server, db, 2).expect("pgbouncer");
        let s = Settings::new("pinned", 4)
            .pooler(PoolerMode::Direct)
            .unlock_timeout(unlock_timeout)
            .wait(T);
        let pool = B::build_through(&bouncer, &s);
        let raw = db.connect().await.unwrap();
        Some(Pinned { bouncer, raw, pool })
    }

    /// A client through PgBouncer inside a transaction: it holds one of the
    /// two server connections. Returns it and that backend's pid.
    async fn pin(&self) -> (tokio_postgres::Client, i32) {
        let c = self.bouncer.connect().await.unwrap();
        c.batch_execute("BEGIN").await.unwrap();
        let pid = c
            .query_typed_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        (c, pid)
    }

    /// The backends holding advisory locks, seen on the server itself.
    async fn holders(&self) -> Vec<i32> {
        raw_locks(&self.raw).await.iter().map(|l| l.0).collect()
    }
}

backends!(an_unlock_a_pooler_moved_names_the_pooler_and_the_backend_left_holding_it);
async fn an_unlock_a_pooler_moved_names_the_pooler_and_the_backend_left_holding_it<B: Backend>() {
    let db = db().await;
    let Some(p) = Pinned::<B>::new(&db, Duration::from_millis(300)).await else {
        return;
    };
    let key = LockKey::Pair(13, 1);
    let (first, s1) = p.pin().await;
    // The only other server connection takes the lock.
    let lock = B::session_lock(&p.pool, key, LockMode::Exclusive, Some(T))
        .await
        .unwrap()
        .expect("a wait grants the lock or fails");
    let holders = p.holders().await;
    let s2 = holders[0];
    assert_eq!(holders.len(), 1);
    assert_ne!(s2, s1);
    // Another client holds that server connection; the first one is free.
    let (second, pinned) = p.pin().await;
    assert_eq!(pinned, s2, "the only idle server connection");
    first.batch_execute("COMMIT").await.unwrap();

    let e = B::unlock(lock).await.unwrap_err();
    assert!(e.is_not_owned() && e.is_behind_pooler(), "{e:?}");
    let msg = e.to_string();
    for part in [
        "transaction-mode pooler".to_owned(),
        format!("ran the guard's statement on backend pid {s1}, not on pid {s2}"),
        format!("pg_terminate_backend({s2})"),
        "PoolerMode::Transaction".to_owned(),
    ] {
        assert!(msg.contains(&part), "{part:?} not in: {msg}");
    }
    assert!(!msg.contains("raw pg_advisory_unlock"), "{msg}");
    // What it reports is so: the lock is still on that server connection.
    assert_eq!(p.holders().await, vec![s2]);
    let released: bool = second
        .query_one("SELECT pg_advisory_unlock(13, 1)", &[])
        .await
        .unwrap()
        .get(0);
    assert!(released);
    second.batch_execute("COMMIT").await.unwrap();
    assert!(p.holders().await.is_empty());
}

// Ignored on sqlx: the test's event, not a library race (stop 40, shown
// with the server's log, `log_min_duration_statement = 0`, 2 of 8 runs
// failing with two CPU burners). sqlx sends the unlock's statement in two
// syncs, and this pool is told `Direct`, so they go unpinned: the first
// attempt's `Parse` ran on the other server connection y, which sets its
// text in pg_stat_activity, and is all this test's `eventually` waits for.
// On a loaded machine the test's `pin()` then took y before sqlx's `Bind`
// came; the `Bind` waited for a server connection, got x (the lock's) once
// its `COMMIT` freed it, and failed there ("unnamed prepared statement does
// not exist", 26000); the statement layer learned the connections move and
// sent it again pinned, and it ran, for the first time, on x: released on
// its own backend, so `Ok(())` is the true answer and nothing is left
// (`[]`). On a quiet machine the `Bind` follows the `Parse` on y at once
// and the unlock answers as the test expects. No event in pg_stat_activity
// tells a parsed statement from an executed one.
backends!(
    ignore_sqlx = "test's event: on sqlx (two syncs, unpinned on a pool told Direct) the unlock's Parse alone shows on the other backend; under load its Bind then reaches the lock's own backend first and Ok(()) is the true answer (server log, stop 40)",
    a_lock_a_pooler_moved_is_released_on_its_backend_once_reachable
);
async fn a_lock_a_pooler_moved_is_released_on_its_backend_once_reachable<B: Backend>() {
    released_once_reachable::<B>(T, LockKey::Pair(13, 2)).await;
}

// The same scenario, the same event (see above).
backends!(
    ignore_sqlx = "test's event: on sqlx (two syncs, unpinned on a pool told Direct) the unlock's Parse alone shows on the other backend; under load its Bind then reaches the lock's own backend first and Ok(()) is the true answer (server log, stop 40)",
    an_unbounded_unlock_timeout_reaches_a_moved_lock_without_panicking
);
/// The same with an unlock timeout of `Duration::MAX`: the bound saturates
/// (it once overflowed `Instant + Duration` and panicked).
async fn an_unbounded_unlock_timeout_reaches_a_moved_lock_without_panicking<B: Backend>() {
    released_once_reachable::<B>(Duration::MAX, LockKey::Pair(13, 3)).await;
}

async fn released_once_reachable<B: Backend>(unlock_timeout: Duration, key: LockKey) {
    let db = db().await;
    let Some(p) = Pinned::<B>::new(&db, unlock_timeout).await else {
        return;
    };
    let mut lock = B::session_lock(&p.pool, key, LockMode::Exclusive, Some(T))
        .await
        .unwrap()
        .expect("a wait grants the lock or fails");
    // Held twice: reaching the backend must release every level.
    assert_eq!(B::lock_again(&mut lock).await.unwrap(), 2);
    let x = p.holders().await[0];
    // The lock's server connection was released last: a new transaction gets it.
    let (on_x, pid) = p.pin().await;
    assert_eq!(pid, x);
    let unlock = tokio::spawn(B::unlock(lock));
    // The unlock runs on the other server connection, then keeps trying to
    // reach the lock's own (the statement shows in pg_stat_activity).
    let raw = &p.raw;
    eventually(
        T,
        "the unlock tries to reach the lock's backend",
        || async {
            raw.query_one(
                "SELECT count(*) FROM pg_stat_activity \
              WHERE pid NOT IN ($1, pg_backend_pid()) \
                AND query LIKE '%CASE WHEN pg_catalog.pg_backend_pid() = $1%'",
                &[&x],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
                > 0
        },
    )
    .await;
    // Hold that other one too, so the next try waits for a free server
    // connection: the lock's, once its transaction ends.
    let (on_y, y) = p.pin().await;
    assert_ne!(y, x);
    on_x.batch_execute("COMMIT").await.unwrap();
    let r = tokio::time::timeout(T + T, unlock)
        .await
        .expect("unlock returns within its bound")
        .unwrap();
    let holders = p.holders().await;
    let e = r.expect_err(&format!(
        "{}: Ok from an unlock that must reach pid {x} (other {y}); advisory locks now on {holders:?}",
        B::NAME
    ));
    assert!(e.is_behind_pooler(), "{e:?}");
    assert!(
        e.to_string()
            .contains(&format!("the lock was released on pid {x}")),
        "{e}"
    );
    assert!(p.holders().await.is_empty(), "released on its backend");
    on_y.batch_execute("COMMIT").await.unwrap();
}
