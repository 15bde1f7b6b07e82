//! Session advisory locks against a real PostgreSQL: key spaces, budget,
//! re-entry, errors, and the drop, panic and cancellation paths. A test
//! under `backends!` runs on every backend from one source (SQL of the
//! test's own on the lock's connection through `Backend::lock_sql`).

use crate::support;

use std::time::{Duration, Instant};

use pgwarden::{BudgetPolicy, Lane, LockKey, LockMode, Namespace};
use support::backend::{settled, Backend, Settings};
use support::*;

const T: Duration = Duration::from_secs(5);
/// A bound only a wrong behaviour waits out, under [`GUARD`], the guard
/// against that hang: no upper bound on the machine's speed.
const HOUR: Duration = Duration::from_secs(3600);
const GUARD: Duration = Duration::from_secs(60);

backends!(single_and_pair_are_distinct_key_spaces);
async fn single_and_pair_are_distinct_key_spaces<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("key-spaces", 4));
    let raw = db.connect().await.unwrap();
    let single = B::session_lock(&pool, LockKey::Single(1), LockMode::Exclusive, Some(T))
        .await
        .unwrap()
        .expect("a wait grants the lock or fails");
    assert!(!free(&raw, LockKey::Single(1)).await, "Single(1) is held");
    assert!(
        free(&raw, LockKey::Pair(0, 1)).await,
        "Pair(0, 1) is another key"
    );
    B::unlock(single).await.unwrap();

    const APP: Namespace = Namespace::new(7);
    let named = B::session_lock(&pool, APP.named("nightly"), LockMode::Exclusive, Some(T))
        .await
        .unwrap()
        .expect("a wait grants the lock or fails");
    // 32-bit FNV-1a of the name, computed here independently.
    let hash = b"nightly".iter().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    }) as i32;
    assert!(
        !free(&raw, LockKey::Pair(7, hash)).await,
        "named key = (7, fnv1a32)"
    );
    B::unlock(named).await.unwrap();
    assert!(free(&raw, LockKey::Pair(7, hash)).await);
}

backends!(session_locks_check_out_on_their_budgeted_lane);
async fn session_locks_check_out_on_their_budgeted_lane<B: Backend>() {
    let db = db().await;
    // Size 4: the default session-lock budget is 1, policy refuse.
    let pool = B::build(&db, &Settings::new("budgeted-lane", 4));
    let a = B::session_lock(&pool, LockKey::Single(10), LockMode::Exclusive, Some(T))
        .await
        .unwrap()
        .expect("a wait grants the lock or fails");
    assert_eq!(B::status(&pool).lane(Lane::SessionLock).in_use, 1);
    let e = B::session_lock(&pool, LockKey::Single(11), LockMode::Exclusive, None)
        .await
        .unwrap_err();
    assert!(e.is_budget_exhausted(), "{e}");
    assert!(
        e.to_string().contains("locks.rs"),
        "names the holder's call site: {e}"
    );
    B::unlock(a).await.unwrap();
    settled::<B>(&pool).await;
    assert_eq!(B::status(&pool).lane(Lane::SessionLock).in_use, 0);
}

backends!(reentry_is_counted_and_gauged);
async fn reentry_is_counted_and_gauged<B: Backend>() {
    let db = db().await;
    let settings = Settings::new("reentry", 4);
    let (pool, snap) = B::build_recorded(&db, &settings);
    let name = settings.pool_name::<B>();
    let raw = db.connect().await.unwrap();
    let key = LockKey::Pair(3, 4);
    let held = || {
        let m = metrics_now(&snap);
        let get = |k: &str| m.get(&format!("pgwarden_{k}{{pool={name}}}")).copied();
        (get("session_locks_held"), get("session_lock_connections"))
    };
    let mut lock = B::session_lock(&pool, key, LockMode::Exclusive, Some(T))
        .await
        .unwrap()
        .expect("a wait grants the lock or fails");
    assert_eq!(B::lock_again(&mut lock).await.unwrap(), 2);
    assert_eq!(held(), (Some(2.0), Some(1.0)));
    assert_eq!(B::unlock_one(&mut lock).await.unwrap(), 1);
    assert!(
        !free(&raw, key).await,
        "one level left: still held, as in PostgreSQL"
    );
    let e = B::unlock_one(&mut lock).await.unwrap_err();
    assert!(
        matches!(
            e,
            pgwarden::Error::Lock(pgwarden::LockError::UnbalancedUnlock { .. })
        ),
        "{e}"
    );
    assert_eq!(B::lock_again(&mut lock).await.unwrap(), 2);
    B::unlock(lock).await.unwrap(); // every level
    assert!(free(&raw, key).await);
    assert_eq!(held(), (Some(0.0), Some(0.0)), "set back by the unlock");
    settled::<B>(&pool).await;
}

