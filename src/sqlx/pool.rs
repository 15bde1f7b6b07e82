//! The sqlx backend, one source for sqlx 0.8 and 0.9 (`super::dep` is the
//! sqlx in use; `super` holds the few shims where their APIs differ):
//! sqlx's `PgPool` as a [`Source`] of the pool shell, and the drop-in
//! [`Pool`] over it.
//!
//! What sqlx gives and how pgwarden uses it:
//!
//! - **Capacity.** pgwarden admits a checkout, then asks `PgPool::acquire`,
//!   which then never waits for capacity: pgwarden owns it. sqlx returns
//!   a dropped connection in a task of its own (the user's `after_release`
//!   hook, then a ping, then the connection is idle and its permit free).
//!   pgwarden does that return itself (`PoolConnection::return_to_pool`,
//!   the future sqlx's drop would have spawned) in its own task and gives
//!   the checkout's admission back only once it is done, so an admitted
//!   checkout never waits inside sqlx for a return pgwarden counted as
//!   done. The hooks run as before (`before_acquire` inside `acquire`,
//!   `after_release` in the return), except for the readiness probe, which
//!   takes an idle connection with `try_acquire` (no ping, no
//!   `before_acquire`; see [`Source::take`] here) and closes, never hands
//!   back, one whose `SELECT 1` it did not see answered: that return's ping
//!   has no bound.
//! - **The backend pid.** sqlx exposes none, nor any id of a connection. A
//!   connection is named by its cached prepared statement
//!   `SELECT pg_backend_pid()` (the address of that statement's metadata,
//!   which sqlx keeps in the connection's statement cache and shares with
//!   every `prepare` of the same text): preparing it again is a cache hit,
//!   no round trip. A new connection costs one Parse round trip and one
//!   execution of it; pgwarden keeps a clone of the statement with the
//!   pid, so that its address names no other connection meanwhile.
//! - **Where no statement may be named** ([`Naming`]): behind a
//!   transaction pooler (configured or detected: a server session holds
//!   whatever any client named on it, `42P05` when two clients name
//!   `sqlx_s_1`), after the server refused the naming statement (`42P05`,
//!   `26000`: a pooler the pool was not told of), and with sqlx's
//!   statement cache off (sqlx 0.8 names a persistent statement even then
//!   and never closes it; 0.9 sends it unnamed, and the address names
//!   nothing for long), every statement pgwarden sends on the pool is
//!   unnamed (sqlx's `persistent(false)`). Each checkout then asks its
//!   backend pid and session start unnamed ([`ASK`], one round trip), and
//!   the connection is named by both where the pool is known to keep its
//!   sessions (a pid names one live session, and is given again once it
//!   ends: with its start it names one session for good), or by a number
//!   of its own per checkout elsewhere (behind a pooler the pid names no
//!   client connection: two may see the same one). That statement failing
//!   means a dead connection: the checkout discards it and takes another.
//!   A small cache that the user's statements fill evicts the naming
//!   statement: it is named again at each checkout (two round trips), one
//!   pid-map entry per checkout, pruned at 4 × the pool's size.
//! - **Errors.** The drop-in methods answer with `sqlx::Error`: a timeout
//!   is `PoolTimedOut`, a closed pool `PoolClosed`, sqlx's own error as it
//!   came.

use std::fmt;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::ops::{Deref, DerefMut};
use std::panic::Location;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use futures_util::StreamExt;

use super::dep;
use super::dep::{Executor, Statement as _};
use super::TransactionManager as _;
use crate::admission::{Lane, Priority};
use crate::census::Census;
use crate::error::{BuildError, CheckoutError, Error};
use crate::key::{LockKey, LockMode};
use crate::lock::{Migrated, SessionLock, Work};
use crate::pool::{
    Backend, Extensions, Identified, PoolBuilder, Refused, Shared, Source, SourceStatus, ASK,
};
use crate::pooler::{PoolerMode, Watch};
use crate::status::Status;
use crate::stmt::SqlError;

/// The statement that names a connection and asks its pid.
const MARKER: &str = "SELECT pg_backend_pid()";

/// pgwarden's error as sqlx's, for the drop-in methods.
fn into_sqlx(e: Error) -> dep::Error {
    match e {
        Error::Checkout(CheckoutError::Backend(b)) => match b.downcast::<dep::Error>() {
            Ok(e) => *e,
            Err(b) => dep::Error::Configuration(b),
        },
        Error::Checkout(CheckoutError::Pool(deadpool_postgres::PoolError::Closed)) => {
            dep::Error::PoolClosed
        }
        e if e.is_timeout() => dep::Error::PoolTimedOut,
        e => dep::Error::Configuration(Box::new(e)),
    }
}

/// sqlx's error as pgwarden's.
fn from_sqlx(e: dep::Error) -> Error {
    match e {
        dep::Error::PoolClosed => {
            Error::Checkout(CheckoutError::Pool(deadpool_postgres::PoolError::Closed))
        }
        e => Error::Checkout(CheckoutError::Backend(Box::new(e))),
    }
}

