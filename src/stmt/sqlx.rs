//! The statement layer on sqlx, one source for sqlx 0.8 and 0.9
//! (`super::dep` is the sqlx in use; `super` holds the shims where their
//! APIs differ: how a statement's text is handed over, which method of
//! [`Value`] reads a column).
//!
//! sqlx runs a statement on `&mut PgConnection`; [`Exec`] takes `&self`
//! (the layers above hand one connection to several statements of one
//! task, and read several connections at once). [`On`] holds the
//! connection (or the transaction) in an async mutex: a statement locks it
//! for its own round trip, and a statement's future dropped half-way lets
//! it go with it (no std lock is held across an await). The mutex is never
//! contended in pgwarden's use, so its cost is an atomic pair per
//! statement.
//!
//! - `Sent::Prepared` is sqlx's persistent statement (cached per
//!   connection by sqlx), `Sent::Unnamed` a non-persistent one (parsed
//!   every time).
//! - **Pinned statements.** sqlx sends a statement with parameters in two
//!   syncs: `Parse`, `Describe`, `Sync`, then, once the server has
//!   answered, `Bind`, `Execute`, `Sync` (sqlx-postgres 0.8 and 0.9,
//!   `PgConnection::run`). Behind a transaction-mode pooler (PgBouncer)
//!   the server connection goes back to the pooler's pool at the first
//!   `ReadyForQuery` outside a transaction, and another client's `Parse`
//!   may land on it before this `Bind`: the `Bind` fails (`08P01`, `26000`)
//!   or, worse, binds the other client's statement. So on a pooled
//!   connection that may move between syncs ([`Pooled`], from the pool's
//!   pooler mode: configured or detected behind a transaction pooler, or
//!   not known either way) a statement outside a transaction runs inside
//!   one of its own: `BEGIN`, the statement, `COMMIT` (a pooler keeps the
//!   server connection for a transaction), two round trips more. A
//!   statement in a transaction (the caller's, the fence's) needs nothing.
//!   The simple-query `batch` is one message and one `ReadyForQuery`:
//!   never pinned. tokio-postgres sends every statement in one sync
//!   (`query_typed`): the deadpool backend pins nothing.
//!   Cut short (its future dropped), a pinned statement never leaves the
//!   connection inside its transaction: after the `BEGIN`'s answer sqlx
//!   counts the transaction and the `ROLLBACK` is queued for the
//!   connection's next use (its return to the pool pings it); during the
//!   `BEGIN`, sqlx 0.8 counts nothing and queues nothing, so the
//!   connection is marked spoiled and closed instead of given back
//!   (`Client`'s drop), on both versions. A statement that fails rolls
//!   its transaction back at once (awaited, so the pooler gets its server
//!   connection back now).
//! - `batch` is the simple-query protocol (`raw_sql`).
//! - Columns decode through sqlx's own `Decode`, but for `oid` (sqlx's
//!   `Oid`) and `timestamptz` (sqlx has no `SystemTime`; the binary value,
//!   microseconds since 2000-01-01 UTC, is read here: no chrono or time
//!   feature forced on the adopter).
//! - An error keeps sqlx's own `Error` (boxed in `SqlError::Sqlx`), whose
//!   SQLSTATE `SqlError::code` reads.

use std::ops::DerefMut;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use super::dep;
use super::dep::postgres::{PgArguments, PgConnection, PgRow, PgValueFormat};
use super::dep::{Row as _, TypeInfo as _, ValueRef as _};
use crate::stmt::{code, Conn, Exec, Param, Row, Sent, SqlError, Tx, Value};

/// A sqlx connection (`&mut PgConnection`) or transaction
/// (`sqlx::Transaction`), as the statement layer runs statements on it.
/// `pub` only because the sqlx `Source` names it; not reachable from
/// outside the crate.
#[allow(unreachable_pub)]
pub struct On<C>(tokio::sync::Mutex<C>);

impl<'c> On<&'c mut PgConnection> {
    /// Statements on `conn`, never pinned (a test's connection, a fenced
    /// transaction's).
    pub(crate) fn new(conn: &'c mut PgConnection) -> Self {
        On(tokio::sync::Mutex::new(conn))
    }
}

impl<'c> On<Pooled<'c>> {
    /// Statements on a pooled connection (see [`Pooled`]).
    pub(crate) fn pooled(
        conn: &'c mut PgConnection,
        spoiled: &'c mut bool,
        pin: bool,
        moves: &'c AtomicBool,
    ) -> Self {
        On(tokio::sync::Mutex::new(Pooled {
            conn,
            spoiled,
            pin,
            moves,
        }))
    }
}

