//! The state one [`Leases`](super::Leases) instance shares with its
//! guards and its renewer ([`Inner`]), the leases it holds ([`Registry`]),
//! the lost signal it fires, and the one way a lease statement reaches the
//! database ([`Inner::run`], and the release that follows a cancelled
//! acquisition). Its other methods live with what they do: acquisitions and
//! releases in `acquire.rs`, their gathering into shared statements in
//! `gather.rs` (whose queues, [`Gather`], are kept here), renewal and purge
//! in `renewer.rs`.
//!
//! # Statements
//!
//! Checkout, statement, and the bound around both; a statement that does not
//! finish in time (or whose future is dropped) is cancelled on the server
//! (`pg_cancel_backend` on another connection of the pool: the pool's own
//! TLS and path), so no backend goes on waiting, for a row lock say, after
//! its client gave up; what follows it (an acquisition's release by holder)
//! runs only once the statement has ended, seen on its own connection. A
//! lease statement that lost a race under snapshot isolation (40001) is
//! sent again within its bound. Named prepared statements on direct
//! connections, unnamed ones behind a transaction pooler (or before the
//! pool knows which it is).
//!
//! # Registry
//!
//! The leases an instance holds, as its renewer sees them: [`Registry`],
//! one [`Entry`] per lease, and the [`Item`]s of a renewal batch.

use std::collections::HashMap;
use std::future::Future;
use std::panic::Location;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{oneshot, Notify, OnceCell};

use super::backend::{Backend, LeasePool};
use super::metrics::{LeaseMetrics, LeaseStats};
use super::options::{PurgeSettings, Settings};
use super::table::{
    Busy, Call, DbTerm, FenceBlock, FenceBlocker, LeaseStatement, PurgeMark, Release, Statements,
    TableName, Taken, TermNow, FENCE_LOOKUP, FENCE_TERM_LOOKUP,
};
use super::term::{LeaseState, Timing};
use crate::admission::{Lane, Priority};
use crate::error::{Error, LeaseError};
use crate::lost::LostReason;
use crate::pool::Client as Checkout;
use crate::stmt::{code, Exec, Param, Row, Sent};

pub(crate) struct Inner<B: Backend = deadpool_postgres::Pool> {
    pub(crate) pool: B::Pool,
    pub(crate) pool_name: Arc<str>,
    pub(crate) table: TableName,
    pub(crate) sql: Statements,
    pub(crate) auto_install: bool,
    pub(crate) installed: OnceCell<()>,
    pub(crate) statement_timeout: Duration,
    pub(crate) purge: PurgeSettings,
    pub(crate) registry: Mutex<Registry>,
    /// Acquisition statements in flight, and acquisitions gathered for the
    /// next one.
    pub(crate) acquiring: Mutex<Gather<Acquiring<B>>>,
    /// The same for releases.
    pub(crate) releasing: Mutex<Gather<Releasing>>,
    pub(crate) wake: Arc<Notify>,
    /// True while a renewer task exists; its task clears it when dropped
    /// (it ended, or its runtime is gone).
    pub(crate) renewer_alive: Arc<AtomicBool>,
    /// Set once the server refused a named prepared statement.
    pub(crate) unnamed_only: AtomicBool,
    /// The pool's pooler mode, as configured and as detection finds it,
    /// kept from the start: read before every statement without the two
    /// lookups in the pool's extensions under their lock (1k client
    /// instructions a lone lease pair).
    pooler: crate::pooler::Watch,
    /// Set once the table is known to lack the `renewed_at` column (its
    /// install could not add it, or a statement met its absence).
    pub(crate) unstamped: AtomicBool,
    pub(crate) detect_started: AtomicBool,
    /// Counts, updated under one lock so a snapshot is consistent.
    pub(crate) stats: Mutex<LeaseStats>,
    pub(crate) metrics: LeaseMetrics,
    /// When this instance was made: the origin of `blocked_logged`.
    pub(crate) created: Instant,
    /// When a blocked take-over was last logged (since `created`).
    pub(crate) blocked_logged: Mutex<Option<Duration>>,
    /// The purge's mark still to sweep, and when it was taken.
    pub(crate) purge_mark: Mutex<Option<(PurgeMark, Instant)>>,
    /// When a purge that waits was last logged (since `created`).
    pub(crate) purge_wait_logged: Mutex<Option<Duration>>,
}

