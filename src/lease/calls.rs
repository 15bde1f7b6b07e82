//! Each lease statement with its parameters, as [`Inner::run`] takes it.
//!
//! [`Inner::run`]: super::inner::Inner::run

use std::future::Future;
use std::time::Duration;

use deadpool_postgres::ClientWrapper as Client;
use tokio_postgres::Error as PgError;

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

/// One acquisition attempt: `None` when another term holds the name.
pub(crate) struct Acquire<'a> {
    pub(crate) name: &'a str,
    pub(crate) holder: &'a str,
    pub(crate) ttl: f64,
    /// The at-least time and the period, in seconds, when either is set.
    pub(crate) hold: Option<(f64, f64)>,
}

lease_statement!(
    Acquire<'_>,
    Option<Taken>,
    "acquisition",
    |s, sql, c, call| sql.acquire(c, call.named, s.name, s.holder, s.ttl, s.hold, call.wait_ms)
);

/// Seconds until a held name may be free.
pub(crate) struct FreeIn<'a> {
    pub(crate) name: &'a str,
}

lease_statement!(FreeIn<'_>, Option<f64>, "busy check", |s, sql, c, call| sql
    .free_in(c, call.named, s.name));

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
    |s, sql, c, call| sql.renew(
        c,
        call.named,
        &s.names,
        &s.holders,
        &s.tokens,
        &s.ttls,
        call.wait_ms,
    )
);

/// A release that deletes the row (no hold, no acquisition in flight).
pub(crate) struct ReleaseDelete<'a> {
    pub(crate) name: &'a str,
    pub(crate) holder: &'a str,
}

lease_statement!(ReleaseDelete<'_>, bool, "release", |s, sql, c, call| sql
    .release_delete(c, call.named, s.name, s.holder, call.wait_ms));

/// A release that keeps the row, marked released.
pub(crate) struct ReleaseKeep<'a> {
    pub(crate) name: &'a str,
    pub(crate) holder: &'a str,
    pub(crate) forget_hold: bool,
}

lease_statement!(ReleaseKeep<'_>, bool, "release", |s, sql, c, call| sql
    .release_keep(
        c,
        call.named,
        s.name,
        s.holder,
        s.forget_hold,
        call.wait_ms
    ));

/// One purge statement: rows deleted.
pub(crate) struct Purge {
    pub(crate) age: Duration,
    pub(crate) limit: i64,
}

lease_statement!(Purge, u64, "purge", |s, sql, c, call| sql.purge(
    c,
    call.named,
    s.age,
    s.limit,
    call.wait_ms
));

/// Create the table if missing, then check its shape.
pub(crate) struct Install<'a> {
    pub(crate) wait: Duration,
    pub(crate) table: &'a str,
}

lease_statement!(
    Install<'_>,
    Result<bool, crate::error::Error>,
    "install",
    |s, sql, c, _call| async move { Ok(sql.install(c, s.wait, s.table).await) }
);