/// The name of a sqlx connection (see the module docs).
#[allow(unreachable_pub)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ConnId {
    /// The address of its cached naming statement's metadata.
    Named(usize),
    /// Its backend pid and its session's start (µs since the epoch), on a
    /// pool known to keep its sessions.
    Pid(i32, i64),
    /// A number of its own, per checkout.
    Fresh(usize),
}

/// One `usize` per name, its kind in the two low bits (a metadata address
/// is 8-aligned): the checkout's id hasher takes one word.
impl Hash for ConnId {
    fn hash<H: Hasher>(&self, h: &mut H) {
        h.write_usize(match *self {
            ConnId::Named(addr) => addr,
            ConnId::Pid(pid, started) => ((pid as u32 as usize) ^ (started as usize)) << 2 | 1,
            ConnId::Fresh(n) => n << 2 | 2,
        })
    }
}

/// What the pool learned about naming its own statements, once and for
/// good: kept in its extension slot, where the lease layer reads it too
/// ([`names_statements`]).
#[derive(Debug, Default)]
struct Learned {
    /// sqlx's statement cache is off: the naming statement was not cached.
    cache_off: AtomicBool,
    /// The server refused the naming statement (`42P05`, `26000`).
    refused: AtomicBool,
}

/// How the pool names its connections: the sqlx pool's
/// [`Source::Cfg`], made at build.
#[allow(unreachable_pub)]
#[derive(Debug)]
pub struct Naming {
    pool: String,
    pooler: Watch,
    learned: Arc<Learned>,
    fresh: AtomicUsize,
}

impl Naming {
    /// pgwarden may send a named (persistent) statement on the pool now.
    fn named(&self) -> bool {
        self.pooler.behind_pooler().is_none() && self.learned.names()
    }

    /// Learned: `flag` set, logged once.
    fn learn(&self, flag: &AtomicBool, why: &dyn fmt::Display) {
        if !flag.swap(true, Ordering::AcqRel) {
            tracing::info!(
                pool = %self.pool,
                why = %why,
                "pgwarden's own statements go unnamed on this sqlx pool from now on"
            );
        }
    }
}

impl Learned {
    fn names(&self) -> bool {
        !self.cache_off.load(Ordering::Acquire) && !self.refused.load(Ordering::Acquire)
    }
}

/// Whether pgwarden may name its statements on `pool` as far as sqlx goes
/// (its statement cache on, no naming statement refused); the pooler mode
/// is the caller's to check.
pub(super) fn names_statements(pool: &Shared<dep::PgPool>) -> bool {
    pool.ext.get::<Learned>().names()
}

/// The connection's backend ([`ASK`]), as a simple query: one message
/// and one `ReadyForQuery`, so that a transaction pooler cannot move the
/// connection half-way (sqlx sends an extended-protocol statement in two
/// syncs: see `stmt::sqlx`), and one round trip instead of two.
async fn ask_pid(conn: &mut dep::PgConnection) -> Result<Backend, Error> {
    let row = dep::Executor::fetch_one(conn, dep::raw_sql(ASK))
        .await
        .map_err(from_sqlx)?;
    let pid = dep::Row::try_get(&row, 0).map_err(from_sqlx)?;
    let started = dep::Row::try_get(&row, 1).map_err(from_sqlx)?;
    Ok(Backend { pid, started })
}

impl Source for dep::PgPool {
    type Object = dep::pool::PoolConnection<dep::Postgres>;
    type Conn = dep::PgConnection;
    type Id = ConnId;
    type Anchor = Option<super::Statement>;
    type Raw = dep::Error;
    type Cfg = Naming;

    fn cfg(&self, name: &str, ext: &Extensions) -> Naming {
        Naming {
            pool: name.to_owned(),
            pooler: Watch::of(ext),
            learned: ext.get::<Learned>(),
            fresh: AtomicUsize::new(0),
        }
    }

    /// For the probe, an idle connection as it is when there is one
    /// (`try_acquire`: no ping, no `before_acquire` hook): sqlx's ping of an
    /// idle connection whose server hung waits inside the checkout, where
    /// pgwarden cannot tell it from a connection being made, and so held
    /// the probe lane for the set-up bound (10 s) instead of the probe's.
    /// The probe's own `SELECT 1` is the ping, under the probe's bound. Else
    /// (none idle, or another lane) sqlx's `acquire`.
    async fn take(&self, _: &Naming, lane: Lane) -> Result<Self::Object, dep::Error> {
        if lane == Lane::Probe {
            if let Some(idle) = self.try_acquire() {
                return Ok(idle);
            }
        }
        self.acquire().await
    }

