//! What every clone of a [`Pool`] shares, and everything done under its
//! state lock: the [`Shared`] core, the admission shell's tables and the
//! checkout records; the shell around the admission core (permits, each
//! waiter's answer and waker, returns, the "releasing" mark, resizing,
//! closing); and what the state says when read (the pool's
//! [`Status`](crate::Status), a lane's load). Every change to the core
//! happens under the state lock, and the lane gauges it moves are set there
//! too, so they always describe the state they were read from.
//!
//! Its parts, in order: the types; the pool's name; recent hold times; the admission shell; reading the
//! state. It calls no other file of the pool but the supervisor (at close):
//! checkouts, housekeeping, the builder and the probe call into it.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::panic::Location;
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use deadpool_postgres::PoolError;
use parking_lot::Mutex;
use slab::Slab;

use super::ext::Extensions;
use super::source::Source;
use super::supervisor::Supervisor;
use crate::admission::{
    Admission, Answer as Admitted, Effect, Lane, Limits, Priority, Refusal, WaiterKey,
};
use crate::error::{BuildError, CheckoutError, Error, LaneHolder, Stage};
use crate::metrics::PoolMetrics;
use crate::status::{LaneStatus, Status};

/// Hashes connection ids (deadpool object ids, one `usize` each) with a
/// multiplication: the pid map is read at every checkout, and SipHash's
/// resistance to chosen keys buys nothing for ids that the pool hands out.
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

/// Maps and sets keyed by connection id.
pub(crate) type IdMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<IdHasher>>;
pub(crate) type IdSet<K> = HashSet<K, std::hash::BuildHasherDefault<IdHasher>>;

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

/// A pgwarden pool of any backend (the deadpool [`Pool`], and with its
/// features `pgwarden::sqlx::Pool`): what the HTTP services take. Sealed:
/// not reachable from outside the crate, like [`Source`].
#[cfg(feature = "http")]
#[allow(unreachable_pub, private_interfaces)]
pub trait AnyPool: Clone + Send + Sync + 'static {
    /// The pool it wraps.
    type Source: Source;
    /// Its shared state.
    fn shared(&self) -> &Arc<Shared<Self::Source>>;
}

#[cfg(feature = "http")]
impl AnyPool for Pool {
    type Source = deadpool_postgres::Pool;

    #[allow(private_interfaces)]
    fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

pub(crate) struct Options {
    pub(crate) wait_timeout: Duration,
    pub(crate) long_hold: Duration,
    pub(crate) housekeeping: Duration,
}

/// What every clone of a pool shares, over the pool `B` it wraps (the
/// deadpool pool unless said otherwise: the layers above name `Shared`).
pub(crate) struct Shared<B: Source = deadpool_postgres::Pool> {
    pub(crate) name: Arc<str>,
    pub(super) _name: Claim,
    pub(crate) inner: B,
    /// The wrapped pool's checkout settings ([`Source::cfg`]).
    pub(super) cfg: B::Cfg,
    pub(crate) state: Mutex<State<B>>,
    pub(crate) opts: Options,
    pub(crate) metrics: PoolMetrics,
    /// State and settings of the layers above the pool, one value per type:
    /// the pool stores them without knowing what they are.
    pub(crate) ext: Extensions,
    /// Housekeeping and the layers' background work.
    pub(crate) supervisor: Supervisor,
    /// A readiness probe's connection set-up is kept going in the
    /// background (`probe.rs`): at most one at a time.
    pub(super) probe_setup: AtomicBool,
    /// When that background probe last answered (`None`: never); changed
    /// (to wake the probes waiting for it) each time one ends.
    pub(super) probe_answered: tokio::sync::watch::Sender<Option<tokio::time::Instant>>,
    /// Set once a deadpool resize was reported (warned once).
    pub(super) resize_warned: AtomicBool,
    /// Tests: the next housekeeping pass panics.
    #[cfg(test)]
    pub(crate) inject_panic: AtomicBool,
}

/// One checked-out connection, as the pool sees it.
pub(crate) struct Checkout<B: Source = deadpool_postgres::Pool> {
    pub(crate) lane: Lane,
    pub(crate) prio: Priority,
    pub(crate) site: &'static Location<'static>,
    /// When its connection was handed out, or, while it waits for
    /// deadpool or a new connection's pid, when its checkout began; `None`
    /// between its admission (at once, or a grant to a waiter) and its
    /// hand-out: a checkout reads no clock there (its connection's recycle
    /// time is the hand-out time).
    pub(crate) since: Option<Instant>,
    pub(crate) pid: Option<i32>,
    pub(crate) object: Option<B::Id>,
    pub(crate) long_warned: bool,
    /// Its owner let go and its return is under way.
    pub(crate) releasing: bool,
    /// What the checkout is for, for logs (e.g. the session lock keys held).
    pub(crate) note: Option<String>,
}

/// A physical connection seen by the pool: its backend pid, when it was
/// made (deadpool: the identity `deadpool::Pool::retain` can see), and
/// what keeps its id its own ([`Source::Anchor`]).
pub(crate) struct Known<B: Source = deadpool_postgres::Pool> {
    pub(crate) pid: i32,
    /// When its session started, where the backend asks it (sqlx): see
    /// [`Backend`](super::source::Backend).
    pub(crate) started: Option<i64>,
    pub(crate) created: Instant,
    pub(super) _anchor: B::Anchor,
    /// Where the backend's connections die with the runtime they were made
    /// on (sqlx), that runtime's watch.
    pub(super) made_on: Option<MadeOn>,
}

impl<B: Source> Known<B> {
    /// The runtime this connection was made on is gone: its socket with
    /// it, and a statement on it fails, or never ends.
    pub(super) fn orphaned(&self) -> bool {
        self.made_on.as_ref().is_some_and(MadeOn::gone)
    }
}

/// Watches the runtime a connection was first seen on (where sqlx made
/// it, in the checkout's own task): a task pending there for as long as
/// the connection is known, which the runtime drops as it goes. Aborted
/// when the connection is forgotten.
pub(crate) struct MadeOn {
    gone: Arc<AtomicBool>,
    task: tokio::task::AbortHandle,
}

/// Set when the task that holds it is dropped.
struct SetOnDrop(Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Release);
    }
}

