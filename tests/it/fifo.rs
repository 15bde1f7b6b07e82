//! FIFO order against a real PostgreSQL, on every backend: a returned
//! connection goes to the first waiter whose lane may take it (waiters of
//! one lane served in the order they came: `backends.rs`).

use crate::support;

use std::time::Duration;

use pgwarden::{Lane, LockKey, LockMode};
use support::backend::{settled, Backend, Settings};
use support::{db, eventually, within};

/// The guard against a hang: only a wrong behaviour waits it out.
const GUARD: Duration = Duration::from_secs(60);

/// A connection a waiter got: a request connection, or a session lock's.
enum Got<B: Backend> {
    Request(B::Conn),
    Lock(B::Lock),
}

backends!(a_returned_connection_goes_to_the_first_waiter_whose_lane_may_take_it);
async fn a_returned_connection_goes_to_the_first_waiter_whose_lane_may_take_it<B: Backend>() {
    // Pool 5, request max 3, session-lock budget 2, probe reserve 1. Three
    // request connections and one session lock out; two request waiters
    // queue (their lane is at its maximum), then a session-lock waiter (the
    // one free connection is the probe's).
    let db = db().await;
    let s = Settings::new("lanes-fifo", 5)
        .request(1, 3)
        .budget(2, pgwarden::BudgetPolicy::Refuse);
    let pool = B::build(&db, &s);
    let mut requests = Vec::new();
    for _ in 0..3 {
        requests.push(B::get(&pool).await.unwrap());
    }
    let first_lock = B::session_lock(&pool, LockKey::Single(1), LockMode::Exclusive, None)
        .await
        .unwrap()
        .unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for (i, lane) in [Lane::Request, Lane::Request, Lane::SessionLock]
        .into_iter()
        .enumerate()
    {
        let (p, tx) = (pool.clone(), tx.clone());
        tasks.push(tokio::spawn(async move {
            let got = match lane {
                Lane::SessionLock => Got::<B>::Lock(
                    B::session_lock(&p, LockKey::Single(2), LockMode::Exclusive, None)
                        .await
                        .unwrap()
                        .unwrap(),
                ),
                _ => Got::Request(B::get_within(&p, GUARD).await.unwrap()),
            };
            tx.send(i).unwrap();
            got
        }));
        let n = if i == 1 { 2 } else { 1 };
        eventually(GUARD, "the waiter queues", || {
            std::future::ready(B::status(&pool).lane(lane).waiting == n)
        })
        .await;
    }
    // The session lock's connection comes back: the request waiters ahead
    // of the session-lock waiter may not take it (their lane is full); the
    // session-lock waiter behind them gets it.
    B::unlock(first_lock).await.unwrap();
    let first = within(GUARD, "a waiter served", rx.recv()).await.unwrap();
    assert_eq!(first, 2);
    assert_eq!(B::status(&pool).lane(Lane::Request).waiting, 2);
    // A request connection comes back: the first request waiter, in order.
    drop(requests.pop());
    let next = within(GUARD, "a waiter served", rx.recv()).await.unwrap();
    assert_eq!(next, 0);
    assert_eq!(B::status(&pool).lane(Lane::Request).waiting, 1);
    drop(requests);
    for t in tasks {
        match t.await.unwrap() {
            Got::Request(c) => drop(c),
            Got::Lock(l) => B::unlock(l).await.unwrap(),
        }
    }
    settled::<B>(&pool).await;
}
