//! [`Pool`]'s user-facing methods, in one file: each delegates to the layer
//! that does the work (the pool core, locks, the census, pooler detection).

use std::future::Future;
use std::panic::Location;
use std::time::Duration;

use deadpool_postgres::{PoolError, TimeoutType, Transaction};
use futures_util::future::BoxFuture;

use crate::admission::Lane;
use crate::census::Census;
use crate::error::{BuildError, CheckoutError, Error, Stage};
use crate::key::{LockKey, LockMode};
use crate::lock::{DeadpoolWork, Migrated, SessionLock};
use crate::pool::{Client, Pool, PoolBuilder};
use crate::pooler::PoolerMode;
use crate::status::Status;

impl Pool {
    /// Starts a builder over an existing deadpool pool (the drop-in path).
    /// pgwarden owns that pool's capacity from then on: keep no clone of it.
    ///
    /// ```no_run
    /// # fn demo(deadpool: deadpool_postgres::Pool) -> Result<(), pgwarden::BuildError> {
    /// let pool = pgwarden::Pool::builder(deadpool).name("app").build()?;
    /// # Ok(()) }
    /// ```
    pub fn builder(inner: deadpool_postgres::Pool) -> PoolBuilder {
        PoolBuilder::new(inner).census_interval(Some(crate::census::DEFAULT_INTERVAL))
    }

    /// Starts a builder from a deadpool-postgres [`Config`](deadpool_postgres::Config)
    /// (no TLS, tokio runtime). Its pool size must be at most 262 143;
    /// deadpool create and recycle timeouts left unset become 10 s and 5 s
    /// (every checkout is bounded by its caller's bound too). Its
    /// connections take the pool's [name](PoolBuilder::name) as
    /// `application_name` unless the config sets one.
    ///
    /// ```no_run
    /// # fn demo() -> Result<(), pgwarden::BuildError> {
    /// let mut config = deadpool_postgres::Config::new();
    /// config.url = Some("postgres://app@db/app".into());
    /// let pool = pgwarden::Pool::from_config(&config)?.build()?;
    /// # Ok(()) }
    /// ```
    pub fn from_config(config: &deadpool_postgres::Config) -> Result<PoolBuilder, BuildError> {
        crate::pool::config_pool(config).map(|(inner, name)| Pool::builder(inner).set_ext(name))
    }

    /// Starts a builder from a `DATABASE_URL`-style connection string
    /// (`postgres://…` or `host=… user=…`), no TLS, `max_size` connections
    /// (at most 262 143), deadpool create and recycle timeouts of 10 s and
    /// 5 s (every checkout is bounded by its caller's bound too). Its
    /// connections take the pool's [name](PoolBuilder::name) as
    /// `application_name` unless the string sets one.
    ///
    /// ```
    /// let e = pgwarden::Pool::from_url("host=/tmp", usize::MAX).unwrap_err();
    /// assert!(e.to_string().contains("above the maximum 262143"), "{e}");
    /// ```
    pub fn from_url(url: &str, max_size: usize) -> Result<PoolBuilder, BuildError> {
        crate::pool::url_pool(url, max_size).map(|(inner, name)| Pool::builder(inner).set_ext(name))
    }

