//! [`Pool`], its builder, the checked-out [`Conn`], and [`Status`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::panic::Location;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::{Object, PoolError, TimeoutType};
use parking_lot::Mutex;
use slab::Slab;
use tokio::sync::oneshot;

use crate::budget::{Budget, Lane, Limits};
use crate::error::{BuildError, Error, Holder};
use crate::metrics::PoolMetrics;

mod admission;
mod builder;
mod conn;
mod housekeeping;
mod status;

pub use builder::PoolBuilder;
pub use conn::Conn;
pub use status::{LaneStatus, Status};

use admission::Permit;

type ObjectId = deadpool_postgres::ObjectId;

/// Hashes deadpool object ids (one `usize` each) with a multiplication: the
/// pid map is read at every checkout, and SipHash's resistance to chosen
/// keys buys nothing for ids that deadpool hands out.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.0 = (self.0 ^ n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// Maps and sets keyed by deadpool object id.
pub(crate) type IdMap<V> = HashMap<ObjectId, V, std::hash::BuildHasherDefault<IdHasher>>;
pub(crate) type IdSet = HashSet<ObjectId, std::hash::BuildHasherDefault<IdHasher>>;

/// A budgeted pool: a drop-in wrapper over [`deadpool_postgres::Pool`].
///
/// Cloning is cheap (an `Arc`); clones share one pool.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = pgwarden::Pool::from_url("host=/run/postgresql user=app dbname=app", 8)?
///     .name("app")
///     .build()?;
/// let conn = pool.get().await?; // derefs to deadpool_postgres::Client
/// let row = conn.query_one("SELECT 1::int4", &[]).await?;
/// assert_eq!(row.get::<_, i32>(0), 1);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Pool {
    pub(crate) shared: Arc<Shared>,
}

pub(crate) struct Options {
    pub(crate) wait_timeout: Duration,
    pub(crate) long_hold: Duration,
    pub(crate) housekeeping: Duration,
    pub(crate) census_interval: Option<Duration>,
    pub(crate) pooler: crate::pooler::Pooler,
    pub(crate) unlock_timeout: Duration,
}

pub(crate) struct Shared {
    pub(crate) name: Arc<str>,
    pub(crate) inner: deadpool_postgres::Pool,
    pub(crate) state: Mutex<State>,
    pub(crate) opts: Options,
    pub(crate) metrics: PoolMetrics,
    pub(crate) locks: crate::lock::LockShared,
    housekeeping_started: AtomicBool,
    /// The pool's own lease table (`Pool::leases`, `Pool::try_exclusive`).
    pub(crate) leases: std::sync::OnceLock<crate::lease::Leases>,
}

/// One checked-out connection, as the pool sees it.
#[derive(Debug)]
pub(crate) struct Checkout {
    pub(crate) lane: Lane,
    pub(crate) site: &'static Location<'static>,
    pub(crate) since: Instant,
    pub(crate) pid: Option<i32>,
    pub(crate) object: Option<ObjectId>,
    pub(crate) long_warned: bool,
    /// What the checkout is for, for logs (e.g. the session lock keys held).
    pub(crate) note: Option<String>,
}

struct Waiter {
    id: u64,
    lane: Lane,
    site: &'static Location<'static>,
    /// When its checkout began: the checkout record's age until attached.
    start: Instant,
    tx: oneshot::Sender<Permit>,
}

pub(crate) struct State {
    pub(crate) budget: Budget,
    waiters: VecDeque<Waiter>,
    pending: [usize; 3],
    next_waiter: u64,
    pub(crate) checkouts: Slab<Checkout>,
    warned_sites: HashSet<usize>,
    /// Backend pid of every physical connection seen, by deadpool object id.
    pub(crate) pids: IdMap<i32>,
    /// Connections to discard at their next checkout (a leaked lock on them).
    pub(crate) tainted: IdSet,
}

impl State {
    fn holders(&self, lane: Lane, now: Instant) -> Vec<Holder> {
        self.checkouts
            .iter()
            .filter(|(_, c)| c.lane == lane)
            .map(|(_, c)| Holder {
                site: c.site,
                age: now.saturating_duration_since(c.since),
                pid: c.pid,
            })
            .collect()
    }

    /// Completes a checkout record once its connection is known; returns
    /// the checkout instant.
    fn attach(&mut self, slot: usize, pid: i32, object: ObjectId) -> Instant {
        let now = Instant::now();
        if let Some(c) = self.checkouts.get_mut(slot) {
            c.pid = Some(pid);
            c.object = Some(object);
            c.since = now;
        }
        now
    }

    fn insert(&mut self, lane: Lane, site: &'static Location<'static>, since: Instant) -> usize {
        self.checkouts.insert(Checkout {
            lane,
            site,
            since,
            pid: None,
            object: None,
            long_warned: false,
            note: None,
        })
    }
}

