//! [`PoolBuilder`], and the deadpool pools pgwarden builds itself.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::{names, Options, Pool, Shared, State};
use crate::admission::{Lane, LaneLimits, Limits, LimitsError, Policy, MAX_POOL_SIZE};
use crate::error::BuildError;
use crate::lock::LockShared;
use crate::metrics::PoolMetrics;
use crate::pooler::Pooler;

/// deadpool's create timeout on pools pgwarden builds, unless configured:
/// a server that accepts connections but never answers fails the connect.
const CREATE_TIMEOUT: Duration = Duration::from_secs(10);
/// deadpool's recycle timeout on pools pgwarden builds, unless configured.
const RECYCLE_TIMEOUT: Duration = Duration::from_secs(5);

fn check_size(size: usize) -> Result<(), BuildError> {
    if size > MAX_POOL_SIZE {
        return Err(LimitsError::TooLarge {
            size,
            max: MAX_POOL_SIZE,
        }
        .into());
    }
    Ok(())
}

impl Pool {
    /// Starts a builder from a deadpool-postgres [`Config`](deadpool_postgres::Config)
    /// (no TLS, tokio runtime). Its pool size must be at most
    /// [`MAX_POOL_SIZE`](crate::MAX_POOL_SIZE); deadpool create and recycle
    /// timeouts left unset become 10 s and 5 s (every checkout is bounded by
    /// its caller's bound too).
    pub fn from_config(config: &deadpool_postgres::Config) -> Result<PoolBuilder, BuildError> {
        let mut config = config.clone();
        let pool = config
            .pool
            .get_or_insert_with(deadpool_postgres::PoolConfig::default);
        check_size(pool.max_size)?;
        pool.timeouts.create.get_or_insert(CREATE_TIMEOUT);
        pool.timeouts.recycle.get_or_insert(RECYCLE_TIMEOUT);
        let inner = config
            .create_pool(
                Some(deadpool_postgres::Runtime::Tokio1),
                tokio_postgres::NoTls,
            )
            .map_err(|e| BuildError::Deadpool(e.to_string()))?;
        Ok(PoolBuilder::new(inner))
    }

    /// Starts a builder from a `DATABASE_URL`-style connection string
    /// (`postgres://…` or `host=… user=…`), no TLS, `max_size` connections
    /// (at most [`MAX_POOL_SIZE`](crate::MAX_POOL_SIZE)), deadpool create and
    /// recycle timeouts of 10 s and 5 s (every checkout is bounded by its
    /// caller's bound too).
    ///
    /// ```
    /// let e = pgwarden::Pool::from_url("host=/tmp", usize::MAX).unwrap_err();
    /// assert!(e.to_string().contains("above the maximum 262143"), "{e}");
    /// ```
    pub fn from_url(url: &str, max_size: usize) -> Result<PoolBuilder, BuildError> {
        check_size(max_size)?;
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
            .create_timeout(Some(CREATE_TIMEOUT))
            .recycle_timeout(Some(RECYCLE_TIMEOUT))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(|e| BuildError::Deadpool(e.to_string()))?;
        Ok(PoolBuilder::new(inner))
    }
}

/// Builds a [`Pool`] over a deadpool pool. Every setting has a default.
#[must_use = "builder does nothing until .build()"]
#[derive(Debug)]
pub struct PoolBuilder {
    inner: deadpool_postgres::Pool,
    name: Option<String>,
    lanes: [Option<LaneLimits>; Lane::COUNT],
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
            name: None,
            lanes: [None; Lane::COUNT],
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
    /// `[A-Za-z0-9_.-]`. Default: `"default"`, or `"default-2"`,
    /// `"default-3"`… while a pool of that name lives, so that two pools
    /// never share the `pool` label unnoticed (a name given here is kept; a
    /// clash with a live pool is logged as a warning).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// One lane's reservation and maximum. Default: see [`Limits::defaults`].
    pub fn lane(mut self, lane: Lane, reserved: usize, max: usize) -> Self {
        self.lanes[lane.idx()] = Some(LaneLimits { reserved, max });
        self
    }

