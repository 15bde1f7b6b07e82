//! Table leases: background exclusivity that holds no connection.
//!
//! A lease is a row of a table (default `public.pgwarden_leases`, see
//! `sql/leases.sql`), taken with one `INSERT … ON CONFLICT … WHERE
//! expires_at < now()` statement, renewed by its holder, released by its
//! holder only. Each statement borrows a connection for that statement only,
//! so a process holding any number of leases holds no connection between
//! statements, and renewals never queue behind request traffic.
//!
//! ```no_run
//! # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
//! use std::time::Duration;
//! use pgwarden::{Job, LeaseOptions, Leases, Scheduler};
//! let leases = Leases::new(&pool); // one per process: it owns the renewer
//! // One attempt (None) or a wait (Some): Ok(None) when another holder has it.
//! if let Some(lease) = leases.acquire("cleanup", &LeaseOptions::default(), None).await? {
//!     // … the work; lease.term().token fences it, lease.lost() warns of a loss
//!     lease.release().await?;
//! }
//! // Or let a scheduler run jobs every period on one instance of the cluster.
//! let scheduler = Scheduler::builder(&leases)
//!     .job(Job::every("alerts", Duration::from_secs(30), |_lease| async {}))
//!     .start()?;
//! scheduler.shutdown(Duration::from_secs(10)).await;
//! # Ok(()) }
//! ```
//!
//! Beyond the plain lease row:
//!
//! - **Fencing tokens.** Every term draws a new token from one sequence: a
//!   later term of a name always has a larger token ([`Term::token`]),
//!   across take-overs, releases and purges, and [`LeaseHandle::fence`] makes
//!   a transaction's writes commit only under the current term.
//! - **A contender never waits.** An attempt on a name held by a live term
//!   is a skip in one round trip, even while the holder sits in a fenced
//!   transaction; the take-over of an expired term waits at most 20 ms for a
//!   lock on its row, then answers busy (counted, and logged with the
//!   session holding it). No lease statement takes an advisory lock, so no
//!   other session can keep a free name busy with one (the fence's mark, in
//!   the holder's own transaction, is a shared try-lock nothing waits on).
//! - **One table whatever the `search_path`.** A table name without a
//!   schema means `public`: instances whose search paths differ share it.
//! - **A lost signal that cannot be silenced.** [`LeaseHandle::lost`] fires
//!   when a renewal finds the lease taken, or at the local deadline (start
//!   of the last successful renewal + TTL − safety margin, monotonic clock),
//!   which falls before anyone else can take it over. The deadline lives in
//!   the lease itself: it fires whatever the renewer does. Transient renewal
//!   errors are retried until then.
//! - **Batched, supervised renewal.** One task per [`Leases`] renews every
//!   lease due in one statement (1,000 leases: one statement per interval;
//!   at most 5,000 leases per statement);
//!   a slow batch holds up no other lease; a panic is caught and counted.
//! - **Bounded statements.** Every statement is bounded end to end; one
//!   that times out is cancelled on the server before its connection closes.
//! - **Holds, schedules, purge.** An at-least-hold ([`LeaseOptions::at_least`]),
//!   a [`Scheduler`] that runs jobs every period on at most one instance (or
//!   once per node), and a purge of old rows.
//! - **Cheap statements.** Prepared once per connection on direct
//!   connections; unnamed behind a transaction pooler (or until the pool
//!   knows it is direct). Acquisitions (and releases) that overlap in one
//!   instance share statements: at most two of each kind are out at a time,
//!   and those that come meanwhile go together in the next, each with its
//!   own answer (see [`Leases::acquire`], "Overlapping acquisitions").
//!
//! # Trade-offs
//!
//! A crashed holder delays the next run by up to its TTL (nobody releases
//! its lease), and a holder frozen or cut off inside a fenced transaction by
//! at most its TTL + 1 s: [`LeaseHandle::fence`] bounds its transaction on
//! the server. A holder cut off from the database for longer than the TTL
//! while another instance reaches it can overlap with the next holder: it
//! learns of it through the lost signal, and by default ([`OnLost::Signal`])
//! its job keeps running, which is fine for idempotent jobs. Use
//! [`OnLost::Cancel`] to stop the job instead, and a fenced transaction for
//! writes a stale holder must never make.
//!
//! # Clocks
//!
//! Every time is the database's (`now()`, `clock_timestamp()`); the local
//! clock only measures intervals (monotonic). Node clocks may drift freely.
//!
//! The safety margin ([`LeaseOptions::safety_margin`], TTL / 8 by default)
//! is how much earlier than the database the holder gives up. It covers the
//! time between the holder's view and the database's: the local deadline is
//! measured from the moment a renewal was *sent*, which is before the
//! database ran it, so the holder always stops trusting the lease at least
//! a margin before the database can let anyone in; and the margin absorbs
//! how late the lost signal reaches a busy job (timer and scheduling
//! delays), and a difference in *rate* between the local monotonic clock and
//! the server's clock (1/8 of a TTL is far beyond any real drift).
//!
//! It does not cover:
//!
//! - **A forward jump of the server's clock.** `now()` jumps, and every
//!   lease's `expires_at` is suddenly that much nearer: a jump of more than
//!   the margin lets another instance take a lease over while its holder
//!   still trusts it (its local deadline is measured on its own monotonic
//!   clock, which did not jump). Both may run the job for a while, until the
//!   old holder's next renewal finds the row taken and fires `lost(Taken)`.
//!   Fenced writes stay safe: a fence checks the term under a row lock, not
//!   the clock. A backward jump only delays take-overs.
//! - **A holder paused longer than the margin** (a stopped process, a long
//!   GC-like stall) between checking its lease and acting on it: it acts
//!   after the deadline. Check [`LeaseHandle::is_lost`] just before acting,
//!   and put writes that must never come from a stale holder under
//!   [`LeaseHandle::fence`].
//!
//! Keep the server clock slewed, not stepped (NTP `slew`/chrony `makestep`
//! only at boot), or make the margin larger than any step you expect.
//!
//! # Files
//!
//! From the top down: each file names and calls items of the files below
//! it only, never of one above (`.ci/layers.py` checks that no files import
//! each other around a circle, and that no two call each other).
//!
//! - `scheduler.rs`: jobs under a lease: [`Leases::run`] (once),
//!   [`Scheduler`] and [`Job`] (every period), one job's loop.
//! - `mod.rs`: this front, [`Leases`] (the lease table of one pool) and
//!   [`LeasesBuilder`] (its settings, and their defaults).
//! - `acquire.rs`: acquire and release: one attempt, the guard it returns
//!   ([`Lease`], [`LeaseHandle`]: term, lost signal, fence), the releases;
//!   `FenceTx`, the transaction a fence takes (per backend).
//! - `gather.rs`: overlapping acquisitions and releases gathered into
//!   shared statements, and each one's answer.
//! - `renewer.rs`: the renewer task, its batches and its purge rounds.
//! - `inner.rs`: the state an instance shares (`Inner`), the leases it holds
//!   (`Registry`), the lost signal it fires, and the statement helper
//!   (`Inner::run`: bounded, cancelled then closed when it runs out of time).
//! - `options.rs`: [`LeaseOptions`] and [`OnLost`], an instance's settings
//!   and their defaults, the rules for names and holder ids.
//! - `table.rs`: the table: its name, the text of every statement and why it
//!   looks the way it does, the calls that run them, install and its shape
//!   check, the operator's rows and revoke.
//! - `term.rs`: one term: [`Term`], its shared state and lost signal, its
//!   timing (renewal, local deadline, back-off).
//! - `metrics.rs`: the metrics and [`LeaseStats`] of an instance.
//! - `backend.rs`: the layer's seam, under everything else of it: what a
//!   backend supplies (`Backend`: whether its connections are known direct,
//!   its pooler detection), the pools a [`Leases`] is made from (`LeasePool`), and the
//!   deadpool side's (sqlx's is in `crate::sqlx`). The rest of the layer is
//!   written once over `B: Backend` (default: the deadpool pool).
//!
//! # On sqlx
//!
//! With feature `sqlx-0_8` or `sqlx-0_9`, [`Leases::new`] and
//! [`Leases::builder`] take a `pgwarden::sqlx::Pool` too (a
//! `Leases<sqlx::PgPool>`): the same statements, renewals, lost signal,
//! scheduler and metrics, and one table a deadpool fleet may share.
//! [`LeaseHandle::fence`] takes the sqlx pool's `Transaction` and the
//! guard dereferences to its `PgConnection` (`&mut *tx` is an executor).
//! Pooler detection is the pool's on either backend: statements are
//! prepared, and a statement cut short cancelled by pid, only on a pool
//! configured or detected direct.

