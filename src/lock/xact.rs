//! Transaction-scoped advisory locks: released by PostgreSQL at `COMMIT` or
//! `ROLLBACK`, they cannot leak, and they work behind a transaction pooler.
//!
//! The helpers borrow a [`tokio_postgres::Transaction`]; a
//! [`deadpool_postgres::Transaction`] derefs to one, so `&tx` works for both.
//! They take a transaction, not a client, on purpose: outside a transaction
//! block a transaction-scoped lock is released as soon as its statement ends.

use std::time::Duration;

use tokio_postgres::Transaction;

use super::{key_params, lock_error, lock_fn, lock_timeout_setting, LockKey, LockMode, Scope};
use crate::error::Error;
use crate::stmt::{Exec, Param, Row, Sent};

/// Takes the transaction-scoped advisory lock `key` in `mode`: tries once
/// when `wait` is `None`, or waits up to `wait`.
///
/// - `Ok(true)`: granted, held until the transaction ends.
/// - `Ok(false)`: only from a single try (`wait` is `None`): another session
///   holds it; the transaction is not aborted.
/// - `Err(`[`LockError::Timeout`](crate::LockError::Timeout)`)`: a wait ran out (SQLSTATE 55P03,
///   `lock_not_available`), and **PostgreSQL has aborted the transaction**:
///   roll it back (dropping it does) and retry with a new one.
///
/// The wait is bounded by PostgreSQL's `lock_timeout`, set for this statement
/// only (the transaction's previous `lock_timeout` is restored once the lock
/// is granted). Under `REPEATABLE READ` or `SERIALIZABLE` the transaction's
/// snapshot may be taken by this very statement, before the wait: the work
/// done under the lock would not see what the previous holder committed.
/// Take the lock in a `READ COMMITTED` transaction, as
/// [`crate::Pool::with_xact_lock`] does.
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
/// use std::time::Duration;
/// use pgwarden::{xact_lock, LockMode, Namespace};
///
/// const ACCOUNTS: Namespace = Namespace::new(2);
/// let mut client = pool.get().await?;
/// let tx = client.transaction().await?;
/// xact_lock(&tx, ACCOUNTS.key(42), LockMode::Exclusive, Some(Duration::from_secs(5))).await?;
/// // … check, then insert: no other session that asks for (2, 42) runs here …
/// tx.commit().await?; // the lock is released here
/// # Ok(()) }
/// ```
pub async fn xact_lock(
    tx: &Transaction<'_>,
    key: LockKey,
    mode: LockMode,
    wait: Option<Duration>,
) -> Result<bool, Error> {
    xact_lock_on(tx, key, mode, wait).await
}

/// [`xact_lock`] in a transaction of any backend.
pub(crate) async fn xact_lock_on(
    tx: &impl Exec,
    key: LockKey,
    mode: LockMode,
    wait: Option<Duration>,
) -> Result<bool, Error> {
    match wait {
        Some(timeout) => bounded(tx, key, mode, timeout).await.map(|()| true),
        None => attempt(tx, key, mode).await,
    }
}

/// The statement of a bounded transaction-scoped lock: one round trip.
///
/// Each level is a subquery that `OFFSET 0` keeps from being flattened, so
/// PostgreSQL evaluates them inside out: read the current `lock_timeout`, set
/// the bound (transaction-local), wait for the lock, then restore the value
/// read first. `$1` is the bound, the key follows.
pub(crate) fn bounded_xact_sql(key: LockKey, mode: LockMode) -> String {
    format!(
        "SELECT set_config('lock_timeout', l.prev, true) \
           FROM (SELECT t.prev, {f}({k}) AS locked \
                   FROM (SELECT s.prev, set_config('lock_timeout', $1, true) AS bound \
                           FROM (SELECT current_setting('lock_timeout') AS prev OFFSET 0) s \
                         OFFSET 0) t \
                 OFFSET 0) l",
        f = lock_fn(Scope::Xact, mode, true),
        k = key.placeholders(2),
    )
}

async fn bounded(
    tx: &impl Exec,
    key: LockKey,
    mode: LockMode,
    timeout: Duration,
) -> Result<(), Error> {
    let setting = lock_timeout_setting(timeout);
    let sql = bounded_xact_sql(key, mode);
    let (k, n) = key_params(key);
    let params = [Param::Text(&setting), k[0], k[1]];
    tx.query(&sql, &params[..1 + n], Sent::Unnamed)
        .await
        .map(drop)
        .map_err(|e| lock_error(e, key, timeout))
}

async fn attempt(tx: &impl Exec, key: LockKey, mode: LockMode) -> Result<bool, Error> {
    let sql = format!(
        "SELECT {}({})",
        lock_fn(Scope::Xact, mode, false),
        key.placeholders(1)
    );
    let (k, n) = key_params(key);
    let row = tx.query(&sql, &k[..n], Sent::Unnamed).await?;
    match row.first() {
        Some(r) => Ok(r.col::<bool>(0)?),
        None => Ok(false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_sql_names_the_function_and_numbers_the_key_after_the_bound() {
        let s = bounded_xact_sql(LockKey::Pair(1, 2), LockMode::Shared);
        assert!(s.contains("pg_advisory_xact_lock_shared($2, $3)"), "{s}");
        let s = bounded_xact_sql(LockKey::Single(1), LockMode::Exclusive);
        assert!(s.contains("pg_advisory_xact_lock($2)"), "{s}");
        assert_eq!(s.matches("OFFSET 0").count(), 3);
    }
}
