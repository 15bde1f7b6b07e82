//! Errors: [`Error`] for everything the pool, locks and leases do, and
//! [`BuildError`] for settings that cannot work.

use std::fmt;
use std::panic::Location;
use std::time::Duration;

use crate::budget::Lane;
use crate::pool::Status;

/// A checkout that holds a lane's connection, as named in errors and logs.
#[derive(Clone, Debug)]
pub struct Holder {
    /// Where the connection was checked out.
    pub site: &'static Location<'static>,
    /// How long it has been out.
    pub age: Duration,
    /// Its backend pid, when known.
    pub pid: Option<i32>,
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({:.1?} ago", self.site, self.age)?;
        if let Some(pid) = self.pid {
            write!(f, ", pid {pid}")?;
        }
        f.write_str(")")
    }
}

pub(crate) struct Holders<'a>(pub(crate) &'a [Holder]);

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

    /// No connection of `lane` became free within the wait timeout.
    #[error("timed out after {waited:?} waiting for a {lane} connection ({status})")]
    Timeout {
        /// The lane asked for.
        lane: Lane,
        /// How long the caller waited.
        waited: Duration,
        /// The pool at that moment.
        status: Status,
    },

    /// A session-lock checkout past its budget was refused.
    #[error(
        "{lane} budget exhausted: {in_use} of {limit} in use{floor}; held by: {holders}; \
         hold no connection for background exclusivity: use a table lease \
         (pgwarden::Leases), or a transaction-scoped lock (pool.with_xact_lock)",
        holders = Holders(holders),
        floor = if *hard_floor { " (hard floor: the control reserve and one request connection)" } else { "" }
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
        holders: Vec<Holder>,
    },

    /// The readiness probe did not answer within its bound.
    #[error("readiness probe did not answer within {0:?}")]
    ReadinessTimeout(Duration),

    /// PostgreSQL returned an error.
    #[error("database error: {0}")]
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
        key: crate::lock::LockKey,
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
        key: crate::lock::LockKey,
    },

    /// `unlock_one` would release the last level of a guard: that is
    /// [`SessionLock::unlock`](crate::SessionLock::unlock)'s job.
    #[error("advisory lock {key} is held once: release the last level with unlock(self), not unlock_one")]
    UnbalancedUnlock {
        /// The key.
        key: crate::lock::LockKey,
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
        /// `"configured"` or `"detected"`.
        how: &'static str,
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
        reason: crate::lease::LostReason,
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

    /// An unlock found the lock not held ([`Error::NotOwned`]).
    pub fn is_not_owned(&self) -> bool {
        matches!(self, Error::NotOwned { .. })
    }

    /// Session locks were refused behind a transaction pooler ([`Error::BehindPooler`]).
    pub fn is_behind_pooler(&self) -> bool {
        matches!(self, Error::BehindPooler { .. })
    }

    pub(crate) fn invalid(what: &'static str, why: impl Into<String>) -> Error {
        Error::InvalidInput {
            what,
            why: why.into(),
        }
    }
}

/// Settings that cannot work, refused by `build()`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// Fewer than two connections: one must stay in reserve for control
    /// statements and one for request work.
    #[error(
        "pool size {size} is too small: pgwarden needs at least 2 (1 control reserve + 1 request)"
    )]
    TooSmall {
        /// The size given.
        size: usize,
    },
    /// Reservations add up past the pool size.
    #[error(
        "lane reservations exceed the pool size: {request} (request) + {session_lock} (session_lock) + {control} (control) = {} > {size}",
        request + session_lock + control
    )]
    ReservationsExceedSize {
        /// Pool size.
        size: usize,
        /// Request reservation.
        request: usize,
        /// Session-lock reservation.
        session_lock: usize,
        /// Control reservation.
        control: usize,
    },
    /// A lane reserves more than its maximum.
    #[error("{lane} lane reserves {reserved} but its maximum is {max}")]
    ReservedAboveMax {
        /// The lane.
        lane: Lane,
        /// Its reservation.
        reserved: usize,
        /// Its maximum.
        max: usize,
    },
    /// A lane's maximum is above the pool size.
    #[error("{lane} lane maximum {max} is above the pool size {size}")]
    MaxAboveSize {
        /// The lane.
        lane: Lane,
        /// Its maximum.
        max: usize,
        /// Pool size.
        size: usize,
    },
    /// The request lane must reserve at least one connection.
    #[error("the request lane must reserve at least 1 connection: the work done under held locks needs it")]
    NoRequestReserve,
    /// The control lane must reserve at least one connection.
    #[error("the control lane must reserve at least 1 connection: readiness probes and lease renewals need it")]
    NoControlReserve,
    /// The session-lock maximum would leave the work under those locks no
    /// connection.
    #[error(
        "session_lock maximum {max} leaves the work under those locks no connection: \
         pool size {size} - control reserve {control_reserved} - request reserve {request_reserved} = {} is the most session locks may pin",
        size - control_reserved - request_reserved
    )]
    SessionLockMaxStarvesWork {
        /// The maximum asked for.
        max: usize,
        /// Pool size.
        size: usize,
        /// Control reservation.
        control_reserved: usize,
        /// Request reservation.
        request_reserved: usize,
    },
    /// The pool name is empty or too long.
    #[error("invalid pool name {0:?}: use 1 to 64 characters of [A-Za-z0-9_.-]")]
    InvalidName(String),
    /// deadpool could not build the pool from the given configuration.
    #[error("cannot build the deadpool pool: {0}")]
    Deadpool(String),
    /// The connection string did not parse.
    #[error("invalid connection string: {0}")]
    InvalidUrl(String),
}
