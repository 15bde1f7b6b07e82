use std::collections::{HashSet, VecDeque};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use slab::Slab;

use super::{IdMap, IdSet, Options, Pool, Shared, State};
use crate::budget::{Budget, Lane, LaneLimits, Limits, Policy};
use crate::error::BuildError;
use crate::lock::LockShared;
use crate::metrics::PoolMetrics;
use crate::pooler::Pooler;

/// Builds a [`Pool`] over a deadpool pool. Every setting has a default.
#[must_use = "builder does nothing until .build()"]
#[derive(Debug)]
pub struct PoolBuilder {
    inner: deadpool_postgres::Pool,
    name: String,
    lanes: [Option<LaneLimits>; 3],
    policy: Policy,
    wait_timeout: Option<Duration>,
    long_hold: Duration,
    housekeeping: Duration,
    census_interval: Option<Duration>,
    pooler: Pooler,
    unlock_timeout: Duration,
}

impl PoolBuilder {
    pub(crate) fn new(inner: deadpool_postgres::Pool) -> PoolBuilder {
        PoolBuilder {
            inner,
            name: "default".into(),
            lanes: [None; 3],
            policy: Policy::Refuse,
            wait_timeout: None,
            long_hold: Duration::from_secs(30),
            housekeeping: Duration::from_secs(1),
            census_interval: Some(Duration::from_secs(60)),
            pooler: Pooler::Auto,
            unlock_timeout: Duration::from_secs(5),
        }
    }

    /// The pool's name in logs and metric labels: 1 to 64 characters of
    /// `[A-Za-z0-9_.-]`. Default: `"default"`.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// One lane's reservation and maximum. Default: see [`Limits::defaults`].
    pub fn lane(mut self, lane: Lane, reserved: usize, max: usize) -> Self {
        self.lanes[lane.idx()] = Some(LaneLimits { reserved, max });
        self
    }

    /// The most connections session locks may pin.
    /// Default: `min(max(1, N / 4), N - 2)`.
    pub fn session_lock_max(mut self, max: usize) -> Self {
        self.lanes[Lane::SessionLock.idx()] = Some(LaneLimits { reserved: 0, max });
        self
    }

    /// What a session-lock checkout past its budget gets. Default: [`Policy::Refuse`].
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// How long request and control checkouts wait, in FIFO order.
    /// Default: deadpool's wait timeout when it has one, else 30 s.
    pub fn wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = Some(timeout);
        self
    }

    /// A connection or session lock held longer than this is logged once and
    /// counted (`pgwarden_long_holds_total`). Default: 30 s.
    pub fn long_hold_threshold(mut self, threshold: Duration) -> Self {
        self.long_hold = threshold;
        self
    }

    /// How often the housekeeping task looks at the holds. Default: 1 s.
    pub fn housekeeping_interval(mut self, every: Duration) -> Self {
        self.housekeeping = every;
        self
    }

    /// How often the periodic census of `pg_locks` runs; `None` turns it off.
    /// Default: 60 s.
    pub fn census_interval(mut self, every: Option<Duration>) -> Self {
        self.census_interval = every;
        self
    }

    /// Whether the pool talks through a transaction-mode pooler: behind one
    /// ([`Pooler::Transaction`]) session locks are refused. Default:
    /// [`Pooler::Auto`], detected at the first session lock or by
    /// [`Pool::detect_pooler`].
    pub fn pooler(mut self, pooler: Pooler) -> Self {
        self.pooler = pooler;
        self
    }

    /// How long a session lock dropped without `unlock` (or cancelled while
    /// acquiring) may take to confirm its release before its connection is
    /// closed instead of returned (zero: always closed). Default: 5 s.
    pub fn unlock_timeout(mut self, bound: Duration) -> Self {
        self.unlock_timeout = bound;
        self
    }

    /// Validates every setting and builds the pool. Call inside a tokio
    /// runtime to start the housekeeping task at once (otherwise it starts at
    /// the first checkout).
    pub fn build(self) -> Result<Pool, BuildError> {
        let valid_name = !self.name.is_empty()
            && self.name.len() <= 64
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if !valid_name {
            return Err(BuildError::InvalidName(self.name));
        }
        let size = self.inner.status().max_size;
        let d = Limits::defaults(size)?;
        let pick = |lane: Lane| self.lanes[lane.idx()].unwrap_or_else(|| d.lane(lane));
        let mut request = pick(Lane::Request);
        let session = pick(Lane::SessionLock);
        let control = pick(Lane::Control);
        // A control reservation set alone shrinks the request default to fit.
        if self.lanes[Lane::Request.idx()].is_none() {
            request.max = size.saturating_sub(control.reserved).max(request.reserved);
        }
        let limits = Limits::new(size, request, session, control, self.policy)?;
        let wait_timeout = self
            .wait_timeout
            .or(self.inner.timeouts().wait)
            .unwrap_or(Duration::from_secs(30));
        if self.housekeeping.is_zero() {
            return Err(BuildError::Deadpool(
                "housekeeping interval must be above zero".into(),
            ));
        }
        let metrics = PoolMetrics::register(&self.name, &limits);
        let shared = Arc::new(Shared {
            name: self.name.into(),
            inner: self.inner,
            state: Mutex::new(State {
                budget: Budget::new(limits),
                waiters: VecDeque::new(),
                pending: [0; 3],
                next_waiter: 0,
                checkouts: Slab::new(),
                warned_sites: HashSet::new(),
                pids: IdMap::default(),
                tainted: IdSet::default(),
            }),
            opts: Options {
                wait_timeout,
                long_hold: self.long_hold,
                housekeeping: self.housekeeping,
                census_interval: self.census_interval,
                pooler: self.pooler,
                unlock_timeout: self.unlock_timeout,
            },
            metrics,
            locks: LockShared::default(),
            housekeeping_started: AtomicBool::new(false),
            leases: std::sync::OnceLock::new(),
        });
        shared.ensure_housekeeping();
        Ok(Pool { shared })
    }
}
