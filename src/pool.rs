//! [`Pool`], its builder, the checked-out [`Conn`], and [`Status`].
//!
//! The pool is a thin shell around the pure admission core
//! ([`crate::admission`]): it keeps each waiter's channel, the checkout
//! records and the backend pids, applies the core's grants and refusals, and
//! takes the admitted connection from deadpool, whose capacity it owns.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::panic::Location;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::{PoolError, TimeoutType};
use parking_lot::Mutex;
use slab::Slab;

use crate::admission::{Admission, Lane, Limits, Priority};
use crate::error::{BuildError, Error, Holder};
use crate::metrics::PoolMetrics;

mod admission;
mod builder;
mod checkout;
mod conn;
mod deadline;
mod housekeeping;
// The load accessor serves `crate::http` (feature `http`).
#[cfg_attr(not(feature = "http"), allow(dead_code))]
mod load;
mod names;
mod status;
#[cfg(test)]
mod tests;

pub use builder::PoolBuilder;
pub use conn::Conn;
pub use deadline::Deadline;
#[cfg(feature = "http")]
pub(crate) use load::LaneLoad;
pub use status::{DeadpoolView, LaneStatus, Status};

use admission::Waiter;

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
    _name: names::Claim,
    pub(crate) inner: deadpool_postgres::Pool,
    /// deadpool's timeouts with a zero wait: an admitted checkout never
    /// waits inside deadpool, it finds out at once that it would.
    get_timeouts: deadpool_postgres::Timeouts,
    pub(crate) state: Mutex<State>,
    pub(crate) opts: Options,
    pub(crate) metrics: PoolMetrics,
    pub(crate) locks: crate::lock::LockShared,
    housekeeping_started: AtomicBool,
    /// Set once a deadpool resize was reported (warned once).
    resize_warned: AtomicBool,
    /// Tests: the next housekeeping pass panics.
    #[cfg(test)]
    pub(crate) inject_panic: AtomicBool,
}

/// One checked-out connection, as the pool sees it.
#[derive(Debug)]
pub(crate) struct Checkout {
    pub(crate) lane: Lane,
    pub(crate) prio: Priority,
    pub(crate) site: &'static Location<'static>,
    pub(crate) since: Instant,
    pub(crate) pid: Option<i32>,
    pub(crate) object: Option<ObjectId>,
    pub(crate) long_warned: bool,
    /// Its owner let go and its return is under way.
    pub(crate) releasing: bool,
    /// What the checkout is for, for logs (e.g. the session lock keys held).
    pub(crate) note: Option<String>,
}

/// A physical connection seen by the pool: its backend pid, and when
/// deadpool created it (the identity `deadpool::Pool::retain` can see).
#[derive(Copy, Clone, Debug)]
pub(crate) struct Known {
    pub(crate) pid: i32,
    pub(crate) created: Instant,
}

pub(crate) struct State {
    pub(crate) adm: Admission,
    waiters: Slab<Waiter>,
    next_waiter: u64,
    pub(crate) checkouts: Slab<Checkout>,
    warned_sites: HashSet<usize>,
    /// Every physical connection seen, by deadpool object id.
    pub(crate) pids: IdMap<Known>,
    /// Connections to discard at their next checkout (a leaked lock on them,
    /// found while they were out).
    pub(crate) tainted: IdSet,
    /// Recent hold times per lane, kept at every return.
    pub(crate) holds: load::RecentHolds,
}

impl State {
    fn new(limits: Limits) -> State {
        State {
            adm: Admission::new(limits),
            waiters: Slab::new(),
            next_waiter: 0,
            checkouts: Slab::new(),
            warned_sites: HashSet::new(),
            pids: IdMap::default(),
            tainted: IdSet::default(),
            holds: load::RecentHolds::default(),
        }
    }

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

    fn insert(
        &mut self,
        lane: Lane,
        prio: Priority,
        site: &'static Location<'static>,
        since: Instant,
    ) -> usize {
        self.checkouts
            .insert(Checkout::new(lane, prio, site, since))
    }
}

impl Checkout {
    fn new(
        lane: Lane,
        prio: Priority,
        site: &'static Location<'static>,
        since: Instant,
    ) -> Checkout {
        Checkout {
            lane,
            prio,
            site,
            since,
            pid: None,
            object: None,
            long_warned: false,
            releasing: false,
            note: None,
        }
    }
}

impl Pool {
    /// Starts a builder over an existing deadpool pool (the drop-in path).
    /// pgwarden owns that pool's capacity from then on: keep no clone of it.
    pub fn builder(inner: deadpool_postgres::Pool) -> PoolBuilder {
        PoolBuilder::new(inner)
    }

