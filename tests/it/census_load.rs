//! The census under load, on every backend, each variant on a server of
//! its own (its lock table is filled: the shared server's, and one server
//! for the three variants at once, holds about 102,000 locks, not 135,000): 30,000 advisory locks leaked on an idle pooled connection and
//! 15,000 more held by another session. The census runs again and again in
//! its own task while checkouts go on, and a checkout completes while a
//! census query is running (the pool's mutex is held only to copy who holds
//! which pid; checkout latencies are printed, not asserted), the leak is
//! logged once for its connection with the count, and that connection is
//! closed.

use crate::support;

use std::time::{Duration, Instant};

use support::backend::{Backend, Settings};
use support::*;

backends!(
    soak,
    thirty_thousand_leaked_locks_do_not_stall_checkouts,
    flavor = "multi_thread",
    worker_threads = 2
);
async fn thirty_thousand_leaked_locks_do_not_stall_checkouts<B: Backend>() {
    // The census logs from the runtime's worker threads: the process-wide
    // subscriber (its lines are told apart by pool name).
    let logs = logs();
    let (server, db) = own_db().await;
    let raw = db.connect().await.unwrap();
    raw.simple_query("SELECT count(pg_advisory_lock(1, i)) FROM generate_series(1, 15000) i")
        .await
        .unwrap();
    // A census pass is bounded by the pool's wait (plus its interval): at
    // the default 5 s, a pass over these 45,000 locks ran out of it twice in
    // a loaded CI run (stop 47) after ending the leaker's session and before
    // its log line. 30 s: a hang guard here.
    let s = Settings::new("census-load", 4)
        .long_hold(Duration::from_secs(30), Duration::from_millis(20))
        .census(Duration::from_millis(50))
        .wait(Duration::from_secs(30));
    let name = s.pool_name::<B>();
    let (pool, snap) = B::build_recorded(&db, &s);

    // The leak: raw SQL on an ordinary connection, never released.
    let mut c = B::get(&pool).await.unwrap();
    B::run(
        &mut c,
        "SELECT count(pg_advisory_lock(2, i)) FROM generate_series(1, 30000) i",
    )
    .await;
    let leaked_pid = B::pid(&c);
    drop(c);

    // Checkouts, measured, while the census runs again and again: until it
    // has run 3 times and a checkout (with its query) was seen to complete
    // while a census query was running on the server (the same backend
    // active on the census query, with the same start, before and after
    // it). Events, not a clock: the bound is only against a hang.
    let passes_key = format!("pgwarden_census_duration_seconds{{pool={name}}}");
    let passes = || metrics_now(&snap).get(&passes_key).copied().unwrap_or(0.0);
    let census_query = || async {
        raw.query_opt(
            "SELECT pid, query_start FROM pg_stat_activity \
              WHERE state = 'active' AND query LIKE '%FROM pg_locks l%' \
                AND pid <> pg_backend_pid() \
              ORDER BY query_start LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .map(|r| (r.get::<_, i32>(0), r.get::<_, std::time::SystemTime>(1)))
    };
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let tasks: Vec<_> = (0..2)
        .map(|_| {
            let (pool, stop) = (pool.clone(), stop.clone());
            tokio::spawn(async move {
                let mut took = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let t = Instant::now();
                    let mut c = B::get(&pool).await.unwrap();
                    took.push(t.elapsed());
                    B::run(&mut c, "SELECT 1").await;
                    drop(c);
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                took
            })
        })
        .collect();
    // `metrics_now` drains what it reads: sum the passes.
    let (mut ran, mut overlapped, mut tries) = (0.0, 0, 0);
    within(
        Duration::from_secs(120),
        "3 census passes, and a checkout during one",
        async {
            while ran < 3.0 || overlapped == 0 {
                ran += passes();
                let Some(before) = census_query().await else {
                    tokio::task::yield_now().await;
                    continue;
                };
                tries += 1;
                let mut c = B::get(&pool).await.unwrap();
                B::run(&mut c, "SELECT 1").await;
                drop(c);
                if census_query().await == Some(before) {
                    overlapped += 1;
                }
            }
        },
    )
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut took = Vec::new();
    for t in tasks {
        took.extend(t.await.unwrap());
    }
    took.sort();
    let p99 = took[(took.len() * 99).div_ceil(100) - 1];
    // The latency is a figure, not an assertion (it depends on the
    // machine's load); the overlap above is what shows the census does not
    // hold the checkouts back.
    eprintln!(
        "{}: {} checkouts during {ran} census passes: p50 {:?}, p99 {p99:?}, max {:?}; \
         {overlapped} of {tries} checkouts tried during a census query completed within it",
        B::NAME,
        took.len(),
        took[took.len() / 2],
        took[took.len() - 1]
    );

    // The leaker was found, logged once with its count, and closed.
    // Ending a session releases its 30 000 locks: seconds on a loaded
    // machine. The bound is only against a hang.
    eventually(
        Duration::from_secs(60),
        "the leaking session ends",
        || async { !alive(&raw, leaked_pid).await },
    )
    .await;
    let text = logs.text();
    let pool_lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains(&format!("pool={name} ")))
        .collect();
    let lines: Vec<&str> = pool_lines
        .iter()
        .copied()
        .filter(|l| l.contains("advisory locks held by a connection idle in the pool"))
        .collect();
    // What else the pool logged, should the leaker have gone another way
    // (seen once on sqlx 0.8 with the machine at load 30: no line at all).
    assert_eq!(
        lines.len(),
        1,
        "one line per connection: {lines:?}; the pool's lines: {pool_lines:#?}"
    );
    assert!(
        lines[0].contains("locks=30000") && lines[0].contains(&format!("pid={leaked_pid}")),
        "{}",
        lines[0]
    );
    drop(server);
}
