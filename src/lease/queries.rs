//! The calls that run the statements of [`Statements`], named or unnamed.

use std::time::Duration;

use deadpool_postgres::ClientWrapper as Client;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Error as PgError, Row};

use super::sql::{
    Statements, Taken, ACQUIRE_HELD_TYPES, ACQUIRE_TYPES, NAME_TYPES, PURGE_TYPES,
    RELEASE_DELETE_TYPES, RELEASE_KEEP_TYPES, RENEW_TYPES,
};

/// Runs `text` with `params`: prepared and cached on the connection when
/// `named`, else as an unnamed statement.
async fn query(
    client: &Client,
    named: bool,
    text: &str,
    types: &[Type],
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>, PgError> {
    if named {
        let stmt = client.prepare_typed_cached(text, types).await?;
        client.query(&stmt, params).await
    } else {
        client.query_typed(text, &typed(params, types)).await
    }
}

fn typed<'a>(
    params: &[&'a (dyn ToSql + Sync)],
    types: &[Type],
) -> Vec<(&'a (dyn ToSql + Sync), Type)> {
    params
        .iter()
        .zip(types)
        .map(|(p, t)| (*p, t.clone()))
        .collect()
}

async fn execute(
    client: &Client,
    named: bool,
    text: &str,
    types: &[Type],
    params: &[&(dyn ToSql + Sync)],
) -> Result<u64, PgError> {
    if named {
        let stmt = client.prepare_typed_cached(text, types).await?;
        client.execute(&stmt, params).await
    } else {
        client.execute_typed(text, &typed(params, types)).await
    }
}

impl Statements {
    /// One acquisition attempt: the new term, or `None` when the name is held.
    /// `hold`: the at-least time and the period, in seconds (see
    /// [`LeaseOptions`](super::LeaseOptions)), when either is set.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn acquire(
        &self,
        client: &Client,
        named: bool,
        name: &str,
        holder: &str,
        ttl: f64,
        hold: Option<(f64, f64)>,
        wait_ms: i32,
    ) -> Result<Option<Taken>, PgError> {
        let rows = match hold {
            None => {
                query(
                    client,
                    named,
                    &self.acquire,
                    ACQUIRE_TYPES,
                    &[&name, &holder, &ttl, &wait_ms],
                )
                .await?
            }
            Some((at_least, period)) => {
                query(
                    client,
                    named,
                    &self.acquire_held,
                    ACQUIRE_HELD_TYPES,
                    &[&name, &holder, &ttl, &at_least, &period, &wait_ms],
                )
                .await?
            }
        };
        rows.first()
            .map(|r| {
                Ok(Taken {
                    token: r.try_get(0)?,
                    prev_holder: r.try_get(1)?,
                    taken_at: r.try_get(2)?,
                })
            })
            .transpose()
    }

    /// Seconds until `name` may be free (database clock): `None` when there
    /// is no row.
    pub(crate) async fn free_in(
        &self,
        client: &Client,
        named: bool,
        name: &str,
    ) -> Result<Option<f64>, PgError> {
        let rows = query(client, named, &self.free_in, NAME_TYPES, &[&name]).await?;
        rows.first().map(|r| r.try_get(0)).transpose()
    }

    /// Renews a batch; returns the `(name, token)` of the leases renewed.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn renew(
        &self,
        client: &Client,
        named: bool,
        names: &[&str],
        holders: &[&str],
        tokens: &[i64],
        ttls: &[f64],
        wait_ms: i32,
    ) -> Result<Vec<(String, i64)>, PgError> {
        let rows = query(
            client,
            named,
            &self.renew,
            RENEW_TYPES,
            &[&names, &holders, &tokens, &ttls, &wait_ms],
        )
        .await?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .collect()
    }

    /// Deletes the row of a term without a hold when no acquisition of its
    /// name is in flight; true when it did.
    pub(crate) async fn release_delete(
        &self,
        client: &Client,
        named: bool,
        name: &str,
        holder: &str,
        wait_ms: i32,
    ) -> Result<bool, PgError> {
        let n = execute(
            client,
            named,
            &self.release_delete,
            RELEASE_DELETE_TYPES,
            &[&name, &holder, &wait_ms],
        )
        .await?;
        Ok(n > 0)
    }

    /// Marks a term's row released, keeping the row; true when the term was
    /// this holder's.
    pub(crate) async fn release_keep(
        &self,
        client: &Client,
        named: bool,
        name: &str,
        holder: &str,
        forget_hold: bool,
        wait_ms: i32,
    ) -> Result<bool, PgError> {
        let n = execute(
            client,
            named,
            &self.release_keep,
            RELEASE_KEEP_TYPES,
            &[&name, &holder, &forget_hold, &wait_ms],
        )
        .await?;
        Ok(n > 0)
    }

    /// Locks the lease row `FOR KEY SHARE` in the caller's transaction;
    /// returns its holder, its token, whether it is unexpired, and whether
    /// the transaction reads from one snapshot (repeatable read or
    /// serializable).
    pub(crate) async fn fence(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        name: &str,
    ) -> Result<Option<(String, i64, bool, bool)>, PgError> {
        let row = tx
            .query_typed_opt(&self.fence, &[(&name, Type::TEXT)])
            .await?;
        row.map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?, r.try_get(3)?)))
            .transpose()
    }

    /// Deletes up to `limit` rows released or expired for longer than `age`,
    /// skipping those whose name an acquisition holds; returns how many.
    pub(crate) async fn purge(
        &self,
        client: &Client,
        named: bool,
        age: Duration,
        limit: i64,
        wait_ms: i32,
    ) -> Result<u64, PgError> {
        let age = age.as_secs_f64();
        execute(
            client,
            named,
            &self.purge,
            PURGE_TYPES,
            &[&age, &limit, &wait_ms],
        )
        .await
    }
}
