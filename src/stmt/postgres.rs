//! The statement layer on tokio-postgres (and deadpool-postgres, whose
//! client and transaction keep a per-connection cache of prepared
//! statements): [`Exec`] for a pooled client, a pooled transaction, a
//! plain client and a plain transaction.
//!
//! Parameters are bound in place (each [`Param`] lends its value as
//! `&dyn ToSql`), and a statement
//! goes out through `query_raw` (prepared: the statement found by address
//! in `stmt/known.rs`, else cached by `prepare_typed_cached`) or `query_typed_raw` (unnamed, each parameter
//! with its type), over an iterator of the caller's slice. The rows are
//! tokio-postgres's own.

use std::pin::pin;

use futures_util::TryStreamExt;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::RowStream;

use super::{known, Conn, Exec, Param, Row, Sent, SqlError, Tx, Value};

impl Param<'_> {
    /// The value, for tokio-postgres to bind.
    fn as_sql(&self) -> &(dyn ToSql + Sync) {
        match self {
            Param::Int4(v) => v,
            Param::Int8(v) => v,
            Param::Float8(v) => v,
            Param::Text(v) => v,
            Param::OptText(v) => v,
            Param::Texts(v) => v,
            Param::Strings(v) => v,
            Param::Int8s(v) => v,
            Param::Float8s(v) => v,
        }
    }

    /// Its PostgreSQL type.
    fn pg_type(&self) -> Type {
        match self {
            Param::Int4(_) => Type::INT4,
            Param::Int8(_) => Type::INT8,
            Param::Float8(_) => Type::FLOAT8,
            Param::Text(_) | Param::OptText(_) => Type::TEXT,
            Param::Texts(_) | Param::Strings(_) => Type::TEXT_ARRAY,
            Param::Int8s(_) => Type::INT8_ARRAY,
            Param::Float8s(_) => Type::FLOAT8_ARRAY,
        }
    }
}

impl Row for tokio_postgres::Row {
    fn col<T: Value>(&self, i: usize) -> Result<T, SqlError> {
        T::from_postgres(self, i)
    }
}

/// The most parameters whose types are kept on the stack for a prepare.
const STACK_TYPES: usize = 8;

/// The parameters' types, for `prepare_typed_cached`: on the stack for up
/// to [`STACK_TYPES`] of them.
enum Types {
    Stack([Type; STACK_TYPES], usize),
    Heap(Vec<Type>),
}

impl Types {
    fn of(params: &[Param<'_>]) -> Types {
        if params.len() <= STACK_TYPES {
            Types::Stack(
                std::array::from_fn(|i| params.get(i).map_or(Type::BOOL, Param::pg_type)),
                params.len(),
            )
        } else {
            Types::Heap(params.iter().map(Param::pg_type).collect())
        }
    }

    fn as_slice(&self) -> &[Type] {
        match self {
            Types::Stack(t, n) => &t[..*n],
            Types::Heap(t) => t,
        }
    }
}

/// Every row of a stream.
async fn collect(stream: RowStream) -> Result<Vec<tokio_postgres::Row>, SqlError> {
    Ok(stream.try_collect().await?)
}

/// The rows a stream's statement affected, once it is drained.
async fn affected(stream: RowStream) -> Result<u64, SqlError> {
    let mut stream = pin!(stream);
    while stream.try_next().await?.is_some() {}
    Ok(stream.rows_affected().unwrap_or(0))
}

/// Sends one statement on `$c` (a value of a type with a statement cache
/// when `$cached` is `cached`), its rows as a stream.
macro_rules! stream {
    (cached, $c:expr, $text:expr, $params:expr, $how:expr) => {
        if $how == Sent::Prepared {
            let types = Types::of($params);
            let stmt = match known::get(&$c.statement_cache, $text, types.as_slice()) {
                Some(stmt) => stmt,
                None => {
                    let stmt = $c.prepare_typed_cached($text, types.as_slice()).await?;
                    known::put(&$c.statement_cache, $text, &stmt);
                    stmt
                }
            };
            $c.query_raw(&stmt, $params.iter().map(Param::as_sql))
                .await?
        } else {
            stream!(unnamed, $c, $text, $params, $how)
        }
    };
    (unnamed, $c:expr, $text:expr, $params:expr, $how:expr) => {{
        let _: Sent = $how;
        $c.query_typed_raw($text, $params.iter().map(|p| (p.as_sql(), p.pg_type())))
            .await?
    }};
}

/// [`Exec`] for `$ty`; `$cached`: `cached` when it keeps prepared
/// statements (deadpool's), else `unnamed` (every statement unnamed).
macro_rules! exec_for {
    ($ty:ty, $cached:ident) => {
        impl Exec for $ty {
            type Row = tokio_postgres::Row;

            fn query<'a>(
                &'a self,
                text: &'a str,
                params: &'a [Param<'a>],
                how: Sent,
            ) -> impl std::future::Future<Output = Result<Vec<tokio_postgres::Row>, SqlError>>
                   + Send
                   + 'a {
                async move { collect(stream!($cached, self, text, params, how)).await }
            }

