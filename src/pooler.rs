//! Whether the pool talks to PostgreSQL through a transaction-mode pooler
//! (PgBouncer `pool_mode = transaction` and the like), configured or detected.
//!
//! Behind such a pooler a session belongs to no client: between two
//! transactions the pooler hands the server connection to another client.
//! Session advisory locks cannot work there, and pgwarden refuses them
//! ([`LockError::BehindPooler`](crate::LockError::BehindPooler)); transaction-scoped locks work. Named prepared
//! statements break too (`prepared statement "s3" does not exist`), so every
//! statement pgwarden sends itself is a `query_typed` (unnamed statement) or
//! a simple query. sqlx sends an unnamed statement in two syncs (`Parse`,
//! then `Bind`), between which the pooler may hand the server connection to
//! another client: on a sqlx pool that may move its connections
//! (`Watch::may_move_between_syncs`) each such statement outside a
//! transaction runs in one of its own (`stmt/sqlx.rs`).

mod peer;
mod probe;

use std::panic::Location;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) use probe::{backend_pid, Announced, Detection, Motion, MOTION_STATEMENTS};

use crate::admission::Lane;
use crate::error::{Error, LockError};
use crate::pool::{Client, Extensions, Pool, PoolBuilder, Shared, Source};
use tokio::sync::OnceCell;

/// How the pool reaches PostgreSQL.
///
/// ```no_run
/// # fn demo() -> Result<(), pgwarden::BuildError> {
/// let pool = pgwarden::Pool::from_url("postgres://app@pgbouncer:6432/app", 16)?
///     .pooler(pgwarden::PoolerMode::Transaction) // session locks refused, leases unnamed
///     .build()?;
/// # Ok(()) }
/// ```
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum PoolerMode {
    /// Not configured: detected at the first session lock, or by
    /// [`Pool::detect_pooler`]. Default.
    #[default]
    Auto,
    /// Straight to PostgreSQL (or a session-mode pooler): a client keeps its
    /// session.
    Direct,
    /// Through a transaction-mode (or statement-mode) pooler: session locks
    /// are refused.
    Transaction,
}

/// The configured mode: a builder setting, kept in the pool's extension slot.
#[derive(Copy, Clone, Debug, Default)]
struct Configured(PoolerMode);

/// What detection found, per pool, in the pool's extension slot.
#[derive(Debug, Default)]
struct Found {
    /// Whether the pool talks through a transaction pooler, once detected.
    detection: OnceCell<Detection>,
    /// A session lock's own check proved a transaction pooler after
    /// detection found none.
    moved: AtomicBool,
}

fn configured<B: Source>(pool: &Shared<B>) -> PoolerMode {
    pool.ext.get::<Configured>().0
}

fn found<B: Source>(pool: &Shared<B>) -> Arc<Found> {
    pool.ext.get::<Found>()
}

/// What a pool knows of its pooler, kept by a backend from the pool's
/// build (`Source::cfg`) and read at each checkout without the extension
/// slot's lock: the sqlx backend names its connections with a prepared
/// statement only while the pool is not known to be behind a transaction
/// pooler.
#[derive(Debug)]
pub(crate) struct Watch {
    configured: PoolerMode,
    found: Arc<Found>,
}

impl Watch {
    /// The pool's, from its extension slot `ext` (its pooler mode is
    /// configured before it is built).
    pub(crate) fn of(ext: &Extensions) -> Watch {
        Watch {
            configured: ext.get::<Configured>().0,
            found: ext.get::<Found>(),
        }
    }

    /// What detection found, once it ran; a transaction pooler once a
    /// session lock's own check proved one.
    fn detected(&self) -> Option<Detection> {
        let found = self.found.detection.get().copied()?;
        let moved = self.found.moved.load(Ordering::Acquire);
        Some(Detection {
            transaction: found.transaction || moved,
            ..found
        })
    }

