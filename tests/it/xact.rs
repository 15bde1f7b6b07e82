//! Transaction-scoped advisory locks, `with_xact_lock` and `migrate_once`
//! against a real PostgreSQL, on every backend: `xact_lock` on a
//! transaction of the caller's own is the backend's (`pgwarden::xact_lock`,
//! `pgwarden::sqlx::xact_lock`, whose sqlx-only cases are in
//! `sqlx_xact_lock.rs`).

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgwarden::{Error, LockError, LockKey, LockMode};
use support::backend::{settled, work_failed, Backend, Settings};
use support::*;

const T: Duration = Duration::from_secs(5);

backends!(xact_lock_bounds_the_wait_and_aborts_the_transaction);
/// The backend's `xact_lock` in a transaction of the caller's own: a wait
/// past its bound is a typed lock timeout and aborts the transaction (as
/// a failed statement does); granted, the transaction's own
/// `lock_timeout` is restored, and the lock is held until COMMIT.
async fn xact_lock_bounds_the_wait_and_aborts_the_transaction<B: Backend>() {
    let db = db().await;
    let raw = db.connect().await.unwrap();
    raw.execute("SELECT pg_advisory_lock(9, 9)", &[])
        .await
        .unwrap();
    let pool = B::build(&db, &Settings::new("xact-bounds", 2));
    let mut src = B::tx_source(&pool).await;

    let mut tx = B::begin(&mut src, None).await;
    let e = B::tx_xact_lock(
        &mut tx,
        LockKey::Pair(9, 9),
        LockMode::Exclusive,
        Some(Duration::from_millis(100)),
    )
    .await
    .unwrap_err();
    assert!(e.is_lock_timeout(), "{e}");
    assert!(matches!(e, Error::Lock(LockError::Timeout { .. })));
    let aborted = B::tx_run(&mut tx, "SELECT 1").await.unwrap_err();
    assert_eq!(B::code(&aborted).as_deref(), Some("25P02"), "{aborted}");
    B::tx_rollback(tx).await.unwrap();

    let mut tx = B::begin(&mut src, None).await;
    B::tx_run(&mut tx, "SET LOCAL lock_timeout = '7s'")
        .await
        .unwrap();
    B::tx_xact_lock(&mut tx, LockKey::Pair(9, 10), LockMode::Exclusive, Some(T))
        .await
        .unwrap();
    let lt = B::tx_text(&mut tx, "SHOW lock_timeout").await.unwrap();
    assert_eq!(lt, "7s", "the transaction's own lock_timeout is restored");
    assert!(
        !free(&raw, LockKey::Pair(9, 10)).await,
        "held until the transaction ends"
    );
    B::tx_commit(tx).await.unwrap();
    assert!(free(&raw, LockKey::Pair(9, 10)).await, "released at commit");
}

backends!(try_and_shared_forms);
/// Two shared holders at once, no writer meanwhile; an exclusive holder
/// refuses a second one's tries (exclusive and shared), and a refused try
/// does not abort its transaction.
async fn try_and_shared_forms<B: Backend>() {
    let db = db().await;
    let raw = db.connect().await.unwrap();
    let pool = B::build(&db, &Settings::new("xact-forms", 3));
    let (mut a, mut b) = (B::tx_source(&pool).await, B::tx_source(&pool).await);
    let key = LockKey::Single(1 << 40);
    let mut ta = B::begin(&mut a, None).await;
    let mut tb = B::begin(&mut b, None).await;
    assert!(B::tx_xact_lock(&mut ta, key, LockMode::Shared, None)
        .await
        .unwrap());
    B::tx_xact_lock(&mut tb, key, LockMode::Shared, Some(T))
        .await
        .unwrap();
    assert!(!free(&raw, key).await, "no writer while readers");
    B::tx_rollback(ta).await.unwrap();
    B::tx_rollback(tb).await.unwrap();
    let mut ta = B::begin(&mut a, None).await;
    assert!(B::tx_xact_lock(&mut ta, key, LockMode::Exclusive, None)
        .await
        .unwrap());
    let mut tb = B::begin(&mut b, None).await;
    assert!(!B::tx_xact_lock(&mut tb, key, LockMode::Exclusive, None)
        .await
        .unwrap());
    assert!(!B::tx_xact_lock(&mut tb, key, LockMode::Shared, None)
        .await
        .unwrap());
    B::tx_run(&mut tb, "SELECT 1")
        .await
        .expect("a refused try does not abort");
    B::tx_commit(ta).await.unwrap();
    assert!(free(&raw, key).await);
    B::tx_rollback(tb).await.unwrap();
}

