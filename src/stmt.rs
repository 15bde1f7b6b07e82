//! The statement layer: how every layer above the pool (leases, the
//! census, locks, pooler detection) runs SQL, whatever the driver. Each
//! statement's text, its parameters and the decoding of its rows exist
//! once, above this layer; a backend implements [`Exec`] (run one
//! statement, named or unnamed; a batch of simple statements), [`Conn`]
//! (open a transaction), [`Tx`] (commit), [`Row`] (one typed column), and
//! one line of the [`Value`] macro per type, and maps its errors to a
//! [`SqlError`] that carries the SQLSTATE.
//!
//! The tokio-postgres / deadpool backend is `stmt/postgres.rs`; the sqlx
//! one (features `sqlx-0_8`, `sqlx-0_9`) is `stmt/sqlx.rs`, one source
//! compiled per sqlx version (`stmt/sqlx08.rs`, `stmt/sqlx09.rs`). What a
//! backend provides is written in ARCHITECTURE.md, "The statement layer".
//! The layers above get an [`Exec`] from a checked-out connection of any
//! backend with `Client::exec` (the pool's `Source::exec`).
//!
//! # Why here
//!
//! Below the layers that hold statements and above the driver: a statement
//! binds [`Param`]s (the few types pgwarden's statements use) and reads
//! columns through [`Row::col`]; nothing above names a driver type. The pool
//! (checkout, pid, discard) stays the pool's.
//!
//! # Costs
//!
//! Parameters are a slice of [`Param`] (borrowed, no allocation); a backend
//! binds them in place (tokio-postgres: `query_raw` / `query_typed_raw`
//! over an iterator, no `Vec` of `&dyn ToSql`); rows are the driver's own,
//! read by index. One future per statement.

mod known;
mod postgres;
#[cfg(feature = "sqlx-0_8")]
pub(crate) mod sqlx08;
#[cfg(feature = "sqlx-0_9")]
pub(crate) mod sqlx09;

use std::fmt;
use std::future::Future;

