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

use std::panic::Location;
use std::time::{Duration, Instant};

use tokio_postgres::types::Type;

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
            Pooler::Auto => self
                .shared
                .locks
                .pooler
                .get()
                .copied()
                .unwrap_or(Pooler::Auto),
            p => p,
        }
    }

    /// Detects, once per pool, whether it talks through a transaction pooler,
    /// and remembers it (a configured mode is returned as is). Call it at
    /// start-up; otherwise the first session lock runs it.
    ///
    /// The probe checks out two connections (request and control lanes) and
    /// sets a unique session setting (`pgwarden.probe`) on one with
    /// `set_config(…, false)`: a transaction pooler shows it to the other
    /// client, or gives both clients the same backend pid, or changes a
    /// client's pid between statements. Straight to PostgreSQL none of these
    /// can happen.
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
            let found = self
                .shared
                .locks
                .pooler
                .get_or_try_init(|| async {
                    let start = Instant::now();
                    let a = self.checkout(Lane::Request, site, timeout).await?;
                    let b = self
                        .checkout(Lane::Control, site, timeout.saturating_sub(start.elapsed()))
                        .await?;
                    probe(&a, &b).await.map(|p| self.remember(p))
                })
                .await?;
            Ok(*found)
        }
    }

    fn remember(&self, found: Pooler) -> Pooler {
        tracing::info!(pool = %self.shared.name, pooler = ?found, "pooler detected");
        found
    }
}

/// Why session locks are refused, when the pool is configured behind a
/// transaction pooler, or was detected so: `"configured"` or `"detected"`.
pub(crate) fn behind_pooler(pool: &Pool) -> Option<&'static str> {
    match (pool.shared.opts.pooler, pool.shared.locks.pooler.get()) {
        (Pooler::Transaction, _) => Some("configured"),
        (Pooler::Auto, Some(Pooler::Transaction)) => Some("detected"),
        _ => None,
    }
}

/// Before the first session lock of an `Auto` pool: detects the pooler with
/// the lock's own connection and a control connection, and refuses the lock
/// behind a transaction pooler.
pub(crate) async fn ensure_direct(
    pool: &Pool,
    lock_conn: &tokio_postgres::Client,
    site: &'static Location<'static>,
    timeout: Duration,
) -> Result<(), Error> {
    if let Some(how) = behind_pooler(pool) {
        return Err(Error::BehindPooler { how });
    }
    if pool.shared.opts.pooler != Pooler::Auto {
        return Ok(());
    }
    let found = pool
        .shared
        .locks
        .pooler
        .get_or_try_init(|| async {
            let other = pool.checkout(Lane::Control, site, timeout).await?;
            probe(lock_conn, &other).await.map(|p| pool.remember(p))
        })
        .await?;
    match found {
        Pooler::Transaction => Err(Error::BehindPooler { how: "detected" }),
        _ => Ok(()),
    }
}

/// The probe: a session setting made on `a` seen from `b`, or pids that a
/// direct connection cannot show, mean a transaction pooler.
pub(crate) async fn probe(
    a: &tokio_postgres::Client,
    b: &tokio_postgres::Client,
) -> Result<Pooler, Error> {
    let token = format!("{:016x}", rand::random::<u64>());
    let set = a
        .query_typed_one(
            "SELECT pg_backend_pid(), set_config('pgwarden.probe', $1, false)",
            &[(&token, Type::TEXT)],
        )
        .await?;
    let seen = b
        .query_typed_one(
            "SELECT pg_backend_pid(), current_setting('pgwarden.probe', true)",
            &[],
        )
        .await?;
    let again = a
        .query_typed_one(
            "SELECT pg_backend_pid(), set_config('pgwarden.probe', '', false)",
            &[],
        )
        .await?;
    let (pid_a, pid_b, pid_a2): (i32, i32, i32) =
        (set.try_get(0)?, seen.try_get(0)?, again.try_get(0)?);
    let leaked = seen.try_get::<_, Option<String>>(1)?.as_deref() == Some(token.as_str());
    Ok(if leaked || pid_a == pid_b || pid_a != pid_a2 {
        Pooler::Transaction
    } else {
        Pooler::Direct
    })
}
