//! On every backend: through PgBouncer in session mode a client keeps its server session:
//! detection says Direct every time, and session locks work, each checked on
//! its own connection (a proxy whose mode cannot be read). Switched to
//! transaction mode under the pools' feet, that check refuses every lock
//! and leaves none behind.
use crate::support;

use std::time::Instant;

use futures_util::StreamExt;

use pgwarden::{LockKey, PoolerMode};
use pgwarden_testing::PoolMode;
use support::backend::Backend;
use support::pooler::*;
use support::*;

backends!(
    soak,
    a_loaded_session_pooler_is_direct_every_time_and_its_locks_work,
    flavor = "multi_thread",
    worker_threads = 2
);
async fn a_loaded_session_pooler_is_direct_every_time_and_its_locks_work<B: Backend>() {
    let tries = tries();
    let db = db().await;
    // Session mode: every client holds a server connection for its life.
    // 32 for the load, 8 for the detections, 8 more for the pools closed
    // just before (their server connections go back to PgBouncer only once
    // their clients' closes reach it: with no slack, a detection waited
    // 5 s in PgBouncer's queue once on a loaded machine, both backends').
    let Some(bouncer) = bouncer(&db, 48, PoolMode::Session) else {
        return;
    };
    let load = load_through(&bouncer).await;
    logs();
    // PARALLEL detections at a time: each holds two server connections
    // (the motion probe's) of the 16 the load leaves free, so none waits
    // in PgBouncer's queue.
    let times =
        direct_detections::<B>(tries, |i| through::<B>(&bouncer, &format!("session-{i}"))).await;
    let counts = statements::<B>("session-");
    assert_eq!(counts, vec![42; tries], "1 + 1 + 40 probe statements each");

    // Session locks work through it, checked on their own connection.
    let raw = db.connect().await.unwrap();
    let pool = through::<B>(&bouncer, "locks");
    let rival = through::<B>(&bouncer, "rival");
    let mut lock_times = Vec::new();
    for i in 0..10 {
        let key = LockKey::Pair(11, i);
        let start = Instant::now();
        let lock = B::session_lock(&pool, key, pgwarden::LockMode::Exclusive, Some(T))
            .await
            .unwrap()
            .expect("a wait grants the lock or fails");
        lock_times.push(start.elapsed());
        assert!(!free(&raw, key).await, "held on the server");
        assert!(
            B::session_lock(&rival, key, pgwarden::LockMode::Exclusive, None)
                .await
                .unwrap()
                .is_none()
        );
        B::unlock(lock).await.unwrap();
        assert!(free(&raw, key).await, "released on the server");
    }
    assert_eq!(B::detect_pooler(&pool).await.unwrap(), PoolerMode::Direct);
    load.stop().await;
    assert!(raw_locks(&raw).await.is_empty());
    eprintln!(
        "{}: {tries}/{tries} direct through a session pooler; detection {}; \
         session lock with its check {}",
        B::NAME,
        summary(times),
        summary(lock_times)
    );
}

backends!(
    a_transaction_pooler_detection_missed_is_caught_at_the_lock,
    flavor = "multi_thread",
    worker_threads = 2
);
async fn a_transaction_pooler_detection_missed_is_caught_at_the_lock<B: Backend>() {
    const POOLS: usize = 16;
    let db = db().await;
    let Some(bouncer) = bouncer(&db, 40, PoolMode::Session) else {
        return;
    };
    // Detection through the session pooler: Direct, its mode unproven.
    // At once: each pool keeps its one server connection (16 of 40).
    let pools: Vec<_> = futures_util::future::join_all((0..POOLS).map(|i| {
        let pool = through::<B>(&bouncer, &format!("missed-{i}"));
        async move {
            assert_eq!(B::detect_pooler(&pool).await.unwrap(), PoolerMode::Direct);
            pool
        }
    }))
    .await;
    // Now it pools transactions, under load.
    bouncer
        .set_pool_mode(PoolMode::Transaction)
        .await
        .expect("switch to transaction mode");
    let load = load_through(&bouncer).await;
    // PARALLEL pools at a time (transaction mode: server connections are
    // shared, the pools' own probes included).
    let times: Vec<_> = futures_util::stream::iter(pools.iter().enumerate())
        .map(|(i, pool)| async move {
            let key = LockKey::Pair(12, i as i32);
            let start = Instant::now();
            let e = match B::session_lock(pool, key, pgwarden::LockMode::Exclusive, Some(T)).await {
                Err(e) => e,
                Ok(lock) => panic!("pool {i}: granted through a transaction pooler: {lock:?}"),
            };
            let took = start.elapsed();
            assert!(e.is_behind_pooler(), "pool {i}: {e}");
            assert!(
                e.to_string().contains("(detected at the lock)"),
                "pool {i}: {e}"
            );
            assert_eq!(
                B::detect_pooler(pool).await.unwrap(),
                PoolerMode::Transaction,
                "pool {i}"
            );
            // Refused from then on without a probe.
            let again = B::session_lock(pool, key, pgwarden::LockMode::Exclusive, None)
                .await
                .unwrap_err();
            assert!(
                again.to_string().contains("(detected)"),
                "pool {i}: {again}"
            );
            took
        })
        .buffer_unordered(PARALLEL)
        .collect()
        .await;
    assert_eq!(times.len(), POOLS);
    load.stop().await;
    let raw = db.connect().await.unwrap();
    let left = raw_locks(&raw).await;
    assert!(
        left.is_empty(),
        "advisory locks left on the server: {left:?}"
    );
    eprintln!(
        "{}: {POOLS}/{POOLS} caught at the lock; {}",
        B::NAME,
        summary(times)
    );
}
