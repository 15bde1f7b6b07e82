//! [`Pool::with_xact_lock`] and [`Pool::run_once`]: work done in one
//! transaction under a transaction-scoped lock.

use std::panic::Location;
use std::time::{Duration, Instant, SystemTime};

use deadpool_postgres::Transaction;
use futures_util::future::BoxFuture;
use tokio_postgres::types::Type;
use tokio_postgres::IsolationLevel;

use super::{xact_lock, LockKey, Namespace};
use crate::admission::Lane;
use crate::error::Error;
use crate::pool::{Client, Pool};

/// The ledger of [`Pool::run_once`]: one row per name that ran.
pub const RUN_ONCE_LEDGER: &str = "pgwarden_run_once";

const LEDGER_DDL: &str = "CREATE TABLE IF NOT EXISTS pgwarden_run_once (\
    name text PRIMARY KEY, \
    ran_at timestamptz NOT NULL DEFAULT now())";

/// What [`Pool::run_once`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunOnce<T> {
    /// This call ran the work, and recorded it: the closure's value.
    Ran(T),
    /// The work had run already (here or in another instance) at `ran_at`,
    /// by the database clock: the closure was not called.
    Skipped {
        /// When it ran.
        ran_at: SystemTime,
    },
}

impl<T> RunOnce<T> {
    /// This call ran the work.
    pub fn ran(&self) -> bool {
        matches!(self, RunOnce::Ran(_))
    }
}

impl Pool {
    /// Runs `f` in one `READ COMMITTED` transaction, on a request connection,
    /// under the exclusive transaction-scoped lock `key`: commits when `f`
    /// returns `Ok`, rolls back when it returns `Err` (or panics, or the
    /// future is dropped). The lock is released with the transaction, so it
    /// cannot leak, and it works behind a transaction pooler.
    ///
    /// The closure's future may borrow the transaction, not the caller's
    /// locals (`for<'a> … BoxFuture<'a, …>`): move owned data into it.
    ///
    /// `timeout` bounds the checkout and the wait for the lock; past it the
    /// error is [`Error::LockTimeout`] (or a checkout timeout), converted into
    /// `E`. `READ COMMITTED` is chosen so that each statement under the lock
    /// sees what the previous holder committed.
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
    /// use std::time::Duration;
    /// const ACCOUNTS: pgwarden::Namespace = pgwarden::Namespace::new(2);
    ///
    /// let created = pool
    ///     .with_xact_lock(ACCOUNTS.key(42), Duration::from_secs(5), |tx| {
    ///         Box::pin(async move {
    ///             let active: i64 = tx
    ///                 .query_one("SELECT count(*) FROM subscriptions WHERE client_id = 42 AND active", &[])
    ///                 .await?
    ///                 .get(0);
    ///             if active == 0 {
    ///                 tx.execute("INSERT INTO subscriptions (client_id, active) VALUES (42, true)", &[]).await?;
    ///             }
    ///             Ok::<_, pgwarden::Error>(active == 0)
    ///         })
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    #[track_caller]
    pub fn with_xact_lock<'p, T, E, F>(
        &'p self,
        key: LockKey,
        timeout: Duration,
        f: F,
    ) -> impl std::future::Future<Output = Result<T, E>> + Send + 'p
    where
        F: for<'a> FnOnce(&'a Transaction<'a>) -> BoxFuture<'a, Result<T, E>> + Send + 'p,
        T: Send + 'p,
        E: From<Error> + Send + 'p,
    {
        let site = Location::caller();
        async move {
            let start = Instant::now();
            let mut conn = self.checkout(Lane::Request, site, timeout).await?;
            conn.set_note(Some(format!("transaction lock {key}")));
            let tx = begin(&mut conn).await?;
            xact_lock(&tx, key, timeout.saturating_sub(start.elapsed())).await?;
            finish(tx, f).await
        }
    }

    /// Runs `f` once per database, whatever the number of instances starting
    /// at the same moment: for start-up DDL (`CREATE SCHEMA/TABLE IF NOT
    /// EXISTS`, which races with itself across sessions) and migrations.
    ///
    /// `name` is the work's identity (e.g. `"billing/0001_schema"`). The
    /// callers serialise on the transaction-scoped lock
    /// `Namespace::PGWARDEN.named(name)`; the first runs `f` in a `READ
    /// COMMITTED` transaction and records `name` in the ledger table
    /// [`RUN_ONCE_LEDGER`] (`pgwarden_run_once`, created on first use under
    /// its own lock, in the first schema of the `search_path`) in that same
    /// transaction. The others wait for it, find the row, and skip `f`
    /// ([`RunOnce::Skipped`]). If `f` fails, nothing is recorded and the next
    /// caller runs it. `timeout` bounds the checkout and each lock wait.
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
    /// use std::time::Duration;
    /// pool.run_once("app/0001_schema", Duration::from_secs(30), |tx| {
    ///     Box::pin(async move {
    ///         tx.batch_execute(
    ///             "CREATE SCHEMA IF NOT EXISTS app;
    ///              CREATE TABLE IF NOT EXISTS app.jobs (id bigint PRIMARY KEY)",
    ///         )
    ///         .await?;
    ///         Ok::<_, pgwarden::Error>(())
    ///     })
    /// })
    /// .await?;
    /// # Ok(()) }
    /// ```
    #[track_caller]
    pub fn run_once<'p, T, E, F>(
        &'p self,
        name: &'p str,
        timeout: Duration,
        f: F,
    ) -> impl std::future::Future<Output = Result<RunOnce<T>, E>> + Send + 'p
    where
        F: for<'a> FnOnce(&'a Transaction<'a>) -> BoxFuture<'a, Result<T, E>> + Send + 'p,
        T: Send + 'p,
        E: From<Error> + Send + 'p,
    {
        let site = Location::caller();
        async move {
            let start = Instant::now();
            let left = || timeout.saturating_sub(start.elapsed());
            let mut conn = self.checkout(Lane::Request, site, timeout).await?;
            conn.set_note(Some(format!("run_once {name}")));
            ensure_ledger(&mut conn, left()).await?;
            let tx = begin(&mut conn).await?;
            xact_lock(&tx, Namespace::PGWARDEN.named(name), left()).await?;
            let done = tx
                .query_typed_opt(
                    "SELECT ran_at FROM pgwarden_run_once WHERE name = $1",
                    &[(&name, Type::TEXT)],
                )
                .await
                .map_err(Error::from)?;
            if let Some(row) = done {
                let ran_at = row.try_get(0).map_err(Error::from)?;
                tx.rollback().await.map_err(Error::from)?;
                return Ok(RunOnce::Skipped { ran_at });
            }
            match f(&tx).await {
                Ok(v) => {
                    let record = async {
                        tx.query_typed(
                            "INSERT INTO pgwarden_run_once (name) VALUES ($1)",
                            &[(&name, Type::TEXT)],
                        )
                        .await?;
                        tx.commit().await
                    };
                    record.await.map_err(Error::from)?;
                    Ok(RunOnce::Ran(v))
                }
                Err(e) => {
                    rollback(tx).await;
                    Err(e)
                }
            }
        }
    }
}

