//! Exact gauges, read with a local debugging recorder: lane gauges set with
//! the state they describe and republished by housekeeping, `close()`
//! zeroing pending and counting `closed`, series for every lane, and pool
//! names that never collide by default; on every backend. (A debugging
//! reading resets what it reads, gauges included: a value read after a
//! reset was set since.)

use crate::support;

use std::time::Duration;

use pgwarden::Lane;
use support::backend::{settled, Backend, Settings};
use support::*;

/// How long a housekeeping pass (every 50 ms) may take to show on a loaded
/// machine.
const LIMIT: Duration = Duration::from_secs(5);

backends!(
    lane_gauges_match_the_state_after_a_storm,
    flavor = "multi_thread",
    worker_threads = 2
);
async fn lane_gauges_match_the_state_after_a_storm<B: Backend>() {
    // A server of its own: on a busy machine a connect outlasts the 50 ms
    // cut below, every cut connect stays in the server's listen queue
    // until the postmaster gets to it, and 4,800 cut checkouts filled the
    // queue (844 entries, `ss -xl`): other tests' connects to the shared
    // server were refused at once with EAGAIN (stop 43, 8 threads and two
    // busy loops: `hostile_fence2::a_cancelled_fence_keeps_its_lease`, the
    // next test in order, in two busy runs out of three).
    let (_server, db) = own_db().await;
    let s = Settings::new("storm", 4);
    let (pool, snap) = B::build_recorded(&db, &s);
    let name = s.pool_name::<B>();
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let pool = pool.clone();
            tokio::spawn(async move {
                for j in 0..100 {
                    let lane = if (i + j) % 5 == 0 {
                        Lane::Control
                    } else {
                        Lane::Request
                    };
                    // Some give up early, some are cancelled while waiting.
                    let bound = Duration::from_millis(if j % 7 == 0 { 1 } else { 2000 });
                    let cut = Duration::from_millis(50);
                    if lane == Lane::Control {
                        // The control lane through the call made for it.
                        let _ = tokio::time::timeout(cut, B::census(&pool)).await;
                    } else if let Ok(Ok(mut c)) =
                        tokio::time::timeout(cut, B::get_within(&pool, bound)).await
                    {
                        B::select_1(&mut c).await;
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    // (sqlx returns a connection in a task of its own.)
    settled::<B>(&pool).await;
    // No housekeeping ran (its interval is an hour): what the gauges say
    // now was set at the last event.
    let now = metrics_now(&snap);
    for lane in Lane::ALL {
        for gauge in ["pgwarden_lane_in_use", "pgwarden_lane_pending"] {
            let k = format!("{gauge}{{lane={lane},pool={name}}}");
            assert_eq!(now.get(&k).copied().unwrap_or(0.0), 0.0, "{k}");
        }
    }
}

backends!(housekeeping_republishes_so_an_idle_pool_reads_zero_within_one_interval);
async fn housekeeping_republishes_so_an_idle_pool_reads_zero_within_one_interval<B: Backend>() {
    let db = db().await;
    let every = Duration::from_millis(50);
    let s = Settings::new("republish", 4).long_hold(Duration::from_secs(30), every);
    let (pool, snap) = B::build_recorded(&db, &s);
    let name = s.pool_name::<B>();
    let lane_in_use = format!("pgwarden_lane_in_use{{lane=request,pool={name}}}");
    let conns = |state: &str| format!("pgwarden_connections{{pool={name},state={state}}}");
    let c = B::get(&pool).await.unwrap();
    metrics_now(&snap); // reset
                        // Each reading resets: a reading shows what passes set since the last
                        // one, or 0. Read until one shows a pass (on this one-thread runtime a
                        // pass runs whole between two readings).
    eventually(LIMIT, "a pass republishes 1 in use", || {
        let now = metrics_now(&snap);
        let lane = now[&lane_in_use];
        let in_use = now[&conns("in_use")];
        // 0 is a reading with no pass since the last.
        assert!(lane == 0.0 || lane == 1.0, "lane in use {lane}");
        assert!(
            in_use == 0.0 || in_use == 1.0,
            "connections in use {in_use}"
        );
        std::future::ready(lane == 1.0 && in_use == 1.0)
    })
    .await;
    drop(c);
    // Set at the return, under the state lock (sqlx: once its return's
    // task has run).
    settled::<B>(&pool).await;
    let now = metrics_now(&snap);
    assert_eq!(now[&lane_in_use], 0.0);
    // And republished: the next passes read 0 in use and 1 idle, values a
    // pass set after the reset above. No reading on the way may show the
    // connection in use (a reset reads 0 as well, so every reading counts).
    eventually(LIMIT, "a pass republishes 1 idle", || {
        let now = metrics_now(&snap);
        assert_eq!(
            now[&conns("in_use")],
            0.0,
            "a pass after the return still counts it in use"
        );
        std::future::ready(now[&conns("idle")] == 1.0)
    })
    .await;
}

backends!(close_zeroes_pending_and_counts_closed);
async fn close_zeroes_pending_and_counts_closed<B: Backend>() {
    let db = db().await;
    let s = Settings::new("closing", 2);
    let (pool, snap) = B::build_recorded(&db, &s);
    let name = s.pool_name::<B>();
    let pending = format!("pgwarden_lane_pending{{lane=request,pool={name}}}");
    let held = B::get(&pool).await.unwrap();
    let waiter = tokio::spawn({
        let pool = pool.clone();
        async move { B::get_within(&pool, Duration::from_secs(5)).await.map(drop) }
    });
    eventually(Duration::from_secs(5), "the waiter queues", || async {
        B::status(&pool).waiting == 1
    })
    .await;
    assert_eq!(metrics_now(&snap)[&pending], 1.0);
    // Closed at the call; sqlx's close then waits for the connection out.
    let closed = B::close(&pool);
    let e = waiter.await.unwrap().unwrap_err();
    assert!(e.to_string().contains("closed"), "{e}");
    assert!(B::get(&pool).await.is_err());
    assert!(B::readiness(&pool, Duration::from_secs(1)).await.is_err());
    let now = metrics_now(&snap);
    assert_eq!(now[&pending], 0.0);
    let failures = |lane: &str| {
        format!("pgwarden_acquire_failures_total{{lane={lane},pool={name},reason=closed}}")
    };
    assert_eq!(now[&failures("request")], 2.0);
    assert_eq!(now[&failures("probe")], 1.0);
    drop(held);
    within(Duration::from_secs(60), "the close", closed).await;
}

backends!(every_lane_has_its_series_and_unnamed_pools_never_share_a_label);
async fn every_lane_has_its_series_and_unnamed_pools_never_share_a_label<B: Backend>() {
    let db = db().await;
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let (a, b) = metrics::with_local_recorder(&recorder, || {
        (B::build_unnamed(&db, 4), B::build_unnamed(&db, 4))
    });
    let (a_name, b_name) = (B::pool_name(&a), B::pool_name(&b));
    assert_ne!(a_name, b_name);
    assert!(a_name.starts_with("default") && b_name.starts_with("default"));
    B::readiness(&a, Duration::from_secs(60)).await.unwrap();
    let now = metrics_now(&snap);
    for pool in [&a_name, &b_name] {
        assert_eq!(
            now[&format!("pgwarden_lane_max{{lane=probe,pool={pool}}}")],
            1.0
        );
        assert_eq!(
            now[&format!("pgwarden_lane_reserved{{lane=probe,pool={pool}}}")],
            1.0
        );
        assert_eq!(
            now[&format!("pgwarden_lane_max{{lane=lease,pool={pool}}}")],
            2.0
        );
        assert_eq!(
            now[&format!("pgwarden_lane_max{{lane=control,pool={pool}}}")],
            1.0
        );
    }
    let probe_checkouts = format!("pgwarden_acquire_duration_seconds{{lane=probe,pool={a_name}}}");
    assert_eq!(now[&probe_checkouts], 1.0);
    // A name is free again once its pool is gone.
    drop(b);
    let c = B::pool_name(&B::build_unnamed(&db, 4));
    assert!(c == b_name || c.starts_with("default"), "{c}");
    assert_ne!(c, a_name);
}
