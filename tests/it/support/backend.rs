//! One test, every backend: [`Backend`] is what a backend-generic test
//! needs of a pool (build one, check out through the drop-in call and
//! through pgwarden's, read a connection's lane, pid and site, run a
//! statement), implemented for the deadpool pool and, with their features,
//! for pgwarden's sqlx pool on sqlx 0.8 and 0.9. [`backends!`] makes one
//! `#[tokio::test]` per backend from one generic `async fn`.
//!
//! Leases: `pgwarden::Leases<B>` is generic over the wrapped pool, whose
//! bound the crate keeps to itself, so a generic test reaches it through
//! [`Backend::Leases`] and the methods below (each the same call on every
//! backend, written once in `lease_methods!`); a fenced write is the one
//! call whose code differs (the backend's own transaction).

use std::fmt;
use std::panic::Location;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::ops::Deref;

use futures_util::future::BoxFuture;
use metrics_util::debugging::{DebuggingRecorder, Snapshotter};
use pgwarden::lease::LeaseRow;
use pgwarden::{
    BudgetPolicy, Census, Error, Job, Lane, LeaseHandle, LeaseOptions, LeaseStats, LockKey,
    LockMode, Migrated, PoolerMode, Scheduler, Status,
};
use pgwarden_testing::{PgBouncer, TestDb};
use tokio_postgres::IsolationLevel;

/// A pool's settings, as a test gives them to any backend.
#[derive(Clone, Debug)]
pub struct Settings {
    pub name: &'static str,
    pub size: usize,
    pub wait: Duration,
    pub long_hold: Duration,
    pub housekeeping: Duration,
    /// The session-lock lane's max (the budget), when set.
    pub budget: Option<usize>,
    pub policy: BudgetPolicy,
    pub unlock_timeout: Duration,
    /// The configured pooler mode (default `Direct`, as `support::builder`).
    pub pooler: PoolerMode,
    /// The periodic census (default off).
    pub census: Option<Duration>,
    /// sqlx's statement cache on (`true`) or off (`statement_cache_capacity(0)`);
    /// `None`: on straight to PostgreSQL, off through PgBouncer. Deadpool
    /// has no such setting.
    pub statement_cache: Option<bool>,
    /// The request lane's (reserved, max), when set.
    pub request: Option<(usize, usize)>,
    /// An idle connection handed out without a statement run on it first:
    /// sqlx's `test_before_acquire(false)` (deadpool's `build` always
    /// recycles so, `RecyclingMethod::Fast`).
    pub unchecked: bool,
}

impl Settings {
    /// A pool `name` of `size`: waits of 5 s, housekeeping on demand only.
    pub fn new(name: &'static str, size: usize) -> Settings {
        Settings {
            name,
            size,
            wait: Duration::from_secs(5),
            long_hold: Duration::from_secs(30),
            housekeeping: Duration::from_secs(3600),
            budget: None,
            policy: BudgetPolicy::Refuse,
            unlock_timeout: Duration::from_secs(5),
            pooler: PoolerMode::Direct,
            census: None,
            statement_cache: None,
            request: None,
            unchecked: false,
        }
    }

    /// See [`Settings::unchecked`].
    pub fn unchecked(mut self) -> Settings {
        self.unchecked = true;
        self
    }

    /// The request lane's reserve and max.
    pub fn request(mut self, reserved: usize, max: usize) -> Settings {
        self.request = Some((reserved, max));
        self
    }

    /// A session-lock budget of `max` connections, and its policy.
    pub fn budget(mut self, max: usize, policy: BudgetPolicy) -> Settings {
        self.budget = Some(max);
        self.policy = policy;
        self
    }

    pub fn unlock_timeout(mut self, bound: Duration) -> Settings {
        self.unlock_timeout = bound;
        self
    }

    pub fn pooler(mut self, mode: PoolerMode) -> Settings {
        self.pooler = mode;
        self
    }

    /// sqlx's statement cache on or off (see [`Settings::statement_cache`]).
    pub fn statement_cache(mut self, on: bool) -> Settings {
        self.statement_cache = Some(on);
        self
    }

    pub fn census(mut self, every: Duration) -> Settings {
        self.census = Some(every);
        self
    }

    /// The pool's name on backend `B`.
    pub fn pool_name<B: Backend>(&self) -> String {
        format!("{}-{}", self.name, B::NAME)
    }

    pub fn wait(mut self, wait: Duration) -> Settings {
        self.wait = wait;
        self
    }

    pub fn long_hold(mut self, threshold: Duration, housekeeping: Duration) -> Settings {
        self.long_hold = threshold;
        self.housekeeping = housekeeping;
        self
    }
}