/// One bound parameter, by its PostgreSQL type. Durations travel as
/// `float8` seconds (`make_interval(secs => $n)` in the text); times come
/// from the database clock, never bound.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Param<'a> {
    /// `int4`
    Int4(i32),
    /// `int8`
    Int8(i64),
    /// `float8` (seconds, for intervals)
    Float8(f64),
    /// `text`
    Text(&'a str),
    /// `text`, NULL when `None`
    OptText(Option<&'a str>),
    /// `text[]`, from borrowed strings
    Texts(&'a [&'a str]),
    /// `text[]`, from owned strings
    Strings(&'a [String]),
    /// `int8[]`
    Int8s(&'a [i64]),
    /// `float8[]`
    Float8s(&'a [f64]),
}

/// How a statement is sent.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Sent {
    /// A named prepared statement, cached per connection: parsed and
    /// planned once per connection (direct connections).
    Prepared,
    /// An unnamed statement, parsed and planned on every call: what a
    /// transaction-mode pooler allows. Unnamed is not enough there on its
    /// own: tokio-postgres sends one in one sync (`query_typed`), but sqlx
    /// in two (`Parse`, then `Bind`), which a pooler may send to two
    /// server sessions; the sqlx backend pins each such statement in a
    /// transaction of its own where the pool may move its connections
    /// (`stmt/sqlx.rs`, "Pinned statements").
    Unnamed,
}

impl Sent {
    /// Prepared when `named`.
    pub(crate) fn named(named: bool) -> Sent {
        if named {
            Sent::Prepared
        } else {
            Sent::Unnamed
        }
    }
}

/// `ROLLBACK` (of what user code left open), then a transaction of its
/// own for a connection's last statement before it goes back to the pool
/// ([`Exec::query_one_after_rollback`]): explicit, at READ COMMITTED,
/// whatever defaults user code set on the session. At `SERIALIZABLE, READ
/// ONLY, DEFERRABLE` (`SET default_transaction_*`) every statement outside
/// a transaction block waits for a safe snapshot, that is for every
/// serializable writer of other sessions to end: the release would wait
/// on another session's transaction for its whole bound, then close a
/// healthy connection. The access mode is left as the session has it
/// (`READ WRITE` would be refused on a standby; the advisory-lock
/// functions run in a read-only transaction). One simple query.
pub(crate) const ROLLBACK_THEN_TX_OF_ITS_OWN: &str =
    "ROLLBACK; BEGIN ISOLATION LEVEL READ COMMITTED";

/// SQLSTATE codes pgwarden's logic branches on.
pub(crate) mod code {
    /// `serialization_failure`
    pub(crate) const SERIALIZATION_FAILURE: &str = "40001";
    /// `lock_not_available` (a `lock_timeout` ran out)
    pub(crate) const LOCK_NOT_AVAILABLE: &str = "55P03";
    /// `query_canceled` (a `statement_timeout` ran out, or a cancel request)
    pub(crate) const QUERY_CANCELED: &str = "57014";
    /// `in_failed_sql_transaction`
    pub(crate) const IN_FAILED_SQL_TRANSACTION: &str = "25P02";
    /// `undefined_column`
    pub(crate) const UNDEFINED_COLUMN: &str = "42703";
    /// `invalid_sql_statement_name` (a pooler lost a prepared statement)
    pub(crate) const INVALID_SQL_STATEMENT_NAME: &str = "26000";
    /// `duplicate_prepared_statement`
    pub(crate) const DUPLICATE_PSTATEMENT: &str = "42P05";
    /// `protocol_violation` (sqlx: a `Bind` that reached another server
    /// session than its `Parse`, behind a transaction pooler)
    #[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
    pub(crate) const PROTOCOL_VIOLATION: &str = "08P01";
}

/// An error of a statement: the server's (with its SQLSTATE), the
/// connection's, or a column that did not decode. The backend's own error
/// is kept whole, so that `crate::Error` hands deadpool users the
/// `tokio_postgres::Error` they had before, and sqlx users their
/// `sqlx::Error` ([`crate::Error::Sqlx`]).
pub(crate) enum SqlError {
    /// tokio-postgres (the deadpool backend).
    Postgres(tokio_postgres::Error),
    /// A `sqlx::Error` (of sqlx 0.8 or 0.9), boxed.
    #[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
    Sqlx(Box<dyn std::error::Error + Send + Sync + 'static>),
}

impl SqlError {
    /// The SQLSTATE, when the server sent one.
    pub(crate) fn code(&self) -> Option<&str> {
        match self {
            SqlError::Postgres(e) => e.code().map(|c| c.code()),
            #[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
            SqlError::Sqlx(e) => crate::error::sqlx_sqlstate(&**e),
        }
    }

    /// The SQLSTATE is `code`.
    pub(crate) fn is(&self, code: &str) -> bool {
        self.code() == Some(code)
    }

    /// The server refused a named prepared statement: one of that name is
    /// not there, or another is (a transaction pooler moved the client
    /// between server sessions).
    pub(crate) fn refused_prepared(&self) -> bool {
        self.is(code::INVALID_SQL_STATEMENT_NAME) || self.is(code::DUPLICATE_PSTATEMENT)
    }
}

impl fmt::Debug for SqlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SqlError::Postgres(e) => fmt::Debug::fmt(e, f),
            #[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
            SqlError::Sqlx(e) => fmt::Debug::fmt(e, f),
        }
    }
}

impl fmt::Display for SqlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SqlError::Postgres(e) => fmt::Display::fmt(e, f),
            #[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
            SqlError::Sqlx(e) => fmt::Display::fmt(e, f),
        }
    }
}

impl From<tokio_postgres::Error> for SqlError {
    fn from(e: tokio_postgres::Error) -> SqlError {
        SqlError::Postgres(e)
    }
}

impl From<SqlError> for crate::error::Error {
    fn from(e: SqlError) -> crate::error::Error {
        match e {
            SqlError::Postgres(e) => crate::error::Error::Db(e),
            #[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
            SqlError::Sqlx(e) => crate::error::Error::Sqlx(e),
        }
    }
}