impl<B: Backend> Drop for Inner<B> {
    fn drop(&mut self) {
        // Lets the renewer task see that its instance is gone, and end.
        self.wake.notify_one();
    }
}

impl<B: Backend> Inner<B> {
    pub(crate) fn new(pool: B::Pool, pool_name: &str, s: Settings) -> Inner<B> {
        let metrics = LeaseMetrics::register(pool_name);
        for name in &s.declared {
            metrics.declare(name, name);
        }
        Inner {
            pooler: crate::pooler::Watch::of(&pool.shared().ext),
            pool,
            pool_name: pool_name.into(),
            sql: Statements::new(&s.table, s.statement_timeout),
            table: s.table,
            auto_install: s.auto_install,
            installed: OnceCell::new(),
            statement_timeout: s.statement_timeout,
            purge: s.purge,
            registry: Mutex::new(Registry::default()),
            acquiring: Mutex::new(Gather::default()),
            releasing: Mutex::new(Gather::default()),
            wake: Arc::new(Notify::new()),
            renewer_alive: Arc::new(AtomicBool::new(false)),
            unnamed_only: AtomicBool::new(false),
            unstamped: AtomicBool::new(false),
            detect_started: AtomicBool::new(false),
            stats: Mutex::new(LeaseStats::default()),
            metrics,
            created: Instant::now(),
            blocked_logged: Mutex::new(None),
            purge_mark: Mutex::new(None),
            purge_wait_logged: Mutex::new(None),
        }
    }

    pub(crate) fn pool(&self) -> B::Pool {
        self.pool.clone()
    }

    pub(crate) fn count_statement(&self) {
        self.stats.lock().statements += 1;
    }
    /// Fires the lost signal of a lease: logged and counted once.
    pub(crate) fn mark_lost(&self, state: &LeaseState, reason: LostReason) {
        if !state.lose(reason) {
            return;
        }
        self.metrics.lost(&state.name, reason);
        tracing::warn!(
            pool = %self.pool_name,
            lease = %state.name,
            token = state.token,
            reason = reason.as_str(),
            "lease lost: {reason}; a job still running under it may overlap with the next holder"
        );
    }

    /// The lost reason of a lease, firing [`LostReason::Deadline`] first if
    /// its local deadline has passed.
    pub(crate) fn check_lost(&self, state: &LeaseState) -> Option<LostReason> {
        if let Some(r) = state.lost_reason() {
            return Some(r);
        }
        if state.past_deadline(Instant::now()) {
            self.mark_lost(state, LostReason::Deadline);
        }
        state.lost_reason()
    }
}

/// What a [`LeaseHandle`](super::LeaseHandle) needs of its instance,
/// whatever the backend: the lost signal, the statements' texts (the fence
/// check), the pool's name for logs.
pub(crate) trait Owner: Send + Sync + 'static {
    /// [`Inner::check_lost`].
    fn check_lost(&self, state: &LeaseState) -> Option<LostReason>;
    /// [`Inner::mark_lost`].
    fn mark_lost(&self, state: &LeaseState, reason: LostReason);
    /// [`Inner::count_statement`].
    fn count_statement(&self);
    /// The statements' texts.
    fn sql(&self) -> &Statements;
    /// The pool's name.
    fn pool_name(&self) -> &str;
    /// What kept a fence of `name` waiting, when the server can tell:
    /// whether it is a lock on the lease table (else on its row), and the
    /// session holding it (see `Statements::fence_blocker`). A lease
    /// statement of its own, asked once the blocked fence's transaction is
    /// gone, bounded by [`FENCE_LOOKUP`]: it reads `pg_locks` first and the
    /// table only when no session holds a lock on the table that would
    /// keep that read waiting.
    fn fence_blocker<'a>(
        &'a self,
        name: &'a str,
    ) -> Pin<Box<dyn Future<Output = Option<FenceBlock>> + Send + 'a>>;
    /// `name`'s term as the database has it now: holder, token, seconds
    /// left (see `Statements::term_now`). A lease statement of its own, for
    /// a fence whose transaction reads an old snapshot, bounded by
    /// [`FENCE_TERM_LOOKUP`] (the fenced transaction waits meanwhile, under
    /// a bound of the grace alone).
    fn term_now<'a>(
        &'a self,
        name: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<Option<DbTerm>, Error>> + Send + 'a>>;
}