backends!(an_unlock_one_cut_off_then_a_refused_lock_again_still_unlocks);
/// A level statement cut off in flight leaves the count unknown, and a
/// `lock_again` the server refuses after it does not make it known again:
/// `unlock()` releases what the session holds instead of answering
/// `NotOwned` for a lock it still holds (issue 16, point 12).
async fn an_unlock_one_cut_off_then_a_refused_lock_again_still_unlocks<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("cut-off-unlock", 3));
    let raw = db.connect().await.unwrap();
    let key = LockKey::Pair(3, 5);
    let mut lock = B::session_lock(&pool, key, LockMode::Exclusive, Some(T))
        .await
        .unwrap()
        .expect("a wait grants the lock or fails");
    assert_eq!(B::lock_again(&mut lock).await.unwrap(), 2);
    let pid = B::lock_pid(&lock);
    // unlock_one polled once (its statement goes out) and dropped, the
    // lock's backend stopped meanwhile so that its answer cannot come within
    // that one poll (on a busy machine a quick server's answer did, on sqlx,
    // which reads right after it writes: CI saw it 50 times in a row).
    let frozen = support::Stopped::stop([pid]).expect("SIGSTOP the lock's backend");
    assert!(futures_util::FutureExt::now_or_never(B::unlock_one(&mut lock)).is_none());
    drop(frozen);
    eventually(T, "the cut-off unlock ran", || async {
        let row = raw
            .query_one(
                "SELECT state, query FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )
            .await
            .unwrap();
        let (state, query): (Option<String>, Option<String>) = (row.get(0), row.get(1));
        state.as_deref() == Some("idle") && query.is_some_and(|q| q.contains("pg_advisory_unlock"))
    })
    .await;
    assert!(!free(&raw, key).await, "one level left");
    // The session in a failed transaction: the server refuses lock_again.
    B::lock_sql(&mut lock, "BEGIN").await.unwrap();
    assert!(B::lock_sql(&mut lock, "SELECT 1/0").await.is_err());
    let e = B::lock_again(&mut lock).await.unwrap_err();
    // 25P02: in_failed_sql_transaction (the display of either backend's
    // database error).
    assert!(e.to_string().starts_with("database error 25P02"), "{e:?}");
    B::lock_sql(&mut lock, "ROLLBACK").await.unwrap();
    assert!(!free(&raw, key).await, "the session still holds it");
    B::unlock(lock).await.unwrap();
    assert!(free(&raw, key).await);
    settled::<B>(&pool).await;
}

backends!(shared_and_try_variants);
async fn shared_and_try_variants<B: Backend>() {
    let db = db().await;
    let settings = Settings::new("shared-try", 8).budget(3, BudgetPolicy::Refuse);
    let pool = B::build(&db, &settings);
    let raw = db.connect().await.unwrap();
    let key = LockKey::Single(-5);
    let lock = |mode, wait| B::session_lock(&pool, key, mode, wait);
    let r1 = lock(LockMode::Shared, Some(T))
        .await
        .unwrap()
        .expect("a wait grants the lock or fails");
    let r2 = lock(LockMode::Shared, None)
        .await
        .unwrap()
        .expect("shared with shared");
    assert!(
        lock(LockMode::Exclusive, None).await.unwrap().is_none(),
        "no writer while readers"
    );
    assert!(!free(&raw, key).await);
    B::unlock(r1).await.unwrap();
    B::unlock(r2).await.unwrap();
    let w = lock(LockMode::Exclusive, None)
        .await
        .unwrap()
        .expect("free again");
    assert!(lock(LockMode::Shared, None).await.unwrap().is_none());
    B::unlock(w).await.unwrap();
    settled::<B>(&pool).await;
    assert_eq!(B::status(&pool).lane(Lane::SessionLock).in_use, 0);
}

