//! Advisory locks done right: typed keys, session locks that cannot leak into
//! the pool, and transaction-scoped locks.
//!
//! # Which lock?
//!
//! Prefer a **transaction-scoped** lock ([`crate::Pool::with_xact_lock`],
//! [`xact_lock`]): PostgreSQL releases it at `COMMIT` or `ROLLBACK`, it cannot
//! leak, and it works behind a transaction-mode pooler. For exclusivity longer
//! than a reasonable transaction, prefer a table lease, which holds no
//! connection between statements.
//!
//! A **session** lock ([`crate::Pool::session_lock`]) pins one connection for
//! as long as it is held: it is checked out on [`crate::Lane::SessionLock`],
//! whose budget bounds how many connections locks may pin. The guard,
//! [`SessionLock`], owns that connection and unlocks on it. Dropped without
//! [`SessionLock::unlock`], panicked through, or cancelled while acquiring,
//! it never returns the connection to the pool still holding a lock: a
//! spawned task ends any transaction left open on it and runs
//! `pg_advisory_unlock_all()` there, and where that is not
//! confirmed within the pool's unlock timeout, the connection is closed
//! instead, so that PostgreSQL ends the session and the lock with it.

mod pooled;
mod release;
mod run_once;
mod session;
mod xact;

use std::time::Duration;

use crate::pool::{PoolBuilder, Shared, Source};
use crate::stmt::{code, Param, SqlError};

pub use crate::key::{LockKey, LockMode, Namespace};
pub use run_once::Migrated;
#[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
pub(crate) use run_once::Work;
pub(crate) use run_once::{migrate_once, with_xact_lock, DeadpoolWork};
pub(crate) use session::acquire as session_lock;
pub use session::SessionLock;
pub use xact::xact_lock;
pub(crate) use xact::xact_lock_on;

/// How long a dropped or cancelled session lock may take to confirm its
/// release: a builder setting, in the pool's extension slot.
#[derive(Copy, Clone, Debug)]
struct UnlockTimeout(Duration);

impl Default for UnlockTimeout {
    fn default() -> Self {
        UnlockTimeout(Duration::from_secs(5))
    }
}

/// The pool's unlock bound ([`PoolBuilder::unlock_timeout`]).
pub(crate) fn unlock_timeout<B: Source>(pool: &Shared<B>) -> Duration {
    pool.ext.get::<UnlockTimeout>().0
}

/// The least a release that its caller waits for ([`SessionLock::unlock`],
/// the clean-up of a lock a pooler moved at acquisition) is given, whatever
/// the unlock timeout: a healthy server answers in milliseconds, and a zero
/// or tiny unlock timeout, meant for dropped guards ("close rather than
/// wait"), must not refuse it (and close a healthy connection) at random.
pub(crate) const EXPLICIT_UNLOCK_FLOOR: Duration = Duration::from_secs(1);

/// The bound of a release its caller waits for: the unlock timeout, at
/// least [`EXPLICIT_UNLOCK_FLOOR`].
pub(crate) fn explicit_unlock_bound(unlock_timeout: Duration) -> Duration {
    unlock_timeout.max(EXPLICIT_UNLOCK_FLOOR)
}

impl<B: Source> PoolBuilder<B> {
    /// How long a session lock dropped without `unlock` (or cancelled while
    /// acquiring) may take to confirm its release before its connection is
    /// closed instead of returned (zero: always closed). Default: 5 s.
    ///
    /// An explicit [`SessionLock::unlock`] is bounded by it too, but never
    /// by less than one second: a zero or tiny bound here closes dropped
    /// guards' connections at once, and does not make a healthy `unlock()`
    /// fail with [`LockError::UnlockNotConfirmed`](crate::LockError::UnlockNotConfirmed)
    /// because its answer was not back within a millisecond.
    ///
    /// ```no_run
    /// # fn demo() -> Result<(), pgwarden::BuildError> {
    /// let pool = pgwarden::Pool::from_url("postgres://app@db/app", 16)?
    ///     .unlock_timeout(std::time::Duration::from_secs(2))
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn unlock_timeout(self, bound: Duration) -> Self {
        self.set_ext(UnlockTimeout(bound))
    }
}