impl Shared {
    pub(crate) fn status(&self) -> Status {
        let d = self.inner.status();
        let st = self.state.lock();
        let limits = st.budget.limits();
        let lanes = Lane::ALL.map(|lane| LaneStatus {
            lane,
            in_use: st.budget.in_use(lane),
            waiting: st.pending[lane.idx()],
            reserved: limits.lane(lane).reserved,
            max: limits.lane(lane).max,
        });
        Status {
            max: limits.size(),
            size: d.size,
            idle: d.available,
            in_use: st.budget.total(),
            waiting: st.pending.iter().sum(),
            lanes,
        }
    }
}

impl Pool {
    /// Starts a builder over an existing deadpool pool (the drop-in path).
    pub fn builder(inner: deadpool_postgres::Pool) -> PoolBuilder {
        PoolBuilder::new(inner)
    }

    /// Wraps an existing deadpool pool with the default limits.
    pub fn new(inner: deadpool_postgres::Pool) -> Result<Pool, BuildError> {
        PoolBuilder::new(inner).build()
    }

    /// Starts a builder from a deadpool-postgres [`Config`](deadpool_postgres::Config)
    /// (no TLS, tokio runtime).
    pub fn from_config(config: &deadpool_postgres::Config) -> Result<PoolBuilder, BuildError> {
        let inner = config
            .create_pool(
                Some(deadpool_postgres::Runtime::Tokio1),
                tokio_postgres::NoTls,
            )
            .map_err(|e| BuildError::Deadpool(e.to_string()))?;
        Ok(PoolBuilder::new(inner))
    }

    /// Starts a builder from a `DATABASE_URL`-style connection string
    /// (`postgres://…` or `host=… user=…`), no TLS, `max_size` connections.
    pub fn from_url(url: &str, max_size: usize) -> Result<PoolBuilder, BuildError> {
        let pg: tokio_postgres::Config = url.parse().map_err(|e: tokio_postgres::Error| {
            // The parser's reason is the source ("invalid value for option
            // `port`", "unexpected EOF"…); the error itself only says
            // "invalid connection string".
            BuildError::InvalidUrl(match std::error::Error::source(&e) {
                Some(reason) => crate::error::Chain(reason).to_string(),
                None => e.to_string(),
            })
        })?;
        let mgr = deadpool_postgres::Manager::from_config(
            pg,
            tokio_postgres::NoTls,
            deadpool_postgres::ManagerConfig {
                recycling_method: deadpool_postgres::RecyclingMethod::Fast,
            },
        );
        let inner = deadpool_postgres::Pool::builder(mgr)
            .max_size(max_size)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(|e| BuildError::Deadpool(e.to_string()))?;
        Ok(PoolBuilder::new(inner))
    }

    /// The pool's name, as in logs and metric labels.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The wrapped deadpool pool. Checkouts made on it directly bypass the
    /// budget: use it for inspection, not for connections.
    pub fn inner(&self) -> &deadpool_postgres::Pool {
        &self.shared.inner
    }

    /// The lane limits in force.
    pub fn limits(&self) -> Limits {
        self.shared.state.lock().budget.limits().clone()
    }

