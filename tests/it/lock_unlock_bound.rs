//! `SessionLock::unlock()` is bounded, on every backend: when the server
//! does not answer (the lock's backend stopped with `SIGSTOP`), the unlock
//! gives up at the pool's unlock timeout (at least one second), the bound
//! its dropped guard uses, and does what the drop path does: its statement cancelled and its
//! connection closed (never returned to the pool), with a typed error.
//! Once the backend runs again its session ends and the lock with it.
//! Before: `unlock()` waited for as long as the backend was stopped.

use crate::support;

use std::time::{Duration, Instant};

use pgwarden::{BudgetPolicy, Error, LockError, LockKey, LockMode};
use support::backend::{settled, Backend, Settings};
use support::{alive, db, eventually, raw_locks, within, Stopped};

/// The guard against a hang: only a wrong behaviour waits it out.
const GUARD: Duration = Duration::from_secs(60);
/// The pool's unlock timeout.
const BOUND: Duration = Duration::from_millis(500);
/// `unlock()`'s bound: the unlock timeout, at least one second (documented
/// on `PoolBuilder::unlock_timeout`; a zero or tiny unlock timeout refused
/// healthy unlocks at random before that floor): here the floor.
const UNLOCK: Duration = Duration::from_secs(1);
/// Past the bound, the time `unlock()` may take to come back: the timer's
/// wake-up and the close on two busy cores (milliseconds quiet, up to
/// seconds beside other suites); 10 s is generous and still far below a
/// wait that ends only when the backend runs again.
const SLACK: Duration = Duration::from_secs(10);

backends!(an_unlock_the_server_does_not_answer_is_bounded);
/// Budget 1. The lock's backend is stopped, then `unlock()`: it returns
/// `UnlockNotConfirmed` within its bound ([`UNLOCK`]) + [`SLACK`], the budget
/// and the pool's slot free again (another lock is taken at once, on
/// another connection). After `SIGCONT` the stopped session ends and
/// `pg_locks` shows no lock. Failed before (the guard fired: `unlock()`
/// waited for the stopped backend).
async fn an_unlock_the_server_does_not_answer_is_bounded<B: Backend>() {
    let db = db().await;
    let raw = db.connect().await.unwrap();
    let s = Settings::new("unlock-stopped", 6)
        .budget(1, BudgetPolicy::Refuse)
        .unlock_timeout(BOUND);
    let pool = B::build(&db, &s);
    let key = LockKey::Single(701);
    let lock = B::session_lock(&pool, key, LockMode::Exclusive, None)
        .await
        .unwrap()
        .expect("a free key");
    let pid = B::lock_pid(&lock);
    let stopped = Stopped::stop([pid]).expect("SIGSTOP");
    let began = Instant::now();
    let e = within(
        UNLOCK + SLACK,
        "the unlock of a stopped backend",
        B::unlock(lock),
    )
    .await
    .unwrap_err();
    eprintln!(
        "{}: unlock gave up after {:?}: {e}",
        B::NAME,
        began.elapsed()
    );
    assert!(
        matches!(e, Error::Lock(LockError::UnlockNotConfirmed { key: k, timeout })
            if k == key && timeout == UNLOCK),
        "{e}"
    );
    // The slot and the budget are back while the backend is still stopped.
    settled::<B>(&pool).await;
    let other = B::session_lock(&pool, LockKey::Single(702), LockMode::Exclusive, None)
        .await
        .expect("the budget is free again")
        .expect("a free key");
    assert_ne!(B::lock_pid(&other), pid, "the closed connection came back");
    B::unlock(other).await.unwrap();
    drop(stopped);
    eventually(GUARD, "the stopped session ended", || async {
        !alive(&raw, pid).await
    })
    .await;
    assert!(
        raw_locks(&raw).await.is_empty(),
        "{:?}",
        raw_locks(&raw).await
    );
    settled::<B>(&pool).await;
}