impl MadeOn {
    /// The current runtime's watch; `None` outside one.
    pub(super) fn here() -> Option<MadeOn> {
        let rt = tokio::runtime::Handle::try_current().ok()?;
        let gone = Arc::new(AtomicBool::new(false));
        let flag = SetOnDrop(gone.clone());
        let task = rt.spawn(async move {
            let _flag = flag;
            std::future::pending::<()>().await
        });
        Some(MadeOn {
            gone,
            task: task.abort_handle(),
        })
    }

    fn gone(&self) -> bool {
        self.gone.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl Drop for MadeOn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub(crate) struct State<B: Source = deadpool_postgres::Pool> {
    pub(crate) adm: Admission,
    pub(super) waiters: Slab<Waiter>,
    pub(super) next_waiter: u64,
    pub(crate) checkouts: Slab<Checkout<B>>,
    pub(super) warned_sites: HashSet<usize>,
    /// Every physical connection seen, by id.
    pub(crate) pids: IdMap<B::Id, Known<B>>,
    /// Connections to discard at their next checkout (a leaked lock on them,
    /// found while they were out).
    pub(crate) tainted: IdSet<B::Id>,
    /// Recent hold times per lane, kept at every return.
    pub(crate) holds: RecentHolds,
}

impl<B: Source> State<B> {
    pub(super) fn new(limits: Limits) -> State<B> {
        State {
            adm: Admission::new(limits),
            waiters: Slab::new(),
            next_waiter: 0,
            checkouts: Slab::new(),
            warned_sites: HashSet::new(),
            pids: IdMap::default(),
            tainted: IdSet::default(),
            holds: RecentHolds::default(),
        }
    }

    pub(super) fn holders(&self, lane: Lane, now: Instant) -> Vec<LaneHolder> {
        self.checkouts
            .iter()
            .filter(|(_, c)| c.lane == lane)
            .map(|(_, c)| LaneHolder {
                site: c.site,
                age: c.age(now),
                pid: c.pid,
            })
            .collect()
    }

    /// Completes a checkout record once its connection is known, handed
    /// out at `now`; returns `now`.
    pub(super) fn attach(&mut self, slot: usize, pid: i32, object: B::Id, now: Instant) -> Instant {
        if let Some(c) = self.checkouts.get_mut(slot) {
            c.pid = Some(pid);
            c.object = Some(object);
            c.since = Some(now);
        }
        now
    }

    /// An admitted checkout waits (for deadpool, or a new connection's
    /// pid) since `start`: its record ages from then (unless it has a
    /// time already).
    pub(super) fn waiting_since(&mut self, slot: usize, start: Instant) {
        if let Some(c) = self.checkouts.get_mut(slot) {
            c.since.get_or_insert(start);
        }
    }

    /// Completes checkout record `slot` with connection `object`, handed
    /// out at `now`, when its pid is known and it is not tainted; returns
    /// the pid (`None`: the checkout's slow path finds out what it is).
    pub(super) fn attach_known(&mut self, slot: usize, object: B::Id, now: Instant) -> Option<i32> {
        let pid = match self.pids.get(&object) {
            Some(k) if self.tainted.is_empty() || !self.tainted.contains(&object) => k.pid,
            _ => return None,
        };
        self.attach(slot, pid, object, now);
        Some(pid)
    }

    /// Records a checkout admitted at once (handed out next: no time yet).
    pub(super) fn insert(
        &mut self,
        lane: Lane,
        prio: Priority,
        site: &'static Location<'static>,
    ) -> usize {
        self.checkouts.insert(Checkout::new(lane, prio, site))
    }
}

impl<B: Source> Checkout<B> {
    pub(super) fn new(lane: Lane, prio: Priority, site: &'static Location<'static>) -> Checkout<B> {
        Checkout {
            lane,
            prio,
            site,
            since: None,
            pid: None,
            object: None,
            long_warned: false,
            releasing: false,
            note: None,
        }
    }

    /// How long it has been out (or waiting) at `now`; zero while it is
    /// being handed out.
    pub(crate) fn age(&self, now: Instant) -> Duration {
        self.since
            .map_or(Duration::ZERO, |s| now.saturating_duration_since(s))
    }
}

/// The right to one connection of a lane: counted in the budget until
/// released (by [`Permit::release`], or on drop). Small enough to move in
/// registers: it moves with every checkout.
pub(crate) struct Permit<B: Source = deadpool_postgres::Pool> {
    shared: Arc<Shared<B>>,
    /// Its checkout record (a key of `State::checkouts`, which holds one
    /// record per admitted checkout: far below `u32::MAX`); [`RELEASED`]
    /// once released. 32 bits keep the permit to 16 bytes, two registers.
    slot: u32,
    pub(super) lane: Lane,
}

/// The slot of a permit already released.
const RELEASED: u32 = u32::MAX;

impl<B: Source> Permit<B> {
    fn new(shared: Arc<Shared<B>>, slot: usize, lane: Lane) -> Permit<B> {
        debug_assert!(slot < RELEASED as usize, "checkout record {slot}");
        Permit {
            shared,
            slot: slot as u32,
            lane,
        }
    }

    /// Moves it out, leaving a released one behind (which costs an `Arc`
    /// clone: for a return that finishes in a task of its own).
    pub(super) fn take(&mut self) -> Permit<B> {
        let slot = std::mem::replace(&mut self.slot, RELEASED);
        Permit {
            shared: self.shared.clone(),
            slot,
            lane: self.lane,
        }
    }

    /// Its pool's state.
    pub(super) fn shared(&self) -> &Arc<Shared<B>> {
        &self.shared
    }

    /// Its checkout record.
    pub(super) fn slot(&self) -> usize {
        self.slot as usize
    }

    /// Releases it now, its connection held for `held` (measured by the
    /// `Client` that held it: one clock read for both records).
    pub(super) fn release(&mut self, held: Duration) {
        let slot = std::mem::replace(&mut self.slot, RELEASED);
        if slot != RELEASED {
            self.shared.release(slot as usize, Some(held));
        }
    }
}

impl<B: Source> Drop for Permit<B> {
    fn drop(&mut self) {
        if self.slot != RELEASED {
            self.shared.release(self.slot as usize, None);
        }
    }
}

/// A queued checkout, as the shell keeps it: in the table from the moment
/// it queues until its checkout reads its answer or gives up (only its own
/// [`Queued`] takes it out), so its key stays its own meanwhile.
pub(crate) struct Waiter {
    /// Unique for the pool's life: checked each time the checkout reads
    /// or leaves its entry (the table reuses a key once its entry is out).
    pub(super) id: u64,
    pub(super) site: &'static Location<'static>,
    pub(super) wait: Wait,
}

/// Where a queued checkout's answer is: kept in its [`Waiter`] entry, with
/// no channel or allocation of its own.
pub(super) enum Wait {
    /// Not answered yet: the task to wake when it is.
    Pending(Waker),
    /// Granted (its checkout record and lane) or refused.
    Answered(Answer),
    /// The pool closed.
    Closed,
}

impl Waiter {
    /// Gives it its answer; returns the task to wake (once the lock is
    /// released).
    fn answer(&mut self, wait: Wait) -> Option<Waker> {
        match std::mem::replace(&mut self.wait, wait) {
            Wait::Pending(waker) => Some(waker),
            _ => {
                debug_assert!(false, "a waiter answered twice");
                None
            }
        }
    }
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.shared.fmt(f)
    }
}

impl<B: Source> fmt::Debug for Shared<B> {
    /// A pool, as its `Debug` shows it: its name and status.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("name", &self.name)
            .field("status", &self.status())
            .finish()
    }
}

