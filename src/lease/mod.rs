//! Table leases: background exclusivity that holds no connection.
//!
//! A lease is a row of a table (default `pgwarden_leases`, see
//! `sql/leases.sql`), taken with one `INSERT … ON CONFLICT … WHERE
//! expires_at < now()` statement, renewed by its holder, released by its
//! holder only. Each statement borrows a connection of the pool's control
//! lane for that statement only, so a process holding any number of leases
//! holds no connection between statements, and renewals never queue behind
//! request traffic. This is seed 000's design, with what it lacked:
//!
//! - **Fencing tokens.** Every take-over draws a new token from one sequence:
//!   a later term always has a larger token ([`LeaseHandle::token`]), and
//!   [`LeaseHandle::fence`] makes a transaction's writes commit only under the
//!   current term.
//! - **A lost signal.** [`LeaseHandle::lost`] fires when a renewal finds the
//!   lease taken, or when no renewal succeeded by the local deadline (start
//!   of the last successful renewal + TTL − safety margin, monotonic clock),
//!   which falls before anyone else can take it over. Transient renewal
//!   errors are retried until then.
//! - **Batched renewal.** One task per [`Leases`] renews every lease due in
//!   one statement: 1,000 leases cost one statement per interval.
//! - **Holds and schedules.** An at-least-hold ([`LeaseOptions::at_least`])
//!   and a [`Scheduler`] that runs jobs every period on exactly one instance,
//!   or once per node.
//!
//! # Trade-offs
//!
//! A crashed holder delays the next run by up to its TTL (nobody releases
//! its lease). A holder cut off from the database for longer than the TTL
//! while another instance reaches it can overlap with the next holder: it
//! learns of it through the lost signal, and by default ([`OnLost::Signal`])
//! its job keeps running, which is fine for idempotent jobs (seed 000's four
//! are). Use [`OnLost::Cancel`] to stop the job instead, and a fenced
//! transaction for writes a stale holder must never make.
//!
//! Every time is the database's (`now()`, `clock_timestamp()`); the local
//! clock only measures intervals (monotonic). Node clocks may drift freely.

use std::fmt;
use std::panic::Location;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use tokio::sync::{Notify, OnceCell};

use crate::budget::Lane;
use crate::error::Error;
use crate::metrics::LeaseMetrics;
use crate::pool::{Conn, Pool, Shared};

mod exclusive;
mod guard;
mod name;
mod options;
mod renewer;
mod scheduler;
mod sql;
mod table;
mod timing;

pub use guard::{Lease, LeaseHandle, LostReason};
pub use name::MAX_NAME_LEN;
pub use options::{LeaseOptions, OnLost, DEFAULT_TTL};
pub use renewer::MAX_BATCH;
pub use scheduler::{Job, JobOutcome, Scheduler, SchedulerBuilder};
pub use sql::INSTALL_LOCK_KEY;
pub use table::{DEFAULT_TABLE, MAX_SCHEMA_LEN, MAX_TABLE_LEN};
pub use timing::{MAX_HOLD, MAX_TTL, MIN_PERIOD, MIN_RENEW_EVERY, MIN_TTL};

use guard::LeaseState;
use sql::{Attempt, Statements};
use table::TableName;

/// The longest a lease statement may take by default (checkout included)
/// before it fails and its connection is closed: 10 s.
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest wait between two attempts of [`Leases::acquire`]: a holder
/// may release early.
const MAX_POLL: Duration = Duration::from_millis(500);

/// The lease table of one pool: acquire, renew (batched, in the background),
/// release, run jobs exclusively.
///
/// Cloning is cheap; clones share one renewer. Create one per table and
/// keep it (or use [`Pool::leases`], the pool's own).
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
/// use std::time::Duration;
/// let leases = pgwarden::Leases::builder(&pool).table("app.leases").build()?;
/// leases.install().await?;
/// let ran = leases
///     .run_exclusive("cleanup", Duration::from_secs(120), |lease| async move {
///         // … the hourly clean-up; lease.lost() fires if the lease is lost
///         lease.token()
///     })
///     .await?;
/// if ran.is_none() {
///     // another instance holds "cleanup": skip this round
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Leases {
    pub(crate) inner: Arc<Inner>,
}

/// What a [`Leases`] instance has done, for logs and tests.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseStats {
    /// Leases held now.
    pub held: usize,
    /// Statements sent: acquisitions, renewals, releases, fences, install.
    pub statements: u64,
    /// Renewal statements sent (each renews a batch).
    pub renewal_statements: u64,
    /// Lease renewals that succeeded, summed over batches.
    pub renewed: u64,
    /// Leases in the last renewal statement that succeeded.
    pub last_batch: usize,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) statements: AtomicU64,
    pub(crate) renewal_statements: AtomicU64,
    pub(crate) renewed: AtomicU64,
    pub(crate) last_batch: AtomicUsize,
}

