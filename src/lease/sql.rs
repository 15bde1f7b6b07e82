//! Every lease statement, as text built once per table, and the calls that
//! run them.
//!
//! Each statement runs either as a named prepared statement, cached per
//! connection (`prepare_typed_cached`: parsed and planned once per
//! connection), or as an unnamed one (`query_typed`: parsed and planned on
//! every call), which is what works behind a transaction-mode pooler. The
//! caller chooses (see `Inner::named`). Every time comes from the database
//! clock; durations travel as `float8` seconds. Names, holders and tokens
//! are parameters; the table name, validated by [`TableName`], is the only
//! text spliced in.
//!
//! # Why the statements look the way they do
//!
//! - **Acquire** reads the current term before it locks anything: a name
//!   held by a live term is a skip without a row lock, so a contender never
//!   waits on a holder, not even on one inside a fenced transaction. Only an
//!   expired (or missing) row goes on to `ON CONFLICT … DO UPDATE`, whose
//!   `SET name = excluded.name` makes the take-over lock the row `FOR UPDATE`:
//!   it conflicts with a fenced transaction (`FOR KEY SHARE`) of the term it
//!   replaces. A take-over draws its token there, with the row locked.
//! - **A take-over never waits long.** The acquisition's own transaction
//!   carries `lock_timeout` = [`TAKEOVER_WAIT`] once it has found the name's
//!   row (a new row gets the statement timeout instead: the locks any
//!   insert may wait for under load, such as the table's extension lock,
//!   say nothing about the name): a take-over that meets a row
//!   lock (a fenced transaction of the expired term, or any other session
//!   holding the row) gives up on the server by itself, and the attempt
//!   answers busy (counted as `takeover_blocked`). The fenced transaction
//!   cannot keep it waiting for long either: `fence` bounds its own
//!   transaction on the server (see `FENCE`), so a holder frozen or cut off
//!   inside it loses its session soon after its term ends.
//! - **No advisory lock.** No statement takes an advisory lock, so no other
//!   session (of any role) can make an acquisition answer "busy" by holding
//!   one: the only thing that can keep a free name busy is a lock on its row,
//!   which needs write privileges on the table, and is reported.
//! - **Tokens grow with every term of a name.** A release keeps its row,
//!   marked released (holder `''`, expired): the next term of the name takes
//!   the row over and draws its token with the row locked, so it is larger
//!   than every token of the rows before it. Only a new name draws its token
//!   before its row exists; only the purge deletes rows, and only once it
//!   holds the table's `SHARE` lock, which no lease statement in flight
//!   allows (it takes it with `NOWAIT`, or skips its round): no new row
//!   drawn before a purge lands after it.
//! - **Busy** is a statement that returns no row. Waiting callers ask when
//!   the lease may be free with a second, read-only statement.
//! - **Bounded on the server too.** Acquisitions, renewals and releases set
//!   `lock_timeout` for their own transaction, a constant of their text (no
//!   parameter, nothing computed per call): the take-over bound for
//!   acquisitions, the statement timeout for the others. The server ends
//!   the wait by itself, even when the client is gone (killed, or cut off)
//!   and no cancel request can come. On the client every statement is
//!   bounded by its timeout, then cancelled and its connection closed.
//! - **Lean.** Renewals and releases are plain `UPDATE`s by name, holder (and
//!   token); a release does what the plain `DELETE` does, keeping the row.

use std::time::Duration;

use tokio_postgres::types::Type;

use super::table::TableName;
use crate::lock::{LockKey, Namespace};

/// The key of the transaction-scoped advisory lock `install()` holds:
/// `Namespace::PGWARDEN.named("leases.install")`, that is the pair
/// `(1885828964, 594100531)`, in pgwarden's own key space. Only the
/// install takes it (never an acquisition): a session that holds it delays
/// the install, which reports a timeout naming the lock.
pub(crate) const INSTALL_LOCK_KEY: LockKey = Namespace::PGWARDEN.named("leases.install");

/// How long an acquisition's take-over of an expired row may wait for a
/// lock on that row before it answers busy: 20 ms.
pub(crate) const TAKEOVER_WAIT: Duration = Duration::from_millis(20);

/// How far past its term's expiry a fenced transaction may last on the
/// server (idle, or in one statement) before the server ends it: 1 s.
pub(crate) const FENCE_GRACE: Duration = Duration::from_secs(1);

/// The statements of one lease table.
#[derive(Debug)]
pub(crate) struct Statements {
    pub(super) acquire: String,
    pub(super) acquire_held: String,
    pub(super) free_in: String,
    pub(super) renew: String,
    pub(super) release: String,
    pub(super) release_unheld: String,
    pub(super) fence: String,
    pub(super) blocker: String,
    pub(crate) ddl: String,
    /// The table, schema-qualified and quoted.
    pub(crate) table: String,
    /// The token sequence, schema-qualified and quoted.
    pub(crate) sequence: String,
}