/// A pass of periodic work.
pub(crate) type Pass = Pin<Box<dyn Future<Output = Result<(), Error>> + Send>>;

/// Periodic work a layer above plugs into the pool: each runs in its own
/// task, every [`Periodic::every`], each pass bounded by the pool's wait
/// timeout plus `min(every, 30 s)`, a panic caught, logged and counted like a
/// housekeeping panic.
pub(crate) trait Periodic<B: Source = deadpool_postgres::Pool>:
    fmt::Debug + Send + Sync + 'static
{
    /// Its name in logs (`"census"`); one hook per name.
    fn name(&self) -> &'static str;
    /// How often it runs.
    fn every(&self) -> Duration;
    /// One pass, on the pool's shared state.
    fn pass(&self, pool: Arc<Shared<B>>) -> Pass;
}

// --- the pool's name -------------------------------------------------------

// Pool names are unique among the live pools of a process by default, so
// that two pools never silently share the `pool` label of their metrics:
// an unnamed pool is `default`, then `default-2`, `default-3`… A name given
// explicitly is kept as given; when another live pool already has it, that
// is logged as a warning (their series add up under one label).

fn live() -> &'static std::sync::Mutex<HashMap<Arc<str>, usize>> {
    static LIVE: OnceLock<std::sync::Mutex<HashMap<Arc<str>, usize>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