mod acquire;
mod backend;
mod gather;
mod inner;
mod metrics;
mod options;
mod renewer;
mod scheduler;
mod table;
mod term;

pub use crate::lost::LostReason;
#[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
pub(crate) use acquire::FenceTx;
pub use acquire::{Fenced, Lease, LeaseHandle};
pub(crate) use backend::{Backend, LeasePool};
pub use metrics::LeaseStats;
pub use options::{LeaseOptions, OnLost};
pub use scheduler::{Job, JobOutcome, Scheduler, SchedulerBuilder};
pub use table::LeaseRow;
pub use term::Term;

use std::fmt;
use std::ops::Bound;
use std::sync::Arc;
use std::time::{Duration, Instant};

use self::acquire::MAX_POLL;
use self::inner::{Inner, Urgency};
use self::options::{check_name, default_settings, PurgeSettings, Settings};
use self::table::{wait_ms, Busy, ReadRows, Revoke, TableName, DEFAULT_TABLE};
use crate::error::{at_most, in_range, within, Error};

/// The lease table of one pool: acquire, renew (batched, in the background),
/// release, run jobs exclusively.
///
/// Cloning is cheap; clones share one renewer. Create one per table when
/// the process starts ([`Leases::new`] for the default table, or
/// [`Leases::builder`]) and keep it: each instance has its own renewer
/// task and metrics registration.
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
/// use std::time::Duration;
/// let leases = pgwarden::Leases::builder(&pool).table("app.leases").build()?;
/// leases.install().await?;
/// let opts = pgwarden::LeaseOptions::new(Duration::from_secs(120));
/// let ran = leases
///     .run("cleanup", &opts, |lease| async move {
///         // … the hourly clean-up; lease.lost() fires if the lease is lost
///         lease.term().token
///     })
///     .await?;
/// if ran.is_none() {
///     // another instance holds "cleanup": skip this round
/// }
/// # Ok(()) }
/// ```
pub struct Leases<B: Backend = deadpool_postgres::Pool> {
    pub(crate) inner: Arc<Inner<B>>,
}