/// A result row, read by column index.
pub(crate) trait Row: Send + Sync {
    /// Column `i` as `T`: an error (never a panic) when it is out of range,
    /// NULL for a `T` that is not an `Option`, or of another type.
    fn col<T: Value>(&self, i: usize) -> Result<T, SqlError>;
}

/// A Rust type a column decodes into: each backend reads it its own way
/// (one method per backend, implemented for every type below by one
/// macro line).
pub(crate) trait Value: Sized {
    /// From a tokio-postgres row.
    fn from_postgres(row: &tokio_postgres::Row, i: usize) -> Result<Self, SqlError>;
    /// From a sqlx 0.8 row.
    #[cfg(feature = "sqlx-0_8")]
    fn from_sqlx08(row: &::sqlx08::postgres::PgRow, i: usize) -> Result<Self, SqlError>;
    /// From a sqlx 0.9 row.
    #[cfg(feature = "sqlx-0_9")]
    fn from_sqlx09(row: &::sqlx09::postgres::PgRow, i: usize) -> Result<Self, SqlError>;
}

macro_rules! values {
    ($($t:ty),* $(,)?) => {$(
        values!(@one $t);
        values!(@one Option<$t>);
    )*};
    (@one $t:ty) => {
        impl Value for $t {
            fn from_postgres(row: &tokio_postgres::Row, i: usize) -> Result<Self, SqlError> {
                row.try_get(i).map_err(SqlError::from)
            }
            #[cfg(feature = "sqlx-0_8")]
            fn from_sqlx08(row: &::sqlx08::postgres::PgRow, i: usize) -> Result<Self, SqlError> {
                <$t as sqlx08::Col>::col(row, i)
            }
            #[cfg(feature = "sqlx-0_9")]
            fn from_sqlx09(row: &::sqlx09::postgres::PgRow, i: usize) -> Result<Self, SqlError> {
                <$t as sqlx09::Col>::col(row, i)
            }
        }
    };
}

values!(
    bool,
    i16,
    i32,
    i64,
    u32, // oid
    f64,
    String,
    std::time::SystemTime, // timestamptz
    Vec<String>,
    Vec<i32>,
);

/// What runs statements: a connection, or a transaction on one.
pub(crate) trait Exec: Send + Sync {
    /// Its rows.
    type Row: Row;

    /// Runs `text` with `params`, sent as `how`; its rows.
    fn query<'a>(
        &'a self,
        text: &'a str,
        params: &'a [Param<'a>],
        how: Sent,
    ) -> impl Future<Output = Result<Vec<Self::Row>, SqlError>> + Send + 'a;

    /// Runs `text` with `params`, sent as `how`; the rows it affected.
    fn execute<'a>(
        &'a self,
        text: &'a str,
        params: &'a [Param<'a>],
        how: Sent,
    ) -> impl Future<Output = Result<u64, SqlError>> + Send + 'a;

    /// Runs `text` with `params`, sent unnamed; its one row (an error, the
    /// backend's own, when there is none or more than one).
    fn query_one<'a>(
        &'a self,
        text: &'a str,
        params: &'a [Param<'a>],
    ) -> impl Future<Output = Result<Self::Row, SqlError>> + Send + 'a;

    /// Runs `text`, one or more statements separated by `;` and without
    /// parameters, with the simple-query protocol.
    fn batch<'a>(&'a self, text: &'a str)
        -> impl Future<Output = Result<(), SqlError>> + Send + 'a;

    /// Ends whatever transaction block the session is in, open or failed
    /// (rolled back: `BEGIN`, then `ROLLBACK`, so that a session in none
    /// logs no warning), then runs `text` (one statement, no parameters)
    /// in a transaction of its own at READ COMMITTED ([`ROLLBACK_THEN_TX_OF_ITS_OWN`]:
    /// no wait for a safe snapshot, whatever session defaults user code
    /// set), committed; its one row. What a connection's last
    /// statement before it goes back to the pool runs through: user code
    /// may have left a transaction open on it. Sent in one round trip: the
    /// statements pipelined (tokio-postgres), or one simple query
    /// (sqlx, which cannot pipeline; a failed transaction, which refuses the
    /// `BEGIN` and with it the rest, costs a second: `ROLLBACK`, then the
    /// query again). Columns are read as text on sqlx: `bool` and integers.
    /// On sqlx the query also carries a mark of its own: an answer that is
    /// not its own (the connection out of step) is an error, and a pooled
    /// connection so found is closed, never returned.
    fn query_one_after_rollback<'a>(
        &'a self,
        text: &'a str,
    ) -> impl Future<Output = Result<Self::Row, SqlError>> + Send + 'a;

    /// The first row, if any.
    fn query_opt<'a>(
        &'a self,
        text: &'a str,
        params: &'a [Param<'a>],
        how: Sent,
    ) -> impl Future<Output = Result<Option<Self::Row>, SqlError>> + Send + 'a {
        async move { Ok(self.query(text, params, how).await?.into_iter().next()) }
    }
}