/// A checked-out connection as the pool hands it to the statement layer
/// (`Source::exec`). Its statements are pinned when `pin` (the pool's
/// pooler mode says it may move the connection between syncs) or `moves`
/// (the pool learned so: a statement of it failed as a split one does, on
/// a pool configured direct); `spoiled` is set when one is cut short
/// during its `BEGIN` (see the module docs).
#[allow(unreachable_pub)]
#[derive(Debug)]
pub struct Pooled<'c> {
    conn: &'c mut PgConnection,
    spoiled: &'c mut bool,
    pin: bool,
    moves: &'c AtomicBool,
}

impl std::ops::Deref for Pooled<'_> {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        self.conn
    }
}

impl DerefMut for Pooled<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.conn
    }
}

/// What [`On`] runs statements on: a connection or a transaction, and
/// whether a statement outside a transaction is to be pinned.
pub(crate) trait Session: DerefMut<Target = PgConnection> + Send + Sync {
    /// Where statements are pinned: the connection, and the flag to set
    /// when one is cut short during its `BEGIN`; `None`: not pinned.
    fn pinned(&mut self) -> Option<(&mut PgConnection, &mut bool)> {
        None
    }

    /// The pool learned that its connections move between server sessions
    /// (see `Pooled::failed`): the statements sqlx named and cached on
    /// this one were parsed in sessions it may no longer be on.
    fn moved(&self) -> bool {
        false
    }

    /// A statement sent unpinned failed with `e`: whether to send it
    /// again, unnamed and pinned.
    fn failed(&self, e: &SqlError) -> bool {
        let _ = e;
        false
    }

    /// Its answers can no longer be trusted: a pooled connection is
    /// closed instead of given back (elsewhere the error says so).
    fn spoil(&mut self) {}
}

impl Session for &mut PgConnection {}

impl Session for dep::Transaction<'_, dep::Postgres> {}

impl Session for Pooled<'_> {
    fn spoil(&mut self) {
        *self.spoiled = true;
    }

    fn moved(&self) -> bool {
        self.moves.load(Ordering::Acquire)
    }

    fn pinned(&mut self) -> Option<(&mut PgConnection, &mut bool)> {
        (self.pin || self.moves.load(Ordering::Acquire))
            .then_some((&mut *self.conn, &mut *self.spoiled))
    }

    /// A prepared statement refused (`26000`, `42P05`) or a `Bind` that
    /// does not fit its statement (`08P01`): the connection moved between
    /// server sessions between two syncs (a transaction pooler the pool
    /// was not told of). The pool pins its statements from now on, and
    /// this one is sent again so (it did not run: each of those errors
    /// ends it at its `Parse` or `Bind`).
    fn failed(&self, e: &SqlError) -> bool {
        let moved = e.refused_prepared() || e.is(crate::stmt::code::PROTOCOL_VIOLATION);
        if moved && !self.moves.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                error = %e,
                "a statement's connection moved between server sessions (a transaction pooler?): \
                 pgwarden's own statements on this sqlx pool go unnamed, each in a transaction of its own, from now on"
            );
        }
        moved
    }
}

/// A transaction of [`On`]: dropped without [`Tx::commit`], sqlx rolls it
/// back before the connection's next statement.
pub(crate) type OnTx<'c> = On<dep::Transaction<'c, dep::Postgres>>;

impl<C> std::fmt::Debug for On<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("On(sqlx connection)")
    }
}

impl<C> On<C> {
    /// The connection (or transaction) inside, for the caller's own
    /// statements.
    pub(crate) fn get_mut(&mut self) -> &mut C {
        self.0.get_mut()
    }
}

impl From<dep::Error> for SqlError {
    fn from(e: dep::Error) -> SqlError {
        SqlError::Sqlx(Box::new(e))
    }
}

type Query<'q> = dep::query::Query<'q, dep::Postgres, PgArguments>;

/// `text` with `params` bound, persistent (a named prepared statement,
/// cached by sqlx per connection) when `how` is [`Sent::Prepared`].
fn statement<'q>(text: &'q str, params: &'q [Param<'q>], how: Sent) -> Query<'q> {
    let q = dep::query(super::text(text)).persistent(how == Sent::Prepared);
    params.iter().fold(q, |q, p| match *p {
        Param::Int4(v) => q.bind(v),
        Param::Int8(v) => q.bind(v),
        Param::Float8(v) => q.bind(v),
        Param::Text(v) => q.bind(v),
        Param::OptText(v) => q.bind(v),
        Param::Texts(v) => q.bind(v),
        Param::Strings(v) => q.bind(v),
        Param::Int8s(v) => q.bind(v),
        Param::Float8s(v) => q.bind(v),
    })
}