impl<B: Backend> Clone for Leases<B> {
    fn clone(&self) -> Self {
        Leases {
            inner: self.inner.clone(),
        }
    }
}

impl<B: Backend> Leases<B> {
    /// The default lease table of `pool`, `public.pgwarden_leases` (created
    /// at first use), with every setting at its
    /// default (see [`LeasesBuilder`]). `pool` is a [`Pool`](crate::Pool),
    /// or (features `sqlx-0_8`, `sqlx-0_9`) a `pgwarden::sqlx::Pool`.
    ///
    /// ```no_run
    /// # fn demo(pool: pgwarden::Pool) {
    /// let leases = pgwarden::Leases::new(&pool); // keep it: one per process
    /// # let _ = leases;
    /// # }
    /// ```
    pub fn new<P: LeasePool<Backend = B>>(pool: &P) -> Leases<B> {
        Leases::from_parts(pool.pool(), default_settings())
    }

    fn from_parts(pool: B::Pool, settings: Settings) -> Leases<B> {
        let name = pool.shared().name.clone();
        let inner = Arc::new(Inner::new(pool, &name, settings));
        inner.supervise_renewer();
        Leases { inner }
    }

    /// The DDL [`Leases::install`] runs: `sql/leases.sql` with this table's
    /// names, for migrations that own the schema
    /// ([`LeasesBuilder::auto_install`](super::LeasesBuilder::auto_install)`(false)`).
    ///
    /// ```no_run
    /// # fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
    /// let leases = pgwarden::Leases::builder(&pool).table("app.leases").build()?;
    /// std::fs::write("migrations/0042_leases.sql", leases.ddl()).ok();
    /// # Ok(()) }
    /// ```
    pub fn ddl(&self) -> String {
        self.inner.table.ddl()
    }