    /// See [`keeps_sessions`].
    pub(crate) fn keeps_sessions(&self) -> bool {
        match self.configured {
            PoolerMode::Direct => true,
            PoolerMode::Transaction => false,
            PoolerMode::Auto => self
                .detected()
                .is_some_and(|d| !d.transaction && !d.proxied),
        }
    }

    /// A statement sent in two syncs may have its halves run on two server
    /// sessions: configured behind a transaction pooler, detected so, or
    /// not known either way (`Auto` before detection, or behind a proxy
    /// whose mode detection could not prove). Only a pool configured
    /// [`PoolerMode::Direct`] or detected without a transaction pooler is
    /// known to keep its server session between syncs.
    #[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
    pub(crate) fn may_move_between_syncs(&self) -> bool {
        match self.configured {
            PoolerMode::Direct => false,
            PoolerMode::Transaction => true,
            PoolerMode::Auto => self.detected().is_none_or(|d| d.transaction || d.unproven),
        }
    }

    /// See [`behind_pooler`].
    pub(crate) fn behind_pooler(&self) -> Option<&'static str> {
        match (self.configured, self.detected()) {
            (PoolerMode::Transaction, _) => Some("configured"),
            (PoolerMode::Auto, Some(d)) if d.transaction => Some("detected"),
            _ => None,
        }
    }
}

impl<B: Source> PoolBuilder<B> {
    /// Whether the pool talks through a transaction-mode pooler: behind one
    /// ([`PoolerMode::Transaction`]) session locks are refused. Default:
    /// [`PoolerMode::Auto`], detected at the first session lock or by
    /// [`Pool::detect_pooler`].
    ///
    /// ```no_run
    /// # fn demo() -> Result<(), pgwarden::BuildError> {
    /// let pool = pgwarden::Pool::from_url("postgres://app@pgbouncer:6432/app", 16)?
    ///     .pooler(pgwarden::PoolerMode::Transaction)
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn pooler(self, mode: PoolerMode) -> Self {
        self.set_ext(Configured(mode))
    }
}

impl Pool {
    /// What the pool knows now ([`mode`]).
    pub(crate) fn pooler(&self) -> PoolerMode {
        mode(&self.shared)
    }
}

/// What the pool knows: the configured mode, or the detected one once
/// detection ran; [`PoolerMode::Auto`] before that.
pub(crate) fn mode<B: Source>(pool: &Shared<B>) -> PoolerMode {
    match configured(pool) {
        PoolerMode::Auto => detected(pool).map_or(PoolerMode::Auto, Detection::pooler),
        p => p,
    }
}

/// Detects, once per pool, whether it talks through a transaction pooler
/// ([`Pool::detect_pooler`]).
pub(crate) async fn detect<B: Source>(
    pool: &Arc<Shared<B>>,
    site: &'static Location<'static>,
) -> Result<PoolerMode, Error>
where
    B::Conn: Announced,
{
    let configured = configured(pool);
    if configured != PoolerMode::Auto {
        return Ok(configured);
    }
    let timeout = pool.opts.wait_timeout;
    found(pool)
        .detection
        .get_or_try_init(|| async {
            let start = Instant::now();
            let mut a = pool.checkout(Lane::Control, site, timeout).await?;
            let left = timeout.saturating_sub(start.elapsed());
            run(pool, &mut a, Lane::Request, site, left)
                .await
                .map(|d| remember(pool, d))
        })
        .await?;
    Ok(mode(pool))
}

fn remember<B: Source>(pool: &Shared<B>, found: Detection) -> Detection {
    tracing::info!(
        pool = %pool.name,
        pooler = ?found.pooler(),
        proxied = found.proxied,
        by_socket = found.by_socket,
        statements = found.statements,
        "pooler detected"
    );
    found
}

/// What detection found, once it ran; a transaction pooler once a session
/// lock's own check proved one.
fn detected<B: Source>(pool: &Shared<B>) -> Option<Detection> {
    Watch::of(&pool.ext).detected()
}

