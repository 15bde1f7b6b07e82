//! The pool shell's behaviour on every backend, from one source: each test
//! is a generic `async fn` over [`Backend`], run by [`backends!`] on the
//! deadpool pool and (features `sqlx-0_8`, `sqlx-0_9`) on pgwarden's sqlx
//! pool over sqlx 0.8 and 0.9. Lanes and the probe reserve, FIFO waits,
//! timeouts with the pool's status, checkouts given up at every point,
//! discard, the `Deadline` scope, long holds with their call site.
//!
//! A sqlx connection's return finishes in a task of its own (sqlx's
//! `after_release` and ping, then its capacity is free, then pgwarden's
//! admission): a test that reads the state right after a drop waits for it
//! ([`settled`]).

use crate::support;

use std::time::{Duration, Instant};

use pgwarden::{CheckoutError, Deadline, Error, Lane, LockKey, LockMode};
use support::backend::{settled, Backend, Settings};
use support::{db, eventually, within};

const HOUR: Duration = Duration::from_secs(3600);
/// The guard against a hang: only a wrong behaviour waits it out.
const GUARD: Duration = Duration::from_secs(60);

backends!(checkout_knows_lane_pid_site_and_age);
/// (Was also `pool::conn_knows_lane_pid_site_and_age`, deadpool only: its
/// session-lock and reuse checks are folded in here.)
async fn checkout_knows_lane_pid_site_and_age<B: Backend>() {
    let db = db().await;
    // 4: a session lock and two requests out at once.
    let pool = B::build(&db, &Settings::new("knows", 4));
    let before = Instant::now();
    let line = line!() + 1;
    let mut c = B::get(&pool).await.unwrap();
    assert_eq!(B::lane(&c), Lane::Request);
    assert_eq!(B::site(&c).file(), file!());
    assert_eq!(B::site(&c).line(), line);
    assert!(B::since(&c) >= before);
    let pid = B::ask_pid(&mut c).await;
    assert_eq!(B::pid(&c), pid, "the pid pgwarden learned is the backend's");
    // A session lock's connection: its own lane and backend.
    let held = B::session_lock(&pool, LockKey::Single(1), LockMode::Exclusive, None)
        .await
        .unwrap()
        .expect("a free key");
    assert_eq!(B::lock_lane(&held), Lane::SessionLock);
    assert_ne!(B::lock_pid(&held), pid);
    let s = B::status(&pool);
    assert_eq!(
        (
            s.in_use,
            s.lane(Lane::Request).in_use,
            s.lane(Lane::SessionLock).in_use
        ),
        (2, 1, 1)
    );
    drop(c);
    eventually(GUARD, "the connection back", || {
        std::future::ready(B::status(&pool).lane(Lane::Request).in_use == 0)
    })
    .await;
    // The idle connection is reused, its pid known without asking again,
    // handed out within the call that checked it out.
    let before = Instant::now();
    let c = B::get(&pool).await.unwrap();
    let after = Instant::now();
    assert_eq!(B::pid(&c), pid, "the idle connection is reused");
    assert!(
        before <= B::since(&c) && B::since(&c) <= after,
        "handed out at {:?}, called {before:?} to {after:?}",
        B::since(&c)
    );
    // A second connection at once: another backend, its own pid.
    let mut d = B::get(&pool).await.unwrap();
    assert_ne!(B::pid(&d), pid);
    assert_eq!(B::ask_pid(&mut d).await, B::pid(&d));
    drop((c, d));
    B::unlock(held).await.unwrap();
    settled::<B>(&pool).await;
}

