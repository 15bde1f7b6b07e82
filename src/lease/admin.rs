//! What an operator needs of a lease table: every row, with the session
//! holding a row lock on it ([`Leases::rows`]), and the end of a term by
//! hand ([`Leases::revoke`]). The `pgwarden` command line's `leases`,
//! `check` and `revoke` are built on these.
//!
//! Both run as other lease statements do (lease lane, bounded, cancelled on
//! the server when they run out of time), on the table the [`Leases`] was
//! built with.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use deadpool_postgres::ClientWrapper as Client;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tokio_postgres::{Error as PgError, Row};

use super::leases::Leases;
use super::options::check_name;
use super::sql::Statements;
use super::statement::{Call, LeaseStatement, Urgency};
use crate::error::Error;

/// One row of the lease table, as [`Leases::rows`] reads it (all times from
/// the database clock), or as it was just before [`Leases::revoke`] ended
/// its term.
///
/// ```no_run
/// # async fn demo(leases: pgwarden::Leases) -> Result<(), pgwarden::Error> {
/// for row in leases.rows().await? {
///     if let Some(pid) = row.blocker_pid {
///         eprintln!("{}: row locked by pid {pid} ({:?})", row.name, row.blocker_state);
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct LeaseRow {
    /// The lease name.
    pub name: String,
    /// The holder id of the current (or last) term; empty once released.
    pub holder: String,
    /// The fencing token of that term.
    pub token: i64,
    /// When that term began.
    pub taken_at: SystemTime,
    /// Seconds until the term expires: negative once expired.
    pub expires_in_s: f64,
    /// A holder holds it and it has not expired.
    pub live: bool,
    /// The at-least hold ([`LeaseOptions::at_least`](super::LeaseOptions::at_least)),
    /// `None` when the row never had one.
    pub held_until: Option<SystemTime>,
    /// The holder of the term this one took over, if any.
    pub prev_holder: Option<String>,
    /// The backend holding a row lock on this row (a fenced transaction, a
    /// statement in flight): the one whose transaction locked it last where
    /// the row tells, else the oldest open transaction holding the table.
    /// A take-over of an expired term is blocked while it lasts (it answers
    /// busy). `None` when the row is not locked.
    pub blocker_pid: Option<i32>,
    /// That backend's `application_name`.
    pub blocker_application_name: Option<String>,
    /// That backend's state (`idle in transaction`…).
    pub blocker_state: Option<String>,
    /// How long that backend has been in its state.
    pub blocker_state_for: Option<Duration>,
}

/// The rows, row-locked names found by a probe that never waits: within a
/// transaction that is rolled back, the rows `FOR UPDATE SKIP LOCKED`
/// skips are the rows some other transaction holds a lock on (row locks
/// are not in `pg_locks`; `FOR UPDATE` conflicts with every row lock). Only
/// rows whose `xmax` is set can be locked, so only those are probed.
fn rows_sql(tbl: &str) -> (String, String) {
    let probe = format!(
        "SELECT name FROM {tbl} WHERE xmax::text <> '0' AND name NOT IN
  (SELECT name FROM {tbl} WHERE xmax::text <> '0' FOR UPDATE SKIP LOCKED)"
    );
    let rows = format!(
        "SELECT l.name, l.holder, l.token, extract(epoch FROM l.taken_at)::float8,
       extract(epoch FROM l.expires_at - now())::float8,
       l.holder <> '' AND l.expires_at >= now(),
       CASE WHEN l.held_until > '-infinity' THEN extract(epoch FROM l.held_until)::float8 END,
       l.prev_holder,
       b.pid, b.application_name, b.state,
       greatest(extract(epoch FROM clock_timestamp() - b.state_change), 0)::float8
  FROM {tbl} l
  LEFT JOIN LATERAL (
       SELECT a.pid, a.application_name, a.state, a.state_change
         FROM pg_stat_activity a
        WHERE (l.name = ANY($1) OR a.backend_xid = l.xmax)
          AND a.pid <> pg_backend_pid() AND a.backend_xid IS NOT NULL
          AND EXISTS (SELECT FROM pg_locks k
                       WHERE k.pid = a.pid AND k.locktype = 'relation' AND k.granted
                         AND k.relation = $2::text::regclass)
        ORDER BY a.backend_xid = l.xmax DESC, a.xact_start
        LIMIT 1) b ON true
 ORDER BY l.name"
    );
    (probe, rows)
}

