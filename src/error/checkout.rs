//! [`CheckoutError`]: no connection was handed out.

use std::fmt;
use std::panic::Location;
use std::time::Duration;

use crate::admission::Lane;
use crate::status::Status;

/// No connection was handed out. Recover by retrying later, shedding the
/// request, or (for [`CheckoutError::BudgetExhausted`]) by not pinning a
/// connection at all; [`CheckoutError::DeadpoolMismatch`] is a setup bug.
///
/// ```no_run
/// use pgwarden::{CheckoutError, Error, Lane};
/// use std::time::Duration;
///
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), Error> {
/// match pool.get_within(Duration::from_millis(200)).await {
///     Ok(conn) => drop(conn),
///     Err(Error::Checkout(CheckoutError::Timeout { stage, status, .. })) => {
///         eprintln!("busy ({stage}): {status}"); // answer 503, retry later
///     }
///     Err(e) => return Err(e),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckoutError {
    /// The underlying deadpool pool failed: connection creation, closed pool,
    /// a deadpool timeout. A connection the server refused shows what it
    /// said (`pool error: could not open a connection: database error 53300:
    /// sorry, too many clients already`).
    #[error("pool error: {}", super::PoolDisplay(.0))]
    Pool(#[source] deadpool_postgres::PoolError),

    /// The wrapped pool (sqlx) failed to hand out a connection, or to
    /// answer the statement that names it: its own error, boxed
    /// (`sqlx::Error` for a sqlx pool: downcast to read it). A connection
    /// the server refused shows its SQLSTATE (`pool error: database error
    /// 28000: error returned from database: role "x" is not permitted to
    /// log in`).
    #[error("pool error: {}", super::BackendDisplay(&**.0))]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),

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
        /// The pool at that moment (boxed: it keeps errors small).
        status: Box<Status>,
    },

    /// pgwarden admitted a checkout but the wrapped deadpool pool had no
    /// connection for it: deadpool's capacity was changed, or its objects
    /// taken, outside pgwarden (a clone of the deadpool pool given to
    /// `Pool::builder`, or a `resize` on that clone: resize through
    /// `pgwarden::Pool::resize`, which keeps both in step).
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

    /// A session-lock checkout past its budget was refused: at once for a
    /// try-once `session_lock` (no wait), or for one that can never be
    /// admitted (a budget of 0). The message names the pool size, the
    /// budget, what holds it, the setting that raises it
    /// (`PoolBuilder::lane(Lane::SessionLock, reserved, max)`) and the
    /// alternatives that pin no connection: a table lease, or a
    /// transaction-scoped lock (`xact_lock`) for try-once work inside a
    /// transaction.
    #[error(
        "{lane} budget exhausted: {in_use} of {limit} in use (pool size {pool_size}){floor}; held by: {holders}; {way_out}",
        holders = Holders(holders),
        floor = if *hard_floor { "; hard floor: the other lanes' reservations and one request connection" } else { "" },
        way_out = WayOut { hard_floor: *hard_floor, limit: *limit }
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
        /// The pool size `N`.
        pool_size: usize,
    },

    /// The readiness probe did not answer within its bound.
    #[error("readiness probe did not answer within {0:?}")]
    ReadinessTimeout(Duration),

    /// A new connection answered `SELECT pg_backend_pid()` without a row:
    /// what is at the other end does not answer as PostgreSQL does.
    #[error("SELECT pg_backend_pid() returned no row: the server (or a proxy before it) does not answer as PostgreSQL does")]
    NoBackendPid,
}

/// A checkout that holds a lane's connection, as named in errors and logs.
///
/// ```no_run
/// # fn demo(e: pgwarden::Error) {
/// use pgwarden::{CheckoutError, Error};
/// if let Error::Checkout(CheckoutError::BudgetExhausted { holders, .. }) = &e {
///     for h in holders {
///         eprintln!("held at {} for {:?} (pid {:?})", h.site, h.age, h.pid);
///     }
/// }
/// # }
/// ```
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

/// The way out of a session-lock refusal.
struct WayOut {
    hard_floor: bool,
    limit: usize,
}

impl fmt::Display for WayOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.hard_floor {
            f.write_str("a larger pool raises it")?;
        } else {
            f.write_str(
                "raise it with PoolBuilder::lane(Lane::SessionLock, reserved, max) (a larger pool raises the default)",
            )?;
        }
        if self.limit > 0 {
            f.write_str(", or give session_lock a wait to queue for it")?;
        }
        f.write_str(
            "; or hold no connection for exclusivity: a table lease (pgwarden::Leases) for \
             background work, or a transaction-scoped lock (pgwarden::xact_lock, \
             pool.with_xact_lock) for try-once work inside a transaction",
        )
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

/// What a checkout was doing when its bound ran out
/// ([`CheckoutError::Timeout`]).
///
/// ```no_run
/// # fn demo(e: pgwarden::Error) {
/// use pgwarden::{CheckoutError, Error, Stage};
/// if let Error::Checkout(CheckoutError::Timeout { stage: Stage::Connection, .. }) = e {
///     eprintln!("the server did not answer in time");
/// }
/// # }
/// ```
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