/// A borrowed [`Exec`] is one: what `Source::exec` hands out for the
/// deadpool backend (`&mut ClientWrapper`).
impl<T: Exec> Exec for &mut T {
    type Row = T::Row;

    fn query<'a>(
        &'a self,
        text: &'a str,
        params: &'a [Param<'a>],
        how: Sent,
    ) -> impl Future<Output = Result<Vec<T::Row>, SqlError>> + Send + 'a {
        (**self).query(text, params, how)
    }

    fn execute<'a>(
        &'a self,
        text: &'a str,
        params: &'a [Param<'a>],
        how: Sent,
    ) -> impl Future<Output = Result<u64, SqlError>> + Send + 'a {
        (**self).execute(text, params, how)
    }

    fn query_one<'a>(
        &'a self,
        text: &'a str,
        params: &'a [Param<'a>],
    ) -> impl Future<Output = Result<T::Row, SqlError>> + Send + 'a {
        (**self).query_one(text, params)
    }

    fn batch<'a>(
        &'a self,
        text: &'a str,
    ) -> impl Future<Output = Result<(), SqlError>> + Send + 'a {
        (**self).batch(text)
    }

    fn query_one_after_rollback<'a>(
        &'a self,
        text: &'a str,
    ) -> impl Future<Output = Result<T::Row, SqlError>> + Send + 'a {
        (**self).query_one_after_rollback(text)
    }
}

impl<T: Conn> Conn for &mut T {
    type Tx<'t>
        = T::Tx<'t>
    where
        Self: 't;

    fn begin(&mut self) -> impl Future<Output = Result<T::Tx<'_>, SqlError>> + Send {
        (**self).begin()
    }

    fn begin_read_committed(&mut self) -> impl Future<Output = Result<T::Tx<'_>, SqlError>> + Send {
        (**self).begin_read_committed()
    }
}

/// A connection that can open a transaction.
pub(crate) trait Conn: Exec {
    /// Its transaction.
    type Tx<'t>: Tx
    where
        Self: 't;

    /// `BEGIN` (the session's default isolation).
    fn begin(&mut self) -> impl Future<Output = Result<Self::Tx<'_>, SqlError>> + Send;

    /// `BEGIN ISOLATION LEVEL READ COMMITTED` (one round trip): where a
    /// transaction lock is taken before the work it guards (see
    /// `crate::xact_lock`).
    fn begin_read_committed(
        &mut self,
    ) -> impl Future<Output = Result<Self::Tx<'_>, SqlError>> + Send;
}

/// A transaction: dropped without [`Tx::commit`], it rolls back.
pub(crate) trait Tx: Exec {
    /// `COMMIT`.
    fn commit(self) -> impl Future<Output = Result<(), SqlError>> + Send;

    /// `ROLLBACK`, its answer awaited.
    fn rollback(self) -> impl Future<Output = Result<(), SqlError>> + Send;
}