impl<B: Backend> Owner for Inner<B> {
    fn check_lost(&self, state: &LeaseState) -> Option<LostReason> {
        Inner::check_lost(self, state)
    }
    fn mark_lost(&self, state: &LeaseState, reason: LostReason) {
        Inner::mark_lost(self, state, reason)
    }
    fn count_statement(&self) {
        Inner::count_statement(self)
    }
    fn sql(&self) -> &Statements {
        &self.sql
    }
    fn pool_name(&self) -> &str {
        &self.pool_name
    }
    fn fence_blocker<'a>(
        &'a self,
        name: &'a str,
    ) -> Pin<Box<dyn Future<Output = Option<FenceBlock>> + Send + 'a>> {
        Box::pin(async move {
            let budget = self.statement_timeout.min(FENCE_LOOKUP);
            let found = self
                .run(Urgency::Normal, budget, &FenceBlocker { name })
                .await;
            found.ok().flatten()
        })
    }
    fn term_now<'a>(
        &'a self,
        name: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<Option<DbTerm>, Error>> + Send + 'a>> {
        Box::pin(async move {
            // Urgent: a fenced transaction waits on it, under a bound
            // that may be the grace alone (and an acquisition never holds
            // the lease lane's last slot, which this may need: the fenced
            // transaction holds a connection of the same pool).
            let budget = self.statement_timeout.min(FENCE_TERM_LOOKUP);
            self.run(Urgency::Urgent, budget, &TermNow { name }).await
        })
    }
}

/// The leases an instance holds, by registration id.
#[derive(Default)]
pub(crate) struct Registry {
    pub(super) next_id: u64,
    pub(super) entries: HashMap<u64, Entry>,
    /// When the renewer plans to wake next (`None`: it waits for a
    /// registration). A registration wakes it only when it is due sooner.
    pub(super) next_wake: Option<Instant>,
    /// When the next purge is due (set at the renewer's first tick).
    pub(super) next_purge: Option<Instant>,
    /// A purge is running.
    pub(super) purging: bool,
}

pub(super) struct Entry {
    pub(super) state: Arc<LeaseState>,
    pub(super) timing: Timing,
    pub(super) due: Instant,
    pub(super) attempt: u32,
    /// Part of a batch in flight.
    pub(super) in_flight: bool,
}

/// One lease of a batch.
pub(super) struct Item {
    pub(super) id: u64,
    pub(super) state: Arc<LeaseState>,
    pub(super) ttl: f64,
}

impl Registry {
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

/// Acquisitions (or releases) of one instance gathered into shared
/// statements (see `gather.rs`): how many statements are out, who waits
/// for the next, and how long they have taken lately.
pub(crate) struct Gather<W> {
    pub(super) in_flight: usize,
    pub(super) waiting: Vec<W>,
    /// The statements' recent time, from checkout to answer (`None` before
    /// the first): it falls fast and rises slowly, so it follows the
    /// round trip and the server's pace, not the odd statement stuck on a
    /// lock.
    pub(super) recent: Option<Duration>,
}

impl<W> Default for Gather<W> {
    fn default() -> Gather<W> {
        Gather {
            in_flight: 0,
            waiting: Vec::new(),
            recent: None,
        }
    }
}

impl<W> Gather<W> {
    /// Folds one statement's time into the recent time: down by half the
    /// gap, up by an eighth.
    pub(super) fn observe(&mut self, took: Duration) {
        self.recent = Some(match self.recent {
            None => took,
            Some(old) if took < old => old - (old - took) / 2,
            Some(old) => old + (took - old) / 8,
        });
    }
}

/// An acquisition waiting for the next batch.
pub(crate) struct Acquiring<B: Backend> {
    pub(super) name: String,
    pub(super) holder: String,
    pub(super) ttl: f64,
    pub(super) hold: Option<(f64, f64)>,
    pub(super) tx: Answer<B>,
    /// Callers of the same name that share this one's attempt (see
    /// `gather.rs`).
    pub(super) followers: Vec<Answer<B>>,
}

/// Where an acquisition's answer goes.
pub(super) type Answer<B> = oneshot::Sender<Joined<Result<Won<B>, Busy>>>;

/// A release waiting for the next batch.
pub(crate) struct Releasing {
    pub(super) name: String,
    pub(super) holder: String,
    pub(super) keep_hold: bool,
    pub(super) tx: oneshot::Sender<Joined<bool>>,
}

/// A term taken for one caller, on its way to it. Dropped before its caller
/// took it ([`Won::take`]): the caller was gone when it was answered, or
/// stopped polling after; the term is then released by holder, in the
/// background (its release never holds up the answers of others).
pub(crate) struct Won<B: Backend> {
    taken: Option<Taken>,
    inner: Arc<Inner<B>>,
    name: String,
    holder: String,
}

impl<B: Backend> Won<B> {
    pub(super) fn new(inner: &Arc<Inner<B>>, name: &str, holder: &str, taken: Taken) -> Won<B> {
        Won {
            taken: Some(taken),
            inner: inner.clone(),
            name: name.to_owned(),
            holder: holder.to_owned(),
        }
    }

