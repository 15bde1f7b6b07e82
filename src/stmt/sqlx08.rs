//! The statement layer on sqlx 0.8 (feature `sqlx-0_8`): the source is
//! `sqlx.rs`, shared with sqlx 0.9; this file holds what differs.

pub(crate) use ::sqlx08 as dep;
/// sqlx's transaction manager trait (for pinned statements).
use ::sqlx08::TransactionManager;

use super::{SqlError, Value};

/// A statement's text as 0.8 takes it (borrowed).
fn text(t: &str) -> &str {
    t
}

/// Column `i` of `row` as `T` (`Value`'s sqlx 0.8 method).
fn value<T: Value>(row: &dep::postgres::PgRow, i: usize) -> Result<T, SqlError> {
    T::from_sqlx08(row, i)
}

// One source for both sqlx versions: compiled here against this one.
#[allow(clippy::duplicate_mod)]
#[path = "sqlx.rs"]
mod imp;

pub(crate) use imp::{Col, On, OnTx, Pooled};