enum PoolRef {
    Strong(Pool),
    /// The pool's own instance ([`Pool::leases`]) must not keep the pool alive.
    Weak(Weak<Shared>),
}

pub(crate) struct Inner {
    pool: PoolRef,
    pub(crate) pool_name: Arc<str>,
    table: TableName,
    pub(crate) sql: Statements,
    auto_install: bool,
    installed: OnceCell<()>,
    pub(crate) statement_timeout: Duration,
    pub(crate) registry: Mutex<renewer::Registry>,
    pub(crate) wake: Arc<Notify>,
    pub(crate) renewer_started: AtomicBool,
    pub(crate) stats: Counters,
    pub(crate) metrics: LeaseMetrics,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Lets the renewer task see that its instance is gone, and end.
        self.wake.notify_one();
    }
}

/// Builds a [`Leases`]. Every setting has a default.
#[must_use = "builder does nothing until .build()"]
#[derive(Debug)]
pub struct LeasesBuilder {
    pool: Pool,
    table: String,
    statement_timeout: Duration,
    auto_install: bool,
}

impl LeasesBuilder {
    /// The lease table: `table` or `schema.table`, each part of
    /// `[A-Za-z0-9_]` not starting with a digit, the table part at most
    /// [`MAX_TABLE_LEN`] bytes (its sequence adds `_token_seq`). Quotes,
    /// spaces and other characters are refused. Default: [`DEFAULT_TABLE`].
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = name.into();
        self
    }

    /// The longest a lease statement may take, checkout included, before it
    /// fails with [`Error::LeaseTimeout`] and its connection is closed.
    /// Renewals are bounded by the local deadline as well.
    /// Default: [`DEFAULT_STATEMENT_TIMEOUT`] (10 s).
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

    /// Validates the settings.
    pub fn build(self) -> Result<Leases, Error> {
        let table = TableName::parse(&self.table)?;
        if self.statement_timeout.is_zero() || self.statement_timeout > timing::MAX_TTL {
            return Err(Error::invalid(
                "lease statement timeout",
                format!(
                    "{:?} is outside (0, {:?}]",
                    self.statement_timeout,
                    timing::MAX_TTL
                ),
            ));
        }
        Ok(Leases::from_parts(
            PoolRef::Strong(self.pool.clone()),
            &self.pool,
            table,
            self.statement_timeout,
            self.auto_install,
        ))
    }
}

impl Leases {
    /// The default lease table ([`DEFAULT_TABLE`]) of `pool`.
    pub fn new(pool: &Pool) -> Leases {
        Leases::from_parts(
            PoolRef::Strong(pool.clone()),
            pool,
            TableName::default(),
            DEFAULT_STATEMENT_TIMEOUT,
            true,
        )
    }

    /// Starts a builder: table name, statement timeout, auto-install.
    pub fn builder(pool: &Pool) -> LeasesBuilder {
        LeasesBuilder {
            pool: pool.clone(),
            table: DEFAULT_TABLE.to_owned(),
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
            auto_install: true,
        }
    }

    /// The instance [`Pool::leases`] keeps: it does not keep the pool alive.
    pub(crate) fn for_pool(pool: &Pool) -> Leases {
        Leases::from_parts(
            PoolRef::Weak(Arc::downgrade(&pool.shared)),
            pool,
            TableName::default(),
            DEFAULT_STATEMENT_TIMEOUT,
            true,
        )
    }

    fn from_parts(
        pool_ref: PoolRef,
        pool: &Pool,
        table: TableName,
        statement_timeout: Duration,
        auto: bool,
    ) -> Leases {
        Leases {
            inner: Arc::new(Inner {
                pool: pool_ref,
                pool_name: pool.name().into(),
                sql: Statements::new(&table),
                table,
                auto_install: auto,
                installed: OnceCell::new(),
                statement_timeout,
                registry: Mutex::new(renewer::Registry::default()),
                wake: Arc::new(Notify::new()),
                renewer_started: AtomicBool::new(false),
                stats: Counters::default(),
                metrics: LeaseMetrics::register(pool.name()),
            }),
        }
    }

    /// The table, as given (`schema.table` or `table`).
    pub fn table(&self) -> String {
        self.inner.table.to_string()
    }

