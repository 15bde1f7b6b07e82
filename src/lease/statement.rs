//! The one way a lease statement reaches the database: [`Inner::run`].
//!
//! Checkout, statement, and the bound around both; a statement that does not
//! finish in time (or whose future is dropped) is cancelled on the server
//! with a cancel request before its connection is closed, so no backend
//! goes on waiting, for a row lock say, after its client gave up. Named
//! prepared statements on direct connections, unnamed ones behind a
//! transaction pooler (or before the pool knows which it is).

use std::future::Future;
use std::panic::Location;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio_postgres::error::SqlState;
use tokio_postgres::{Error as PgError, NoTls};

use super::inner::Inner;
use super::table::{Call, LeaseStatement};
use crate::admission::{Lane, Priority};
use crate::error::{Error, LeaseError};
use crate::pool::Client as Checkout;

/// How long a cancel request may take (it connects anew, and a hung server
/// does not answer).
const CANCEL_TIMEOUT: Duration = Duration::from_secs(2);

/// How urgent a lease statement's connection is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Urgency {
    /// Renewals and releases: late, they cost a lease or keep one from
    /// others.
    Urgent,
    /// Acquisitions, busy checks, install, purge.
    Normal,
}

/// What to run after a cancelled statement's cancel request: for an
/// acquisition, a release by holder in case it committed first.
pub(crate) type FollowUp = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

impl Inner {
    /// The checkout of every lease statement: one call site, on the pool's
    /// lease lane, where renewals and releases go before acquisitions (and
    /// acquisitions never hold the lane's last slot).
    pub(crate) async fn checkout(
        &self,
        urgency: Urgency,
        timeout: Duration,
    ) -> Result<Checkout, Error> {
        let priority = match urgency {
            Urgency::Urgent => Priority::Urgent,
            Urgency::Normal => Priority::Normal,
        };
        self.pool
            .checkout_with(Lane::Lease, priority, Location::caller(), timeout)
            .await
    }

    /// Named prepared statements only on a connection known to be direct,
    /// and never again after the server refused one.
    pub(crate) fn named(&self) -> bool {
        !self.unnamed_only.load(Ordering::Relaxed) && crate::pooler::keeps_sessions(&self.pool)
    }

    /// Runs `stmt` within `budget`, checkout included. See the module docs.
    pub(crate) async fn run<S: LeaseStatement>(
        &self,
        urgency: Urgency,
        budget: Duration,
        stmt: &S,
    ) -> Result<S::Out, Error> {
        self.run_then(urgency, budget, stmt, || None).await
    }

    /// [`Inner::run`], with `follow_up` run after the cancel request when
    /// the statement is cancelled (timed out, or its future dropped).
    pub(crate) async fn run_then<S, F>(
        &self,
        urgency: Urgency,
        budget: Duration,
        stmt: &S,
        follow_up: F,
    ) -> Result<S::Out, Error>
    where
        S: LeaseStatement,
        F: FnOnce() -> Option<FollowUp>,
    {
        let began = Instant::now();
        let mut named = self.named();
        let mut flight = InFlight {
            inner: self,
            what: S::WHAT,
            conn: None,
            follow_up: Some(follow_up),
        };
        for attempt in 0..2 {
            let left = budget.saturating_sub(began.elapsed());
            let outcome = tokio::time::timeout(left, async {
                let conn = self.checkout(urgency, left).await?;
                self.count_statement();
                let call = Call { named };
                let conn = flight.conn.insert(conn);
                Ok::<_, Error>(stmt.exec(&self.sql, conn, call).await)
            })
            .await;
            match outcome {
                Ok(Ok(Ok(out))) => {
                    flight.conn = None; // back to the pool
                    return Ok(out);
                }
                Ok(Ok(Err(e))) if attempt == 0 && named && refused_prepared(&e) => {
                    // A pooler behind a direct-looking connection: never
                    // name a statement again, retry this one unnamed.
                    self.unnamed_only.store(true, Ordering::Relaxed);
                    tracing::warn!(
                        pool = %self.pool_name,
                        error = %e,
                        "a prepared lease statement was refused: sending lease statements unnamed from now on"
                    );
                    if let Some(conn) = flight.conn.take() {
                        conn.discard();
                    }
                    named = false;
                }
                Ok(Ok(Err(e))) => {
                    flight.conn = None;
                    // Its own lock_timeout: the server ended the wait.
                    if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
                        if let Some(out) = S::on_lock_timeout() {
                            return Ok(out);
                        }
                        self.metrics.timed_out(S::WHAT);
                        return Err(Error::Lease(LeaseError::Timeout {
                            what: S::WHAT,
                            waited: began.elapsed(),
                        }));
                    }
                    return Err(Error::Db(e));
                }
                // The checkout ran out of the statement's time: the
                // statement's timeout, as documented, and counted.
                Ok(Err(e)) if e.is_timeout() => {
                    self.metrics.timed_out(S::WHAT);
                    return Err(Error::Lease(LeaseError::Timeout {
                        what: S::WHAT,
                        waited: began.elapsed(),
                    }));
                }
                Ok(Err(e)) => return Err(e), // the checkout failed
                Err(_) => {
                    self.metrics.timed_out(S::WHAT);
                    drop(flight); // cancels the statement if it was sent
                    return Err(Error::Lease(LeaseError::Timeout {
                        what: S::WHAT,
                        waited: began.elapsed(),
                    }));
                }
            }
        }
        Err(Error::Lease(LeaseError::Timeout {
            what: S::WHAT,
            waited: began.elapsed(),
        }))
    }
}