/// Unix seconds as a time; a value no `SystemTime` holds (a timestamp of
/// ±infinity) becomes the epoch.
fn from_epoch(s: f64) -> SystemTime {
    let d = Duration::try_from_secs_f64(s.abs()).unwrap_or_default();
    if s >= 0.0 {
        UNIX_EPOCH.checked_add(d).unwrap_or(UNIX_EPOCH)
    } else {
        UNIX_EPOCH.checked_sub(d).unwrap_or(UNIX_EPOCH)
    }
}

fn lease_row(r: &Row) -> Result<LeaseRow, PgError> {
    Ok(LeaseRow {
        name: r.try_get(0)?,
        holder: r.try_get(1)?,
        token: r.try_get(2)?,
        taken_at: from_epoch(r.try_get(3)?),
        expires_in_s: r.try_get(4)?,
        live: r.try_get(5)?,
        held_until: r.try_get::<_, Option<f64>>(6)?.map(from_epoch),
        prev_holder: r.try_get(7)?,
        blocker_pid: None,
        blocker_application_name: None,
        blocker_state: None,
        blocker_state_for: None,
    })
}

/// A row of [`rows_sql`]: the lease columns, then its blocker's.
fn lease_row_blocked(r: &Row) -> Result<LeaseRow, PgError> {
    Ok(LeaseRow {
        blocker_pid: r.try_get(8)?,
        blocker_application_name: r.try_get(9)?,
        blocker_state: r.try_get(10)?,
        blocker_state_for: r
            .try_get::<_, Option<f64>>(11)?
            .map(|s| Duration::try_from_secs_f64(s).unwrap_or_default()),
        ..lease_row(r)?
    })
}

/// Every row, with its blocker; lock waits (for the table lock, behind
/// DDL only) bounded on the server by `wait_ms`.
struct ReadRows {
    wait_ms: i32,
}

/// A statement timeout as a server-side `lock_timeout` in milliseconds
/// (at least 1: 0 would mean no bound).
fn wait_ms(timeout: Duration) -> i32 {
    i32::try_from(timeout.as_millis().clamp(1, i32::MAX as u128)).unwrap_or(i32::MAX)
}

impl LeaseStatement for ReadRows {
    type Out = Vec<LeaseRow>;
    const WHAT: &'static str = "listing";
    async fn exec<'a>(
        &'a self,
        sql: &'a Statements,
        client: &'a mut Client,
        _call: Call,
    ) -> Result<Self::Out, PgError> {
        let (probe, rows) = rows_sql(&sql.table);
        let tx = client.transaction().await?;
        // The table lock (ROW SHARE) waits only behind DDL: bounded too.
        tx.query_typed(
            "SELECT set_config('lock_timeout', $1::int4::text, true)",
            &[(&self.wait_ms, Type::INT4)],
        )
        .await?;
        // Without the UPDATE privilege the probe is refused: then only the
        // row's own `xmax` tells (one locker's open transaction).
        let mut tx = tx;
        let sp = tx.savepoint("pgwarden_probe").await?;
        let locked: Vec<String> = match sp.query_typed(&probe, &[]).await {
            Ok(rows) => {
                let names = rows
                    .iter()
                    .map(|r| r.try_get(0))
                    .collect::<Result<_, _>>()?;
                sp.commit().await?; // releases the savepoint, keeps the locks
                names
            }
            Err(e) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
                sp.rollback().await?;
                Vec::new()
            }
            Err(e) => return Err(e),
        };
        let out = tx
            .query_typed(
                &rows,
                &[(&locked, Type::TEXT_ARRAY), (&sql.table, Type::TEXT)],
            )
            .await?
            .iter()
            .map(lease_row_blocked)
            .collect::<Result<_, _>>()?;
        // Nothing was written; the probe's row locks go with it.
        tx.rollback().await?;
        Ok(out)
    }
}

/// Ends the term of `name`: the row is marked released (holder `''`,
/// expired now); returned as it was before.
struct Revoke<'a> {
    name: &'a str,
    wait_ms: i32,
}

fn revoke_sql(tbl: &str) -> String {
    // The row is locked `FOR NO KEY UPDATE` (as a renewal does), which a
    // fenced transaction's `FOR KEY SHARE` does not hold up; `$2` bounds
    // the wait for a statement in flight on it.
    format!(
        "WITH o AS (
  SELECT name, holder, token, taken_at, expires_at, held_until, prev_holder FROM {tbl}
   WHERE set_config('lock_timeout', $2::int4::text, true) IS NOT NULL
     AND name = $1 AND holder <> ''
     FOR NO KEY UPDATE)
UPDATE {tbl} AS l SET holder = '', expires_at = least(l.expires_at, now())
  FROM o WHERE l.name = o.name
RETURNING o.name, o.holder, o.token, extract(epoch FROM o.taken_at)::float8,
       extract(epoch FROM o.expires_at - now())::float8, o.expires_at >= now(),
       CASE WHEN o.held_until > '-infinity' THEN extract(epoch FROM o.held_until)::float8 END,
       o.prev_holder"
    )
}