    /// The term, now its caller's.
    pub(super) fn take(mut self) -> Taken {
        match self.taken.take() {
            Some(t) => t,
            // Only `take` empties it, and it consumes the `Won`.
            None => unreachable!("a Won is taken once"),
        }
    }
}

impl<B: Backend> Drop for Won<B> {
    fn drop(&mut self) {
        if self.taken.take().is_none() {
            return;
        }
        let (inner, name, holder) = (
            self.inner.clone(),
            std::mem::take(&mut self.name),
            std::mem::take(&mut self.holder),
        );
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    tracing::debug!(pool = %inner.pool_name, lease = %name, "an acquisition's caller gave up after it took the lease: releasing");
                    inner.release_cancelled(&name, &holder).await;
                });
            }
            Err(_) => tracing::warn!(
                pool = %self.inner.pool_name, lease = %name,
                "an acquisition's caller gave up after it took the lease, outside a tokio runtime: it expires after its TTL"
            ),
        }
    }
}

/// What a batch answers one of its own.
pub(super) enum Joined<T> {
    /// What its own statement would have answered.
    Done(T),
    /// The batch failed on the server and did nothing: send your own
    /// statement.
    Alone,
    /// The batch ran out of time.
    TimedOut,
}

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

impl<B: Backend> Inner<B> {
    /// The checkout of every lease statement: one call site, on the pool's
    /// lease lane, where renewals and releases go before acquisitions (and
    /// acquisitions never hold the lane's last slot).
    pub(crate) async fn checkout(
        &self,
        urgency: Urgency,
        timeout: Duration,
    ) -> Result<Checkout<B>, Error> {
        let priority = match urgency {
            Urgency::Urgent => Priority::Urgent,
            Urgency::Normal => Priority::Normal,
        };
        self.pool
            .shared()
            .checkout_inner(
                Lane::Lease,
                priority,
                false,
                Location::caller(),
                timeout,
                std::convert::identity,
            )
            .await
    }

    /// After a cancelled acquisition: releases the lease if the statement
    /// took it before the cancel reached the server.
    pub(crate) async fn release_cancelled(&self, name: &str, holder: &str) {
        let stmt = Release {
            name,
            holder,
            keep_hold: false,
        };
        match self
            .run(Urgency::Urgent, self.statement_timeout, &stmt)
            .await
        {
            Ok(true) => tracing::info!(
                pool = %self.pool_name, lease = name,
                "a cancelled acquisition had taken the lease: released"
            ),
            Ok(false) => {}
            Err(e) => tracing::warn!(
                pool = %self.pool_name, lease = name, error = %e,
                "could not release after a cancelled acquisition; if it took the lease, it expires after its TTL"
            ),
        }
    }

    /// Named prepared statements only on a connection known to be direct,
    /// never again after the server refused one, and only where the
    /// backend keeps them (not on sqlx with its statement cache off).
    pub(crate) fn named(&self) -> bool {
        self.direct() && B::names_statements(&self.pool)
    }

    /// The pool's connections are known to keep their server session, and
    /// the server never refused a named statement (a pooler behind a
    /// direct-looking connection): a statement cut short is cancelled by
    /// its backend pid.
    pub(crate) fn direct(&self) -> bool {
        !self.unnamed_only.load(Ordering::Relaxed) && self.pooler.keeps_sessions()
    }