/// What a backend-generic test needs of a pool.
pub trait Backend: Send + Sync + 'static {
    /// Its name, appended to the pool's (`<name>-<backend>`): the variants
    /// of one test run at once, each pool its own metric label.
    const NAME: &'static str;
    type Pool: Clone + Send + Sync + fmt::Debug + 'static;
    type Conn: Send + fmt::Debug + 'static;
    /// The error of the backend's drop-in checkout (`get` / `acquire`).
    type DropInError: std::error::Error + Send + 'static;

    /// Builds a pool on `db` (no connection made yet).
    fn build(db: &TestDb, s: &Settings) -> Self::Pool;
    /// Builds a pool through PgBouncer (sqlx: its statement cache off, as
    /// behind any transaction pooler).
    fn build_through(b: &PgBouncer, s: &Settings) -> Self::Pool;

    /// [`Backend::build`], with every connection checked for advisory locks
    /// as it comes back into the wrapped pool (sqlx: its `after_release`
    /// hook) or is handed out again (deadpool: its `post_recycle` hook),
    /// before anything else can use or clean it: the count of connections
    /// found holding one.
    fn build_watched(db: &TestDb, s: &Settings) -> (Self::Pool, Arc<AtomicUsize>);

    /// [`Backend::build_recorded`], the wrapped pool closing connections
    /// on its own, without pgwarden's knowledge, while the flag is set:
    /// sqlx as it gets one back (its `after_release` answers false),
    /// deadpool as it recycles one for a checkout (a `pre_recycle` hook
    /// fails). Each checkout then makes a new connection.
    fn build_closing(db: &TestDb, s: &Settings) -> (Self::Pool, Snapshotter, Arc<AtomicBool>);

    /// Builds a pool whose metrics go to a local recorder.
    fn build_recorded(db: &TestDb, s: &Settings) -> (Self::Pool, Snapshotter) {
        let recorder = DebuggingRecorder::new();
        let snap = recorder.snapshotter();
        let pool = metrics::with_local_recorder(&recorder, || Self::build(db, s));
        (pool, snap)
    }

    /// The drop-in checkout: deadpool's `get`, sqlx's `acquire`.
    #[track_caller]
    fn get(pool: &Self::Pool) -> BoxFuture<'_, Result<Self::Conn, Self::DropInError>>;
    /// pgwarden's checkout with its own bound and error.
    #[track_caller]
    fn get_within(pool: &Self::Pool, t: Duration) -> BoxFuture<'_, Result<Self::Conn, Error>>;
    /// Whether the drop-in error is the backend's own timeout.
    fn is_drop_in_timeout(e: &Self::DropInError) -> bool;

    fn lane(c: &Self::Conn) -> Lane;
    fn pid(c: &Self::Conn) -> i32;
    fn site(c: &Self::Conn) -> &'static Location<'static>;
    fn since(c: &Self::Conn) -> Instant;
    /// `SELECT pg_backend_pid()`, run by user code on the connection.
    fn ask_pid(c: &mut Self::Conn) -> BoxFuture<'_, i32>;
    /// `SELECT 1` on the connection.
    fn select_1(c: &mut Self::Conn) -> BoxFuture<'_, ()>;
    fn discard(c: Self::Conn);

    /// `sql` as a simple query, run by user code on the connection.
    fn run<'a>(c: &'a mut Self::Conn, sql: &'static str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            if let Err(e) = Self::try_run(c, sql).await {
                panic!("{sql}: {e}");
            }
        })
    }
    /// [`Backend::run`], for a statement that may fail: its error as text.
    fn try_run<'a>(c: &'a mut Self::Conn, sql: &'static str) -> BoxFuture<'a, Result<(), String>>;
    /// `sql`'s one `int8` (unnamed), run by user code on the connection.
    fn count<'a>(c: &'a mut Self::Conn, sql: &'static str) -> BoxFuture<'a, i64>;

    fn status(pool: &Self::Pool) -> Status;
    #[track_caller]
    fn census(pool: &Self::Pool) -> BoxFuture<'_, Result<Census, Error>>;
    fn detect_pooler(pool: &Self::Pool) -> BoxFuture<'_, Result<PoolerMode, Error>>;
    /// An app: `GET /work` ("done") under `ShedLayer::new(pool).max_wait(max_wait)`,
    /// `GET /ready` the readiness service with `bound`.
    #[cfg(feature = "http")]
    fn app(pool: &Self::Pool, max_wait: Duration, bound: Duration) -> axum::Router;
    /// `routes` under `ShedLayer::new(pool)`, with `max_wait` when given.
    #[cfg(feature = "http")]
    fn shed(pool: &Self::Pool, max_wait: Option<Duration>, routes: axum::Router) -> axum::Router;
    /// `GET path`: `Readiness::new(pool)`, with `bound` when given.
    #[cfg(feature = "http")]
    fn ready(pool: &Self::Pool, path: &str, bound: Option<Duration>) -> axum::Router;
    fn readiness(pool: &Self::Pool, t: Duration) -> BoxFuture<'_, Result<Duration, Error>>;
    fn close(pool: &Self::Pool) -> BoxFuture<'_, ()>;

    /// A session lock's guard (`SessionLock` of the backend).
    type Lock: Send + fmt::Debug + 'static;
    #[track_caller]
    fn session_lock(
        pool: &Self::Pool,
        key: LockKey,
        mode: LockMode,
        wait: Option<Duration>,
    ) -> BoxFuture<'_, Result<Option<Self::Lock>, Error>>;
    /// The backend pid of the lock's connection, as the pool knows it.
    fn lock_pid(l: &Self::Lock) -> i32;
    /// `pg_backend_pid()` asked on the lock's own connection.
    fn ask_lock_pid(l: &mut Self::Lock) -> BoxFuture<'_, i32>;
    fn lock_again(l: &mut Self::Lock) -> BoxFuture<'_, Result<u32, Error>>;
    fn unlock_one(l: &mut Self::Lock) -> BoxFuture<'_, Result<u32, Error>>;
    fn unlock(l: Self::Lock) -> BoxFuture<'static, Result<(), Error>>;
    /// `with_xact_lock(key, timeout)` whose work returns the backend pid of
    /// its transaction (and counts its runs in `ran`).
    #[track_caller]
    fn xact_pid(
        pool: &Self::Pool,
        key: LockKey,
        timeout: Duration,
        ran: Arc<AtomicUsize>,
    ) -> BoxFuture<'_, Result<i32, Error>>;
    /// `migrate_once(name, timeout)` whose work counts its runs in `ran`
    /// and creates table `made`: whether this call ran it.
    #[track_caller]
    fn migrate<'p>(
        pool: &'p Self::Pool,
        name: &'static str,
        timeout: Duration,
        ran: Arc<AtomicUsize>,
    ) -> BoxFuture<'p, Result<bool, Error>>;
    /// `pgwarden::Leases` on this backend.
    type Leases: Clone + Send + Sync + fmt::Debug + 'static;
    /// `pgwarden::Lease` on this backend: derefs to the one `LeaseHandle`.
    type Lease: Deref<Target = LeaseHandle> + Send + fmt::Debug + 'static;
    /// `Leases::new(&pool)`: the default table.
    fn leases(pool: &Self::Pool) -> Self::Leases;
    /// `Leases::install`.
    fn install(l: &Self::Leases) -> BoxFuture<'_, Result<bool, Error>>;
    /// `Leases::acquire`.
    fn acquire<'a>(
        l: &'a Self::Leases,
        name: &'a str,
        opts: &'a LeaseOptions,
        wait: Option<Duration>,
    ) -> BoxFuture<'a, Result<Option<Self::Lease>, Error>>;
    /// `Lease::release`.
    fn release(lease: Self::Lease) -> BoxFuture<'static, Result<(), Error>>;
    /// `Leases::stats`.
    fn lease_stats(l: &Self::Leases) -> LeaseStats;
    /// `Leases::rows`.
    fn rows(l: &Self::Leases) -> BoxFuture<'_, Result<Vec<LeaseRow>, Error>>;
    /// `Leases::revoke`.
    fn revoke<'a>(
        l: &'a Self::Leases,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<LeaseRow>, Error>>;
    /// `Leases::release_all`.
    fn release_all(l: &Self::Leases) -> BoxFuture<'_, Result<usize, Error>>;
    /// `Leases::run(name, opts, job)`.
    fn run_job<'a, F, Fut, T>(
        l: &'a Self::Leases,
        name: &'a str,
        opts: &'a LeaseOptions,
        job: F,
    ) -> BoxFuture<'a, Result<Option<T>, Error>>
    where
        F: FnOnce(LeaseHandle) -> Fut + Send + 'a,
        Fut: std::future::Future<Output = T> + Send + 'a,
        T: Send + 'a;
    /// `Leases::run(name, opts, work)` whose work returns its term's token.
    fn run_token<'a>(
        l: &'a Self::Leases,
        name: &'a str,
        opts: &'a LeaseOptions,
    ) -> BoxFuture<'a, Result<Option<i64>, Error>>;
    /// `Scheduler::builder(&leases)` with `jobs`, started.
    fn schedule(l: &Self::Leases, jobs: Vec<Job>) -> Result<Scheduler, Error>;
    /// In a transaction of its own on `pool`, fenced by `lease`:
    /// `INSERT INTO ledger (name, token, prev) VALUES ($1, $2, the
    /// greatest token of the name in the ledger as the transaction sees
    /// it)`, then the fenced commit. The fence's, the write's or the
    /// commit's error.
    fn fenced_write<'a>(
        pool: &'a Self::Pool,
        lease: &'a LeaseHandle,
    ) -> BoxFuture<'a, Result<(), Error>>;

    /// Whether it follows a multi-host connection string to the server
    /// that takes writes (`target_session_attrs=read-write`) by itself:
    /// deadpool (tokio-postgres) does; sqlx connects to one host, so a sqlx
    /// service follows a failover through an address that moves with the
    /// primary (a virtual IP, a DNS name, a proxy).
    const MULTI_HOST: bool;
    /// Whether pgwarden reads the pid the server announced at connection
    /// start: deadpool does (tokio-postgres's cancel token), so detection
    /// proves a direct connection in one statement; sqlx does not expose
    /// it, so detection is the motion probe alone (1 + 1 + 40 statements
    /// straight to PostgreSQL), as the README says.
    const ANNOUNCED_PID: bool;
    /// Whether the wrapped pool names the statements it prepares through
    /// a cache of its own (sqlx's statement cache): behind a transaction
    /// pooler pgwarden then learns to go unnamed (deadpool names none).
    const STATEMENT_CACHE: bool;
    /// Builds a pool on `config` (hosts, ports, user, database,
    /// `application_name`); several hosts only when [`Backend::MULTI_HOST`].
    fn build_on(config: &tokio_postgres::Config, s: &Settings) -> Self::Pool;
    /// `sql` (one row, one `int8`) on the connection, or its error as text:
    /// for a statement that may fail (a server going away).
    fn scalar<'a>(c: &'a mut Self::Conn, sql: &'static str) -> BoxFuture<'a, Result<i64, String>>;
    /// In a transaction of its own on `pool`, fenced by `lease`: `sql` with
    /// `$1` the lease's name, `$2` its token, `$3` `seq`, `$4` its holder,
    /// returning one `int8`; then the fenced commit. The value, or the
    /// checkout's, fence's, statement's or commit's error.
    fn fenced_scalar<'a>(
        pool: &'a Self::Pool,
        lease: &'a LeaseHandle,
        sql: &'static str,
        seq: i32,
    ) -> BoxFuture<'a, Result<i64, Error>>;
    /// Whether `e` says the connection itself is gone (closed, I/O).
    fn is_connection_lost(e: &Error) -> bool;
    /// `Leases::builder(pool).statement_timeout(t).build()`.
    fn leases_bounded(pool: &Self::Pool, statement_timeout: Duration) -> Self::Leases;

    /// `with_xact_lock(key, timeout, work)`: the work reads `n` from table
    /// `counter`, leaves a window of 5 ms (other tasks run), writes `n + 1`
    /// back; with `fail` it then fails with [`work_failed`].
    #[track_caller]
    fn xact_count(
        pool: &Self::Pool,
        key: LockKey,
        timeout: Duration,
        fail: bool,
    ) -> BoxFuture<'_, Result<(), Error>>;
    /// `migrate_once(name, timeout, work)` whose work creates table `made`,
    /// then runs a statement the server refuses: the call's error.
    #[track_caller]
    fn migrate_failing<'p>(
        pool: &'p Self::Pool,
        name: &'static str,
        timeout: Duration,
    ) -> BoxFuture<'p, Result<bool, Error>>;
    /// `sql` (simple or unnamed) on the lock's own connection: its error, if any.
    fn lock_sql<'a>(l: &'a mut Self::Lock, sql: &'static str) -> BoxFuture<'a, Result<(), Error>>;

    /// `Leases::builder(pool)` with `s`'s settings, built.
    fn leases_with(pool: &Self::Pool, s: &LeaseSettings) -> Result<Self::Leases, Error>;
    /// `Leases::ddl`.
    fn lease_ddl(l: &Self::Leases) -> String;
    /// `Scheduler::builder(&leases).node(node)` with `jobs`, started.
    fn schedule_node(l: &Self::Leases, node: &str, jobs: Vec<Job>) -> Result<Scheduler, Error>;
    /// The same with `poll_jitter(jitter)`, when given.
    fn schedule_jittered(
        l: &Self::Leases,
        node: &str,
        jitter: Option<Duration>,
        jobs: Vec<Job>,
    ) -> Result<Scheduler, Error>;
    /// The SQLSTATE of `e`, when the server sent one.
    fn code(e: &Error) -> Option<String>;

    /// Where a test's own transactions begin: deadpool's connection (a
    /// transaction borrows it), sqlx's pool (its `begin` checks a
    /// connection out, owned by the transaction).
    type TxSource: Send + 'static;
    /// A [`Backend::TxSource`] on `pool`.
    fn tx_source(pool: &Self::Pool) -> BoxFuture<'_, Self::TxSource>;
    /// A transaction, not fenced yet: what `LeaseHandle::fence` takes.
    type Tx<'c>: Send;
    /// `BEGIN` (at `level`, when given) on `s`.
    fn begin(s: &mut Self::TxSource, level: Option<IsolationLevel>) -> BoxFuture<'_, Self::Tx<'_>>;
    /// `sql` (no rows) in the transaction, not fenced.
    fn tx_run<'a>(tx: &'a mut Self::Tx<'_>, sql: &'static str) -> BoxFuture<'a, Result<(), Error>>;
    /// `pgwarden::Fenced` of this backend's transaction.
    type Fenced<'c>: Send + fmt::Debug;
    /// `lease.fence(tx)`.
    fn fence<'c>(
        lease: &LeaseHandle,
        tx: Self::Tx<'c>,
    ) -> BoxFuture<'c, Result<Self::Fenced<'c>, Error>>;
    /// `sql` in the fenced transaction; `$1`, when `sql` has it, is `arg`.
    fn fx_run<'a>(
        tx: &'a mut Self::Fenced<'_>,
        sql: &'static str,
        arg: Option<i64>,
    ) -> BoxFuture<'a, Result<(), Error>>;
    /// `sql`'s one `text` in the fenced transaction.
    fn fx_text<'a>(
        tx: &'a mut Self::Fenced<'_>,
        sql: &'static str,
    ) -> BoxFuture<'a, Result<String, Error>>;
    /// `Fenced::check`.
    fn fx_check<'a>(tx: &'a mut Self::Fenced<'_>) -> BoxFuture<'a, Result<(), Error>>;
    /// `Fenced::commit`.
    fn fx_commit(tx: Self::Fenced<'_>) -> BoxFuture<'_, Result<(), Error>>;

    // Lock, census, metrics, pool and fault tests (session 39, helper E).
    /// The lane of the lock's connection.
    fn lock_lane(l: &Self::Lock) -> Lane;
    /// The backend's `xact_lock` (`pgwarden::xact_lock`,
    /// `pgwarden::sqlx::xact_lock`) in a test's own transaction.
    fn tx_xact_lock<'a>(
        tx: &'a mut Self::Tx<'_>,
        key: LockKey,
        mode: LockMode,
        wait: Option<Duration>,
    ) -> BoxFuture<'a, Result<bool, Error>>;
    /// `sql`'s one `text` in the transaction, not fenced.
    fn tx_text<'a>(
        tx: &'a mut Self::Tx<'_>,
        sql: &'static str,
    ) -> BoxFuture<'a, Result<String, Error>>;
    /// `COMMIT` of the transaction, not fenced.
    fn tx_commit(tx: Self::Tx<'_>) -> BoxFuture<'_, Result<(), Error>>;
    /// `ROLLBACK` of the transaction, not fenced.
    fn tx_rollback(tx: Self::Tx<'_>) -> BoxFuture<'_, Result<(), Error>>;
    /// A pool of `size` on `db` given no name (its default), its metrics
    /// to the recorder in effect.
    fn build_unnamed(db: &TestDb, size: usize) -> Self::Pool {
        Self::build_named(db, size, None)
    }
    /// A pool of `size` on `db` on the shipped defaults, named `name`
    /// when given, its metrics to the recorder in effect.
    fn build_named(db: &TestDb, size: usize, name: Option<&str>) -> Self::Pool;
    /// The pool's name.
    fn pool_name(pool: &Self::Pool) -> String;
    /// [`Backend::build_on`], the wrapped pool running a statement on
    /// every idle connection before handing it out (deadpool:
    /// `RecyclingMethod::Verified`; sqlx: `test_before_acquire`, its
    /// default).
    fn build_checked(config: &tokio_postgres::Config, s: &Settings) -> Self::Pool;
    /// The SQLSTATE the server sent, found in `e`'s chain of sources.
    fn source_code(e: &(dyn std::error::Error + 'static)) -> Option<String>;
    /// The SQLSTATE the server sent, found in the drop-in checkout's error.
    fn drop_in_code(e: &Self::DropInError) -> Option<String> {
        Self::source_code(e)
    }
}

/// The settings of `Leases::builder` a test gives any backend
/// ([`Backend::leases_with`]).
#[derive(Clone, Debug, Default)]
pub struct LeaseSettings {
    pub table: Option<String>,
    pub statement_timeout: Option<Duration>,
    /// `purge(after, every)`.
    pub purge: Option<(Duration, Option<Duration>)>,
    pub auto_install: Option<bool>,
    /// `declare(names)`: lease names that are metric labels of their own.
    pub declare: Vec<String>,
}

impl LeaseSettings {
    pub fn table(mut self, name: &str) -> LeaseSettings {
        self.table = Some(name.to_owned());
        self
    }

    pub fn statement_timeout(mut self, t: Duration) -> LeaseSettings {
        self.statement_timeout = Some(t);
        self
    }

    pub fn purge(mut self, after: Duration, every: Option<Duration>) -> LeaseSettings {
        self.purge = Some((after, every));
        self
    }

    pub fn auto_install(mut self, on: bool) -> LeaseSettings {
        self.auto_install = Some(on);
        self
    }

    pub fn declare(mut self, names: &[&str]) -> LeaseSettings {
        self.declare = names.iter().map(|n| n.to_string()).collect();
        self
    }
}

/// The error of a transaction's work that fails on purpose
/// ([`Backend::xact_count`]): a lock timeout of zero, which no real wait
/// gives.
pub fn work_failed(key: LockKey) -> Error {
    Error::Lock(pgwarden::LockError::Timeout {
        key,
        timeout: Duration::ZERO,
    })
}

/// The work of [`Backend::xact_count`]'s window: wide enough that
/// unserialised read-modify-writes would lose updates.
pub const WINDOW: Duration = Duration::from_millis(5);

/// Advisory locks held by the session that asks (a failed ask counts as
/// one: nothing may go unchecked).
const LOCKS_HERE: &str =
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()";

/// The settings of [`Settings`] a pool builder of either backend takes.
macro_rules! configured {
    ($b:expr, $s:expr) => {{
        let s: &Settings = $s;
        let mut b = $b
            .name(s.pool_name::<Self>())
            .wait_timeout(s.wait)
            .long_hold_threshold(s.long_hold)
            .housekeeping_interval(s.housekeeping)
            .policy(s.policy)
            .unlock_timeout(s.unlock_timeout)
            .pooler(s.pooler)
            .census_interval(s.census);
        if let Some(max) = s.budget {
            b = b.lane(Lane::SessionLock, 0, max);
        }
        if let Some((reserved, max)) = s.request {
            b = b.lane(Lane::Request, reserved, max);
        }
        b.build().expect("pool")
    }};
}

/// The lock methods every backend's pool and guard spell the same.
macro_rules! lock_methods {
    () => {
        #[track_caller]
        fn session_lock(
            pool: &Self::Pool,
            key: LockKey,
            mode: LockMode,
            wait: Option<Duration>,
        ) -> BoxFuture<'_, Result<Option<Self::Lock>, Error>> {
            Box::pin(pool.session_lock(key, mode, wait))
        }

        fn lock_pid(l: &Self::Lock) -> i32 {
            l.client().pid()
        }

        fn lock_again(l: &mut Self::Lock) -> BoxFuture<'_, Result<u32, Error>> {
            Box::pin(l.lock_again())
        }

        fn unlock_one(l: &mut Self::Lock) -> BoxFuture<'_, Result<u32, Error>> {
            Box::pin(l.unlock_one())
        }

        fn unlock(l: Self::Lock) -> BoxFuture<'static, Result<(), Error>> {
            Box::pin(l.unlock())
        }
    };
}

