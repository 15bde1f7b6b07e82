//! [`Lease`], the guard of one term, and [`LeaseHandle`], its shareable view:
//! name, fencing token, the lost signal, the fenced-transaction check.

use std::fmt;
use std::future::Future;
use std::ops::Deref;
use std::sync::Arc;

use super::term::{LeaseState, Term};
use super::Inner;
use crate::error::{Error, LeaseError};

pub use crate::lost::LostReason;

/// A shareable view of a held lease: name, fencing token, lost signal, fence.
///
/// Cheap to clone; [`Leases::run`](crate::Leases::run) and scheduled
/// [`Job`](crate::Job)s receive one, and a [`Lease`] guard dereferences to
/// one (`LeaseHandle::clone(&lease)` makes a handle to move into another
/// task). It cannot release the lease: its guard (or the runner) does.
///
/// ```no_run
/// # async fn demo(leases: pgwarden::Leases) -> Result<(), pgwarden::Error> {
/// let opts = pgwarden::LeaseOptions::default();
/// if let Some(lease) = leases.acquire("report", &opts, None).await? {
///     let handle = pgwarden::LeaseHandle::clone(&lease);
///     let worker = tokio::spawn(async move {
///         tokio::select! {
///             reason = handle.lost() => eprintln!("stopped: lease {reason}"),
///             _ = std::future::pending::<()>() => {} // the work
///         }
///     });
///     # let _ = worker;
///     let term = lease.term();
///     println!("{} held with token {}", term.name, term.token);
///     lease.release().await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct LeaseHandle {
    pub(crate) state: Arc<LeaseState>,
    pub(crate) inner: Arc<Inner>,
}

impl LeaseHandle {
    /// The term held: name, fencing token, holder, start, and whose expired
    /// term it replaced. See [`Term`].
    pub fn term(&self) -> &Term {
        &self.state.term
    }

    /// Has the lease been lost? True once the signal fired, and as soon as
    /// the local deadline has passed (it fires the signal then), whatever
    /// the renewer is doing. [`LeaseHandle::lost`] tells why (at once, when
    /// it is already lost).
    pub fn is_lost(&self) -> bool {
        self.inner.check_lost(&self.state).is_some()
    }

    /// Completes when the lease is lost: a renewal touched no row (another
    /// holder took it), or the local deadline passed without a successful
    /// renewal, which falls a safety margin before the database could let
    /// anyone else in. Never completes while the lease is held; completes at
    /// once if it was already lost.
    ///
    /// It keeps its own timer on the deadline (re-read when renewals move
    /// it), so it fires on time even when the renewer is stuck, panicked or
    /// gone with its runtime. The future owns what it needs (`'static`):
    /// select on it, or move it into another task.
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        let (state, inner) = (self.state.clone(), self.inner.clone());
        let mut rx = state.subscribe();
        async move {
            loop {
                if let Some(reason) = inner.check_lost(&state) {
                    return reason;
                }
                let at = tokio::time::Instant::from_std(state.deadline());
                tokio::select! {
                    changed = rx.changed() => {
                        // `state` keeps the sender alive: this cannot fail,
                        // but if it did, the deadline still ends the wait.
                        if changed.is_err() {
                            tokio::time::sleep_until(at).await;
                        }
                    }
                    _ = tokio::time::sleep_until(at) => {}
                }
            }
        }
    }

    /// The fenced-transaction check: inside the caller's transaction, locks
    /// the lease row `FOR KEY SHARE` and checks that it is still this term
    /// (holder and token) and unexpired, and that the local deadline has not
    /// passed (before and after the statement).
    ///
    /// On success, the writes of that transaction commit only under this
    /// term: a take-over (which locks the row `FOR UPDATE`) waits for the
    /// transaction to end, and then sees the term the commit happened under.
    /// Renewals of this lease do not wait (they take `FOR NO KEY UPDATE`).
    /// No take-over happens while the transaction is open (a take-over
    /// answers busy meanwhile), so the transaction is bounded on the server:
    /// `fence` sets `statement_timeout` and
    /// `idle_in_transaction_session_timeout` for this transaction to the
    /// term's time left + 1 s. A holder frozen or cut off with the
    /// transaction open loses its session then, and its commit never lands;
    /// the lease is taken over at most 1 s after its term ends. A
    /// transaction that must outlive its term's time left (renewals extend
    /// the term meanwhile) calls `fence` again to extend the bound. Keep
    /// fenced transactions short.
    ///
    /// Fails with [`LeaseError::Lost`](crate::LeaseError::Lost) when the term is over: `Taken` (the
    /// row is another term's, or gone), `Expired` (still this term, expired
    /// in the database) or `Deadline`. Roll back: the writes would come from
    /// a stale holder.
    ///
    /// # Isolation levels
    ///
    /// All three of PostgreSQL's levels are supported. Under `READ
    /// COMMITTED` the check reads the row as it is now. Under `REPEATABLE
    /// READ` and `SERIALIZABLE` it reads the transaction's snapshot: a
    /// take-over committed since then makes PostgreSQL refuse the lock with
    /// a serialization failure, which `fence` reports as
    /// `LeaseError::Lost { reason: Taken }`; a renewal by this holder since then is
    /// no conflict (it changes no key), and the expiry it carries is newer
    /// than the snapshot's, so there the local deadline stands in for the
    /// expiry check. Take the snapshot after the lease: call `fence` first
    /// in the transaction (a snapshot older than the acquisition sees
    /// another term, and the fence fails with `Taken`).
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::Pool, lease: pgwarden::LeaseHandle) -> Result<(), pgwarden::Error> {
    /// let mut conn = pool.get_within(std::time::Duration::from_secs(5)).await?;
    /// let tx = conn.transaction().await?;
    /// lease.fence(&tx).await?; // rejected if another holder took over
    /// tx.execute("UPDATE accounts SET balance = balance - 1 WHERE id = 1", &[]).await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn fence(&self, tx: &tokio_postgres::Transaction<'_>) -> Result<(), Error> {
        if let Some(reason) = self.inner.check_lost(&self.state) {
            return Err(self.fence_failed(reason));
        }
        self.inner.count_statement();
        let row = match self.inner.sql.fence(tx, &self.state.name).await {
            Ok(row) => row,
            // A take-over (or purge) committed after the transaction's
            // snapshot: the term is over.
            Err(e) if is_serialization_failure(&e) => {
                return Err(self.fence_failed(LostReason::Taken))
            }
            Err(e) => return Err(Error::Db(e)),
        };
        let reason = match row {
            Some((holder, token, fresh, snapshot))
                if holder == self.state.holder && token == self.state.token =>
            {
                // Under a snapshot the expiry read may predate renewals made
                // since: the local deadline (checked below) decides.
                if fresh || snapshot {
                    match self.inner.check_lost(&self.state) {
                        None => return Ok(()),
                        Some(reason) => reason,
                    }
                } else {
                    LostReason::Expired
                }
            }
            _ => LostReason::Taken,
        };
        Err(self.fence_failed(reason))
    }

    fn fence_failed(&self, reason: LostReason) -> Error {
        // The term is over: the lost signal says so too (once).
        self.inner.mark_lost(&self.state, reason);
        tracing::warn!(
            pool = %self.inner.pool_name,
            lease = %self.state.name,
            token = self.state.token,
            %reason,
            "fenced write rejected: the lease term is over"
        );
        Error::Lease(LeaseError::Lost {
            name: self.state.name.to_string(),
            reason,
        })
    }
}