/// Which family of PostgreSQL functions.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Scope {
    Session,
    Xact,
}

/// The PostgreSQL function that takes a lock of `scope` and `mode`, waiting or not,
/// schema-qualified: a search path user code left on a session cannot shadow it.
pub(crate) const fn lock_fn(scope: Scope, mode: LockMode, wait: bool) -> &'static str {
    match (scope, mode, wait) {
        (Scope::Session, LockMode::Exclusive, true) => "pg_catalog.pg_advisory_lock",
        (Scope::Session, LockMode::Shared, true) => "pg_catalog.pg_advisory_lock_shared",
        (Scope::Session, LockMode::Exclusive, false) => "pg_catalog.pg_try_advisory_lock",
        (Scope::Session, LockMode::Shared, false) => "pg_catalog.pg_try_advisory_lock_shared",
        (Scope::Xact, LockMode::Exclusive, true) => "pg_catalog.pg_advisory_xact_lock",
        (Scope::Xact, LockMode::Shared, true) => "pg_catalog.pg_advisory_xact_lock_shared",
        (Scope::Xact, LockMode::Exclusive, false) => "pg_catalog.pg_try_advisory_xact_lock",
        (Scope::Xact, LockMode::Shared, false) => "pg_catalog.pg_try_advisory_xact_lock_shared",
    }
}

/// A `lock_timeout` value for a bound: whole milliseconds, rounded up, at
/// least 1 (0 would turn the timeout off) and at most `i32::MAX`.
pub(crate) fn lock_timeout_setting(bound: Duration) -> String {
    let ms = bound.as_micros().div_ceil(1000).clamp(1, i32::MAX as u128);
    format!("{ms}ms")
}

/// A key's parameters, in placeholder order (see
/// [`LockKey::placeholders`]): the first `n` of the array (`n` is 1 or 2).
pub(crate) fn key_params(key: LockKey) -> ([Param<'static>; 2], usize) {
    match key {
        LockKey::Single(k) => ([Param::Int8(k), Param::Int8(0)], 1),
        LockKey::Pair(a, b) => ([Param::Int4(a), Param::Int4(b)], 2),
    }
}

/// Maps a failed lock statement: 55P03 is a [`LockError::Timeout`](crate::LockError::Timeout).
pub(crate) fn lock_error(e: SqlError, key: LockKey, timeout: Duration) -> crate::Error {
    if e.is(code::LOCK_NOT_AVAILABLE) {
        crate::Error::Lock(crate::LockError::Timeout { key, timeout })
    } else {
        e.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_timeout_never_zero_and_rounds_up() {
        assert_eq!(lock_timeout_setting(Duration::ZERO), "1ms");
        assert_eq!(lock_timeout_setting(Duration::from_micros(1)), "1ms");
        assert_eq!(lock_timeout_setting(Duration::from_micros(1001)), "2ms");
        assert_eq!(lock_timeout_setting(Duration::from_secs(5)), "5000ms");
        assert_eq!(
            lock_timeout_setting(Duration::MAX),
            format!("{}ms", i32::MAX)
        );
    }

    #[test]
    fn key_params_follow_the_placeholders() {
        let (p, n) = key_params(LockKey::Pair(1, 2));
        assert_eq!(n, 2);
        assert!(matches!(p, [Param::Int4(1), Param::Int4(2)]));
        let (p, n) = key_params(LockKey::Single(-7));
        assert_eq!(n, 1);
        assert!(matches!(p[0], Param::Int8(-7)));
    }

    #[test]
    fn modes_read_pg_locks() {
        for m in [LockMode::Exclusive, LockMode::Shared] {
            assert_eq!(LockMode::from_pg_mode(m.pg_mode()), Some(m));
        }
        assert_eq!(LockMode::from_pg_mode("AccessShareLock"), None);
        assert_eq!(
            lock_fn(Scope::Xact, LockMode::Shared, false),
            "pg_catalog.pg_try_advisory_xact_lock_shared"
        );
    }
}