/// The ledger a fenced write goes to (see [`Backend::fenced_write`]): one
/// row per write, with the greatest token its transaction saw before it.
pub const LEDGER: &str =
    "CREATE TABLE ledger (name text NOT NULL, token int8 PRIMARY KEY, prev int8)";

/// The fenced write's statement.
const LEDGER_WRITE: &str = "INSERT INTO ledger (name, token, prev) \
     SELECT $1, $2, max(token) FROM ledger WHERE name = $1";

/// The lease calls, the same on every backend (`pgwarden::Leases<B>`'s
/// methods, resolved for each concrete `B`).
macro_rules! lease_methods {
    ($src:ty) => {
        type Leases = pgwarden::Leases<$src>;
        type Lease = pgwarden::Lease<$src>;

        fn leases(pool: &Self::Pool) -> Self::Leases {
            pgwarden::Leases::new(pool)
        }

        fn install(l: &Self::Leases) -> BoxFuture<'_, Result<bool, Error>> {
            Box::pin(l.install())
        }

        fn acquire<'a>(
            l: &'a Self::Leases,
            name: &'a str,
            opts: &'a LeaseOptions,
            wait: Option<Duration>,
        ) -> BoxFuture<'a, Result<Option<Self::Lease>, Error>> {
            Box::pin(l.acquire(name, opts, wait))
        }

        fn release(lease: Self::Lease) -> BoxFuture<'static, Result<(), Error>> {
            Box::pin(lease.release())
        }

        fn lease_stats(l: &Self::Leases) -> LeaseStats {
            l.stats()
        }

        fn rows(l: &Self::Leases) -> BoxFuture<'_, Result<Vec<LeaseRow>, Error>> {
            Box::pin(l.rows())
        }

        fn revoke<'a>(
            l: &'a Self::Leases,
            name: &'a str,
        ) -> BoxFuture<'a, Result<Option<LeaseRow>, Error>> {
            Box::pin(l.revoke(name))
        }

        fn release_all(l: &Self::Leases) -> BoxFuture<'_, Result<usize, Error>> {
            Box::pin(l.release_all())
        }

        fn run_job<'a, F, Fut, T>(
            l: &'a Self::Leases,
            name: &'a str,
            opts: &'a LeaseOptions,
            job: F,
        ) -> BoxFuture<'a, Result<Option<T>, Error>>
        where
            F: FnOnce(LeaseHandle) -> Fut + Send + 'a,
            Fut: std::future::Future<Output = T> + Send + 'a,
            T: Send + 'a,
        {
            Box::pin(l.run(name, opts, job))
        }

        fn run_token<'a>(
            l: &'a Self::Leases,
            name: &'a str,
            opts: &'a LeaseOptions,
        ) -> BoxFuture<'a, Result<Option<i64>, Error>> {
            Box::pin(l.run(name, opts, |lease| async move { lease.term().token }))
        }

        fn schedule(l: &Self::Leases, jobs: Vec<Job>) -> Result<Scheduler, Error> {
            jobs.into_iter()
                .fold(Scheduler::builder(l), |b, j| b.job(j))
                .start()
        }
    };
}