    /// The DDL [`Leases::install`] runs: `sql/leases.sql` with this table's
    /// names.
    pub fn ddl(&self) -> String {
        self.inner.table.ddl()
    }

    /// Creates the lease table and its token sequence when they do not both
    /// exist, inside a transaction holding the transaction-scoped advisory
    /// lock [`INSTALL_LOCK_KEY`], so instances starting together do not race.
    /// The schema must exist. Returns true when it ran the DDL.
    pub async fn install(&self) -> Result<bool, Error> {
        let inner = &self.inner;
        let mut conn = inner.control(inner.statement_timeout).await?;
        inner.count_statement();
        let ran = inner.sql.install(&mut conn).await?;
        if ran {
            tracing::info!(pool = %inner.pool_name, table = %inner.table, "lease table installed");
        }
        let _ = inner.installed.set(());
        Ok(ran)
    }

    /// Takes `name` for `ttl` if nobody holds it; `None` when another term
    /// holds it (a skip). Renewal every TTL / 4 starts at once.
    pub async fn try_acquire(&self, name: &str, ttl: Duration) -> Result<Option<Lease>, Error> {
        self.try_acquire_with(name, &LeaseOptions::new(ttl)).await
    }

    /// [`Leases::try_acquire`] with every option.
    pub async fn try_acquire_with(
        &self,
        name: &str,
        opts: &LeaseOptions,
    ) -> Result<Option<Lease>, Error> {
        match self.inner.attempt(name, opts).await? {
            Ok(lease) => Ok(Some(lease)),
            Err(_) => {
                self.inner.metrics.skipped(name);
                Ok(None)
            }
        }
    }

    /// Takes `name` for `ttl`, waiting up to `wait` for its holder to release
    /// it or let it expire; [`Error::LeaseBusy`] after that.
    pub async fn acquire(&self, name: &str, ttl: Duration, wait: Duration) -> Result<Lease, Error> {
        self.acquire_with(name, &LeaseOptions::new(ttl), wait).await
    }

    /// [`Leases::acquire`] with every option.
    pub async fn acquire_with(
        &self,
        name: &str,
        opts: &LeaseOptions,
        wait: Duration,
    ) -> Result<Lease, Error> {
        let start = Instant::now();
        loop {
            let retry_in = match self.inner.attempt(name, opts).await? {
                Ok(lease) => return Ok(lease),
                Err(retry_in) => retry_in,
            };
            let left = wait.saturating_sub(start.elapsed());
            if left.is_zero() {
                self.inner.metrics.skipped(name);
                return Err(Error::LeaseBusy {
                    name: name.to_owned(),
                    waited: start.elapsed(),
                });
            }
            let pause = retry_in
                .clamp(Duration::from_millis(10), MAX_POLL)
                .min(left);
            tokio::time::sleep(pause).await;
        }
    }

    /// Releases every lease this instance still holds (graceful shutdown):
    /// their guards fire `lost(Released)` and become inert. Returns how many
    /// rows were released; the first error is returned after trying all.
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
        let s = &self.inner.stats;
        LeaseStats {
            held: self.inner.registry.lock().len(),
            statements: s.statements.load(Ordering::Relaxed),
            renewal_statements: s.renewal_statements.load(Ordering::Relaxed),
            renewed: s.renewed.load(Ordering::Relaxed),
            last_batch: s.last_batch.load(Ordering::Relaxed),
        }
    }
}

