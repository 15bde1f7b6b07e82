//! The admission state machine against a real PostgreSQL, on every
//! backend: a session lock taken again right after its guard was dropped
//! waits for the background unlock and is admitted, not refused; a
//! try-once session-lock checkout that can never be admitted while the
//! queue ahead holds is refused at once, and one with a wait queues behind
//! it.

use crate::support;

use std::time::Duration;

use pgwarden::{Lane, LockKey, LockMode};
use support::backend::{settled, Backend, Settings};
use support::*;

const T: Duration = Duration::from_secs(5);
/// The wait bound of the calls that must be woken by an event: a missed
/// wake-up would sit it out, far past [`GUARD`].
const HOUR: Duration = Duration::from_secs(3600);
/// Only against a hang: what the right behaviour takes on any machine, the
/// wrong one (an hour's wait) never does.
const GUARD: Duration = Duration::from_secs(60);

backends!(a_lock_taken_again_right_after_its_guard_dropped_is_admitted);
async fn a_lock_taken_again_right_after_its_guard_dropped_is_admitted<B: Backend>() {
    let db = db().await;
    // Size 4: a session-lock budget of 1, policy refuse.
    let pool = B::build(&db, &Settings::new("relock", 4));
    let key = LockKey::Single(501);
    for round in 0..10 {
        let lock = B::session_lock(&pool, key, LockMode::Exclusive, Some(T))
            .await
            .unwrap()
            .expect("a wait grants the lock or fails");
        drop(lock); // unlocked in a spawned task; its slot frees after
                    // Woken when the unlock ends: with an hour to wait, a missed
                    // wake-up would hang here (no clock on the machine's speed).
        let again = within(
            GUARD,
            "re-lock admitted when the background unlock ends",
            B::session_lock(&pool, key, LockMode::Exclusive, Some(HOUR)),
        )
        .await
        .unwrap_or_else(|e| panic!("round {round}: {e}"))
        .expect("a wait grants the lock or fails");
        B::unlock(again).await.unwrap();
    }
    settled::<B>(&pool).await;
}

backends!(a_session_lock_that_can_never_be_admitted_is_refused_at_once);
async fn a_session_lock_that_can_never_be_admitted_is_refused_at_once<B: Backend>() {
    let db = db().await;
    let raw = db.connect().await.unwrap();
    raw.execute("SELECT pg_advisory_lock(502)", &[])
        .await
        .unwrap();
    // The unlock of a guard cancelled while its lock waits on the server
    // queues behind that wait: the release stays in flight until `raw`
    // lets 502 go (the unlock timeout, an hour, never ends it here): the
    // test decides when the release ends.
    let pool = B::build(&db, &Settings::new("never", 4).unlock_timeout(HOUR));
    let releasing = |pool: &B::Pool| B::status(pool).lane(Lane::SessionLock).releasing;
    let waiting = |pool: &B::Pool| B::status(pool).lane(Lane::SessionLock).waiting;
    let lock = |key, wait| B::session_lock(&pool, LockKey::Single(key), LockMode::Exclusive, wait);
    // Cancelled once its lock statement waits on the server (an event, not
    // a 300 ms clock that a slow connect could outlast). Its wait is an
    // hour: only raw's unlock ends it (a lock timeout would end the release
    // on a clock).
    let cancelled = cancel_once_waiting(&raw, 502, lock(502, Some(HOUR))).await;
    assert!(
        cancelled.is_some(),
        "502 is held by raw, yet the lock ended"
    );
    eventually(T, "the cancelled lock's release in flight", || {
        std::future::ready(releasing(&pool) == 1)
    })
    .await;

    // The first one waits for that release...
    let first = tokio::spawn({
        let pool = pool.clone();
        async move {
            let lock =
                B::session_lock(&pool, LockKey::Single(503), LockMode::Exclusive, Some(HOUR)).await;
            let releasing = B::status(&pool).lane(Lane::SessionLock).releasing;
            (releasing, lock)
        }
    });
    eventually(T, "the first waiter queues", || {
        std::future::ready(waiting(&pool) == 1)
    })
    .await;
    // ...and the slot it frees is the first one's: a try-once call (no
    // wait) can never be admitted while the first holds it, and hears so at
    // once: while the release is still in flight, which it is until raw
    // lets go below (a call that waited for the slot would hang here).
    let e = within(GUARD, "the try-once call refused", lock(504, None))
        .await
        .unwrap_err();
    assert!(e.is_budget_exhausted(), "{e}");
    assert_eq!(releasing(&pool), 1, "refused before the release ended");
    // A call with a wait queues behind the first for the budget instead.
    let second = tokio::spawn({
        let pool = pool.clone();
        async move {
            B::session_lock(&pool, LockKey::Single(504), LockMode::Exclusive, Some(HOUR)).await
        }
    });
    eventually(T, "the second waiter queues behind the first", || {
        std::future::ready(waiting(&pool) == 2)
    })
    .await;

    // The release ends when raw lets 502 go: the cancelled lock is granted
    // on the server, then unlocked.
    assert!(
        !first.is_finished(),
        "the first waiter admitted during the release"
    );
    raw.execute("SELECT pg_advisory_unlock(502)", &[])
        .await
        .unwrap();
    eventually(GUARD, "the release ends", || {
        std::future::ready(releasing(&pool) == 0)
    })
    .await;
    // The release's end wakes the first waiter: with an hour to wait, one
    // it did not wake would hang here.
    let (releasing_then, lock) = within(
        GUARD,
        "the first waiter admitted at the release's end",
        first,
    )
    .await
    .unwrap();
    let lock = lock.unwrap().expect("a wait grants the lock or fails");
    // Not before the release ended: two session locks out at once otherwise.
    assert_eq!(releasing_then, 0, "granted while the release was in flight");
    assert_eq!(waiting(&pool), 1);
    B::unlock(lock).await.unwrap();
    let lock = within(GUARD, "the second waiter served", second)
        .await
        .unwrap()
        .unwrap()
        .expect("a wait grants the lock or fails");
    B::unlock(lock).await.unwrap();
    settled::<B>(&pool).await;
    assert!(raw_locks(&raw).await.is_empty());
}