    fn take_waiting<'a>(
        &'a self,
        _: &'a Naming,
    ) -> impl Future<Output = Result<Self::Object, dep::Error>> + Send + 'a {
        self.acquire()
    }

    fn refused(e: dep::Error) -> Refused {
        match e {
            dep::Error::PoolTimedOut => Refused::NoRoom,
            e => Refused::Failed(from_sqlx(e)),
        }
    }

    fn quick_id(_: &Self::Object) -> Option<ConnId> {
        None
    }

    /// By its cached naming statement where one may be named (no round
    /// trip but a new connection's Parse), else by its pid asked unnamed
    /// (see the module docs).
    async fn identify(obj: &mut Self::Object, cfg: &Naming) -> Result<Identified<Self>, Error> {
        if cfg.named() {
            match super::prepare(obj, MARKER).await {
                // Cached: its metadata lives as long as the pool keeps it.
                Ok(stmt) if dep::Connection::cached_statements_size(&**obj) > 0 => {
                    return Ok(Identified {
                        id: ConnId::Named(stmt.columns().as_ptr() as usize),
                        anchor: Some(stmt),
                        pid: None,
                    })
                }
                Ok(_) => cfg.learn(&cfg.learned.cache_off, &"sqlx's statement cache is off"),
                Err(e) => {
                    let e = SqlError::from(e);
                    if !e.refused_prepared() {
                        return Err(e.into());
                    }
                    cfg.learn(&cfg.learned.refused, &e);
                }
            }
        }
        let backend = ask_pid(obj).await?;
        let id = match backend.started {
            Some(started)
                if cfg.pooler.keeps_sessions() && !cfg.learned.refused.load(Ordering::Acquire) =>
            {
                ConnId::Pid(backend.pid, started)
            }
            _ => ConnId::Fresh(cfg.fresh.fetch_add(1, Ordering::Relaxed)),
        };
        Ok(Identified {
            id,
            anchor: None,
            pid: Some(backend),
        })
    }

    async fn backend_pid(obj: &mut Self::Object) -> Result<Backend, Error> {
        ask_pid(obj).await
    }

    /// A number per checkout names nothing at the next one.
    fn stable(id: &ConnId) -> bool {
        !matches!(id, ConnId::Fresh(_))
    }

    fn handed_out(_: &Self::Object) -> Instant {
        Instant::now()
    }

    fn created(_: &Self::Object) -> Instant {
        Instant::now()
    }

    fn is_new(_: &Self::Object) -> bool {
        false
    }

    fn is_broken(_: &Self::Object) -> bool {
        false
    }

    fn conn(obj: &Self::Object) -> &dep::PgConnection {
        obj
    }

    fn conn_mut(obj: &mut Self::Object) -> &mut dep::PgConnection {
        obj
    }

    type Exec<'c> = super::On<super::Pooled<'c>>;
    type Row = dep::postgres::PgRow;

    /// Its statements pinned (each in a transaction of its own) where the
    /// pool may move the connection between two syncs: sqlx sends a
    /// statement in two (see `stmt::sqlx`).
    fn exec<'c>(
        conn: &'c mut dep::PgConnection,
        cfg: &'c Naming,
        spoiled: &'c mut bool,
    ) -> super::On<super::Pooled<'c>> {
        let pin = cfg.pooler.may_move_between_syncs();
        super::On::pooled(conn, spoiled, pin, &cfg.learned.refused)
    }

    /// sqlx sends no cancel request.
    fn cancel(_: &dep::PgConnection) -> Option<impl Future<Output = ()> + Send + 'static> {
        None::<std::future::Ready<()>>
    }

    /// sqlx's own return (its `after_release` hook, a ping, then idle):
    /// the future its drop would have spawned, run by pgwarden's shell.
    fn give_back(
        obj: &mut Option<Self::Object>,
    ) -> Option<impl Future<Output = ()> + Send + 'static> {
        let mut obj = obj.take()?;
        let back = obj.return_to_pool();
        // Nothing left in it to return (it only keeps `min_connections`).
        in_a_runtime(|| drop(obj));
        Some(back)
    }

    const DIES_WITH_ITS_RUNTIME: bool = true;

    /// Taken out of sqlx's pool (its capacity back at once) and dropped:
    /// no I/O on a socket whose runtime is gone.
    fn forget(obj: Self::Object) {
        in_a_runtime(|| drop(obj.detach()));
    }

    /// sqlx keeps the connection's capacity until it is closed.
    fn discard(obj: Self::Object) -> Option<impl Future<Output = ()> + Send + 'static> {
        if tokio::runtime::Handle::try_current().is_err() {
            // Closed here: its session ends, and every lock with it.
            in_a_runtime(|| drop(obj.detach()));
            return None;
        }
        Some(async move {
            let _ = obj.close().await;
        })
    }

    /// sqlx keeps its idle connections to itself: none can be closed from
    /// outside (see `crate::census` for what the sweep does instead).
    fn close_idle(&self, _: ConnId, _: Instant) -> Option<bool> {
        None
    }

    /// sqlx pings an idle connection as `acquire` hands it out unless the
    /// adopter turned `test_before_acquire` off.
    fn pings_idle(&self) -> bool {
        self.options().get_test_before_acquire()
    }

    /// A simple query: one message, which no pooler splits (see
    /// [`ask_pid`]).
    async fn select_1(conn: &mut dep::PgConnection) -> Result<(), Error> {
        dep::Executor::execute(conn, dep::raw_sql("SELECT 1"))
            .await
            .map(drop)
            .map_err(from_sqlx)
    }

    fn status(&self) -> SourceStatus {
        SourceStatus {
            max: self.options().get_max_connections() as usize,
            size: self.size() as usize,
            idle: self.num_idle(),
            waiting: 0,
        }
    }

    fn wait_bound(&self) -> Option<Duration> {
        Some(self.options().get_acquire_timeout())
    }

    /// A sqlx pool has the size it was built with; pgwarden's sqlx pool
    /// offers no resize.
    fn resize(&self, _: usize) {}

    fn close(&self) {
        // sqlx marks the pool closed as the call is made; its future only
        // waits for the connections out.
        drop(dep::PgPool::close(self));
    }

    fn is_closed(&self) -> bool {
        dep::PgPool::is_closed(self)
    }
}