    /// Creates the lease table and its token sequence when they do not both
    /// exist, inside a transaction holding the transaction-scoped advisory
    /// lock `Namespace::PGWARDEN.named("leases.install")` (the pair
    /// `(1885828964, 594100531)`, in pgwarden's own key space), so instances
    /// starting together do not race; then checks the shape of what exists.
    /// The schema must exist. Returns true when it ran the DDL.
    ///
    /// A table (or sequence) of another shape fails with
    /// [`LeaseError::TableMismatch`](crate::LeaseError::TableMismatch), naming each difference: a missing or
    /// mistyped column, the primary key (it must be `(name)`), the token
    /// sequence (a `bigint` sequence named after the table). With
    /// `auto_install` on (the default) the first acquisition runs this.
    ///
    /// A table made by pgwarden 0.1 lacks the `renewed_at` column (each
    /// term's TTL, stored for readers: [`LeaseRow::ttl`]): the install adds
    /// it (`ALTER TABLE … ADD COLUMN IF NOT EXISTS`, under the same lock,
    /// waiting at most 200 ms for the table's lock). When it cannot (the
    /// role does not own the table, a read-only session, the table busy),
    /// it logs a warning naming the statement to run, and leases work
    /// without the column; so does an instance that never installs. Rows
    /// written without it read as `ttl: None`.
    ///
    /// ```no_run
    /// # async fn demo(leases: pgwarden::Leases) -> Result<(), pgwarden::Error> {
    /// // At start-up: fail early on a table of another shape.
    /// let created = leases.install().await?;
    /// # let _ = created;
    /// # Ok(()) }
    /// ```
    pub async fn install(&self) -> Result<bool, Error> {
        self.inner.install().await
    }

