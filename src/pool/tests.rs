//! The shell's timeouts, cancellation, refusals, closing and housekeeping,
//! deterministically: tokio's paused clock, and a deadpool pool that points
//! nowhere and is never asked for a connection (permits are taken straight
//! from the admission shell).

use std::panic::Location;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::FutureExt;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tokio::time::Instant;

use super::shared::{Permit, Pool};
use crate::admission::{Lane, Priority};
use crate::error::{CheckoutError, Error, Stage};

fn nowhere(size: usize) -> deadpool_postgres::Pool {
    let cfg: tokio_postgres::Config = "host=/nonexistent/pgwarden user=nobody".parse().unwrap();
    let mgr = deadpool_postgres::Manager::from_config(
        cfg,
        tokio_postgres::NoTls,
        deadpool_postgres::ManagerConfig::default(),
    );
    deadpool_postgres::Pool::builder(mgr)
        .max_size(size)
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
        .unwrap()
}

fn pool(size: usize) -> (Pool, Snapshotter) {
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let pool = metrics::with_local_recorder(&recorder, || {
        // The pool core alone: no census, no layer above.
        super::PoolBuilder::new(nowhere(size))
            .housekeeping_interval(Duration::from_secs(1))
            .build()
            .unwrap()
    });
    (pool, snap)
}

/// One reading of every metric: (name, lane, reason, value). A debugging
/// snapshot resets what it reads (gauges too): one per checkpoint.
struct Reading(Vec<(String, Option<String>, Option<String>, f64)>);

fn read(snap: &Snapshotter) -> Reading {
    Reading(
        snap.snapshot()
            .into_vec()
            .into_iter()
            .map(|(ck, _, _, v)| {
                let k = ck.key();
                let label = |n: &str| {
                    k.labels()
                        .find(|l| l.key() == n)
                        .map(|l| l.value().to_owned())
                };
                let v = match v {
                    DebugValue::Counter(n) => n as f64,
                    DebugValue::Gauge(g) => g.into_inner(),
                    DebugValue::Histogram(h) => h.len() as f64,
                };
                (k.name().to_owned(), label("lane"), label("reason"), v)
            })
            .collect(),
    )
}

impl Reading {
    /// The sum over the series of `name` with these labels (`None`: any).
    fn get(&self, name: &str, lane: Option<&str>, reason: Option<&str>) -> f64 {
        self.0
            .iter()
            .filter(|(n, l, r, _)| {
                n == name
                    && lane.is_none_or(|x| l.as_deref() == Some(x))
                    && reason.is_none_or(|x| r.as_deref() == Some(x))
            })
            .map(|(.., v)| v)
            .sum()
    }
}

async fn admit(pool: &Pool, lane: Lane, timeout: Duration) -> Result<Permit, Error> {
    pool.shared
        .admit(lane, Priority::Normal, false, Location::caller(), timeout)
        .await
}

