//! Errors: [`Error`] for everything the pool, locks and leases do, and
//! [`BuildError`] for settings that cannot work.

use std::fmt;
use std::panic::Location;
use std::time::Duration;

use crate::admission::{Lane, LimitsError};
use crate::key::LockKey;
use crate::lost::LostReason;
use crate::status::Status;

/// A checkout that holds a lane's connection, as named in errors and logs.
#[derive(Clone, Debug)]
pub struct LaneHolder {
    /// Where the connection was checked out.
    pub site: &'static Location<'static>,
    /// How long it has been out.
    pub age: Duration,
    /// Its backend pid, when known.
    pub pid: Option<i32>,
}

impl fmt::Display for LaneHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({:.1?} ago", self.site, self.age)?;
        if let Some(pid) = self.pid {
            write!(f, ", pid {pid}")?;
        }
        f.write_str(")")
    }
}

pub(crate) struct Holders<'a>(pub(crate) &'a [LaneHolder]);

impl fmt::Display for Holders<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        for (i, h) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{h}")?;
        }
        Ok(())
    }
}

/// Everything that can go wrong in pgwarden at run time.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The underlying deadpool pool failed: connection creation, closed pool,
    /// a deadpool timeout.
    #[error("pool error: {0}")]
    Pool(#[from] deadpool_postgres::PoolError),

    /// No connection of `lane` came within the caller's bound: the bound
    /// covers admission, deadpool's wait, connecting, recycling and the
    /// backend-pid query.
    #[error("timed out after {waited:?} {stage} for a {lane} connection ({status})")]
    Timeout {
        /// The lane asked for.
        lane: Lane,
        /// How long the caller waited.
        waited: Duration,
        /// What the checkout was doing when its bound ran out.
        stage: Stage,
        /// The pool at that moment (boxed: it keeps `Error` small).
        status: Box<Status>,
    },

    /// pgwarden admitted a checkout but the wrapped deadpool pool had no
    /// connection for it: deadpool's capacity was changed, or its objects
    /// taken, outside pgwarden (a clone of the deadpool pool given to
    /// `Pool::builder`, or a `resize` on it).
    #[error(
        "pgwarden admitted a {lane} checkout but deadpool had no connection for it: {}",
        if deadpool_max != size {
            format!("deadpool's max_size is {deadpool_max}, pgwarden owns {size} (the deadpool pool was resized outside pgwarden)")
        } else {
            format!("pgwarden has {in_use} of {size} out; the others are held outside pgwarden (a clone of the wrapped deadpool pool): build pgwarden over a pool nothing else uses")
        }
    )]
    DeadpoolMismatch {
        /// The lane asked for.
        lane: Lane,
        /// The size pgwarden recorded at build.
        size: usize,
        /// deadpool's `max_size` now.
        deadpool_max: usize,
        /// Connections pgwarden had out.
        in_use: usize,
    },

    /// A session-lock checkout past its budget was refused.
    #[error(
        "{lane} budget exhausted: {in_use} of {limit} in use{floor}; held by: {holders}; \
         hold no connection for background exclusivity: use a table lease \
         (pgwarden::Leases), or a transaction-scoped lock (pool.with_xact_lock)",
        holders = Holders(holders),
        floor = if *hard_floor { " (hard floor: the other lanes' reservations and one request connection)" } else { "" }
    )]
    BudgetExhausted {
        /// The lane refused (always [`Lane::SessionLock`] today).
        lane: Lane,
        /// Its limit: the configured maximum, or the hard ceiling.
        limit: usize,
        /// Connections of the lane in use.
        in_use: usize,
        /// True when the hard floor refused it, which no policy lifts.
        hard_floor: bool,
        /// The checkouts holding the lane now.
        holders: Vec<LaneHolder>,
    },

    /// The readiness probe did not answer within its bound.
    #[error("readiness probe did not answer within {0:?}")]
    ReadinessTimeout(Duration),

    /// PostgreSQL returned an error, or the connection failed.
    ///
    /// Displayed with what the server said: `database error 42P01: relation
    /// "x" does not exist`, then its detail and hint when it gave them; an
    /// error of the connection itself (closed, I/O) with tokio-postgres's
    /// chain of causes. [`tokio_postgres::Error::code`] and
    /// [`tokio_postgres::Error::as_db_error`] give the parts.
    #[error("{}", DbDisplay(.0))]
    Db(#[from] tokio_postgres::Error),

    /// Bad input at the call: `what` was wrong, `why`.
    #[error("invalid {what}: {why}")]
    InvalidInput {
        /// What was given.
        what: &'static str,
        /// What is wrong with it and what is allowed.
        why: String,
    },
    // --- lock errors (src/lock*) ---
    /// An advisory lock was not granted within its bound: PostgreSQL's
    /// `lock_timeout` fired (SQLSTATE 55P03, `lock_not_available`).
    ///
    /// For a transaction-scoped lock, PostgreSQL has aborted the transaction:
    /// roll it back (dropping it does) and retry with a new one.
    #[error(
        "advisory lock {key} not granted within {timeout:?} (lock_timeout, sqlstate 55P03): \
         another session holds it; retry later, or use a try_ variant to skip instead of waiting"
    )]
    LockTimeout {
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
    /// [`Error::is_not_owned`] and [`Error::is_behind_pooler`] hold.
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
    // --- lease errors (src/lease*) ---
    // (their predicates, `is_lease_lost()` and friends, are in src/lease/mod.rs)
    /// The lease is no longer this holder's: taken over, expired, or given
    /// up at the local deadline. Work that must not come from a stale holder
    /// stops here.
    #[error("lease {name:?} lost: {reason}")]
    LeaseLost {
        /// The lease.
        name: String,
        /// Why.
        reason: LostReason,
    },

    /// [`crate::Leases::acquire`] waited and another holder still has it.
    #[error("lease {name:?} still held by another holder after waiting {waited:?}")]
    LeaseBusy {
        /// The lease.
        name: String,
        /// How long the caller waited.
        waited: std::time::Duration,
    },

    /// A lease statement did not complete in time; its connection was closed
    /// (the statement may or may not have taken effect).
    #[error("lease {what} did not complete within {waited:?}; its connection was closed")]
    LeaseTimeout {
        /// The statement: `acquisition`, `renewal`, `release` or `install`.
        what: &'static str,
        /// How long it ran.
        waited: std::time::Duration,
    },

    /// The lease table (or its token sequence) exists with another shape
    /// than pgwarden's: `install()` and the first use with `auto_install`
    /// check it, so that acquisitions do not fail later with SQL errors.
    #[error(
        "lease table {table} does not have the shape pgwarden needs: {}; \
         alter it to match sql/leases.sql, or drop it (when no lease is held) and call install()",
        differences.join("; ")
    )]
    LeaseTableMismatch {
        /// The table, as configured.
        table: String,
        /// Each difference, in words: a missing or mistyped column, the
        /// primary key, the sequence.
        differences: Vec<String>,
    },
}