/// A name held by a live pool; given back on drop.
#[derive(Debug)]
pub(crate) struct Claim(Arc<str>);

impl Claim {
    /// Claims `explicit`, or the first free default name.
    pub(crate) fn new(explicit: Option<&str>) -> Claim {
        // A poisoned registry only means another thread panicked while
        // holding it: the map itself is always consistent.
        let mut live = live().lock().unwrap_or_else(|e| e.into_inner());
        let name: Arc<str> = match explicit {
            Some(n) => n.into(),
            None => (1usize..)
                .map(|i| -> Arc<str> {
                    if i == 1 {
                        "default".into()
                    } else {
                        format!("default-{i}").into()
                    }
                })
                .find(|n| live.get(n).copied().unwrap_or(0) == 0)
                .unwrap_or_else(|| "default".into()),
        };
        let n = live.entry(name.clone()).or_insert(0);
        *n += 1;
        if *n > 1 {
            tracing::warn!(
                pool = %name,
                live = *n,
                "another live pool has this name: their metric series share the pool label; \
                 give each pool its own name"
            );
        }
        Claim(name)
    }

    pub(crate) fn name(&self) -> Arc<str> {
        self.0.clone()
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut live = live().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = live.get_mut(&self.0) {
            *n -= 1;
            if *n == 0 {
                live.remove(&self.0);
            }
        }
    }
}

// --- recent hold times -----------------------------------------------------

// Recent hold times per lane, kept in the return path.

/// Recent hold times per lane: an exponentially weighted moving average,
/// in nanoseconds, 0 until the first return. Part of the pool's state.
///
/// It rises fast (half the gap per sample) and falls slowly (an eighth),
/// so a wait estimated from it errs on the long side when holds grow.
#[derive(Debug, Default)]
pub(crate) struct RecentHolds([u64; Lane::COUNT]);

impl RecentHolds {
    /// Folds one hold into the lane's average.
    pub(crate) fn record(&mut self, lane: Lane, held: Duration) {
        let slot = &mut self.0[lane.idx()];
        let x = u64::try_from(held.as_nanos()).unwrap_or(u64::MAX);
        let old = *slot;
        let new = if old == 0 {
            x
        } else if x > old {
            // Up: half the gap.
            old + (x - old) / 2
        } else {
            // Down: an eighth of the gap.
            old - (old - x) / 8
        };
        *slot = new.max(1);
    }

    pub(crate) fn get(&self, lane: Lane) -> Option<Duration> {
        match self.0[lane.idx()] {
            0 => None,
            n => Some(Duration::from_nanos(n)),
        }
    }
}

// --- the admission shell ---------------------------------------------------

// The shell around the admission core: permits, each waiter's channel and
// deadline, returns, the "releasing" mark, and closing. Every change to the
// core happens under the state lock, and the lane gauges it moves are set
// there too, so they always describe the state they were read from.

/// What [`Shared::admit_now`] says when it does not refuse.
pub(super) enum Entry<'a, B: Source> {
    /// Admitted at once.
    Admitted(Permit<B>),
    /// Queued: wait with [`Queued::poll_admitted`].
    Queued(Queued<'a, B>),
}

/// A queued checkout: its entry in the waiters' table (read with
/// [`Queued::poll_admitted`]), and when it queued. Dropped before its
/// answer is read, it leaves the queue, or gives back the grant it was
/// given meanwhile.
pub(super) struct Queued<'a, B: Source> {
    shared: &'a Arc<Shared<B>>,
    key: WaiterKey,
    id: u64,
    lane: Lane,
    prio: Priority,
    /// When it was queued: its checkout's start, for its deadline.
    pub(super) start: tokio::time::Instant,
}

impl<B: Source> Queued<'_, B> {
    /// Its answer, once given: a permit, or why none (refused, or the pool
    /// closed). Until then it keeps `cx`'s waker in its entry. Ready only
    /// once: the entry leaves the table then.
    pub(super) fn poll_admitted(&mut self, cx: &mut Context<'_>) -> Poll<Result<Permit<B>, Error>> {
        let shared = self.shared;
        let lane = self.lane;
        let mut st = shared.state.lock();
        let w = match st.waiters.get_mut(self.key) {
            Some(w) if w.id == self.id => w,
            // Read already (its key may serve another since): a caller's
            // bug, answered as the pool closing rather than with a second
            // permit.
            _ => {
                debug_assert!(false, "a queued checkout polled after its answer");
                return Poll::Ready(Err(shared.closed(lane)));
            }
        };
        if let Wait::Pending(waker) = &mut w.wait {
            if !waker.will_wake(cx.waker()) {
                *waker = cx.waker().clone();
            }
            return Poll::Pending;
        }
        let w = st.waiters.remove(self.key);
        // Answered: the entry is gone, there is nothing left to undo.
        self.id = 0;
        Poll::Ready(match w.wait {
            Wait::Answered(Ok((slot, lane))) => {
                drop(st);
                Ok(Permit::new(shared.clone(), slot, lane))
            }
            Wait::Answered(Err(r)) => {
                let err = shared.refusal(&st, lane, r);
                drop(st);
                Err(shared.refused(lane, r, err))
            }
            Wait::Closed | Wait::Pending(_) => {
                drop(st);
                Err(shared.closed(lane))
            }
        })
    }
}