/// Runs `f`, which drops (what is left of) a sqlx `PoolConnection`, in a
/// tokio runtime's context. sqlx's drop of one spawns a task whenever the
/// pool keeps `min_connections` (its live connection taken out or not), and
/// panics outside a runtime: a guard or connection dropped after its
/// runtime is gone. There the task goes to a throwaway runtime, dropped
/// unpolled with it (nothing is lost: the pool's idle-connection upkeep).
fn in_a_runtime(f: impl FnOnce()) {
    if tokio::runtime::Handle::try_current().is_ok() {
        return f();
    }
    match tokio::runtime::Builder::new_current_thread().build() {
        Ok(rt) => {
            let _in = rt.enter();
            f();
        }
        // No runtime of its own (out of threads or memory): sqlx would
        // panic, which would drop whatever it was dropping.
        Err(e) => {
            tracing::error!(error = %e, "no runtime to drop a sqlx connection in: it may panic");
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        }
    }
}

/// A connection checked out of a pgwarden sqlx [`Pool`]: derefs to sqlx's
/// `PgConnection` (`&mut *conn` is an executor), knows its lane, backend
/// pid and call site, and goes back to the pool on drop.
pub type PoolConnection = crate::Client<dep::PgPool>;

/// A budgeted pool over a `sqlx::PgPool`: the drop-in for it. Code written
/// against `sqlx::PgPool` compiles with the type changed: `&pool` is an
/// executor (`sqlx::query(…).fetch_one(&pool)`), and `acquire`, `begin`,
/// `close`, `size`, `num_idle` and `is_closed` are there. Every checkout
/// goes through pgwarden's admission on the request lane, bounded by the
/// pool's wait timeout (and the [`Deadline`](crate::Deadline) scope it
/// runs in).
///
/// pgwarden owns the sqlx pool's capacity: keep no clone of it.
///
/// ```no_run
/// # async fn demo(url: &str) -> Result<(), Box<dyn std::error::Error>> {
/// # use sqlx09 as sqlx;
/// use sqlx::postgres::PgPoolOptions;
/// let pg = PgPoolOptions::new().max_connections(8).connect(url).await?;
/// let pool = pgwarden::sqlx::Pool::builder(pg).name("api").build()?;
/// let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&pool).await?;
/// let mut tx = pool.begin().await?;
/// sqlx::query("SELECT 2").execute(&mut *tx).await?;
/// tx.commit().await?;
/// # let _ = one; Ok(()) }
/// ```
#[derive(Clone)]
pub struct Pool {
    pub(super) shared: Arc<Shared<dep::PgPool>>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.shared.fmt(f)
    }
}

#[cfg(feature = "http")]
impl crate::pool::AnyPool for Pool {
    type Source = dep::PgPool;

    #[allow(private_interfaces)]
    fn shared(&self) -> &Arc<Shared<dep::PgPool>> {
        &self.shared
    }
}

impl PoolBuilder<dep::PgPool> {
    /// Validates every setting and builds the sqlx pool.
    pub fn build(self) -> Result<Pool, BuildError> {
        let (shared, periodic) = self.build_shared()?;
        shared.supervise_periodic(periodic);
        Ok(Pool { shared })
    }
}

impl Pool {
    /// Starts a builder over the adopter's `sqlx::PgPool` (the drop-in
    /// path): lanes, the readiness reserve, the session-lock budget, the
    /// wait timeout (default: the sqlx pool's acquire timeout), the
    /// long-hold threshold, the name, the pooler mode and the census
    /// interval (default 60 s), as the deadpool builder has them.
    pub fn builder(pg: dep::PgPool) -> PoolBuilder<dep::PgPool> {
        PoolBuilder::new(pg).census_interval(Some(crate::census::DEFAULT_INTERVAL))
    }