/// `Leases::builder(pool)` with its settings, the same on every backend.
macro_rules! bounded_leases {
    () => {
        fn leases_bounded(pool: &Self::Pool, statement_timeout: Duration) -> Self::Leases {
            let s = LeaseSettings::default().statement_timeout(statement_timeout);
            Self::leases_with(pool, &s).expect("leases")
        }

        fn leases_with(pool: &Self::Pool, s: &LeaseSettings) -> Result<Self::Leases, Error> {
            let mut b = pgwarden::Leases::builder(pool);
            if let Some(t) = &s.table {
                b = b.table(t.as_str());
            }
            if let Some(t) = s.statement_timeout {
                b = b.statement_timeout(t);
            }
            if let Some((after, every)) = s.purge {
                b = b.purge(after, every);
            }
            if let Some(on) = s.auto_install {
                b = b.auto_install(on);
            }
            if !s.declare.is_empty() {
                b = b.declare(s.declare.iter().map(String::as_str));
            }
            b.build()
        }

        fn lease_ddl(l: &Self::Leases) -> String {
            l.ddl()
        }

        fn schedule_node(l: &Self::Leases, node: &str, jobs: Vec<Job>) -> Result<Scheduler, Error> {
            Self::schedule_jittered(l, node, None, jobs)
        }

        fn schedule_jittered(
            l: &Self::Leases,
            node: &str,
            jitter: Option<Duration>,
            jobs: Vec<Job>,
        ) -> Result<Scheduler, Error> {
            let mut b = Scheduler::builder(l).node(node);
            if let Some(j) = jitter {
                b = b.poll_jitter(j);
            }
            jobs.into_iter().fold(b, |b, j| b.job(j)).start()
        }
    };
}

/// What every backend's `Client` answers the same way: its lane, pid,
/// site, age, discard; the pool's status and readiness.
macro_rules! common_methods {
    () => {
        fn lane(c: &Self::Conn) -> Lane {
            c.lane()
        }

        fn pid(c: &Self::Conn) -> i32 {
            c.pid()
        }

        fn site(c: &Self::Conn) -> &'static Location<'static> {
            c.site()
        }

        fn since(c: &Self::Conn) -> Instant {
            c.since()
        }

        fn discard(c: Self::Conn) {
            c.discard()
        }

        fn status(pool: &Self::Pool) -> Status {
            pool.status()
        }

        fn readiness(pool: &Self::Pool, t: Duration) -> BoxFuture<'_, Result<Duration, Error>> {
            Box::pin(pool.readiness(t))
        }

        #[track_caller]
        fn census(pool: &Self::Pool) -> BoxFuture<'_, Result<pgwarden::Census, Error>> {
            Box::pin(pool.census())
        }

        fn detect_pooler(pool: &Self::Pool) -> BoxFuture<'_, Result<PoolerMode, Error>> {
            Box::pin(pool.detect_pooler())
        }

        #[cfg(feature = "http")]
        fn app(pool: &Self::Pool, max_wait: Duration, bound: Duration) -> axum::Router {
            let work = axum::Router::new().route("/work", axum::routing::get(|| async { "done" }));
            Self::shed(pool, Some(max_wait), work).merge(Self::ready(pool, "/ready", Some(bound)))
        }

        #[cfg(feature = "http")]
        fn shed(
            pool: &Self::Pool,
            max_wait: Option<Duration>,
            routes: axum::Router,
        ) -> axum::Router {
            let layer = pgwarden::http::ShedLayer::new(pool);
            routes.layer(match max_wait {
                Some(w) => layer.max_wait(w),
                None => layer,
            })
        }

        #[cfg(feature = "http")]
        fn ready(pool: &Self::Pool, path: &str, bound: Option<Duration>) -> axum::Router {
            let r = pgwarden::http::Readiness::new(pool.clone());
            let r = match bound {
                Some(b) => r.bound(b),
                None => r,
            };
            axum::Router::new().route_service(path, r)
        }
    };
}