#[tokio::test(start_paused = true)]
async fn a_waiter_times_out_at_its_bound_exactly_and_leaves_no_trace() {
    let (pool, snap) = pool(4);
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(admit(&pool, Lane::Request, Duration::ZERO).await.unwrap());
    }
    let start = Instant::now();
    let e = admit(&pool, Lane::Request, Duration::from_secs(2))
        .await
        .err()
        .unwrap();
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    match &e {
        Error::Checkout(CheckoutError::Timeout {
            lane,
            stage,
            waited,
            status,
        }) => {
            assert_eq!((*lane, *stage), (Lane::Request, Stage::Admission));
            assert_eq!(*waited, Duration::from_secs(2));
            assert_eq!(status.lane(Lane::Request).waiting, 1, "{status}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(pool.status().waiting, 0);
    let r = read(&snap);
    assert_eq!(
        r.get(crate::metrics::LANE_PENDING, Some("request"), None),
        0.0
    );
    assert_eq!(
        r.get(
            crate::metrics::ACQUIRE_FAILURES,
            Some("request"),
            Some("timeout")
        ),
        1.0
    );
    // A bound too large to add is no panic: it waits, and is served.
    let waiting = tokio::spawn({
        let pool = pool.clone();
        async move { admit(&pool, Lane::Request, Duration::MAX).await.map(drop) }
    });
    tokio::time::sleep(Duration::from_secs(3600)).await;
    assert_eq!(pool.status().waiting, 1);
    drop(held.pop());
    waiting.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_waiter_leaves_no_trace() {
    let (pool, snap) = pool(4);
    let held: Vec<_> = [0; 3]
        .iter()
        .map(|_| {
            admit(&pool, Lane::Request, Duration::ZERO)
                .now_or_never()
                .unwrap()
                .unwrap()
        })
        .collect();
    for polls in 1..4 {
        let mut fut = Box::pin(admit(&pool, Lane::Request, Duration::from_secs(5)));
        for _ in 0..polls {
            assert!((&mut fut).now_or_never().is_none());
        }
        assert_eq!(pool.status().waiting, 1);
        assert_eq!(
            read(&snap).get(crate::metrics::LANE_PENDING, Some("request"), None),
            1.0
        );
        drop(fut);
        assert_eq!(pool.status().waiting, 0);
        assert_eq!(
            read(&snap).get(crate::metrics::LANE_PENDING, Some("request"), None),
            0.0
        );
    }
    // A return goes to nobody: the next checkout is admitted at once.
    drop(held);
    let s = pool.status();
    assert_eq!((s.in_use, s.waiting), (0, 0));
    let p = admit(&pool, Lane::Request, Duration::ZERO)
        .now_or_never()
        .unwrap();
    assert!(p.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_session_lock_waits_for_a_release_in_flight_and_a_hopeless_one_is_refused_at_once() {
    let (pool, snap) = pool(4);
    let lock = admit(&pool, Lane::SessionLock, Duration::ZERO)
        .await
        .unwrap();
    // Refused while held.
    let e = admit(&pool, Lane::SessionLock, Duration::from_secs(5))
        .await
        .err()
        .unwrap();
    assert!(e.is_budget_exhausted(), "{e}");
    // Its guard is dropped: the release is under way.
    pool.shared.mark_releasing(lock.slot());
    assert_eq!(pool.status().lane(Lane::SessionLock).releasing, 1);
    let first = tokio::spawn({
        let pool = pool.clone();
        async move {
            admit(&pool, Lane::SessionLock, Duration::from_secs(5))
                .await
                .map(drop)
        }
    });
    while pool.status().lane(Lane::SessionLock).waiting == 0 {
        tokio::task::yield_now().await;
    }
    // The slot the release frees is the first waiter's: a second one can
    // never be admitted while the first holds it, and hears so at once.
    let start = Instant::now();
    let e = admit(&pool, Lane::SessionLock, Duration::from_secs(5))
        .await
        .err()
        .unwrap();
    assert!(e.is_budget_exhausted(), "{e}");
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(
        read(&snap).get(
            crate::metrics::ACQUIRE_FAILURES,
            Some("session_lock"),
            Some("refused")
        ),
        2.0
    );
    // The release completes: the first waiter is admitted at once.
    let start = Instant::now();
    drop(lock);
    first.await.unwrap().unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn the_probe_reserve_is_there_when_everything_else_is_taken() {
    let (pool, _snap) = pool(4);
    let mut held = Vec::new();
    for lane in [Lane::SessionLock, Lane::Control, Lane::Request] {
        held.push(admit(&pool, lane, Duration::ZERO).await.unwrap());
    }
    for lane in [Lane::Request, Lane::Control, Lane::Lease, Lane::SessionLock] {
        assert!(
            admit(&pool, lane, Duration::from_millis(10)).await.is_err(),
            "{lane}"
        );
    }
    let probe = admit(&pool, Lane::Probe, Duration::ZERO).await.unwrap();
    assert_eq!(pool.status().in_use, 4);
    drop((probe, held));
}

#[tokio::test(start_paused = true)]
async fn close_fails_waiters_and_later_checkouts_as_closed() {
    let (pool, snap) = pool(2);
    let held = admit(&pool, Lane::Request, Duration::ZERO).await.unwrap();
    let waiter = tokio::spawn({
        let pool = pool.clone();
        async move {
            admit(&pool, Lane::Request, Duration::from_secs(5))
                .await
                .map(drop)
        }
    });
    while pool.status().waiting == 0 {
        tokio::task::yield_now().await;
    }
    pool.close();
    let e = waiter.await.unwrap().unwrap_err();
    assert!(
        matches!(
            e,
            Error::Checkout(CheckoutError::Pool(deadpool_postgres::PoolError::Closed))
        ),
        "{e}"
    );
    assert!(admit(&pool, Lane::Probe, Duration::ZERO).await.is_err());
    let r = read(&snap);
    assert_eq!(r.get(crate::metrics::LANE_PENDING, None, None), 0.0);
    assert_eq!(
        r.get(crate::metrics::ACQUIRE_FAILURES, None, Some("closed")),
        2.0
    );
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn housekeeping_survives_a_panic_and_keeps_publishing() {
    let (pool, snap) = pool(4);
    pool.shared.inject_panic.store(true, Ordering::Release);
    let held = admit(&pool, Lane::Request, Duration::ZERO).await.unwrap();
    // The first pass panics; the next ones run and republish the gauges
    // (a reading resets them: only a pass sets them again).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let r = read(&snap);
    assert_eq!(r.get(crate::metrics::HOUSEKEEPING_PANICS, None, None), 1.0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let r = read(&snap);
    assert!(r.get(crate::metrics::OLDEST_HOLD, Some("request"), None) > 0.0);
    assert_eq!(
        r.get(crate::metrics::LANE_IN_USE, Some("request"), None),
        1.0
    );
    assert_eq!(r.get(crate::metrics::HOUSEKEEPING_PANICS, None, None), 0.0);
    drop(held);
    // The return sets the gauge at once, under the state lock.
    assert_eq!(
        read(&snap).get(crate::metrics::LANE_IN_USE, Some("request"), None),
        0.0
    );
}

#[tokio::test(start_paused = true)]
async fn a_waiter_dropped_after_its_grant_leaves_the_next_waiter_alone() {
    let (pool, _snap) = pool(2);
    let held = admit(&pool, Lane::Request, Duration::ZERO).await.unwrap();
    let mut a = Box::pin(admit(&pool, Lane::Request, Duration::from_secs(5)));
    assert!((&mut a).now_or_never().is_none());
    // Granted while nobody polls it: its grant waits in its entry.
    drop(held);
    let mut b = Box::pin(admit(&pool, Lane::Request, Duration::from_secs(5)));
    assert!((&mut b).now_or_never().is_none());
    assert_eq!(pool.status().waiting, 1);
    // The first one gives up without reading its grant: the grant comes
    // back, and goes to the second, whose place in the queue was kept.
    drop(a);
    assert!(b.await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_waiter_polled_by_another_task_is_woken_there() {
    let (pool, _snap) = pool(2);
    let held = admit(&pool, Lane::Request, Duration::ZERO).await.unwrap();
    // Queued with a waker that wakes nothing (`now_or_never`'s), then
    // awaited here: the grant must wake this task, not the first waker.
    let mut b = Box::pin(admit(&pool, Lane::Request, Duration::from_secs(5)));
    assert!((&mut b).now_or_never().is_none());
    assert_eq!(pool.status().waiting, 1);
    let giver = tokio::spawn(async move {
        tokio::task::yield_now().await;
        drop(held);
    });
    // Woken by the grant, at once (the clock is paused: it moves only
    // when every task sleeps), not by a timer.
    let start = tokio::time::Instant::now();
    let got = tokio::time::timeout(Duration::from_secs(1), b).await;
    assert!(matches!(got, Ok(Ok(_))), "the waiter was not served");
    assert_eq!(
        start.elapsed(),
        Duration::ZERO,
        "the grant did not wake the task that awaits"
    );
    giver.await.unwrap();
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Supervision: housekeeping and a layer's task start on the runtime in use,
/// die with it, come back on the next one at the first checkout; a task
/// that panics comes back too; `close()` stops them all for good.
#[test]
fn background_work_is_supervised_across_runtimes_and_stopped_by_close() {
    let (pool, _snap) = pool(2);
    // Built outside a runtime: nothing running yet.
    assert!(pool.shared.supervisor.running().is_empty());
    let started = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let a = runtime();
    a.block_on(async {
        let n = started.clone();
        pool.shared.supervise(
            "layer task",
            move || {
                // The first one panics: the supervisor starts it again.
                let first = n.fetch_add(1, Ordering::AcqRel) == 0;
                Some(Box::pin(async move {
                    tokio::task::yield_now().await;
                    if first {
                        panic!("injected background panic");
                    }
                    std::future::pending::<()>().await
                }) as super::Task)
            },
            None,
        );
        // Started by the next checkout (here: by hand).
        assert!(pool.shared.supervisor.running().is_empty());
        pool.shared.revive_background();
        let mut running = pool.shared.supervisor.running();
        running.sort();
        assert_eq!(running, ["housekeeping", "layer task"]);
        // Let the first start panic, then a checkout revives it.
        while pool.shared.supervisor.running().len() == 2 {
            tokio::task::yield_now().await;
        }
        pool.shared.revive_background();
        assert_eq!(pool.shared.supervisor.running().len(), 2);
        assert_eq!(started.load(Ordering::Acquire), 2);
    });
    drop(a);
    // Their runtime is gone, and them with it.
    assert!(pool.shared.supervisor.running().is_empty());
    let b = runtime();
    b.block_on(async {
        // A checkout on B (it fails: the pool points nowhere) revives them.
        let e = pool
            .checkout(Lane::Request, Location::caller(), Duration::from_millis(50))
            .await;
        assert!(e.is_err());
        let mut running = pool.shared.supervisor.running();
        running.sort();
        assert_eq!(running, ["housekeeping", "layer task"]);
        assert_eq!(started.load(Ordering::Acquire), 3);
        pool.close();
        assert!(pool.is_closed());
        assert!(pool.shared.supervisor.running().is_empty());
        pool.shared.revive_background();
        pool.shared.supervise(
            "after close",
            || Some(Box::pin(std::future::pending::<()>()) as super::Task),
            None,
        );
        assert!(pool.shared.supervisor.running().is_empty());
        assert_eq!(started.load(Ordering::Acquire), 3);
    });
}