backends!(request_timeout_carries_the_status);
async fn request_timeout_carries_the_status<B: Backend>() {
    let db = db().await;
    let pool = B::build(
        &db,
        &Settings::new("timeout", 3).wait(Duration::from_millis(200)),
    );
    // Request max is N - probe reserve = 2. The two held checkouts open
    // their connections within the guard's bound, not the pool's 200 ms: a
    // connection opened on a busy machine may take longer than that (CI
    // once saw it fail so), and the timeouts under test are the next two.
    let a = B::get_within(&pool, GUARD).await.unwrap();
    let b = B::get_within(&pool, GUARD).await.unwrap();
    let e = B::get(&pool).await.unwrap_err();
    assert!(B::is_drop_in_timeout(&e), "{e:?}");
    let e = B::get_within(&pool, Duration::from_millis(200))
        .await
        .unwrap_err();
    match &e {
        Error::Checkout(CheckoutError::Timeout {
            lane,
            waited,
            status,
            ..
        }) => {
            assert_eq!(*lane, Lane::Request);
            assert!(*waited >= Duration::from_millis(200));
            assert_eq!(status.lane(Lane::Request).in_use, 2);
            assert_eq!(status.lane(Lane::Request).waiting, 1);
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    let msg = e.to_string();
    assert!(
        msg.contains("request 2/2") && msg.contains("waiting 1"),
        "{msg}"
    );
    // The probe reserve is still there: readiness answers.
    B::readiness(&pool, GUARD).await.unwrap();
    assert_eq!(B::status(&pool).waiting, 0);
    drop((a, b));
    settled::<B>(&pool).await;
}

backends!(a_cancelled_waiter_leaves_no_trace);
async fn a_cancelled_waiter_leaves_no_trace<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("cancelled", 2));
    let a = B::get(&pool).await.unwrap();
    let r = tokio::time::timeout(Duration::from_millis(50), B::get(&pool)).await;
    assert!(
        r.is_err(),
        "the request lane of a pool of 2 has one connection"
    );
    let s = B::status(&pool);
    assert_eq!((s.waiting, s.in_use), (0, 1));
    drop(a);
    // Nothing was handed to the dropped waiter: the connection is there.
    let c = within(GUARD, "the next checkout", B::get(&pool))
        .await
        .unwrap();
    drop(c);
    settled::<B>(&pool).await;
}

backends!(a_checkout_dropped_after_its_grant_gives_it_back);
/// A queued checkout granted while nobody polls it, then dropped without
/// reading its grant: the grant goes back, and the connection is there for
/// the next checkout.
async fn a_checkout_dropped_after_its_grant_gives_it_back<B: Backend>() {
    use futures_util::FutureExt;
    let db = db().await;
    let pool = B::build(&db, &Settings::new("granted", 2));
    let a = B::get(&pool).await.unwrap();
    let mut waiting = B::get(&pool);
    assert!((&mut waiting).now_or_never().is_none());
    assert_eq!(B::status(&pool).waiting, 1);
    // Granted to `waiting` as the connection comes back; not polled since.
    drop(a);
    eventually(GUARD, "the grant goes to the waiter", || {
        let s = B::status(&pool);
        std::future::ready((s.waiting, s.in_use) == (0, 1))
    })
    .await;
    drop(waiting);
    let s = B::status(&pool);
    assert_eq!(
        (s.waiting, s.in_use),
        (0, 0),
        "the dropped checkout kept its grant"
    );
    let c = within(Duration::from_secs(2), "the next checkout", B::get(&pool))
        .await
        .unwrap();
    drop(c);
    settled::<B>(&pool).await;
}

backends!(
    checkouts_given_up_at_any_point_leave_no_trace,
    flavor = "multi_thread",
    worker_threads = 2
);
/// Many checkouts on few connections, on two worker threads, each given
/// up at a point of its own: after one poll and a yield (granted or not
/// meanwhile), at a timeout that races its grant, or not at all. Whatever
/// the interleaving, every grant ends in a served checkout or goes back:
/// afterwards nothing is in use or waiting, and the lane's connections are
/// all there.
async fn checkouts_given_up_at_any_point_leave_no_trace<B: Backend>() {
    use futures_util::FutureExt;
    const TASKS: u64 = 24;
    const ROUNDS: u64 = 150;
    let db = db().await;
    let pool = B::build(&db, &Settings::new("given-up", 4));
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let pool = pool.clone();
            tokio::spawn(async move {
                // A small generator of its own per task: the same run each time.
                let mut x = t.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                let mut next = move || {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x
                };
                let mut given_up = 0u32;
                for _ in 0..ROUNDS {
                    match next() % 4 {
                        0 => {
                            let mut c = B::get(&pool).await.expect("a checkout with time to wait");
                            B::select_1(&mut c).await;
                        }
                        1 => {
                            let wait = Duration::from_micros(next() % 2_000);
                            match tokio::time::timeout(wait, B::get(&pool)).await {
                                Ok(r) => drop(r.expect("a checkout within its bound")),
                                Err(_) => given_up += 1,
                            }
                        }
                        2 => {
                            // Queued, then left unpolled while others run
                            // (and may grant it), then dropped unread.
                            let mut get = B::get(&pool);
                            if let Some(r) = (&mut get).now_or_never() {
                                drop(r.expect("a checkout admitted at once"));
                            } else {
                                tokio::task::yield_now().await;
                                drop(get);
                                given_up += 1;
                            }
                        }
                        _ => {
                            let c = B::get(&pool).await.expect("a checkout with time to wait");
                            tokio::task::yield_now().await;
                            drop(c);
                        }
                    }
                }
                given_up
            })
        })
        .collect();
    let mut given_up = 0;
    for t in tasks {
        given_up += within(GUARD, "a task (a grant was lost)", t).await.unwrap();
    }
    assert!(given_up > 0, "no checkout was given up: nothing was tried");
    settled::<B>(&pool).await;
    // The request lane's three connections, together: none kept by a
    // checkout given up (the pool's wait timeout is 5 s).
    let mut held = Vec::new();
    for _ in 0..3 {
        let c = within(
            Duration::from_secs(2),
            "a connection of the lane",
            B::get(&pool),
        )
        .await
        .unwrap();
        held.push(c);
    }
    drop(held);
    settled::<B>(&pool).await;
}