    /// Takes `name` under `opts`, the one way to acquire a lease. A name is
    /// 1 to 128 bytes of UTF-8 without control characters; names are metric
    /// labels only when declared ([`LeasesBuilder::declare`](super::LeasesBuilder::declare)).
    ///
    /// - `wait: None`: one attempt. `Ok(None)` when another term holds the
    ///   name (a skip), in one statement's round trip: the statement never
    ///   waits on a live holder, not even one inside a fenced transaction.
    ///   Also `Ok(None)` when the term is over but another session holds a
    ///   lock on its row for more than 20 ms (a fenced transaction of the
    ///   expired term, or any session that can write the table): counted in
    ///   [`LeaseStats::takeovers_blocked`] and the metric
    ///   `pgwarden_lease_takeovers_blocked_total`, and logged with the pid of
    ///   the session holding the row.
    /// - `wait: Some(d)`: waits up to `d` for the holder to release the
    ///   lease or let it expire (polling when the database says it may be
    ///   free, at least every 500 ms; 500 ms after a blocked take-over);
    ///   `Ok(None)` if it is still held then.
    ///
    /// Renewal (every TTL / 4 by default) starts at once. Errors are the
    /// options' validation ([`Error::Invalid`]), a statement timeout
    /// ([`LeaseError::Timeout`](crate::LeaseError::Timeout)), a table of another shape
    /// ([`LeaseError::TableMismatch`](crate::LeaseError::TableMismatch)) or the database's.
    ///
    /// Cancellation: a future dropped after its statement went out leaves
    /// the statement to end on the server: it is cancelled there where a
    /// cancel can reach it (a connection known to be direct:
    /// `pg_cancel_backend`, sent on another connection of the pool, so with
    /// the pool's own TLS), its connection waits for its end, and if it
    /// took the lease, the lease is released then, in the background, never
    /// before the statement has ended. The
    /// same holds for an acquisition answered by a batch while its future
    /// was not polled, then dropped. A statement that runs out of time is
    /// cancelled the same way, and its connection waits for its end (up to
    /// its server-side bound, the statement timeout) before the release
    /// that follows. So does a statement whose answer never came (its
    /// connection reset or closed after the statement went out: an error
    /// without a SQLSTATE, returned to the caller; a gathered acquisition
    /// answers [`LeaseError::Timeout`](crate::LeaseError::Timeout) then):
    /// the statement may have committed, and what it took is released by
    /// holder once its server-side bound (the statement timeout, plus a
    /// second) has passed.
    ///
    /// Isolation: the lease statements behave the same at every default
    /// isolation level of the database (`default_transaction_isolation`):
    /// one that loses a race under `repeatable read` or `serializable`
    /// (40001; it committed nothing) is sent again within its bound, and
    /// answers as at `read committed` (busy, say).
    ///
    /// # Overlapping acquisitions
    ///
    /// One instance sends at most two acquisition statements at a time. The
    /// acquisitions that come meanwhile wait together and go to the server
    /// in one statement (up to 64 names) as soon as one of the two ends; each
    /// gets the answer its own statement would have given, and a batch that
    /// fails on the server (a take-over blocked by a row lock, say: a
    /// batch's lock waits are bounded to 100 ms) is tried again one
    /// acquisition per statement. Callers of one name waiting at once
    /// share one attempt: the first gets the lease if the batch took it,
    /// the others busy (what their own statements would have answered). A
    /// call that finds no batch within 100 ms
    /// (or twice the statements' recent time on a slow link, up to 1 s: the
    /// two statements out are stuck on a lock or a slow server) sends its
    /// own statement, as without gathering. Each still answers within the
    /// statement timeout. Releases are gathered the same way. [`LeaseStats::acquisitions_waiting`] and
    /// [`LeaseStats::gathered`] show it happening.
    ///
    /// ```no_run
    /// # async fn demo(leases: pgwarden::Leases) -> Result<(), pgwarden::Error> {
    /// use std::time::Duration;
    /// use pgwarden::LeaseOptions;
    /// // One attempt: skip this round when another instance has it.
    /// if let Some(lease) = leases.acquire("cleanup", &LeaseOptions::default(), None).await? {
    ///     // … the work; lease.lost() fires if the lease is lost
    ///     lease.release().await?;
    /// }
    /// // Wait up to 5 s for a lease of 30 s.
    /// let opts = LeaseOptions::new(Duration::from_secs(30));
    /// match leases.acquire("migrate", &opts, Some(Duration::from_secs(5))).await? {
    ///     Some(lease) => lease.release().await?,
    ///     None => eprintln!("another instance kept \"migrate\" for 5 s"),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn acquire(
        &self,
        name: &str,
        opts: &LeaseOptions,
        wait: Option<Duration>,
    ) -> Result<Option<Lease<B>>, Error> {
        let start = Instant::now();
        let wait = wait.unwrap_or(Duration::ZERO);
        loop {
            let busy = match self.inner.attempt(name, opts).await? {
                Ok(lease) => return Ok(Some(lease)),
                Err(busy) => busy,
            };
            let left = wait.saturating_sub(start.elapsed());
            if left.is_zero() {
                self.inner.metrics.skipped(name);
                return Ok(None);
            }
            let retry_in = match busy {
                Busy::Held => self.inner.free_in(name).await?,
                // Expired, its row locked: ask again a little later.
                Busy::Blocked => MAX_POLL,
            };
            let left = wait.saturating_sub(start.elapsed());
            let pause = retry_in
                .clamp(Duration::from_millis(10), MAX_POLL)
                .min(left);
            tokio::time::sleep(pause).await;
        }
    }

    /// Releases every lease this instance still holds (graceful shutdown):
    /// their guards fire `lost(Released)` and become inert. Returns how many
    /// rows were released; the first error is returned after trying all.
    ///
    /// ```no_run
    /// # async fn demo(leases: pgwarden::Leases) -> Result<(), pgwarden::Error> {
    /// // on SIGTERM, after the scheduler's shutdown:
    /// let released = leases.release_all().await?;
    /// # let _ = released;
    /// # Ok(()) }
    /// ```
    pub async fn release_all(&self) -> Result<usize, Error> {
        let mut released = 0;
        let mut first_err = None;
        for (id, state) in self.inner.held() {
            // Claim it first: a guard released concurrently keeps its own.
            if !self.inner.unregister(id) {
                continue;
            }
            state.lose(LostReason::Released);
            match self.inner.release_row(&state, false).await {
                Ok(()) => released += 1,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(released),
        }
    }

    /// What this instance has done so far.
    pub fn stats(&self) -> LeaseStats {
        let held = self.inner.registry.lock().len();
        let acquisitions_waiting = self.inner.waiting();
        LeaseStats {
            held,
            acquisitions_waiting,
            ..*self.inner.stats.lock()
        }
    }

    /// Every row of the lease table, by name, each with the backend holding
    /// a row lock on it, if any ([`LeaseRow::blocker_pid`]): a fenced
    /// transaction left open (a frozen or cut-off holder) blocks the
    /// take-over of an expired term until it ends.
    ///
    /// Reads only, and locks nothing a lease statement could wait for: one
    /// statement, no transaction, no row lock. The blocker is the running
    /// transaction named by the row's `xmax`, found in `pg_locks` (which
    /// every role can read; `application_name` and state come from
    /// `pg_stat_activity`, where a role without `pg_monitor` sees other
    /// roles' state as `None`). A row locked by several transactions at
    /// once (two fenced transactions of one term, say) names none of them.
    /// Works from a read-only session and on a hot standby; there no
    /// blocker is shown, since row locks live on the primary. A listing
    /// stopped half-way (a frozen process, a slow link) holds up nobody by
    /// itself: it keeps only the table's `ACCESS SHARE` lock, until the
    /// server sees the link gone (`tcp_keepalives_*`, `tcp_user_timeout`).
    /// DDL on the table in that time (`VACUUM FULL`, `ALTER TABLE`) queues
    /// behind it, and every lease statement behind the DDL.
    pub async fn rows(&self) -> Result<Vec<LeaseRow>, Error> {
        let inner = &self.inner;
        inner
            .run(Urgency::Normal, inner.statement_timeout, &ReadRows)
            .await
    }

    /// Ends the current term of `name` by hand (an operator's last resort):
    /// the row is marked released, so its holder's
    /// [`fence`](super::LeaseHandle::fence) is refused from now on and its
    /// [`lost`](super::LeaseHandle::lost) signal fires at its next renewal
    /// ([`LostReason::Revoked`]). The term's expiry is kept: nobody takes the
    /// name before the revoked holder must have stopped trusting it (its
    /// renewal fails, and its local deadline falls before that expiry), so
    /// a revoke never starts a second holder while the first still runs.
    /// An at-least hold (`held_until`) still running is kept too.
    ///
    /// Returns the row as it was (old holder and token), or `None` when
    /// there is no row or no holder (already released). It does not wait
    /// on a fenced transaction.
    pub async fn revoke(&self, name: &str) -> Result<Option<LeaseRow>, Error> {
        check_name(name)?;
        let inner = &self.inner;
        inner
            .run(
                Urgency::Urgent,
                inner.statement_timeout,
                &Revoke {
                    name,
                    wait_ms: wait_ms(inner.statement_timeout),
                },
            )
            .await
    }
}

