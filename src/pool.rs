//! [`Pool`], its builder, the checked-out [`Conn`], and [`Status`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::panic::Location;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use deadpool_postgres::{Object, PoolError, TimeoutType};
use parking_lot::Mutex;
use slab::Slab;
use tokio::sync::oneshot;

use crate::budget::{Budget, Decision, Lane, Limits, Refusal};
use crate::error::{BuildError, Error, Holder};
use crate::metrics::PoolMetrics;

mod builder;
mod status;

pub use builder::PoolBuilder;
pub use status::{LaneStatus, Status};

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

/// The right to one connection of a lane: counted in the budget until dropped.
pub(crate) struct Permit {
    shared: Arc<Shared>,
    slot: usize,
    lane: Lane,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.shared.release(self.slot, self.lane);
    }
}

/// Removes a waiter from the queue when its checkout gives up or is dropped.
struct WaiterGuard<'a> {
    shared: &'a Shared,
    id: u64,
    lane: Lane,
}

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        let mut st = self.shared.state.lock();
        if let Some(pos) = st.waiters.iter().position(|w| w.id == self.id) {
            st.waiters.remove(pos);
            st.pending[self.lane.idx()] -= 1;
            let n = st.pending[self.lane.idx()];
            drop(st);
            self.shared.metrics.lane(self.lane).pending.set(n as f64);
        }
    }
}

impl Shared {
    fn refusal(&self, st: &State, lane: Lane, r: Refusal) -> Error {
        let (limit, hard_floor) = match r {
            Refusal::Budget { limit } => (limit, false),
            Refusal::HardFloor { limit } => (limit, true),
        };
        Error::BudgetExhausted {
            lane,
            limit,
            in_use: st.budget.in_use(lane),
            hard_floor,
            holders: st.holders(lane, Instant::now()),
        }
    }

    /// Admits one checkout of `lane`, waiting in FIFO order up to `timeout`.
    async fn acquire(
        self: &Arc<Self>,
        lane: Lane,
        site: &'static Location<'static>,
        start: Instant,
        timeout: Duration,
    ) -> Result<Permit, Error> {
        let lm = self.metrics.lane(lane);
        let (id, rx) = {
            let mut st = self.state.lock();
            let queued = st.pending[lane.idx()] > 0;
            let d = match st.budget.decide(lane) {
                // Others of this lane wait already: queue behind them.
                Decision::Admit | Decision::AdmitOverBudget if queued => Decision::Wait,
                Decision::Admit | Decision::AdmitOverBudget => st.budget.acquire(lane),
                d => d,
            };
            match d {
                Decision::Admit | Decision::AdmitOverBudget => {
                    let slot = st.insert(lane, site, start);
                    let in_use = st.budget.in_use(lane);
                    let over = d == Decision::AdmitOverBudget;
                    let first = over && st.warned_sites.insert(site as *const _ as usize);
                    drop(st);
                    lm.in_use.set(in_use as f64);
                    if over {
                        self.over_budget(site, first, in_use);
                    }
                    return Ok(Permit {
                        shared: self.clone(),
                        slot,
                        lane,
                    });
                }
                Decision::Refuse(r) => {
                    let err = self.refusal(&st, lane, r);
                    drop(st);
                    lm.fail_refused.increment(1);
                    if matches!(r, Refusal::Budget { .. }) {
                        self.metrics.overrun_refuse.increment(1);
                    }
                    return Err(err);
                }
                Decision::Wait => {
                    let (tx, rx) = oneshot::channel();
                    let id = st.next_waiter;
                    st.next_waiter += 1;
                    st.waiters.push_back(Waiter {
                        id,
                        lane,
                        site,
                        start,
                        tx,
                    });
                    st.pending[lane.idx()] += 1;
                    lm.pending.set(st.pending[lane.idx()] as f64);
                    (id, rx)
                }
            }
        };
        let guard = WaiterGuard {
            shared: self,
            id,
            lane,
        };
        let res = tokio::time::timeout(timeout.saturating_sub(start.elapsed()), rx).await;
        match res {
            Ok(Ok(permit)) => {
                // `release` took this waiter off the queue before granting
                // it: nothing to remove, skip the guard's scan of the queue.
                std::mem::forget(guard);
                Ok(permit)
            }
            // The sender went away without a permit: the pool is closing.
            Ok(Err(_)) => Err(Error::Pool(PoolError::Closed)),
            Err(_) => {
                // The status as this waiter saw it, itself still counted.
                let status = self.status();
                drop(guard);
                lm.fail_timeout.increment(1);
                tracing::warn!(pool = %self.name, %lane, waited = ?start.elapsed(), %status, "checkout timed out");
                Err(Error::Timeout {
                    lane,
                    waited: start.elapsed(),
                    status,
                })
            }
        }
    }

