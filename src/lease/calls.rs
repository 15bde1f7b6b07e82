//! Each lease statement with its parameters, as [`Inner::run`] takes it.
//!
//! [`Inner::run`]: super::inner::Inner::run

use std::future::Future;
use std::time::Duration;

use deadpool_postgres::ClientWrapper as Client;
use tokio_postgres::Error as PgError;

use super::sql::{Statements, Taken};
use super::statement::{Call, LeaseStatement};

/// One acquisition attempt: `None` when another term holds the name.
pub(crate) struct Acquire<'a> {
    pub(crate) name: &'a str,
    pub(crate) holder: &'a str,
    pub(crate) ttl: f64,
    /// The at-least time and the period, in seconds, when either is set.
    pub(crate) hold: Option<(f64, f64)>,
}

impl LeaseStatement for Acquire<'_> {
    type Out = Option<Taken>;
    const WHAT: &'static str = "acquisition";
    fn exec<'a>(
        &'a self,
        sql: &'a Statements,
        client: &'a mut Client,
        call: Call,
    ) -> impl Future<Output = Result<Self::Out, PgError>> + Send + 'a {
        sql.acquire(
            client,
            call.named,
            self.name,
            self.holder,
            self.ttl,
            self.hold,
            call.wait_ms,
        )
    }
}

/// Seconds until a held name may be free.
pub(crate) struct FreeIn<'a> {
    pub(crate) name: &'a str,
}

impl LeaseStatement for FreeIn<'_> {
    type Out = Option<f64>;
    const WHAT: &'static str = "busy check";
    fn exec<'a>(
        &'a self,
        sql: &'a Statements,
        client: &'a mut Client,
        call: Call,
    ) -> impl Future<Output = Result<Self::Out, PgError>> + Send + 'a {
        sql.free_in(client, call.named, self.name)
    }
}

/// One batched renewal.
pub(crate) struct Renew<'a> {
    pub(crate) names: Vec<&'a str>,
    pub(crate) holders: Vec<&'a str>,
    pub(crate) tokens: Vec<i64>,
    pub(crate) ttls: Vec<f64>,
}

impl LeaseStatement for Renew<'_> {
    type Out = Vec<(String, i64)>;
    const WHAT: &'static str = "renewal";
    fn exec<'a>(
        &'a self,
        sql: &'a Statements,
        client: &'a mut Client,
        call: Call,
    ) -> impl Future<Output = Result<Self::Out, PgError>> + Send + 'a {
        sql.renew(
            client,
            call.named,
            &self.names,
            &self.holders,
            &self.tokens,
            &self.ttls,
            call.wait_ms,
        )
    }
}

/// A release that deletes the row (no hold, no acquisition in flight).
pub(crate) struct ReleaseDelete<'a> {
    pub(crate) name: &'a str,
    pub(crate) holder: &'a str,
}

impl LeaseStatement for ReleaseDelete<'_> {
    type Out = bool;
    const WHAT: &'static str = "release";
    fn exec<'a>(
        &'a self,
        sql: &'a Statements,
        client: &'a mut Client,
        call: Call,
    ) -> impl Future<Output = Result<Self::Out, PgError>> + Send + 'a {
        sql.release_delete(client, call.named, self.name, self.holder, call.wait_ms)
    }
}

/// A release that keeps the row, marked released.
pub(crate) struct ReleaseKeep<'a> {
    pub(crate) name: &'a str,
    pub(crate) holder: &'a str,
    pub(crate) forget_hold: bool,
}

impl LeaseStatement for ReleaseKeep<'_> {
    type Out = bool;
    const WHAT: &'static str = "release";
    fn exec<'a>(
        &'a self,
        sql: &'a Statements,
        client: &'a mut Client,
        call: Call,
    ) -> impl Future<Output = Result<Self::Out, PgError>> + Send + 'a {
        sql.release_keep(
            client,
            call.named,
            self.name,
            self.holder,
            self.forget_hold,
            call.wait_ms,
        )
    }
}

/// One purge statement: rows deleted.
pub(crate) struct Purge {
    pub(crate) age: Duration,
    pub(crate) limit: i64,
}

impl LeaseStatement for Purge {
    type Out = u64;
    const WHAT: &'static str = "purge";
    fn exec<'a>(
        &'a self,
        sql: &'a Statements,
        client: &'a mut Client,
        call: Call,
    ) -> impl Future<Output = Result<Self::Out, PgError>> + Send + 'a {
        sql.purge(client, call.named, self.age, self.limit, call.wait_ms)
    }
}

/// Create the table if missing, then check its shape.
pub(crate) struct Install<'a> {
    pub(crate) wait: Duration,
    pub(crate) table: &'a str,
}

impl LeaseStatement for Install<'_> {
    type Out = Result<bool, crate::error::Error>;
    const WHAT: &'static str = "install";
    async fn exec<'a>(
        &'a self,
        sql: &'a Statements,
        client: &'a mut Client,
        _call: Call,
    ) -> Result<Self::Out, PgError> {
        Ok(sql.install(client, self.wait, self.table).await)
    }
}
