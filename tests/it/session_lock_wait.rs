//! `session_lock(key, mode, Some(wait))` waits for the session-lock budget
//! when other locks hold it now: in FIFO order, up to `wait`, holding no
//! connection while it waits. `None` keeps try-once semantics, and a call
//! that can never be admitted is refused at once, with a message that names
//! the pool size, the budget, the setting and the alternatives. On every
//! backend, from one source.

use crate::support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgwarden::{CheckoutError, Error, Lane, LockKey, LockMode, Stage};
use support::backend::{settled, Backend, Settings};
use support::{admin, db, eventually, within};
use tokio_postgres::Client;

const FIVE: Duration = Duration::from_secs(5);
/// A bound only a wrong behaviour waits out…
const HOUR: Duration = Duration::from_secs(3600);
/// …and the guard against that hang (the right behaviour returns well
/// within it on any machine): no upper bound on the machine's speed.
const GUARD: Duration = Duration::from_secs(60);

/// Backends of the test's database, the admin connection's own left out.
async fn backends(admin: &Client) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity \
              WHERE datname = current_database() AND pid <> pg_backend_pid()",
            &[],
        )
        .await
        .expect("pg_stat_activity")
        .get(0)
}

fn waiting<B: Backend>(pool: &B::Pool) -> usize {
    B::status(pool).lane(Lane::SessionLock).waiting
}

/// Waits until `n` session-lock callers are queued on `pool`.
async fn queued<B: Backend>(pool: &B::Pool, n: usize) {
    eventually(FIVE, "the callers queued", || {
        std::future::ready(waiting::<B>(pool) == n)
    })
    .await
}

backends!(waiters_are_served_in_fifo_order_at_deadpools_default_size);
async fn waiters_are_served_in_fifo_order_at_deadpools_default_size<B: Backend>() {
    let db = db().await;
    // deadpool's default size here is 4: a session-lock budget of 1.
    let pool = B::build(&db, &Settings::new("fifo-locks", 4));
    assert_eq!(B::status(&pool).lane(Lane::SessionLock).max, 1);
    let first = B::session_lock(&pool, LockKey::Single(0), LockMode::Exclusive, Some(FIVE))
        .await
        .unwrap()
        .unwrap();
    // Six callers with a wait, as in the meteroid port: queued one after
    // the other, none refused.
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 1..=6i64 {
        let (p, order) = (pool.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let lock = B::session_lock(&p, LockKey::Single(i), LockMode::Exclusive, Some(GUARD))
                .await
                .expect("admitted after waiting")
                .expect("granted");
            order.lock().unwrap().push(i);
            B::unlock(lock).await.expect("unlock");
        }));
        queued::<B>(&pool, i as usize).await;
    }
    assert!(order.lock().unwrap().is_empty());
    B::unlock(first).await.unwrap();
    for t in tasks {
        within(GUARD, "a waiter served", t).await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(waiting::<B>(&pool), 0);
    settled::<B>(&pool).await;
}

backends!(a_waiter_holds_no_connection);
async fn a_waiter_holds_no_connection<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let pool = B::build(&db, &Settings::new("waiter-holds", 4));
    let held = B::session_lock(&pool, LockKey::Single(1), LockMode::Exclusive, None)
        .await
        .unwrap()
        .unwrap();
    let tasks: Vec<_> = (2..5i64)
        .map(|k| {
            let pool = pool.clone();
            tokio::spawn(async move {
                B::session_lock(&pool, LockKey::Single(k), LockMode::Exclusive, Some(GUARD))
                    .await
                    .map(|l| l.is_some())
            })
        })
        .collect();
    queued::<B>(&pool, 3).await;
    // Queued on the budget: one connection out (the held lock's), one open,
    // one backend on the server; the work under the lock still gets one.
    let s = B::status(&pool);
    assert_eq!((s.in_use, s.size), (1, 1), "{s}");
    assert_eq!(s.lane(Lane::SessionLock).in_use, 1, "{s}");
    assert_eq!(backends(&admin).await, 1);
    let mut work = B::get(&pool).await.unwrap();
    B::select_1(&mut work).await;
    drop(work);
    B::unlock(held).await.unwrap();
    for t in tasks {
        let granted = within(GUARD, "a waiter served", t).await.unwrap().unwrap();
        assert!(granted);
    }
    settled::<B>(&pool).await;
}

backends!(the_wait_is_bounded_and_none_tries_once);
async fn the_wait_is_bounded_and_none_tries_once<B: Backend>() {
    let db = db().await;
    // The pool's own bound is an hour: a call that waited past its own
    // wait, or did not try once, would hang past the guard.
    let pool = B::build(&db, &Settings::new("bounded-wait", 4).wait(HOUR));
    let lock = |wait| B::session_lock(&pool, LockKey::Single(2), LockMode::Exclusive, wait);
    let held = B::session_lock(&pool, LockKey::Single(1), LockMode::Exclusive, None)
        .await
        .unwrap()
        .unwrap();

    // With a wait: queued, then out of time at the wait.
    let wait = Duration::from_millis(400);
    let t0 = Instant::now();
    let e = within(GUARD, "out of time at its wait", lock(Some(wait)))
        .await
        .unwrap_err();
    let took = t0.elapsed();
    assert!(took >= wait, "returned before its wait: {took:?}");
    match &e {
        Error::Checkout(CheckoutError::Timeout {
            lane: Lane::SessionLock,
            stage: Stage::Admission,
            status,
            ..
        }) => assert_eq!(status.lane(Lane::SessionLock).in_use, 1),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        waiting::<B>(&pool),
        0,
        "a waiter out of time leaves the queue"
    );

    // Without a wait: refused at once, and the message says what to do.
    let e = within(GUARD, "try-once refused at once", lock(None))
        .await
        .unwrap_err();
    assert!(e.is_budget_exhausted(), "{e:?}");
    let msg = e.to_string();
    for part in [
        "session_lock budget exhausted: 1 of 1 in use (pool size 4)",
        "PoolBuilder::lane(Lane::SessionLock, reserved, max)",
        "give session_lock a wait",
        "table lease",
        "pgwarden::xact_lock",
        "try-once work inside a transaction",
    ] {
        assert!(msg.contains(part), "{part:?} missing from: {msg}");
    }
    B::unlock(held).await.unwrap();
    let again = lock(None).await.unwrap();
    B::unlock(again.expect("free again")).await.unwrap();
    settled::<B>(&pool).await;
}

backends!(a_call_that_can_never_be_admitted_is_refused_at_once);
async fn a_call_that_can_never_be_admitted_is_refused_at_once<B: Backend>() {
    let db = db().await;
    // A pool of 2 has no session-lock budget at all: waiting cannot help.
    let pool = B::build(&db, &Settings::new("no-budget", 2));
    assert_eq!(B::status(&pool).lane(Lane::SessionLock).max, 0);
    // With an hour to wait: a call that waited would hang past the guard.
    let e = within(
        GUARD,
        "refused at once",
        B::session_lock(&pool, LockKey::Single(1), LockMode::Exclusive, Some(HOUR)),
    )
    .await
    .unwrap_err();
    assert!(e.is_budget_exhausted(), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("0 of 0 in use (pool size 2)"), "{msg}");
    assert!(!msg.contains("give session_lock a wait"), "{msg}");
}
