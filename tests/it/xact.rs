//! Transaction-scoped advisory locks, `with_xact_lock` and `migrate_once`
//! against a real PostgreSQL. `with_xact_lock` and `migrate_once` run on
//! every backend; `xact_lock` on a transaction of the caller's own here
//! on deadpool (it takes a `tokio_postgres::Transaction`), and its sqlx
//! counterpart, `pgwarden::sqlx::xact_lock`, in `sqlx_xact_lock.rs`.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgwarden::{xact_lock, Error, LockError, LockKey, Migrated};
use support::backend::{settled, work_failed, Backend, Settings};
use support::*;
use tokio_postgres::error::SqlState;

const T: Duration = Duration::from_secs(5);

#[tokio::test]
async fn xact_lock_bounds_the_wait_and_aborts_the_transaction() {
    let db = db().await;
    let raw = db.connect().await.unwrap();
    raw.execute("SELECT pg_advisory_lock(9, 9)", &[])
        .await
        .unwrap();
    let mut c = db.connect().await.unwrap();

    let tx = c.transaction().await.unwrap();
    let e = xact_lock(
        &tx,
        LockKey::Pair(9, 9),
        pgwarden::LockMode::Exclusive,
        Some(Duration::from_millis(100)),
    )
    .await
    .unwrap_err();
    assert!(e.is_lock_timeout(), "{e}");
    assert!(matches!(e, Error::Lock(LockError::Timeout { .. })));
    let aborted = tx.query_one("SELECT 1", &[]).await.unwrap_err();
    assert_eq!(aborted.code(), Some(&SqlState::IN_FAILED_SQL_TRANSACTION));
    drop(tx);

    let tx = c.transaction().await.unwrap();
    tx.batch_execute("SET LOCAL lock_timeout = '7s'")
        .await
        .unwrap();
    xact_lock(
        &tx,
        LockKey::Pair(9, 10),
        pgwarden::LockMode::Exclusive,
        Some(T),
    )
    .await
    .unwrap();
    let lt: String = tx.query_one("SHOW lock_timeout", &[]).await.unwrap().get(0);
    assert_eq!(lt, "7s", "the transaction's own lock_timeout is restored");
    assert!(
        !free(&raw, LockKey::Pair(9, 10)).await,
        "held until the transaction ends"
    );
    tx.commit().await.unwrap();
    assert!(free(&raw, LockKey::Pair(9, 10)).await, "released at commit");
}

#[tokio::test]
async fn try_and_shared_forms() {
    let db = db().await;
    let raw = db.connect().await.unwrap();
    let (mut a, mut b) = (db.connect().await.unwrap(), db.connect().await.unwrap());
    let key = LockKey::Single(1 << 40);
    let ta = a.transaction().await.unwrap();
    let tb = b.transaction().await.unwrap();
    assert!(xact_lock(&ta, key, pgwarden::LockMode::Shared, None)
        .await
        .unwrap());
    xact_lock(&tb, key, pgwarden::LockMode::Shared, Some(T))
        .await
        .unwrap();
    assert!(!free(&raw, key).await, "no writer while readers");
    ta.rollback().await.unwrap();
    tb.rollback().await.unwrap();
    let ta = a.transaction().await.unwrap();
    assert!(xact_lock(&ta, key, pgwarden::LockMode::Exclusive, None)
        .await
        .unwrap());
    let tb = b.transaction().await.unwrap();
    assert!(!xact_lock(&tb, key, pgwarden::LockMode::Exclusive, None)
        .await
        .unwrap());
    assert!(!xact_lock(&tb, key, pgwarden::LockMode::Shared, None)
        .await
        .unwrap());
    tb.query_one("SELECT 1", &[])
        .await
        .expect("a refused try does not abort");
    ta.commit().await.unwrap();
    assert!(free(&raw, key).await);
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

#[tokio::test]
async fn run_once_five_starters_run_the_ddl_once() {
    let db = db().await;
    let ran = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Barrier::new(5));
    let tasks: Vec<_> = (0..5)
        .map(|_| {
            // Each starter is its own instance: its own pool.
            let pool = builder(&db, 2).build().unwrap();
            let (ran, gate) = (ran.clone(), gate.clone());
            tokio::spawn(async move {
                gate.wait().await;
                pool.migrate_once("app/0001_schema", T, move |tx| {
                    Box::pin(async move {
                        tx.batch_execute(
                            "CREATE SCHEMA IF NOT EXISTS app;
                             CREATE TABLE IF NOT EXISTS app.items (id bigint PRIMARY KEY, name text)",
                        )
                        .await?;
                        ran.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, Error>("created")
                    })
                })
                .await
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.unwrap().expect("no catalog unique violation"));
    }
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(
        outcomes
            .iter()
            .filter(|o| matches!(o, Migrated::Ran(_)))
            .count(),
        1,
        "{outcomes:?}"
    );
    assert!(outcomes.contains(&Migrated::Ran("created")));
    let c = db.connect().await.unwrap();
    let rows: i64 = c
        .query_one("SELECT count(*) FROM pgwarden_run_once", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 1);
    c.execute("INSERT INTO app.items VALUES (1, 'x')", &[])
        .await
        .unwrap();
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
