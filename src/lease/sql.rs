//! Every lease statement, as text built once per table, and the calls that
//! run them.
//!
//! All of them go through `query_typed` (or `simple_query`-free transaction
//! control), never named prepared statements: they work behind PgBouncer in
//! transaction mode. Every time comes from the database clock; durations
//! travel as `float8` seconds. Names, holders and tokens are parameters; the
//! table name, validated by [`TableName`], is the only text spliced in.

use std::time::Duration;

use tokio_postgres::types::Type;
use tokio_postgres::{Client, Error as PgError, GenericClient};

use super::table::TableName;
use crate::error::Error;
use crate::lock::{xact_lock, LockKey, Namespace};

/// The key of the transaction-scoped advisory lock `install()` holds:
/// `Namespace::PGWARDEN.named("leases.install")`, that is the pair
/// `(1885828964, 594100531)`, in pgwarden's own key space.
pub const INSTALL_LOCK_KEY: LockKey = Namespace::PGWARDEN.named("leases.install");

/// The statements of one lease table.
#[derive(Debug)]
pub(crate) struct Statements {
    exists: String,
    acquire: String,
    renew: String,
    release: String,
    fence: String,
    ddl: String,
    table: String,
    sequence: String,
}

/// What one acquisition attempt found.
#[derive(Debug)]
pub(crate) enum Attempt {
    /// Taken: the new term.
    Taken {
        token: i64,
        /// The holder of the previous term: `None` for a new row, `Some("")`
        /// for a released row kept by its hold, else an expired holder's id.
        prev_holder: Option<String>,
        /// The database's `now()` at the take, as Unix seconds.
        taken_at: f64,
    },
    /// Held by another term; free again in about `retry_in` seconds (database
    /// clock), unless its holder releases it first.
    Busy { retry_in: f64 },
}

