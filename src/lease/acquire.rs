//! Acquire and release: getting a lease ([`Inner::attempt`]), the guard it
//! returns ([`Lease`], and [`LeaseHandle`], its shareable view), and giving
//! it back (by the guard, on drop, or after a cancelled acquisition).
//!
//! # Acquisition
//!
//! Getting a lease: readiness before the first statement (pooler
//! detection, install), one acquisition attempt, and how long a held name
//! may stay busy.
//!
//! # The guard
//!
//! [`Lease`], the guard of one term, and [`LeaseHandle`], its shareable view:
//! name, fencing token, the lost signal, the fenced-transaction check.
//!
//! # Release
//!
//! Releasing a term: by its guard or runner, in the background when the
//! guard is dropped, and after a cancelled acquisition.

use std::fmt;
use std::future::Future;
use std::ops::Deref;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::inner::{FollowUp, Inner, Urgency};
use super::options::{check_name, new_holder, LeaseOptions};
use super::table::{Acquire, Blocker, Busy, FreeIn, Install, Release};
use super::term::{LeaseState, Term, TermInfo};
use crate::error::{Error, LeaseError};
use crate::lost::LostReason;
use crate::pooler::PoolerMode;

/// The longest wait between two attempts of [`Leases::acquire`](super::Leases::acquire):
/// a holder may release early. Also the wait after a blocked take-over.
pub(crate) const MAX_POLL: Duration = Duration::from_millis(500);

/// At most one log line per this interval, per instance, for blocked
/// take-overs (each is counted).
const BLOCKED_LOG_EVERY: Duration = Duration::from_secs(10);

impl Inner {
    /// Before the first statement: find out, in the background, whether the
    /// pool talks to PostgreSQL directly (statements are sent unnamed until
    /// it is known), and install the table (with its shape check) when
    /// `auto_install` is on.
    pub(crate) async fn ensure_ready(&self) -> Result<(), Error> {
        self.detect_pooler_in_background();
        if !self.auto_install {
            return Ok(());
        }
        self.installed
            .get_or_try_init(|| async {
                self.install().await?;
                Ok::<(), Error>(())
            })
            .await
            .map(|_| ())
    }

    fn detect_pooler_in_background(&self) {
        if self
            .detect_started
            .load(std::sync::atomic::Ordering::Relaxed)
            || self
                .detect_started
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            return;
        }
        let pool = self.pool();
        if pool.pooler() != PoolerMode::Auto {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let bound = self.statement_timeout;
        rt.spawn(async move {
            match tokio::time::timeout(bound, pool.detect_pooler()).await {
                Ok(Ok(found)) => {
                    tracing::debug!(pool = %pool.name(), pooler = ?found, "lease statements: pooler known")
                }
                Ok(Err(e)) => tracing::warn!(
                    pool = %pool.name(), error = %e,
                    "pooler detection failed: lease statements stay unnamed (parsed on every call)"
                ),
                Err(_) => tracing::warn!(
                    pool = %pool.name(),
                    "pooler detection did not finish within {bound:?}: lease statements stay unnamed"
                ),
            }
        });
    }

    /// Creates the table unless it exists, then checks its shape (see
    /// [`super::Leases::install`]), bounded by the statement timeout.
    pub(crate) async fn install(&self) -> Result<bool, Error> {
        self.detect_pooler_in_background();
        let table = self.table.to_string();
        let bare = self.table.unqualified_if_defaulted();
        let stmt = Install {
            wait: self.statement_timeout,
            table: &table,
            bare: bare.as_deref(),
        };
        let ran = self
            .run(Urgency::Normal, self.statement_timeout, &stmt)
            .await??;
        if ran {
            tracing::info!(pool = %self.pool_name, table = %self.table, "lease table installed");
        }
        let _ = self.installed.set(());
        Ok(ran)
    }

    /// One acquisition attempt: the lease, or why not.
    pub(crate) async fn attempt(
        self: &Arc<Self>,
        name: &str,
        opts: &LeaseOptions,
    ) -> Result<Result<Lease, Busy>, Error> {
        self.attempt_as(name, opts, new_holder()).await
    }

