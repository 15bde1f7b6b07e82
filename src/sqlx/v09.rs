//! `pgwarden::sqlx` for sqlx 0.9 (feature `sqlx-0_9`): [`Pool`], a
//! budgeted pool over the adopter's own `sqlx::PgPool`, and its
//! [`PoolConnection`] and [`Transaction`]. The source is `pool.rs`, shared
//! with sqlx 0.8 (feature `sqlx-0_8`); this file holds what differs in
//! 0.9's API: statements are `SqlStr`, and `Executor::prepare_with` and
//! `describe` take one.

use crate::stmt::sqlx09::{On, OnTx, Pooled};
pub(crate) use ::sqlx09 as dep;
pub(crate) use ::sqlx09_core::transaction::TransactionManager;
use dep::SqlSafeStr;

/// A prepared statement kept past its connection's borrow.
type Statement = dep::postgres::PgStatement;

/// Prepares `sql` on `conn` (a cached statement: no round trip).
fn prepare<'c>(
    conn: &'c mut dep::PgConnection,
    sql: &'static str,
) -> futures_util::future::BoxFuture<'c, Result<Statement, dep::Error>> {
    dep::Executor::prepare(conn, sql.into_sql_str())
}

/// `Executor`'s methods whose signatures changed in 0.9.
macro_rules! versioned_executor {
    () => {
        fn prepare_with<'e>(
            self,
            sql: dep::SqlStr,
            parameters: &'e [dep::postgres::PgTypeInfo],
        ) -> BoxFuture<'e, Result<dep::postgres::PgStatement, dep::Error>>
        where
            'p: 'e,
        {
            on_conn!(self, c => c.prepare_with(sql, parameters))
        }

        fn describe<'e>(
            self,
            sql: dep::SqlStr,
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