/// A term just taken.
#[derive(Debug)]
pub(crate) struct Taken {
    pub(crate) token: i64,
    /// The holder of the term taken over: `None` for a new row, `Some("")`
    /// for a released row, else an expired holder's id.
    pub(crate) prev_holder: Option<String>,
    /// The database's `now()` at the take, as Unix seconds.
    pub(crate) taken_at: f64,
}

pub(super) const ACQUIRE_TYPES: &[Type] = &[Type::TEXT, Type::TEXT, Type::FLOAT8];
pub(super) const ACQUIRE_HELD_TYPES: &[Type] = &[
    Type::TEXT,
    Type::TEXT,
    Type::FLOAT8,
    Type::FLOAT8,
    Type::FLOAT8,
];
pub(super) const NAME_TYPES: &[Type] = &[Type::TEXT];
pub(super) const RENEW_TYPES: &[Type] = &[
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::INT8_ARRAY,
    Type::FLOAT8_ARRAY,
];
pub(super) const RELEASE_TYPES: &[Type] = &[Type::TEXT, Type::TEXT];
pub(super) const FENCE_TYPES: &[Type] = &[Type::TEXT, Type::INT8];

/// `lock_timeout` for the statement's own transaction, as a constant of
/// the statement's text (at least 1 ms: 0 would mean no bound).
fn lock_bound(wait: Duration) -> String {
    format!(
        "set_config('lock_timeout', '{}', true) IS NOT NULL",
        lock_ms(wait)
    )
}

/// A lock wait bound in milliseconds, at least 1 (0 would mean no bound).
fn lock_ms(wait: Duration) -> u128 {
    wait.as_millis().clamp(1, i32::MAX as u128)
}