/// What a statement's caller wants of it.
#[derive(Copy, Clone)]
enum Want {
    /// Its rows.
    All,
    /// Its one row.
    One,
    /// The rows it affected.
    Affected,
}

/// What a statement answered, as [`Want`] asked.
enum Got {
    Rows(Vec<PgRow>),
    Row(PgRow),
    Affected(u64),
}

impl Got {
    fn rows(self) -> Vec<PgRow> {
        match self {
            Got::Rows(rows) => rows,
            Got::Row(row) => vec![row],
            Got::Affected(_) => Vec::new(),
        }
    }
}

/// Runs `q` on `conn`, as `want` asks.
async fn send(q: Query<'_>, conn: &mut PgConnection, want: Want) -> Result<Got, dep::Error> {
    Ok(match want {
        Want::All => Got::Rows(q.fetch_all(conn).await?),
        Want::One => Got::Row(q.fetch_one(conn).await?),
        Want::Affected => Got::Affected(q.execute(conn).await?.rows_affected()),
    })
}

/// A pinned statement's transaction (see the module docs): dropped during
/// its `BEGIN` it spoils the connection; dropped open, it queues the
/// `ROLLBACK` for the connection's next use.
struct Pin<'g> {
    conn: &'g mut PgConnection,
    spoiled: &'g mut bool,
    begun: bool,
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        if !self.begun {
            *self.spoiled = true;
        } else if <dep::postgres::PgTransactionManager as super::TransactionManager>::get_transaction_depth(self.conn) > 0 {
            <dep::postgres::PgTransactionManager as super::TransactionManager>::start_rollback(
                self.conn,
            );
        }
    }
}

/// Runs `q` on `conn` inside a transaction of its own: `BEGIN`, `q`,
/// `COMMIT`; `ROLLBACK` (awaited) when `q` fails.
async fn pinned(
    q: Query<'_>,
    conn: &mut PgConnection,
    spoiled: &mut bool,
    want: Want,
) -> Result<Got, dep::Error> {
    use super::TransactionManager as _;
    type Tm = dep::postgres::PgTransactionManager;
    let mut pin = Pin {
        conn,
        spoiled,
        begun: false,
    };
    Tm::begin(pin.conn, None).await?;
    pin.begun = true;
    match send(q, pin.conn, want).await {
        Ok(got) => {
            Tm::commit(pin.conn).await?;
            Ok(got)
        }
        Err(e) => {
            // Failed: the server connection goes back to the pooler now
            // (a rollback that fails is queued again by `pin`'s drop).
            let _ = Tm::rollback(pin.conn).await;
            Err(e)
        }
    }
}

#[allow(private_bounds)]
impl<C: Session> On<C> {
    /// Runs `text` with `params`, pinned where `C` says so and no
    /// transaction is open.
    async fn run(
        &self,
        text: &str,
        params: &[Param<'_>],
        how: Sent,
        want: Want,
    ) -> Result<Got, SqlError> {
        use super::TransactionManager as _;
        let mut c = self.0.lock().await;
        let c: &mut C = &mut c;
        if c.moved() && dep::Connection::cached_statements_size(&**c) > 0 {
            // sqlx answers an unnamed statement from its cache when it
            // named the same text before: closed (one round trip, once per
            // connection), every statement goes unnamed from now on.
            dep::Connection::clear_cached_statements(&mut **c).await?;
        }
        if dep::postgres::PgTransactionManager::get_transaction_depth(c) == 0 {
            if let Some((conn, spoiled)) = c.pinned() {
                // Unnamed: a statement sqlx named and cached on this
                // connection was parsed in another server session.
                let q = statement(text, params, Sent::Unnamed);
                return Ok(pinned(q, conn, spoiled, want).await?);
            }
        }
        let e = match send(statement(text, params, how), c, want).await {
            Ok(got) => return Ok(got),
            Err(e) => SqlError::from(e),
        };
        if c.failed(&e) {
            // As above, learned just now: the statement that failed may be
            // one sqlx named and cached (its `Bind` reached a server
            // session that has no such statement, or another of that
            // name), and sent again unnamed it would be that cached one
            // again (`08P01 bind message supplies 5 parameters, but
            // prepared statement "sqlx_s_2" requires 2` reached a lease
            // acquisition so, stop 39).
            if dep::Connection::cached_statements_size(&**c) > 0 {
                dep::Connection::clear_cached_statements(&mut **c).await?;
            }
            if let Some((conn, spoiled)) = c.pinned() {
                let q = statement(text, params, Sent::Unnamed);
                return Ok(pinned(q, conn, spoiled, want).await?);
            }
        }
        Err(e)
    }
}

#[allow(private_bounds)]
impl<C: Session> Exec for On<C> {
    type Row = PgRow;

