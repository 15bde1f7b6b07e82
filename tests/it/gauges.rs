//! Exact gauges, read with a local debugging recorder: lane gauges set with
//! the state they describe and republished by housekeeping, `close()`
//! zeroing pending and counting `closed`, series for every lane, and pool
//! names that never collide by default. (A debugging reading resets what it
//! reads, gauges included: a value read after a reset was set since.)

use crate::support;

use std::time::Duration;

use pgwarden::{Lane, Pool};
use support::*;

/// How long a housekeeping pass (every 50 ms) may take to show on a loaded
/// machine.
const LIMIT: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lane_gauges_match_the_state_after_a_storm() {
    let db = db().await;
    let (pool, snap) = with_recorder(builder(&db, 4).name("storm"));
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
                        let _ = tokio::time::timeout(cut, pool.census()).await;
                    } else if let Ok(Ok(c)) =
                        tokio::time::timeout(cut, pool.get_within(bound)).await
                    {
                        c.simple_query("SELECT 1").await.unwrap();
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let s = pool.status();
    assert_eq!((s.in_use, s.waiting), (0, 0), "{s}");
    // No housekeeping ran (its interval is an hour): what the gauges say
    // now was set at the last event.
    let now = metrics_now(&snap);
    for lane in Lane::ALL {
        for name in ["pgwarden_lane_in_use", "pgwarden_lane_pending"] {
            let k = format!("{name}{{lane={lane},pool=storm}}");
            assert_eq!(now.get(&k).copied().unwrap_or(0.0), 0.0, "{k}");
        }
    }
}

#[tokio::test]
async fn housekeeping_republishes_so_an_idle_pool_reads_zero_within_one_interval() {
    let db = db().await;
    let every = Duration::from_millis(50);
    let (pool, snap) = with_recorder(
        builder(&db, 4)
            .name("republish")
            .housekeeping_interval(every),
    );
    let c = pool.get().await.unwrap();
    metrics_now(&snap); // reset
                        // Each reading resets: a reading shows what passes set since the last
                        // one, or 0. Read until one shows a pass (on this one-thread runtime a
                        // pass runs whole between two readings).
    eventually(LIMIT, "a pass republishes 1 in use", || {
        let now = metrics_now(&snap);
        let lane = now["pgwarden_lane_in_use{lane=request,pool=republish}"];
        let conns = now["pgwarden_connections{pool=republish,state=in_use}"];
        // 0 is a reading with no pass since the last.
        assert!(lane == 0.0 || lane == 1.0, "lane in use {lane}");
        assert!(conns == 0.0 || conns == 1.0, "connections in use {conns}");
        std::future::ready(lane == 1.0 && conns == 1.0)
    })
    .await;
    drop(c);
    // Set at the return, under the state lock.
    let now = metrics_now(&snap);
    assert_eq!(
        now["pgwarden_lane_in_use{lane=request,pool=republish}"],
        0.0
    );
    // And republished: the next passes read 0 in use and 1 idle, values a
    // pass set after the reset above. No reading on the way may show the
    // connection in use (a reset reads 0 as well, so every reading counts).
    eventually(LIMIT, "a pass republishes 1 idle", || {
        let now = metrics_now(&snap);
        assert_eq!(
            now["pgwarden_connections{pool=republish,state=in_use}"], 0.0,
            "a pass after the return still counts it in use"
        );
        std::future::ready(now["pgwarden_connections{pool=republish,state=idle}"] == 1.0)
    })
    .await;
}

#[tokio::test]
async fn close_zeroes_pending_and_counts_closed() {
    let db = db().await;
    let (pool, snap) = with_recorder(builder(&db, 2).name("closing"));
    let held = pool.get().await.unwrap();
    let waiter = tokio::spawn({
        let pool = pool.clone();
        async move { pool.get_within(Duration::from_secs(5)).await.map(drop) }
    });
    eventually(Duration::from_secs(5), "the waiter queues", || async {
        pool.status().waiting == 1
    })
    .await;
    assert_eq!(
        metrics_now(&snap)["pgwarden_lane_pending{lane=request,pool=closing}"],
        1.0
    );
    pool.close();
    let e = waiter.await.unwrap().unwrap_err();
    assert!(e.to_string().contains("closed"), "{e}");
    assert!(pool.get().await.is_err());
    assert!(pool.readiness(Duration::from_secs(1)).await.is_err());
    let now = metrics_now(&snap);
    assert_eq!(now["pgwarden_lane_pending{lane=request,pool=closing}"], 0.0);
    assert_eq!(
        now["pgwarden_acquire_failures_total{lane=request,pool=closing,reason=closed}"],
        2.0
    );
    assert_eq!(
        now["pgwarden_acquire_failures_total{lane=probe,pool=closing,reason=closed}"],
        1.0
    );
    drop(held);
}

#[tokio::test]
async fn every_lane_has_its_series_and_unnamed_pools_never_share_a_label() {
    let db = db().await;
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let (a, b) = metrics::with_local_recorder(&recorder, || {
        let a = Pool::builder(db.deadpool(4).unwrap()).build().unwrap();
        let b = Pool::builder(db.deadpool(4).unwrap()).build().unwrap();
        (a, b)
    });
    assert_ne!(a.name(), b.name());
    assert!(a.name().starts_with("default") && b.name().starts_with("default"));
    a.readiness(Duration::from_secs(60)).await.unwrap();
    let now = metrics_now(&snap);
    for pool in [a.name(), b.name()] {
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
    let probe_checkouts = format!(
        "pgwarden_acquire_duration_seconds{{lane=probe,pool={}}}",
        a.name()
    );
    assert_eq!(now[&probe_checkouts], 1.0);
    // A name is free again once its pool is gone.
    let name = b.name().to_owned();
    drop(b);
    let c = Pool::builder(db.deadpool(4).unwrap()).build().unwrap();
    assert!(
        c.name() == name || c.name().starts_with("default"),
        "{}",
        c.name()
    );
    assert_ne!(c.name(), a.name());
}