    /// The pool's name, as in logs and metric labels.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// A request-lane connection, as `PgPool::acquire`: through pgwarden's
    /// admission (FIFO), bounded by the pool's wait timeout, with sqlx's
    /// error (`PoolTimedOut`, `PoolClosed`, or what sqlx said).
    #[track_caller]
    pub fn acquire(&self) -> impl Future<Output = Result<PoolConnection, dep::Error>> + Send + '_ {
        self.shared.checkout_inner(
            Lane::Request,
            Priority::Normal,
            false,
            Location::caller(),
            self.shared.opts.wait_timeout,
            into_sqlx,
        )
    }

    /// A request-lane connection within `timeout` (checkout included), with
    /// pgwarden's error: a timeout carries the pool's status and its stage.
    #[track_caller]
    pub fn acquire_within(
        &self,
        timeout: Duration,
    ) -> impl Future<Output = Result<PoolConnection, Error>> + Send + '_ {
        self.shared
            .checkout(Lane::Request, Location::caller(), timeout)
    }

    /// Starts a transaction on a request-lane connection, as
    /// `PgPool::begin`; rolled back on drop unless committed. Cancel-safe:
    /// dropped before the server has answered its `BEGIN`, its connection
    /// is closed (the server rolls the transaction back), never returned
    /// to the pool inside a transaction (what sqlx 0.8's own `begin` does:
    /// see `pool::Beginning`).
    #[track_caller]
    pub fn begin(&self) -> impl Future<Output = Result<Transaction, dep::Error>> + Send + '_ {
        let conn = self.acquire();
        async move {
            let mut beginning = Beginning(Some(conn.await?));
            if let Some(conn) = beginning.0.as_mut() {
                dep::postgres::PgTransactionManager::begin(conn, None).await?;
            }
            match beginning.0.take() {
                Some(conn) => Ok(Transaction { conn, open: true }),
                // Taken only just above.
                None => Err(dep::Error::PoolClosed),
            }
        }
    }

    /// The readiness probe: `SELECT 1` on the probe lane, whose reserve no
    /// other lane may take, bounded by `timeout` (checkout included);
    /// returns its latency (see the deadpool pool's `readiness`).
    #[track_caller]
    pub fn readiness(
        &self,
        timeout: Duration,
    ) -> impl Future<Output = Result<Duration, Error>> + Send + '_ {
        self.shared.probe(timeout, Location::caller())
    }

    /// Detects, once per pool, whether it talks through a transaction
    /// pooler, and remembers it (a configured mode is returned as is); see
    /// the deadpool pool's `detect_pooler`. sqlx does not expose the pid a
    /// server announced at connection start; over TCP on Linux one
    /// statement proves a direct connection instead (the server's view of
    /// both ends of the session's connection is a socket this process
    /// holds), once the motion probe saw no motion; session locks are still
    /// checked on their own connection there. Elsewhere (a Unix socket,
    /// NAT, no `/proc`) detection is the motion probe alone: straight to
    /// PostgreSQL it answers [`PoolerMode::Direct`] after its statements,
    /// unproven (session locks are then checked on their own connection,
    /// lease statements go unnamed, and the census matches no lock to the
    /// pool's connections: configure [`PoolerMode::Direct`] with
    /// `PoolBuilder::pooler` for all three). A pool that cannot hold the
    /// probe's two connections answers [`PoolerMode::Auto`]: nothing was
    /// proven.
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::sqlx::Pool) -> Result<(), pgwarden::Error> {
    /// if pool.detect_pooler().await? == pgwarden::PoolerMode::Transaction {
    ///     // session locks will be refused: use transaction locks or leases
    /// }
    /// # Ok(()) }
    /// ```
    #[track_caller]
    pub fn detect_pooler(&self) -> impl Future<Output = Result<PoolerMode, Error>> + Send + '_ {
        crate::pooler::detect(&self.shared, Location::caller())
    }

    /// The advisory locks in the database now, each matched to this pool's
    /// connections (see the deadpool pool's `census`). Runs on a control
    /// connection; a periodic census (`PoolBuilder::census_interval`)
    /// also ends the sessions of idle connections found holding a leaked
    /// lock (sqlx gives no way to close an idle connection: see the
    /// README's sqlx section).
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::sqlx::Pool) -> Result<(), pgwarden::Error> {
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

    /// The pool now: per lane in use, waiting and limits; `size` and
    /// `idle` are sqlx's.
    pub fn status(&self) -> Status {
        self.shared.status()
    }

    /// Closes the pool: waiters and new checkouts fail (`PoolClosed`), and
    /// sqlx closes its connections, waiting (as `PgPool::close`) for those
    /// out to come back.
    pub fn close(&self) -> impl Future<Output = ()> + '_ {
        self.shared.close();
        async move {
            self.shared.inner.close().await;
            // sqlx 0.8 closes the idle connections it finds, then waits for
            // every permit: a connection whose return (its ping) was under
            // way as the pool closed goes idle after that and stays open.
            // Every return is done now: close what is idle.
            self.shared.inner.close().await;
        }
    }

    /// Whether [`Pool::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.shared.is_closed()
    }

    /// Connections open (sqlx's `size`).
    pub fn size(&self) -> u32 {
        self.shared.inner.size()
    }

    /// Connections idle (sqlx's `num_idle`).
    pub fn num_idle(&self) -> usize {
        self.shared.inner.num_idle()
    }

    /// Takes a session advisory lock on a connection of the session-lock
    /// lane, as the deadpool pool's
    /// [`session_lock`](crate::Pool::session_lock) does (the budget, typed
    /// keys, the guard that owns its connection and unlocks on it, never
    /// returning it to the pool still holding a lock, cancel-safe at every
    /// await): the replacement for `sqlx::postgres::PgAdvisoryLock`. Run the
    /// lock's own statements on [`SessionLock::conn_mut`]. A dropped guard
    /// whose unlock is not confirmed within the unlock timeout has its
    /// statement cancelled with `pg_cancel_backend` on another connection
    /// (sqlx sends no cancel request) and its connection closed.
    ///
    /// sqlx does not expose the pid the server announced, so a pool left at
    /// [`PoolerMode::Auto`](crate::PoolerMode::Auto) cannot prove it talks
    /// to PostgreSQL directly as firmly as a deadpool pool does (over TCP
    /// on Linux its own socket proves it, see [`Pool::detect_pooler`], but
    /// a pooler's mode switched later can make that stale): each lock is
    /// checked on its own connection (some 40 `SELECT pg_backend_pid()`).
    /// Configure [`PoolerMode::Direct`](crate::PoolerMode::Direct) on a
    /// pool that does.
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::sqlx::Pool) -> Result<(), pgwarden::Error> {
    /// use pgwarden::{LockKey, LockMode};
    /// let wait = Some(std::time::Duration::from_secs(5));
    /// if let Some(lock) = pool.session_lock(LockKey::Single(42), LockMode::Exclusive, wait).await? {
    ///     // … the work only one instance does …
    ///     lock.unlock().await?;
    /// }
    /// # Ok(()) }
    /// ```
    #[track_caller]
    pub fn session_lock(
        &self,
        key: LockKey,
        mode: LockMode,
        wait: Option<Duration>,
    ) -> impl Future<Output = Result<Option<SessionLock<dep::PgPool>>, Error>> + Send + '_ {
        let site = Location::caller();
        crate::lock::session_lock(&self.shared, key, mode, wait, site)
    }

    /// Runs `f` in one `READ COMMITTED` transaction under the exclusive
    /// transaction-scoped lock `key`, as the deadpool pool's
    /// [`with_xact_lock`](crate::Pool::with_xact_lock): `f` gets the
    /// transaction's `&mut PgConnection` (an executor).
    ///
    /// ```no_run
    /// # use sqlx09 as sqlx;
    /// # async fn demo(pool: pgwarden::sqlx::Pool) -> Result<(), pgwarden::Error> {
    /// const ACCOUNTS: pgwarden::Namespace = pgwarden::Namespace::new(2);
    /// let timeout = std::time::Duration::from_secs(5);
    /// let n = pool
    ///     .with_xact_lock(ACCOUNTS.key(42), timeout, |tx| {
    ///         Box::pin(async move {
    ///             let done = sqlx::query("UPDATE accounts SET n = n + 1").execute(tx).await;
    ///             Ok::<_, pgwarden::Error>(done.map_or(0, |d| d.rows_affected()))
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
        F: for<'a> FnOnce(&'a mut dep::PgConnection) -> BoxFuture<'a, Result<T, E>> + Send + 'p,
        T: Send + 'p,
        E: From<Error> + Send + 'p,
    {
        let site = Location::caller();
        crate::lock::with_xact_lock(&self.shared, key, timeout, SqlxWork(f), site)
    }

    /// Runs `f` once per database, as the deadpool pool's
    /// [`migrate_once`](crate::Pool::migrate_once) (the same ledger table
    /// and lock: a deadpool instance and a sqlx instance run it once
    /// between them); `f` gets the transaction's `&mut PgConnection`.
    ///
    /// ```no_run
    /// # use sqlx09 as sqlx;
    /// # async fn demo(pool: pgwarden::sqlx::Pool) -> Result<(), pgwarden::Error> {
    /// let timeout = std::time::Duration::from_secs(30);
    /// pool.migrate_once("app/0001_schema", timeout, |tx| {
    ///     Box::pin(async move {
    ///         sqlx::raw_sql("CREATE SCHEMA IF NOT EXISTS app").execute(tx).await.ok();
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
        F: for<'a> FnOnce(&'a mut dep::PgConnection) -> BoxFuture<'a, Result<T, E>> + Send + 'p,
        T: Send + 'p,
        E: From<Error> + Send + 'p,
    {
        let site = Location::caller();
        crate::lock::migrate_once(&self.shared, name, timeout, SqlxWork(f), site)
    }
}

