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
use std::time::{Duration, Instant};

use std::ops::Deref;

use futures_util::future::BoxFuture;
use metrics_util::debugging::{DebuggingRecorder, Snapshotter};
use pgwarden::lease::LeaseRow;
use pgwarden::{Error, Job, Lane, LeaseHandle, LeaseOptions, LeaseStats, Scheduler, Status};
use pgwarden_testing::TestDb;

/// A pool's settings, as a test gives them to any backend.
#[derive(Clone, Debug)]
pub struct Settings {
    pub name: &'static str,
    pub size: usize,
    pub wait: Duration,
    pub long_hold: Duration,
    pub housekeeping: Duration,
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
        }
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
    type DropInError: fmt::Debug + fmt::Display + Send + 'static;

    /// Builds a pool on `db` (no connection made yet).
    fn build(db: &TestDb, s: &Settings) -> Self::Pool;

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

    fn status(pool: &Self::Pool) -> Status;
    fn readiness(pool: &Self::Pool, t: Duration) -> BoxFuture<'_, Result<Duration, Error>>;
    fn close(pool: &Self::Pool) -> BoxFuture<'_, ()>;

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

        fn schedule(l: &Self::Leases, jobs: Vec<Job>) -> Result<Scheduler, Error> {
            jobs.into_iter()
                .fold(Scheduler::builder(l), |b, j| b.job(j))
                .start()
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
    };
}

/// sqlx's connect options for a test database (`$sqlx`: the sqlx crate).
#[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
macro_rules! sqlx_options {
    ($sqlx:ident, $db:expr) => {{
        let (host, socket, port, user, dbname) = $crate::support::backend::sqlx_target($db);
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

/// The deadpool pool.
pub struct Deadpool;

impl Backend for Deadpool {
    const NAME: &'static str = "deadpool";
    type Pool = pgwarden::Pool;
    type Conn = pgwarden::Client;
    type DropInError = deadpool_postgres::PoolError;

    fn build(db: &TestDb, s: &Settings) -> pgwarden::Pool {
        super::builder(db, s.size)
            .name(s.pool_name::<Self>())
            .wait_timeout(s.wait)
            .long_hold_threshold(s.long_hold)
            .housekeeping_interval(s.housekeeping)
            .build()
            .expect("pool")
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

    fn close(pool: &pgwarden::Pool) -> BoxFuture<'_, ()> {
        pool.close();
        Box::pin(std::future::ready(()))
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
}

/// The sqlx connect options of `db` (a socket directory or a host).
#[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
pub fn sqlx_target(
    db: &TestDb,
) -> (
    Option<String>,
    Option<std::path::PathBuf>,
    u16,
    String,
    String,
) {
    let cfg = db.pg_config();
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
                let opts = sqlx_options!($sqlx, db);
                let pg = $sqlx::postgres::PgPoolOptions::new()
                    .max_connections(s.size as u32)
                    .connect_lazy_with(opts);
                $($pg)::+::Pool::builder(pg)
                    .name(s.pool_name::<Self>())
                    .wait_timeout(s.wait)
                    .long_hold_threshold(s.long_hold)
                    .housekeeping_interval(s.housekeeping)
                    .build()
                    .expect("pool")
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

            fn close(pool: &Self::Pool) -> BoxFuture<'_, ()> {
                Box::pin(pool.close())
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
        }
    };
}

#[cfg(all(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
sqlx_backend!(Sqlx08, sqlx08, pgwarden::sqlx_0_8);
#[cfg(all(feature = "sqlx-0_8", not(feature = "sqlx-0_9")))]
sqlx_backend!(Sqlx08, sqlx08, pgwarden::sqlx);
#[cfg(feature = "sqlx-0_9")]
sqlx_backend!(Sqlx09, sqlx09, pgwarden::sqlx);

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
