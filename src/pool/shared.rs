//! The pool's shared state: [`Pool`] itself, its [`Shared`] core, the
//! admission shell's tables and the checkout records. The files beside it add
//! behaviour to these types; this one imports none of them but leaves.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::panic::Location;
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use slab::Slab;
use tokio::sync::oneshot;

use super::ext::Extensions;
use super::holds::RecentHolds;
use super::names;
use super::supervisor::Supervisor;
use crate::admission::{Admission, Lane, Limits, Priority, Refusal};
use crate::error::{Error, LaneHolder};
use crate::metrics::PoolMetrics;

pub(crate) type ObjectId = deadpool_postgres::ObjectId;

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
}

pub(crate) struct Shared {
    pub(crate) name: Arc<str>,
    pub(super) _name: names::Claim,
    pub(crate) inner: deadpool_postgres::Pool,
    /// deadpool's timeouts with a zero wait: an admitted checkout never
    /// waits inside deadpool, it finds out at once that it would.
    pub(super) get_timeouts: deadpool_postgres::Timeouts,
    pub(crate) state: Mutex<State>,
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
    /// Set once a deadpool resize was reported (warned once).
    pub(super) resize_warned: AtomicBool,
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
    pub(super) waiters: Slab<Waiter>,
    pub(super) next_waiter: u64,
    pub(crate) checkouts: Slab<Checkout>,
    pub(super) warned_sites: HashSet<usize>,
    /// Every physical connection seen, by deadpool object id.
    pub(crate) pids: IdMap<Known>,
    /// Connections to discard at their next checkout (a leaked lock on them,
    /// found while they were out).
    pub(crate) tainted: IdSet,
    /// Recent hold times per lane, kept at every return.
    pub(crate) holds: RecentHolds,
}

impl State {
    pub(super) fn new(limits: Limits) -> State {
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
                age: now.saturating_duration_since(c.since),
                pid: c.pid,
            })
            .collect()
    }

    /// Completes a checkout record once its connection is known; returns
    /// the checkout instant.
    pub(super) fn attach(&mut self, slot: usize, pid: i32, object: ObjectId) -> Instant {
        let now = Instant::now();
        if let Some(c) = self.checkouts.get_mut(slot) {
            c.pid = Some(pid);
            c.object = Some(object);
            c.since = now;
        }
        now
    }

    pub(super) fn insert(
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
    pub(super) fn new(
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

/// The right to one connection of a lane: counted in the budget until dropped.
pub(crate) struct Permit {
    pub(super) shared: Arc<Shared>,
    pub(super) slot: usize,
    pub(super) lane: Lane,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.shared.release(self.slot);
    }
}

/// What a queued waiter is told: its permit, or why never.
pub(super) type Outcome = Result<Permit, Refusal>;

/// A queued checkout, as the shell keeps it.
pub(crate) struct Waiter {
    /// Unique for the pool's life: the table's keys are reused, and a
    /// waiter that gave up just as it was granted must not touch the next
    /// waiter filed under the same key.
    pub(super) id: u64,
    pub(super) site: &'static Location<'static>,
    /// When its checkout began: the checkout record's age until attached.
    pub(super) start: Instant,
    pub(super) tx: oneshot::Sender<Outcome>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("name", &self.shared.name)
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
pub(crate) trait Periodic: fmt::Debug + Send + Sync + 'static {
    /// Its name in logs (`"census"`); one hook per name.
    fn name(&self) -> &'static str;
    /// How often it runs.
    fn every(&self) -> Duration;
    /// One pass.
    fn pass(&self, pool: Pool) -> Pass;
}