impl<B: Source> Drop for Queued<'_, B> {
    /// Leaves the queue (a checkout that gave up or was dropped), or gives
    /// back a grant its checkout did not read.
    fn drop(&mut self) {
        if self.id == 0 {
            return;
        }
        let mut fired = Fired::default();
        let granted = {
            let mut guard = self.shared.state.lock();
            let st = &mut *guard;
            let mine = st.waiters.get(self.key).is_some_and(|w| w.id == self.id);
            debug_assert!(mine, "a queued checkout's entry gone before its drop");
            if !mine {
                return;
            }
            match st.waiters.remove(self.key).wait {
                Wait::Pending(_) => {
                    let mut t = Tables {
                        waiters: &mut st.waiters,
                        checkouts: &mut st.checkouts,
                        warned_sites: &mut st.warned_sites,
                    };
                    st.adm.cancel(self.lane, self.prio, self.key, |e| {
                        self.shared.apply(&mut t, e, &mut fired)
                    });
                    self.shared.publish(st, 1 << self.lane.idx() | fired.lanes);
                    None
                }
                Wait::Answered(Ok((slot, _))) => Some(slot),
                Wait::Answered(Err(_)) | Wait::Closed => None,
            }
        };
        fired.send(self.shared);
        if let Some(slot) = granted {
            // Granted as it gave up: the grant goes back (and to the next).
            self.shared.release(slot, None);
        }
    }
}

/// A grant's checkout slot and lane, or a refusal: what a waiter is told
/// (made into a permit by the waiter as it reads it, out of the lock: the
/// permit's `Arc` clone is an atomic every checkout touches).
pub(super) type Answer = Result<(usize, Lane), Refusal>;

/// Tasks to wake once the lock is released, and what changed.
#[derive(Default)]
struct Fired {
    first: Option<Waker>,
    rest: Vec<Waker>,
    /// Lanes whose gauges moved (bit per lane index).
    lanes: u8,
    /// Session locks admitted past the budget: (site, first at that site).
    overs: Vec<(&'static Location<'static>, bool)>,
}

impl Fired {
    fn push(&mut self, waker: Option<Waker>) {
        let Some(waker) = waker else { return };
        if self.first.is_none() {
            self.first = Some(waker);
        } else {
            self.rest.push(waker);
        }
    }

    #[inline]
    fn send<B: Source>(self, shared: &Arc<Shared<B>>) {
        // Nothing fired (most returns): `rest` is empty whenever `first`
        // is, and empty vectors hold no memory, so there is nothing to drop.
        if self.first.is_none() && self.overs.is_empty() {
            std::mem::forget(self);
            return;
        }
        self.send_all(shared);
    }

    fn send_all<B: Source>(self, shared: &Arc<Shared<B>>) {
        for (site, first) in self.overs {
            shared.over_budget(site, first);
        }
        for waker in self.first.into_iter().chain(self.rest) {
            waker.wake();
        }
    }
}

/// The shell's tables, apart from the admission core that is borrowed
/// while its effects are applied to them.
struct Tables<'a, B: Source> {
    waiters: &'a mut Slab<Waiter>,
    checkouts: &'a mut Slab<Checkout<B>>,
    warned_sites: &'a mut HashSet<usize>,
}

impl<B: Source> Shared<B> {
    /// Applies one of the core's effects (under the lock).
    fn apply(&self, t: &mut Tables<'_, B>, e: Effect, fired: &mut Fired) {
        match e {
            Effect::Grant {
                key,
                lane,
                prio,
                over_budget,
            } => {
                let Some(w) = t.waiters.get_mut(key) else {
                    debug_assert!(false, "granted an unknown waiter");
                    return;
                };
                let slot = t.checkouts.insert(Checkout::new(lane, prio, w.site));
                if over_budget {
                    let first = t.warned_sites.insert(w.site as *const _ as usize);
                    fired.overs.push((w.site, first));
                }
                fired.lanes |= 1 << lane.idx();
                fired.push(w.answer(Wait::Answered(Ok((slot, lane)))));
            }
            Effect::Refuse { key, lane, refusal } => {
                if let Some(w) = t.waiters.get_mut(key) {
                    fired.lanes |= 1 << lane.idx();
                    fired.push(w.answer(Wait::Answered(Err(refusal))));
                }
            }
        }
    }

    /// Sets the in-use and pending gauges of the lanes in `lanes` (a bit per
    /// lane index), under the lock that guards what they describe.
    pub(super) fn publish(&self, st: &State<B>, lanes: u8) {
        let mut bits = lanes & ((1 << Lane::COUNT) - 1);
        while bits != 0 {
            let lane = Lane::ALL[bits.trailing_zeros() as usize];
            bits &= bits - 1;
            let m = self.metrics.lane(lane);
            m.in_use.set(st.adm.in_use(lane) as f64);
            m.pending.set(st.adm.pending(lane) as f64);
        }
    }