impl Statements {
    /// The statements of table `t`, whose lease statements are bounded by
    /// `timeout` on the client.
    pub(crate) fn new(t: &TableName, timeout: Duration) -> Statements {
        let tbl = t.quoted();
        let seq = t.sequence_literal();
        // Renewals and releases wait for a row lock only behind another
        // session's (a take-over's, bounded as below, or anyone's): bounded
        // on the server by the statement timeout, so that a statement whose
        // client is gone (no cancel request comes, as behind a pooler) ends.
        let wait = lock_bound(timeout);
        // An acquisition reads the name's row first (`s.live`: NULL when
        // there is none), then bounds its own lock waits: a take-over of an
        // existing row by the take-over bound; a new row by the statement
        // timeout, for the locks every insert may wait for under load (the
        // table's extension lock, a same-named insert in flight), which say
        // nothing about the name being busy: with 16 sessions inserting at
        // once on 2 cores, a 20 ms bound there made free names answer busy.
        let probe = format!(
            "(SELECT (SELECT c.expires_at >= now() OR c.held_until > now() FROM {tbl} c WHERE c.name = $1) AS live OFFSET 0) AS s"
        );
        let gate = format!(
            "s.live IS NOT TRUE
   AND set_config('lock_timeout', CASE WHEN s.live IS NULL THEN '{}' ELSE '{}' END, true) IS NOT NULL",
            lock_ms(timeout),
            lock_ms(TAKEOVER_WAIT.min(timeout))
        );
        let on_conflict = format!(
            "ON CONFLICT (name) DO UPDATE
   SET name = excluded.name, holder = excluded.holder, token = nextval({seq}),
       taken_at = excluded.taken_at, expires_at = excluded.expires_at,
       held_until = excluded.held_until, prev_holder = l.holder
 WHERE l.expires_at < now() AND l.held_until <= now()
RETURNING l.token, l.prev_holder, extract(epoch FROM l.taken_at)::float8"
        );
        Statements {
            // Without a hold, `held_until` keeps its default ('-infinity'):
            // fewer expressions for the server to set up on every call.
            acquire: format!(
                "INSERT INTO {tbl} AS l (name, holder, token, taken_at, expires_at)
SELECT $1, $2, nextval({seq}), now(), now() + make_interval(secs => $3)
  FROM {probe}
 WHERE {gate}
{on_conflict}"
            ),
            acquire_held: format!(
                "INSERT INTO {tbl} AS l (name, holder, token, taken_at, expires_at, held_until)
SELECT $1, $2, nextval({seq}), now(), now() + make_interval(secs => $3),
       greatest(now() + make_interval(secs => $4),
                CASE WHEN $5 > 0 THEN to_timestamp((floor(extract(epoch FROM now()) / $5) + 1) * $5) END)
 FROM {probe}
 WHERE {gate}
{on_conflict}"
            ),
            free_in: format!(
                "SELECT extract(epoch FROM greatest(expires_at, held_until) - now())::float8 FROM {tbl} WHERE name = $1"
            ),
            // One statement renews every lease of the batch, each within its
            // own term only.
            renew: format!(
                "UPDATE {tbl} AS l SET expires_at = now() + make_interval(secs => r.ttl)
  FROM unnest($1::text[], $2::text[], $3::int8[], $4::float8[]) AS r(name, holder, token, ttl)
 WHERE {wait} AND l.name = r.name AND l.holder = r.holder AND l.token = r.token
RETURNING l.name, l.token"
            ),
            // Holder ids are new on every acquisition: a holder matches its
            // own term only, so a late release never touches a later term.
            // The row stays, marked released, with its hold.
            release: format!(
                "UPDATE {tbl} SET holder = '', expires_at = now() WHERE {wait} AND name = $1 AND holder = $2"
            ),
            // After an acquisition whose run never started (cancelled, or
            // stopped before the job): the hold goes too.
            release_unheld: format!(
                "UPDATE {tbl} SET holder = '', expires_at = now(), held_until = least(held_until, now())
 WHERE {wait} AND name = $1 AND holder = $2"
            ),
            // The row locked `FOR KEY SHARE` (a take-over waits for the
            // transaction, a renewal does not), and the transaction bounded
            // on the server from the term's expiry: past it by more than
            // `$2` ms, idle or in one statement, the server ends the session.
            fence: format!(
                "SELECT holder, token, expires_at > clock_timestamp(),
       current_setting('transaction_isolation') <> 'read committed',
       set_config('idle_in_transaction_session_timeout', b.ms, true) IS NOT NULL
         AND set_config('statement_timeout', b.ms, true) IS NOT NULL
  FROM {tbl} AS f,
       LATERAL (SELECT (ceil(greatest(extract(epoch FROM expires_at - clock_timestamp()), 0) * 1000) + $2)::int8::text) AS b(ms)
 WHERE name = $1 FOR KEY SHARE OF f"
            ),
            // The session holding a lock on a row (its `xmax` is the locking
            // transaction when one transaction holds it), for the log line
            // of a blocked take-over.
            blocker: format!(
                "SELECT a.pid, coalesce(a.application_name, ''), coalesce(a.state, ''),
       coalesce(extract(epoch FROM now() - a.state_change), 0)::float8
  FROM {tbl} AS t
  JOIN pg_locks AS k ON k.locktype = 'transactionid' AND k.transactionid = t.xmax AND k.granted
  JOIN pg_stat_activity AS a ON a.pid = k.pid
 WHERE t.name = $1 AND a.pid <> pg_backend_pid()
 LIMIT 1"
            ),
            ddl: t.ddl(),
            table: tbl,
            sequence: t.sequence_quoted(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_name_is_the_only_splice() {
        let s = Statements::new(
            &TableName::parse("app.leases").unwrap(),
            Duration::from_secs(10),
        );
        for text in [
            &s.acquire,
            &s.acquire_held,
            &s.free_in,
            &s.renew,
            &s.release,
            &s.release_unheld,
            &s.fence,
            &s.blocker,
        ] {
            assert!(text.contains(r#""app"."leases""#), "{text}");
            assert!(!text.contains("pgwarden_leases"));
            assert!(!text.contains("advisory"), "{text}");
        }
        assert!(s.acquire.contains(r#"nextval('"app"."leases_token_seq"')"#));
        assert_eq!(INSTALL_LOCK_KEY, LockKey::Pair(1_885_828_964, 594_100_531));
        assert!(s.ddl.contains("(1885828964, 594100531)"));
    }

    #[test]
    fn an_unqualified_name_is_in_public() {
        let s = Statements::new(&TableName::default(), Duration::from_secs(10));
        assert_eq!(s.table, r#""public"."pgwarden_leases""#);
        assert_eq!(s.sequence, r#""public"."pgwarden_leases_token_seq""#);
        assert!(s
            .acquire
            .contains(r#"nextval('"public"."pgwarden_leases_token_seq"')"#));
    }

    #[test]
    fn lock_waits_are_bounded_by_constants() {
        let s = Statements::new(&TableName::default(), Duration::from_millis(1500));
        for text in [&s.acquire, &s.acquire_held] {
            // A take-over of an existing row waits 20 ms for a lock; a new
            // row, the statement timeout.
            assert!(
                text.contains(
                    "set_config('lock_timeout', CASE WHEN s.live IS NULL THEN '1500' ELSE '20' END, true)"
                ),
                "{text}"
            );
            // The bound comes before the row is projected: before any row lock.
            let bound = text.find("set_config").unwrap();
            assert!(bound < text.find("ON CONFLICT").unwrap());
        }
        for text in [&s.renew, &s.release, &s.release_unheld] {
            assert!(
                text.contains("set_config('lock_timeout', '1500', true)"),
                "{text}"
            );
        }
        for text in [&s.free_in, &s.blocker] {
            assert!(!text.contains("set_config"), "{text}");
        }
        // A statement timeout under the take-over bound bounds it too.
        let short = Statements::new(&TableName::default(), Duration::from_millis(7));
        assert!(short
            .acquire
            .contains("CASE WHEN s.live IS NULL THEN '7' ELSE '7' END"));
        assert!(s.fence.contains("idle_in_transaction_session_timeout"));
        assert!(s.fence.contains("'statement_timeout'"));
        assert!(!s.acquire.contains("held_until)\nSELECT"));
        assert!(s.acquire_held.contains("held_until)\nSELECT"));
    }
}
