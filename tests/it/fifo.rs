//! FIFO order against a real PostgreSQL: a returned connection goes to the
//! first waiter whose lane may take it (waiters of one lane served in the
//! order they came, on every backend: `backends.rs`).

use crate::support;

use std::time::Duration;

use pgwarden::{Client, Lane, LockKey, LockMode, Pool, SessionLock};
use support::db;

/// A connection a waiter got: a request connection, or a session lock's.
enum Got {
    Request(Client),
    Lock(SessionLock),
}

#[tokio::test]
async fn a_returned_connection_goes_to_the_first_waiter_whose_lane_may_take_it() {
    // Pool 5, request max 3, session-lock budget 2, probe reserve 1. Three
    // request connections and one session lock out; two request waiters
    // queue (their lane is at its maximum), then a session-lock waiter (the
    // one free connection is the probe's).
    let db = db().await;
    let pool = Pool::builder(db.deadpool(5).unwrap())
        .lane(Lane::Request, 1, 3)
        .lane(Lane::SessionLock, 0, 2)
        .pooler(pgwarden::PoolerMode::Direct)
        .wait_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let mut requests = Vec::new();
    for _ in 0..3 {
        requests.push(pool.get().await.unwrap());
    }
    let first_lock = pool
        .session_lock(LockKey::Single(1), LockMode::Exclusive, None)
        .await
        .unwrap()
        .unwrap();
    let wait_for = |lane: Lane, n: usize| {
        let pool = pool.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while pool.status().lane(lane).waiting != n {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{lane}: {n} waiting"
                );
                tokio::task::yield_now().await;
            }
        }
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for (i, lane) in [Lane::Request, Lane::Request, Lane::SessionLock]
        .into_iter()
        .enumerate()
    {
        let (p, tx) = (pool.clone(), tx.clone());
        tasks.push(tokio::spawn(async move {
            let got = match lane {
                Lane::SessionLock => Got::Lock(
                    p.session_lock(LockKey::Single(2), LockMode::Exclusive, None)
                        .await
                        .unwrap()
                        .unwrap(),
                ),
                _ => Got::Request(p.get_within(Duration::from_secs(5)).await.unwrap()),
            };
            tx.send(i).unwrap();
            got
        }));
        wait_for(lane, if i == 1 { 2 } else { 1 }).await;
    }
    // The session lock's connection comes back: the request waiters ahead
    // of the session-lock waiter may not take it (their lane is full); the
    // session-lock waiter behind them gets it.
    first_lock.unlock().await.unwrap();
    let first = tokio::time::timeout(Duration::from_secs(60), rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first, 2);
    assert_eq!(pool.status().lane(Lane::Request).waiting, 2);
    // A request connection comes back: the first request waiter, in order.
    drop(requests.pop());
    let next = tokio::time::timeout(Duration::from_secs(60), rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(next, 0);
    assert_eq!(pool.status().lane(Lane::Request).waiting, 1);
    drop(requests);
    for t in tasks {
        match t.await.unwrap() {
            Got::Request(c) => drop(c),
            Got::Lock(l) => l.unlock().await.unwrap(),
        }
    }
    assert_eq!(pool.status().in_use, 0);
}