/// `GET path` on `app`, in process: its status and body.
#[cfg(feature = "http")]
pub async fn call(app: &axum::Router, path: &str) -> (u16, String) {
    use tower_service::Service as _;
    let req = axum::http::Request::get(path)
        .body(axum::body::Body::empty())
        .expect("request");
    let resp = app.clone().call(req).await.expect("infallible");
    let status = resp.status().as_u16();
    let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .expect("body");
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// sqlx's connect options for a test database (`$sqlx`: the sqlx crate).
#[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
macro_rules! sqlx_options {
    ($sqlx:ident, $db:expr) => {{
        let (host, socket, port, user, dbname) = $crate::support::backend::sqlx_target(&$db);
        let mut opts = $sqlx::postgres::PgConnectOptions::new_without_pgpass()
            .port(port)
            .username(&user)
            .database(&dbname);
        if let Some(h) = host {
            opts = opts.host(&h);
        }
        if let Some(s) = socket {
            opts = opts.socket(s);
        }
        opts
    }};
}

/// What helper E's block asks that every backend's pool and guard spell
/// the same.
macro_rules! more_methods {
    () => {
        fn lock_lane(l: &Self::Lock) -> Lane {
            l.client().lane()
        }

        fn pool_name(pool: &Self::Pool) -> String {
            pool.name().to_owned()
        }
    };
}

/// The deadpool pool.
pub struct Deadpool;

impl Backend for Deadpool {
    const NAME: &'static str = "deadpool";
    type Pool = pgwarden::Pool;
    type Conn = pgwarden::Client;
    type DropInError = deadpool_postgres::PoolError;

    fn build(db: &TestDb, s: &Settings) -> pgwarden::Pool {
        Self::with(
            pgwarden::Pool::builder(db.deadpool(s.size).expect("deadpool")),
            s,
        )
    }

    fn build_through(b: &PgBouncer, s: &Settings) -> pgwarden::Pool {
        Self::with(
            pgwarden::Pool::builder(b.deadpool(s.size).expect("deadpool")),
            s,
        )
    }

    fn build_watched(db: &TestDb, s: &Settings) -> (pgwarden::Pool, Arc<AtomicUsize>) {
        use deadpool_postgres::{Hook, RecyclingMethod};
        let found = Arc::new(AtomicUsize::new(0));
        let seen = found.clone();
        let dp = Self::inner(&db.pg_config(), s.size, RecyclingMethod::Fast)
            .post_recycle(Hook::async_fn(move |c, _| {
                let seen = seen.clone();
                Box::pin(async move {
                    let row = c.query_one(LOCKS_HERE, &[]).await;
                    // Printed: a failed ask counts as dirty, and says why.
                    if !matches!(&row, Ok(r) if r.get::<_, i64>(0) == 0) {
                        eprintln!("post_recycle: advisory locks here: {row:?}");
                    }
                    if row.map_or(true, |r| r.get::<_, i64>(0) > 0) {
                        seen.fetch_add(1, Ordering::AcqRel);
                    }
                    Ok(())
                })
            }))
            .build()
            .expect("deadpool");
        let b = pgwarden::Pool::builder(dp)
            .census_interval(None)
            .wait_timeout(Duration::from_secs(5));
        (configured!(b, s), found)
    }

    fn build_closing(db: &TestDb, s: &Settings) -> (pgwarden::Pool, Snapshotter, Arc<AtomicBool>) {
        use deadpool_postgres::{Hook, HookError, RecyclingMethod};
        let close = Arc::new(AtomicBool::new(false));
        let closing = close.clone();
        let dp = Self::inner(&db.pg_config(), s.size, RecyclingMethod::Fast)
            .pre_recycle(Hook::sync_fn(move |_, _| {
                if closing.load(Ordering::Acquire) {
                    return Err(HookError::message("closed by the test"));
                }
                Ok(())
            }))
            .build()
            .expect("deadpool");
        let recorder = DebuggingRecorder::new();
        let snap = recorder.snapshotter();
        let pool =
            metrics::with_local_recorder(&recorder, || Self::with(pgwarden::Pool::builder(dp), s));
        (pool, snap, close)
    }

    #[track_caller]
    fn get(
        pool: &pgwarden::Pool,
    ) -> BoxFuture<'_, Result<pgwarden::Client, deadpool_postgres::PoolError>> {
        Box::pin(pool.get())
    }

    #[track_caller]
    fn get_within(
        pool: &pgwarden::Pool,
        t: Duration,
    ) -> BoxFuture<'_, Result<pgwarden::Client, Error>> {
        Box::pin(pool.get_within(t))
    }

    fn is_drop_in_timeout(e: &deadpool_postgres::PoolError) -> bool {
        matches!(e, deadpool_postgres::PoolError::Timeout(_))
    }

    common_methods!();

    fn ask_pid(c: &mut pgwarden::Client) -> BoxFuture<'_, i32> {
        Box::pin(async move {
            c.query_one("SELECT pg_backend_pid()", &[])
                .await
                .expect("pid")
                .get(0)
        })
    }

    fn select_1(c: &mut pgwarden::Client) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            c.simple_query("SELECT 1").await.expect("SELECT 1");
        })
    }

    fn try_run<'a>(
        c: &'a mut pgwarden::Client,
        sql: &'static str,
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let text = |e| Error::Db(e).to_string();
            c.simple_query(sql).await.map(drop).map_err(text)
        })
    }

    fn count<'a>(c: &'a mut pgwarden::Client, sql: &'static str) -> BoxFuture<'a, i64> {
        Box::pin(async move { c.query_typed(sql, &[]).await.expect(sql)[0].get(0) })
    }

    fn close(pool: &pgwarden::Pool) -> BoxFuture<'_, ()> {
        pool.close();
        Box::pin(std::future::ready(()))
    }

    type Lock = pgwarden::SessionLock;

    lock_methods!();

    fn ask_lock_pid(l: &mut pgwarden::SessionLock) -> BoxFuture<'_, i32> {
        Box::pin(async move {
            let row = l.client().query_one("SELECT pg_backend_pid()", &[]).await;
            row.expect("pid").get(0)
        })
    }

    #[track_caller]
    fn xact_pid(
        pool: &pgwarden::Pool,
        key: LockKey,
        timeout: Duration,
        ran: Arc<AtomicUsize>,
    ) -> BoxFuture<'_, Result<i32, Error>> {
        Box::pin(pool.with_xact_lock(key, timeout, move |tx| {
            Box::pin(async move {
                ran.fetch_add(1, Ordering::AcqRel);
                let row = tx.query_one("SELECT pg_backend_pid()", &[]).await?;
                Ok::<_, Error>(row.get(0))
            })
        }))
    }

    #[track_caller]
    fn migrate<'p>(
        pool: &'p pgwarden::Pool,
        name: &'static str,
        timeout: Duration,
        ran: Arc<AtomicUsize>,
    ) -> BoxFuture<'p, Result<bool, Error>> {
        let done = pool.migrate_once(name, timeout, move |tx| {
            Box::pin(async move {
                ran.fetch_add(1, Ordering::AcqRel);
                tx.batch_execute("CREATE TABLE made (x int)").await?;
                Ok::<_, Error>(())
            })
        });
        Box::pin(async move { Ok(matches!(done.await?, Migrated::Ran(()))) })
    }

    lease_methods!(deadpool_postgres::Pool);

    fn fenced_write<'a>(
        pool: &'a pgwarden::Pool,
        lease: &'a LeaseHandle,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            let mut c = pool.get_within(Duration::from_secs(10)).await?;
            let tx = lease.fence(c.transaction().await?).await?;
            let name: &str = &lease.term().name;
            tx.execute(LEDGER_WRITE, &[&name, &lease.term().token])
                .await?;
            tx.commit().await
        })
    }
    const MULTI_HOST: bool = true;
    const ANNOUNCED_PID: bool = true;
    const STATEMENT_CACHE: bool = false;

    fn build_on(config: &tokio_postgres::Config, s: &Settings) -> pgwarden::Pool {
        let dp = pgwarden_testing::deadpool(config.clone(), s.size).expect("deadpool");
        Self::with(pgwarden::Pool::builder(dp), s)
    }

    fn scalar<'a>(
        c: &'a mut pgwarden::Client,
        sql: &'static str,
    ) -> BoxFuture<'a, Result<i64, String>> {
        Box::pin(async move {
            let text = |e| Error::Db(e).to_string();
            let row = c.query_one(sql, &[]).await.map_err(text)?;
            row.try_get(0).map_err(text)
        })
    }

    fn fenced_scalar<'a>(
        pool: &'a pgwarden::Pool,
        lease: &'a LeaseHandle,
        sql: &'static str,
        seq: i32,
    ) -> BoxFuture<'a, Result<i64, Error>> {
        Box::pin(async move {
            let mut c = pool.get().await?;
            let tx = lease.fence(c.transaction().await?).await?;
            let t = lease.term();
            let row = tx
                .query_one(sql, &[&t.name.as_str(), &t.token, &seq, &t.holder.as_str()])
                .await?;
            tx.commit().await?;
            Ok(row.try_get(0)?)
        })
    }

    fn is_connection_lost(e: &Error) -> bool {
        matches!(e, Error::Db(e) if e.is_closed())
    }

    bounded_leases!();

    #[track_caller]
    fn xact_count(
        pool: &pgwarden::Pool,
        key: LockKey,
        timeout: Duration,
        fail: bool,
    ) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(pool.with_xact_lock(key, timeout, move |tx| {
            Box::pin(async move {
                let n: i32 = tx.query_one("SELECT n FROM counter", &[]).await?.get(0);
                tokio::time::sleep(WINDOW).await;
                tx.execute("UPDATE counter SET n = $1", &[&(n + 1)]).await?;
                if fail {
                    return Err(work_failed(key));
                }
                Ok(())
            })
        }))
    }

    #[track_caller]
    fn migrate_failing<'p>(
        pool: &'p pgwarden::Pool,
        name: &'static str,
        timeout: Duration,
    ) -> BoxFuture<'p, Result<bool, Error>> {
        let done = pool.migrate_once(name, timeout, |tx| {
            Box::pin(async move {
                tx.batch_execute("CREATE TABLE made (x int)").await?;
                tx.batch_execute("SELECT no_such_column FROM made").await?;
                Ok::<_, Error>(())
            })
        });
        Box::pin(async move { Ok(matches!(done.await?, Migrated::Ran(()))) })
    }

    fn lock_sql<'a>(
        l: &'a mut pgwarden::SessionLock,
        sql: &'static str,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move { Ok(l.client().batch_execute(sql).await?) })
    }
    fn code(e: &Error) -> Option<String> {
        match e {
            Error::Db(e) => e.code().map(|c| c.code().to_owned()),
            _ => None,
        }
    }

    type TxSource = pgwarden::Client;

    fn tx_source(pool: &pgwarden::Pool) -> BoxFuture<'_, pgwarden::Client> {
        Box::pin(async move { pool.get().await.expect("checkout") })
    }

    type Tx<'c> = deadpool_postgres::Transaction<'c>;

    fn begin(
        s: &mut pgwarden::Client,
        level: Option<IsolationLevel>,
    ) -> BoxFuture<'_, deadpool_postgres::Transaction<'_>> {
        Box::pin(async move {
            let mut b = s.build_transaction();
            if let Some(level) = level {
                b = b.isolation_level(level);
            }
            b.start().await.expect("BEGIN")
        })
    }

    fn tx_run<'a>(
        tx: &'a mut deadpool_postgres::Transaction<'_>,
        sql: &'static str,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move { Ok(tx.batch_execute(sql).await?) })
    }

    type Fenced<'c> = pgwarden::Fenced<'c>;

    fn fence<'c>(
        lease: &LeaseHandle,
        tx: Self::Tx<'c>,
    ) -> BoxFuture<'c, Result<Self::Fenced<'c>, Error>> {
        let lease = lease.clone();
        Box::pin(async move { lease.fence(tx).await })
    }

    fn fx_run<'a>(
        tx: &'a mut pgwarden::Fenced<'_>,
        sql: &'static str,
        arg: Option<i64>,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            match arg {
                Some(arg) => tx.execute(sql, &[&arg]).await.map(drop)?,
                None => tx.batch_execute(sql).await?,
            }
            Ok(())
        })
    }

    fn fx_text<'a>(
        tx: &'a mut pgwarden::Fenced<'_>,
        sql: &'static str,
    ) -> BoxFuture<'a, Result<String, Error>> {
        Box::pin(async move { Ok(tx.query_one(sql, &[]).await?.get(0)) })
    }

    fn fx_check<'a>(tx: &'a mut pgwarden::Fenced<'_>) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(tx.check())
    }

    fn fx_commit(tx: Self::Fenced<'_>) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(tx.commit())
    }

    more_methods!();

    fn tx_xact_lock<'a>(
        tx: &'a mut deadpool_postgres::Transaction<'_>,
        key: LockKey,
        mode: LockMode,
        wait: Option<Duration>,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(pgwarden::xact_lock(tx, key, mode, wait))
    }

    fn tx_text<'a>(
        tx: &'a mut deadpool_postgres::Transaction<'_>,
        sql: &'static str,
    ) -> BoxFuture<'a, Result<String, Error>> {
        Box::pin(async move { Ok(tx.query_one(sql, &[]).await?.try_get(0)?) })
    }

    fn tx_commit(tx: Self::Tx<'_>) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move { Ok(tx.commit().await?) })
    }

    fn tx_rollback(tx: Self::Tx<'_>) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move { Ok(tx.rollback().await?) })
    }

    fn build_named(db: &TestDb, size: usize, name: Option<&str>) -> pgwarden::Pool {
        let b = pgwarden::Pool::builder(db.deadpool(size).expect("deadpool"));
        match name {
            Some(n) => b.name(n),
            None => b,
        }
        .build()
        .expect("pool")
    }

    fn build_checked(config: &tokio_postgres::Config, s: &Settings) -> pgwarden::Pool {
        let dp = Self::inner(config, s.size, deadpool_postgres::RecyclingMethod::Verified)
            .build()
            .expect("deadpool");
        Self::with(pgwarden::Pool::builder(dp), s)
    }

    fn source_code(e: &(dyn std::error::Error + 'static)) -> Option<String> {
        std::iter::successors(Some(e), |e| e.source())
            .find_map(|e| e.downcast_ref::<tokio_postgres::Error>()?.code())
            .map(|c| c.code().to_owned())
    }
}