backends!(lock_timeout_is_typed_and_leaves_the_connection_clean);
async fn lock_timeout_is_typed_and_leaves_the_connection_clean<B: Backend>() {
    let db = db().await;
    // The pool's own bound is an hour: a wait that ignored its lock timeout
    // would hang past the guard.
    let pool = B::build(&db, &Settings::new("lock-timeout", 3).wait(HOUR));
    let raw = db.connect().await.unwrap();
    raw.execute("SELECT pg_advisory_lock(77)", &[])
        .await
        .unwrap();
    // A connection open before the wait, and a wait of 1 s: the wait bounds
    // the checkout too, and with 200 ms and no open connection a loaded
    // machine (load 24, sqlx 0.9) spent it connecting, not waiting.
    drop(B::get(&pool).await.unwrap());
    settled::<B>(&pool).await;
    let start = Instant::now();
    let e = within(
        GUARD,
        "the wait ends at its lock timeout",
        B::session_lock(
            &pool,
            LockKey::Single(77),
            LockMode::Exclusive,
            Some(Duration::from_secs(1)),
        ),
    )
    .await
    .unwrap_err();
    let took = start.elapsed();
    assert!(e.is_lock_timeout(), "{e:?}");
    assert!(took >= Duration::from_millis(750), "{took:?}");
    // Settled once its unlock is confirmed: a lock timeout does not prove
    // nothing was taken (`a_lock_granted_as_its_wait_times_out_is_not_left_in_the_pool`).
    settled::<B>(&pool).await;
    // The raw session's lock alone: no wait left, nothing on the pool's side
    // (an exclusive lock has one holder).
    let locks: Vec<_> = raw_locks(&raw).await.iter().map(|l| (l.2, l.4)).collect();
    assert_eq!(locks, [(77, true)]);
    // The bound was statement-local: no pooled session keeps it.
    let mut c = B::get(&pool).await.unwrap();
    let sql = "SELECT (current_setting('lock_timeout') = '0')::int::int8";
    assert_eq!(B::scalar(&mut c, sql).await, Ok(1), "lock_timeout is 0");
}

backends!(unlock_that_postgres_refuses_is_an_error);
async fn unlock_that_postgres_refuses_is_an_error<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("refused-unlock", 3));
    let raw = db.connect().await.unwrap();
    let mut lock = B::session_lock(&pool, LockKey::Single(8), LockMode::Exclusive, Some(T))
        .await
        .unwrap()
        .expect("a wait grants the lock or fails");
    // Released behind the guard's back, on its own connection.
    B::lock_sql(&mut lock, "SELECT pg_advisory_unlock_all()")
        .await
        .unwrap();
    let e = B::unlock(lock).await.unwrap_err();
    assert!(e.is_not_owned(), "{e}");
    settled::<B>(&pool).await;
    assert!(free(&raw, LockKey::Single(8)).await);
}

backends!(panic_while_held_releases);
async fn panic_while_held_releases<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("panic-held", 3));
    let raw = db.connect().await.unwrap();
    let p = pool.clone();
    let task = tokio::spawn(async move {
        let _lock = B::session_lock(&p, LockKey::Single(12), LockMode::Exclusive, Some(T))
            .await
            .unwrap()
            .expect("a wait grants the lock or fails");
        panic!("work under the lock failed");
    });
    assert!(task.await.unwrap_err().is_panic());
    settled::<B>(&pool).await;
    assert!(free(&raw, LockKey::Single(12)).await);
}

