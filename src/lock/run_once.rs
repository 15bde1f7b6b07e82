//! [`Pool::with_xact_lock`](crate::Pool::with_xact_lock) and [`Pool::migrate_once`](crate::Pool::migrate_once): work done in one
//! transaction under a transaction-scoped lock.

use std::panic::Location;
use std::time::{Duration, Instant, SystemTime};

use std::sync::Arc;

use deadpool_postgres::Transaction;
use futures_util::future::BoxFuture;

use super::{xact_lock_on, LockKey, LockMode, Namespace};
use crate::admission::Lane;
use crate::error::{check_text_name, Error, LockError};
use crate::pool::{Beginning, Shared, Source};
use crate::stmt::{Conn, Exec, Param, Row, Sent, SqlError, Tx};

/// The ledger of [`Pool::migrate_once`](crate::Pool::migrate_once): one row per name that ran.
pub(crate) const RUN_ONCE_LEDGER: &str = "pgwarden_run_once";

/// The longest [`Pool::migrate_once`](crate::Pool::migrate_once) name, in bytes: well inside the
/// ledger's primary-key index row limit (about 2700 bytes), so that a name
/// the closure ran for can always be recorded.
pub(crate) const MAX_NAME_LEN: usize = 1024;

const LEDGER_DDL: &str = "CREATE TABLE IF NOT EXISTS pgwarden_run_once (\
    name text PRIMARY KEY, \
    ran_at timestamptz NOT NULL DEFAULT now())";

/// What [`Pool::migrate_once`](crate::Pool::migrate_once) did.
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
/// let done = pool
///     .migrate_once("app/0002_index", std::time::Duration::from_secs(30), |tx| {
///         Box::pin(async move {
///             tx.batch_execute("CREATE INDEX IF NOT EXISTS jobs_due ON app.jobs (id)").await?;
///             Ok::<_, pgwarden::Error>(())
///         })
///     })
///     .await?;
/// if let pgwarden::Migrated::Skipped { ran_at } = done {
///     tracing::info!(?ran_at, "already migrated");
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Migrated<T> {
    /// This call ran the work, and recorded it: the closure's value.
    Ran(T),
    /// The work had run already (here or in another instance) at `ran_at`,
    /// by the database clock: the closure was not called.
    Skipped {
        /// When it ran.
        ran_at: SystemTime,
    },
}

/// How a backend hands its transaction to the work of
/// [`Pool::with_xact_lock`](crate::Pool::with_xact_lock) and [`Pool::migrate_once`](crate::Pool::migrate_once): the user's closure,
/// wrapped in a type of the backend's ([`DeadpoolWork`]: a
/// `&deadpool_postgres::Transaction`; the sqlx pool's: a
/// `&mut PgConnection` inside the transaction). Everything around it (the
/// checkout, `BEGIN`, the lock, the ledger, commit or rollback) is
/// written once, below.
pub(crate) trait Work<B: Source, T, E> {
    /// Runs the work in `tx`.
    fn run<'a, 'c, 't>(self, tx: &'a mut TxOf<'c, 't, B>) -> BoxFuture<'a, Result<T, E>>;
}

/// The transaction of backend `B`'s connection.
pub(crate) type TxOf<'c, 't, B> = <<B as Source>::Exec<'c> as Conn>::Tx<'t>;

/// The deadpool pool's closures: they get the `deadpool_postgres::Transaction`.
pub(crate) struct DeadpoolWork<F>(pub(crate) F);

impl<F, T, E> Work<deadpool_postgres::Pool, T, E> for DeadpoolWork<F>
where
    F: for<'a> FnOnce(&'a Transaction<'a>) -> BoxFuture<'a, Result<T, E>>,
{
    fn run<'a, 'c, 't>(self, tx: &'a mut Transaction<'t>) -> BoxFuture<'a, Result<T, E>> {
        (self.0)(tx)
    }
}

/// [`Pool::with_xact_lock`](crate::Pool::with_xact_lock)'s work. Boxed, and
/// `Send` proven here for every backend at once (from the statement
/// layer's bounds): proven for a concrete backend instead, the compiler
/// would have to normalise its transaction type under higher-ranked
/// lifetimes, which it cannot.
pub(crate) fn with_xact_lock<'p, B, T, E, W>(
    pool: &'p Arc<Shared<B>>,
    key: LockKey,
    timeout: Duration,
    work: W,
    site: &'static Location<'static>,
) -> BoxFuture<'p, Result<T, E>>
where
    B: Source,
    W: Work<B, T, E> + Send + 'p,
    T: Send + 'p,
    E: From<Error> + Send + 'p,
{
    Box::pin(async move {
        let start = Instant::now();
        let mut conn = pool.checkout(Lane::Request, site, timeout).await?;
        conn.set_note(Some(format!("transaction lock {key}")));
        let mut beginning = Beginning::new(&mut conn);
        let (conn, flag) = beginning.parts();
        let mut ex = conn.exec();
        let mut tx = ex.begin_read_committed().await.map_err(Error::from)?;
        Beginning::<B>::begun(flag);
        xact_lock_on(
            &tx,
            key,
            LockMode::Exclusive,
            Some(timeout.saturating_sub(start.elapsed())),
        )
        .await?;
        match work.run(&mut tx).await {
            Ok(v) => {
                tx.commit().await.map_err(Error::from)?;
                Ok(v)
            }
            Err(e) => {
                rollback(tx).await;
                Err(e)
            }
        }
    })
}

