//! The admission state machine against a real PostgreSQL: a session lock
//! taken again right after its guard was dropped waits for the background
//! unlock and is admitted, not refused; a try-once session-lock checkout
//! that can never be admitted while the queue ahead holds is refused at once,
//! and one with a wait queues behind it.

use crate::support;

use std::time::{Duration, Instant};

use pgwarden::{Lane, LockKey};
use support::*;

const T: Duration = Duration::from_secs(5);

#[tokio::test]
async fn a_lock_taken_again_right_after_its_guard_dropped_is_admitted() {
    let db = db().await;
    // Size 4: a session-lock budget of 1, policy refuse.
    let pool = builder(&db, 4).build().unwrap();
    let key = LockKey::Single(501);
    for round in 0..20 {
        let lock = pool
            .session_lock(key, pgwarden::LockMode::Exclusive, Some(T))
            .await
            .unwrap()
            .expect("a wait grants the lock or fails");
        drop(lock); // unlocked in a spawned task; its slot frees after
        let start = Instant::now();
        let again = pool
            .session_lock(key, pgwarden::LockMode::Exclusive, Some(T))
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"))
            .expect("a wait grants the lock or fails");
        assert!(start.elapsed() < Duration::from_secs(1));
        again.unlock().await.unwrap();
    }
    assert_eq!(pool.status().in_use, 0);
}

#[tokio::test]
async fn a_session_lock_that_can_never_be_admitted_is_refused_at_once() {
    let db = db().await;
    let raw = db.connect().await.unwrap();
    raw.execute("SELECT pg_advisory_lock(502)", &[])
        .await
        .unwrap();
    // The unlock of a guard cancelled while its lock waits on the server
    // queues behind that wait: the release stays in flight up to the unlock
    // timeout (then its connection is closed).
    let pool = builder(&db, 4)
        .unlock_timeout(Duration::from_millis(1500))
        .build()
        .unwrap();
    let waiting = pool.session_lock(LockKey::Single(502), pgwarden::LockMode::Exclusive, Some(T));
    assert!(tokio::time::timeout(Duration::from_millis(300), waiting)
        .await
        .is_err());
    assert_eq!(pool.status().lane(Lane::SessionLock).releasing, 1);

    // The first one waits for that release...
    let first = tokio::spawn({
        let pool = pool.clone();
        async move {
            let start = Instant::now();
            let lock = pool
                .session_lock(LockKey::Single(503), pgwarden::LockMode::Exclusive, Some(T))
                .await;
            let releasing = pool.status().lane(Lane::SessionLock).releasing;
            (start.elapsed(), Instant::now(), releasing, lock)
        }
    });
    eventually(T, "the first waiter queues", || async {
        pool.status().lane(Lane::SessionLock).waiting == 1
    })
    .await;
    // ...and the slot it frees is the first one's: a try-once call (no
    // wait) can never be admitted while the first holds it, and hears so at
    // once.
    let start = Instant::now();
    let e = pool
        .session_lock(LockKey::Single(504), pgwarden::LockMode::Exclusive, None)
        .await
        .unwrap_err();
    let took = start.elapsed();
    assert!(e.is_budget_exhausted(), "{e}");
    assert!(took < Duration::from_millis(200), "refused after {took:?}");
    // A call with a wait queues behind the first for the budget instead.
    let second = tokio::spawn({
        let pool = pool.clone();
        async move {
            pool.session_lock(LockKey::Single(504), pgwarden::LockMode::Exclusive, Some(T))
                .await
        }
    });
    eventually(T, "the second waiter queues behind the first", || async {
        pool.status().lane(Lane::SessionLock).waiting == 2
    })
    .await;

    eventually(T, "the release ends", || async {
        pool.status().lane(Lane::SessionLock).releasing == 0
    })
    .await;
    let ended = Instant::now();
    let (waited, granted, releasing, lock) = first.await.unwrap();
    let lock = lock.unwrap().expect("a wait grants the lock or fails");
    assert!(waited < T, "admitted when the release ended: {waited:?}");
    let after_end = granted.saturating_duration_since(ended);
    eprintln!(
        "re-lock admitted after the release ended: {waited:?} (granted {after_end:?} after the end was seen)"
    );
    // Not before the release ended: two session locks out at once otherwise.
    assert_eq!(releasing, 0, "granted while the release was in flight");
    // At its end: a new connection and one lock statement, 1 s allowed on a
    // loaded machine; a waiter the release's end did not wake would sit out
    // its whole bound (T, 5 s, about 3.5 s after the end).
    assert!(
        after_end < Duration::from_secs(1),
        "granted {after_end:?} after the release ended"
    );
    assert_eq!(pool.status().lane(Lane::SessionLock).waiting, 1);
    lock.unlock().await.unwrap();
    let lock = within(T, "the second waiter served", second)
        .await
        .unwrap()
        .unwrap()
        .expect("a wait grants the lock or fails");
    lock.unlock().await.unwrap();
    raw.execute("SELECT pg_advisory_unlock_all()", &[])
        .await
        .unwrap();
}
