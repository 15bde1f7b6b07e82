//! The statement layer on sqlx 0.9 (feature `sqlx-0_9`): the source is
//! `sqlx.rs`, shared with sqlx 0.8; this file holds what differs.

pub(crate) use ::sqlx09 as dep;
/// sqlx's transaction manager trait (for pinned statements).
use ::sqlx09_core::transaction::TransactionManager;

use super::{SqlError, Value};

/// A statement's text as 0.9 takes it: pgwarden's texts are built at run
/// time from validated identifiers and fixed SQL, their values always
/// bound (sqlx copies the text into its `SqlStr`).
fn text(t: &str) -> dep::AssertSqlSafe<&str> {
    dep::AssertSqlSafe(t)
}

/// Column `i` of `row` as `T` (`Value`'s sqlx 0.9 method).
fn value<T: Value>(row: &dep::postgres::PgRow, i: usize) -> Result<T, SqlError> {
    T::from_sqlx09(row, i)
}

// One source for both sqlx versions: compiled here against this one.
#[allow(clippy::duplicate_mod)]
#[path = "sqlx.rs"]
mod imp;

pub(crate) use imp::{Col, On, OnTx, Pooled};