    async fn query<'a>(
        &'a self,
        text: &'a str,
        params: &'a [Param<'a>],
        how: Sent,
    ) -> Result<Vec<PgRow>, SqlError> {
        Ok(self.run(text, params, how, Want::All).await?.rows())
    }

    async fn execute<'a>(
        &'a self,
        text: &'a str,
        params: &'a [Param<'a>],
        how: Sent,
    ) -> Result<u64, SqlError> {
        match self.run(text, params, how, Want::Affected).await? {
            Got::Affected(n) => Ok(n),
            got => Ok(got.rows().len() as u64),
        }
    }

    async fn query_one<'a>(
        &'a self,
        text: &'a str,
        params: &'a [Param<'a>],
    ) -> Result<PgRow, SqlError> {
        match self.run(text, params, Sent::Unnamed, Want::One).await? {
            Got::Row(row) => Ok(row),
            got => got
                .rows()
                .into_iter()
                .next()
                .ok_or_else(|| SqlError::from(dep::Error::RowNotFound)),
        }
    }

    async fn batch<'a>(&'a self, text: &'a str) -> Result<(), SqlError> {
        let mut c = self.0.lock().await;
        // Through `Executor` (a boxed future): `RawSql::execute`'s own
        // future is not provably `Send` in an async trait method.
        let c: &mut PgConnection = &mut c;
        dep::Executor::execute(c, dep::raw_sql(super::text(text))).await?;
        Ok(())
    }

    async fn query_one_after_rollback<'a>(&'a self, text: &'a str) -> Result<PgRow, SqlError> {
        let mut c = self.0.lock().await;
        let c: &mut C = &mut c;
        let first = marked_after_rollback(c, text).await;
        match first {
            Err(e) if e.is(code::IN_FAILED_SQL_TRANSACTION) => {
                // A failed transaction refused the `BEGIN`, and the rest
                // with it: end it, then again. A `ROLLBACK` fails only on a
                // broken connection, or one out of step (its answer an
                // earlier query's: the refusal above was one too).
                let rollback = dep::raw_sql(super::text("ROLLBACK"));
                match dep::Executor::execute(&mut **c, rollback).await {
                    Ok(_) => {}
                    // The `ROLLBACK` cancelled while it ran (a cancel
                    // request hits whatever runs when it comes): its own
                    // answer, as on deadpool, where the same error comes
                    // back. The transaction is still failed; a caller that
                    // sends it all again (the release does, once) ends it
                    // then, and that query's mark tells whether the
                    // connection is in step after all.
                    Err(dep::Error::Database(d))
                        if d.code().as_deref() == Some(code::QUERY_CANCELED) =>
                    {
                        return Err(dep::Error::Database(d).into());
                    }
                    Err(e @ (dep::Error::Database(_) | dep::Error::Protocol(_))) => {
                        c.spoil();
                        return Err(out_of_step("ROLLBACK", &e.to_string()));
                    }
                    Err(e) => {
                        c.spoil();
                        return Err(e.into());
                    }
                }
                marked_after_rollback(c, text).await
            }
            done => done,
        }
    }
}

