//! [`Leases`]: the lease table of one pool, and its builder.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::guard::{Lease, LostReason};
use super::inner::{Inner, PoolRef, MAX_POLL};
use super::options::LeaseOptions;
use super::table::{TableName, DEFAULT_TABLE};
use super::timing;
use crate::error::Error;
use crate::pool::Pool;

/// The longest a lease statement may take by default (checkout included)
/// before it fails and its connection is closed: 10 s.
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);

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
    /// Statements sent: acquisitions, renewals, releases, fences (and each
    /// install, counted once).
    pub statements: u64,
    /// Renewal statements sent (each renews a batch).
    pub renewal_statements: u64,
    /// Lease renewals that succeeded, summed over batches.
    pub renewed: u64,
    /// Leases in the last renewal statement that succeeded.
    pub last_batch: usize,
    /// How long that statement took, checkout included.
    pub last_renewal: Duration,
    /// Renewal attempts that failed (a database or pool error, a timeout):
    /// retried with back-off until the local deadline.
    pub renewal_failures: u64,
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
    /// [`MAX_TABLE_LEN`](super::MAX_TABLE_LEN) bytes (its sequence adds `_token_seq`). Quotes,
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
        auto_install: bool,
    ) -> Leases {
        Leases {
            inner: Arc::new(Inner::new(
                pool_ref,
                pool.name(),
                table,
                statement_timeout,
                auto_install,
            )),
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
    /// lock [`INSTALL_LOCK_KEY`](super::INSTALL_LOCK_KEY), so instances starting together do not race.
    /// The schema must exist. Returns true when it ran the DDL.
    pub async fn install(&self) -> Result<bool, Error> {
        self.inner.install().await
    }

    /// Takes `name` for `ttl` if nobody holds it; `None` when another term
    /// holds it (a skip). Renewal every TTL / 4 starts at once.
    ///
    /// Cancellation: a future dropped after its statement reached the
    /// database may have taken the lease with no guard to renew it; it
    /// expires after `ttl`, as a crashed holder's would.
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
        let held = self.inner.registry.lock().len();
        LeaseStats {
            held,
            ..*self.inner.stats.lock()
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