impl Statements {
    pub(crate) fn new(t: &TableName) -> Statements {
        let tbl = t.quoted();
        let seq = t.sequence_literal();
        Statements {
            exists: "SELECT to_regclass($1) IS NOT NULL AND to_regclass($2) IS NOT NULL".to_owned(),
            // Seed 000's statement, extended: a token from the sequence on
            // every take, the previous holder, the hold, and the time until
            // free when busy. A take-over draws its token in the DO UPDATE
            // branch, with the row locked: after the previous term's, so
            // tokens grow with every term of a name even when a statement
            // that drew a value in VALUES stalls (they do not when drawn
            // before the lock: seen under 16 contenders). `name = excluded.name` makes a
            // take-over lock the row FOR UPDATE, so it waits for fenced
            // transactions (FOR KEY SHARE) while renewals do not.
            acquire: format!(
                "WITH a AS (
  INSERT INTO {tbl} AS l (name, holder, token, taken_at, expires_at, held_until, prev_holder)
  VALUES ($1, $2, nextval({seq}), now(), now() + make_interval(secs => $3),
          greatest(now() + make_interval(secs => $4),
                   CASE WHEN $5 > 0 THEN to_timestamp((floor(extract(epoch FROM now()) / $5) + 1) * $5) END),
          NULL)
  ON CONFLICT (name) DO UPDATE
     SET name = excluded.name, holder = excluded.holder, token = nextval({seq}),
         taken_at = excluded.taken_at, expires_at = excluded.expires_at,
         held_until = excluded.held_until, prev_holder = l.holder
   WHERE l.expires_at < now() AND l.held_until <= now()
  RETURNING l.token, l.prev_holder, extract(epoch FROM l.taken_at)::float8 AS taken_at
)
SELECT true, a.token, a.prev_holder, a.taken_at, 0::float8 FROM a
UNION ALL
SELECT false, NULL::int8, NULL::text, NULL::float8,
       greatest(0, extract(epoch FROM greatest(l.expires_at, l.held_until) - now()))::float8
  FROM {tbl} l WHERE l.name = $1 AND NOT EXISTS (SELECT 1 FROM a)"
            ),
            // One statement renews every lease of the batch, each within its
            // own term only.
            renew: format!(
                "UPDATE {tbl} AS l SET expires_at = now() + make_interval(secs => r.ttl)
  FROM unnest($1::text[], $2::text[], $3::int8[], $4::float8[]) AS r(name, holder, token, ttl)
 WHERE l.name = r.name AND l.holder = r.holder AND l.token = r.token
RETURNING l.name, l.token"
            ),
            // The holder's own term only. The row stays, marked released
            // (holder ''), keeping its token and its hold: the next term's
            // token is drawn under the row lock, after this one's. `$4`
            // forgets the hold (an interrupted run).
            release: format!(
                "UPDATE {tbl} SET holder = '', expires_at = now(),
       held_until = CASE WHEN $4 THEN least(held_until, now()) ELSE held_until END
 WHERE name = $1 AND holder = $2 AND token = $3
RETURNING 1"
            ),
            fence: format!(
                "SELECT holder, token, expires_at > clock_timestamp() FROM {tbl} WHERE name = $1 FOR KEY SHARE"
            ),
            ddl: t.ddl(),
            table: tbl,
            sequence: t.sequence_quoted(),
        }
    }

    /// Creates the table and its sequence unless both exist, inside a
    /// transaction holding the transaction-scoped advisory lock
    /// [`INSTALL_LOCK_KEY`] (waiting up to `wait` for it). Returns true when
    /// it ran the DDL.
    pub(crate) async fn install(&self, client: &mut Client, wait: Duration) -> Result<bool, Error> {
        if self.exists(&*client).await? {
            return Ok(false);
        }
        let tx = client.transaction().await?;
        xact_lock(&tx, INSTALL_LOCK_KEY, wait).await?;
        tx.batch_execute(&self.ddl).await?;
        tx.commit().await?;
        Ok(true)
    }

    pub(crate) async fn exists(&self, client: &impl GenericClient) -> Result<bool, PgError> {
        let row = client
            .query_typed_one(
                &self.exists,
                &[(&self.table, Type::TEXT), (&self.sequence, Type::TEXT)],
            )
            .await?;
        Ok(row.try_get::<_, Option<bool>>(0)?.unwrap_or(false))
    }

    pub(crate) async fn acquire(
        &self,
        client: &Client,
        name: &str,
        holder: &str,
        ttl: f64,
        at_least: f64,
        period: f64,
    ) -> Result<Attempt, PgError> {
        let row = client
            .query_typed_opt(
                &self.acquire,
                &[
                    (&name, Type::TEXT),
                    (&holder, Type::TEXT),
                    (&ttl, Type::FLOAT8),
                    (&at_least, Type::FLOAT8),
                    (&period, Type::FLOAT8),
                ],
            )
            .await?;
        let Some(row) = row else {
            // The row that stopped us was committed after this statement's
            // snapshot: held, by someone who just took it.
            return Ok(Attempt::Busy { retry_in: 0.05 });
        };
        if row.try_get::<_, bool>(0)? {
            Ok(Attempt::Taken {
                token: row.try_get(1)?,
                prev_holder: row.try_get(2)?,
                taken_at: row.try_get(3)?,
            })
        } else {
            Ok(Attempt::Busy {
                retry_in: row.try_get(4)?,
            })
        }
    }

    /// Renews a batch; returns the `(name, token)` of the leases renewed.
    pub(crate) async fn renew(
        &self,
        client: &Client,
        names: &[&str],
        holders: &[&str],
        tokens: &[i64],
        ttls: &[f64],
    ) -> Result<Vec<(String, i64)>, PgError> {
        let rows = client
            .query_typed(
                &self.renew,
                &[
                    (&names, Type::TEXT_ARRAY),
                    (&holders, Type::TEXT_ARRAY),
                    (&tokens, Type::INT8_ARRAY),
                    (&ttls, Type::FLOAT8_ARRAY),
                ],
            )
            .await?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .collect()
    }

    /// Releases one term; returns whether a row was ours to release.
    pub(crate) async fn release(
        &self,
        client: &Client,
        name: &str,
        holder: &str,
        token: i64,
        forget_hold: bool,
    ) -> Result<bool, PgError> {
        let row = client
            .query_typed_opt(
                &self.release,
                &[
                    (&name, Type::TEXT),
                    (&holder, Type::TEXT),
                    (&token, Type::INT8),
                    (&forget_hold, Type::BOOL),
                ],
            )
            .await?;
        Ok(row.is_some())
    }

    /// Locks the lease row `FOR KEY SHARE` in the caller's transaction;
    /// returns its holder, token and whether it is unexpired.
    pub(crate) async fn fence(
        &self,
        client: &impl GenericClient,
        name: &str,
    ) -> Result<Option<(String, i64, bool)>, PgError> {
        let row = client
            .query_typed_opt(&self.fence, &[(&name, Type::TEXT)])
            .await?;
        row.map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_name_is_the_only_splice() {
        let s = Statements::new(&TableName::parse("app.leases").unwrap());
        for text in [&s.acquire, &s.renew, &s.release, &s.fence] {
            assert!(text.contains(r#""app"."leases""#), "{text}");
            assert!(!text.contains("pgwarden_leases"));
        }
        assert!(s.acquire.contains(r#"nextval('"app"."leases_token_seq"')"#));
        assert_eq!(INSTALL_LOCK_KEY, LockKey::Pair(1_885_828_964, 594_100_531));
        assert!(s.ddl.contains("(1885828964, 594100531)"));
    }
}