    /// Wraps an existing deadpool pool with the default limits.
    pub fn new(inner: deadpool_postgres::Pool) -> Result<Pool, BuildError> {
        PoolBuilder::new(inner).build()
    }

    /// The pool's name, as in logs and metric labels.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// A read-only view of the wrapped deadpool pool (its status and
    /// timeouts). Its connections come only through pgwarden.
    pub fn inner(&self) -> DeadpoolView<'_> {
        DeadpoolView(&self.shared.inner)
    }

    /// The lane limits in force.
    pub fn limits(&self) -> Limits {
        self.shared.state.lock().adm.limits().clone()
    }

    /// A request-lane connection: the drop-in replacement for
    /// [`deadpool_postgres::Pool::get`], with deadpool's error type.
    ///
    /// Bounded end to end by the pool's wait timeout: admission (FIFO),
    /// deadpool, connecting or recycling, and the backend-pid query of a new
    /// connection. A timeout is `PoolError::Timeout` (`Wait` while waiting
    /// for admission, `Create` after), logged with the pool's status (use
    /// [`Pool::get_for`] for an error that carries it).
    #[track_caller]
    pub fn get(&self) -> impl std::future::Future<Output = Result<Conn, PoolError>> + Send + '_ {
        let site = Location::caller();
        async move {
            self.checkout(Lane::Request, site, self.shared.opts.wait_timeout)
                .await
                .map_err(into_pool_error)
        }
    }

    /// A connection of `lane`, within the pool's wait timeout (checkout
    /// included, as in [`Pool::get`]).
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

    /// A connection of `lane`, within `timeout` (checkout included).
    #[track_caller]
    pub fn timeout_get_for(
        &self,
        lane: Lane,
        timeout: Duration,
    ) -> impl std::future::Future<Output = Result<Conn, Error>> + Send + '_ {
        let site = Location::caller();
        self.checkout(lane, site, timeout)
    }

    /// The pool now: size, idle, and per lane in use, waiting and limits.
    pub fn status(&self) -> Status {
        self.shared.status()
    }

    /// One lane's load now: in use, maximum, waiting, capacity, whether a
    /// checkout would be admitted at once, and its recent hold time.
    #[cfg_attr(not(feature = "http"), allow(dead_code))]
    pub(crate) fn lane_load(&self, lane: Lane) -> load::LaneLoad {
        self.shared.lane_load(lane)
    }

    /// The readiness probe: `SELECT 1` on the probe lane, whose reserve no
    /// other lane may take, bounded by `timeout` (checkout included). Returns
    /// its latency. A probe cut off by its bound closes its connection.
    #[track_caller]
    pub fn readiness(
        &self,
        timeout: Duration,
    ) -> impl std::future::Future<Output = Result<Duration, Error>> + Send + '_ {
        let site = Location::caller();
        async move {
            let start = tokio::time::Instant::now();
            let m = &self.shared.metrics;
            let result = match self.checkout(Lane::Probe, site, timeout).await {
                Ok(c) => {
                    let left = timeout.saturating_sub(start.elapsed());
                    match tokio::time::timeout(left, c.simple_query("SELECT 1")).await {
                        Ok(r) => r.map(drop).map_err(Error::from),
                        Err(_) => {
                            // The server did not answer: this connection is
                            // in an unknown state, never reuse it.
                            c.discard();
                            Err(Error::ReadinessTimeout(timeout))
                        }
                    }
                }
                Err(e) if e.is_timeout() => Err(Error::ReadinessTimeout(timeout)),
                Err(e) => Err(e),
            };
            match result {
                Ok(()) => {
                    let took = start.elapsed();
                    m.readiness.record(took.as_secs_f64());
                    Ok(took)
                }
                Err(e) => {
                    if e.is_timeout() {
                        m.readiness_timeout.increment(1);
                    } else {
                        m.readiness_error.increment(1);
                    }
                    Err(e)
                }
            }
        }
    }

    /// Closes the pool: idle connections are closed, waiters fail, checkouts
    /// fail from now on (each counted as failure reason `closed`).
    pub fn close(&self) {
        self.shared.close();
    }

    /// Runs one housekeeping pass now (the background task runs one every
    /// housekeeping interval): oldest-hold gauges, long-hold warnings, lane
    /// and connection gauges.
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
    use crate::error::Stage;
    match e {
        Error::Pool(e) => e,
        Error::Db(e) => PoolError::Backend(e),
        Error::Timeout {
            stage: Stage::Admission,
            ..
        }
        | Error::DeadpoolMismatch { .. } => PoolError::Timeout(TimeoutType::Wait),
        Error::Timeout { .. } => PoolError::Timeout(TimeoutType::Create),
        // The request lane is never refused and runs no other statement.
        _ => PoolError::Closed,
    }
}