impl Detection {
    /// The mode it proved: [`PoolerMode::Auto`] when the motion probe
    /// could not run behind a proxy (nothing proven either way).
    fn pooler(self) -> PoolerMode {
        if self.transaction {
            PoolerMode::Transaction
        } else if self.unproven {
            PoolerMode::Auto
        } else {
            PoolerMode::Direct
        }
    }
}

/// Whether each client of the pool keeps its server session: configured
/// [`PoolerMode::Direct`], or detected straight to PostgreSQL (the announced pid
/// matched). Through a proxy whose mode is unproven, false: named prepared
/// statements, which a transaction pooler breaks, are not to be used.
pub(crate) fn keeps_sessions<B: Source>(pool: &Shared<B>) -> bool {
    Watch::of(&pool.ext).keeps_sessions()
}

/// A session lock's check found that the pool's connections move between
/// server sessions: a transaction pooler, from now on.
pub(crate) fn proven_by_lock<B: Source>(pool: &Shared<B>) {
    if !found(pool).moved.swap(true, Ordering::AcqRel) {
        tracing::warn!(
            pool = %pool.name,
            "a session lock's own check found a transaction pooler that detection missed: \
             session locks are refused from now on"
        );
    }
}

/// Why session locks are refused, when the pool is configured behind a
/// transaction pooler, or was detected so: `"configured"` or `"detected"`.
pub(crate) fn behind_pooler<B: Source>(pool: &Shared<B>) -> Option<&'static str> {
    Watch::of(&pool.ext).behind_pooler()
}

/// Before the first session lock of an `Auto` pool: detects the pooler with
/// the lock's own connection and a control connection, and refuses the lock
/// behind a transaction pooler. `Ok(true)`: allowed, through a proxy whose
/// mode is unproven, so the lock must be checked on its own connection once
/// taken.
pub(crate) async fn ensure_direct<B: Source>(
    pool: &Arc<Shared<B>>,
    lock_conn: &mut Client<B>,
    site: &'static Location<'static>,
    timeout: Duration,
) -> Result<bool, Error>
where
    B::Conn: Announced,
{
    if let Some(how) = behind_pooler(pool) {
        return Err(Error::Lock(LockError::BehindPooler { how }));
    }
    if configured(pool) != PoolerMode::Auto {
        return Ok(false);
    }
    found(pool)
        .detection
        .get_or_try_init(|| async {
            run(pool, lock_conn, Lane::Control, site, timeout)
                .await
                .map(|d| remember(pool, d))
        })
        .await?;
    match detected(pool) {
        Some(d) if d.transaction => Err(Error::Lock(LockError::BehindPooler { how: "detected" })),
        // Unproven behind a proxy, or proven by the connection's socket
        // only (`probe::proven_by_socket`: a verdict that a pooler's mode
        // switch can make stale): each lock is checked on its connection.
        found => Ok(found.is_some_and(|d| d.proxied || d.by_socket)),
    }
}

/// Detection with `a`, a connection the caller holds: one statement proves a
/// direct connection. Behind a proxy, the motion probe runs with a second
/// connection of `lane`, held at the same time, when the pool can hold two
/// outside the probe reserve (a pool of 2 cannot: the mode stays unproven,
/// and nothing waits for a connection that cannot come).
async fn run<B: Source>(
    pool: &Arc<Shared<B>>,
    a: &mut Client<B>,
    lane: Lane,
    site: &'static Location<'static>,
    timeout: Duration,
) -> Result<Detection, Error>
where
    B::Conn: Announced,
{
    let announced = a.announced_pid();
    let a = a.exec();
    let seen = match probe::direct(&a, announced).await? {
        Ok(direct) => return Ok(direct),
        Err(seen) => seen,
    };
    let status = pool.status();
    if status.max.saturating_sub(status.lane(Lane::Probe).reserved) < 2 {
        return Ok(probe::unproven());
    }
    let mut b = pool.checkout(lane, site, timeout).await?;
    let b = b.exec();
    let motion = probe::motion(&a, seen.pid, &b).await?;
    Ok(probe::proven_by_socket(motion, seen.ends).await)
}