    fn refusal(&self, st: &State<B>, lane: Lane, r: Refusal) -> Error {
        let (limit, hard_floor) = match r {
            Refusal::Budget { limit } => (limit, false),
            Refusal::HardFloor { limit } => (limit, true),
        };
        Error::Checkout(CheckoutError::BudgetExhausted {
            lane,
            limit,
            in_use: st.adm.in_use(lane),
            hard_floor,
            holders: st.holders(lane, Instant::now()),
            pool_size: st.adm.limits().size(),
        })
    }

    fn refused(&self, lane: Lane, r: Refusal, err: Error) -> Error {
        self.metrics.lane(lane).fail_refused.increment(1);
        if matches!(r, Refusal::Budget { .. }) {
            self.metrics.overrun_refuse.increment(1);
        }
        err
    }

    fn closed(&self, lane: Lane) -> Error {
        self.metrics.lane(lane).fail_closed.increment(1);
        Error::Checkout(CheckoutError::Pool(PoolError::Closed))
    }

    /// Admits one checkout of `lane` at `prio`, waiting in FIFO order up to
    /// `timeout` (and, when `patient`, waiting for the session-lock budget
    /// rather than being refused while other locks hold it).
    #[cfg(test)]
    pub(super) async fn admit(
        self: &Arc<Self>,
        lane: Lane,
        prio: Priority,
        patient: bool,
        site: &'static Location<'static>,
        timeout: Duration,
    ) -> Result<Permit<B>, Error> {
        let waker = std::future::poll_fn(|cx| Poll::Ready(cx.waker().clone())).await;
        match self.admit_now(lane, prio, patient, site, &waker)? {
            Entry::Admitted(permit) => {
                // No connection comes: its record ages from now, as a
                // checkout's that waits for deadpool.
                self.waiting_since(permit.slot(), tokio::time::Instant::now().into_std());
                Ok(permit)
            }
            Entry::Queued(mut q) => {
                let deadline = super::deadline::deadline(q.start, timeout);
                let answer = std::future::poll_fn(|cx| q.poll_admitted(cx));
                match tokio::time::timeout_at(deadline, answer).await {
                    Ok(r) => r,
                    Err(_) => {
                        // The status as this waiter saw it, itself still counted.
                        let status = self.status();
                        let start = q.start;
                        drop(q);
                        Err(self.timed_out(lane, Stage::Admission, start, status))
                    }
                }
            }
        }
    }

    /// [`State::waiting_since`], under the lock.
    pub(super) fn waiting_since(&self, slot: usize, start: Instant) {
        self.state.lock().waiting_since(slot, start)
    }

    /// [`State::attach_known`], under the lock.
    pub(super) fn attach_known(&self, slot: usize, object: B::Id, now: Instant) -> Option<i32> {
        self.state.lock().attach_known(slot, object, now)
    }