    fn over_budget(&self, site: &'static Location<'static>, first: bool, in_use: usize) {
        self.metrics.overrun_warn.increment(1);
        if first {
            let limit = self
                .state
                .lock()
                .budget
                .limits()
                .lane(Lane::SessionLock)
                .max;
            tracing::warn!(
                pool = %self.name,
                %site,
                in_use,
                limit,
                "session lock admitted past its budget (policy warn): hold no connection for \
                 background exclusivity; use a table lease or a transaction-scoped lock"
            );
        }
    }

    /// Returns one connection of `lane` to the budget and serves waiters.
    fn release(self: &Arc<Self>, slot: usize, lane: Lane) {
        // Usually one grant per return: the first needs no allocation.
        let mut grant: Option<(oneshot::Sender<Permit>, usize, Lane)> = None;
        let mut grants = Vec::new();
        let mut overs = Vec::new();
        let mut st = self.state.lock();
        if st.checkouts.try_remove(slot).is_none() {
            debug_assert!(false, "released an unknown checkout");
        }
        st.budget.release(lane);
        // A lane that must wait stays blocked for the rest of this pass:
        // granting a connection never makes room for another lane. Stop
        // once every lane with waiters is blocked, instead of asking the
        // budget again for each of the waiters queued behind.
        let mut blocked = [false; 3];
        let mut i = 0;
        while i < st.waiters.len() {
            let wl = st.waiters[i].lane;
            if blocked[wl.idx()] {
                i += 1;
                continue;
            }
            match st.budget.acquire(wl) {
                d @ (Decision::Admit | Decision::AdmitOverBudget) => {
                    let Some(w) = st.waiters.remove(i) else { break };
                    st.pending[wl.idx()] -= 1;
                    let slot = st.insert(wl, w.site, w.start);
                    if d == Decision::AdmitOverBudget {
                        let first = st.warned_sites.insert(w.site as *const _ as usize);
                        overs.push((w.site, first, st.budget.in_use(wl)));
                    }
                    if grant.is_none() {
                        grant = Some((w.tx, slot, wl));
                    } else {
                        grants.push((w.tx, slot, wl));
                    }
                }
                Decision::Refuse(_) | Decision::Wait => {
                    blocked[wl.idx()] = true;
                    let pending = st.pending;
                    if Lane::ALL
                        .iter()
                        .all(|l| blocked[l.idx()] || pending[l.idx()] == 0)
                    {
                        break;
                    }
                    i += 1;
                }
            }
        }
        let in_use = st.budget.in_use(lane);
        // Lanes whose gauges changed besides the returned one: those granted.
        let mut granted: [Option<(usize, usize)>; 3] = [None; 3];
        for (_, _, l) in grant.iter().chain(&grants) {
            granted[l.idx()] = Some((st.budget.in_use(*l), st.pending[l.idx()]));
        }
        drop(st);
        self.metrics.lane(lane).in_use.set(in_use as f64);
        for l in Lane::ALL {
            if let Some((n, p)) = granted[l.idx()] {
                let m = self.metrics.lane(l);
                m.in_use.set(n as f64);
                m.pending.set(p as f64);
            }
        }
        for (site, first, n) in overs {
            self.over_budget(site, first, n);
        }
        for (tx, slot, lane) in grant.into_iter().chain(grants) {
            let permit = Permit {
                shared: self.clone(),
                slot,
                lane,
            };
            // A waiter that gave up in the meantime hands the permit back,
            // whose drop releases it again.
            let _ = tx.send(permit);
        }
    }

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

    fn ensure_housekeeping(self: &Arc<Self>) {
        if self.housekeeping_started.load(Ordering::Relaxed) {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            if !self.housekeeping_started.swap(true, Ordering::AcqRel) {
                rt.spawn(housekeeping(Arc::downgrade(self), self.opts.housekeeping));
            }
        }
    }

    /// One housekeeping pass: the oldest hold per lane, long-hold warnings,
    /// connection gauges.
    pub(crate) fn housekeep(&self) {
        let now = Instant::now();
        let mut oldest = [Duration::ZERO; 3];
        let mut long = Vec::new();
        {
            let mut st = self.state.lock();
            for (_, c) in st.checkouts.iter_mut() {
                let age = now.saturating_duration_since(c.since);
                let o = &mut oldest[c.lane.idx()];
                *o = (*o).max(age);
                if age >= self.opts.long_hold && !c.long_warned {
                    c.long_warned = true;
                    long.push((c.lane, c.site, c.pid, age, c.note.clone()));
                }
            }
        }
        for l in Lane::ALL {
            self.metrics
                .lane(l)
                .oldest
                .set(oldest[l.idx()].as_secs_f64());
        }
        for (lane, site, pid, age, note) in long {
            self.metrics.lane(lane).long_holds.increment(1);
            tracing::warn!(
                pool = %self.name,
                %lane,
                %site,
                pid,
                ?age,
                held_for = note.as_deref().unwrap_or(""),
                threshold = ?self.opts.long_hold,
                "connection held past the long-hold threshold"
            );
        }
        let s = self.inner.status();
        self.metrics.idle.set(s.available as f64);
        self.metrics.in_use.set((s.size - s.available) as f64);
    }
}

