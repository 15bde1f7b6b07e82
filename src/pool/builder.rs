//! [`PoolBuilder`], and the deadpool pools pgwarden builds itself.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::ext::Extensions;
use super::shared::{Claim, Options, Periodic, Pool, Shared, State};
use super::source::Source;
use super::supervisor::Supervisor;
use crate::admission::{BudgetPolicy, Lane, LaneLimits, Limits, LimitsError, MAX_POOL_SIZE};
use crate::error::BuildError;
use crate::metrics::PoolMetrics;

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

/// The pool's name, set by [`PoolBuilder::build`]: the `application_name`
/// of the connections of a pool pgwarden builds itself (`from_url`,
/// `from_config`) whose settings give none, so that `pg_stat_activity`
/// (and `pgwarden locks`) names the pool.
#[derive(Clone, Debug, Default)]
pub(crate) struct AppName(Arc<std::sync::OnceLock<String>>);

/// deadpool's connector for the pools pgwarden builds: no TLS, and the
/// pool's name as `application_name` unless the settings give one.
struct NamedConnect(AppName);

impl deadpool_postgres::Connect for NamedConnect {
    fn connect(
        &self,
        pg_config: &tokio_postgres::Config,
    ) -> futures_util::future::BoxFuture<
        '_,
        Result<(tokio_postgres::Client, tokio::task::JoinHandle<()>), tokio_postgres::Error>,
    > {
        let mut pg_config = pg_config.clone();
        if pg_config.get_application_name().is_none() {
            if let Some(name) = self.0 .0.get() {
                pg_config.application_name(name);
            }
        }
        Box::pin(async move {
            let (client, connection) = pg_config.connect(tokio_postgres::NoTls).await?;
            let task = tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::warn!(target: "deadpool.postgres", "Connection error: {}", e);
                }
            });
            Ok((client, task))
        })
    }
}

/// A deadpool pool from a deadpool-postgres config (no TLS, tokio runtime),
/// its create and recycle timeouts defaulted; its connections take the
/// pool's name as `application_name` unless the config sets one.
pub(crate) fn config_pool(
    config: &deadpool_postgres::Config,
) -> Result<(deadpool_postgres::Pool, AppName), BuildError> {
    let mut pool = config.get_pool_config();
    check_size(pool.max_size)?;
    pool.timeouts.create.get_or_insert(CREATE_TIMEOUT);
    pool.timeouts.recycle.get_or_insert(RECYCLE_TIMEOUT);
    let pg = config.get_pg_config().map_err(|e| {
        BuildError::Deadpool(Box::new(deadpool_postgres::CreatePoolError::Config(e)))
    })?;
    let name = AppName::default();
    let mgr = deadpool_postgres::Manager::from_connect(
        pg,
        NamedConnect(name.clone()),
        config.get_manager_config(),
    );
    let inner = deadpool_postgres::Pool::builder(mgr)
        .config(pool)
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
        .map_err(|e| {
            BuildError::Deadpool(Box::new(deadpool_postgres::CreatePoolError::Build(e)))
        })?;
    Ok((inner, name))
}

/// A deadpool pool from a connection string, no TLS, timeouts defaulted;
/// its connections take the pool's name as `application_name` unless the
/// string sets one.
pub(crate) fn url_pool(
    url: &str,
    max_size: usize,
) -> Result<(deadpool_postgres::Pool, AppName), BuildError> {
    check_size(max_size)?;
    let pg: tokio_postgres::Config = url.parse().map_err(BuildError::InvalidUrl)?;
    let name = AppName::default();
    let mgr = deadpool_postgres::Manager::from_connect(
        pg,
        NamedConnect(name.clone()),
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
        .map_err(|e| BuildError::Deadpool(Box::new(e)))?;
    Ok((inner, name))
}

/// The periodic work of the layers above, one per name.
type Hooks<B> = Vec<Arc<dyn Periodic<B>>>;

/// Builds a [`Pool`] over a deadpool pool. Every setting has a default.
///
/// ```no_run
/// # fn demo() -> Result<(), pgwarden::BuildError> {
/// use std::time::Duration;
/// use pgwarden::{BudgetPolicy, Lane, Pool};
/// let pool = Pool::from_url("postgres://app@db/app", 16)?
///     .name("app")
///     .lane(Lane::SessionLock, 0, 4)
///     .policy(BudgetPolicy::Refuse)
///     .wait_timeout(Duration::from_secs(5))
///     .build()?;
/// # Ok(()) }
/// ```
///
/// (`B` is the pool it wraps: deadpool's unless said otherwise; the sqlx
/// pool's builder is `pgwarden::sqlx::Pool::builder`, with the settings
/// of this one that do not belong to the layers above.)
#[must_use = "builder does nothing until .build()"]
pub struct PoolBuilder<B: Source = deadpool_postgres::Pool> {
    inner: B,
    name: Option<String>,
    lanes: [Option<LaneLimits>; Lane::COUNT],
    policy: BudgetPolicy,
    wait_timeout: Option<Duration>,
    long_hold: Duration,
    housekeeping: Duration,
    /// Settings of the layers above (pooler mode, unlock bound…), by type.
    ext: Extensions,
    /// Periodic work of the layers above (the census), one per name.
    periodic: Hooks<B>,
    /// A setting of a layer above that cannot work, reported by `build`.
    invalid: Vec<(&'static str, BuildError)>,
}

impl<B: Source> std::fmt::Debug for PoolBuilder<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolBuilder")
            .field("name", &self.name)
            .field("lanes", &self.lanes)
            .field("policy", &self.policy)
            .field("wait_timeout", &self.wait_timeout)
            .finish_non_exhaustive()
    }
}