impl Error {
    /// The session-lock budget (or its hard floor) refused a checkout.
    pub fn is_budget_exhausted(&self) -> bool {
        matches!(self, Error::BudgetExhausted { .. })
    }

    /// A checkout or probe timed out.
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            Error::Timeout { .. }
                | Error::ReadinessTimeout(_)
                | Error::Pool(deadpool_postgres::PoolError::Timeout(_))
        )
    }

    /// An advisory lock was not granted in time: [`Error::LockTimeout`], or a
    /// database error with SQLSTATE 55P03 (`lock_not_available`).
    pub fn is_lock_timeout(&self) -> bool {
        match self {
            Error::LockTimeout { .. } => true,
            Error::Db(e) => e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE),
            _ => false,
        }
    }

    /// An unlock found the lock not held by the guard's session
    /// ([`Error::NotOwned`], [`Error::MovedByPooler`]).
    pub fn is_not_owned(&self) -> bool {
        matches!(self, Error::NotOwned { .. } | Error::MovedByPooler { .. })
    }

    /// Session locks were refused behind a transaction pooler
    /// ([`Error::BehindPooler`]), or a guard found its connection moved by
    /// one ([`Error::MovedByPooler`]).
    pub fn is_behind_pooler(&self) -> bool {
        matches!(
            self,
            Error::BehindPooler { .. } | Error::MovedByPooler { .. }
        )
    }

    pub(crate) fn invalid(what: &'static str, why: impl Into<String>) -> Error {
        Error::InvalidInput {
            what,
            why: why.into(),
        }
    }
}