    /// Runs `stmt` within `budget`, checkout included. See the module docs.
    pub(crate) async fn run<S: LeaseStatement>(
        &self,
        urgency: Urgency,
        budget: Duration,
        stmt: &S,
    ) -> Result<S::Out, Error> {
        self.run_then(urgency, Instant::now(), budget, stmt, || None)
            .await
    }

    /// [`Inner::run`] for a caller that started waiting at `began` (its
    /// budget, and the time its timeout reports, count from then).
    pub(crate) async fn run_since<S: LeaseStatement>(
        &self,
        urgency: Urgency,
        began: Instant,
        budget: Duration,
        stmt: &S,
    ) -> Result<S::Out, Error> {
        self.run_then(urgency, began, budget, stmt, || None).await
    }

    /// [`Inner::run`] from `began`, with `follow_up` run once a statement
    /// cut short (timed out, or its future dropped: its caller gave up) has
    /// ended on the server (see [`InFlight`]: cancelled first on a
    /// connection known to be direct).
    pub(crate) async fn run_then<S, F>(
        &self,
        urgency: Urgency,
        began: Instant,
        budget: Duration,
        stmt: &S,
        follow_up: F,
    ) -> Result<S::Out, Error>
    where
        S: LeaseStatement,
        F: FnOnce() -> Option<FollowUp>,
    {
        let mut named = self.named();
        let mut flight = InFlight {
            inner: self,
            what: S::WHAT,
            transactional: S::TRANSACTIONAL,
            conn: None,
            follow_up: Some(follow_up),
        };
        let mut refused_once = false;
        let mut unstamped_once = false;
        let mut serialization_retries = 0u32;
        loop {
            let left = budget.saturating_sub(began.elapsed());
            let outcome = tokio::time::timeout(left, async {
                let conn = self.checkout(urgency, left).await?;
                self.count_statement();
                let call = Call {
                    // What the checkout taught the pool counts (sqlx: its
                    // statement cache found off).
                    named: named && self.named(),
                    stamped: !self.unstamped.load(Ordering::Relaxed),
                };
                let conn = flight.conn.insert(conn);
                let mut on = conn.exec();
                Ok::<_, Error>(stmt.exec(&self.sql, &mut on, call).await)
            })
            .await;
            match outcome {
                Ok(Ok(Ok(out))) => {
                    flight.conn = None; // back to the pool
                    return Ok(out);
                }
                Ok(Ok(Err(e))) if !refused_once && named && e.refused_prepared() => {
                    refused_once = true;
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
                // A table made by an earlier pgwarden, never installed by
                // this instance (or whose column was dropped): every
                // statement goes without `renewed_at` from now on.
                Ok(Ok(Err(e)))
                    if !unstamped_once
                        && e.is(code::UNDEFINED_COLUMN)
                        && !self.unstamped.load(Ordering::Relaxed) =>
                {
                    unstamped_once = true;
                    flight.conn = None;
                    self.unstamped.store(true, Ordering::Relaxed);
                    tracing::warn!(
                        pool = %self.pool_name, table = %self.table, error = %e,
                        "the lease table has no renewed_at column (made by an earlier pgwarden): \
                         lease statements go without it; readers guess each term's TTL \
                         (Leases::install adds it when the role owns the table)"
                    );
                }
                // A lost race under a database whose default isolation is
                // repeatable read or serializable: the statement (its own
                // transaction) committed nothing. Sent again, it sees the
                // winner's row and answers as it would at read committed
                // (busy, say).
                Ok(Ok(Err(e)))
                    if e.is(code::SERIALIZATION_FAILURE)
                        && budget.saturating_sub(began.elapsed()) > SERIALIZATION_PAUSE_MAX =>
                {
                    flight.conn = None;
                    serialization_retries += 1;
                    tracing::debug!(
                        pool = %self.pool_name, statement = S::WHAT, retries = serialization_retries,
                        "lease statement lost a race under snapshot isolation (40001): sent again"
                    );
                    let pause = SERIALIZATION_PAUSE_MAX.mul_f64(rand::random::<f64>());
                    tokio::time::sleep(pause).await;
                }
                // No answer from the server (the connection failed, or its
                // answer could not be read): the statement may have
                // committed. It ends as a cut-short statement does:
                // cancelled where a cancel reaches it, its connection kept
                // only if it answers, and what it took released by holder.
                Ok(Ok(Err(e))) if e.code().is_none() => {
                    drop(flight);
                    return Err(e.into());
                }
                Ok(Ok(Err(e))) => {
                    flight.conn = None;
                    // Its own lock_timeout: the server ended the wait.
                    if e.is(code::LOCK_NOT_AVAILABLE) {
                        if let Some(out) = S::on_lock_timeout() {
                            return Ok(out);
                        }
                        self.metrics.timed_out(S::WHAT);
                        return Err(Error::Lease(LeaseError::Timeout {
                            what: S::WHAT,
                            waited: began.elapsed(),
                        }));
                    }
                    return Err(e.into());
                }
                // The checkout ran out of the statement's time: the
                // statement's timeout, as documented, and counted.
                Ok(Err(e)) if e.is_timeout() => {
                    self.metrics.timed_out(S::WHAT);
                    return Err(self.no_connection(stmt, began.elapsed()));
                }
                Ok(Err(e)) => return Err(e), // the checkout failed
                Err(_) => {
                    self.metrics.timed_out(S::WHAT);
                    if flight.conn.is_none() {
                        // Still waiting for a connection: nothing was sent.
                        return Err(self.no_connection(stmt, began.elapsed()));
                    }
                    drop(flight); // cancels the statement if it was sent
                    return Err(Error::Lease(LeaseError::Timeout {
                        what: S::WHAT,
                        waited: began.elapsed(),
                    }));
                }
            }
        }
    }
}

/// A statement's error that came without an answer from the server (no
/// SQLSTATE: its connection failed, or the answer could not be read): it
/// may have committed, and `run_then` released what it took by holder.
pub(crate) fn answer_lost(e: &Error) -> bool {
    let statement = match e {
        Error::Db(_) => true,
        #[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
        Error::Sqlx(_) => true,
        _ => false,
    };
    statement && e.sqlstate().is_none()
}

impl<B: Backend> Inner<B> {
    /// `stmt` got no connection within its budget (`waited`): its own
    /// error ([`LeaseStatement::no_connection`]), else [`LeaseError::Timeout`].
    fn no_connection<S: LeaseStatement>(&self, stmt: &S, waited: Duration) -> Error {
        let pool_size = self.pool.shared().status().max;
        let e = stmt
            .no_connection(waited, pool_size)
            .unwrap_or(LeaseError::Timeout {
                what: S::WHAT,
                waited,
            });
        Error::Lease(e)
    }
}

/// The longest pause before a lease statement that lost a race under
/// snapshot isolation (40001) is sent again (a random pause up to this, so
/// that the losers of one race do not meet again at once).
const SERIALIZATION_PAUSE_MAX: Duration = Duration::from_millis(5);

/// Cancels the statement running on backend `pid` with
/// `pg_cancel_backend`, sent on another connection of the pool (its control
/// lane, pgwarden's own statements: the lease lane may be full of the very
/// statements to cancel):
/// it goes the way every connection of the pool goes (its TLS, its
/// network path), unlike a cancel request, which opens a connection of its
/// own (tokio-postgres needs the TLS connector again, which a deadpool pool
/// does not expose). The same role may cancel its own sessions. Bounded by
/// [`CANCEL_TIMEOUT`]; true when the server signalled the backend. Only for
/// a connection known to be direct (behind a pooler the pid is not the
/// backend's).
pub(crate) async fn cancel_backend<B: Backend>(pool: &B::Pool, pid: i32) -> Result<bool, Error> {
    let sent = async {
        let mut conn = pool
            .shared()
            .checkout_inner(
                Lane::Control,
                Priority::Urgent,
                false,
                Location::caller(),
                CANCEL_TIMEOUT,
                std::convert::identity,
            )
            .await?;
        let rows = conn
            .exec()
            .query(
                "SELECT pg_cancel_backend($1)",
                &[Param::Int4(pid)],
                Sent::Unnamed,
            )
            .await?;
        match rows.first() {
            Some(r) => Ok::<bool, Error>(r.col(0)?),
            None => Ok(false),
        }
    };
    match tokio::time::timeout(CANCEL_TIMEOUT, sent).await {
        Ok(r) => r,
        Err(_) => Err(Error::Lease(LeaseError::Timeout {
            what: "cancel",
            waited: CANCEL_TIMEOUT,
        })),
    }
}

/// The connection of a statement in flight. Dropped while it still holds
/// one (a timeout, a dropped future), it cancels the statement on the server
/// (on a connection known to be direct: [`cancel_backend`]), then waits for
/// the statement's end on its own connection (a `SELECT 1` sent behind it
/// answers only once it has ended, bounded by its server-side bound: its
/// `lock_timeout` is at most the statement timeout), and only then runs the
/// follow-up (an acquisition's release by holder): a release that ran while
/// the statement still waited would come before the statement's commit, and
/// leave the lease held until its TTL. A cancel that failed changes
/// nothing but the wait.
///
/// No cancel request goes to a connection not known to be direct: PgBouncer
/// before 1.20 crashes when a cancel request's client closes before
/// PgBouncer has forwarded it (pgbouncer/pgbouncer#801), and a pid seen
/// through a pooler is not the backend's. There the statement's own
/// `lock_timeout` ends its wait on the server, and the `SELECT 1` behind it
/// (kept on the same server connection while the statement's transaction
/// lasts) answers once it has.
struct InFlight<'i, B: Backend, F: FnOnce() -> Option<FollowUp>> {
    inner: &'i Inner<B>,
    what: &'static str,
    /// The statement runs a transaction of its own
    /// ([`LeaseStatement::TRANSACTIONAL`]): its connection is closed once
    /// the statement has ended, never returned.
    transactional: bool,
    conn: Option<Checkout<B>>,
    follow_up: Option<F>,
}