    /// [`Inner::attempt`] under a holder id the caller made
    /// ([`new_holder`]), so that it can release by holder after
    /// cancelling the attempt.
    pub(crate) async fn attempt_as(
        self: &Arc<Self>,
        name: &str,
        opts: &LeaseOptions,
        holder: String,
    ) -> Result<Result<Lease, Busy>, Error> {
        check_name(name)?;
        let timing = opts.validate()?;
        self.ensure_renewer();
        self.ensure_ready().await?;
        let at_least = opts.at_least_time();
        let has_hold = !at_least.is_zero() || opts.period.is_some();
        let stmt = Acquire {
            name,
            holder: &holder,
            ttl: timing.ttl.as_secs_f64(),
            hold: has_hold.then(|| {
                (
                    at_least.as_secs_f64(),
                    opts.period.map_or(0.0, |p| p.as_secs_f64()),
                )
            }),
        };
        let start = Instant::now();
        // Cancelled after it reached the server, the statement may have
        // taken the lease: release whatever this holder got.
        let follow_up = || -> Option<FollowUp> {
            let (inner, name, holder) = (self.clone(), name.to_owned(), holder.clone());
            Some(Box::pin(async move {
                inner.release_cancelled(&name, &holder).await;
            }))
        };
        let taken = match self.acquire_gathered(&stmt, follow_up).await? {
            Ok(taken) => taken,
            Err(busy) => {
                if busy == Busy::Blocked {
                    self.takeover_blocked(name).await;
                }
                return Ok(Err(busy));
            }
        };
        let taken_at = Duration::try_from_secs_f64(taken.taken_at)
            .ok()
            .and_then(|d| UNIX_EPOCH.checked_add(d))
            .unwrap_or_else(SystemTime::now);
        let info = TermInfo {
            name: name.into(),
            holder,
            token: taken.token,
            taken_at,
            prev_holder: taken.prev_holder,
        };
        let state = Arc::new(LeaseState::new(info, timing.deadline(start)));
        self.metrics.acquired(name);
        if let Some(prev) = state.term.took_over_from.as_deref() {
            self.metrics.takeover(name);
            tracing::warn!(
                pool = %self.pool_name,
                lease = name,
                token = taken.token,
                previous_holder = prev,
                "lease taken over from an expired holder"
            );
        }
        let id = self.register(state.clone(), timing, start);
        Ok(Ok(Lease {
            handle: LeaseHandle {
                state,
                inner: self.clone(),
            },
            id,
            done: false,
        }))
    }

    /// A take-over that met a row lock: counted, and logged (at most once
    /// per [`BLOCKED_LOG_EVERY`] per instance) with the session that holds
    /// the row when the server can tell.
    async fn takeover_blocked(&self, name: &str) {
        self.metrics.takeover_blocked(name);
        self.stats.lock().takeovers_blocked += 1;
        let now = self.created.elapsed();
        {
            let mut last = self.blocked_logged.lock();
            if last.is_some_and(|t| now.saturating_sub(t) < BLOCKED_LOG_EVERY) {
                return;
            }
            *last = Some(now);
        }
        let blocker = self
            .run(Urgency::Normal, self.statement_timeout, &Blocker { name })
            .await;
        match blocker {
            Ok(Some(b)) => tracing::warn!(
                pool = %self.pool_name, lease = name,
                blocking_pid = b.pid, application_name = %b.application_name,
                state = %b.state, state_for_s = b.state_for_s,
                "lease take-over blocked by a row lock on its expired row: answered busy, tried again later \
                 (a fenced transaction of the expired term ends at most 1 s past the term; another session \
                 holding the row blocks it as long as it holds it)"
            ),
            Ok(None) => tracing::warn!(
                pool = %self.pool_name, lease = name,
                "lease take-over blocked by a row lock on its expired row: answered busy, tried again later"
            ),
            Err(e) => tracing::warn!(
                pool = %self.pool_name, lease = name, error = %e,
                "lease take-over blocked by a row lock on its expired row (its holder could not be read): answered busy"
            ),
        }
    }

    /// How long until a held name may be free (database clock), for callers
    /// that wait: at most [`MAX_POLL`]'s worth is ever slept at once.
    pub(crate) async fn free_in(&self, name: &str) -> Result<Duration, Error> {
        let secs = self
            .run(Urgency::Normal, self.statement_timeout, &FreeIn { name })
            .await?;
        // No row: taken and released, or being inserted. Ask again soon.
        Ok(secs
            .and_then(|s| Duration::try_from_secs_f64(s.max(0.0)).ok())
            .unwrap_or(Duration::from_millis(10)))
    }
}

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

