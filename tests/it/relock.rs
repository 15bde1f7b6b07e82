//! The admission state machine against a real PostgreSQL: a session lock
//! taken again right after its guard was dropped waits for the background
//! unlock and is admitted, not refused; a try-once session-lock checkout
//! that can never be admitted while the queue ahead holds is refused at once,
//! and one with a wait queues behind it.

use crate::support;

use std::time::Duration;

use pgwarden::{Lane, LockKey};
use support::*;

const T: Duration = Duration::from_secs(5);
/// The wait bound of the calls that must be woken by an event: a missed
/// wake-up would sit it out, far past [`GUARD`].
const HOUR: Duration = Duration::from_secs(3600);
/// Only against a hang: what the right behaviour takes on any machine, the
/// wrong one (an hour's wait) never does.
const GUARD: Duration = Duration::from_secs(60);

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
                    // Woken when the unlock ends: with an hour to wait, a missed
                    // wake-up would hang here (no clock on the machine's speed).
        let again = within(
            GUARD,
            "re-lock admitted when the background unlock ends",
            pool.session_lock(key, pgwarden::LockMode::Exclusive, Some(HOUR)),
        )
        .await
        .unwrap_or_else(|e| panic!("round {round}: {e}"))
        .expect("a wait grants the lock or fails");
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
    // queues behind that wait: the release stays in flight until `raw`
    // lets 502 go (the unlock timeout, an hour, never ends it here): the
    // test decides when the release ends.
    let pool = builder(&db, 4).unlock_timeout(HOUR).build().unwrap();
    let waiting = pool.session_lock(LockKey::Single(502), pgwarden::LockMode::Exclusive, Some(T));
    // Cancelled once its lock statement waits on the server (an event, not
    // a 300 ms clock that a slow connect could outlast).
    tokio::select! {
        r = waiting => panic!("502 is held by raw, yet: {:?}", r.map(|l| l.is_some())),
        () = eventually(T, "the session lock waits on the server", || async {
            raw.query_one(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 502 AND NOT granted",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
                == 1
        }) => {}
    }
    eventually(T, "the cancelled lock's release in flight", || async {
        pool.status().lane(Lane::SessionLock).releasing == 1
    })
    .await;

    // The first one waits for that release...
    let first = tokio::spawn({
        let pool = pool.clone();
        async move {
            let lock = pool
                .session_lock(
                    LockKey::Single(503),
                    pgwarden::LockMode::Exclusive,
                    Some(HOUR),
                )
                .await;
            let releasing = pool.status().lane(Lane::SessionLock).releasing;
            (releasing, lock)
        }
    });
    eventually(T, "the first waiter queues", || async {
        pool.status().lane(Lane::SessionLock).waiting == 1
    })
    .await;
    // ...and the slot it frees is the first one's: a try-once call (no
    // wait) can never be admitted while the first holds it, and hears so at
    // once: while the release is still in flight, which it is until raw
    // lets go below (a call that waited for the slot would hang here).
    let e = within(
        GUARD,
        "the try-once call refused",
        pool.session_lock(LockKey::Single(504), pgwarden::LockMode::Exclusive, None),
    )
    .await
    .unwrap_err();
    assert!(e.is_budget_exhausted(), "{e}");
    assert_eq!(
        pool.status().lane(Lane::SessionLock).releasing,
        1,
        "refused before the release ended"
    );
    // A call with a wait queues behind the first for the budget instead.
    let second = tokio::spawn({
        let pool = pool.clone();
        async move {
            pool.session_lock(
                LockKey::Single(504),
                pgwarden::LockMode::Exclusive,
                Some(HOUR),
            )
            .await
        }
    });
    eventually(T, "the second waiter queues behind the first", || async {
        pool.status().lane(Lane::SessionLock).waiting == 2
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
    eventually(GUARD, "the release ends", || async {
        pool.status().lane(Lane::SessionLock).releasing == 0
    })
    .await;
    // The release's end wakes the first waiter: with an hour to wait, one
    // it did not wake would hang here.
    let (releasing, lock) = within(
        GUARD,
        "the first waiter admitted at the release's end",
        first,
    )
    .await
    .unwrap();
    let lock = lock.unwrap().expect("a wait grants the lock or fails");
    // Not before the release ended: two session locks out at once otherwise.
    assert_eq!(releasing, 0, "granted while the release was in flight");
    assert_eq!(pool.status().lane(Lane::SessionLock).waiting, 1);
    lock.unlock().await.unwrap();
    let lock = within(GUARD, "the second waiter served", second)
        .await
        .unwrap()
        .unwrap()
        .expect("a wait grants the lock or fails");
    lock.unlock().await.unwrap();
    raw.execute("SELECT pg_advisory_unlock_all()", &[])
        .await
        .unwrap();
}
