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
//!   it waits for a fenced transaction (`FOR KEY SHARE`) of the term it
//!   replaces. A take-over draws its token there, with the row locked.
//! - **Tokens grow with every term of a name**, also when rows are deleted.
//!   A new row draws its token before it is inserted, and a statement can
//!   stall between the two; if the row of a later term were deleted during
//!   that stall, the stalled statement would insert a smaller token. Two
//!   guards rule it out. An acquisition holds a shared transaction-scoped
//!   advisory lock on the name (try-only: it never waits) from before its
//!   draw to its commit, and a release deletes its row only if it gets that
//!   lock exclusively (try-only): otherwise it keeps the row, marked
//!   released, and the stalled statement meets it and takes the `DO UPDATE`
//!   path. The purge deletes an old row under the same exclusive try-lock,
//!   and skips (until its next round) the rows it cannot lock. Neither ever
//!   waits, and no table lock holds up other lease statements.
//! - **Busy** is a statement that returns no row. Waiting callers ask when
//!   the lease may be free with a second, read-only statement.
//! - **Bounded on the server too.** Every statement that may wait for a row
//!   lock first sets `lock_timeout` for its own transaction
//!   (`set_config(…, true)`, its last parameter, in milliseconds) to what is
//!   left of its budget: the server ends the wait by itself, even when the
//!   client is gone (killed, or cut off) and no cancel request can come.

use tokio_postgres::types::Type;

use super::table::{quote_literal, TableName};
use crate::lock::{LockKey, Namespace};

/// The key of the transaction-scoped advisory lock `install()` holds:
/// `Namespace::PGWARDEN.named("leases.install")`, that is the pair
/// `(1885828964, 594100531)`, in pgwarden's own key space.
pub(crate) const INSTALL_LOCK_KEY: LockKey = Namespace::PGWARDEN.named("leases.install");

/// The statements of one lease table.
#[derive(Debug)]
pub(crate) struct Statements {
    pub(super) acquire: String,
    pub(super) acquire_held: String,
    pub(super) free_in: String,
    pub(super) renew: String,
    pub(super) release_delete: String,
    pub(super) release_keep: String,
    pub(super) fence: String,
    pub(super) purge: String,
    pub(crate) ddl: String,
    pub(crate) table: String,
    pub(crate) sequence: String,
}

/// A term just taken.
#[derive(Debug)]
pub(crate) struct Taken {
    pub(crate) token: i64,
    /// The holder of the term taken over: `None` for a new row, `Some("")`
    /// for a released row kept by its hold, else an expired holder's id.
    pub(crate) prev_holder: Option<String>,
    /// The database's `now()` at the take, as Unix seconds.
    pub(crate) taken_at: f64,
}

pub(super) const ACQUIRE_TYPES: &[Type] = &[Type::TEXT, Type::TEXT, Type::FLOAT8, Type::INT4];
pub(super) const ACQUIRE_HELD_TYPES: &[Type] = &[
    Type::TEXT,
    Type::TEXT,
    Type::FLOAT8,
    Type::FLOAT8,
    Type::FLOAT8,
    Type::INT4,
];
pub(super) const NAME_TYPES: &[Type] = &[Type::TEXT];
pub(super) const RENEW_TYPES: &[Type] = &[
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::INT8_ARRAY,
    Type::FLOAT8_ARRAY,
    Type::INT4,
];
pub(super) const RELEASE_DELETE_TYPES: &[Type] = &[Type::TEXT, Type::TEXT, Type::INT4];
pub(super) const RELEASE_KEEP_TYPES: &[Type] = &[Type::TEXT, Type::TEXT, Type::BOOL, Type::INT4];
pub(super) const PURGE_TYPES: &[Type] = &[Type::FLOAT8, Type::INT8, Type::INT4];

/// The server-side bound of a statement: `lock_timeout` for its own
/// transaction, from parameter `$n` (milliseconds, at least 1: 0 would mean
/// no bound).
fn wait_bound(n: usize) -> String {
    format!("set_config('lock_timeout', ${n}::int4::text, true) IS NOT NULL")
}

