//! Pooler detection under load, on every backend: a real PgBouncer in transaction mode with 32
//! clients running short transactions the whole time, and PostgreSQL itself
//! under the same load. Every try builds a fresh pool, so detection runs
//! every time.
//!
//! Detection (or a refusal built on it) is a short probe. Its time is
//! printed, not asserted (measured on a loaded 2-core machine, all three
//! tests of this file at once, 4 runs: a median of 0.08 to 0.34 s and a
//! maximum of 1.35 s): what a slow machine cannot pass, the tests assert
//! without a clock. A probe that queued behind the load for a server
//! connection until its bound `T` fails `detect_pooler` with a timeout; a
//! refusal that waited for the lock first (a wait of `T`) runs into its
//! `within(T)`; a probe that stopped seeing motion runs more statements
//! than the first test allows (its statements to proof).
use crate::support;

use std::time::Instant;

use pgwarden::{LockKey, PoolerMode};
use pgwarden_testing::PoolMode;
use support::backend::Backend;
use support::pooler::*;
use support::*;

backends!(
    soak,
    a_loaded_pgbouncer_is_a_transaction_pooler_every_time,
    flavor = "multi_thread",
    worker_threads = 2
);
async fn a_loaded_pgbouncer_is_a_transaction_pooler_every_time<B: Backend>() {
    let tries = tries();
    let db = db().await;
    let Some(bouncer) = bouncer(&db, 10, PoolMode::Transaction) else {
        return;
    };
    let load = load_through(&bouncer).await;
    logs();
    let before = load.done();
    let mut times = Vec::new();
    for i in 0..tries {
        let pool = through::<B>(&bouncer, &format!("tx-{i}"));
        let start = Instant::now();
        let found = B::detect_pooler(&pool).await.unwrap();
        times.push(start.elapsed());
        assert_eq!(found, PoolerMode::Transaction, "try {i}");
        B::close(&pool).await;
    }
    let during = load.done() - before;
    let total = load.stop().await;
    let counts = statements::<B>("tx-");
    assert_eq!(counts.len(), tries, "one detection per try");
    assert!(
        during >= tries as u64,
        "the load ran during the tries: {during}"
    );
    let mut hist = std::collections::BTreeMap::new();
    for c in &counts {
        *hist.entry(*c).or_insert(0) += 1;
    }
    eprintln!(
        "{}: {tries}/{tries} transaction pooler; detection {}; statements to proof {hist:?}; \
         load: {during} transactions during the tries ({total} in all)",
        B::NAME,
        summary(times.clone())
    );
    // Statements to proof. The probe measured about 3 to 12 statements in
    // 100 showing no motion in this mix (10 server connections, 32 busy
    // clients): a proof takes 2 or 3 statements as a rule (here, 4 runs of
    // 100 tries: 2 to 6, median 3). The median stays at 4 or under, and no try
    // needs more than 12 (10 misses in a row: about 0.12^10 ≈ 6e-10 a try);
    // a probe that stopped seeing motion would run all 42 (1 + 1 + 40).
    let mut sorted = counts.clone();
    sorted.sort_unstable();
    assert!(
        sorted[0] >= 2,
        "a proof needs two clients' statements: {hist:?}"
    );
    assert!(
        sorted[tries / 2] <= 4,
        "median statements to proof: {hist:?}"
    );
    assert!(sorted[tries - 1] <= 12, "statements to proof: {hist:?}");
}

backends!(
    soak,
    session_locks_through_a_loaded_pgbouncer_are_never_granted,
    flavor = "multi_thread",
    worker_threads = 2
);
async fn session_locks_through_a_loaded_pgbouncer_are_never_granted<B: Backend>() {
    let tries = tries();
    let db = db().await;
    let Some(bouncer) = bouncer(&db, 10, PoolMode::Transaction) else {
        return;
    };
    let load = load_through(&bouncer).await;
    let mut times = Vec::new();
    for i in 0..tries {
        let pool = through::<B>(&bouncer, &format!("lock-{i}"));
        let key = LockKey::Pair(9, i as i32);
        let start = Instant::now();
        let (mode, wait) = match i % 3 {
            0 => (pgwarden::LockMode::Exclusive, Some(T)),
            1 => (pgwarden::LockMode::Exclusive, None),
            _ => (pgwarden::LockMode::Shared, Some(T)),
        };
        let got = within(
            T,
            "a session lock through PgBouncer",
            B::session_lock(&pool, key, mode, wait),
        )
        .await;
        times.push(start.elapsed());
        match got {
            Err(e) => assert!(e.is_behind_pooler(), "try {i}: {e}"),
            Ok(lock) => {
                panic!("try {i}: session lock granted through a transaction pooler: {lock:?}")
            }
        }
        assert_eq!(
            B::detect_pooler(&pool).await.unwrap(),
            PoolerMode::Transaction,
            "try {i}"
        );
        B::close(&pool).await;
    }
    load.stop().await;
    // On the server itself: no advisory lock on any backend.
    let raw = db.connect().await.unwrap();
    let left = raw_locks(&raw).await;
    assert!(
        left.is_empty(),
        "advisory locks left on the server: {left:?}"
    );
    eprintln!(
        "{}: {tries}/{tries} refused (BehindPooler); {}",
        B::NAME,
        summary(times.clone())
    );
}

backends!(
    soak,
    loaded_postgres_is_direct_every_time,
    flavor = "multi_thread",
    worker_threads = 2
);
async fn loaded_postgres_is_direct_every_time<B: Backend>() {
    let tries = tries();
    let db = db().await;
    let mut clients = Vec::new();
    for _ in 0..LOAD_CLIENTS {
        clients.push(db.connect().await.unwrap());
    }
    let load = Load::start(clients);
    load.running().await;
    logs();
    // PARALLEL detections at a time (as through the session pooler): on
    // sqlx, which does not show the pid announced at connection start, each
    // is the whole motion probe, 42 statements, and 100 in a row took 47 s.
    let times =
        direct_detections::<B>(tries, |i| fresh::<B>(On::Db(&db), &format!("pg-{i}"))).await;
    load.stop().await;
    let counts = statements::<B>("pg-");
    // One statement where the pid announced at connection start is read;
    // else the whole motion probe, which saw no motion (1 + 1 + 40).
    let each = if B::ANNOUNCED_PID { 1 } else { 42 };
    assert_eq!(counts, vec![each; tries], "{each} statements, every time");
    eprintln!(
        "{}: {tries}/{tries} direct; detection {}",
        B::NAME,
        summary(times.clone())
    );
}