/// Marks of [`marked_after_rollback`]'s queries: each one's own in this
/// process (the queries a connection may still owe an answer to were sent
/// by this process).
static MARK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// `BEGIN; ROLLBACK; BEGIN ISOLATION LEVEL READ COMMITTED; {text};
/// SELECT '<mark>'; COMMIT`, one simple query with a mark of its own as
/// its last row: its answer is `text`'s row. `text` and the mark run in a
/// transaction of their own ([`crate::stmt::ROLLBACK_THEN_TX_OF_ITS_OWN`]: no wait for a safe
/// snapshot whatever defaults user code set on the session); a `text`
/// that fails leaves that transaction failed, which the next attempt's
/// `BEGIN` finds (its `ROLLBACK`, then again). Read
/// anything else last (another query's mark, another row, none), the
/// connection is out of step: sqlx read an answer owed to an earlier
/// query as this one's, and this one's is still on its way (a
/// `COPY FROM STDIN` given up on, `PgCopyIn` dropped, leaves a
/// `ReadyForQuery` sqlx does not count). Its answers cannot be trusted
/// from here on: the connection is spoiled (closed, never returned), and
/// this is an error. No round trip more: the mark is a statement of the
/// same query.
async fn marked_after_rollback<C: Session>(c: &mut C, text: &str) -> Result<PgRow, SqlError> {
    let mark = MARK.fetch_add(1, Ordering::Relaxed);
    let all = format!(
        "BEGIN; {}; {text}; SELECT 'pgwarden mark {mark}'; COMMIT",
        crate::stmt::ROLLBACK_THEN_TX_OF_ITS_OWN
    );
    let sent = dep::Executor::fetch_all(&mut **c, dep::raw_sql(super::text(&all))).await;
    let mut rows = match sent {
        Ok(rows) => rows,
        // sqlx read a message no answer to this query has (the rest of a
        // `COPY TO STDOUT` given up on, say).
        Err(e @ dep::Error::Protocol(_)) => {
            c.spoil();
            return Err(out_of_step(
                &format!("pgwarden's query {mark}"),
                &e.to_string(),
            ));
        }
        // The server's error: its answer, read in step or not (the mark
        // of the next query tells). A broken connection: closed.
        Err(e) => {
            let e = SqlError::from(e);
            if e.code().is_none() {
                c.spoil();
            }
            return Err(e);
        }
    };
    let last = rows.pop();
    let marked = last
        .as_ref()
        .and_then(|row| row.try_get::<&str, _>(0).ok())
        .and_then(|m| m.strip_prefix("pgwarden mark "))
        .is_some_and(|m| m == mark.to_string());
    if !marked {
        c.spoil();
        return Err(out_of_step(
            &format!("pgwarden's query {mark}"),
            "another answer",
        ));
    }
    rows.into_iter()
        .next()
        .ok_or_else(|| SqlError::from(dep::Error::RowNotFound))
}

/// The error of a connection found out of step: what it read for `what`
/// was `read`, an answer owed to an earlier query.
fn out_of_step(what: &str, read: &str) -> SqlError {
    SqlError::from(dep::Error::Protocol(format!(
        "the connection is out of step: {what} was answered with {read}, an earlier query's \
         (still owed: a COPY given up on?); the connection is closed, not returned to the pool, \
         and its session's locks go with it"
    )))
}

#[allow(private_bounds)]
impl<C: Session> Conn for On<C> {
    type Tx<'t>
        = OnTx<'t>
    where
        Self: 't;

    async fn begin(&mut self) -> Result<OnTx<'_>, SqlError> {
        let conn: &mut PgConnection = self.0.get_mut();
        Ok(On(tokio::sync::Mutex::new(
            dep::Connection::begin(conn).await?,
        )))
    }

    async fn begin_read_committed(&mut self) -> Result<OnTx<'_>, SqlError> {
        let conn: &mut PgConnection = self.0.get_mut();
        let begin = "BEGIN ISOLATION LEVEL READ COMMITTED";
        Ok(On(tokio::sync::Mutex::new(
            dep::Connection::begin_with(conn, begin).await?,
        )))
    }
}

impl Tx for OnTx<'_> {
    async fn commit(self) -> Result<(), SqlError> {
        Ok(self.0.into_inner().commit().await?)
    }

    async fn rollback(self) -> Result<(), SqlError> {
        Ok(self.0.into_inner().rollback().await?)
    }
}

impl Row for PgRow {
    fn col<T: Value>(&self, i: usize) -> Result<T, SqlError> {
        super::value(self, i)
    }
}

/// A column's value as sqlx reads it: what [`Value`]'s sqlx method calls.
pub(crate) trait Col: Sized {
    /// Column `i` of `row`.
    fn col(row: &PgRow, i: usize) -> Result<Self, SqlError>;
}

/// [`Col`] through sqlx's own `Decode`, for `T` and `Option<T>`.
macro_rules! decoded {
    ($($t:ty),* $(,)?) => {$(
        impl Col for $t {
            fn col(row: &PgRow, i: usize) -> Result<Self, SqlError> {
                Ok(row.try_get(i)?)
            }
        }
        impl Col for Option<$t> {
            fn col(row: &PgRow, i: usize) -> Result<Self, SqlError> {
                Ok(row.try_get(i)?)
            }
        }
    )*};
}

decoded!(bool, i16, i32, i64, f64, String, Vec<String>, Vec<i32>);