/// The least time left worth a second release attempt.
const MIN_RETRY_BUDGET: Duration = Duration::from_millis(50);

/// Whether a failed release is worth a second attempt: not when the term is
/// known to be over, nor when the bound is spent.
fn retryable(e: &Error) -> bool {
    !matches!(
        e,
        Error::Lease(LeaseError::Lost { .. }) | Error::Lease(LeaseError::Timeout { .. })
    )
}

impl Inner {
    /// Releases one term for its guard or runner: stops renewing it, then
    /// releases its row.
    pub(crate) async fn release(
        self: &Arc<Self>,
        id: u64,
        state: &LeaseState,
        forget_hold: bool,
    ) -> Result<(), Error> {
        self.unregister(id);
        match state.lost_reason() {
            Some(LostReason::Taken) => Err(Error::Lease(LeaseError::Lost {
                name: state.name.to_string(),
                reason: LostReason::Taken,
            })),
            // `release_all` released it already.
            Some(LostReason::Released) => Ok(()),
            _ => self.release_row(state, forget_hold).await,
        }
    }

    /// The release of one term: its row is marked released (and kept, with
    /// its hold unless `forget_hold`). Bounded by the statement timeout.
    ///
    /// A release that fails (a connection the server closed, as right after
    /// a primary failover, or any other error) is tried once more within
    /// what is left of the bound: otherwise the lease would stay held until
    /// its TTL. The first attempt's answer may have been lost after the
    /// server ran it, so a retry that finds the term gone counts as
    /// released.
    pub(crate) async fn release_row(
        self: &Arc<Self>,
        state: &LeaseState,
        forget_hold: bool,
    ) -> Result<(), Error> {
        let began = Instant::now();
        let name = &*state.name;
        let ours = match self
            .release_once(state, forget_hold, self.statement_timeout)
            .await
        {
            Err(e) if retryable(&e) => {
                let left = self.statement_timeout.saturating_sub(began.elapsed());
                if left < MIN_RETRY_BUDGET {
                    return Err(e);
                }
                tracing::info!(
                    pool = %self.pool_name, lease = name, error = %e,
                    "lease release failed: trying once more"
                );
                if !self.release_once(state, forget_hold, left).await? {
                    tracing::debug!(
                        pool = %self.pool_name, lease = name,
                        "lease release retried: the term is gone (released by the first attempt, or taken over)"
                    );
                }
                true
            }
            other => other?,
        };
        if ours {
            return Ok(());
        }
        tracing::warn!(
            pool = %self.pool_name,
            lease = name,
            token = state.token,
            "late release: the lease had been taken over; the new holder's lease is untouched"
        );
        Err(Error::Lease(LeaseError::Lost {
            name: name.to_owned(),
            reason: LostReason::Taken,
        }))
    }

    /// One release attempt within `budget`: whether the term was still ours.
    async fn release_once(
        self: &Arc<Self>,
        state: &LeaseState,
        forget_hold: bool,
        budget: Duration,
    ) -> Result<bool, Error> {
        let stmt = Release {
            name: &state.name,
            holder: state.holder.as_str(),
            keep_hold: !forget_hold,
        };
        self.release_gathered(&stmt, budget).await
    }

    /// The guard's drop: stop renewing now, release in the background.
    pub(crate) fn release_in_background(self: &Arc<Self>, id: u64, state: Arc<LeaseState>) {
        self.unregister(id);
        if matches!(
            state.lost_reason(),
            Some(LostReason::Taken | LostReason::Released)
        ) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let inner = self.clone();
                rt.spawn(async move {
                    if let Err(e) = inner.release(id, &state, false).await {
                        if !e.is_lease_lost() {
                            tracing::warn!(
                                pool = %inner.pool_name,
                                lease = %state.name,
                                error = %e,
                                "lease release on drop failed; it expires after its TTL"
                            );
                        }
                    }
                });
            }
            Err(_) => tracing::warn!(
                pool = %self.pool_name,
                lease = %state.name,
                "lease dropped outside a tokio runtime; it expires after its TTL"
            ),
        }
    }
}