backends!(the_probe_answers_while_request_traffic_saturates);
/// The probe's reserve: request work saturating its lane, and more of it
/// queued for an hour, never delays the readiness probe.
async fn the_probe_answers_while_request_traffic_saturates<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("probe", 4).wait(HOUR));
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(B::get(&pool).await.unwrap());
    }
    let queued: Vec<_> = (0..4)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move { B::get(&pool).await.map(drop) })
        })
        .collect();
    eventually(GUARD, "four request waiters queue", || {
        std::future::ready(B::status(&pool).lane(Lane::Request).waiting == 4)
    })
    .await;
    for _ in 0..5 {
        within(
            GUARD,
            "the probe answers past the queued request work",
            B::readiness(&pool, HOUR),
        )
        .await
        .unwrap();
        assert_eq!(B::status(&pool).lane(Lane::Request).waiting, 4);
    }
    drop(held);
    for q in queued {
        within(GUARD, "a queued request", q).await.unwrap().unwrap();
    }
    settled::<B>(&pool).await;
}

backends!(discard_closes_the_backend);
async fn discard_closes_the_backend<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("discard", 3));
    let c = B::get(&pool).await.unwrap();
    let pid = B::pid(&c);
    B::discard(c);
    settled::<B>(&pool).await;
    let watcher = db.connect().await.unwrap();
    eventually(
        Duration::from_secs(10),
        "the discarded backend ends",
        || async {
            let n: i64 = watcher
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
                    &[&pid],
                )
                .await
                .unwrap()
                .get(0);
            n == 0
        },
    )
    .await;
    // The pool opens a new connection in its place.
    let c = B::get(&pool).await.unwrap();
    assert_ne!(B::pid(&c), pid);
}

backends!(a_readiness_bound_of_zero_answers_at_once_and_closes_nothing);
async fn a_readiness_bound_of_zero_answers_at_once_and_closes_nothing<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("zero", 2));
    B::readiness(&pool, Duration::from_secs(5)).await.unwrap();
    settled::<B>(&pool).await;
    let before = B::status(&pool);
    assert_eq!(
        before.size, 1,
        "the probe opened one connection: {before:?}"
    );
    let err = B::readiness(&pool, Duration::ZERO).await.unwrap_err();
    assert!(
        matches!(err, Error::Checkout(CheckoutError::ReadinessTimeout(d)) if d.is_zero()),
        "{err}"
    );
    let after = B::status(&pool);
    assert_eq!(
        (after.size, after.idle, after.in_use),
        (1, 1, 0),
        "a bound of zero checks nothing out and closes no healthy connection: {after:?}"
    );
}

backends!(waiters_are_served_in_fifo_order);
async fn waiters_are_served_in_fifo_order<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("fifo", 3));
    let a = B::get(&pool).await.unwrap();
    let b = B::get(&pool).await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for i in 0..5 {
        let p = pool.clone();
        let tx = tx.clone();
        tasks.push(tokio::spawn(async move {
            let c = B::get(&p).await.unwrap();
            tx.send(i).unwrap();
            drop(c);
        }));
        // Each waiter is queued before the next one starts.
        eventually(GUARD, "the waiter queues", || {
            std::future::ready(B::status(&pool).lane(Lane::Request).waiting == i + 1)
        })
        .await;
    }
    drop(a);
    let mut order = Vec::new();
    for _ in 0..5 {
        order.push(within(GUARD, "the next waiter", rx.recv()).await.unwrap());
    }
    assert_eq!(order, vec![0, 1, 2, 3, 4]);
    drop(b);
    for t in tasks {
        t.await.unwrap();
    }
    settled::<B>(&pool).await;
}