    /// The pool's name, as in logs and metric labels.
    ///
    /// ```no_run
    /// # fn demo(pool: pgwarden::Pool) {
    /// tracing::info!(pool = pool.name(), "ready");
    /// # }
    /// ```
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// A request-lane connection: the drop-in replacement for
    /// [`deadpool_postgres::Pool::get`], with deadpool's error type.
    ///
    /// Bounded end to end by the pool's wait timeout: admission (FIFO),
    /// deadpool, connecting or recycling, and the backend-pid query of a new
    /// connection. A timeout is `PoolError::Timeout` (`Wait` while waiting
    /// for admission, `Create` after), logged with the pool's status (use
    /// [`Pool::get_within`] for an error that carries it).
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::Pool) -> Result<(), deadpool_postgres::PoolError> {
    /// let client = pool.get().await?; // derefs to deadpool_postgres::Client
    /// client.simple_query("SELECT 1").await?;
    /// # Ok(()) }
    /// ```
    #[track_caller]
    pub fn get(&self) -> impl Future<Output = Result<Client, PoolError>> + Send + '_ {
        self.checkout_mapped(
            Lane::Request,
            Location::caller(),
            self.shared.opts.wait_timeout,
            into_pool_error,
        )
    }

    /// A request-lane connection within `timeout` (checkout included), with
    /// pgwarden's error: a timeout carries the pool's status and the stage
    /// it ran out in ([`CheckoutError::Timeout`](crate::CheckoutError::Timeout)).
    ///
    /// User code takes request connections only. The other lanes come
    /// through the calls made for them, which hold what they take to their
    /// purpose: [`Pool::session_lock`] (the session-lock lane, budgeted),
    /// [`Pool::readiness`] (the probe's reserve), [`Leases`](crate::Leases)
    /// (the lease lane), [`Pool::census`] and [`Pool::detect_pooler`]
    /// (control).
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
    /// use std::time::Duration;
    /// let client = pool.get_within(Duration::from_millis(200)).await?;
    /// client.simple_query("SELECT 1").await?;
    /// # Ok(()) }
    /// ```
    #[track_caller]
    pub fn get_within(
        &self,
        timeout: Duration,
    ) -> impl Future<Output = Result<Client, Error>> + Send + '_ {
        let site = Location::caller();
        self.checkout(Lane::Request, site, timeout)
    }

    /// The pool now: size, idle, and per lane in use, waiting and limits.
    ///
    /// ```no_run
    /// # fn demo(pool: pgwarden::Pool) {
    /// let s = pool.status();
    /// println!("{s}"); // total 16, open 4, idle 2, in use 2 (request 2/14…)
    /// # }
    /// ```
    pub fn status(&self) -> Status {
        self.shared.status()
    }

    /// Whether [`Pool::close`] was called (as deadpool's `is_closed`).
    ///
    /// ```no_run
    /// # fn demo(pool: pgwarden::Pool) {
    /// pool.close();
    /// assert!(pool.is_closed());
    /// # }
    /// ```
    pub fn is_closed(&self) -> bool {
        self.shared.is_closed()
    }

    /// The timeouts checkouts run under, as deadpool's `timeouts()`: `wait`
    /// is pgwarden's end-to-end checkout bound
    /// ([`PoolBuilder::wait_timeout`]); `create` and `recycle` are the
    /// wrapped deadpool pool's.
    ///
    /// ```no_run
    /// # fn demo(pool: pgwarden::Pool) {
    /// let bound = pool.timeouts().wait; // Some(30 s) unless configured
    /// # }
    /// ```
    pub fn timeouts(&self) -> deadpool_postgres::Timeouts {
        deadpool_postgres::Timeouts {
            wait: Some(self.shared.opts.wait_timeout),
            ..self.shared.inner.timeouts()
        }
    }

    /// Resizes the pool to `max_size` connections, as deadpool's `resize`,
    /// with the lanes' limits derived again for the new size (lanes set with
    /// [`PoolBuilder::lane`] keep their settings; the others follow the
    /// size, as at build).
    ///
    /// Refused, with nothing changed, when the settings cannot work at that
    /// size: a reservation or a lane maximum that no longer fits
    /// ([`BuildError::Limits`]), a size below 2 or above 262 143, or a closed
    /// pool ([`BuildError::DeadpoolClosed`]). Checkouts out stay out: a pool
    /// shrunk below what is out admits nothing more until enough come back
    /// (never more than `max_size` out once they have; every reservation
    /// still kept), and the connections that come back past the new size are
    /// closed.
    ///
    /// ```no_run
    /// # fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::BuildError> {
    /// pool.resize(32)?;
    /// assert_eq!(pool.status().max_size, 32);
    /// # Ok(()) }
    /// ```
    pub fn resize(&self, max_size: usize) -> Result<(), BuildError> {
        self.shared.resize(max_size)
    }

    /// Closes the idle connections for which `keep` answers false, as
    /// deadpool's `retain` (it sees each idle connection and its deadpool
    /// metrics: age, last use). Returns how many were closed. Checked-out
    /// connections are not seen; the budget is not changed (idle
    /// connections are not counted in it). `keep` runs under deadpool's
    /// lock: it must not block.
    ///
    /// ```no_run
    /// # fn demo(pool: pgwarden::Pool) {
    /// use std::time::Duration;
    /// let closed = pool.retain(|_, m| m.last_used() < Duration::from_secs(60));
    /// # }
    /// ```
    pub fn retain(
        &self,
        keep: impl FnMut(&deadpool_postgres::ClientWrapper, deadpool_postgres::Metrics) -> bool,
    ) -> usize {
        self.shared.inner.retain(keep).removed.len()
    }

    /// The deadpool-postgres [`Manager`](deadpool_postgres::Manager) of the
    /// wrapped pool, as deadpool's `manager()`: its statement caches
    /// (`manager().statement_caches`), and its configuration. It cannot take
    /// the pool's capacity: a connection made with `Manager::create` is the
    /// caller's own, outside the pool and its budget.
    ///
    /// ```no_run
    /// # fn demo(pool: pgwarden::Pool) {
    /// pool.manager().statement_caches.clear(); // after a schema change
    /// # }
    /// ```
    pub fn manager(&self) -> &deadpool_postgres::Manager {
        self.shared.inner.manager()
    }

    /// The readiness probe: `SELECT 1` on the probe lane, whose reserve no
    /// other lane may take, bounded by `timeout` (checkout included). Returns
    /// its latency. A connection that does not answer in time is closed,
    /// never reused. On a slow link, a connection still being made when the
    /// bound runs out is made in the background (for up to 10 s) and kept
    /// for the next probe, so that readiness can become ready where making a
    /// connection takes longer than one probe's bound. A connection refused
    /// by the server is an error that says what the server said.
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::Pool) {
    /// let ready = pool.readiness(std::time::Duration::from_millis(500)).await.is_ok();
    /// # }
    /// ```
    #[track_caller]
    pub fn readiness(
        &self,
        timeout: Duration,
    ) -> impl Future<Output = Result<Duration, Error>> + Send + '_ {
        let site = Location::caller();
        self.shared.probe(timeout, site)
    }

    /// Closes the pool: idle connections are closed, waiters fail, checkouts
    /// fail from now on (each counted as failure reason `closed`).
    ///
    /// ```no_run
    /// # fn demo(pool: pgwarden::Pool) {
    /// pool.close();
    /// # }
    /// ```
    pub fn close(&self) {
        self.shared.close();
    }

    /// Detects, once per pool, whether it talks through a transaction pooler,
    /// and remembers it (a configured mode is returned as is). Call it at
    /// start-up; otherwise the first session lock runs it.
    ///
    /// The probe checks out a control connection and asks it for
    /// `pg_backend_pid()`; it sets nothing. Straight to PostgreSQL, the pid a
    /// connection's server announced when it connected is its backend's pid:
    /// one statement proves [`PoolerMode::Direct`]. Through a proxy, the probe
    /// takes a second connection at the same time and asks again, from either
    /// at random (up to 40 statements): a connection that lands on another
    /// backend proves [`PoolerMode::Transaction`]. Since a transaction pooler
    /// can, rarely, hide that so long, each session lock through a proxy is
    /// checked again on its own connection. A pool of 2 cannot hold two
    /// connections outside the probe reserve: behind a proxy its mode stays
    /// unproven: answered [`PoolerMode::Auto`] (nothing proven either way;
    /// each session lock checked on its own connection, lease statements
    /// unnamed, the census matches no lock to the pool's connections).
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
    /// if pool.detect_pooler().await? == pgwarden::PoolerMode::Transaction {
    ///     // session locks will be refused: use pool.with_xact_lock or leases
    /// }
    /// # Ok(()) }
    /// ```
    #[track_caller]
    pub fn detect_pooler(&self) -> impl Future<Output = Result<PoolerMode, Error>> + Send + '_ {
        let site = Location::caller();
        crate::pooler::detect(&self.shared, site)
    }

    /// The advisory locks in the database now, each matched to this pool's
    /// connections. Runs on a control connection; a lock found on that very
    /// connection is reported [`Owner::Idle`](crate::Owner::Idle): it was
    /// idle in the pool a moment before, and runs nothing but the census.
    ///
    /// Behind a transaction pooler, backend pids do not identify this pool's
    /// connections: every lock is then reported as
    /// [`Owner::Other`](crate::Owner::Other); use the keys. On a
    /// [`PoolerMode::Auto`] pool not probed yet, the first census runs
    /// [`Pool::detect_pooler`] first.
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
    /// for lock in pool.census().await?.ours() {
    ///     println!("{:?} holds {} ({}): {:?}", lock.pid, lock.key, lock.mode, lock.owner);
    /// }
    /// # Ok(()) }
    /// ```
    #[track_caller]
    pub fn census(&self) -> impl Future<Output = Result<Census, Error>> + Send + '_ {
        let site = Location::caller();
        async move { self.shared.census_at(site).await.map(|(census, ..)| census) }
    }

    /// Takes the session advisory lock `key` in `mode` on a connection of
    /// its own ([`Lane::SessionLock`]): tries once when `wait` is `None` (the
    /// checkout then waits up to the pool's wait timeout), or waits up to
    /// `wait` in all (the checkout, then the lock, bounded by PostgreSQL's
    /// `lock_timeout`).
    ///
    /// - `Ok(Some(lock))`: granted; the guard owns the connection.
    /// - `Ok(None)`: only from a single try (`wait` is `None`): another
    ///   session holds it.
    /// - `Err(`[`LockError::Timeout`](crate::LockError::Timeout)`)`: a wait ran out, as for
    ///   [`xact_lock`](crate::xact_lock).
    ///
    /// The checkout is budgeted. While other locks hold the session-lock
    /// budget, a call with a wait queues for it, in FIFO order with the other
    /// waiting session locks and holding no connection, within `wait` (then
    /// [`CheckoutError::Timeout`](crate::CheckoutError::Timeout), stage
    /// `Admission`); a single try (`None`) is refused at once
    /// ([`CheckoutError::BudgetExhausted`](crate::CheckoutError::BudgetExhausted),
    /// naming the pool size, the budget, the setting that raises it and the
    /// alternatives), or admitted with a warning under [`BudgetPolicy::Warn`](crate::BudgetPolicy::Warn).
    /// A call that can never be admitted (a budget of 0) is refused at once
    /// either way. Behind a transaction-mode pooler it is refused ([`LockError::BehindPooler`](crate::LockError::BehindPooler)).
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
    /// use std::time::Duration;
    /// use pgwarden::{LockMode, Namespace};
    /// const REPORTS: Namespace = Namespace::new(3);
    ///
    /// let key = REPORTS.named("monthly");
    /// if let Some(lock) = pool.session_lock(key, LockMode::Exclusive, Some(Duration::from_secs(5))).await? {
    ///     let work = pool.get().await?; // the work under the lock: a request connection
    ///     work.simple_query("SELECT 1").await?;
    ///     drop(work);
    ///     lock.unlock().await?; // reports errors; dropping the guard also unlocks
    /// }
    /// # Ok(()) }
    /// ```
    #[track_caller]
    pub fn session_lock(
        &self,
        key: LockKey,
        mode: LockMode,
        wait: Option<Duration>,
    ) -> impl Future<Output = Result<Option<SessionLock>, Error>> + Send + '_ {
        let site = Location::caller();
        crate::lock::session_lock(&self.shared, key, mode, wait, site)
    }

    /// Runs `f` in one `READ COMMITTED` transaction, on a request connection,
    /// under the exclusive transaction-scoped lock `key`: commits when `f`
    /// returns `Ok`, rolls back when it returns `Err` (or panics, or the
    /// future is dropped). The lock goes with the transaction: it cannot
    /// leak, and it works behind a transaction pooler. The closure's future
    /// may borrow the transaction, not the caller's locals: move owned data
    /// into it. `timeout` bounds the checkout and the wait for the lock; past
    /// it the error is [`LockError::Timeout`](crate::LockError::Timeout) (or a checkout timeout),
    /// converted into `E`.
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
    /// const ACCOUNTS: pgwarden::Namespace = pgwarden::Namespace::new(2);
    /// let created = pool
    ///     .with_xact_lock(ACCOUNTS.key(42), std::time::Duration::from_secs(5), |tx| {
    ///         Box::pin(async move {
    ///             let n = tx.execute("INSERT INTO subscriptions (client_id) VALUES (42) ON CONFLICT DO NOTHING", &[]).await?;
    ///             Ok::<_, pgwarden::Error>(n == 1)
    ///         })
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    #[track_caller]
    pub fn with_xact_lock<'p, T, E, F>(
        &'p self,
        key: LockKey,
        timeout: Duration,
        f: F,
    ) -> impl Future<Output = Result<T, E>> + Send + 'p
    where
        F: for<'a> FnOnce(&'a Transaction<'a>) -> BoxFuture<'a, Result<T, E>> + Send + 'p,
        T: Send + 'p,
        E: From<Error> + Send + 'p,
    {
        let site = Location::caller();
        crate::lock::with_xact_lock(&self.shared, key, timeout, DeadpoolWork(f), site)
    }

    /// Runs `f` once per database, whatever the number of instances starting
    /// at the same moment: for start-up DDL (`CREATE … IF NOT EXISTS` races
    /// with itself across sessions) and migrations. `name` is the work's
    /// identity (e.g. `"billing/0001_schema"`). Callers serialise on a
    /// transaction-scoped lock derived from `name`; the first runs `f` in a
    /// `READ COMMITTED` transaction and records `name` in the ledger table
    /// `pgwarden_run_once` (created on first use, in the first schema of the
    /// `search_path`) in that same transaction. The others wait, find the
    /// row, and skip `f` ([`Migrated::Skipped`]). If `f` fails, nothing is
    /// recorded and the next caller runs it. `timeout` bounds the checkout
    /// and each lock wait.
    ///
    /// `name` is checked before anything runs: 1 to 1024 bytes, no NUL byte
    /// or other control character ([`InvalidInput::Name`](crate::InvalidInput::Name)). When `f`
    /// succeeded but recording it failed, the error is
    /// [`LockError::MigrationNotRecorded`](crate::LockError::MigrationNotRecorded): the work ran, and says whether its
    /// transaction was rolled back.
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
    /// pool.migrate_once("app/0001_schema", std::time::Duration::from_secs(30), |tx| {
    ///     Box::pin(async move {
    ///         tx.batch_execute("CREATE SCHEMA IF NOT EXISTS app").await?;
    ///         Ok::<_, pgwarden::Error>(())
    ///     })
    /// })
    /// .await?;
    /// # Ok(()) }
    /// ```
    #[track_caller]
    pub fn migrate_once<'p, T, E, F>(
        &'p self,
        name: &'p str,
        timeout: Duration,
        f: F,
    ) -> impl Future<Output = Result<Migrated<T>, E>> + Send + 'p
    where
        F: for<'a> FnOnce(&'a Transaction<'a>) -> BoxFuture<'a, Result<T, E>> + Send + 'p,
        T: Send + 'p,
        E: From<Error> + Send + 'p,
    {
        let site = Location::caller();
        crate::lock::migrate_once(&self.shared, name, timeout, DeadpoolWork(f), site)
    }
}

fn into_pool_error(e: Error) -> PoolError {
    match e {
        Error::Checkout(CheckoutError::Pool(e)) => e,
        Error::Db(e) => PoolError::Backend(e),
        Error::Checkout(CheckoutError::Timeout {
            stage: Stage::Admission,
            ..
        })
        | Error::Checkout(CheckoutError::DeadpoolMismatch { .. }) => {
            PoolError::Timeout(TimeoutType::Wait)
        }
        Error::Checkout(CheckoutError::Timeout { .. }) => PoolError::Timeout(TimeoutType::Create),
        // The request lane is never refused and runs no other statement.
        _ => PoolError::Closed,
    }
}
