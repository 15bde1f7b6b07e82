//! [`Leases`]: the lease table of one pool, and its builder.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::acquire::Lease;
use super::acquire::MAX_POLL;
use super::inner::Inner;
use super::inner::Urgency;
use super::metrics::LeaseStats;
use super::options::check_name;
use super::options::LeaseOptions;
use super::options::{default_settings, Settings};
use super::table::{wait_ms, Busy, LeaseRow, ReadRows, Revoke};
use crate::error::Error;
use crate::lost::LostReason;
use crate::pool::Pool;

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
#[derive(Clone)]
pub struct Leases {
    pub(crate) inner: Arc<Inner>,
}

impl Leases {
    /// The default lease table of `pool`, `public.pgwarden_leases` (created
    /// at first use), with every setting at its
    /// default (see [`LeasesBuilder`](super::LeasesBuilder)).
    ///
    /// ```no_run
    /// # fn demo(pool: pgwarden::Pool) {
    /// let leases = pgwarden::Leases::new(&pool); // keep it: one per process
    /// # let _ = leases;
    /// # }
    /// ```
    pub fn new(pool: &Pool) -> Leases {
        Leases::from_parts(pool, default_settings())
    }

    pub(super) fn from_parts(pool: &Pool, settings: Settings) -> Leases {
        let inner = Arc::new(Inner::new(pool.clone(), pool.name(), settings));
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
    /// Cancellation: a future dropped after its statement reached the
    /// database cancels the statement on the server, then releases the
    /// lease in the background in case the statement took it first.
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
    ) -> Result<Option<Lease>, Error> {
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
        LeaseStats {
            held,
            ..*self.inner.stats.lock()
        }
    }
}

impl Leases {
    /// Every row of the lease table, by name, each with the backend holding
    /// a row lock on it, if any ([`LeaseRow::blocker_pid`]): a fenced
    /// transaction left open (a frozen or cut-off holder) blocks the
    /// take-over of an expired term until it ends.
    ///
    /// Reads only: locked rows are found with `FOR UPDATE SKIP LOCKED` in a
    /// transaction that is rolled back, which never waits on a row lock.
    /// That probe needs the `UPDATE` privilege on the table; without it a
    /// blocker is found only when the row names its transaction (`xmax`:
    /// one locker, not several sharing the lock).
    pub async fn rows(&self) -> Result<Vec<LeaseRow>, Error> {
        let inner = &self.inner;
        inner
            .run(
                Urgency::Normal,
                inner.statement_timeout,
                &ReadRows {
                    wait_ms: wait_ms(inner.statement_timeout),
                },
            )
            .await
    }

    /// Ends the current term of `name` by hand (an operator's last resort):
    /// the row is marked released and expired, so its holder's
    /// [`fence`](super::LeaseHandle::fence) is refused from now on and its
    /// [`lost`](super::LeaseHandle::lost) signal fires at its next renewal
    /// (`Taken`). The next acquisition takes the name at once, unless an
    /// at-least hold (`held_until`) still runs: the hold is kept.
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

impl fmt::Debug for Leases {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leases")
            .field("pool", &self.inner.pool_name)
            .field("table", &self.inner.table)
            .field("stats", &self.stats())
            .finish()
    }
}