impl Col for Option<u32> {
    fn col(row: &PgRow, i: usize) -> Result<Self, SqlError> {
        let oid: Option<dep::postgres::types::Oid> = row.try_get(i)?;
        Ok(oid.map(|o| o.0))
    }
}

impl Col for u32 {
    fn col(row: &PgRow, i: usize) -> Result<Self, SqlError> {
        Option::<u32>::col(row, i)?.ok_or_else(|| undecodable(i, "NULL where an oid is expected"))
    }
}

/// 2000-01-01 00:00:00 UTC, PostgreSQL's epoch, in Unix seconds.
const PG_EPOCH: u64 = 946_684_800;

impl Col for Option<SystemTime> {
    /// The binary `timestamptz`: microseconds since 2000-01-01 UTC (an
    /// `int8`, big-endian); `infinity` and `-infinity` do not decode.
    fn col(row: &PgRow, i: usize) -> Result<Self, SqlError> {
        let v = row.try_get_raw(i)?;
        if v.is_null() {
            return Ok(None);
        }
        if v.type_info().name() != "TIMESTAMPTZ" || v.format() != PgValueFormat::Binary {
            return Err(undecodable(i, "not a binary timestamptz"));
        }
        let bytes: [u8; 8] = v
            .as_bytes()
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| undecodable(i, "a timestamptz of other than 8 bytes"))?;
        let micros = i64::from_be_bytes(bytes);
        let epoch = SystemTime::UNIX_EPOCH + Duration::from_secs(PG_EPOCH);
        let off = Duration::from_micros(micros.unsigned_abs());
        let t = match micros {
            i64::MAX | i64::MIN => None,
            m if m >= 0 => epoch.checked_add(off),
            _ => epoch.checked_sub(off),
        };
        t.map(Some)
            .ok_or_else(|| undecodable(i, "an infinite or out-of-range timestamptz"))
    }
}

impl Col for SystemTime {
    fn col(row: &PgRow, i: usize) -> Result<Self, SqlError> {
        Option::<SystemTime>::col(row, i)?
            .ok_or_else(|| undecodable(i, "NULL where a timestamptz is expected"))
    }
}

/// sqlx's own error for a column that does not decode.
fn undecodable(i: usize, why: &'static str) -> SqlError {
    SqlError::from(dep::Error::ColumnDecode {
        index: i.to_string(),
        source: why.into(),
    })
}

/// The sqlx statement backend against a real PostgreSQL (compiled once per
/// sqlx version): every parameter type bound, every column type read
/// (NULLs, wrong types and out-of-range columns are errors, never
/// panics), prepared against unnamed statements as the server lists them,
/// the SQLSTATE kept through `crate::Error`, transactions committed or
/// rolled back on drop, the simple-query batch, and a checkout of a
/// pgwarden sqlx pool reached through `Client::exec`.
#[cfg(test)]
mod tests {
    use std::panic::Location;
    use std::time::{Duration, SystemTime};

    use pgwarden_testing::{TestDb, TestServer};

    use super::{dep, On};
    use crate::admission::Lane;
    use crate::stmt::{Conn, Exec, Param, Row, Sent, SqlError, Tx};

    async fn db() -> TestDb {
        TestServer::shared()
            .unwrap()
            .create_database()
            .await
            .unwrap()
    }

    fn options(db: &TestDb) -> dep::postgres::PgConnectOptions {
        let cfg = db.pg_config();
        let mut o = dep::postgres::PgConnectOptions::new_without_pgpass()
            .port(cfg.get_ports().first().copied().unwrap_or(5432))
            .username(cfg.get_user().unwrap_or("postgres"))
            .database(cfg.get_dbname().unwrap_or("postgres"));
        match cfg.get_hosts().first() {
            Some(tokio_postgres::config::Host::Unix(p)) => o = o.socket(p),
            Some(tokio_postgres::config::Host::Tcp(h)) => o = o.host(h),
            None => {}
        }
        o
    }