backends!(cancelled_while_waiting_and_confirmed_unlocks_and_keeps);
/// Cancelled while the lock statement waits on the server: the release
/// queues behind it; confirmed within the unlock timeout, the connection
/// is kept. (Not confirmed, it is closed:
/// `lock_backends::a_guard_cancelled_while_waiting_past_its_unlock_bound_is_closed`.)
/// On sqlx the wait's own error (its lock timeout) comes back as the
/// answer to the release's `pg_advisory_unlock_all()`, which sqlx had not
/// sent yet: the release sends it once more. Failed on sqlx before (the
/// release took that error for its own and closed the connection).
async fn cancelled_while_waiting_and_confirmed_unlocks_and_keeps<B: Backend>() {
    let db = db().await;
    let raw = db.connect().await.unwrap();
    let key = LockKey::Single(13);
    raw.execute("SELECT pg_advisory_lock(13)", &[])
        .await
        .unwrap();
    // lock_timeout (2 s) ends the wait before the unlock bound (an hour).
    // Cancelled once it waits on the server; tried again in the rare case
    // its lock timeout ended the wait before that was seen.
    let pool = B::build(&db, &Settings::new("cancel-kept", 3).unlock_timeout(HOUR));
    let mut tries = 0;
    let pid = loop {
        let wait = B::session_lock(&pool, key, LockMode::Exclusive, Some(2 * T / 5));
        if let Some(pid) = cancel_once_waiting(&raw, 13, wait).await {
            break pid;
        }
        tries += 1;
        assert!(tries < 10, "never seen waiting on the server");
    };
    eventually(GUARD, "released", || {
        std::future::ready(B::status(&pool).in_use == 0)
    })
    .await;
    assert!(alive(&raw, pid).await, "the waiting session is kept");
    assert_eq!(B::status(&pool).size, 1, "unlocked and kept");
    raw.execute("SELECT pg_advisory_unlock(13)", &[])
        .await
        .unwrap();
    assert!(raw_locks(&raw).await.is_empty());
}

backends!(long_hold_warning_names_the_key);
async fn long_hold_warning_names_the_key<B: Backend>() {
    let db = db().await;
    // Longer than taking the lock on a loaded machine: a pass that comes
    // while the lock statement still runs logs the hold without its key
    // (and only once).
    let settings =
        Settings::new("held", 3).long_hold(Duration::from_secs(1), Duration::from_millis(20));
    let (pool, snap) = B::build_recorded(&db, &settings);
    let name = settings.pool_name::<B>();
    // The runtime of `#[tokio::test]` runs the housekeeping task on this
    // thread: the thread's default subscriber sees its logs.
    let logs = Logs::default();
    let _logs = tracing::subscriber::set_default(logs.subscriber());
    let lock = B::session_lock(&pool, LockKey::Pair(5, 6), LockMode::Exclusive, Some(T))
        .await
        .unwrap()
        .expect("a wait grants the lock or fails");
    eventually(T, "the long hold is logged", || {
        std::future::ready(logs.text().contains("long-hold threshold"))
    })
    .await;
    // Three more passes (the oldest-hold gauge is set again by each pass
    // after a reading resets it): still logged once.
    let key = format!("pgwarden_long_holds_total{{lane=session_lock,pool={name}}}");
    let oldest = format!("pgwarden_oldest_hold_seconds{{lane=session_lock,pool={name}}}");
    let mut long = 0.0;
    for _ in 0..3 {
        long += metrics_now(&snap).get(&key).copied().unwrap_or(0.0);
        eventually(T, "a housekeeping pass", || {
            let m = metrics_now(&snap);
            long += m.get(&key).copied().unwrap_or(0.0);
            std::future::ready(m.contains_key(&oldest))
        })
        .await;
    }
    let text = logs.text();
    assert_eq!(text.matches("long-hold threshold").count(), 1, "{text}");
    for part in [
        "session lock 5:6",
        "session_lock",
        &B::lock_pid(&lock).to_string(),
        "locks.rs",
    ] {
        assert!(text.contains(part), "{part:?} missing from {text}");
    }
    // Counted once, at the first pass past the threshold (readings reset
    // counters: summed over all of them).
    long += metrics_now(&snap).get(&key).copied().unwrap_or(0.0);
    assert_eq!(long, 1.0);

    B::unlock(lock).await.unwrap();
}

/// The log capture the tests here count on: a log line that a thread with
/// no subscriber (a sibling test) hits first is still captured by the test
/// that installed one (see `Logs::subscriber`).
#[test]
fn a_log_line_first_hit_elsewhere_is_still_captured() {
    fn hit(n: u32) {
        tracing::debug!(n, "capture probe");
    }
    let logs = Logs::default();
    let _log = tracing::subscriber::set_default(logs.subscriber());
    std::thread::spawn(|| hit(1)).join().unwrap();
    hit(2);
    assert!(logs.text().contains("capture probe n=2"), "{}", logs.text());
}

#[path = "locks/thousand.rs"]
mod thousand;
