//! The pool's background work under its supervisor (issue 16, point 8):
//! housekeeping, the census and the lease renewer come back on the runtime in
//! use when theirs is dropped.

use crate::support;

use std::collections::HashMap;
use std::time::Duration;

use pgwarden::{LeaseOptions, Leases};
use support::*;

const T: Duration = Duration::from_secs(10);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn get(m: &HashMap<String, f64>, k: &str) -> f64 {
    m.get(k).copied().unwrap_or(0.0)
}

/// A pool and its leases built on runtime A, A dropped, the pool used on
/// runtime B: the long-hold warning, the republished gauges, the census's
/// leaked-lock cleanup and lease renewal all happen on B, without a lease
/// call on B (a plain checkout revives them). (That `close()` stops them is
/// shown by the pool core's own tests, `src/pool/tests.rs`.)
#[test]
fn background_work_comes_back_on_the_runtime_in_use() {
    let a = runtime();
    let db = a.block_on(db());
    let b = builder(&db, 4)
        .name("supervised")
        .housekeeping_interval(Duration::from_millis(50))
        .long_hold_threshold(Duration::from_millis(300))
        .census_interval(Some(Duration::from_millis(100)));
    let (pool, snap) = with_recorder(b);
    let leases = Leases::new(&pool);
    let opts = LeaseOptions::new(Duration::from_secs(1));
    let lease = a.block_on(async {
        // Everything runs on A first.
        pool.get()
            .await
            .unwrap()
            .simple_query("SELECT 1")
            .await
            .unwrap();
        leases
            .acquire("nightly", &opts, None)
            .await
            .unwrap()
            .expect("free")
    });
    drop(a);
    let renewed_on_a = leases.stats().renewed;

    let b = runtime();
    b.block_on(async {
        let raw = db.connect().await.unwrap();
        // A checkout on B: no lease call.
        let conn = pool.get().await.unwrap();
        conn.simple_query("SELECT pg_advisory_lock(4242)")
            .await
            .unwrap();
        let leaked_pid = conn.pid();
        // Held past the long-hold threshold: warned and counted, and the
        // oldest-hold gauge republished, by housekeeping on B.
        let mut seen = HashMap::<String, f64>::new();
        eventually(
            T,
            "long hold counted and oldest-hold gauge republished",
            || {
                for (k, v) in metrics_now(&snap) {
                    let e = seen.entry(k.clone()).or_insert(0.0);
                    if k.contains("_total") {
                        *e += v;
                    } else {
                        *e = e.max(v);
                    }
                }
                let long = get(
                    &seen,
                    "pgwarden_long_holds_total{lane=request,pool=supervised}",
                );
                let oldest = get(
                    &seen,
                    "pgwarden_oldest_hold_seconds{lane=request,pool=supervised}",
                );
                std::future::ready(long >= 1.0 && oldest >= 0.3)
            },
        )
        .await;
        // Returned holding its lock: the census on B closes it.
        drop(conn);
        eventually(T, "the census closes the leaked session", || async {
            !alive(&raw, leaked_pid).await
        })
        .await;
        // Renewal on B: renewed four times (past its 1 s TTL) here, and
        // never lost.
        eventually(T, "renewals on B", || {
            std::future::ready(leases.stats().renewed >= renewed_on_a + 4)
        })
        .await;
        assert!(!lease.is_lost(), "the lease was lost: {:?}", leases.stats());
        drop(lease);
    });
}