/// How much longer than the statement timeout a cut-short statement may
/// take to end on the server before its connection is closed anyway.
const END_MARGIN: Duration = Duration::from_secs(1);

impl<B: Backend, F: FnOnce() -> Option<FollowUp>> Drop for InFlight<'_, B, F> {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let pool_name = self.inner.pool_name.clone();
        let what = self.what;
        let transactional = self.transactional;
        let pid = conn.pid();
        let follow_up = self.follow_up.take().and_then(|f| f());
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            conn.discard();
            tracing::warn!(
                pool = %pool_name, statement = what, pid,
                "lease statement abandoned outside a tokio runtime: its connection is closed; its lock_timeout ends it on the server"
            );
            return;
        };
        // Known direct by now (detection may have finished meanwhile).
        let direct = self.inner.direct();
        let pool = self.inner.pool();
        let bound = self.inner.statement_timeout + END_MARGIN;
        let dropped = Instant::now();
        rt.spawn(async move {
            if direct {
                match cancel_backend::<B>(&pool, pid).await {
                    Ok(true) => tracing::debug!(pool = %pool_name, statement = what, pid, "lease statement cancelled on the server"),
                    Ok(false) => tracing::debug!(pool = %pool_name, statement = what, pid, "lease statement to cancel had ended"),
                    Err(e) => tracing::warn!(
                        pool = %pool_name, statement = what, pid, error = %e,
                        "cancelling a lease statement failed: waiting for its end on the server (its lock_timeout bounds it)"
                    ),
                }
            }
            let ended = tokio::time::timeout(bound, async {
                let on = conn.exec();
                on.batch("SELECT 1").await
            })
            .await;
            match ended {
                // It has ended: the connection is clean, back to the pool.
                Ok(Ok(_)) if !transactional => drop(conn),
                // Its transaction may still be open (a `BEGIN` cut short).
                Ok(Ok(_)) => conn.discard(),
                Ok(Err(e)) => {
                    tracing::debug!(pool = %pool_name, statement = what, pid, error = %e, "connection of a cut-short lease statement failed: closed");
                    conn.discard();
                    // Nothing proves it has ended: where no cancel reached
                    // it (behind a pooler; a cancel that failed), it may
                    // still wait on the server and commit later. Its
                    // server-side bound passes first.
                    if follow_up.is_some() {
                        tokio::time::sleep(bound.saturating_sub(dropped.elapsed())).await;
                    }
                }
                Err(_) => {
                    tracing::warn!(
                        pool = %pool_name, statement = what, pid,
                        "a cut-short lease statement did not end within {bound:?}: its connection is closed"
                    );
                    conn.discard();
                }
            }
            if let Some(f) = follow_up {
                f.await;
            }
        });
    }
}