async fn begin(conn: &mut Client) -> Result<Transaction<'_>, Error> {
    Ok(conn
        .build_transaction()
        .isolation_level(IsolationLevel::ReadCommitted)
        .start()
        .await?)
}

/// Runs `f`, then commits on `Ok`, rolls back on `Err`.
async fn finish<'c, T, E, F>(tx: Transaction<'c>, f: F) -> Result<T, E>
where
    F: for<'a> FnOnce(&'a Transaction<'a>) -> BoxFuture<'a, Result<T, E>>,
    E: From<Error>,
{
    match f(&tx).await {
        Ok(v) => {
            tx.commit().await.map_err(Error::from)?;
            Ok(v)
        }
        Err(e) => {
            rollback(tx).await;
            Err(e)
        }
    }
}

async fn rollback(tx: Transaction<'_>) {
    if let Err(e) = tx.rollback().await {
        tracing::warn!(error = %e, "rollback after a failed locked transaction failed");
    }
}

/// Creates the ledger table once, under its own lock: concurrent
/// `CREATE TABLE IF NOT EXISTS` would otherwise race on the catalog.
async fn ensure_ledger(conn: &mut Client, timeout: Duration) -> Result<(), Error> {
    let exists: bool = conn
        .query_typed_one("SELECT to_regclass('pgwarden_run_once') IS NOT NULL", &[])
        .await?
        .try_get(0)?;
    if exists {
        return Ok(());
    }
    let tx = begin(conn).await?;
    xact_lock(&tx, Namespace::PGWARDEN.named(RUN_ONCE_LEDGER), timeout).await?;
    tx.batch_execute(LEDGER_DDL).await?;
    Ok(tx.commit().await?)
}