/// Takes the transaction-scoped advisory lock `key` in `mode` in the
/// caller's own sqlx transaction: the sqlx side of
/// [`pgwarden::xact_lock`](crate::xact_lock), with the same statement and
/// answers. Tries once when `wait` is `None`, or waits up to `wait`.
///
/// - `Ok(true)`: granted, held until the transaction ends (`COMMIT` or
///   `ROLLBACK`: it cannot leak into the pool).
/// - `Ok(false)`: only from a single try (`wait` is `None`): another
///   session holds it; the transaction is not aborted.
/// - `Err(`[`LockError::Timeout`](crate::LockError::Timeout)`)`: a wait ran
///   out (SQLSTATE 55P03, `lock_not_available`), and **PostgreSQL has
///   aborted the transaction**: roll it back (dropping it does) and retry
///   with a new one.
/// - `Err(`[`InvalidInput::NoTransaction`](crate::InvalidInput::NoTransaction)`)`:
///   `conn` is in no transaction that sqlx opened (the lock would go with
///   its own statement); nothing was sent.
///
/// `conn` is the transaction's connection: `&mut tx` for this pool's
/// [`Transaction`] (`pool.begin()`) or a `sqlx::Transaction` (sqlx's
/// `begin` on a checked-out connection). The wait is bounded by
/// PostgreSQL's `lock_timeout`, set for this statement only (the
/// transaction's own is restored once the lock is granted). Take it in a
/// `READ COMMITTED` transaction (the default) for the work under it to see
/// what the previous holder committed, as [`Pool::with_xact_lock`] does;
/// it works behind a transaction-mode pooler (its statement is sent
/// unnamed).
///
/// ```no_run
/// # use sqlx09 as sqlx;
/// # async fn demo(pool: pgwarden::sqlx::Pool) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use pgwarden::{LockMode, Namespace};
///
/// const ACCOUNTS: Namespace = Namespace::new(2);
/// let mut tx = pool.begin().await?;
/// let wait = Some(Duration::from_secs(5));
/// pgwarden::sqlx::xact_lock(&mut tx, ACCOUNTS.key(42), LockMode::Exclusive, wait).await?;
/// // … check, then insert: no other session that asks for (2, 42) runs here …
/// sqlx::query("UPDATE accounts SET n = n + 1 WHERE id = 42").execute(&mut *tx).await?;
/// tx.commit().await?; // the lock is released here
/// # Ok(()) }
/// ```
pub async fn xact_lock(
    conn: &mut dep::PgConnection,
    key: LockKey,
    mode: LockMode,
    wait: Option<Duration>,
) -> Result<bool, Error> {
    if !dep::Connection::is_in_transaction(conn) {
        return Err(Error::Invalid(crate::InvalidInput::NoTransaction {
            what: "pgwarden::sqlx::xact_lock",
        }));
    }
    crate::lock::xact_lock_on(&super::On::new(conn), key, mode, wait).await
}