            fn execute<'a>(
                &'a self,
                text: &'a str,
                params: &'a [Param<'a>],
                how: Sent,
            ) -> impl std::future::Future<Output = Result<u64, SqlError>> + Send + 'a {
                async move { affected(stream!($cached, self, text, params, how)).await }
            }

            fn query_one<'a>(
                &'a self,
                text: &'a str,
                params: &'a [Param<'a>],
            ) -> impl std::future::Future<Output = Result<tokio_postgres::Row, SqlError>>
                   + Send
                   + 'a {
                async move {
                    let typed: Vec<(&(dyn ToSql + Sync), Type)> =
                        params.iter().map(|p| (p.as_sql(), p.pg_type())).collect();
                    Ok(self.query_typed_one(text, &typed).await?)
                }
            }

            fn batch<'a>(
                &'a self,
                text: &'a str,
            ) -> impl std::future::Future<Output = Result<(), SqlError>> + Send + 'a {
                async move { Ok(self.batch_execute(text).await?) }
            }

            fn query_one_after_rollback<'a>(
                &'a self,
                text: &'a str,
            ) -> impl std::future::Future<Output = Result<tokio_postgres::Row, SqlError>>
                   + Send
                   + 'a {
                async move {
                    // Pipelined: each request goes out at its future's first
                    // poll, in order, before any answer is read. A failed
                    // transaction refuses the first `BEGIN` alone (its error
                    // is expected then, and dropped), and the `ROLLBACK` ends
                    // it. The query runs in a transaction of its own at READ
                    // COMMITTED ([`crate::stmt::ROLLBACK_THEN_TX_OF_ITS_OWN`]); a `COMMIT` of one
                    // the query failed in rolls it back.
                    let (_, rolled_back, row, committed) = futures_util::future::join4(
                        self.batch_execute("BEGIN"),
                        self.batch_execute(crate::stmt::ROLLBACK_THEN_TX_OF_ITS_OWN),
                        self.query_typed_one(text, &[]),
                        self.batch_execute("COMMIT"),
                    )
                    .await;
                    rolled_back?;
                    let row = row?;
                    committed?;
                    Ok(row)
                }
            }
        }
    };
}

exec_for!(deadpool_postgres::ClientWrapper, cached);
exec_for!(deadpool_postgres::Transaction<'_>, cached);
// No statement cache of their own: always unnamed.
exec_for!(tokio_postgres::Client, unnamed);
exec_for!(tokio_postgres::Transaction<'_>, unnamed);

impl Conn for deadpool_postgres::ClientWrapper {
    type Tx<'t> = deadpool_postgres::Transaction<'t>;

    async fn begin(&mut self) -> Result<deadpool_postgres::Transaction<'_>, SqlError> {
        Ok(self.transaction().await?)
    }

    async fn begin_read_committed(
        &mut self,
    ) -> Result<deadpool_postgres::Transaction<'_>, SqlError> {
        Ok(self
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
            .start()
            .await?)
    }
}

impl Tx for deadpool_postgres::Transaction<'_> {
    async fn commit(self) -> Result<(), SqlError> {
        Ok(deadpool_postgres::Transaction::commit(self).await?)
    }

    async fn rollback(self) -> Result<(), SqlError> {
        Ok(deadpool_postgres::Transaction::rollback(self).await?)
    }
}

impl Tx for tokio_postgres::Transaction<'_> {
    async fn commit(self) -> Result<(), SqlError> {
        Ok(tokio_postgres::Transaction::commit(self).await?)
    }

    async fn rollback(self) -> Result<(), SqlError> {
        Ok(tokio_postgres::Transaction::rollback(self).await?)
    }
}