/// `database error 42P01: relation "x" does not exist` (with the server's
/// detail and hint), or for an error of the connection itself
/// `database error: connection closed: <cause>: <cause>…`.
struct DbDisplay<'a>(&'a tokio_postgres::Error);

impl fmt::Display for DbDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.as_db_error() {
            Some(db) => {
                write!(f, "database error {}: {}", db.code().code(), db.message())?;
                if let Some(detail) = db.detail() {
                    write!(f, "; detail: {detail}")?;
                }
                if let Some(hint) = db.hint() {
                    write!(f, "; hint: {hint}")?;
                }
                Ok(())
            }
            None => write!(f, "database error: {}", Chain(self.0)),
        }
    }
}

/// An error and its sources, `: `-separated.
pub(crate) struct Chain<'a>(pub(crate) &'a (dyn std::error::Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(e) = source {
            write!(f, ": {e}")?;
            source = e.source();
        }
        Ok(())
    }
}

/// What a checkout was doing when its bound ran out ([`Error::Timeout`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Stage {
    /// Waiting for admission: the lane, or the pool, was full.
    Admission,
    /// Getting the connection from deadpool: connecting to the server, or
    /// recycling an idle connection (the server did not answer in time).
    Connection,
    /// Asking a new connection for its backend pid.
    BackendPid,
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stage::Admission => "waiting for admission",
            Stage::Connection => "connecting or recycling",
            Stage::BackendPid => "asking the backend pid",
        })
    }
}

/// Settings that cannot work, refused by `build()` (and by
/// `Pool::from_url`/`Pool::from_config` for the pool size). Each names the
/// setting and the value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The pool size or the lane limits cannot work.
    #[error(transparent)]
    Limits(#[from] LimitsError),
    /// A duration setting is out of range.
    #[error("invalid {setting} {value:?}: {why}")]
    InvalidDuration {
        /// The setting, as the builder method names it.
        setting: &'static str,
        /// The value given.
        value: Duration,
        /// What is allowed.
        why: &'static str,
    },
    /// The deadpool pool handed to `Pool::builder` has connections out (or
    /// callers waiting) already: pgwarden must own all of its capacity.
    #[error(
        "the deadpool pool has {in_use} of {max_size} connections out or waited for already: \
         pgwarden must own all of its capacity; build pgwarden over a pool nothing else uses"
    )]
    DeadpoolInUse {
        /// Objects out or callers waiting in deadpool.
        in_use: usize,
        /// deadpool's `max_size`.
        max_size: usize,
    },
    /// The deadpool pool handed to `Pool::builder` is closed.
    #[error("the deadpool pool is closed")]
    DeadpoolClosed,
    /// The pool name is empty or too long.
    #[error("invalid pool name {0:?}: use 1 to 64 characters of [A-Za-z0-9_.-]")]
    InvalidName(String),
    /// deadpool could not build the pool from the given configuration.
    #[error("cannot build the deadpool pool: {0}")]
    Deadpool(String),
    /// The connection string did not parse: the parser's reason, for
    /// example ``invalid value for option `port` `` or `unexpected EOF`.
    #[error("invalid connection string: {0}")]
    InvalidUrl(String),
}