/// The sqlx pool's transaction-lock closures: they get the transaction's
/// `&mut PgConnection`.
struct SqlxWork<F>(F);

impl<F, T, E> Work<dep::PgPool, T, E> for SqlxWork<F>
where
    F: for<'a> FnOnce(&'a mut dep::PgConnection) -> BoxFuture<'a, Result<T, E>>,
{
    fn run<'a, 'c, 't>(self, tx: &'a mut super::OnTx<'t>) -> BoxFuture<'a, Result<T, E>> {
        let conn: &'a mut dep::PgConnection = tx.get_mut();
        (self.0)(conn)
    }
}

/// A transaction on a connection of a pgwarden sqlx [`Pool`], as sqlx's
/// `Transaction`: derefs to `PgConnection` (`&mut *tx` is an executor),
/// [`commit`](Transaction::commit) or [`rollback`](Transaction::rollback);
/// dropped open, it is rolled back before its connection is used again
/// (sqlx queues the `ROLLBACK`; the return to the pool sends it).
pub struct Transaction {
    conn: PoolConnection,
    open: bool,
}

impl Transaction {
    /// Commits it.
    pub async fn commit(mut self) -> Result<(), dep::Error> {
        dep::postgres::PgTransactionManager::commit(&mut self.conn).await?;
        self.open = false;
        Ok(())
    }

    /// Rolls it back.
    pub async fn rollback(mut self) -> Result<(), dep::Error> {
        dep::postgres::PgTransactionManager::rollback(&mut self.conn).await?;
        self.open = false;
        Ok(())
    }
}