/// A prepared statement the server (a pooler, really) does not know, or
/// already knows under that name.
fn refused_prepared(e: &PgError) -> bool {
    e.code().is_some_and(|c| {
        *c == SqlState::INVALID_SQL_STATEMENT_NAME || *c == SqlState::DUPLICATE_PSTATEMENT
    })
}

/// The connection of a statement in flight. Dropped while it still holds
/// one (a timeout, a dropped future), it cancels the statement on the server
/// and closes the connection.
///
/// The cancel request goes only to a connection known to be direct. Behind
/// a transaction pooler it is not sent: PgBouncer before 1.20 crashes when a
/// cancel request's client closes before PgBouncer has forwarded it
/// (pgbouncer/pgbouncer#801), and tokio-postgres closes it right after
/// writing. There the statement's own `lock_timeout` ends its wait on the
/// server, and the connection is closed at once.
struct InFlight<'i, F: FnOnce() -> Option<FollowUp>> {
    inner: &'i Inner,
    what: &'static str,
    conn: Option<Checkout>,
    follow_up: Option<F>,
}

impl<F: FnOnce() -> Option<FollowUp>> Drop for InFlight<'_, F> {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        let pool = self.inner.pool_name.clone();
        let what = self.what;
        let pid = conn.pid();
        let follow_up = self.follow_up.take().and_then(|f| f());
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            conn.discard();
            tracing::warn!(
                pool = %pool, statement = what, pid,
                "lease statement abandoned outside a tokio runtime: its connection is closed; its lock_timeout ends it on the server"
            );
            return;
        };
        // Known direct by now (detection may have finished meanwhile).
        if !self.inner.named() {
            conn.discard();
            if let Some(f) = follow_up {
                rt.spawn(f);
            }
            return;
        }
        // Cancel first, then close: behind a transaction pooler the cancel
        // request finds the server connection through this client's link,
        // which closing the connection would cut.
        let token = conn.cancel_token();
        rt.spawn(async move {
            match tokio::time::timeout(CANCEL_TIMEOUT, token.cancel_query(NoTls)).await {
                Ok(Ok(())) => {
                    tracing::debug!(pool = %pool, statement = what, pid, "lease statement cancelled on the server")
                }
                Ok(Err(e)) => tracing::warn!(
                    pool = %pool, statement = what, pid, error = %e,
                    "cancel request for a lease statement failed; its connection is closed"
                ),
                Err(_) => tracing::warn!(
                    pool = %pool, statement = what, pid,
                    "cancel request for a lease statement got no answer within {CANCEL_TIMEOUT:?}; its connection is closed"
                ),
            }
            conn.discard();
            if let Some(f) = follow_up {
                f.await;
            }
        });
    }
}
