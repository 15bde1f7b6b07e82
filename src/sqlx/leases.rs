//! Table leases on a sqlx pool, one source for sqlx 0.8 and 0.9: the lease
//! layer's [`Backend`] for sqlx's `PgPool`, the pool a
//! [`Leases`](crate::Leases) is made from ([`LeasePool`]), and the
//! transaction [`LeaseHandle::fence`](crate::LeaseHandle::fence) takes
//! ([`FenceTx`]: pgwarden's sqlx [`Transaction`]). Everything else of the
//! lease layer (statements, gathering, renewals, the lost signal, the
//! fence check, the scheduler) is the deadpool side's code, compiled for
//! this backend.
//!
//! Pooler detection is the pool's (`crate::pooler`, on either backend):
//! lease statements are prepared (sqlx's persistent statements) only on a
//! pool configured or detected direct, as on deadpool, and with sqlx's
//! statement cache on (`pool::names_statements`), and a statement cut
//! short is cancelled by its backend pid (`pg_cancel_backend`) only on a
//! direct pool.

use std::future::Future;
use std::sync::Arc;

use super::dep;
use super::pool::{Pool, Transaction};
use crate::error::Error;
use crate::lease::{Backend, FenceTx, Fenced, LeaseHandle, LeasePool};
use crate::pool::Shared;
use crate::pooler::PoolerMode;
use crate::stmt::SqlError;

impl LeasePool for Pool {
    type Backend = dep::PgPool;

    #[allow(private_interfaces)]
    fn shared(&self) -> &Arc<Shared<dep::PgPool>> {
        &self.shared
    }

    fn pool(&self) -> Pool {
        self.clone()
    }
}

impl Backend for dep::PgPool {
    type Pool = Pool;

    fn names_statements(pool: &Pool) -> bool {
        super::pool::names_statements(&pool.shared)
    }

    fn detect_pooler(
        pool: &Pool,
    ) -> Option<impl Future<Output = Result<PoolerMode, Error>> + Send + 'static> {
        if crate::pooler::mode(&pool.shared) != PoolerMode::Auto {
            return None;
        }
        let pool = pool.clone();
        Some(async move { pool.detect_pooler().await })
    }
}

/// A fenced sqlx transaction dereferences to its `PgConnection`:
/// `sqlx::query(…).execute(&mut *tx)` runs in it.
impl FenceTx for Transaction {
    type Target = dep::PgConnection;

    fn target(&self) -> &dep::PgConnection {
        self
    }

    fn target_mut(&mut self) -> &mut dep::PgConnection {
        self
    }

    /// After reading what a statement cut short left unread (see
    /// `Transaction::read_leftovers`): the check meets the transaction as the
    /// caller's statements left it.
    async fn check_in(&mut self, lease: &LeaseHandle) -> Result<(), Error> {
        self.read_leftovers().await;
        lease.check_in(&super::On::new(self)).await
    }

    async fn commit(self) -> Result<(), Error> {
        Transaction::commit(self)
            .await
            .map_err(|e| SqlError::from(e).into())
    }
}

impl Fenced<'_, Transaction> {
    /// Checks the term again inside the transaction, as
    /// [`LeaseHandle::fence`](crate::LeaseHandle::fence) did, and moves the
    /// transaction's server-side bound to the term's time left now + 1 s
    /// (the deadpool guard's `check`, taking `&mut self`: sqlx runs a
    /// statement on `&mut PgConnection`). Fails as `fence` does (a
    /// `LeaseError::FenceBlocked` here names no pid: the transaction is
    /// still open); drop the guard then (it rolls back).
    ///
    /// ```no_run
    /// # use sqlx09 as sqlx;
    /// # async fn demo(pool: pgwarden::sqlx::Pool, lease: pgwarden::LeaseHandle) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = lease.fence(pool.begin().await?).await?;
    /// sqlx::query("UPDATE accounts SET balance = balance - 1 WHERE id = 1")
    ///     .execute(&mut *tx)
    ///     .await?;
    /// tx.check().await?; // still this term, bound moved
    /// tx.commit().await?; // Ok: it landed, under this term
    /// # Ok(()) }
    /// ```
    pub async fn check(&mut self) -> Result<(), Error> {
        self.tx.check_in(&self.lease).await
    }
}