fn is_serialization_failure(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&tokio_postgres::error::SqlState::T_R_SERIALIZATION_FAILURE)
}

impl fmt::Debug for LeaseHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseHandle")
            .field("name", &self.state.name)
            .field("token", &self.state.token)
            .field("holder", &self.state.holder)
            .field("lost", &self.state.lost_reason())
            .finish()
    }
}

/// A held lease: one term of one row of the lease table. Holds no
/// connection; the process's renewer renews it (batched) until it is
/// released.
///
/// It dereferences to its [`LeaseHandle`]: name, token, lost signal, fence.
/// [`Lease::release`] releases it and reports errors; dropping it releases it
/// in the background (when a tokio runtime is running; otherwise it expires
/// after its TTL).
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool, leases: pgwarden::Leases) -> Result<(), pgwarden::Error> {
/// let opts = pgwarden::LeaseOptions::default();
/// if let Some(lease) = leases.acquire("cleanup", &opts, None).await? {
///     let mut conn = pool.get().await?; // the work's own connection
///     let tx = conn.transaction().await?;
///     lease.fence(&tx).await?; // its writes commit only under this term
///     tx.execute("DELETE FROM sso_requests WHERE expires_at < now()", &[]).await?;
///     tx.commit().await?;
///     drop(conn);
///     lease.release().await?;
/// }
/// # Ok(()) }
/// ```
pub struct Lease {
    pub(crate) handle: LeaseHandle,
    pub(crate) id: u64,
    pub(crate) done: bool,
}

impl Lease {
    /// Releases the lease, this term's only (its holder id is new on every
    /// acquisition), so a late release never touches a later holder's
    /// lease. The row is marked released and kept (until the purge), with
    /// its hold if the term has one (an at-least time or a schedule, which
    /// keeps the lease from being taken again until its time): the next
    /// term takes it over and draws a larger token.
    ///
    /// Fails with [`LeaseError::Lost`](crate::LeaseError::Lost) when the term was already over (taken
    /// over), or with the database error; either way the lease is no longer
    /// renewed.
    ///
    /// Cancellation-safe: dropped before it completes, the guard releases in
    /// the background as on drop.
    pub async fn release(mut self) -> Result<(), Error> {
        let h = self.handle.clone();
        let r = h.inner.release(self.id, &h.state, false).await;
        self.done = true;
        r
    }

    /// Releases, forgetting any hold: the lease is free at once.
    pub(crate) async fn release_now(mut self) -> Result<(), Error> {
        let h = self.handle.clone();
        let r = h.inner.release(self.id, &h.state, true).await;
        self.done = true;
        r
    }
}

impl Deref for Lease {
    type Target = LeaseHandle;

    fn deref(&self) -> &LeaseHandle {
        &self.handle
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if !self.done {
            self.handle
                .inner
                .release_in_background(self.id, self.handle.state.clone());
        }
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("name", &self.handle.state.name)
            .field("token", &self.handle.state.token)
            .field("holder", &self.handle.state.holder)
            .field("lost", &self.handle.state.lost_reason())
            .finish()
    }
}