    /// A request-lane connection: the drop-in replacement for
    /// [`deadpool_postgres::Pool::get`], with deadpool's error type.
    ///
    /// Waits in FIFO order up to the pool's wait timeout; a timeout is
    /// `PoolError::Timeout(TimeoutType::Wait)`, logged with the pool's status
    /// (use [`Pool::get_for`] for an error that carries it).
    #[track_caller]
    pub fn get(&self) -> impl std::future::Future<Output = Result<Conn, PoolError>> + Send + '_ {
        let site = Location::caller();
        async move {
            self.checkout(Lane::Request, site, self.shared.opts.wait_timeout)
                .await
                .map_err(into_pool_error)
        }
    }

    /// A connection of `lane`, waiting up to the pool's wait timeout.
    ///
    /// Session-lock checkouts are budgeted: past the budget they are refused
    /// ([`Error::BudgetExhausted`]) or admitted with a warning, by policy.
    #[track_caller]
    pub fn get_for(
        &self,
        lane: Lane,
    ) -> impl std::future::Future<Output = Result<Conn, Error>> + Send + '_ {
        let site = Location::caller();
        self.checkout(lane, site, self.shared.opts.wait_timeout)
    }

    /// A connection of `lane`, waiting up to `timeout`.
    #[track_caller]
    pub fn timeout_get_for(
        &self,
        lane: Lane,
        timeout: Duration,
    ) -> impl std::future::Future<Output = Result<Conn, Error>> + Send + '_ {
        let site = Location::caller();
        self.checkout(lane, site, timeout)
    }

    pub(crate) async fn checkout(
        &self,
        lane: Lane,
        site: &'static Location<'static>,
        timeout: Duration,
    ) -> Result<Conn, Error> {
        let shared = &self.shared;
        shared.ensure_housekeeping();
        let start = Instant::now();
        let permit = shared.acquire(lane, site, start, timeout).await?;
        let lm = shared.metrics.lane(lane);
        loop {
            let obj = match shared.inner.get().await {
                Ok(o) => o,
                Err(e) => {
                    lm.fail_backend.increment(1);
                    return Err(Error::Pool(e));
                }
            };
            let id = Object::id(&obj);
            enum Seen {
                Tainted,
                Known(i32, Instant),
                New,
            }
            // One lock: discard a tainted connection, or find its pid and,
            // when known, complete the checkout record.
            let seen = {
                let mut st = shared.state.lock();
                if !st.tainted.is_empty() && st.tainted.remove(&id) {
                    st.pids.remove(&id);
                    Seen::Tainted
                } else if let Some(pid) = st.pids.get(&id).copied() {
                    Seen::Known(pid, st.attach(permit.slot, pid, id))
                } else {
                    Seen::New
                }
            };
            let (pid, since) = match seen {
                Seen::Known(pid, since) => (pid, since),
                Seen::Tainted => {
                    tracing::warn!(pool = %shared.name, "discarding a pooled connection that held a leaked advisory lock");
                    drop(Object::take(obj));
                    continue;
                }
                Seen::New => match backend_pid(&obj).await {
                    Ok(pid) => {
                        let mut st = shared.state.lock();
                        // Connections deadpool dropped on its own leave stale
                        // entries: keep the map bounded (idle pids are asked again).
                        if st.pids.len() >= 4 * st.budget.limits().size() {
                            let out: IdSet =
                                st.checkouts.iter().filter_map(|(_, c)| c.object).collect();
                            st.pids.retain(|id, _| out.contains(id));
                        }
                        st.pids.insert(id, pid);
                        (pid, st.attach(permit.slot, pid, id))
                    }
                    Err(e) => {
                        lm.fail_backend.increment(1);
                        drop(Object::take(obj));
                        return Err(e);
                    }
                },
            };
            lm.acquire
                .record(since.saturating_duration_since(start).as_secs_f64());
            return Ok(Conn {
                obj: Some(obj),
                permit,
                pid,
                site,
                since,
                object: id,
            });
        }
    }

    /// The pool now: size, idle, and per lane in use, waiting and limits.
    pub fn status(&self) -> Status {
        self.shared.status()
    }

    /// The readiness probe: `SELECT 1` on the control lane, bounded by
    /// `timeout` (checkout included). Returns its latency.
    #[track_caller]
    pub fn readiness(
        &self,
        timeout: Duration,
    ) -> impl std::future::Future<Output = Result<Duration, Error>> + Send + '_ {
        let site = Location::caller();
        async move {
            let start = Instant::now();
            let probe = async {
                let c = self.checkout(Lane::Control, site, timeout).await?;
                c.simple_query("SELECT 1").await?;
                Ok::<_, Error>(())
            };
            let m = &self.shared.metrics;
            match tokio::time::timeout(timeout, probe).await {
                Ok(Ok(())) => {
                    let took = start.elapsed();
                    m.readiness.record(took.as_secs_f64());
                    Ok(took)
                }
                Ok(Err(e)) => {
                    if e.is_timeout() {
                        m.readiness_timeout.increment(1);
                    } else {
                        m.readiness_error.increment(1);
                    }
                    Err(e)
                }
                Err(_) => {
                    m.readiness_timeout.increment(1);
                    Err(Error::ReadinessTimeout(timeout))
                }
            }
        }
    }

    /// Closes the pool: idle connections are closed, waiters fail, checkouts
    /// fail from now on.
    pub fn close(&self) {
        self.shared.inner.close();
        let waiters: Vec<Waiter> = {
            let mut st = self.shared.state.lock();
            st.pending = [0; 3];
            st.waiters.drain(..).collect()
        };
        drop(waiters);
    }

    /// Runs one housekeeping pass now (the background task runs one every
    /// housekeeping interval): oldest-hold gauges, long-hold warnings.
    pub fn housekeep(&self) {
        self.shared.housekeep();
    }
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("name", &self.shared.name)
            .field("status", &self.status())
            .finish()
    }
}

fn into_pool_error(e: Error) -> PoolError {
    match e {
        Error::Pool(e) => e,
        Error::Db(e) => PoolError::Backend(e),
        Error::Timeout { .. } => PoolError::Timeout(TimeoutType::Wait),
        // The request lane is never refused and runs no other statement.
        _ => PoolError::Closed,
    }
}

async fn backend_pid(obj: &deadpool_postgres::Client) -> Result<i32, Error> {
    let msgs = obj.simple_query("SELECT pg_backend_pid()").await?;
    msgs.iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).and_then(|v| v.parse().ok()),
            _ => None,
        })
        .ok_or_else(|| Error::invalid("backend pid", "SELECT pg_backend_pid() returned no row"))
}