impl LeaseStatement for Revoke<'_> {
    type Out = Option<LeaseRow>;
    const WHAT: &'static str = "revocation";
    async fn exec<'a>(
        &'a self,
        sql: &'a Statements,
        client: &'a mut Client,
        _call: Call,
    ) -> Result<Self::Out, PgError> {
        let rows = client
            .query_typed(
                &revoke_sql(&sql.table),
                &[(&self.name, Type::TEXT), (&self.wait_ms, Type::INT4)],
            )
            .await?;
        rows.first().map(lease_row).transpose()
    }
}

impl Leases {
    /// Every row of the lease table, by name, each with the backend holding
    /// a row lock on it, if any ([`LeaseRow::blocker_pid`]): a fenced
    /// transaction left open (a frozen or cut-off holder) blocks the
    /// take-over of an expired term until it ends.
    ///
    /// Reads only: locked rows are found with `FOR UPDATE SKIP LOCKED` in a
    /// transaction that is rolled back, which never waits on a row lock.
    /// That probe needs the `UPDATE` privilege on the table; without it a
    /// blocker is found only when the row names its transaction (`xmax`:
    /// one locker, not several sharing the lock).
    pub async fn rows(&self) -> Result<Vec<LeaseRow>, Error> {
        let inner = &self.inner;
        inner
            .run(
                Urgency::Normal,
                inner.statement_timeout,
                &ReadRows {
                    wait_ms: wait_ms(inner.statement_timeout),
                },
            )
            .await
    }

    /// Ends the current term of `name` by hand (an operator's last resort):
    /// the row is marked released and expired, so its holder's
    /// [`fence`](super::LeaseHandle::fence) is refused from now on and its
    /// [`lost`](super::LeaseHandle::lost) signal fires at its next renewal
    /// (`Taken`). The next acquisition takes the name at once, unless an
    /// at-least hold (`held_until`) still runs: the hold is kept.
    ///
    /// Returns the row as it was (old holder and token), or `None` when
    /// there is no row or no holder (already released). It does not wait
    /// on a fenced transaction.
    pub async fn revoke(&self, name: &str) -> Result<Option<LeaseRow>, Error> {
        check_name(name)?;
        let inner = &self.inner;
        inner
            .run(
                Urgency::Urgent,
                inner.statement_timeout,
                &Revoke {
                    name,
                    wait_ms: wait_ms(inner.statement_timeout),
                },
            )
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_never_waits_and_the_revoke_does_not_wait_on_a_fence() {
        let (probe, rows) = rows_sql(r#""app"."leases""#);
        assert!(probe.contains("FOR UPDATE SKIP LOCKED"), "{probe}");
        assert!(
            !probe.contains("NOWAIT") && !rows.contains("FOR "),
            "{rows}"
        );
        assert!(rows.contains(r#"FROM "app"."leases" l"#), "{rows}");
        let revoke = revoke_sql(r#""app"."leases""#);
        // FOR NO KEY UPDATE does not conflict with a fence's FOR KEY SHARE;
        // FOR UPDATE would.
        assert!(revoke.contains("FOR NO KEY UPDATE"), "{revoke}");
        assert!(!revoke.contains("FOR UPDATE"), "{revoke}");
        let bound = revoke.find("set_config('lock_timeout'").unwrap();
        assert!(bound < revoke.find("FOR NO KEY UPDATE").unwrap());
        // Only the term's holder, token and expiry change: the key stays.
        assert!(revoke.contains("SET holder = '', expires_at = least(l.expires_at, now())"));
    }

    #[test]
    fn epoch_seconds_become_times_without_panicking() {
        assert_eq!(from_epoch(1.5), UNIX_EPOCH + Duration::from_millis(1500));
        assert_eq!(from_epoch(-2.0), UNIX_EPOCH - Duration::from_secs(2));
        assert_eq!(from_epoch(f64::INFINITY), UNIX_EPOCH);
        assert_eq!(from_epoch(f64::NAN), UNIX_EPOCH);
    }
}