    async fn connect(db: &TestDb) -> dep::PgConnection {
        <dep::PgConnection as dep::Connection>::connect_with(&options(db))
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn every_param_binds_and_every_value_reads() {
        let db = db().await;
        let mut conn = connect(&db).await;
        let c = On::new(&mut conn);
        let texts = ["a", "b"];
        let strings = vec!["c".to_owned()];
        let params = [
            Param::Int4(-7),
            Param::Int8(1 << 40),
            Param::Float8(1.5),
            Param::Text("x"),
            Param::OptText(None),
            Param::Texts(&texts),
            Param::Strings(&strings),
            Param::Int8s(&[1, 2]),
            Param::Float8s(&[0.5]),
        ];
        for how in [Sent::Prepared, Sent::Unnamed] {
            let rows = c
            .query(
                "SELECT $1::int4, $2::int8, $3::float8, $4::text, $5::text, $6::text[], \
                        $7::text[], $8::int8[] = ARRAY[1, 2]::int8[], $9::float8[] = ARRAY[0.5]::float8[], \
                        2::int2, 'pg_class'::regclass::oid, ARRAY[3, 4]::int4[], NULL::int4",
                &params,
                how,
            )
            .await
            .unwrap();
            let r = &rows[0];
            assert_eq!(r.col::<i32>(0).unwrap(), -7);
            assert_eq!(r.col::<i64>(1).unwrap(), 1 << 40);
            assert_eq!(r.col::<f64>(2).unwrap(), 1.5);
            assert_eq!(r.col::<String>(3).unwrap(), "x");
            assert_eq!(r.col::<Option<String>>(4).unwrap(), None);
            assert_eq!(r.col::<Vec<String>>(5).unwrap(), ["a", "b"]);
            assert_eq!(r.col::<Vec<String>>(6).unwrap(), ["c"]);
            assert!(r.col::<bool>(7).unwrap());
            assert!(r.col::<bool>(8).unwrap());
            assert_eq!(r.col::<i16>(9).unwrap(), 2);
            assert_eq!(r.col::<u32>(10).unwrap(), 1259, "pg_class's oid");
            assert_eq!(r.col::<Vec<i32>>(11).unwrap(), [3, 4]);
            assert_eq!(r.col::<Option<i32>>(12).unwrap(), None);
            // Errors, never panics: NULL into a plain type, another type, a
            // column that is not there.
            assert!(r.col::<i32>(12).is_err());
            assert!(r.col::<u32>(12).is_err());
            assert!(r.col::<i32>(3).is_err());
            assert!(r.col::<SystemTime>(0).is_err());
            assert!(r.col::<i32>(99).is_err());
        }
    }

    #[tokio::test]
    async fn timestamptz_decodes_from_its_binary_value() {
        let db = db().await;
        let mut conn = connect(&db).await;
        let c = On::new(&mut conn);
        let r = c
            .query_one(
                "SELECT '2024-01-02 03:04:05.123456+00'::timestamptz, \
                    '1969-12-31 23:59:59.5+00'::timestamptz, \
                    '2000-01-01 00:00:00+00'::timestamptz, NULL::timestamptz, \
                    'infinity'::timestamptz, '-infinity'::timestamptz, now(), \
                    extract(epoch FROM now())::float8",
                &[],
            )
            .await
            .unwrap();
        let at = |secs: u64, micros: u64| {
            SystemTime::UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_micros(micros)
        };
        assert_eq!(r.col::<SystemTime>(0).unwrap(), at(1_704_164_645, 123_456));
        assert_eq!(
            r.col::<SystemTime>(1).unwrap(),
            SystemTime::UNIX_EPOCH - Duration::from_millis(500)
        );
        assert_eq!(r.col::<SystemTime>(2).unwrap(), at(946_684_800, 0));
        assert_eq!(r.col::<Option<SystemTime>>(3).unwrap(), None);
        assert!(r.col::<SystemTime>(3).is_err());
        assert!(r.col::<SystemTime>(4).is_err(), "infinity");
        assert!(r.col::<SystemTime>(5).is_err(), "-infinity");
        let now = r.col::<SystemTime>(6).unwrap();
        let epoch = r.col::<f64>(7).unwrap();
        let secs = now
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!((secs - epoch).abs() < 1e-5, "{secs} against {epoch}");
    }

    #[tokio::test]
    async fn prepared_statements_are_kept_unnamed_ones_are_not() {
        let db = db().await;
        let mut conn = connect(&db).await;
        let c = On::new(&mut conn);
        let listed = |text: &'static str| {
            let c = &c;
            async move {
                c.query_one(
                    "SELECT count(*) FROM pg_prepared_statements WHERE statement = $1",
                    &[Param::Text(text)],
                )
                .await
                .unwrap()
                .col::<i64>(0)
                .unwrap()
            }
        };
        const PREPARED: &str = "SELECT 1 + $1::int4";
        const UNNAMED: &str = "SELECT 2 + $1::int4";
        for _ in 0..2 {
            c.query(PREPARED, &[Param::Int4(1)], Sent::Prepared)
                .await
                .unwrap();
            c.execute(UNNAMED, &[Param::Int4(1)], Sent::Unnamed)
                .await
                .unwrap();
        }
        assert_eq!(listed(PREPARED).await, 1, "prepared once, kept");
        assert_eq!(listed(UNNAMED).await, 0);
    }

