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
//! spawned task runs `pg_advisory_unlock_all()` on it, and where that is not
//! confirmed within the pool's unlock timeout, the connection is closed
//! instead, so that PostgreSQL ends the session and the lock with it.

mod key;
mod pooled;
mod release;
mod run_once;
mod session;
mod xact;

use std::fmt;
use std::time::Duration;

pub use key::{fnv1a32, LockKey, Namespace};
pub(crate) use release::LockShared;
pub use run_once::{RunOnce, RUN_ONCE_LEDGER};
pub use session::SessionLock;
pub use xact::{try_xact_lock, try_xact_lock_shared, xact_lock, xact_lock_shared};

/// Exclusive or shared: one holder, or many readers and no writer.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum LockMode {
    /// One holder at a time (`pg_advisory_lock`); `ExclusiveLock` in `pg_locks`.
    Exclusive,
    /// Any number of shared holders, no exclusive one
    /// (`pg_advisory_lock_shared`); `ShareLock` in `pg_locks`.
    Shared,
}

impl LockMode {
    /// The mode as `pg_locks.mode` names it.
    pub const fn pg_mode(self) -> &'static str {
        match self {
            LockMode::Exclusive => "ExclusiveLock",
            LockMode::Shared => "ShareLock",
        }
    }

    /// Reads `pg_locks.mode`.
    pub fn from_pg_mode(mode: &str) -> Option<LockMode> {
        match mode {
            "ExclusiveLock" => Some(LockMode::Exclusive),
            "ShareLock" => Some(LockMode::Shared),
            _ => None,
        }
    }
}

impl fmt::Display for LockMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LockMode::Exclusive => "exclusive",
            LockMode::Shared => "shared",
        })
    }
}

/// Which family of PostgreSQL functions.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Scope {
    Session,
    Xact,
}

/// The PostgreSQL function that takes a lock of `scope` and `mode`, waiting or not.
pub(crate) const fn lock_fn(scope: Scope, mode: LockMode, wait: bool) -> &'static str {
    match (scope, mode, wait) {
        (Scope::Session, LockMode::Exclusive, true) => "pg_advisory_lock",
        (Scope::Session, LockMode::Shared, true) => "pg_advisory_lock_shared",
        (Scope::Session, LockMode::Exclusive, false) => "pg_try_advisory_lock",
        (Scope::Session, LockMode::Shared, false) => "pg_try_advisory_lock_shared",
        (Scope::Xact, LockMode::Exclusive, true) => "pg_advisory_xact_lock",
        (Scope::Xact, LockMode::Shared, true) => "pg_advisory_xact_lock_shared",
        (Scope::Xact, LockMode::Exclusive, false) => "pg_try_advisory_xact_lock",
        (Scope::Xact, LockMode::Shared, false) => "pg_try_advisory_xact_lock_shared",
    }
}

/// A `lock_timeout` value for a bound: whole milliseconds, rounded up, at
/// least 1 (0 would turn the timeout off) and at most `i32::MAX`.
pub(crate) fn lock_timeout_setting(bound: Duration) -> String {
    let ms = bound.as_micros().div_ceil(1000).clamp(1, i32::MAX as u128);
    format!("{ms}ms")
}

/// Maps a failed lock statement: 55P03 is a [`crate::Error::LockTimeout`].
pub(crate) fn lock_error(
    e: tokio_postgres::Error,
    key: LockKey,
    timeout: Duration,
) -> crate::Error {
    if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) {
        crate::Error::LockTimeout { key, timeout }
    } else {
        crate::Error::Db(e)
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
    fn modes_read_pg_locks() {
        for m in [LockMode::Exclusive, LockMode::Shared] {
            assert_eq!(LockMode::from_pg_mode(m.pg_mode()), Some(m));
        }
        assert_eq!(LockMode::from_pg_mode("AccessShareLock"), None);
        assert_eq!(
            lock_fn(Scope::Xact, LockMode::Shared, false),
            "pg_try_advisory_xact_lock_shared"
        );
    }
}
