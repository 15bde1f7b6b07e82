//! Errors, one enum per layer under a thin [`Error`], each shaped by how a
//! caller recovers: a [`CheckoutError`] (no connection: retry later, shed
//! load), a [`LockError`] (the advisory lock: retry, or fix how the pool
//! reaches the server), a [`LeaseError`] (the lease: stop the work that
//! must not come from a stale holder), a database error (what the server
//! said), and [`InvalidInput`] (fix the call). [`BuildError`] is for
//! settings that cannot work, refused before the pool exists.

use std::fmt;

mod build;
mod checkout;
mod invalid;
mod lease;
mod lock;

pub use build::BuildError;
pub use checkout::{CheckoutError, LaneHolder, Stage};
pub(crate) use invalid::{at_most, check_text_name, in_range, name_error, within};
pub use invalid::{InvalidInput, NameRule};
pub use lease::LeaseError;
pub use lock::LockError;

/// Everything that can go wrong in pgwarden at run time: which layer
/// failed, and that layer's error.
///
/// The predicates ([`Error::is_timeout`], [`Error::is_lease_lost`]…) answer
/// the common questions; match the layer's enum for the details.
///
/// ```no_run
/// use pgwarden::{CheckoutError, Error, LockKey, LockMode};
/// use std::time::Duration;
///
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), Error> {
/// match pool.session_lock(LockKey::Single(7), LockMode::Exclusive, Some(Duration::from_secs(1))).await {
///     Ok(Some(_guard)) => { /* the work */ }
///     Ok(None) => { /* not granted: someone else does it */ }
///     Err(e) if e.is_lock_timeout() => { /* someone else does it: skip */ }
///     Err(Error::Checkout(CheckoutError::BudgetExhausted { holders, .. })) => {
///         eprintln!("no session-lock connection; held by {holders:?}");
///     }
///     Err(Error::Db(db)) => eprintln!("the server said {:?}", db.code()),
///     Err(e) => return Err(e),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No connection was handed out: the pool, its budget or its bound.
    #[error(transparent)]
    Checkout(#[from] CheckoutError),

    /// An advisory lock could not be taken or released as asked.
    #[error(transparent)]
    Lock(#[from] LockError),

    /// A table lease was lost, timed out, or its table is unusable.
    #[error(transparent)]
    Lease(#[from] LeaseError),

    /// PostgreSQL returned an error, or the connection failed.
    ///
    /// Displayed with what the server said: `database error 42P01: relation
    /// "x" does not exist`, then its detail and hint when it gave them; an
    /// error of the connection itself (closed, I/O) with tokio-postgres's
    /// chain of causes. [`tokio_postgres::Error::code`] and
    /// [`tokio_postgres::Error::as_db_error`] give the parts.
    #[error("{}", DbDisplay(.0))]
    Db(#[from] tokio_postgres::Error),

    /// PostgreSQL returned an error, or the connection failed, on a
    /// statement pgwarden ran on a sqlx pool (features `sqlx-0_8`,
    /// `sqlx-0_9`): sqlx's own `sqlx::Error`, boxed (`downcast` it).
    /// Displayed as `database error 55P03: …` when the server sent a
    /// SQLSTATE.
    ///
    /// ```no_run
    /// # fn demo(e: pgwarden::Error) {
    /// if e.is_lock_timeout() {
    ///     // SQLSTATE 55P03, whichever backend ran the statement
    /// } else if let pgwarden::Error::Sqlx(e) = e {
    ///     eprintln!("{e}"); // `e.downcast::<sqlx::Error>()` for sqlx's own
    /// }
    /// # }
    /// ```
    #[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
    #[error("{}", SqlxDisplay(&**.0))]
    Sqlx(Box<dyn std::error::Error + Send + Sync + 'static>),

    /// Bad input at the call, refused before anything ran.
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
}

impl From<deadpool_postgres::PoolError> for Error {
    fn from(e: deadpool_postgres::PoolError) -> Error {
        Error::Checkout(CheckoutError::Pool(e))
    }
}

impl Error {
    /// The SQLSTATE of a database error, when the server sent one.
    pub(crate) fn sqlstate(&self) -> Option<&str> {
        match self {
            Error::Db(e) => e.code().map(|c| c.code()),
            #[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
            Error::Sqlx(e) => sqlx_sqlstate(&**e),
            _ => None,
        }
    }

    /// The session-lock budget (or its hard floor) refused a checkout
    /// ([`CheckoutError::BudgetExhausted`]).
    pub fn is_budget_exhausted(&self) -> bool {
        matches!(self, Error::Checkout(CheckoutError::BudgetExhausted { .. }))
    }

    /// A checkout or probe timed out: [`CheckoutError::Timeout`],
    /// [`CheckoutError::ReadinessTimeout`], or deadpool's own timeout.
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            Error::Checkout(
                CheckoutError::Timeout { .. }
                    | CheckoutError::ReadinessTimeout(_)
                    | CheckoutError::Pool(deadpool_postgres::PoolError::Timeout(_))
            )
        )
    }

    /// An advisory lock was not granted in time: [`LockError::Timeout`], or
    /// a database error with SQLSTATE 55P03 (`lock_not_available`).
    pub fn is_lock_timeout(&self) -> bool {
        match self {
            Error::Lock(LockError::Timeout { .. }) => true,
            Error::Db(e) => e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE),
            #[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
            Error::Sqlx(e) => sqlx_sqlstate(&**e) == Some("55P03"),
            _ => false,
        }
    }

    /// An unlock found the lock not held by the guard's session
    /// ([`LockError::NotOwned`], [`LockError::MovedByPooler`]).
    pub fn is_not_owned(&self) -> bool {
        matches!(
            self,
            Error::Lock(LockError::NotOwned { .. } | LockError::MovedByPooler { .. })
        )
    }

    /// Session locks were refused behind a transaction pooler
    /// ([`LockError::BehindPooler`]), or a guard found its connection moved
    /// by one ([`LockError::MovedByPooler`]).
    pub fn is_behind_pooler(&self) -> bool {
        matches!(
            self,
            Error::Lock(LockError::BehindPooler { .. } | LockError::MovedByPooler { .. })
        )
    }

    /// The lease is no longer this holder's ([`LeaseError::Lost`]): taken
    /// over, expired, or given up at the local deadline. Stop the work that
    /// must not come from a stale holder.
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::Pool, lease: pgwarden::Lease) -> Result<(), pgwarden::Error> {
    /// let mut conn = pool.get().await?;
    /// let tx = conn.transaction().await?;
    /// match lease.fence(tx).await {
    ///     Ok(tx) => tx.commit().await?,
    ///     Err(e) if e.is_lease_lost() => return Ok(()), // rolled back on drop
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn is_lease_lost(&self) -> bool {
        matches!(self, Error::Lease(LeaseError::Lost { .. }))
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

/// The SQLSTATE of a boxed `sqlx::Error` (of either sqlx version), when
/// the server sent one.
#[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
pub(crate) fn sqlx_sqlstate<'e>(e: &'e (dyn std::error::Error + 'static)) -> Option<&'e str> {
    #[cfg(feature = "sqlx-0_8")]
    if let Some(e) = e.downcast_ref::<::sqlx08::Error>() {
        let db = e.as_database_error()?;
        return Some(
            db.try_downcast_ref::<::sqlx08::postgres::PgDatabaseError>()?
                .code(),
        );
    }
    #[cfg(feature = "sqlx-0_9")]
    if let Some(e) = e.downcast_ref::<::sqlx09::Error>() {
        let db = e.as_database_error()?;
        return Some(
            db.try_downcast_ref::<::sqlx09::postgres::PgDatabaseError>()?
                .code(),
        );
    }
    None
}

/// `database error 55P03: <sqlx's message>`, or sqlx's message alone.
#[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
struct SqlxDisplay<'a>(&'a (dyn std::error::Error + Send + Sync + 'static));

#[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
impl fmt::Display for SqlxDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match sqlx_sqlstate(self.0) {
            Some(code) => write!(f, "database error {code}: {}", self.0),
            None => write!(f, "database error: {}", Chain(self.0)),
        }
    }
}

/// A wrapped pool's own error, with the SQLSTATE the server sent when it
/// sent one (sqlx's text names none: "error returned from database: …").
pub(crate) struct BackendDisplay<'a>(
    pub(crate) &'a (dyn std::error::Error + Send + Sync + 'static),
);

impl fmt::Display for BackendDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        #[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
        if let Some(code) = sqlx_sqlstate(self.0) {
            return write!(f, "database error {code}: {}", self.0);
        }
        write!(f, "{}", self.0)
    }
}

/// deadpool's error, with what the server said when it refused a new
/// connection (deadpool's own text ends at tokio-postgres's "db error").
pub(crate) struct PoolDisplay<'a>(pub(crate) &'a deadpool_postgres::PoolError);

impl fmt::Display for PoolDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use deadpool_postgres::{HookError, PoolError};
        match self.0 {
            PoolError::Backend(e) => write!(f, "could not open a connection: {}", DbDisplay(e)),
            PoolError::PostCreateHook(HookError::Backend(e)) => {
                write!(f, "post_create hook failed: {}", DbDisplay(e))
            }
            e => write!(f, "{e}"),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Small enough to return by value everywhere (clippy's
    /// `result_large_err` limit is 128 bytes).
    #[test]
    fn errors_are_small() {
        assert!(
            std::mem::size_of::<Error>() <= 96,
            "{}",
            std::mem::size_of::<Error>()
        );
    }
}
