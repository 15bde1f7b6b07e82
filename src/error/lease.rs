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
    /// [`Fenced::commit`](crate::Fenced::commit)) waited for a lock that
    /// another session held until its bound ran out: the lease row's (a
    /// `SELECT … FOR UPDATE` or a `DELETE` of the row, or a session frozen
    /// holding it), or the lease table's own (`LOCK TABLE`, an `ALTER
    /// TABLE`, `VACUUM FULL`). Its bound: the term's end + 1 s, or the
    /// transaction's own `lock_timeout` or `statement_timeout` when
    /// tighter (a wait for the table's lock, which comes before the
    /// fence's statement can set anything, has only those). The term was
    /// still this holder's by the local deadline then (past it, the fence
    /// reports [`LeaseError::Lost`] instead). Nothing was written: the
    /// transaction failed, and is rolled back. Retry in a new transaction;
    /// end the session that holds the lock (`blocking_pid`, or `pgwarden
    /// leases` for a row), and keep statements that lock rows or the table
    /// off the lease table.
    ///
    /// The same bounds (a tighter `statement_timeout`, a cancel request)
    /// also end a fence that waited for no lock at all, only ran slow: then
    /// no session is named (`blocking_pid: None`, `on_table: false`), and
    /// the message claims no lock. Only a session whose lock conflicts with
    /// a fence's is ever named (another fenced transaction's, or a
    /// renewal's, never is).
    #[error("{}", fence_blocked(name, waited, *on_table, *blocking_pid))]
    FenceBlocked {
        /// The lease.
        name: String,
        /// How long the fence's statement ran.
        waited: Duration,
        /// The session holding the lock when the fence gave up, when the
        /// server could tell (looked up once the fence's transaction is
        /// gone: `None` from [`Fenced::check`](crate::Fenced::check), whose
        /// transaction is still open, and for a prepared transaction).
        blocking_pid: Option<i32>,
        /// The lock was the lease table's (another session held, or was
        /// first in line for, an `EXCLUSIVE` or `ACCESS EXCLUSIVE` lock on
        /// it); `false`: the lease row's, or unknown when `blocking_pid` is
        /// `None` too.
        on_table: bool,
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

    /// [`LeaseHandle::fence`](crate::LeaseHandle::fence) on a transaction
    /// whose snapshot may be older than the lease's term (repeatable read
    /// or serializable, a statement before the fence) must read the term
    /// outside that snapshot, on another connection of the same pool, and
    /// got none within its bound: the fenced transaction holds one, the
    /// others were busy. Nothing was fenced; the transaction is left as it
    /// was (roll it back). Call `fence` first in the transaction, before
    /// any other statement (then its snapshot is the fence's own and no
    /// read outside it is needed), or give the pool more connections.
    #[error(
        "fence of lease {name:?} could not read its term outside the transaction's snapshot: \
         no connection of the pool (at most {pool_size}) came free within {waited:?}, \
         the fenced transaction holding one; call fence first in the transaction, \
         before any other statement, or give the pool more connections"
    )]
    FenceNoConnection {
        /// The lease.
        name: String,
        /// How long the term read waited for a connection.
        waited: Duration,
        /// The pool's size (its maximum).
        pool_size: usize,
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

/// The message of [`LeaseError::FenceBlocked`]: which lock, held by whom,
/// and what to do; or, when no session held a lock that blocks a fence by
/// the time it was looked up, that the bound ran out without naming a lock
/// (the holder let go since, or the statement was slow and waited for
/// nothing).
fn fence_blocked(name: &str, waited: &Duration, on_table: bool, pid: Option<i32>) -> String {
    let (lock, keep_off) = match (on_table, pid) {
        (true, Some(pid)) => (
            format!("waited {waited:?} for the lease table's lock, held by pid {pid}, and gave up"),
            "end that session's transaction, and keep LOCK TABLE, ALTER TABLE and VACUUM FULL off the lease table while leases are in use",
        ),
        (true, None) => (
            format!("waited {waited:?} for the lease table's lock, held by a prepared transaction, and gave up"),
            "end that prepared transaction, and keep LOCK TABLE, ALTER TABLE and VACUUM FULL off the lease table while leases are in use",
        ),
        (false, Some(pid)) => (
            format!("waited {waited:?} for the lease row's lock, held by pid {pid}, and gave up"),
            "end that session's transaction, and keep statements that lock rows, such as SELECT … FOR UPDATE, off the lease table",
        ),
        (false, None) => (
            format!(
                "was cut off after {waited:?}, naming no lock: no session was found holding one that blocks a fence \
                 (one held the lease row or table and let go since, or the statement was slow and waited for none; \
                 Fenced::check, whose transaction is still open, looks for none)"
            ),
            "if this repeats, look for sessions locking the lease row or table, and for a tight statement_timeout on a slow server",
        ),
    };
    format!(
        "fence of lease {name:?} {lock} (its bound: the term's end + 1 s, or the transaction's tighter \
         lock_timeout or statement_timeout, or a cancel request); nothing was written and the \
         transaction is rolled back: retry in a new transaction ({keep_off})"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocked(on_table: bool, blocking_pid: Option<i32>) -> String {
        LeaseError::FenceBlocked {
            name: "n".to_owned(),
            waited: Duration::from_millis(300),
            blocking_pid,
            on_table,
        }
        .to_string()
    }

    #[test]
    fn a_blocked_fence_names_the_lock_it_can_tell() {
        let table = blocked(true, Some(7));
        assert!(
            table.contains("the lease table's lock, held by pid 7"),
            "{table}"
        );
        assert!(table.contains("LOCK TABLE"), "{table}");
        let row = blocked(false, Some(7));
        assert!(row.contains("the lease row's lock, held by pid 7"), "{row}");
        assert!(row.contains("FOR UPDATE"), "{row}");
        let prepared = blocked(true, None);
        assert!(
            prepared.contains("the lease table's lock, held by a prepared transaction"),
            "{prepared}"
        );
        // Nobody found: no lock is claimed, no pid named.
        let unknown = blocked(false, None);
        assert!(
            unknown.contains("no session was found holding one that blocks a fence"),
            "{unknown}"
        );
        assert!(!unknown.contains("lock, held by"), "{unknown}");
        assert!(!unknown.contains("pid"), "{unknown}");
        for m in [table, prepared, row, unknown] {
            assert!(m.contains("statement_timeout"), "{m}");
            assert!(m.contains("retry in a new transaction"), "{m}");
        }
    }
}