backends!(
    checkouts_in_a_scope_wait_no_longer_than_it_allows,
    flavor = "multi_thread",
    worker_threads = 2
);
/// `Deadline`: a scope bounds every checkout in it, whatever the call's own
/// bound (the request lane of a pool of four held: 3 of 3).
async fn checkouts_in_a_scope_wait_no_longer_than_it_allows<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("deadline", 4).wait(HOUR));
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(B::get(&pool).await.unwrap());
    }
    // The per-checkout maximum: the drop-in checkout (an hour of its own,
    // in a scope of an hour) gives up at 100 ms.
    let t = Instant::now();
    let d = Deadline::after(HOUR).max_wait(Duration::from_millis(100));
    let e = within(GUARD, "get in scope", d.scope(B::get(&pool)))
        .await
        .unwrap_err();
    assert!(B::is_drop_in_timeout(&e), "{e}");
    assert!(
        t.elapsed() >= Duration::from_millis(100),
        "{:?}",
        t.elapsed()
    );
    // The deadline itself: an hour's bound ends at the 150 ms left.
    let t = Instant::now();
    let d = Deadline::after(Duration::from_millis(150));
    let e = within(
        GUARD,
        "get_within in scope",
        d.scope(B::get_within(&pool, HOUR)),
    )
    .await
    .unwrap_err();
    assert!(e.is_timeout(), "{e}");
    assert!(
        t.elapsed() >= Duration::from_millis(150),
        "{:?}",
        t.elapsed()
    );
    // Scopes nest and never extend: an inner scope of an hour inside a
    // 120 ms one.
    let t = Instant::now();
    let outer = Deadline::after(Duration::from_millis(120));
    let r = within(
        GUARD,
        "the inner scope ends with the outer one",
        outer.scope(async {
            Deadline::after(HOUR)
                .scope(async {
                    assert_eq!(Deadline::current(), Some(outer));
                    B::get(&pool).await
                })
                .await
        }),
    )
    .await;
    assert!(r.is_err(), "{:?}", t.elapsed());
    assert!(
        t.elapsed() >= Duration::from_millis(120),
        "{:?}",
        t.elapsed()
    );
    // Outside any scope the pool's own bound (an hour) applies: still
    // waiting at 300 ms (a lower bound: a slow machine only waits longer).
    let outside = tokio::time::timeout(Duration::from_millis(300), B::get(&pool)).await;
    assert!(
        outside.is_err(),
        "a checkout outside the scope gave up early"
    );
    // A connection coming back within the bound is handed out.
    let d = Deadline::after(Duration::from_secs(30)).max_wait(Duration::from_secs(20));
    let back = held.pop().unwrap();
    let got = tokio::join!(d.scope(B::get(&pool)), async {
        eventually(GUARD, "the scoped checkout queues", || {
            std::future::ready(B::status(&pool).waiting == 1)
        })
        .await;
        drop(back);
    })
    .0
    .unwrap();
    assert_eq!(B::lane(&got), Lane::Request);
    drop(got);
    drop(held);
    settled::<B>(&pool).await;
}

backends!(a_long_hold_is_counted_and_logged_with_its_call_site);
/// A connection held past the long-hold threshold is counted once, under
/// the pool's name and its lane, and logged with where it was checked out.
async fn a_long_hold_is_counted_and_logged_with_its_call_site<B: Backend>() {
    let db = db().await;
    let settings = Settings::new("long-hold", 3)
        .long_hold(Duration::from_millis(50), Duration::from_millis(20));
    let (pool, snap) = B::build_recorded(&db, &settings);
    let logs = support::logs();
    let line = line!() + 1;
    let c = B::get(&pool).await.unwrap();
    let name = settings.pool_name::<B>();
    let key = format!("pgwarden_long_holds_total{{lane=request,pool={name}}}");
    let mut seen = 0;
    eventually(GUARD, "the long hold is counted", || {
        let now = support::metrics_now(&snap);
        seen += now.get(&key).copied().unwrap_or(0.0) as u64;
        std::future::ready(seen > 0)
    })
    .await;
    assert_eq!(seen, 1, "counted once");
    let site = format!("{}:{line}", file!());
    eventually(GUARD, "the long hold is logged with its site", || {
        let text = logs.text();
        std::future::ready(text.lines().any(|l| {
            l.contains("long-hold threshold")
                && l.contains(&site)
                && l.contains(&format!("pool={name}"))
        }))
    })
    .await;
    drop(c);
    settled::<B>(&pool).await;
}