    /// The synchronous half of an admission, one lock: admitted now,
    /// queued (in FIFO order; when `patient`, waiting for the session-lock
    /// budget rather than being refused while other locks hold it), or
    /// refused. A queued checkout keeps `waker` in its entry, to be woken
    /// by its answer, and reads it with [`Queued::poll_admitted`]. Only a
    /// queued one reads the clock (its start, for its deadline; after the
    /// lock): one admitted at once is handed out at its connection's
    /// recycle time. A granted waiter's record, like one admitted at once,
    /// has no time until its hand-out (or until it waits for deadpool).
    #[inline(always)]
    pub(super) fn admit_now<'a>(
        self: &'a Arc<Self>,
        lane: Lane,
        prio: Priority,
        patient: bool,
        site: &'static Location<'static>,
        waker: &Waker,
    ) -> Result<Entry<'a, B>, Error> {
        let mut st = self.state.lock();
        let key = st.waiters.vacant_key();
        match st.adm.request_with(lane, prio, key, patient) {
            // Inline (the common case): the permit is built where the
            // checkout keeps it.
            Admitted::Admit { over_budget } => {
                let slot = st.insert(lane, prio, site);
                let in_use = st.adm.in_use(lane);
                self.metrics.lane(lane).in_use.set(in_use as f64);
                let first = over_budget && st.warned_sites.insert(site as *const _ as usize);
                drop(st);
                if over_budget {
                    self.over_budget(site, first);
                }
                Ok(Entry::Admitted(Permit::new(self.clone(), slot, lane)))
            }
            Admitted::Refused(r) => {
                let err = self.refusal(&st, lane, r);
                drop(st);
                Err(self.refused(lane, r, err))
            }
            Admitted::Closed => {
                drop(st);
                Err(self.closed(lane))
            }
            Admitted::Queued => Ok(self.enqueue(st, lane, prio, key, site, waker)),
        }
    }

    /// [`Shared::admit_now`] for a checkout that must wait: it joins the
    /// queue (out of line: it keeps the admission's inline part small).
    #[inline(never)]
    fn enqueue<'a>(
        self: &'a Arc<Self>,
        mut st: parking_lot::MutexGuard<'_, State<B>>,
        lane: Lane,
        prio: Priority,
        key: WaiterKey,
        site: &'static Location<'static>,
        waker: &Waker,
    ) -> Entry<'a, B> {
        st.next_waiter += 1;
        let id = st.next_waiter;
        let wait = Wait::Pending(waker.clone());
        let at = st.waiters.insert(Waiter { id, site, wait });
        debug_assert_eq!(at, key, "a waiter filed under another key than the queue's");
        self.publish(&st, 1 << lane.idx());
        drop(st);
        // Read out of the lock: its deadline counts from here.
        let start = tokio::time::Instant::now();
        Entry::Queued(Queued {
            shared: self,
            key,
            id,
            lane,
            prio,
            start,
        })
    }

    /// Counts and logs a checkout whose bound ran out.
    pub(super) fn timed_out(
        &self,
        lane: Lane,
        stage: Stage,
        start: tokio::time::Instant,
        status: crate::status::Status,
    ) -> Error {
        self.metrics.lane(lane).fail_timeout.increment(1);
        let waited = start.elapsed();
        tracing::warn!(pool = %self.name, %lane, ?waited, %stage, %status, "checkout timed out");
        Error::Checkout(CheckoutError::Timeout {
            lane,
            waited,
            stage,
            status: Box::new(status),
        })
    }

    fn over_budget(&self, site: &'static Location<'static>, first: bool) {
        self.metrics.overrun_warn.increment(1);
        if first {
            let (in_use, limit) = {
                let st = self.state.lock();
                let lane = Lane::SessionLock;
                (st.adm.in_use(lane), st.adm.limits().lane(lane).max)
            };
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

    /// Returns one checkout to the budget and serves the waiters it makes
    /// room for; `held`: how long its connection was held, when measured.
    pub(super) fn release(self: &Arc<Self>, slot: usize, held: Option<Duration>) {
        let fired = {
            let mut guard = self.state.lock();
            let st = &mut *guard;
            let Some(c) = st.checkouts.try_remove(slot) else {
                debug_assert!(false, "released an unknown checkout");
                return;
            };
            // A connection was handed out (not a checkout that failed
            // after admission): its hold counts in the lane's average.
            if c.object.is_some() {
                let held = held.unwrap_or_else(|| c.age(Instant::now()));
                st.holds.record(c.lane, held);
            }
            if st.adm.waiting() == 0 {
                // Nobody to serve or refuse (most returns): only the
                // lane's in-use moves.
                st.adm.release(c.lane, c.prio, c.releasing, |_| {});
                let in_use = st.adm.in_use(c.lane);
                self.metrics.lane(c.lane).in_use.set(in_use as f64);
                return;
            }
            let mut fired = Fired::default();
            let mut t = Tables {
                waiters: &mut st.waiters,
                checkouts: &mut st.checkouts,
                warned_sites: &mut st.warned_sites,
            };
            st.adm.release(c.lane, c.prio, c.releasing, |e| {
                self.apply(&mut t, e, &mut fired)
            });
            if fired.lanes == 0 {
                // Nobody served or refused: only the lane's in-use moved.
                let in_use = st.adm.in_use(c.lane);
                self.metrics.lane(c.lane).in_use.set(in_use as f64);
            } else {
                self.publish(st, 1 << c.lane.idx() | fired.lanes);
            }
            fired
        };
        fired.send(self);
    }

    /// The owner of checkout `slot` let go and its return is under way: a
    /// checkout of its lane refused only because of it waits instead.
    pub(super) fn mark_releasing(&self, slot: usize) {
        let mut st = self.state.lock();
        let lane = match st.checkouts.get_mut(slot) {
            Some(c) if !c.releasing => {
                c.releasing = true;
                c.lane
            }
            _ => return,
        };
        st.adm.mark_releasing(lane);
    }

    /// Resizes the pool to `size`: the lanes' limits derived again for it
    /// (the lanes set explicitly kept), then deadpool resized in the same
    /// critical section (grown before the new limits admit more, shrunk
    /// after they stop admitting past the new size). Checkouts out stay
    /// out; a shrink below them admits nothing more until returns bring the
    /// pool below its new size, and deadpool closes the connections that
    /// come back past it.
    pub(crate) fn resize(self: &Arc<Self>, size: usize) -> Result<(), BuildError> {
        let mut fired = Fired::default();
        let limits = {
            let mut guard = self.state.lock();
            let st = &mut *guard;
            if st.adm.is_closed() || self.inner.is_closed() {
                return Err(BuildError::DeadpoolClosed);
            }
            let limits = st.adm.limits().resized(size)?;
            let grow = size > st.adm.limits().size();
            if grow {
                self.inner.resize(size);
            }
            let mut t = Tables {
                waiters: &mut st.waiters,
                checkouts: &mut st.checkouts,
                warned_sites: &mut st.warned_sites,
            };
            st.adm
                .set_limits(limits.clone(), |e| self.apply(&mut t, e, &mut fired));
            if !grow {
                self.inner.resize(size);
            }
            self.publish(st, u8::MAX);
            limits
        };
        self.metrics.publish_limits(&self.name, &limits);
        fired.send(self);
        Ok(())
    }

    /// Whether the pool was closed.
    pub(crate) fn is_closed(&self) -> bool {
        self.state.lock().adm.is_closed() || self.inner.is_closed()
    }

    /// Closes deadpool, stops the background work and fails every waiter.
    pub(crate) fn close(&self) {
        self.inner.close();
        self.supervisor.close();
        let mut wake = Vec::new();
        {
            let mut st = self.state.lock();
            let st = &mut *st;
            let mut keys = Vec::new();
            st.adm.close(|k| keys.push(k));
            for k in keys {
                if let Some(w) = st.waiters.get_mut(k) {
                    wake.extend(w.answer(Wait::Closed));
                }
            }
            self.publish(st, u8::MAX);
        }
        // They read `closed` in their entries.
        for waker in wake {
            waker.wake();
        }
    }
}

// --- reading the state -----------------------------------------------------

// The pool's [`Status`](crate::Status), and what a lane looks like to
// someone deciding whether to queue for it: in use, limits, waiters,
// whether a checkout would be admitted now, and how long its connections
// have been held lately (an average kept in the return path, under the lock
// the return takes anyway: no shared cache line of its own to bounce
// between cores).

/// One lane's load, read under the pool's lock in one go.
#[cfg_attr(not(feature = "http"), allow(dead_code))]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct LaneLoad {
    /// Connections of the lane out now.
    pub(crate) in_use: usize,
    /// The lane's maximum.
    pub(crate) max: usize,
    /// Checkouts of the lane waiting now.
    pub(crate) pending: usize,
    /// How many connections the lane can hold at once now: its maximum,
    /// less what the other lanes hold or keep in reserve (at least what it
    /// holds, and at least 1).
    pub(crate) capacity: usize,
    /// Whether a checkout of the lane would be admitted at once.
    pub(crate) admits_now: bool,
    /// The lane's recent hold time (`None` before its first return).
    pub(crate) recent_hold: Option<Duration>,
    /// The pool is closed.
    pub(crate) closed: bool,
}

