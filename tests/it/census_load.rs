//! The census under load, on a server of the test's own (its lock table is
//! filled): 30,000 advisory locks leaked on an idle pooled connection and
//! 15,000 more held by another session. The census runs again and again in
//! its own task while checkouts go on; checkout p99 stays under 5 ms (the
//! pool's mutex is held only to copy who holds which pid), the leak is
//! logged once for its connection with the count, and that connection is
//! closed.

use crate::support;

use std::time::{Duration, Instant};

use pgwarden_testing::TestServer;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_thousand_leaked_locks_do_not_stall_checkouts() {
    // The census logs from the runtime's worker threads: a global
    // subscriber (this file holds one test).
    let logs = Logs::default();
    tracing::subscriber::set_global_default(logs.subscriber()).unwrap();
    let server = tokio::task::spawn_blocking(TestServer::start)
        .await
        .unwrap()
        .expect("throwaway PostgreSQL");
    let db = server.create_database().await.unwrap();
    let raw = db.connect().await.unwrap();
    raw.simple_query("SELECT count(pg_advisory_lock(1, i)) FROM generate_series(1, 15000) i")
        .await
        .unwrap();
    let b = builder(&db, 4)
        .name("census-load")
        .housekeeping_interval(Duration::from_millis(20))
        .census_interval(Some(Duration::from_millis(50)));
    let (pool, snap) = with_recorder(b);

    // The leak: raw SQL on an ordinary connection, never released.
    let c = pool.get().await.unwrap();
    c.simple_query("SELECT count(pg_advisory_lock(2, i)) FROM generate_series(1, 30000) i")
        .await
        .unwrap();
    let leaked_pid = c.pid();
    drop(c);

    // Checkouts, measured, while the census runs again and again.
    let began = Instant::now();
    let tasks: Vec<_> = (0..2)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let mut took = Vec::new();
                while began.elapsed() < Duration::from_secs(5) {
                    let t = Instant::now();
                    let c = pool.get().await.unwrap();
                    took.push(t.elapsed());
                    c.simple_query("SELECT 1").await.unwrap();
                    drop(c);
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                took
            })
        })
        .collect();
    let mut took = Vec::new();
    for t in tasks {
        took.extend(t.await.unwrap());
    }
    let passes = metrics_now(&snap)
        .get(&format!(
            "{}{{pool=census-load}}",
            "pgwarden_census_duration_seconds"
        ))
        .copied()
        .unwrap_or(0.0);
    took.sort();
    let p99 = took[(took.len() * 99).div_ceil(100) - 1];
    eprintln!(
        "{} checkouts during {passes} census passes: p50 {:?}, p99 {p99:?}, max {:?}",
        took.len(),
        took[took.len() / 2],
        took[took.len() - 1]
    );
    assert!(passes >= 3.0, "the census ran {passes} times");
    assert!(p99 < Duration::from_millis(5), "checkout p99 {p99:?}");

    // The leaker was found, logged once with its count, and closed.
    eventually(
        Duration::from_secs(10),
        "the leaking session ends",
        || async { !alive(&raw, leaked_pid).await },
    )
    .await;
    let text = logs.text();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("advisory locks held by a connection idle in the pool"))
        .collect();
    assert_eq!(lines.len(), 1, "one line per connection: {lines:?}");
    assert!(
        lines[0].contains("locks=30000") && lines[0].contains(&format!("pid={leaked_pid}")),
        "{}",
        lines[0]
    );
    drop(server);
}