impl Deadpool {
    /// A deadpool pool's builder of `size` on `config`, recycling by `method`.
    fn inner(
        config: &tokio_postgres::Config,
        size: usize,
        method: deadpool_postgres::RecyclingMethod,
    ) -> deadpool_postgres::PoolBuilder {
        let manager = deadpool_postgres::Manager::from_config(
            config.clone(),
            tokio_postgres::NoTls,
            deadpool_postgres::ManagerConfig {
                recycling_method: method,
            },
        );
        deadpool_postgres::Pool::builder(manager)
            .max_size(size)
            .runtime(deadpool_postgres::Runtime::Tokio1)
    }

    /// The settings on a deadpool builder.
    fn with(b: pgwarden::PoolBuilder, s: &Settings) -> pgwarden::Pool {
        configured!(b, s)
    }
}

/// The sqlx connect options of `cfg` (a socket directory or a host).
#[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
pub fn sqlx_target(
    cfg: &tokio_postgres::Config,
) -> (
    Option<String>,
    Option<std::path::PathBuf>,
    u16,
    String,
    String,
) {
    let (host, socket) = match cfg.get_hosts().first() {
        Some(tokio_postgres::config::Host::Unix(p)) => (None, Some(p.clone())),
        Some(tokio_postgres::config::Host::Tcp(h)) => (Some(h.clone()), None),
        None => (Some("localhost".into()), None),
    };
    let port = cfg.get_ports().first().copied().unwrap_or(5432);
    let user = cfg.get_user().unwrap_or("postgres").to_owned();
    let dbname = cfg.get_dbname().unwrap_or("postgres").to_owned();
    (host, socket, port, user, dbname)
}

/// The `name=value` pairs of a libpq `options` string (`-c name=value`
/// or `-cname=value`, space-separated), as sqlx's `options` takes them.
#[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
pub fn command_line_settings(options: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut words = options.split_whitespace();
    while let Some(w) = words.next() {
        let pair = match w.strip_prefix("-c") {
            Some("") => words.next().unwrap_or_default(),
            Some(rest) => rest,
            None => panic!("options: only -c name=value is supported, got {w:?}"),
        };
        let (name, value) = pair.split_once('=').expect("options: -c name=value");
        out.push((name.to_owned(), value.to_owned()));
    }
    out
}

