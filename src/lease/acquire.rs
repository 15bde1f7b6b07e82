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
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::backend::Backend;
use super::inner::{Inner, Owner, Urgency};
use super::options::{check_name, new_holder, LeaseOptions};
use super::table::{
    Acquire, Blocker, Busy, Call, DbTerm, FreeIn, Install, LeaseStatement, Release, Statements,
    FENCE_GRACE,
};
use super::term::{LeaseState, Term, TermInfo, MAX_TTL};
use crate::error::{Error, LeaseError};
use crate::key::Namespace;
use crate::lost::LostReason;
use crate::stmt::{code, Conn, Exec, Param, Row, Sent, SqlError};

/// The longest wait between two attempts of [`Leases::acquire`](super::Leases::acquire):
/// a holder may release early. Also the wait after a blocked take-over.
pub(crate) const MAX_POLL: Duration = Duration::from_millis(500);

/// At most one log line per this interval, per instance, for blocked
/// take-overs (each is counted).
const BLOCKED_LOG_EVERY: Duration = Duration::from_secs(10);

impl<B: Backend> Inner<B> {
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
        let Some(detect) = B::detect_pooler(&self.pool) else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let bound = self.statement_timeout;
        let pool = self.pool_name.clone();
        rt.spawn(async move {
            match tokio::time::timeout(bound, detect).await {
                Ok(Ok(found)) => {
                    tracing::debug!(pool = %pool, pooler = ?found, "lease statements: pooler known")
                }
                Ok(Err(e)) => tracing::warn!(
                    pool = %pool, error = %e,
                    "pooler detection failed: lease statements stay unnamed (parsed on every call)"
                ),
                Err(_) => tracing::warn!(
                    pool = %pool,
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
        let found = self
            .run(Urgency::Normal, self.statement_timeout, &stmt)
            .await??;
        self.unstamped
            .store(!found.stamped, std::sync::atomic::Ordering::Relaxed);
        if let Some(why) = &found.unstamped_why {
            tracing::warn!(
                pool = %self.pool_name, table = %self.table, error = %why,
                "lease table made by an earlier pgwarden: could not add its column renewed_at; \
                 leases work without it, but readers (`pgwarden check`, `Leases::rows`) must guess \
                 each term's TTL; run `ALTER TABLE {} ADD COLUMN renewed_at timestamptz` as the table's owner",
                self.sql.table
            );
        }
        let ran = found.ran;
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
    ) -> Result<Result<Lease<B>, Busy>, Error> {
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
    ) -> Result<Result<Lease<B>, Busy>, Error> {
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
        // A take-over blocked past the expired term's end + 1 s by a fenced
        // transaction of that term ends its session, then tries once more.
        let mut tried_again = false;
        let taken = loop {
            match self.acquire_gathered(&stmt).await? {
                Ok(taken) => break taken,
                Err(Busy::Blocked) => {
                    // A cold path, boxed: its future stays out of every
                    // acquisition's (moved whole at each of its awaits'
                    // first polls).
                    let ended = Box::pin(self.takeover_blocked(name)).await;
                    if ended && !tried_again {
                        tried_again = true;
                        continue;
                    }
                    return Ok(Err(Busy::Blocked));
                }
                Err(busy) => return Ok(Err(busy)),
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
        let state = Arc::new(LeaseState::new(info, timing.deadline(start), timing.margin));
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
            inner: self.clone(),
            id,
            done: false,
        }))
    }

    /// A take-over that met a row lock. First, once the expired term ended
    /// more than [`FENCE_GRACE`] ago, ends the sessions that hold that
    /// term's fence mark (its fenced transactions: see
    /// [`LeaseHandle::fence`]), and returns true when it ended one.
    /// Otherwise counted, and logged (at most once per
    /// [`BLOCKED_LOG_EVERY`] per instance) with the session that holds the
    /// row when the server can tell.
    async fn takeover_blocked(&self, name: &str) -> bool {
        match self
            .run(
                Urgency::Normal,
                self.statement_timeout,
                &EndFenced {
                    name,
                    grace: FENCE_GRACE,
                },
            )
            .await
        {
            Ok(found) => {
                let mut ended = false;
                for f in found {
                    if f.ended {
                        ended = true;
                        tracing::warn!(
                            pool = %self.pool_name, lease = name, pid = f.pid,
                            application_name = %f.application_name,
                            "ended the session of a fenced transaction left open past its term's end + {FENCE_GRACE:?} \
                             (a frozen or cut-off holder): its commit cannot land; taking the lease over"
                        );
                    } else {
                        tracing::warn!(
                            pool = %self.pool_name, lease = name, pid = f.pid,
                            application_name = %f.application_name, role = %f.role,
                            "a fenced transaction left open past its term's end blocks this take-over, and this \
                             role may not end its session: grant the lease role pg_signal_backend (or use one role \
                             for the lease statements and the fenced transactions), or end pid {} by hand",
                            f.pid
                        );
                    }
                }
                if ended {
                    return true;
                }
            }
            Err(e) => tracing::debug!(
                pool = %self.pool_name, lease = name, error = %e,
                "could not look for a fenced transaction past its term blocking a take-over"
            ),
        }
        self.metrics.takeover_blocked(name);
        self.stats.lock().takeovers_blocked += 1;
        let now = self.created.elapsed();
        {
            let mut last = self.blocked_logged.lock();
            if last.is_some_and(|t| now.saturating_sub(t) < BLOCKED_LOG_EVERY) {
                return false;
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
                 (a fenced transaction of the expired term is ended 1 s past the term; another session \
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
        false
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
    /// Its instance, whatever the backend (what a handle needs of it does
    /// not depend on the pool: one `LeaseHandle` type, and one [`Job`](crate::Job)
    /// type, for every backend).
    pub(crate) inner: Arc<dyn Owner>,
}

impl LeaseHandle {
    /// The term held: name, fencing token, holder, start, and whose expired
    /// term it replaced. See [`Term`].
    pub fn term(&self) -> &Term {
        &self.state.term
    }

    /// The local deadline: the instant this process stops trusting the
    /// lease unless a renewal succeeds first. It is the start of the
    /// statement that took the lease, or of the last successful renewal,
    /// plus the TTL less the safety margin (so a safety margin before the
    /// database could let anyone else in), and moves later with every
    /// renewal. [`LeaseHandle::lost`] fires at it.
    ///
    /// It counts from the statement that took the lease, not from the call:
    /// an [`acquire`](crate::Leases::acquire) that waited for most of a TTL
    /// still has the whole term ahead. Use it to bound work that cannot
    /// check [`is_lost`](LeaseHandle::is_lost) itself (`pgwarden run`'s
    /// keeper kills its command at this deadline unless it moves).
    ///
    /// ```rust,no_run
    /// # async fn demo(leases: pgwarden::Leases) -> Result<(), pgwarden::Error> {
    /// let ttl = std::time::Duration::from_secs(30);
    /// let opts = pgwarden::LeaseOptions::new(ttl);
    /// if let Some(lease) = leases.acquire("report", &opts, None).await? {
    ///     let left = lease.deadline().saturating_duration_since(std::time::Instant::now());
    ///     assert!(left < ttl);
    ///     lease.release().await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn deadline(&self) -> std::time::Instant {
        self.state.deadline()
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
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static + use<> {
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

    /// Fences the transaction `tx`: inside it, locks the lease row `FOR KEY
    /// SHARE` and checks that it is still this term (holder and token) and
    /// unexpired, and that the local deadline has not passed (before and
    /// after the statement). Returns the transaction as a [`Fenced`] guard:
    /// run the writes through it (it dereferences to the transaction), then
    /// [`Fenced::commit`], the only way to commit it.
    ///
    /// On success, the writes of that transaction commit only under this
    /// term: a take-over (which locks the row `FOR UPDATE`) waits for the
    /// transaction to end, and then sees the term the commit happened under.
    /// Renewals of this lease do not wait (they take `FOR NO KEY UPDATE`).
    /// No take-over happens while the transaction is open (a take-over
    /// answers busy meanwhile), so the transaction is bounded on the server,
    /// as a whole, to the term's time left + 1 s. The term's end there is
    /// the database's: the row's expiry as the fence reads it, or, when
    /// that read may be older than the term (see *Isolation levels*), as a
    /// read outside the snapshot gives it; never this client's own (its
    /// local deadline plus the safety margin), which trails the database's
    /// clock once the host was suspended. The time left is counted once
    /// the row is locked, not before the fence's wait for it:
    ///
    /// - `statement_timeout`, `idle_in_transaction_session_timeout` and
    ///   `lock_timeout` are set for this transaction to that bound, or kept
    ///   when the role's, the session's or the transaction's own is tighter
    ///   (0 counts as none); on PostgreSQL 17 and later `transaction_timeout`
    ///   too, which bounds the transaction as a whole;
    /// - the fence's own statement is bounded too, in the same round trip:
    ///   its `lock_timeout` is set before it locks the row, so a row held by
    ///   another session (a `SELECT … FOR UPDATE` or a `DELETE` on the lease
    ///   table, or a session frozen holding it) makes the fence give up at
    ///   the term's end + 1 s, with
    ///   [`LeaseError::Lost`](crate::LeaseError::Lost) (the term is over by
    ///   then: renewals wait behind the same lock), or earlier at the
    ///   transaction's tighter `lock_timeout` or `statement_timeout` with
    ///   [`LeaseError::FenceBlocked`](crate::LeaseError::FenceBlocked),
    ///   which says whether the lock was the row's or the table's and
    ///   names the session holding it (looked up from `pg_locks` in at
    ///   most 2 s, never waiting behind a lock on the lease table; only a
    ///   lock that conflicts with a fence's is named, and a fence cut off by
    ///   a `statement_timeout` while it ran slow, waiting for nothing,
    ///   names none and claims none). A lock
    ///   on the lease table itself (`LOCK TABLE`, `ALTER TABLE`, `VACUUM
    ///   FULL` in an open transaction) is waited for as the statement is
    ///   parsed, before it can set anything: only the transaction's own
    ///   `lock_timeout` or `statement_timeout` bounds that wait (give the
    ///   transaction one where that can happen);
    /// - these bound one statement or one idle spell each, not the
    ///   transaction: the transaction also takes pgwarden's *fence mark*,
    ///   the shared advisory lock `(1885828964, the token's low 32 bits)`
    ///   (pgwarden's own namespace; a try, never waited on, released at the
    ///   transaction's end). A take-over blocked by this row's lock past the
    ///   term's end + 1 s ends (`pg_terminate_backend`) the session that
    ///   holds the mark of the expired term and started before its end,
    ///   then tries once more. This needs the right to signal that session
    ///   (the same role, or `pg_signal_backend`); without it the take-over
    ///   answers busy and logs the pid.
    ///
    /// A holder frozen or cut off with the transaction open loses its
    /// session then, and its commit never lands; the lease is taken over at
    /// most about 1 s after its term ends. A transaction that must outlive
    /// its term's time left (renewals extend the term meanwhile) calls
    /// [`Fenced::check`] to extend the bound. Keep fenced transactions
    /// short.
    ///
    /// `tx` is the transaction of the pool's own driver: a
    /// `deadpool_postgres::Transaction`, or (features `sqlx-0_8`,
    /// `sqlx-0_9`) the `Transaction` of `pgwarden::sqlx::Pool::begin`,
    /// whose guard dereferences to its `PgConnection`
    /// (`sqlx::query(…).execute(&mut *tx)`). Any pool of the database
    /// will do: the fence is the row lock and the term check, not the
    /// connection.
    ///
    /// Fails with [`LeaseError::Lost`](crate::LeaseError::Lost) when the term is over: `Taken` (the
    /// row is another term's, or gone), `Expired` (still this term, expired
    /// in the database) or `Deadline`. The transaction is then rolled back
    /// (dropped): the writes would come from a stale holder. Fails with
    /// [`LeaseError::FenceBlocked`](crate::LeaseError::FenceBlocked) when
    /// another session kept the row locked past the fence's bound while
    /// the term was still this holder's (rolled back too: retry).
    ///
    /// # Isolation levels
    ///
    /// All three of PostgreSQL's levels are supported. Under `READ
    /// COMMITTED` the check reads the row as it is now. Under `REPEATABLE
    /// READ` and `SERIALIZABLE` it reads the transaction's snapshot: a
    /// take-over committed since then makes PostgreSQL refuse the lock with
    /// a serialization failure, which `fence` reports as
    /// `LeaseError::Lost { reason: Taken }`; a renewal by this holder, a
    /// [`revoke`](crate::Leases::revoke) or a release since then is no
    /// conflict (none changes the key), but the row the snapshot shows is
    /// then out of date. So when the row has a newer version than the one
    /// read (a renewal, revoke or release committed since the snapshot), or
    /// its expiry as read is earlier than the term's end this client knows
    /// by more than 100 ms (this client's clock trailing the database's
    /// after a suspended host), `fence` reads the term once more outside
    /// the snapshot (one statement on the instance's pool, no lock, at most
    /// 500 ms) and the database decides: a term over there is refused
    /// (`Expired`, `Revoked`), a live one is bounded from its expiry there
    /// (one more statement in the transaction). If that read fails (a pool
    /// of 2, whose one shared connection the fenced transaction holds), the
    /// fence passes when the snapshot's row is unexpired, bounded from its
    /// expiry (a revoke since the snapshot is then not seen), and fails
    /// with the read's error otherwise
    /// ([`LeaseError::FenceNoConnection`](crate::LeaseError::FenceNoConnection)
    /// when it got no connection in time). So a fence never passes for a term
    /// the database has ended, at any level (but for that one case), and every
    /// fenced transaction started before its term's end, within reach of a
    /// blocked take-over (below). Take the snapshot after the lease:
    /// call `fence` first in the transaction (a snapshot older than the
    /// acquisition sees another term, and the fence fails with `Taken`;
    /// one taken by the fence itself is current, and costs no second read).
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::Pool, lease: pgwarden::LeaseHandle) -> Result<(), pgwarden::Error> {
    /// let mut conn = pool.get_within(std::time::Duration::from_secs(5)).await?;
    /// let tx = conn.transaction().await?;
    /// let tx = lease.fence(tx).await?; // rejected if another holder took over
    /// tx.execute("UPDATE accounts SET balance = balance - 1 WHERE id = 1", &[]).await?;
    /// tx.commit().await?; // Ok only when it landed
    /// # Ok(()) }
    /// ```
    pub async fn fence<'a, T: FenceTx + 'a>(&self, tx: T) -> Result<Fenced<'a, T>, Error> {
        let mut tx = tx;
        if let Err(e) = tx.check_in(self).await {
            // Rolled back first: nothing waits on this transaction while
            // the blocker is looked up.
            drop(tx);
            return Err(self.name_blocker(e).await);
        }
        Ok(Fenced {
            tx,
            lease: self.clone(),
            life: PhantomData,
        })
    }

    /// The fence check in `tx` (see [`LeaseHandle::fence`]), on any
    /// backend's transaction ([`FenceTx::check_in`] gives it its own).
    pub(crate) async fn check_in(&self, tx: &impl Exec) -> Result<(), Error> {
        if let Some(reason) = self.inner.check_lost(&self.state) {
            return Err(self.fence_failed(reason));
        }
        let row = self.fence_statement(tx, None).await?;
        let reason = match row {
            Some((holder, token, fresh, stale, marked))
                if holder == self.state.holder && token == self.state.token =>
            {
                if !marked {
                    // Another transaction of this session holds the same
                    // key exclusively (a token whose low 32 bits are one of
                    // pgwarden's own keys): the per-statement bounds stand.
                    tracing::debug!(
                        pool = %self.inner.pool_name(), lease = %self.state.name,
                        token = self.state.token,
                        "fence mark not taken: its key is held exclusively elsewhere"
                    );
                }
                if stale {
                    // Under a snapshot, the row read may be older than the
                    // term: the row changed since the snapshot (renewed,
                    // revoked or released), or this client's clock trails
                    // the database's (a suspended host). The database
                    // decides.
                    match self.confirm(tx, fresh).await? {
                        None => match self.inner.check_lost(&self.state) {
                            None => return Ok(()),
                            Some(reason) => reason,
                        },
                        Some(reason) => reason,
                    }
                } else if fresh {
                    match self.inner.check_lost(&self.state) {
                        None => return Ok(()),
                        Some(reason) => reason,
                    }
                } else {
                    LostReason::Expired
                }
            }
            // The row still carries this term's token, with no holder: the
            // term was ended by hand.
            Some((holder, token, ..)) if holder.is_empty() && token == self.state.token => {
                LostReason::Revoked
            }
            _ => LostReason::Taken,
        };
        Err(self.fence_failed(reason))
    }

    /// The fence's statement in `tx` (see `Statements::fence`), its errors
    /// mapped: `db_left`, the term's time left as the database gave it
    /// outside the transaction's snapshot, for the bound.
    async fn fence_statement(
        &self,
        tx: &impl Exec,
        db_left: Option<Duration>,
    ) -> Result<Option<(String, i64, bool, bool, bool)>, Error> {
        self.inner.count_statement();
        let began = Instant::now();
        match self
            .inner
            .sql()
            .fence(
                tx,
                &self.state.name,
                &self.state.holder,
                self.state.token,
                self.state.term_end().saturating_duration_since(began),
                db_left,
            )
            .await
        {
            Ok(row) => Ok(row),
            // A take-over (or purge) committed after the transaction's
            // snapshot: the term is over.
            Err(e) if e.is(code::SERIALIZATION_FAILURE) => {
                Err(self.fence_failed(LostReason::Taken))
            }
            // A lock (the row's, or the table's) was not granted within the
            // fence's bound (the term's end + 1 s, or the transaction's
            // tighter lock_timeout), or the transaction's tighter
            // statement_timeout ended the statement first (a lock wait, or
            // a slow statement that waited for nothing), or a cancel
            // request (57014 too: only the message's words, in the
            // server's language, tell them apart): the session holding a
            // lock that blocks a fence, if any, is looked up once the
            // transaction is gone.
            Err(e) if e.is(code::LOCK_NOT_AVAILABLE) || e.is(code::QUERY_CANCELED) => {
                Err(self.fence_blocked(began.elapsed()))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// For a fence whose row read may be older than the term (`stale`, see
    /// `Statements::fence`): reads the term outside the
    /// transaction's snapshot, on the instance's pool. The term over there
    /// (or another's): its reason. Still this holder's: the fence's
    /// statement again in `tx`, bounding the transaction from the
    /// database's time left, and `None`. The read failed (or took longer
    /// than `FENCE_TERM_LOOKUP`): when the row read is unexpired (`fresh`:
    /// the term is live in the database), `None`, the transaction keeping
    /// the bound that row gives, never later than the database's; else the
    /// read's error.
    async fn confirm(&self, tx: &impl Exec, fresh: bool) -> Result<Option<LostReason>, Error> {
        let asked = Instant::now();
        let DbTerm {
            holder,
            token,
            left_s,
        } = match self.inner.term_now(&self.state.name).await {
            Ok(Some(term)) => term,
            Ok(None) => return Ok(Some(LostReason::Taken)),
            Err(e) if fresh => {
                tracing::warn!(
                    pool = %self.inner.pool_name(), lease = %self.state.name,
                    token = self.state.token, error = %e,
                    "fence under an old snapshot could not read its term outside it: \
                     its transaction is bounded from the snapshot's expiry"
                );
                return Ok(None);
            }
            // The row read is expired, and nothing says the term is not:
            // no fence (a transaction fenced past the term's end would be
            // out of a take-over's reach, see `EndFenced`).
            Err(e) => return Err(e),
        };
        if holder.is_empty() && token == self.state.token {
            return Ok(Some(LostReason::Revoked));
        }
        if holder != self.state.holder || token != self.state.token {
            return Ok(Some(LostReason::Taken));
        }
        // At most the longest term (an expiry edited by hand to
        // 'infinity' included); NaN is no time left.
        let left = Duration::try_from_secs_f64(left_s.min(MAX_TTL.as_secs_f64()))
            .unwrap_or(Duration::ZERO);
        if left.is_zero() {
            return Ok(Some(LostReason::Expired));
        }
        self.fence_statement(tx, Some(left.saturating_sub(asked.elapsed())))
            .await?;
        Ok(None)
    }

    /// The fence's wait for a lock (the lease row's, or the table's) ran
    /// out after `waited`: [`LeaseError::Lost`] when the term is over by
    /// now (the bound is the term's end + 1 s, so it usually is: renewals
    /// wait behind a row lock too), else [`LeaseError::FenceBlocked`] (a
    /// tighter `lock_timeout` or `statement_timeout` of the
    /// transaction's), its blocker to be named by
    /// [`LeaseHandle::name_blocker`].
    fn fence_blocked(&self, waited: Duration) -> Error {
        tracing::warn!(
            pool = %self.inner.pool_name(),
            lease = %self.state.name,
            token = self.state.token,
            ?waited,
            "fence gave up waiting for a lock on the lease row or table, held by another session \
             (a SELECT … FOR UPDATE, DELETE or LOCK TABLE on the lease table, or a frozen session)"
        );
        if let Some(reason) = self.inner.check_lost(&self.state) {
            return self.fence_failed(reason);
        }
        Error::Lease(LeaseError::FenceBlocked {
            name: self.state.name.to_string(),
            waited,
            blocking_pid: None,
            on_table: false,
        })
    }

    /// `e` with the lock and the session holding it named, when it is
    /// [`LeaseError::FenceBlocked`]: looked up once the fenced transaction
    /// is gone (its caller dropped it), so that the lookup holds nothing,
    /// and bounded short (`FENCE_LOOKUP`), never waiting behind a lock on
    /// the lease table (see `Statements::fence_blocker`).
    async fn name_blocker(&self, e: Error) -> Error {
        match e {
            Error::Lease(LeaseError::FenceBlocked {
                name,
                waited,
                blocking_pid: None,
                on_table: false,
            }) => {
                let found = self.inner.fence_blocker(&name).await;
                let (on_table, blocking_pid) = found.map_or((false, None), |b| (b.on_table, b.pid));
                Error::Lease(LeaseError::FenceBlocked {
                    name,
                    waited,
                    blocking_pid,
                    on_table,
                })
            }
            e => e,
        }
    }

    fn fence_failed(&self, reason: LostReason) -> Error {
        // The term is over: the lost signal says so too (once).
        self.inner.mark_lost(&self.state, reason);
        tracing::warn!(
            pool = %self.inner.pool_name(),
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

/// A fenced transaction: the transaction [`LeaseHandle::fence`] checked,
/// whose writes commit only under that term. It dereferences to the
/// transaction (run the writes through it); [`Fenced::commit`] is the only
/// way to commit, and dropping it rolls back.
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool, lease: pgwarden::Lease) -> Result<(), pgwarden::Error> {
/// let mut conn = pool.get().await?;
/// let tx = lease.fence(conn.transaction().await?).await?;
/// tx.execute("DELETE FROM sso_requests WHERE expires_at < now()", &[]).await?;
/// tx.commit().await?; // Ok: it landed, under this term
/// # Ok(()) }
/// ```
pub struct Fenced<'a, T: FenceTx + 'a = deadpool_postgres::Transaction<'a>> {
    pub(crate) tx: T,
    pub(crate) lease: LeaseHandle,
    life: PhantomData<&'a ()>,
}

impl Fenced<'_> {
    /// Checks the term again inside the transaction, as
    /// [`LeaseHandle::fence`] did, and moves the transaction's server-side
    /// bound to the term's time left now + 1 s (renewals since the fence
    /// extended the term): for a transaction that must outlive the bound
    /// its fence set. Fails as `fence` does (a
    /// [`LeaseError::FenceBlocked`](crate::LeaseError::FenceBlocked) here
    /// names no pid: the transaction is still open); drop the guard then
    /// (it rolls back).
    pub async fn check(&self) -> Result<(), Error> {
        self.lease.check_in(&self.tx).await
    }
}

impl<T: FenceTx> Fenced<'_, T> {
    /// Commits, after checking the term once more inside the transaction:
    /// `Ok` only when the transaction committed, under this term.
    ///
    /// PostgreSQL answers `COMMIT` on a failed transaction (one whose
    /// statement failed, whether or not its caller saw the error: a future
    /// dropped by a client timeout after the fence's bound cancelled its
    /// statement, say) with `ROLLBACK`, and tokio-postgres does not tell
    /// the two apart. The check before the commit fails on such a
    /// transaction: the commit then reports
    /// [`LeaseError::Aborted`](crate::LeaseError::Aborted) and nothing
    /// lands. A term over by then reports [`LeaseError::Lost`](crate::LeaseError::Lost) and rolls back;
    /// a check blocked by another session's lock on the lease row past the
    /// fence's bound, [`LeaseError::FenceBlocked`](crate::LeaseError::FenceBlocked) (rolled back too);
    /// any other failure (of the check or of `COMMIT` itself, a
    /// serialization failure say) is the database's error.
    pub async fn commit(mut self) -> Result<(), Error> {
        match self.tx.check_in(&self.lease).await {
            Ok(()) => {}
            Err(e @ Error::Lease(LeaseError::FenceBlocked { .. })) => {
                let Fenced { tx, lease, .. } = self;
                drop(tx); // rolled back before the blocker is looked up
                return Err(lease.name_blocker(e).await);
            }
            Err(e) if e.sqlstate() == Some(code::IN_FAILED_SQL_TRANSACTION) => {
                tracing::warn!(
                    pool = %self.lease.inner.pool_name(), lease = %self.lease.state.name,
                    token = self.lease.state.token,
                    "fenced commit refused: the transaction had already failed; nothing was committed"
                );
                return Err(Error::Lease(LeaseError::Aborted {
                    name: self.lease.state.name.to_string(),
                }));
            }
            Err(e) => return Err(e),
        }
        self.tx.commit().await
    }
}

/// Deadpool: the `deadpool_postgres::Transaction`; sqlx: the
/// `PgConnection` (`&mut *tx` is an executor).
impl<T: FenceTx> Deref for Fenced<'_, T> {
    type Target = T::Target;

    fn deref(&self) -> &T::Target {
        self.tx.target()
    }
}

impl<T: FenceTx> DerefMut for Fenced<'_, T> {
    fn deref_mut(&mut self) -> &mut T::Target {
        self.tx.target_mut()
    }
}

impl<T: FenceTx> fmt::Debug for Fenced<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fenced")
            .field("name", &self.lease.state.name)
            .field("token", &self.lease.state.token)
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
///     let tx = lease.fence(conn.transaction().await?).await?; // under this term only
///     tx.execute("DELETE FROM sso_requests WHERE expires_at < now()", &[]).await?;
///     tx.commit().await?;
///     drop(conn);
///     lease.release().await?;
/// }
/// # Ok(()) }
/// ```
pub struct Lease<B: Backend = deadpool_postgres::Pool> {
    pub(crate) handle: LeaseHandle,
    pub(crate) inner: Arc<Inner<B>>,
    pub(crate) id: u64,
    pub(crate) done: bool,
}

impl<B: Backend> Lease<B> {
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
        let (inner, state) = (self.inner.clone(), self.handle.state.clone());
        let r = inner.release(self.id, &state, false).await;
        self.done = true;
        r
    }

    /// Releases, forgetting any hold: the lease is free at once.
    pub(crate) async fn release_now(mut self) -> Result<(), Error> {
        let (inner, state) = (self.inner.clone(), self.handle.state.clone());
        let r = inner.release(self.id, &state, true).await;
        self.done = true;
        r
    }
}

impl<B: Backend> Deref for Lease<B> {
    type Target = LeaseHandle;

    fn deref(&self) -> &LeaseHandle {
        &self.handle
    }
}

impl<B: Backend> Drop for Lease<B> {
    fn drop(&mut self) {
        if !self.done {
            self.inner
                .release_in_background(self.id, self.handle.state.clone());
        }
    }
}

impl<B: Backend> fmt::Debug for Lease<B> {
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

impl<B: Backend> Inner<B> {
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

/// The sessions holding the fence mark of `name`'s current term, when that
/// term ended more than `grace` ago, each ended (`pg_terminate_backend`,
/// waiting up to `grace` for it to go) when this role may.
///
/// A session qualifies when it holds the term's mark (the shared advisory
/// lock `(1885828964, low 32 bits of the token)` that only
/// [`LeaseHandle::fence`] takes, and only for its own term) and its
/// transaction started before the term's end (a fence succeeds only before
/// it; two terms whose tokens are 2^32 apart share a mark, and this keeps a
/// later term's fenced transaction out). Another session holding the row
/// (no mark) is never ended: the take-over answers busy as before.
struct EndFenced<'a> {
    name: &'a str,
    grace: Duration,
}

/// A session [`EndFenced`] found: whether it was ended.
struct FoundFenced {
    pid: i32,
    ended: bool,
    application_name: String,
    role: String,
}

impl LeaseStatement for EndFenced<'_> {
    type Out = Vec<FoundFenced>;
    const WHAT: &'static str = "busy check";
    async fn exec<'a, C: Conn>(
        &'a self,
        sql: &'a Statements,
        client: &'a mut C,
        _call: Call,
    ) -> Result<Vec<FoundFenced>, SqlError> {
        let text = format!(
            "SELECT a.pid,
       CASE WHEN (pg_has_role(a.usesysid, 'MEMBER') OR pg_has_role('pg_signal_backend', 'MEMBER'))
             AND (NOT r.rolsuper OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user))
            THEN pg_terminate_backend(a.pid, $3) ELSE false END,
       coalesce(a.application_name, ''), coalesce(a.usename::text, '')
  FROM {tbl} AS t
  JOIN pg_locks AS m
    ON m.locktype = 'advisory' AND m.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND m.classid = $4::int8::oid AND m.objid = (t.token & 4294967295)::oid AND m.objsubid = 2
   AND m.mode = 'ShareLock' AND m.granted
  JOIN pg_stat_activity AS a ON a.pid = m.pid
  LEFT JOIN pg_roles AS r ON r.oid = a.usesysid
 WHERE t.name = $1 AND t.expires_at < clock_timestamp() - make_interval(secs => $2)
   AND a.pid <> pg_backend_pid()
   AND (a.xact_start IS NULL OR a.xact_start <= t.expires_at)",
            tbl = sql.table
        );
        let grace_ms = i64::try_from(self.grace.as_millis()).unwrap_or(i64::MAX);
        let ns = i64::from(Namespace::PGWARDEN.id());
        let rows = client
            .query(
                &text,
                &[
                    Param::Text(self.name),
                    Param::Float8(self.grace.as_secs_f64()),
                    Param::Int8(grace_ms),
                    Param::Int8(ns),
                ],
                Sent::Unnamed,
            )
            .await?;
        rows.iter()
            .map(|r| {
                Ok(FoundFenced {
                    pid: r.col(0)?,
                    ended: r.col::<Option<bool>>(1)?.unwrap_or(false),
                    application_name: r.col(2)?,
                    role: r.col(3)?,
                })
            })
            .collect()
    }
}

/// A transaction [`LeaseHandle::fence`] takes: `deadpool_postgres::Transaction`,
/// and (features `sqlx-0_8`, `sqlx-0_9`) pgwarden's sqlx `Transaction`
/// (`crate::sqlx`). Public only because `fence` and [`Fenced`] name it as a
/// bound; not reachable from outside the crate (sealed).
#[allow(unreachable_pub)]
pub trait FenceTx: Send {
    /// What a [`Fenced`] guard dereferences to: the transaction itself
    /// (deadpool), or its `PgConnection` (sqlx: `&mut *tx` is an executor).
    type Target: ?Sized;
    /// [`FenceTx::Target`] of it.
    fn target(&self) -> &Self::Target;
    /// [`FenceTx::Target`] of it, mutably.
    fn target_mut(&mut self) -> &mut Self::Target;
    /// The fence check of `lease` inside it ([`LeaseHandle::check_in`] on
    /// its statement-layer view).
    fn check_in<'t>(
        &'t mut self,
        lease: &'t LeaseHandle,
    ) -> impl Future<Output = Result<(), Error>> + Send + 't;
    /// `COMMIT`.
    fn commit(self) -> impl Future<Output = Result<(), Error>> + Send;
}

impl<'a> FenceTx for deadpool_postgres::Transaction<'a> {
    type Target = deadpool_postgres::Transaction<'a>;

    fn target(&self) -> &Self::Target {
        self
    }

    fn target_mut(&mut self) -> &mut Self::Target {
        self
    }

    fn check_in<'t>(
        &'t mut self,
        lease: &'t LeaseHandle,
    ) -> impl Future<Output = Result<(), Error>> + Send + 't {
        lease.check_in(&*self)
    }

    async fn commit(self) -> Result<(), Error> {
        deadpool_postgres::Transaction::commit(self)
            .await
            .map_err(Error::Db)
    }
}
