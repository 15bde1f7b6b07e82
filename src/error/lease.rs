//! [`LeaseError`]: a table lease was lost, timed out, or its table is
//! unusable.

use std::time::Duration;

use crate::lost::LostReason;

/// A table lease was lost, a lease statement timed out, or the lease table
/// has another shape. Recover from [`LeaseError::Lost`] by stopping the
/// work that must not come from a stale holder (and acquiring again later);
/// from [`LeaseError::Timeout`] and [`LeaseError::FenceBlocked`] by retrying
/// (the latter once the session holding the lease row lets go of it);
/// [`LeaseError::TableMismatch`]
/// needs the table fixed.
///
/// Another holder having the lease is not an error: `acquire` returns
/// `Ok(None)`.
///
/// ```no_run
/// use pgwarden::{Error, LeaseError, LostReason};
///
/// # async fn demo(pool: pgwarden::Pool, lease: pgwarden::Lease) -> Result<(), Error> {
/// let mut conn = pool.get().await?;
/// let tx = conn.transaction().await?;
/// match lease.fence(tx).await {
///     Ok(tx) => tx.commit().await?,
///     Err(Error::Lease(LeaseError::Lost { reason: LostReason::Taken, .. })) => {
///         // another holder has it now: stop (the transaction rolls back on drop)
///     }
///     Err(e) => return Err(e),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseError {
    /// The lease is no longer this holder's: taken over, expired, or given
    /// up at the local deadline. Work that must not come from a stale holder
    /// stops here.
    #[error("lease {name:?} lost: {reason}")]
    Lost {
        /// The lease.
        name: String,
        /// Why.
        reason: LostReason,
    },

    /// A fenced transaction had already failed when [`Fenced::commit`](crate::Fenced::commit)
    /// was called: one of its statements failed, whether or not its caller
    /// saw the error (a future dropped by a client timeout after the
    /// fence's server-side bound cancelled its statement, say). Nothing was
    /// committed; the transaction was rolled back. Redo the work in a new
    /// transaction, under a new fence.
    #[error("fenced transaction of lease {name:?} had already failed (a statement of it failed): nothing was committed")]
    Aborted {
        /// The lease.
        name: String,
    },

    /// [`LeaseHandle::fence`](crate::LeaseHandle::fence) (or a fenced
    /// transaction's [`Fenced::check`](crate::Fenced::check) or
    /// [`Fenced::commit`](crate::Fenced::commit)) waited for the lease
    /// row's lock, which another session held (a `SELECT … FOR UPDATE` or
    /// a `DELETE` of the row, or a session frozen holding it), until its
    /// bound ran out: the term's end + 1 s as the fence read it, or the
    /// transaction's own `lock_timeout` when tighter. The term was still
    /// this holder's by the local deadline then (past it, the fence
    /// reports [`LeaseError::Lost`] instead). Nothing was written: the
    /// transaction failed, and is rolled back. Retry in a new transaction;
    /// end the session that holds the row (`blocking_pid`, or `pgwarden
    /// leases`), and keep statements that lock rows off the lease table.
    #[error(
        "fence of lease {name:?} waited {waited:?} for the lease row's lock, held by {}, and gave up \
         (its bound: the term's end + 1 s, or the transaction's tighter lock_timeout); nothing was written \
         and the transaction is rolled back: retry in a new transaction, and end that session's transaction \
         (keep statements that lock rows, such as SELECT … FOR UPDATE, off the lease table)",
        match blocking_pid { Some(pid) => format!("pid {pid}"), None => "another session".to_owned() }
    )]
    FenceBlocked {
        /// The lease.
        name: String,
        /// How long the fence's statement ran.
        waited: Duration,
        /// The session holding the row's lock when the fence gave up, when
        /// the server could tell.
        blocking_pid: Option<i32>,
    },

    /// A lease statement did not complete in time; its connection was closed
    /// (the statement may or may not have taken effect).
    #[error("lease {what} did not complete within {waited:?}; its connection was closed")]
    Timeout {
        /// The statement: `acquisition`, `renewal`, `release` or `install`.
        what: &'static str,
        /// How long it ran.
        waited: Duration,
    },

    /// The lease table (or its token sequence) exists with another shape
    /// than pgwarden's: `install()` and the first use with `auto_install`
    /// check it, so that acquisitions do not fail later with SQL errors.
    #[error(
        "lease table {table} does not have the shape pgwarden needs: {}; \
         alter it to match sql/leases.sql, or drop it (when no lease is held) and call install()",
        differences.join("; ")
    )]
    TableMismatch {
        /// The table, as configured.
        table: String,
        /// Each difference, in words: a missing or mistyped column, the
        /// primary key, the sequence.
        differences: Vec<String>,
    },
}