/// The backend of one sqlx version: `$sqlx` the sqlx crate, `$pg` the
/// pgwarden module over it (one source for both versions).
#[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
macro_rules! sqlx_backend {
    ($backend:ident, $sqlx:ident, $($pg:ident)::+) => {
        pub struct $backend;

        impl Backend for $backend {
            const NAME: &'static str = stringify!($sqlx);
            type Pool = $($pg)::+::Pool;
            type Conn = $($pg)::+::PoolConnection;
            type DropInError = $sqlx::Error;

            fn build(db: &TestDb, s: &Settings) -> Self::Pool {
                let opts = sqlx_options!($sqlx, db.pg_config());
                Self::with(Self::cache(opts, s.statement_cache.unwrap_or(true)), s)
            }

            fn build_through(b: &PgBouncer, s: &Settings) -> Self::Pool {
                let opts = sqlx_options!($sqlx, b.pg_config())
                    .ssl_mode($sqlx::postgres::PgSslMode::Disable);
                Self::with(Self::cache(opts, s.statement_cache.unwrap_or(false)), s)
            }

            fn build_watched(db: &TestDb, s: &Settings) -> (Self::Pool, Arc<AtomicUsize>) {
                let found = Arc::new(AtomicUsize::new(0));
                let seen = found.clone();
                let opts = sqlx_options!($sqlx, db.pg_config());
                let pg = $sqlx::postgres::PgPoolOptions::new()
                    .max_connections(s.size as u32)
                    .after_release(move |c, _| {
                        let seen = seen.clone();
                        Box::pin(async move {
                            let n = $sqlx::query_scalar::<_, i64>(LOCKS_HERE)
                                .fetch_one(&mut *c)
                                .await;
                            // Printed: a failed ask counts as dirty, and says why.
                            if !matches!(n, Ok(0)) {
                                eprintln!("after_release: advisory locks here: {n:?}");
                            }
                            if n.map_or(true, |n| n > 0) {
                                seen.fetch_add(1, Ordering::AcqRel);
                            }
                            Ok(true)
                        })
                    })
                    .connect_lazy_with(opts);
                (configured!($($pg)::+::Pool::builder(pg), s), found)
            }

            fn build_closing(
                db: &TestDb,
                s: &Settings,
            ) -> (Self::Pool, Snapshotter, Arc<AtomicBool>) {
                let close = Arc::new(AtomicBool::new(false));
                let closing = close.clone();
                let opts = sqlx_options!($sqlx, db.pg_config());
                let pg = Self::options(s)
                    .after_release(move |_, _| {
                        let keep = !closing.load(Ordering::Acquire);
                        Box::pin(async move { Ok(keep) })
                    })
                    .connect_lazy_with(Self::cache(opts, s.statement_cache.unwrap_or(true)));
                let recorder = DebuggingRecorder::new();
                let snap = recorder.snapshotter();
                let pool = metrics::with_local_recorder(&recorder, || {
                    configured!($($pg)::+::Pool::builder(pg), s)
                });
                (pool, snap, close)
            }

            #[track_caller]
            fn get(pool: &Self::Pool) -> BoxFuture<'_, Result<Self::Conn, $sqlx::Error>> {
                Box::pin(pool.acquire())
            }

            #[track_caller]
            fn get_within(
                pool: &Self::Pool,
                t: Duration,
            ) -> BoxFuture<'_, Result<Self::Conn, Error>> {
                Box::pin(pool.acquire_within(t))
            }

            fn is_drop_in_timeout(e: &$sqlx::Error) -> bool {
                matches!(e, $sqlx::Error::PoolTimedOut)
            }

            common_methods!();

            fn ask_pid(c: &mut Self::Conn) -> BoxFuture<'_, i32> {
                Box::pin(async move {
                    $sqlx::query_scalar("SELECT pg_backend_pid()")
                        .fetch_one(&mut **c)
                        .await
                        .expect("pid")
                })
            }

            fn select_1(c: &mut Self::Conn) -> BoxFuture<'_, ()> {
                Box::pin(async move {
                    $sqlx::query("SELECT 1")
                        .execute(&mut **c)
                        .await
                        .expect("SELECT 1");
                })
            }

            // A simple query, as deadpool's `run`: one message, so behind a
            // transaction pooler it cannot be split between two server
            // connections (sqlx's unnamed statement goes in two syncs; a
            // test's own statement got 26000 there once under load).
            fn try_run<'a>(
                c: &'a mut Self::Conn,
                sql: &'static str,
            ) -> BoxFuture<'a, Result<(), String>> {
                Box::pin(async move {
                    let c: &mut $sqlx::PgConnection = &mut **c;
                    $sqlx::Executor::execute(c, $sqlx::raw_sql(sql))
                        .await
                        .map(drop)
                        .map_err(|e| e.to_string())
                })
            }

            fn count<'a>(c: &'a mut Self::Conn, sql: &'static str) -> BoxFuture<'a, i64> {
                Box::pin(async move {
                    $sqlx::query_scalar(sql)
                        .persistent(false)
                        .fetch_one(&mut **c)
                        .await
                        .expect(sql)
                })
            }

            fn close(pool: &Self::Pool) -> BoxFuture<'_, ()> {
                Box::pin(pool.close())
            }

            type Lock = pgwarden::SessionLock<$sqlx::PgPool>;

            lock_methods!();

            fn ask_lock_pid(l: &mut Self::Lock) -> BoxFuture<'_, i32> {
                Box::pin(async move {
                    $sqlx::query_scalar("SELECT pg_backend_pid()")
                        .fetch_one(l.conn_mut())
                        .await
                        .expect("pid")
                })
            }

            #[track_caller]
            fn xact_pid(
                pool: &Self::Pool,
                key: LockKey,
                timeout: Duration,
                ran: Arc<AtomicUsize>,
            ) -> BoxFuture<'_, Result<i32, Error>> {
                Box::pin(pool.with_xact_lock(key, timeout, move |tx| {
                    Box::pin(async move {
                        ran.fetch_add(1, Ordering::AcqRel);
                        // Unnamed: it runs behind PgBouncer too.
                        let pid = $sqlx::query_scalar("SELECT pg_backend_pid()")
                            .persistent(false)
                            .fetch_one(tx)
                            .await
                            .map_err(|e| Error::Sqlx(Box::new(e)))?;
                        Ok::<_, Error>(pid)
                    })
                }))
            }

            #[track_caller]
            fn migrate<'p>(
                pool: &'p Self::Pool,
                name: &'static str,
                timeout: Duration,
                ran: Arc<AtomicUsize>,
            ) -> BoxFuture<'p, Result<bool, Error>> {
                let done = pool.migrate_once(name, timeout, move |tx| {
                    Box::pin(async move {
                        ran.fetch_add(1, Ordering::AcqRel);
                        // Unnamed: it runs behind PgBouncer too.
                        $sqlx::query("CREATE TABLE made (x int)")
                            .persistent(false)
                            .execute(tx)
                            .await
                            .map_err(|e| Error::Sqlx(Box::new(e)))?;
                        Ok::<_, Error>(())
                    })
                });
                Box::pin(async move { Ok(matches!(done.await?, Migrated::Ran(()))) })
            }

            lease_methods!($sqlx::PgPool);

            fn fenced_write<'a>(
                pool: &'a Self::Pool,
                lease: &'a LeaseHandle,
            ) -> BoxFuture<'a, Result<(), Error>> {
                Box::pin(async move {
                    let tx = pool.begin().await.expect("begin");
                    let mut tx = lease.fence(tx).await?;
                    let name: &str = &lease.term().name;
                    $sqlx::query(LEDGER_WRITE)
                        .bind(name)
                        .bind(lease.term().token)
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| Error::Sqlx(Box::new(e)))?;
                    tx.commit().await
                })
            }
            const MULTI_HOST: bool = false;
            const ANNOUNCED_PID: bool = false;
            const STATEMENT_CACHE: bool = true;

            fn build_on(config: &tokio_postgres::Config, s: &Settings) -> Self::Pool {
                assert_eq!(config.get_hosts().len(), 1, "sqlx connects to one host");
                let mut opts = sqlx_options!($sqlx, config);
                if let Some(app) = config.get_application_name() {
                    opts = opts.application_name(app);
                }
                // `options` (`-c name=value …`): run-time settings, such as
                // a search path.
                if let Some(o) = config.get_options() {
                    opts = opts.options(command_line_settings(o));
                }
                Self::with(opts, s)
            }

            fn scalar<'a>(
                c: &'a mut Self::Conn,
                sql: &'static str,
            ) -> BoxFuture<'a, Result<i64, String>> {
                Box::pin(async move {
                    $sqlx::query_scalar(sql)
                        .fetch_one(&mut **c)
                        .await
                        .map_err(|e| e.to_string())
                })
            }

            fn fenced_scalar<'a>(
                pool: &'a Self::Pool,
                lease: &'a LeaseHandle,
                sql: &'static str,
                seq: i32,
            ) -> BoxFuture<'a, Result<i64, Error>> {
                let sqlx_err = |e: $sqlx::Error| Error::Sqlx(Box::new(e));
                Box::pin(async move {
                    let tx = pool.begin().await.map_err(sqlx_err)?;
                    let mut tx = lease.fence(tx).await?;
                    let t = lease.term();
                    let n = $sqlx::query_scalar(sql)
                        .bind(t.name.as_str())
                        .bind(t.token)
                        .bind(seq)
                        .bind(t.holder.as_str())
                        .fetch_one(&mut *tx)
                        .await
                        .map_err(sqlx_err)?;
                    tx.commit().await?;
                    Ok(n)
                })
            }

            fn is_connection_lost(e: &Error) -> bool {
                matches!(e, Error::Sqlx(e) if matches!(
                    e.downcast_ref::<$sqlx::Error>(),
                    Some($sqlx::Error::Io(_) | $sqlx::Error::WorkerCrashed)
                ))
            }

            bounded_leases!();

            #[track_caller]
            fn xact_count(
                pool: &Self::Pool,
                key: LockKey,
                timeout: Duration,
                fail: bool,
            ) -> BoxFuture<'_, Result<(), Error>> {
                let sqlx_err = |e: $sqlx::Error| Error::Sqlx(Box::new(e));
                Box::pin(pool.with_xact_lock(key, timeout, move |tx| {
                    Box::pin(async move {
                        // Unnamed: it runs behind PgBouncer too (sqlx 0.8
                        // names a statement even with its cache off).
                        let n: i32 = $sqlx::query_scalar("SELECT n FROM counter")
                            .persistent(false)
                            .fetch_one(&mut *tx)
                            .await
                            .map_err(sqlx_err)?;
                        tokio::time::sleep(WINDOW).await;
                        $sqlx::query("UPDATE counter SET n = $1")
                            .bind(n + 1)
                            .persistent(false)
                            .execute(&mut *tx)
                            .await
                            .map_err(sqlx_err)?;
                        if fail {
                            return Err(work_failed(key));
                        }
                        Ok(())
                    })
                }))
            }

            #[track_caller]
            fn migrate_failing<'p>(
                pool: &'p Self::Pool,
                name: &'static str,
                timeout: Duration,
            ) -> BoxFuture<'p, Result<bool, Error>> {
                let sqlx_err = |e: $sqlx::Error| Error::Sqlx(Box::new(e));
                let done = pool.migrate_once(name, timeout, move |tx| {
                    Box::pin(async move {
                        $sqlx::query("CREATE TABLE made (x int)")
                            .execute(&mut *tx)
                            .await
                            .map_err(sqlx_err)?;
                        $sqlx::query("SELECT no_such_column FROM made")
                            .execute(&mut *tx)
                            .await
                            .map_err(sqlx_err)?;
                        Ok::<_, Error>(())
                    })
                });
                Box::pin(async move { Ok(matches!(done.await?, Migrated::Ran(()))) })
            }

            fn lock_sql<'a>(
                l: &'a mut Self::Lock,
                sql: &'static str,
            ) -> BoxFuture<'a, Result<(), Error>> {
                Box::pin(async move {
                    $sqlx::query(sql)
                        .persistent(false)
                        .execute(l.conn_mut())
                        .await
                        .map(drop)
                        .map_err(|e| Error::Sqlx(Box::new(e)))
                })
            }

            fn code(e: &Error) -> Option<String> {
                let Error::Sqlx(e) = e else { return None };
                let db = e.downcast_ref::<$sqlx::Error>()?.as_database_error()?;
                db.code().map(|c| c.into_owned())
            }

            type TxSource = Self::Pool;

            fn tx_source(pool: &Self::Pool) -> BoxFuture<'_, Self::Pool> {
                Box::pin(std::future::ready(pool.clone()))
            }

            type Tx<'c> = $($pg)::+::Transaction;

            fn begin(
                s: &mut Self::Pool,
                level: Option<IsolationLevel>,
            ) -> BoxFuture<'_, $($pg)::+::Transaction> {
                Box::pin(async move {
                    let mut tx = s.begin().await.expect("BEGIN");
                    let set = match level {
                        None => return tx,
                        Some(IsolationLevel::Serializable) => {
                            "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE"
                        }
                        Some(IsolationLevel::RepeatableRead) => {
                            "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"
                        }
                        Some(IsolationLevel::ReadCommitted) => {
                            "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"
                        }
                        Some(level) => panic!("{level:?}"),
                    };
                    $sqlx::query(set)
                        .persistent(false)
                        .execute(&mut *tx)
                        .await
                        .expect(set);
                    tx
                })
            }

            fn tx_run<'a>(
                tx: &'a mut $($pg)::+::Transaction,
                sql: &'static str,
            ) -> BoxFuture<'a, Result<(), Error>> {
                Box::pin(async move {
                    $sqlx::query(sql)
                        .persistent(false)
                        .execute(&mut **tx)
                        .await
                        .map(drop)
                        .map_err(|e| Error::Sqlx(Box::new(e)))
                })
            }

            type Fenced<'c> = pgwarden::Fenced<'c, $($pg)::+::Transaction>;

            fn fence<'c>(
                lease: &LeaseHandle,
                tx: Self::Tx<'c>,
            ) -> BoxFuture<'c, Result<Self::Fenced<'c>, Error>> {
                let lease = lease.clone();
                Box::pin(async move { lease.fence(tx).await })
            }

            fn fx_run<'a>(
                tx: &'a mut Self::Fenced<'_>,
                sql: &'static str,
                arg: Option<i64>,
            ) -> BoxFuture<'a, Result<(), Error>> {
                Box::pin(async move {
                    let q = $sqlx::query(sql).persistent(false);
                    let q = match arg {
                        Some(arg) => q.bind(arg),
                        None => q,
                    };
                    q.execute(&mut **tx)
                        .await
                        .map(drop)
                        .map_err(|e| Error::Sqlx(Box::new(e)))
                })
            }

            fn fx_text<'a>(
                tx: &'a mut Self::Fenced<'_>,
                sql: &'static str,
            ) -> BoxFuture<'a, Result<String, Error>> {
                Self::text(&mut **tx, sql)
            }

            fn fx_check<'a>(tx: &'a mut Self::Fenced<'_>) -> BoxFuture<'a, Result<(), Error>> {
                Box::pin(tx.check())
            }

            fn fx_commit(tx: Self::Fenced<'_>) -> BoxFuture<'_, Result<(), Error>> {
                Box::pin(tx.commit())
            }

            more_methods!();

            fn tx_xact_lock<'a>(
                tx: &'a mut Self::Tx<'_>,
                key: LockKey,
                mode: LockMode,
                wait: Option<Duration>,
            ) -> BoxFuture<'a, Result<bool, Error>> {
                Box::pin($($pg)::+::xact_lock(&mut **tx, key, mode, wait))
            }

            fn tx_text<'a>(
                tx: &'a mut Self::Tx<'_>,
                sql: &'static str,
            ) -> BoxFuture<'a, Result<String, Error>> {
                Self::text(&mut **tx, sql)
            }

            fn tx_commit(tx: Self::Tx<'_>) -> BoxFuture<'_, Result<(), Error>> {
                Box::pin(async move { tx.commit().await.map_err(|e| Error::Sqlx(Box::new(e))) })
            }

            fn tx_rollback(tx: Self::Tx<'_>) -> BoxFuture<'_, Result<(), Error>> {
                Box::pin(async move { tx.rollback().await.map_err(|e| Error::Sqlx(Box::new(e))) })
            }

            fn build_named(db: &TestDb, size: usize, name: Option<&str>) -> Self::Pool {
                let pg = $sqlx::postgres::PgPoolOptions::new()
                    .max_connections(size as u32)
                    .connect_lazy_with(sqlx_options!($sqlx, db.pg_config()));
                let b = $($pg)::+::Pool::builder(pg);
                match name {
            Some(n) => b.name(n),
            None => b,
        }
        .build()
        .expect("pool")
            }

            fn build_checked(config: &tokio_postgres::Config, s: &Settings) -> Self::Pool {
                // `test_before_acquire` is sqlx's default: `build_on`'s pool.
                Self::build_on(config, s)
            }

            fn source_code(e: &(dyn std::error::Error + 'static)) -> Option<String> {
                std::iter::successors(Some(e), |e| e.source()).find_map(|e| {
                    let db = e.downcast_ref::<$sqlx::Error>()?.as_database_error()?;
                    db.code().map(|c| c.into_owned())
                })
            }
        }

        impl $backend {
            /// `sql`'s one `text` (unnamed) on `c`.
            fn text<'a>(
                c: &'a mut $sqlx::PgConnection,
                sql: &'static str,
            ) -> BoxFuture<'a, Result<String, Error>> {
                Box::pin(async move {
                    $sqlx::query_scalar(sql)
                        .persistent(false)
                        .fetch_one(c)
                        .await
                        .map_err(|e| Error::Sqlx(Box::new(e)))
                })
            }

            /// `opts` with sqlx's statement cache off unless `on`.
            fn cache(
                opts: $sqlx::postgres::PgConnectOptions,
                on: bool,
            ) -> $sqlx::postgres::PgConnectOptions {
                if on {
                    opts
                } else {
                    opts.statement_cache_capacity(0)
                }
            }

            /// The settings on a sqlx pool over `opts`.
            fn with(opts: $sqlx::postgres::PgConnectOptions, s: &Settings) -> $($pg)::+::Pool {
                let pg = Self::options(s).connect_lazy_with(opts);
                configured!($($pg)::+::Pool::builder(pg), s)
            }

            /// sqlx's pool options of `s`: its size, and whether an idle
            /// connection is tested before it is handed out.
            fn options(s: &Settings) -> $sqlx::postgres::PgPoolOptions {
                $sqlx::postgres::PgPoolOptions::new()
                    .max_connections(s.size as u32)
                    .test_before_acquire(!s.unchecked)
            }
        }
    };
}