impl<B: Source> PoolBuilder<B> {
    pub(crate) fn new(inner: B) -> PoolBuilder<B> {
        PoolBuilder {
            inner,
            name: None,
            lanes: [None; Lane::COUNT],
            policy: BudgetPolicy::Refuse,
            wait_timeout: None,
            long_hold: Duration::from_secs(30),
            housekeeping: Duration::from_secs(1),
            ext: Extensions::default(),
            periodic: Vec::new(),
            invalid: Vec::new(),
        }
    }

    /// A layer above sets its per-pool setting (one value per type).
    pub(crate) fn set_ext<T: std::any::Any + Send + Sync>(mut self, value: T) -> Self {
        self.ext.set(value);
        self
    }

    /// A layer above plugs in (`Some`) or removes (`None`) its periodic
    /// work, by name.
    pub(crate) fn periodic(mut self, name: &str, hook: Option<Arc<dyn Periodic<B>>>) -> Self {
        self.periodic.retain(|h| h.name() != name);
        self.periodic.extend(hook);
        self
    }

    /// A layer above reports whether its `setting` can work (`None`: it
    /// can); `build` returns the first one that cannot.
    pub(crate) fn invalid(mut self, setting: &'static str, e: Option<BuildError>) -> Self {
        self.invalid.retain(|(s, _)| *s != setting);
        self.invalid.extend(e.map(|e| (setting, e)));
        self
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

    /// One lane's reservation and maximum. The defaults for a pool of `size`
    /// connections (2 to 262 143):
    ///
    /// | lane | reserved | max |
    /// |---|---|---|
    /// | request | 1 (0 when `size` is 2) | `size - 1` |
    /// | session lock | 0 | `min(max(1, size / 4), size - 2)` |
    /// | control | 0 | 1 |
    /// | probe | 1 | 1 |
    /// | lease | 0 | `max(2, size / 2)` |
    ///
    /// The default policy is [`BudgetPolicy::Refuse`].
    ///
    /// - No lane but the probe may take the probe's reserve.
    /// - The request reserve is for the work under held session locks; short
    ///   statements (control, the probe beyond its own reserve, lease renewals
    ///   and releases) may borrow it for a moment, session locks and lease
    ///   acquisitions may not.
    /// - In the lease lane, renewals and releases go before acquisitions and
    ///   every other waiter, and acquisitions hold at most `max - 1`
    ///   connections (a lease reservation, when set, is theirs alone).
    /// - A pool of 2 has the probe reserve and one shared connection: request
    ///   work, control and lease statements take turns on it, and it has no
    ///   session-lock budget. A pool of 3 has a session-lock budget of 1.
    ///
    ///
    /// ```no_run
    /// # fn demo() -> Result<(), pgwarden::BuildError> {
    /// use pgwarden::{Lane, Pool};
    /// let pool = Pool::from_url("postgres://app@db/app", 16)?
    ///     .lane(Lane::SessionLock, 0, 2) // at most 2 connections pinned by session locks
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn lane(mut self, lane: Lane, reserved: usize, max: usize) -> Self {
        self.lanes[lane.idx()] = Some(LaneLimits { reserved, max });
        self
    }

    /// What a session-lock checkout past its budget gets. Default:
    /// [`BudgetPolicy::Refuse`].
    pub fn policy(mut self, policy: BudgetPolicy) -> Self {
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

    /// Validates every setting and builds what a pool shares, its
    /// housekeeping supervised; returns the periodic work of the layers
    /// above too.
    pub(crate) fn build_shared(mut self) -> Result<(Arc<Shared<B>>, Hooks<B>), BuildError> {
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
        if let Some((_, e)) = self.invalid.drain(..).next() {
            return Err(e);
        }
        if self.inner.is_closed() {
            return Err(BuildError::DeadpoolClosed);
        }
        let d = self.inner.status();
        let limits = Limits::derive(d.max, self.lanes, self.policy)?;
        // Objects out, or callers waiting: someone else uses this pool.
        let in_use = d.size.saturating_sub(d.idle) + d.waiting;
        if in_use > 0 {
            return Err(BuildError::DeadpoolInUse {
                in_use,
                max_size: d.max,
            });
        }
        let wait_timeout = self
            .wait_timeout
            .or(self.inner.wait_bound())
            .unwrap_or(Duration::from_secs(30));
        let claim = Claim::new(self.name.as_deref());
        let name = claim.name();
        // A pool built by `from_url` / `from_config`: its connections are
        // named after it from now on.
        let _ = self.ext.get::<AppName>().0.set(name.to_string());
        let metrics = PoolMetrics::register(&name, &limits);
        let cfg = self.inner.cfg(&name, &self.ext);
        let shared = Arc::new(Shared {
            name,
            _name: claim,
            inner: self.inner,
            cfg,
            state: Mutex::new(State::new(limits)),
            opts: Options {
                wait_timeout,
                long_hold: self.long_hold,
                housekeeping: self.housekeeping,
            },
            metrics,
            ext: self.ext,
            supervisor: Supervisor::new(),
            probe_setup: AtomicBool::new(false),
            probe_answered: tokio::sync::watch::Sender::new(None),
            resize_warned: AtomicBool::new(false),
            #[cfg(test)]
            inject_panic: AtomicBool::new(false),
        });
        shared.supervise_housekeeping();
        Ok((shared, self.periodic))
    }
}

impl PoolBuilder {
    /// Validates every setting and builds the pool. Call inside a tokio
    /// runtime to start the housekeeping task at once (otherwise it starts at
    /// the first checkout).
    pub fn build(self) -> Result<Pool, BuildError> {
        let (shared, periodic) = self.build_shared()?;
        shared.supervise_periodic(periodic);
        Ok(Pool { shared })
    }
}