    /// The most connections session locks may pin.
    /// Default: `min(max(1, N / 4), N - 2)` (0 for a pool of 2).
    pub fn session_lock_max(mut self, max: usize) -> Self {
        self.lanes[Lane::SessionLock.idx()] = Some(LaneLimits { reserved: 0, max });
        self
    }

    /// What a session-lock checkout past its budget gets. Default: [`Policy::Refuse`].
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// How long checkouts may take, end to end (admission in FIFO order,
    /// connecting or recycling, the backend-pid query).
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

    /// How often the housekeeping task looks at the holds and republishes
    /// the gauges; above zero. Default: 1 s.
    pub fn housekeeping_interval(mut self, every: Duration) -> Self {
        self.housekeeping = every;
        self
    }

    /// How often the periodic census of `pg_locks` runs (in its own task);
    /// `None` turns it off; above zero. Default: 60 s.
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

    /// The limits these settings give a pool of `size`.
    fn limits(&self, size: usize) -> Result<Limits, LimitsError> {
        let d = Limits::default_lanes(size);
        let mut lanes = d;
        for lane in Lane::ALL {
            if let Some(l) = self.lanes[lane.idx()] {
                lanes[lane.idx()] = l;
            }
        }
        // Unless set, the request maximum is what the other lanes'
        // reservations leave.
        if self.lanes[Lane::Request.idx()].is_none() {
            let reserved: usize = Lane::ALL
                .iter()
                .filter(|l| **l != Lane::Request)
                .map(|l| lanes[l.idx()].reserved)
                .fold(0, usize::saturating_add);
            let r = &mut lanes[Lane::Request.idx()];
            r.max = size.saturating_sub(reserved).max(r.reserved);
        }
        Limits::new(size, lanes, self.policy)
    }

    /// Validates every setting and builds the pool. Call inside a tokio
    /// runtime to start the housekeeping task at once (otherwise it starts at
    /// the first checkout).
    pub fn build(self) -> Result<Pool, BuildError> {
        if let Some(name) = &self.name {
            let valid = !name.is_empty()
                && name.len() <= 64
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
            if !valid {
                return Err(BuildError::InvalidName(name.clone()));
            }
        }
        let positive = |setting: &'static str, value: Duration| {
            if value.is_zero() {
                Err(BuildError::InvalidDuration {
                    setting,
                    value,
                    why: "must be above zero",
                })
            } else {
                Ok(())
            }
        };
        positive("housekeeping_interval", self.housekeeping)?;
        if let Some(every) = self.census_interval {
            positive("census_interval", every)?;
        }
        if self.inner.is_closed() {
            return Err(BuildError::DeadpoolClosed);
        }
        let d = self.inner.status();
        let limits = self.limits(d.max_size)?;
        // Objects out, or callers waiting: someone else uses this pool.
        let in_use = d.size.saturating_sub(d.available) + d.waiting;
        if in_use > 0 {
            return Err(BuildError::DeadpoolInUse {
                in_use,
                max_size: d.max_size,
            });
        }
        let wait_timeout = self
            .wait_timeout
            .or(self.inner.timeouts().wait)
            .unwrap_or(Duration::from_secs(30));
        let claim = names::Claim::new(self.name.as_deref());
        let name = claim.name();
        let metrics = PoolMetrics::register(&name, &limits);
        let get_timeouts = deadpool_postgres::Timeouts {
            wait: Some(Duration::ZERO),
            ..self.inner.timeouts()
        };
        let shared = Arc::new(Shared {
            name,
            _name: claim,
            inner: self.inner,
            get_timeouts,
            state: Mutex::new(State::new(limits)),
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
            resize_warned: AtomicBool::new(false),
            #[cfg(test)]
            inject_panic: AtomicBool::new(false),
        });
        shared.ensure_housekeeping();
        Ok(Pool { shared })
    }
}