async fn housekeeping(shared: Weak<Shared>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is immediate: nothing has been held yet.
    tick.tick().await;
    // The first census runs one interval after start, not at build time.
    let mut last_census = Instant::now();
    loop {
        tick.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if shared.inner.is_closed() {
            return;
        }
        shared.housekeep();
        if let Some(every) = shared.opts.census_interval {
            if last_census.elapsed() >= every {
                last_census = Instant::now();
                census_pass(Pool { shared }, every).await;
            }
        }
    }
}

/// The periodic census, bounded so that housekeeping never stalls on it.
async fn census_pass(pool: Pool, every: Duration) {
    let bound = pool.shared.opts.wait_timeout + every.min(Duration::from_secs(30));
    match tokio::time::timeout(bound, pool.census_sweep()).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::warn!(pool = %pool.shared.name, error = %e, "census failed"),
        Err(_) => tracing::warn!(pool = %pool.shared.name, ?bound, "census did not finish in time"),
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
        let pg: tokio_postgres::Config = url
            .parse()
            .map_err(|e: tokio_postgres::Error| BuildError::InvalidUrl(e.to_string()))?;
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

/// A checked-out connection. Derefs to [`deadpool_postgres::Client`], so code
/// written against deadpool runs unchanged; returns to the pool on drop.
///
/// Knows its lane, its backend pid, where it was checked out and since when.
pub struct Conn {
    // Field order matters: the object goes back to deadpool before the permit
    // is released, so an admitted checkout never waits inside deadpool.
    obj: Option<deadpool_postgres::Client>,
    permit: Permit,
    pid: i32,
    site: &'static Location<'static>,
    since: Instant,
    object: ObjectId,
}

impl Conn {
    /// The lane it was checked out on.
    pub fn lane(&self) -> Lane {
        self.permit.lane
    }

    /// The backend pid of its PostgreSQL session (behind a transaction
    /// pooler: the pid seen at first checkout, which may change).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Where it was checked out.
    pub fn site(&self) -> &'static Location<'static> {
        self.site
    }

    /// When it was checked out.
    pub fn since(&self) -> Instant {
        self.since
    }

    /// The pool it came from.
    pub fn pool(&self) -> Pool {
        Pool {
            shared: self.permit.shared.clone(),
        }
    }

    /// Closes the physical connection instead of returning it to the pool:
    /// PostgreSQL ends the session, and every session lock with it.
    pub fn discard(mut self) {
        if let Some(obj) = self.obj.take() {
            self.permit.shared.state.lock().pids.remove(&self.object);
            drop(Object::take(obj));
        }
    }

    /// Sets what the checkout is for, shown in long-hold warnings.
    pub(crate) fn set_note(&self, note: Option<String>) {
        if let Some(c) = self
            .permit
            .shared
            .state
            .lock()
            .checkouts
            .get_mut(self.permit.slot)
        {
            c.note = note;
        }
    }

    fn client(&self) -> &deadpool_postgres::Client {
        // infallible: `obj` is Some until drop or `discard`, which consume self.
        self.obj.as_ref().expect("connection present until drop")
    }
}

impl Deref for Conn {
    type Target = deadpool_postgres::Client;
    fn deref(&self) -> &Self::Target {
        self.client()
    }
}

impl DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut Self::Target {
        // infallible: `obj` is Some until drop or `discard`, which consume self.
        self.obj.as_mut().expect("connection present until drop")
    }
}

impl AsRef<deadpool_postgres::Client> for Conn {
    fn as_ref(&self) -> &deadpool_postgres::Client {
        self.client()
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(obj) = &self.obj {
            let shared = &self.permit.shared;
            shared
                .metrics
                .lane(self.permit.lane)
                .hold
                .record(self.since.elapsed().as_secs_f64());
            if obj.is_closed() {
                shared.state.lock().pids.remove(&self.object);
            }
        }
        // The fields drop next, in place: the object goes back to deadpool,
        // then the permit returns to the budget.
    }
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conn")
            .field("lane", &self.permit.lane)
            .field("pid", &self.pid)
            .field("site", &format_args!("{}", self.site))
            .field("age", &self.since.elapsed())
            .finish()
    }
}