impl fmt::Debug for Leases {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leases")
            .field("pool", &self.inner.pool_name)
            .field("table", &self.inner.table)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Inner {
    fn pool(&self) -> Result<Pool, Error> {
        match &self.pool {
            PoolRef::Strong(p) => Ok(p.clone()),
            PoolRef::Weak(w) => w
                .upgrade()
                .map(|shared| Pool { shared })
                .ok_or(Error::Pool(deadpool_postgres::PoolError::Closed)),
        }
    }

    /// A control-lane connection for one statement.
    pub(crate) async fn control(&self, timeout: Duration) -> Result<Conn, Error> {
        let pool = self.pool()?;
        let site = Location::caller();
        pool.checkout(Lane::Control, site, timeout).await
    }

    pub(crate) fn count_statement(&self) {
        self.stats.statements.fetch_add(1, Ordering::Relaxed);
    }

    async fn ensure_installed(&self) -> Result<(), Error> {
        if !self.auto_install {
            return Ok(());
        }
        self.installed
            .get_or_try_init(|| async {
                let mut conn = self.control(self.statement_timeout).await?;
                self.count_statement();
                if self.sql.install(&mut conn).await? {
                    tracing::info!(pool = %self.pool_name, table = %self.table, "lease table installed");
                }
                Ok::<(), Error>(())
            })
            .await
            .map(|_| ())
    }

    /// One acquisition attempt: the lease, or how long until it may be free.
    async fn attempt(
        self: &Arc<Self>,
        name: &str,
        opts: &LeaseOptions,
    ) -> Result<Result<Lease, Duration>, Error> {
        name::check_name(name)?;
        let timing = opts.validate()?;
        self.ensure_installed().await?;
        let holder = name::new_holder();
        let began = Instant::now();
        let conn = self.control(self.statement_timeout).await?;
        let start = Instant::now();
        let left = self.statement_timeout.saturating_sub(began.elapsed());
        self.count_statement();
        let fut = self.sql.acquire(
            &conn,
            name,
            &holder,
            timing.ttl.as_secs_f64(),
            opts.at_least_time().as_secs_f64(),
            opts.period.map_or(0.0, |p| p.as_secs_f64()),
        );
        let attempt = match tokio::time::timeout(left, fut).await {
            Ok(r) => r?,
            Err(_) => {
                conn.discard();
                return Err(Error::LeaseTimeout {
                    what: "acquisition",
                    waited: began.elapsed(),
                });
            }
        };
        drop(conn);
        let (token, prev_holder, taken_at) = match attempt {
            Attempt::Busy { retry_in } => {
                return Ok(Err(
                    Duration::try_from_secs_f64(retry_in).unwrap_or(MAX_POLL)
                ));
            }
            Attempt::Taken {
                token,
                prev_holder,
                taken_at,
            } => (token, prev_holder, taken_at),
        };
        let taken_at = Duration::try_from_secs_f64(taken_at)
            .ok()
            .and_then(|d| UNIX_EPOCH.checked_add(d))
            .unwrap_or_else(SystemTime::now);
        let state = Arc::new(LeaseState::new(
            name.into(),
            holder,
            token,
            timing.ttl,
            taken_at,
            prev_holder,
        ));
        self.metrics.acquired(name);
        if let Some(prev) = state.prev_holder.as_deref().filter(|h| !h.is_empty()) {
            self.metrics.takeover(name);
            tracing::warn!(
                pool = %self.pool_name,
                lease = name,
                token,
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

    /// Releases one term for its guard or runner: stops renewing it, then
    /// deletes (or marks released) its row.
    pub(crate) async fn release(
        &self,
        id: u64,
        state: &LeaseState,
        forget_hold: bool,
    ) -> Result<(), Error> {
        self.unregister(id);
        match state.lost_reason() {
            Some(LostReason::Taken) => Err(Error::LeaseLost {
                name: state.name.to_string(),
                reason: LostReason::Taken,
            }),
            // `release_all` released it already.
            Some(LostReason::Released) => Ok(()),
            _ => self.release_row(state, forget_hold).await,
        }
    }

    /// The release statement of one term.
    async fn release_row(&self, state: &LeaseState, forget_hold: bool) -> Result<(), Error> {
        let began = Instant::now();
        let conn = self.control(self.statement_timeout).await?;
        let left = self.statement_timeout.saturating_sub(began.elapsed());
        self.count_statement();
        let fut = self
            .sql
            .release(&conn, &state.name, &state.holder, state.token, forget_hold);
        let ours = match tokio::time::timeout(left, fut).await {
            Ok(r) => r?,
            Err(_) => {
                conn.discard();
                return Err(Error::LeaseTimeout {
                    what: "release",
                    waited: began.elapsed(),
                });
            }
        };
        if ours {
            return Ok(());
        }
        tracing::warn!(
            pool = %self.pool_name,
            lease = %state.name,
            token = state.token,
            "late release: the lease had been taken over; the new holder's lease is untouched"
        );
        Err(Error::LeaseLost {
            name: state.name.to_string(),
            reason: LostReason::Taken,
        })
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

impl Error {
    /// The lease is no longer this holder's ([`Error::LeaseLost`]).
    pub fn is_lease_lost(&self) -> bool {
        matches!(self, Error::LeaseLost { .. })
    }

    /// Another holder kept the lease for the whole wait ([`Error::LeaseBusy`]).
    pub fn is_lease_busy(&self) -> bool {
        matches!(self, Error::LeaseBusy { .. })
    }

    /// A lease statement timed out ([`Error::LeaseTimeout`]).
    pub fn is_lease_timeout(&self) -> bool {
        matches!(self, Error::LeaseTimeout { .. })
    }
}
