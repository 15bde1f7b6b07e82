//! Whether the pool talks to PostgreSQL through a transaction-mode pooler
//! (PgBouncer `pool_mode = transaction` and the like), configured or detected.
//!
//! Behind such a pooler a session belongs to no client: between two
//! transactions the pooler hands the server connection to another client.
//! Session advisory locks cannot work there, and pgwarden refuses them
//! ([`Error::BehindPooler`]); transaction-scoped locks work. Named prepared
//! statements break too (`prepared statement "s3" does not exist`), so every
//! statement pgwarden sends itself is a `query_typed` (unnamed statement) or
//! a simple query.

mod probe;

use std::panic::Location;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

pub(crate) use probe::{backend_pid, Detection, Motion, MOTION_STATEMENTS};

use crate::admission::Lane;
use crate::error::Error;
use crate::pool::Pool;

/// How the pool reaches PostgreSQL.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum Pooler {
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

impl Pool {
    /// What the pool knows: the configured mode, or the detected one once
    /// detection ran; [`Pooler::Auto`] before that.
    pub fn pooler(&self) -> Pooler {
        match self.shared.opts.pooler {
            Pooler::Auto => detected(self).map_or(Pooler::Auto, Detection::pooler),
            p => p,
        }
    }

    /// Detects, once per pool, whether it talks through a transaction pooler,
    /// and remembers it (a configured mode is returned as is). Call it at
    /// start-up; otherwise the first session lock runs it.
    ///
    /// The probe checks out a control connection and asks it for
    /// `pg_backend_pid()`; it sets nothing.
    ///
    /// - Straight to PostgreSQL, the pid a connection's server announced when
    ///   it connected (the key of its cancel requests) is its backend's pid:
    ///   a match is certain, and the answer is [`Pooler::Direct`] after that
    ///   one statement.
    /// - A pooler makes up the announced pid. Through one, the probe takes a
    ///   second connection (request lane) at the same time, and asks
    ///   again, from either connection at random (up to 40
    ///   statements, stopping at the first proof): a connection that lands on
    ///   a backend other than its first, or on the other connection's, proves
    ///   a transaction pooler ([`Pooler::Transaction`]). A session pooler
    ///   never shows that, and is [`Pooler::Direct`]; since a transaction
    ///   pooler can, rarely, hide it that long, each session lock through a
    ///   pooler is checked again on its own connection before it is granted.
    ///   A pool of 2 cannot hold two connections outside the probe reserve:
    ///   behind a proxy its mode stays unproven (reported
    ///   [`Pooler::Direct`], with the same check at every session lock, and
    ///   lease statements unnamed).
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
    /// if pool.detect_pooler().await? == pgwarden::Pooler::Transaction {
    ///     // session locks will be refused: use pool.with_xact_lock or leases
    /// }
    /// # Ok(()) }
    /// ```
    #[track_caller]
    pub fn detect_pooler(
        &self,
    ) -> impl std::future::Future<Output = Result<Pooler, Error>> + Send + '_ {
        let site = Location::caller();
        async move {
            if self.shared.opts.pooler != Pooler::Auto {
                return Ok(self.shared.opts.pooler);
            }
            let timeout = self.shared.opts.wait_timeout;
            self.shared
                .locks
                .pooler
                .get_or_try_init(|| async {
                    let start = Instant::now();
                    let a = self.checkout(Lane::Control, site, timeout).await?;
                    let left = timeout.saturating_sub(start.elapsed());
                    run(self, &a, Lane::Request, site, left)
                        .await
                        .map(|d| self.remember(d))
                })
                .await?;
            Ok(self.pooler())
        }
    }

    fn remember(&self, found: Detection) -> Detection {
        tracing::info!(
            pool = %self.shared.name,
            pooler = ?found.pooler(),
            proxied = found.proxied,
            statements = found.statements,
            "pooler detected"
        );
        found
    }
}

