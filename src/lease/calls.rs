//! Each lease statement with its parameters, as [`Inner::run`] takes it.
//!
//! [`Inner::run`]: super::inner::Inner::run

use std::future::Future;
use std::time::Duration;

use deadpool_postgres::ClientWrapper as Client;
use tokio_postgres::Error as PgError;

use super::queries::RowLocker;
use super::sql::{Statements, Taken};
use super::statement::{Call, LeaseStatement};

/// Implements [`LeaseStatement`] for `$ty`: `$out` from the `Statements`
/// call `$body` makes with the statement `$s`, the statements `$sql`, the
/// client `$c` and how it is sent, `$call`.
macro_rules! lease_statement {
    ($ty:ty, $out:ty, $what:literal, |$s:ident, $sql:ident, $c:ident, $call:ident| $body:expr) => {
        impl LeaseStatement for $ty {
            type Out = $out;
            const WHAT: &'static str = $what;
            fn exec<'a>(
                &'a self,
                $sql: &'a Statements,
                $c: &'a mut Client,
                $call: Call,
            ) -> impl Future<Output = Result<Self::Out, PgError>> + Send + 'a {
                let $s = self;
                $body
            }
        }
    };
}

/// Why an acquisition attempt did not take the lease.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Busy {
    /// Another term holds it (or its hold keeps it).
    Held,
    /// Its term is over, but another session held a lock on its row for
    /// longer than [`TAKEOVER_WAIT`](super::sql::TAKEOVER_WAIT): a fenced
    /// transaction of the expired term, or anyone holding the row.
    Blocked,
}

/// One acquisition attempt.
pub(crate) struct Acquire<'a> {
    pub(crate) name: &'a str,
    pub(crate) holder: &'a str,
    pub(crate) ttl: f64,
    /// The at-least time and the period, in seconds, when either is set.
    pub(crate) hold: Option<(f64, f64)>,
}

impl LeaseStatement for Acquire<'_> {
    type Out = Result<Taken, Busy>;
    const WHAT: &'static str = "acquisition";
    async fn exec(
        &self,
        sql: &Statements,
        c: &mut Client,
        call: Call,
    ) -> Result<Result<Taken, Busy>, PgError> {
        let taken = sql
            .acquire(c, call.named, self.name, self.holder, self.ttl, self.hold)
            .await?;
        Ok(taken.ok_or(Busy::Held))
    }
    fn on_lock_timeout() -> Option<Result<Taken, Busy>> {
        Some(Err(Busy::Blocked))
    }
}

/// Seconds until a held name may be free.
pub(crate) struct FreeIn<'a> {
    pub(crate) name: &'a str,
}

lease_statement!(FreeIn<'_>, Option<f64>, "busy check", |s, sql, c, call| sql
    .free_in(c, call.named, s.name));

/// The session holding a lock on a name's row (a blocked take-over's log).
pub(crate) struct Blocker<'a> {
    pub(crate) name: &'a str,
}

lease_statement!(
    Blocker<'_>,
    Option<RowLocker>,
    "busy check",
    |s, sql, c, call| sql.blocker(c, call.named, s.name)
);

/// One batched renewal.
pub(crate) struct Renew<'a> {
    pub(crate) names: Vec<&'a str>,
    pub(crate) holders: Vec<&'a str>,
    pub(crate) tokens: Vec<i64>,
    pub(crate) ttls: Vec<f64>,
}

lease_statement!(
    Renew<'_>,
    Vec<(String, i64)>,
    "renewal",
    |s, sql, c, call| sql.renew(c, call.named, &s.names, &s.holders, &s.tokens, &s.ttls)
);

/// A release: the row stays, marked released; with `keep_hold` false the
/// hold goes too (a run that never started).
pub(crate) struct Release<'a> {
    pub(crate) name: &'a str,
    pub(crate) holder: &'a str,
    pub(crate) keep_hold: bool,
}

lease_statement!(Release<'_>, bool, "release", |s, sql, c, call| sql.release(
    c,
    call.named,
    s.name,
    s.holder,
    s.keep_hold
));

/// One purge statement: rows deleted.
pub(crate) struct Purge {
    pub(crate) age: Duration,
    pub(crate) limit: i64,
}

lease_statement!(Purge, Option<u64>, "purge", |s, sql, c, _call| sql
    .purge(c, s.age, s.limit));

/// Create the table if missing, then check its shape.
pub(crate) struct Install<'a> {
    pub(crate) wait: Duration,
    pub(crate) table: &'a str,
    /// The bare table name, when it was given without a schema.
    pub(crate) bare: Option<&'a str>,
}

lease_statement!(
    Install<'_>,
    Result<bool, crate::error::Error>,
    "install",
    |s, sql, c, _call| async move { Ok(sql.install(c, s.wait, s.table, s.bare).await) }
);
