//! [`LockError`]: an advisory lock could not be taken or released as asked.

use std::time::Duration;

use crate::key::LockKey;

/// An advisory lock could not be taken or released as asked. Recover from
/// [`LockError::Timeout`] by retrying later; [`LockError::BehindPooler`] and
/// [`LockError::MovedByPooler`] by changing how the pool reaches the server
/// (or using a transaction-scoped lock or a table lease); the others are
/// bugs in how the guard was used.
///
/// ```no_run
/// use pgwarden::{Error, LockError, LockKey, LockMode};
/// use std::time::Duration;
///
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), Error> {
/// match pool.session_lock(LockKey::Single(7), LockMode::Exclusive, Some(Duration::from_secs(1))).await {
///     Ok(Some(lock)) => lock.unlock().await?,
///     Ok(None) => {}
///     Err(Error::Lock(LockError::Timeout { key, timeout })) => {
///         eprintln!("{key} still held after {timeout:?}: try again later");
///     }
///     Err(Error::Lock(LockError::BehindPooler { .. })) => {
///         // a transaction-mode pooler: take a transaction-scoped lock instead
///     }
///     Err(e) => return Err(e),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// An advisory lock was not granted within its bound: PostgreSQL's
    /// `lock_timeout` fired (SQLSTATE 55P03, `lock_not_available`).
    ///
    /// For a transaction-scoped lock, PostgreSQL has aborted the transaction:
    /// roll it back (dropping it does) and retry with a new one.
    #[error(
        "advisory lock {key} not granted within {timeout:?} (lock_timeout, sqlstate 55P03): \
         another session holds it; retry later, or use a try_ variant to skip instead of waiting"
    )]
    Timeout {
        /// The key asked for.
        key: LockKey,
        /// The bound that passed.
        timeout: Duration,
    },

    /// PostgreSQL said this session did not hold the lock it was asked to
    /// release (`WARNING: you don't own a lock of type ExclusiveLock`).
    #[error(
        "advisory lock {key} was not held by its guard's session when unlocked: something released it \
         behind the guard (raw pg_advisory_unlock or pg_advisory_unlock_all on its connection); \
         the connection is cleaned up, not returned as is"
    )]
    NotOwned {
        /// The key.
        key: LockKey,
    },

    /// `unlock_one` would release the last level of a guard: that is
    /// [`SessionLock::unlock`](crate::SessionLock::unlock)'s job.
    #[error("advisory lock {key} is held once: release the last level with unlock(self), not unlock_one")]
    UnbalancedUnlock {
        /// The key.
        key: LockKey,
    },

    /// Session advisory locks were refused because the pool talks to
    /// PostgreSQL through a transaction-mode pooler.
    #[error(
        "session advisory locks cannot work behind a transaction-mode pooler ({how}): the pooler hands \
         the server connection, and the lock with it, to other clients between transactions; \
         use a transaction-scoped lock (pool.with_xact_lock, pgwarden::xact_lock) or a table lease \
         (pgwarden::Leases)"
    )]
    BehindPooler {
        /// `"configured"`, `"detected"`, or `"detected at the lock"` (the
        /// check on a lock's own connection found it, and released the lock).
        how: &'static str,
    },

    /// A session lock's statement ran on another server session than the
    /// one its lock was taken on: the connection goes through a
    /// transaction-mode pooler (configured [`crate::PoolerMode::Direct`], or
    /// one that detection and the lock's own check could not see). Both
    /// [`Error::is_not_owned`](crate::Error::is_not_owned) and
    /// [`Error::is_behind_pooler`](crate::Error::is_behind_pooler) hold.
    #[error(
        "advisory lock {key}: the connection goes through a transaction-mode pooler (PgBouncer or the like), \
         which ran the guard's statement on backend pid {ran_on}, not on pid {held_on} where the lock was \
         taken; {fate}; session locks cannot work through such a pooler: leave the pool's pooler setting \
         at PoolerMode::Auto or set PoolerMode::Transaction, and use a transaction-scoped lock \
         (pool.with_xact_lock) or a table lease (pgwarden::Leases)",
        fate = if *released {
            format!("the lock was released on pid {held_on} by a later statement that reached it")
        } else {
            format!(
                "the lock stays on that pooled server connection, shared by other clients, until it \
                 closes: end it with SELECT pg_terminate_backend({held_on}) on the server"
            )
        }
    )]
    MovedByPooler {
        /// The key.
        key: LockKey,
        /// The backend pid the lock was taken on.
        held_on: i32,
        /// The backend pid the statement ran on.
        ran_on: i32,
        /// Whether the lock was released on `held_on` since.
        released: bool,
    },

    /// [`SessionLock::unlock`](crate::SessionLock::unlock) got no answer
    /// from the server within the pool's unlock timeout
    /// ([`PoolBuilder::unlock_timeout`](crate::PoolBuilder::unlock_timeout),
    /// for `unlock()` at least one second):
    /// a backend frozen or a link cut off. As for a dropped guard, the lock's
    /// statement in flight was cancelled and its connection closed (never
    /// returned to the pool): PostgreSQL ends the session, and releases
    /// the lock with it, as soon as the backend runs again or notices the
    /// closed connection. The pool's slot is free again. Nothing to undo;
    /// another session may have to wait until that session has ended.
    #[error(
        "advisory lock {key}: unlock not confirmed within {timeout:?} (the server did not answer); \
         its connection was closed and its statement cancelled: the lock goes with its session, \
         as soon as the backend notices"
    )]
    UnlockNotConfirmed {
        /// The key.
        key: LockKey,
        /// The bound that passed: the unlock timeout, at least one second.
        timeout: Duration,
    },

    /// [`Pool::migrate_once`](crate::Pool::migrate_once)'s work ran (its
    /// closure returned `Ok`) but recording it in the ledger
    /// (`pgwarden_run_once`) failed. With `rolled_back`, its transaction was
    /// rolled back: the work's database writes are undone, anything it did
    /// outside the database stays done, and the next call runs it again.
    /// Without, the connection failed during `COMMIT`: whether the work and
    /// its record committed is unknown (look for the name in the ledger).
    #[error(
        "migrate_once {name:?} ran its work but could not record it in pgwarden_run_once: {db}; {fate}",
        db = source,
        fate = if *rolled_back {
            "its transaction was rolled back (its database writes are undone; anything it did outside \
             the database stays done), and the next call runs it again"
        } else {
            "the connection failed during COMMIT, so whether the work and its record committed is \
             unknown: look for the name in pgwarden_run_once before running it again"
        }
    )]
    MigrationNotRecorded {
        /// The migration's name.
        name: String,
        /// Whether its transaction is known rolled back.
        rolled_back: bool,
        /// The database's error: [`Error::Db`](crate::Error::Db) on the
        /// deadpool pool, `Error::Sqlx` on a sqlx pool.
        #[source]
        source: Box<crate::Error>,
    },
}