#[cfg(all(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
sqlx_backend!(Sqlx08, sqlx08, pgwarden::sqlx_0_8);
#[cfg(all(feature = "sqlx-0_8", not(feature = "sqlx-0_9")))]
sqlx_backend!(Sqlx08, sqlx08, pgwarden::sqlx);
#[cfg(feature = "sqlx-0_9")]
sqlx_backend!(Sqlx09, sqlx09, pgwarden::sqlx);

/// A pool of backend `B` on `db` whose backends are named
/// `<app>-<backend>` in `pg_stat_activity.application_name` (the variants
/// of a test run at once on one server): the pool and that name.
pub fn named<B: Backend>(db: &TestDb, app: &str, s: &Settings) -> (B::Pool, String) {
    let app = format!("{app}-{}", B::NAME);
    let mut config = db.pg_config();
    config.application_name(&app);
    (B::build_on(&config, s), app)
}

/// `Leases::new` on a pool of `size` of backend `B` on `config` (a
/// database, PgBouncer, a proxy), the pool named `app` and its backends
/// `<app>-<backend>` in `pg_stat_activity.application_name`: the leases
/// and that name.
pub fn leases_on<B: Backend>(
    config: &tokio_postgres::Config,
    app: &str,
    size: usize,
) -> (B::Leases, String) {
    let (pool, app_b) = pool_on::<B>(config, app, size);
    (B::leases(&pool), app_b)
}

/// A pool of `size` of backend `B` on `config` (a database, another role,
/// PgBouncer, a proxy), named `app` and its backends `<app>-<backend>` in
/// `pg_stat_activity.application_name`: the pool and that name.
pub fn pool_on<B: Backend>(
    config: &tokio_postgres::Config,
    app: &str,
    size: usize,
) -> (B::Pool, String) {
    let app_b = format!("{app}-{}", B::NAME);
    let mut config = config.clone();
    config.application_name(&app_b);
    let name: &'static str = Box::leak(app.to_owned().into_boxed_str());
    (B::build_on(&config, &Settings::new(name, size)), app_b)
}

/// Waits (on the pool's state, not a clock) until nothing is in use or
/// waiting: a sqlx connection's return finishes in a task of its own.
pub async fn settled<B: Backend>(pool: &B::Pool) {
    super::eventually(Duration::from_secs(10), "nothing in use or waiting", || {
        let s = B::status(pool);
        std::future::ready(s.in_use == 0 && s.waiting == 0)
    })
    .await
}

/// One `#[tokio::test]` per backend from the generic `async fn $name<B>()`:
/// `$name::deadpool`, and with their features `$name::sqlx_0_8` and
/// `$name::sqlx_0_9`.
macro_rules! backends {
    // A plain `#[test]` per backend: `$name::<B>()` runs its own runtimes.
    (sync, $name:ident) => {
        mod $name {
            #[test]
            fn deadpool() {
                super::$name::<crate::support::backend::Deadpool>()
            }

            #[cfg(feature = "sqlx-0_8")]
            #[test]
            fn sqlx_0_8() {
                super::$name::<crate::support::backend::Sqlx08>()
            }

            #[cfg(feature = "sqlx-0_9")]
            #[test]
            fn sqlx_0_9() {
                super::$name::<crate::support::backend::Sqlx09>()
            }
        }
    };
    // A plain `#[test]` per backend, the sqlx ones ignored (why: a FINDING).
    (sync, ignore_sqlx = $why:literal, $name:ident) => {
        mod $name {
            #[test]
            fn deadpool() {
                super::$name::<crate::support::backend::Deadpool>()
            }

            #[cfg(feature = "sqlx-0_8")]
            #[ignore = $why]
            #[test]
            fn sqlx_0_8() {
                super::$name::<crate::support::backend::Sqlx08>()
            }

            #[cfg(feature = "sqlx-0_9")]
            #[ignore = $why]
            #[test]
            fn sqlx_0_9() {
                super::$name::<crate::support::backend::Sqlx09>()
            }
        }
    };
    // Every variant ignored, with the open bug that makes them fail.
    (ignore_all = $why:literal, $name:ident $(, $($flavor:tt)*)?) => {
        mod $name {
            #[ignore = $why]
            #[tokio::test $( ( $($flavor)* ) )?]
            async fn deadpool() {
                super::$name::<crate::support::backend::Deadpool>().await
            }

            #[cfg(feature = "sqlx-0_8")]
            #[ignore = $why]
            #[tokio::test $( ( $($flavor)* ) )?]
            async fn sqlx_0_8() {
                super::$name::<crate::support::backend::Sqlx08>().await
            }

            #[cfg(feature = "sqlx-0_9")]
            #[ignore = $why]
            #[tokio::test $( ( $($flavor)* ) )?]
            async fn sqlx_0_9() {
                super::$name::<crate::support::backend::Sqlx09>().await
            }
        }
    };
    // A soak (a loaded server or pooler for `POOLER_TRIES` detections, or
    // `H3_SOAK_SECS` of racing): deadpool, and sqlx at the newest version compiled in. With
    // both sqlx versions on (`--all-features`) the 0.8 variant is ignored
    // (`cargo test --all-features -- --ignored sqlx_0_8_soak` runs it): the same
    // source against the other sqlx, whose every other test runs. The six
    // soaks' 0.8 variants (pooler load and session, census load, the fence
    // soak) took 14 to 54 s each, 187 of the 1,495 test-seconds of
    // `tests/it` (2026-12-04, 4 threads). With 0.8 alone it runs.
    (soak, $name:ident $(, $($flavor:tt)*)?) => {
        mod $name {
            #[tokio::test $( ( $($flavor)* ) )?]
            async fn deadpool() {
                super::$name::<crate::support::backend::Deadpool>().await
            }

            #[cfg(feature = "sqlx-0_8")]
            #[cfg_attr(
                feature = "sqlx-0_9",
                ignore = "soak: runs on deadpool and sqlx 0.9; `-- --ignored sqlx_0_8_soak` runs it on 0.8"
            )]
            #[tokio::test $( ( $($flavor)* ) )?]
            async fn sqlx_0_8_soak() {
                super::$name::<crate::support::backend::Sqlx08>().await
            }

            #[cfg(feature = "sqlx-0_9")]
            #[tokio::test $( ( $($flavor)* ) )?]
            async fn sqlx_0_9() {
                super::$name::<crate::support::backend::Sqlx09>().await
            }
        }
    };
    // The sqlx variants ignored, with the open bug that makes them fail.
    (ignore_sqlx = $why:literal, $name:ident $(, $($flavor:tt)*)?) => {
        mod $name {
            #[tokio::test $( ( $($flavor)* ) )?]
            async fn deadpool() {
                super::$name::<crate::support::backend::Deadpool>().await
            }

            #[cfg(feature = "sqlx-0_8")]
            #[ignore = $why]
            #[tokio::test $( ( $($flavor)* ) )?]
            async fn sqlx_0_8() {
                super::$name::<crate::support::backend::Sqlx08>().await
            }

            #[cfg(feature = "sqlx-0_9")]
            #[ignore = $why]
            #[tokio::test $( ( $($flavor)* ) )?]
            async fn sqlx_0_9() {
                super::$name::<crate::support::backend::Sqlx09>().await
            }
        }
    };
    ($name:ident $(, $($flavor:tt)*)?) => {
        mod $name {
            #[tokio::test $( ( $($flavor)* ) )?]
            async fn deadpool() {
                super::$name::<crate::support::backend::Deadpool>().await
            }

            #[cfg(feature = "sqlx-0_8")]
            #[tokio::test $( ( $($flavor)* ) )?]
            async fn sqlx_0_8() {
                super::$name::<crate::support::backend::Sqlx08>().await
            }

            #[cfg(feature = "sqlx-0_9")]
            #[tokio::test $( ( $($flavor)* ) )?]
            async fn sqlx_0_9() {
                super::$name::<crate::support::backend::Sqlx09>().await
            }
        }
    };
}