impl Transaction {
    /// Reads what a statement of the caller's, its future dropped, left
    /// unread on the connection (its rows, or its error: a statement the
    /// fence's bound cancelled, say), so that the next statement is not
    /// answered with it. sqlx reads such leftovers before its next
    /// statement and fails that one with a leftover error: the fence
    /// check would take a `57014` of the caller's statement for its own
    /// lock wait (`LeaseError::FenceBlocked`). Drained first, the check
    /// meets the failed transaction (`25P02`: the fenced commit reports
    /// `LeaseError::Aborted`). Free where the connection is named: a
    /// cache hit of its naming statement reads what is pending and sends
    /// nothing; elsewhere a ping (one round trip). Its error, a leftover's,
    /// is dropped: what it left is the transaction's state, which the
    /// next statement meets.
    pub(super) async fn read_leftovers(&mut self) {
        let shared = self.conn.pool();
        let named = crate::pooler::behind_pooler(shared).is_none() && names_statements(shared);
        let read = if named {
            super::prepare(&mut self.conn, MARKER).await.map(drop)
        } else {
            dep::Connection::ping(&mut *self.conn).await
        };
        if let Err(e) = read {
            tracing::debug!(error = %e, "a statement cut short in a fenced transaction left this unread");
        }
    }
}

impl Deref for Transaction {
    type Target = dep::PgConnection;
    fn deref(&self) -> &dep::PgConnection {
        &self.conn
    }
}

impl DerefMut for Transaction {
    fn deref_mut(&mut self) -> &mut dep::PgConnection {
        &mut self.conn
    }
}

/// A connection whose `BEGIN` is under way: dropped before it is done (the
/// caller's future dropped half-way, or the `BEGIN` failed), the connection
/// is closed, not returned. sqlx 0.8's `begin` counts the transaction only
/// once the server has answered, so its own rollback guard queues nothing
/// when cut short: the server would be left inside a transaction that the
/// pool's next borrower's statements run in, never committed (sqlx 0.9
/// counts it first and queues the `ROLLBACK`; closing is right on both).
struct Beginning(Option<PoolConnection>);

impl Drop for Beginning {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            conn.discard();
        }
    }
}

impl Drop for Transaction {
    fn drop(&mut self) {
        if self.open {
            dep::postgres::PgTransactionManager::start_rollback(&mut self.conn);
        }
    }
}

impl fmt::Debug for Transaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transaction")
            .field("conn", &self.conn)
            .field("open", &self.open)
            .finish()
    }
}

/// A stream fed by a future: the future hands each item over in `slot`
/// and waits until it is taken (what sqlx's own `try_stream!` does, for
/// a stream that owns the connection its rows come from).
struct Fed<'e, T> {
    slot: Arc<parking_lot::Mutex<Option<T>>>,
    fut: Option<BoxFuture<'e, Result<(), T>>>,
}

/// What the feeding future hands items over with.
struct Feeder<T>(Arc<parking_lot::Mutex<Option<T>>>);

impl<T> Feeder<T> {
    /// Hands `item` over; ready once the stream has taken it.
    async fn send(&self, item: T) {
        *self.0.lock() = Some(item);
        // The stream takes it as soon as this returns pending, and polls
        // again only after that: no waker is needed.
        std::future::poll_fn(|_| {
            if self.0.lock().is_some() {
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        })
        .await
    }
}

impl<T: Send> futures_util::Stream for Fed<'_, T> {
    type Item = T;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let Some(fut) = self.fut.as_mut() else {
            return Poll::Ready(None);
        };
        let done = fut.as_mut().poll(cx);
        if let Some(item) = self.slot.lock().take() {
            return Poll::Ready(Some(item));
        }
        match done {
            Poll::Pending => Poll::Pending,
            Poll::Ready(r) => {
                self.fut = None;
                Poll::Ready(r.err())
            }
        }
    }
}

/// The body of an `Executor` method on `&Pool`: `$call` on a request-lane
/// connection (the versions' shims differ in signatures only).
macro_rules! on_conn {
    ($pool:expr, $c:ident => $call:expr) => {{
        let pool = $pool.clone();
        Box::pin(async move {
            let mut $c = pool.acquire().await?;
            $call.await
        })
    }};
}

type Step = Result<dep::Either<dep::postgres::PgQueryResult, dep::postgres::PgRow>, dep::Error>;

impl<'p> Executor<'p> for &'_ Pool {
    type Database = dep::Postgres;

    /// Checks out a request-lane connection, runs `query` on it, and gives
    /// it back once the stream ends or is dropped.
    fn fetch_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, Step>
    where
        E: 'q + dep::Execute<'q, dep::Postgres>,
    {
        let pool = self.clone();
        let slot = Arc::new(parking_lot::Mutex::new(None));
        let feeder = Feeder(slot.clone());
        let fut = async move {
            let mut conn = pool.acquire().await?;
            let mut s = conn.fetch_many(query);
            while let Some(step) = s.next().await {
                let failed = step.is_err();
                feeder.send(step).await;
                if failed {
                    break;
                }
            }
            Ok(())
        };
        let fut: BoxFuture<'e, Result<(), Step>> = Box::pin(async move { fut.await.map_err(Err) });
        Box::pin(Fed {
            slot,
            fut: Some(fut),
        })
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<dep::postgres::PgRow>, dep::Error>>
    where
        E: 'q + dep::Execute<'q, dep::Postgres>,
    {
        on_conn!(self, c => c.fetch_optional(query))
    }

    versioned_executor!();
}