/// [`Pool::migrate_once`](crate::Pool::migrate_once)'s work.
/// Boxed, for the reason [`with_xact_lock`] is.
pub(crate) fn migrate_once<'p, B, T, E, W>(
    pool: &'p Arc<Shared<B>>,
    name: &'p str,
    timeout: Duration,
    work: W,
    site: &'static Location<'static>,
) -> BoxFuture<'p, Result<Migrated<T>, E>>
where
    B: Source,
    W: Work<B, T, E> + Send + 'p,
    T: Send + 'p,
    E: From<Error> + Send + 'p,
{
    Box::pin(async move {
        check_name(name)?;
        let start = Instant::now();
        let left = || timeout.saturating_sub(start.elapsed());
        let mut conn = pool.checkout(Lane::Request, site, timeout).await?;
        conn.set_note(Some(format!("migrate_once {name}")));
        let mut beginning = Beginning::new(&mut conn);
        let (conn, flag) = beginning.parts();
        let mut ex = conn.exec();
        ensure_ledger(&mut ex, left()).await?;
        let mut tx = ex.begin_read_committed().await.map_err(Error::from)?;
        Beginning::<B>::begun(flag);
        xact_lock_on(
            &tx,
            Namespace::PGWARDEN.named(name),
            LockMode::Exclusive,
            Some(left()),
        )
        .await?;
        let done = tx
            .query_opt(
                "SELECT ran_at FROM pgwarden_run_once WHERE name = $1",
                &[Param::Text(name)],
                Sent::Unnamed,
            )
            .await
            .map_err(Error::from)?;
        if let Some(row) = done {
            let ran_at = row.col(0).map_err(Error::from)?;
            tx.rollback().await.map_err(Error::from)?;
            return Ok(Migrated::Skipped { ran_at });
        }
        match work.run(&mut tx).await {
            Ok(v) => {
                let not_recorded = |rolled_back, source: SqlError| {
                    Error::Lock(LockError::MigrationNotRecorded {
                        name: name.to_owned(),
                        rolled_back,
                        source: Box::new(source.into()),
                    })
                };
                let record = tx
                    .execute(
                        "INSERT INTO pgwarden_run_once (name) VALUES ($1)",
                        &[Param::Text(name)],
                        Sent::Unnamed,
                    )
                    .await;
                if let Err(e) = record {
                    // The transaction is aborted: nothing of it can commit.
                    rollback(tx).await;
                    return Err(not_recorded(true, e).into());
                }
                if let Err(e) = tx.commit().await {
                    // The server refused the commit (a deferred check): rolled
                    // back. Otherwise the connection failed with COMMIT in flight.
                    let rolled_back = e.code().is_some();
                    return Err(not_recorded(rolled_back, e).into());
                }
                Ok(Migrated::Ran(v))
            }
            Err(e) => {
                rollback(tx).await;
                Err(e)
            }
        }
    })
}

/// A [`Pool::migrate_once`](crate::Pool::migrate_once) name: 1 to [`MAX_NAME_LEN`] bytes, no NUL
/// byte or other control character. Checked before anything runs.
fn check_name(name: &str) -> Result<(), Error> {
    check_text_name("migrate_once name", name, MAX_NAME_LEN)
}

async fn rollback(tx: impl Tx) {
    if let Err(e) = tx.rollback().await {
        tracing::warn!(error = %e, "rollback after a failed locked transaction failed");
    }
}

/// Creates the ledger table once, under its own lock: concurrent
/// `CREATE TABLE IF NOT EXISTS` would otherwise race on the catalog.
async fn ensure_ledger(conn: &mut impl Conn, timeout: Duration) -> Result<(), Error> {
    let exists: bool = conn
        .query_one("SELECT to_regclass('pgwarden_run_once') IS NOT NULL", &[])
        .await?
        .col(0)?;
    if exists {
        return Ok(());
    }
    let tx = conn.begin_read_committed().await?;
    xact_lock_on(
        &tx,
        Namespace::PGWARDEN.named(RUN_ONCE_LEDGER),
        LockMode::Exclusive,
        Some(timeout),
    )
    .await?;
    tx.batch(LEDGER_DDL).await?;
    Ok(tx.commit().await?)
}