backends!(with_xact_lock_commits_rolls_back_and_serialises);
async fn with_xact_lock_commits_rolls_back_and_serialises<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("xact-serialises", 6));
    let c = db.connect().await.unwrap();
    c.batch_execute("CREATE TABLE counter (n int NOT NULL); INSERT INTO counter VALUES (0)")
        .await
        .unwrap();
    let key = LockKey::Pair(2, 42);
    let count = || async {
        let row = c.query_one("SELECT n FROM counter", &[]).await.unwrap();
        row.get::<_, i32>(0)
    };

    // Read-modify-write under the lock, ten at once: no lost update.
    let tasks: Vec<_> = (0..10)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move { B::xact_count(&pool, key, T, false).await })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(count().await, 10);

    // The work fails after its write: its error comes back, the write is
    // rolled back.
    let e = B::xact_count(&pool, key, T, true).await.unwrap_err();
    assert_eq!(e.to_string(), work_failed(key).to_string());
    assert_eq!(count().await, 10, "rolled back");
    assert!(free(&c, key).await, "released with the transaction");
    settled::<B>(&pool).await;
}

backends!(run_once_five_starters_run_the_ddl_once);
/// Five instances (a pool each) start the same migration at once: its
/// work (a `CREATE TABLE`: a second run would fail) runs once, the others
/// skip it, no catalog unique violation, one ledger row.
async fn run_once_five_starters_run_the_ddl_once<B: Backend>() {
    let db = db().await;
    let ran = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Barrier::new(5));
    let tasks: Vec<_> = (0..5)
        .map(|_| {
            // Each starter is its own instance: its own pool.
            let pool = B::build(&db, &Settings::new("run-once-five", 2));
            let (ran, gate) = (ran.clone(), gate.clone());
            tokio::spawn(async move {
                gate.wait().await;
                B::migrate(&pool, "app/0001_schema", T, ran).await
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.unwrap().expect("no catalog unique violation"));
    }
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(
        outcomes.iter().filter(|ran| **ran).count(),
        1,
        "{outcomes:?}"
    );
    let c = db.connect().await.unwrap();
    let rows: i64 = c
        .query_one("SELECT count(*) FROM pgwarden_run_once", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 1);
    c.execute("INSERT INTO made VALUES (1)", &[]).await.unwrap();
}

backends!(run_once_records_nothing_when_the_work_fails);
async fn run_once_records_nothing_when_the_work_fails<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("run-once-fails", 3));
    let e = B::migrate_failing(&pool, "m2", T).await.unwrap_err();
    assert!(e.to_string().contains("42703"), "the server's error: {e}");
    // The work creates table `made` again: it would fail had the failed
    // attempt left it.
    let ran = Arc::new(AtomicUsize::new(0));
    let again = B::migrate(&pool, "m2", T, ran.clone()).await.unwrap();
    assert!(again, "the failed attempt left no ledger row and no table");
    let third = B::migrate(&pool, "m2", T, ran.clone()).await.unwrap();
    assert!(!third, "skipped once recorded");
    assert_eq!(ran.load(Ordering::Acquire), 1);
    settled::<B>(&pool).await;
}