    #[tokio::test]
    async fn errors_keep_their_sqlstate_through_the_crate_error() {
        let db = db().await;
        let mut conn = connect(&db).await;
        let c = On::new(&mut conn);
        let e = c.query_one("SELECT 1 / $1::int4", &[Param::Int4(0)]).await;
        let e = e.err().unwrap();
        assert_eq!(e.code(), Some("22012"));
        let e = crate::Error::from(e);
        assert_eq!(e.sqlstate(), Some("22012"));
        assert!(e.to_string().starts_with("database error 22012: "), "{e}");
        // sqlx's own error inside.
        let crate::Error::Sqlx(inner) = e else {
            panic!("a sqlx error")
        };
        assert!(inner.downcast::<dep::Error>().is_ok());
        // query_one on no row: sqlx's error, no SQLSTATE.
        let e = c
            .query_one("SELECT 1 WHERE false", &[])
            .await
            .err()
            .unwrap();
        assert_eq!(e.code(), None);
        // 55P03 is a lock timeout for the crate's error too.
        c.batch("SET lock_timeout = '1ms'").await.unwrap();
        let e = c
            .batch("DO $$ BEGIN RAISE EXCEPTION 'x' USING ERRCODE = '55P03'; END $$")
            .await
            .err()
            .unwrap();
        assert!(e.is(crate::stmt::code::LOCK_NOT_AVAILABLE));
        assert!(crate::Error::from(e).is_lock_timeout());
    }

    #[tokio::test]
    async fn transactions_commit_or_roll_back_on_drop_and_batches_run() {
        let db = db().await;
        let mut conn = connect(&db).await;
        let mut c = On::new(&mut conn);
        c.batch("CREATE TABLE t (x int); INSERT INTO t VALUES (1)")
            .await
            .unwrap();
        {
            let tx = c.begin().await.unwrap();
            let n = tx
                .execute(
                    "INSERT INTO t VALUES ($1), ($1)",
                    &[Param::Int4(2)],
                    Sent::Unnamed,
                )
                .await
                .unwrap();
            assert_eq!(n, 2);
            // Dropped: rolled back.
        }
        assert_eq!(count(&c).await, 1);
        let tx = c.begin().await.unwrap();
        tx.execute("UPDATE t SET x = $1", &[Param::Int4(5)], Sent::Prepared)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(count(&c).await, 1);
        let r = c
            .query_one("SELECT x FROM t", &[])
            .await
            .unwrap()
            .col::<i32>(0)
            .unwrap();
        assert_eq!(r, 5);
        // A statement's future dropped half-way: the connection goes on (sqlx
        // drains the answer first), the mutex is free.
        let slow = c.query("SELECT pg_sleep(1)", &[], Sent::Unnamed);
        assert!(tokio::time::timeout(Duration::from_millis(50), slow)
            .await
            .is_err());
        let e: Result<Vec<dep::postgres::PgRow>, SqlError> = tokio::time::timeout(
            Duration::from_secs(30),
            c.query("SELECT 1", &[], Sent::Unnamed),
        )
        .await
        .unwrap();
        assert!(e.is_ok());
    }

    async fn count(c: &impl Exec) -> i64 {
        c.query_one("SELECT count(*) FROM t", &[])
            .await
            .unwrap()
            .col::<i64>(0)
            .unwrap()
    }

    #[tokio::test]
    async fn a_pool_checkout_runs_statements_through_client_exec() {
        let db = db().await;
        let pg = dep::postgres::PgPoolOptions::new()
            .max_connections(3)
            .connect_lazy_with(options(&db));
        let (shared, _) = crate::pool::PoolBuilder::new(pg)
            .name("stmt-sqlx")
            .build_shared()
            .unwrap();
        let mut client = shared
            .checkout(Lane::Request, Location::caller(), Duration::from_secs(30))
            .await
            .unwrap();
        let pid = client.pid();
        let on = client.exec();
        let r = on.query_one("SELECT pg_backend_pid()", &[]).await.unwrap();
        assert_eq!(r.col::<i32>(0).unwrap(), pid);
        let mut on = client.exec();
        let tx = on.begin().await.unwrap();
        tx.batch("SELECT 1").await.unwrap();
        tx.commit().await.unwrap();
    }
}