impl<B: Backend> fmt::Debug for Leases<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leases")
            .field("pool", &self.inner.pool_name)
            .field("table", &self.inner.table)
            .field("stats", &self.stats())
            .finish()
    }
}

/// The shortest purge interval accepted: 10 ms.
pub(crate) const MIN_PURGE_INTERVAL: Duration = Duration::from_millis(10);

/// Builds a [`Leases`]. Every setting has a default.
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
/// use std::time::Duration;
/// let leases = pgwarden::Leases::builder(&pool)
///     .table("app.leases")
///     .auto_install(false) // migrations create it: see Leases::ddl
///     .declare(["cleanup", "report"])
///     .purge(Duration::from_secs(3600), Some(Duration::from_secs(300)))
///     .build()?;
/// # let _ = leases;
/// # Ok(()) }
/// ```
#[must_use = "builder does nothing until .build()"]
#[derive(Debug)]
pub struct LeasesBuilder<B: Backend = deadpool_postgres::Pool> {
    pool: B::Pool,
    table: String,
    statement_timeout: Duration,
    auto_install: bool,
    purge: PurgeSettings,
    declared: Vec<String>,
}

impl<B: Backend> LeasesBuilder<B> {
    /// The lease table: `table` or `schema.table`, each part of
    /// `[A-Za-z0-9_]` not starting with a digit, the table part at most 53
    /// bytes (its sequence adds `_token_seq`; PostgreSQL's identifiers stop
    /// at 63), the schema at most 63. Quotes, spaces and other characters
    /// are refused. A name without a schema is in `public`, whatever the
    /// session's `search_path` (so that instances whose search paths differ
    /// use one table). Default: `public.pgwarden_leases`.
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = name.into();
        self
    }

    /// The longest a lease statement may take, checkout included, before it
    /// fails with [`LeaseError::Timeout`](crate::LeaseError::Timeout). The bound holds on the server too:
    /// each statement sets its own transaction's `lock_timeout` to what is
    /// left of it, so the server ends a wait on a row lock by itself, even
    /// when the client is gone; on a connection known to be direct a cancel
    /// request is sent as well. Its connection is then closed. Renewals are
    /// bounded by the local deadline as well.
    /// More than zero, at most 24 h. Default: 10 s.
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// Create the table (and its sequence) at the first acquisition when it
    /// does not exist, as [`Leases::install`] does. Turn off when migrations
    /// own the schema. Default: true.
    pub fn auto_install(mut self, on: bool) -> Self {
        self.auto_install = on;
        self
    }

    /// Declares lease names up front: each becomes a value of the `lease`
    /// label of the lease metrics. Every name not declared (here or as a
    /// [`Scheduler`] job) counts under the label value
    /// `_other`, so that names made at run time (per user, per tenant)
    /// cannot grow the metrics without bound. Names are 1 to 128 bytes of
    /// UTF-8 without control characters. Default: none.
    pub fn declare<I, S>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.declared.extend(names.into_iter().map(Into::into));
        self
    }

    /// Old rows: the renewer deletes, one round per `every` (10 ms to 366
    /// days), the rows released (their hold, if any, over) and the rows
    /// expired for longer than their TTL plus `after` (0 to 366 days);
    /// `None` turns the purge off on this instance (the rows then stay, one
    /// per name ever used, unless another instance purges). Default:
    /// `after` 60 s, `every` 5 s. A released row says nothing the next term
    /// will not, so it goes at once; an expired one is a holder that
    /// stopped renewing (a crash, a frozen process), which `pgwarden check`
    /// reports once it has been expired for its TTL, so it stays that long
    /// and `after` more (a row written without its TTL, by an older
    /// pgwarden, for `after`). The table holds the live leases, what was
    /// released within about 2 × `every`, and what expired within the last
    /// TTL + `after` + 2 × `every`, whatever the rate of new names: a round
    /// deletes every row it may, in statements of 500 rows.
    ///
    /// A purged name starts again with a new row, and its tokens still grow.
    /// A round first marks: it reads the token sequence's last value and
    /// which sessions hold the table's `ROW EXCLUSIVE` lock (from
    /// `pg_locks`: every lease statement in flight holds it from before it
    /// draws its token). The next round deletes only rows whose token is at
    /// most the mark's, and only once every session of the mark has ended
    /// its transaction: no acquisition that drew a smaller token can still
    /// land a new row after them. The purge takes no table lock and never
    /// waits for a row lock (locked rows are skipped, kept for the next
    /// round): no lease statement of any instance waits for it (an
    /// acquisition of a name whose old row a sweep holds at that instant
    /// answers busy, as for any row lock; a waiting caller tries again). A session
    /// that keeps the table's `ROW EXCLUSIVE` lock across rounds (a
    /// transaction left open after writing to the table, a stopped backend)
    /// holds the purge back, never a lease: counted in
    /// [`LeaseStats::purges_waited`] and logged with its pid. A transaction
    /// that has ended but not yet released its locks (for a moment
    /// `pg_locks` shows it under its backend's id and the local id 0) is
    /// not waited for: the same id is what that backend's locks show under
    /// while it is idle, a session advisory lock on that pooled connection
    /// for one, which would hold the purge back for as long as it is held.
    pub fn purge(mut self, after: Duration, every: Option<Duration>) -> Self {
        self.purge.age = after;
        self.purge.auto = every.is_some();
        if let Some(every) = every {
            self.purge.every = every;
        }
        self
    }

    /// Validates the settings.
    pub fn build(self) -> Result<Leases<B>, Error> {
        let table = TableName::parse(&self.table)?;
        let p = self.purge;
        {
            at_most("lease purge age", p.age, term::MAX_HOLD)?;
            within(
                "lease purge interval",
                p.every,
                MIN_PURGE_INTERVAL,
                term::MAX_HOLD,
            )?;
        }
        for name in &self.declared {
            check_name(name)?;
        }
        in_range(
            "lease statement timeout",
            self.statement_timeout,
            Bound::Excluded(Duration::ZERO),
            Bound::Included(term::MAX_TTL),
        )?;
        let settings = Settings {
            table,
            statement_timeout: self.statement_timeout,
            auto_install: self.auto_install,
            purge: self.purge,
            declared: self.declared,
        };
        Ok(Leases::from_parts(self.pool, settings))
    }
}

impl<B: Backend> Leases<B> {
    /// Starts a builder: table name, statement timeout, auto-install,
    /// purge, declared names. See [`LeasesBuilder`].
    pub fn builder<P: LeasePool<Backend = B>>(pool: &P) -> LeasesBuilder<B> {
        let d = default_settings();
        LeasesBuilder {
            pool: pool.pool(),
            table: DEFAULT_TABLE.to_owned(),
            statement_timeout: d.statement_timeout,
            auto_install: d.auto_install,
            purge: d.purge,
            declared: d.declared,
        }
    }
}