/// What detection found, once it ran; a transaction pooler once a session
/// lock's own check proved one.
fn detected(pool: &Pool) -> Option<Detection> {
    let found = pool.shared.locks.pooler.get().copied()?;
    let moved = pool.shared.locks.moved.load(Ordering::Acquire);
    Some(Detection {
        transaction: found.transaction || moved,
        ..found
    })
}

impl Detection {
    fn pooler(self) -> Pooler {
        if self.transaction {
            Pooler::Transaction
        } else {
            Pooler::Direct
        }
    }
}

/// Whether each client of the pool keeps its server session: configured
/// [`Pooler::Direct`], or detected straight to PostgreSQL (the announced pid
/// matched). Through a proxy whose mode is unproven, false: named prepared
/// statements, which a transaction pooler breaks, are not to be used.
pub(crate) fn keeps_sessions(pool: &Pool) -> bool {
    match pool.shared.opts.pooler {
        Pooler::Direct => true,
        Pooler::Transaction => false,
        Pooler::Auto => detected(pool).is_some_and(|d| !d.transaction && !d.proxied),
    }
}

/// A session lock's check found that the pool's connections move between
/// server sessions: a transaction pooler, from now on.
pub(crate) fn proven_by_lock(pool: &Pool) {
    if !pool.shared.locks.moved.swap(true, Ordering::AcqRel) {
        tracing::warn!(
            pool = %pool.shared.name,
            "a session lock's own check found a transaction pooler that detection missed: \
             session locks are refused from now on"
        );
    }
}

/// Why session locks are refused, when the pool is configured behind a
/// transaction pooler, or was detected so: `"configured"` or `"detected"`.
pub(crate) fn behind_pooler(pool: &Pool) -> Option<&'static str> {
    match (pool.shared.opts.pooler, detected(pool)) {
        (Pooler::Transaction, _) => Some("configured"),
        (Pooler::Auto, Some(d)) if d.transaction => Some("detected"),
        _ => None,
    }
}

/// Before the first session lock of an `Auto` pool: detects the pooler with
/// the lock's own connection and a control connection, and refuses the lock
/// behind a transaction pooler. `Ok(true)`: allowed, through a proxy whose
/// mode is unproven, so the lock must be checked on its own connection once
/// taken.
pub(crate) async fn ensure_direct(
    pool: &Pool,
    lock_conn: &tokio_postgres::Client,
    site: &'static Location<'static>,
    timeout: Duration,
) -> Result<bool, Error> {
    if let Some(how) = behind_pooler(pool) {
        return Err(Error::BehindPooler { how });
    }
    if pool.shared.opts.pooler != Pooler::Auto {
        return Ok(false);
    }
    pool.shared
        .locks
        .pooler
        .get_or_try_init(|| async {
            run(pool, lock_conn, Lane::Control, site, timeout)
                .await
                .map(|d| pool.remember(d))
        })
        .await?;
    match detected(pool) {
        Some(d) if d.transaction => Err(Error::BehindPooler { how: "detected" }),
        found => Ok(found.is_some_and(|d| d.proxied)),
    }
}

/// Detection with `a`, a connection the caller holds: one statement proves a
/// direct connection. Behind a proxy, the motion probe runs with a second
/// connection of `lane`, held at the same time, when the pool can hold two
/// outside the probe reserve (a pool of 2 cannot: the mode stays unproven,
/// and nothing waits for a connection that cannot come).
async fn run(
    pool: &Pool,
    a: &tokio_postgres::Client,
    lane: Lane,
    site: &'static Location<'static>,
    timeout: Duration,
) -> Result<Detection, Error> {
    let a_pid = match probe::direct(a).await? {
        Ok(direct) => return Ok(direct),
        Err(pid) => pid,
    };
    let status = pool.status();
    if status.max.saturating_sub(status.lane(Lane::Probe).reserved) < 2 {
        return Ok(probe::unproven());
    }
    let b = pool.checkout(lane, site, timeout).await?;
    probe::motion(a, a_pid, &b).await
}