impl Statements {
    pub(crate) fn new(t: &TableName) -> Statements {
        let tbl = t.quoted();
        let seq = t.sequence_literal();
        // The per-name advisory lock: pgwarden's namespace, and the name
        // hashed with the table (`hashtext` is consistent among the sessions
        // of one server, which is all a transaction-scoped lock needs).
        let ns = Namespace::PGWARDEN.id();
        let key = format!("{ns}, hashtext({} || $1)", quote_literal(&tbl));
        let (w3, w4, w5, w6) = (wait_bound(3), wait_bound(4), wait_bound(5), wait_bound(6));
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
 WHERE {w4}
   AND pg_try_advisory_xact_lock_shared({key})
   AND NOT EXISTS (SELECT FROM {tbl} c WHERE c.name = $1 AND (c.expires_at >= now() OR c.held_until > now()))
{on_conflict}"
            ),
            acquire_held: format!(
                "INSERT INTO {tbl} AS l (name, holder, token, taken_at, expires_at, held_until)
SELECT $1, $2, nextval({seq}), now(), now() + make_interval(secs => $3),
       greatest(now() + make_interval(secs => $4),
                CASE WHEN $5 > 0 THEN to_timestamp((floor(extract(epoch FROM now()) / $5) + 1) * $5) END)
 WHERE {w6}
   AND pg_try_advisory_xact_lock_shared({key})
   AND NOT EXISTS (SELECT FROM {tbl} c WHERE c.name = $1 AND (c.expires_at >= now() OR c.held_until > now()))
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
 WHERE {w5} AND l.name = r.name AND l.holder = r.holder AND l.token = r.token
RETURNING l.name, l.token"
            ),
            // Holder ids are new on every acquisition: a holder matches its
            // own term only, so a late release never touches a later term.
            release_delete: format!(
                "DELETE FROM {tbl} WHERE {w3} AND name = $1 AND holder = $2 AND held_until <= now()
   AND pg_try_advisory_xact_lock({key})"
            ),
            // The row stays, marked released (holder ''): for a hold, or
            // when an acquisition of the name is in flight. `$3` forgets the
            // hold (an interrupted run).
            release_keep: format!(
                "UPDATE {tbl} SET holder = '', expires_at = now(),
       held_until = CASE WHEN $3 THEN least(held_until, now()) ELSE held_until END
 WHERE {w4} AND name = $1 AND holder = $2"
            ),
            fence: format!(
                "SELECT holder, token, expires_at > clock_timestamp(),
       current_setting('transaction_isolation') <> 'read committed'
  FROM {tbl} WHERE name = $1 FOR KEY SHARE"
            ),
            // Candidates by age, each deleted only under the exclusive
            // try-lock of its name (the row's name: `$1` of the key is
            // replaced). A candidate changed meanwhile has another ctid.
            purge: format!(
                "DELETE FROM {tbl} WHERE ctid = ANY (ARRAY(
  SELECT ctid FROM {tbl} WHERE greatest(expires_at, held_until) < now() - make_interval(secs => $1) LIMIT $2))
   AND {w3}
   AND greatest(expires_at, held_until) < now() - make_interval(secs => $1)
   AND pg_try_advisory_xact_lock({})",
                key.replace("$1", "name")
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
        let s = Statements::new(&TableName::parse("app.leases").unwrap());
        for text in [
            &s.acquire,
            &s.acquire_held,
            &s.free_in,
            &s.renew,
            &s.release_delete,
            &s.release_keep,
            &s.fence,
            &s.purge,
        ] {
            assert!(text.contains(r#""app"."leases""#), "{text}");
            assert!(!text.contains("pgwarden_leases"));
        }
        assert!(s.acquire.contains(r#"nextval('"app"."leases_token_seq"')"#));
        // The acquisition's shared lock and the release's exclusive one are
        // on the same key.
        let key = r#"(1885828964, hashtext('"app"."leases"' || $1))"#;
        assert!(s
            .acquire
            .contains(&format!("pg_try_advisory_xact_lock_shared{key}")));
        assert!(s
            .release_delete
            .contains(&format!("pg_try_advisory_xact_lock{key}")));
        assert!(s.purge.contains(
            r#"pg_try_advisory_xact_lock(1885828964, hashtext('"app"."leases"' || name))"#
        ));
        assert_eq!(INSTALL_LOCK_KEY, LockKey::Pair(1_885_828_964, 594_100_531));
        assert!(s.ddl.contains("(1885828964, 594100531)"));
    }

    #[test]
    fn the_shared_lock_comes_before_the_token_is_drawn() {
        // The draw in VALUES is the target list of an INSERT … SELECT whose
        // WHERE holds the lock: PostgreSQL evaluates the qualification of a
        // row before it projects it.
        let s = Statements::new(&TableName::default());
        let select = s.acquire.find("SELECT $1, $2, nextval").unwrap();
        let lock = s
            .acquire
            .find("\n WHERE set_config('lock_timeout'")
            .unwrap();
        let targets = &s.acquire[select..lock];
        assert!(!targets.contains(r#"FROM "pgwarden_leases""#), "{targets}");
        assert!(s.acquire.contains("token = nextval"));
        // And the lock timeout is set before both: before any row lock.
        let bound = s.acquire.find("set_config('lock_timeout', $4").unwrap();
        assert!(bound < s.acquire.find("pg_try_advisory_xact_lock_shared").unwrap());
        let bound = s
            .acquire_held
            .find("set_config('lock_timeout', $6")
            .unwrap();
        assert!(
            bound
                < s.acquire_held
                    .find("pg_try_advisory_xact_lock_shared")
                    .unwrap()
        );
        assert!(!s.acquire.contains("held_until)\nSELECT"));
        assert!(s.acquire_held.contains("held_until)\nSELECT"));
        for text in [&s.renew, &s.release_delete, &s.release_keep, &s.purge] {
            assert!(text.contains("set_config('lock_timeout', $"), "{text}");
        }
    }
}