impl<B: Source> Shared<B> {
    /// The pool now, read under the lock in one go.
    pub(crate) fn status(&self) -> Status {
        let d = self.inner.status();
        let st = self.state.lock();
        let limits = st.adm.limits();
        let lanes = Lane::ALL.map(|lane| LaneStatus {
            lane,
            in_use: st.adm.in_use(lane),
            releasing: st.adm.releasing(lane),
            waiting: st.adm.pending(lane),
            reserved: limits.lane(lane).reserved,
            max: limits.lane(lane).max,
        });
        Status {
            max: limits.size(),
            max_size: limits.size(),
            size: d.size,
            idle: d.idle,
            available: d.idle,
            in_use: st.adm.total(),
            waiting: st.adm.waiting(),
            lanes,
        }
    }

    #[cfg_attr(not(feature = "http"), allow(dead_code))]
    pub(crate) fn lane_load(&self, lane: Lane) -> LaneLoad {
        let st = self.state.lock();
        let recent_hold = st.holds.get(lane);
        let adm = &st.adm;
        let limits = adm.limits();
        let in_use = adm.in_use(lane);
        let max = limits.lane(lane).max;
        let others: usize = Lane::ALL
            .iter()
            .filter(|l| **l != lane)
            .map(|l| adm.in_use(*l).max(limits.lane(*l).reserved))
            .sum();
        let capacity = max
            .min(limits.size().saturating_sub(others))
            .max(in_use)
            .max(1);
        LaneLoad {
            in_use,
            max,
            pending: adm.pending(lane),
            capacity,
            admits_now: adm.admits_now(lane, Priority::Normal),
            recent_hold,
            closed: adm.is_closed(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_holds_rise_fast_and_fall_slowly() {
        let mut h = RecentHolds::default();
        assert_eq!(h.get(Lane::Request), None);
        let ms = Duration::from_millis;
        h.record(Lane::Request, ms(5));
        assert_eq!(h.get(Lane::Request), Some(ms(5)));
        for _ in 0..4 {
            h.record(Lane::Request, ms(50));
        }
        let up = h.get(Lane::Request).unwrap();
        assert!(up > ms(45) && up <= ms(50), "{up:?}");
        h.record(Lane::Request, ms(10));
        let down = h.get(Lane::Request).unwrap();
        assert!(down > ms(40), "{down:?}");
        assert_eq!(h.get(Lane::Probe), None);
        h.record(Lane::Probe, Duration::ZERO);
        assert!(
            h.get(Lane::Probe).is_some(),
            "a zero hold still counts as seen"
        );
        h.record(Lane::Lease, Duration::MAX);
        assert!(h.get(Lane::Lease).is_some());
    }
}
