//! `pgwarden::sqlx` for sqlx 0.8 (feature `sqlx-0_8`; `pgwarden::sqlx_0_8`
//! when `sqlx-0_9` is on too): [`Pool`], a budgeted pool over the
//! adopter's own `sqlx::PgPool`, and its [`PoolConnection`] and
//! [`Transaction`]. The source is `pool.rs`, shared with sqlx 0.9; this
//! file holds what differs in 0.8's API: statements are `&str`, prepared
//! statements borrow theirs.

use crate::stmt::sqlx08::{On, OnTx, Pooled};
pub(crate) use ::sqlx08 as dep;
pub(crate) use ::sqlx08::TransactionManager;

/// A prepared statement kept past its connection's borrow.
type Statement = dep::postgres::PgStatement<'static>;

/// Prepares `sql` on `conn` (a cached statement: no round trip).
fn prepare<'c>(
    conn: &'c mut dep::PgConnection,
    sql: &'static str,
) -> futures_util::future::BoxFuture<'c, Result<Statement, dep::Error>> {
    dep::Executor::prepare(conn, sql)
}

/// `Executor`'s methods whose signatures changed in 0.9.
macro_rules! versioned_executor {
    () => {
        fn prepare_with<'e, 'q: 'e>(
            self,
            sql: &'q str,
            parameters: &'e [dep::postgres::PgTypeInfo],
        ) -> BoxFuture<'e, Result<dep::postgres::PgStatement<'q>, dep::Error>> {
            on_conn!(self, c => c.prepare_with(sql, parameters))
        }

        fn describe<'e, 'q: 'e>(
            self,
            sql: &'q str,
        ) -> BoxFuture<'e, Result<dep::Describe<dep::Postgres>, dep::Error>> {
            on_conn!(self, c => c.describe(sql))
        }
    };
}

// One source for both sqlx versions: compiled here against this one.
#[allow(clippy::duplicate_mod)]
#[path = "pool.rs"]
mod pool;

// Leases on this sqlx (one source for both versions).
#[allow(clippy::duplicate_mod)]
#[path = "leases.rs"]
mod leases;

pub use pool::{xact_lock, Pool, PoolConnection, Transaction};
