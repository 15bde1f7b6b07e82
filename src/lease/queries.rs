//! The calls that run the statements of [`Statements`], named or unnamed.

use std::time::Duration;

use deadpool_postgres::ClientWrapper as Client;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Error as PgError, Row};

use super::sql::{
    Statements, Taken, ACQUIRE_HELD_TYPES, ACQUIRE_TYPES, FENCE_GRACE, FENCE_TYPES, NAME_TYPES,
    RELEASE_TYPES, RENEW_TYPES,
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

/// A session holding a lock on a lease row.
#[derive(Debug, Clone)]
pub(crate) struct RowLocker {
    pub(crate) pid: i32,
    pub(crate) application_name: String,
    pub(crate) state: String,
    /// Seconds in that state.
    pub(crate) state_for_s: f64,
}

impl Statements {
    /// One acquisition attempt: the new term, or `None` when the name is held.
    /// `hold`: the at-least time and the period, in seconds (see
    /// [`LeaseOptions`](super::LeaseOptions)), when either is set.
    pub(crate) async fn acquire(
        &self,
        client: &Client,
        named: bool,
        name: &str,
        holder: &str,
        ttl: f64,
        hold: Option<(f64, f64)>,
    ) -> Result<Option<Taken>, PgError> {
        let rows = match hold {
            None => {
                query(
                    client,
                    named,
                    &self.acquire,
                    ACQUIRE_TYPES,
                    &[&name, &holder, &ttl],
                )
                .await?
            }
            Some((at_least, period)) => {
                query(
                    client,
                    named,
                    &self.acquire_held,
                    ACQUIRE_HELD_TYPES,
                    &[&name, &holder, &ttl, &at_least, &period],
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
    pub(crate) async fn renew(
        &self,
        client: &Client,
        named: bool,
        names: &[&str],
        holders: &[&str],
        tokens: &[i64],
        ttls: &[f64],
    ) -> Result<Vec<(String, i64)>, PgError> {
        let rows = query(
            client,
            named,
            &self.renew,
            RENEW_TYPES,
            &[&names, &holders, &tokens, &ttls],
        )
        .await?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .collect()
    }

    /// Marks a term's row released, keeping the row (and, with
    /// `keep_hold`, its hold); true when the term was this holder's.
    pub(crate) async fn release(
        &self,
        client: &Client,
        named: bool,
        name: &str,
        holder: &str,
        keep_hold: bool,
    ) -> Result<bool, PgError> {
        let text = if keep_hold {
            &self.release
        } else {
            &self.release_unheld
        };
        let n = execute(client, named, text, RELEASE_TYPES, &[&name, &holder]).await?;
        Ok(n > 0)
    }

    /// Locks the lease row `FOR KEY SHARE` in the caller's transaction and
    /// bounds that transaction on the server (`statement_timeout` and
    /// `idle_in_transaction_session_timeout`, for the transaction only: the
    /// term's time left plus [`FENCE_GRACE`]); returns its holder, its
    /// token, whether it is unexpired, and whether the transaction reads
    /// from one snapshot (repeatable read or serializable).
    pub(crate) async fn fence(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        name: &str,
    ) -> Result<Option<(String, i64, bool, bool)>, PgError> {
        let grace = i64::try_from(FENCE_GRACE.as_millis()).unwrap_or(i64::MAX);
        let row = tx
            .query_typed_opt(
                &self.fence,
                &[
                    (&name, FENCE_TYPES[0].clone()),
                    (&grace, FENCE_TYPES[1].clone()),
                ],
            )
            .await?;
        row.map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?, r.try_get(3)?)))
            .transpose()
    }

    /// The session holding a lock on `name`'s row, when one transaction
    /// holds it.
    pub(crate) async fn blocker(
        &self,
        client: &Client,
        named: bool,
        name: &str,
    ) -> Result<Option<RowLocker>, PgError> {
        let rows = query(client, named, &self.blocker, NAME_TYPES, &[&name]).await?;
        rows.first()
            .map(|r| {
                Ok(RowLocker {
                    pid: r.try_get(0)?,
                    application_name: r.try_get(1)?,
                    state: r.try_get(2)?,
                    state_for_s: r.try_get(3)?,
                })
            })
            .transpose()
    }

    /// Deletes up to `limit` rows released or expired for longer than
    /// `age`; returns how many, or `None` when a lease statement was in
    /// flight (the round is skipped).
    ///
    /// First a plain read finds the rows (their `ctid`s), holding no lock a
    /// lease statement waits for: the scan of the table, as long as it
    /// takes, holds nobody up, and when no row is old enough nothing else
    /// happens. Then one round trip, one implicit transaction: the table's
    /// `SHARE` lock taken with `NOWAIT`, and the `DELETE` of those rows by
    /// `ctid` (a TID scan of at most `limit` rows), each checked again. The
    /// lock is granted only when no lease statement is in flight (each
    /// holds `ROW EXCLUSIVE` until it ends, from before it draws a token),
    /// so no acquisition that drew a token for a new row before the purge
    /// can insert it after a purged row of the same name with a larger
    /// token. It never queues (a queued request would hold up every lease
    /// statement behind it); statements that come while the `DELETE` runs
    /// wait for it alone, which is short: an acquisition waits at most 20 ms
    /// for a lock before it answers busy, so the purge must not scan the
    /// table under its lock.
    pub(crate) async fn purge(
        &self,
        client: &mut Client,
        age: Duration,
        limit: i64,
    ) -> Result<Option<u64>, PgError> {
        // Both values are this crate's own numbers, formatted as SQL
        // numbers (the simple query protocol takes no parameters).
        let old = format!(
            "greatest(expires_at, held_until) < now() - make_interval(secs => {:.6}::float8)",
            age.as_secs_f64()
        );
        let find = format!(
            "SELECT ctid::text FROM {} WHERE {old} LIMIT {limit}",
            self.table
        );
        let mut tids = Vec::new();
        for m in client.simple_query(&find).await? {
            if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
                // The server's own `(block,offset)` text: spliced back only
                // once it is checked to be two numbers.
                if let Some(t) = r.get(0).and_then(tid) {
                    tids.push(t);
                }
            }
        }
        if tids.is_empty() {
            return Ok(Some(0));
        }
        let batch = format!(
            "LOCK TABLE {t} IN SHARE MODE NOWAIT; DELETE FROM {t} WHERE ctid = ANY ('{{{}}}'::tid[]) AND {old}",
            tids.join(","),
            t = self.table
        );
        match client.simple_query(&batch).await {
            Ok(messages) => Ok(Some(
                messages
                    .iter()
                    .filter_map(|m| match m {
                        tokio_postgres::SimpleQueryMessage::CommandComplete(n) => Some(*n),
                        _ => None,
                    })
                    .last()
                    .unwrap_or(0),
            )),
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
}

/// A `ctid` as the server writes it, `(block,offset)`, checked to be just
/// that, as an element of an array literal: `"(12,5)"` (with its quotes).
fn tid(text: &str) -> Option<String> {
    let inner = text.strip_prefix('(')?.strip_suffix(')')?;
    let (block, offset) = inner.split_once(',')?;
    let block: u32 = block.parse().ok()?;
    let offset: u16 = offset.parse().ok()?;
    // Quoted as an array element: the comma would split it otherwise.
    Some(format!("\"({block},{offset})\""))
}

#[cfg(test)]
mod tests {
    use super::tid;

    #[test]
    fn a_tid_is_two_numbers_or_nothing() {
        assert_eq!(tid("(12,5)").as_deref(), Some(r#""(12,5)""#));
        assert_eq!(tid("(0,1)").as_deref(), Some(r#""(0,1)""#));
        for bad in [
            "",
            "(1,2",
            "1,2)",
            "(1;2)",
            "(a,1)",
            "(1,2),(3,4)",
            "(1,2)'",
            "(-1,2)",
            "(1,99999)",
        ] {
            assert_eq!(tid(bad), None, "{bad:?}");
        }
    }
}
