//! The lease table: its name ([`TableName`]: validated, quoted, the DDL
//! that creates it), every statement on it ([`Statements`]), the install
//! and its shape check, what an operator reads of it (rows, revoke), and
//! each statement with its parameters as the statement helper runs it
//! ([`LeaseStatement`]; the helper itself is `Inner::run`, in `inner.rs`).
//!
//! # Statements
//!
//! Every lease statement, as text built once per table, and the calls that
//! run them.
//!
//! Each statement runs either as a named prepared statement, cached per
//! connection (`prepare_typed_cached`: parsed and planned once per
//! connection), or as an unnamed one (`query_typed`: parsed and planned on
//! every call), which is what a transaction-mode pooler allows (on sqlx,
//! pinned in a transaction of its own there: see `stmt/sqlx.rs`). The
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
//! - **No advisory lock waited on.** No acquisition, renewal, release or
//!   purge takes an advisory lock, so no other session (of any role) can
//!   make an acquisition answer "busy" by holding one: the only thing that
//!   can keep a free name busy is a lock on its row, which needs write
//!   privileges on the table, and is reported. The one advisory lock in a
//!   lease statement is the fence's mark (`fence`, in the holder's own
//!   transaction): shared, taken with `pg_try_advisory_xact_lock_shared`
//!   (never waits; a session holding the key exclusively only leaves the
//!   transaction unmarked), read by a blocked take-over from `pg_locks` to
//!   tell a fenced transaction past its term from any other row locker.
//! - **Tokens grow with every term of a name.** A release keeps its row,
//!   marked released (holder `''`, expired): the next term of the name takes
//!   the row over and draws its token with the row locked, so it is larger
//!   than every token of the rows before it. Only a new name draws its token
//!   before its row exists; only the purge deletes rows, and only rows whose
//!   token is at most the last value of the sequence at its previous
//!   round's mark, once every session that held the table's `ROW
//!   EXCLUSIVE` lock at that mark has ended its transaction (see
//!   `Statements::purge_mark`): no new row drawn before a purge lands after
//!   it. The purge locks nothing that a lease statement waits for.
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
//!
//! # The table's name
//!
//! The lease table's name: validated, quoted, and the DDL that creates it.
//!
//! # Install
//!
//! `install()`: create the lease table and its token sequence when they are
//! missing, and check the shape of what exists.
//!
//! A table that exists with other columns, without a primary key on `name`,
//! or without its sequence would make every acquisition fail with an SQL
//! error later; the check names what differs instead, once, at install or
//! at first use.
//!
//! # Rows and revoke
//!
//! What an operator needs of a lease table: every row, with the session
//! holding a row lock on it ([`Leases::rows`]), and the end of a term by
//! hand ([`Leases::revoke`]). The `pgwarden` command line's `leases`,
//! `check` and `revoke` are built on these.
//!
//! Both run as other lease statements do (lease lane, bounded, cancelled on
//! the server when they run out of time), on the table the [`Leases`] was
//! built with.
//!
//! # Each statement as the helper runs it
//!
//! Each lease statement with its parameters, as [`Inner::run`] takes it.
//!
//! [`Inner::run`]: super::inner::Inner::run
//! [`Leases`]: super::Leases
//! [`Leases::rows`]: super::Leases::rows
//! [`Leases::revoke`]: super::Leases::revoke

use std::fmt;
use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::{name_error, Error, LeaseError, NameRule};
use crate::lock::{xact_lock_on, LockKey, LockMode, Namespace};
use crate::stmt::{Conn, Exec, Param, Row, Sent, SqlError, Tx};

/// The key of the transaction-scoped advisory lock `install()` holds:
/// `Namespace::PGWARDEN.named("leases.install")`, that is the pair
/// `(1885828964, 594100531)`, in pgwarden's own key space. Only the
/// install takes it (never an acquisition): a session that holds it delays
/// the install, which reports a timeout naming the lock.
pub(crate) const INSTALL_LOCK_KEY: LockKey = Namespace::PGWARDEN.named("leases.install");

/// How long an acquisition's take-over of an expired row may wait for a
/// lock on that row before it answers busy: 20 ms.
pub(crate) const TAKEOVER_WAIT: Duration = Duration::from_millis(20);

/// The bound of a batch's lock waits (see `gather.rs`): past it, each of
/// its statements is sent alone.
pub(crate) const BATCH_LOCK_WAIT: Duration = Duration::from_millis(100);

/// How far past its term's expiry a fenced transaction may last on the
/// server (idle, or in one statement) before the server ends it: 1 s.
pub(crate) const FENCE_GRACE: Duration = Duration::from_secs(1);

/// How long the lookup of what kept a blocked fence waiting may take (a
/// connection, then `pg_locks` and, when no lock is held on the table, the
/// row's locker; a few milliseconds on a healthy server): 2 s. Past it the
/// fence reports no pid rather than keep its caller longer.
pub(crate) const FENCE_LOOKUP: Duration = Duration::from_secs(2);

/// How long a fence whose transaction reads an old snapshot may take to
/// read its term outside that snapshot (`Statements::term_now`, on the
/// instance's pool): 500 ms, half the grace, which bounds the fenced
/// transaction's idle spell meanwhile (past that, the server would end
/// its session). Past it, the fence passes on the bound the grace gives.
pub(crate) const FENCE_TERM_LOOKUP: Duration = Duration::from_millis(500);

/// The statements of one lease table.
#[derive(Debug)]
pub(crate) struct Statements {
    pub(super) acquire: Stamped,
    pub(super) acquire_held: Stamped,
    pub(super) acquire_batch: Stamped,
    pub(super) free_in: String,
    pub(super) renew: Stamped,
    pub(super) release: String,
    pub(super) release_unheld: String,
    pub(super) release_batch: String,
    pub(super) fence: String,
    pub(super) term_now: String,
    pub(super) blocker: String,
    pub(super) fence_row_blocker: String,
    pub(super) table_blocker: String,
    pub(super) terms: String,
    pub(super) purge_mark: String,
    pub(super) purge_sweep: Stamped,
    pub(crate) ddl: String,
    /// The table, schema-qualified and quoted.
    pub(crate) table: String,
    /// The token sequence, schema-qualified and quoted.
    pub(crate) sequence: String,
}

/// A statement that starts or renews a term, in two texts: one that writes
/// the row's `renewed_at` (the database's `now()` when `expires_at` was
/// set, so that a reader knows the term's TTL exactly: `expires_at -
/// renewed_at`), and one for a table made before that column existed,
/// which the role may not alter (see [`RENEWED_AT`]).
#[derive(Debug)]
pub(crate) struct Stamped {
    pub(super) stamped: String,
    pub(super) legacy: String,
}

impl Stamped {
    /// Both texts of `text`, whose `{stamp_col}` (a column list's tail),
    /// `{stamp_val}` (the values') and `{stamp_set}` (a `SET` list's tail)
    /// become the column, or nothing.
    fn new(text: &str) -> Stamped {
        let fill = |col: &str, val: &str, set: &str, ttl: &str| {
            text.replace("{stamp_col}", col)
                .replace("{stamp_val}", val)
                .replace("{stamp_set}", set)
                .replace("{stamp_ttl}", ttl)
        };
        Stamped {
            stamped: fill(
                ", renewed_at",
                ", now()",
                ", renewed_at = now()",
                " - CASE WHEN renewed_at >= taken_at THEN greatest(expires_at - renewed_at, interval '0') ELSE interval '0' END",
            ),
            legacy: fill("", "", "", ""),
        }
    }

    /// The text `call` is sent with.
    pub(super) fn text(&self, call: Call) -> &str {
        if call.stamped {
            &self.stamped
        } else {
            &self.legacy
        }
    }
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

/// `lock_timeout` for the statement's own transaction, as a constant of
/// the statement's text (at least 1 ms: 0 would mean no bound).
fn lock_bound(wait: Duration) -> String {
    format!(
        "set_config('lock_timeout', '{}', true) IS NOT NULL",
        lock_ms(wait)
    )
}

/// The fence's view of a timeout setting, in milliseconds (0: none): the
/// value it had before the transaction's first fence, kept in
/// `pgwarden.<mark>`, else the setting's own. Read with `current_setting`
/// (which shows it with its unit, `5s` or `1min`, all of which an
/// `interval` takes), not from `pg_settings`, which builds every setting's
/// row on each read: 30 times the server time of `current_setting`
/// (1.6 ms against 0.06 ms a read on two busy cores). A setting the server
/// does not have (`transaction_timeout` before PostgreSQL 17) is 0.
fn kept_ms(mark: &str, setting: &str) -> String {
    format!(
        "coalesce(nullif(current_setting('pgwarden.{mark}', true), '')::int8,
                                (extract(epoch FROM current_setting('{setting}', true)::interval) * 1000)::int8, 0)"
    )
}

/// The fence's wait bound in milliseconds, for its own wait for the row's
/// lock (set below that lock): the term's time left plus the grace
/// (`$2`), the term's end being the later of the row's `expires_at` as the
/// statement reads it (alias `{row}`) and the term's end as the client
/// knows it (`$5`: its local deadline plus the safety margin, in
/// milliseconds from when the statement was sent, see
/// `LeaseState::term_end`), counted down by the statement's age on the
/// server (`statement_timestamp()`, its arrival). It bounds a wait only:
/// the transaction's own bounds come from the database alone (see
/// [`db_left_ms`]).
fn term_left_ms(row: &str) -> String {
    format!(
        "(ceil(greatest(extract(epoch FROM {row}.expires_at - clock_timestamp()) * 1000,
                                     $5 - extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000,
                                     0)) + $2)::int8"
    )
}

/// The fence's bound for its transaction in milliseconds, as of the moment
/// it is computed: the term's time left by the database plus the grace
/// (`$2`), the term's end being the later of
///
/// - the row's `expires_at` (alias `{row}`), as the statement reads it:
///   the latest committed under `READ COMMITTED`, but the snapshot's under
///   `REPEATABLE READ` and `SERIALIZABLE`, older than every renewal since
///   the snapshot;
/// - `$6`: the term's time left as the database gave it to a read outside
///   the transaction's snapshot (`Statements::term_now`), in milliseconds
///   from when the statement was sent, counted down by the statement's
///   age on the server; 0 on a first fence, whose caller then looks the
///   term up only when the row it read is older than the term it knows
///   (the `stale` column, see [`stale`]).
///
/// Never the client's own term end: that one trails the database's when
/// the host was suspended (`Instant` is `CLOCK_MONOTONIC` on Linux, which
/// stops meanwhile), and a transaction bounded from it could outlive the
/// term the database ended.
fn db_left_ms(row: &str) -> String {
    format!(
        "(ceil(greatest(extract(epoch FROM {row}.expires_at - clock_timestamp()) * 1000,
                                     $6 - extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000,
                                     0)) + $2)::int8"
    )
}

/// How much later than the row's expiry, as the fence reads it, the
/// client's own term end may be before the fence looks the term up outside
/// its snapshot: 100 ms. Read from a current row, the two differ by the
/// fence's one-way latency less the last renewal's (the client's end
/// counts from the renewal's send, the row's from its execution); read
/// from a snapshot older than a renewal, the client's end is later by the
/// time between renewals at least.
pub(crate) const FENCE_STALE_SLACK: Duration = Duration::from_millis(100);

/// Whether a fence's read of the row (alias `{row}`, with its `ctid`) may
/// be older than the term: under `REPEATABLE READ` or `SERIALIZABLE` (the
/// statement reads the transaction's snapshot), either
///
/// - the row has a newer committed version than the one read
///   (`currtid2`, which follows the row's update chain under the latest
///   snapshot, not the transaction's, gives another `ctid`): a renewal, a
///   revoke or a release committed since the snapshot; none of them
///   changes the key, so the fence's `FOR KEY SHARE` is no conflict and
///   reads the old row, whose holder, token and expiry may all be out of
///   date (a revoke keeps the expiry: only this tells it);
/// - or the client's term end (`$5`, counted down as in [`term_left_ms`])
///   is later than the row's expiry by more than [`FENCE_STALE_SLACK`]:
///   the client's clock trails the database's (a host suspended: its term
///   end says too much).
///
/// Only a read outside the snapshot tells what the term is
/// (`Statements::term_now`). `table`: the table as a string literal.
/// Under `READ COMMITTED` the read is current: `false`, nothing looked up.
fn stale(row: &str, table: &str) -> String {
    format!(
        "(CASE WHEN current_setting('transaction_isolation') = 'read committed' THEN false
       ELSE pg_catalog.currtid2({table}, {row}.ctid) <> {row}.ctid
         OR $5 - extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000
            > extract(epoch FROM {row}.expires_at - clock_timestamp()) * 1000 + {slack} END)",
        slack = FENCE_STALE_SLACK.as_millis()
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
        // A batch's lock waits are bounded short: one name's wait would hold
        // up the others; past it, the batch did nothing and each of its
        // statements is sent alone, with the bounds above.
        let batch_wait = lock_bound(BATCH_LOCK_WAIT.min(timeout));
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
        // The term's start as float8 seconds straight from `date_part`
        // (PostgreSQL 14 and later compute `extract` in numeric: 3k
        // server instructions more per acquisition for the same float8).
        let on_conflict = format!(
            "ON CONFLICT (name) DO UPDATE
   SET name = excluded.name, holder = excluded.holder, token = nextval({seq}),
       taken_at = excluded.taken_at, expires_at = excluded.expires_at,
       held_until = excluded.held_until, prev_holder = l.holder{{stamp_set}}
 WHERE l.expires_at < now() AND l.held_until <= now()
RETURNING l.token, l.prev_holder, date_part('epoch', l.taken_at)"
        );
        Statements {
            // Without a hold, `held_until` keeps its default ('-infinity'):
            // fewer expressions for the server to set up on every call.
            acquire: Stamped::new(&format!(
                "INSERT INTO {tbl} AS l (name, holder, token, taken_at, expires_at{{stamp_col}})
SELECT $1, $2, nextval({seq}), now(), now() + make_interval(secs => $3){{stamp_val}}
  FROM {probe}
 WHERE {gate}
{on_conflict}"
            )),
            acquire_held: Stamped::new(&format!(
                "INSERT INTO {tbl} AS l (name, holder, token, taken_at, expires_at, held_until{{stamp_col}})
SELECT $1, $2, nextval({seq}), now(), now() + make_interval(secs => $3),
       greatest(now() + make_interval(secs => $4),
                CASE WHEN $5 > 0 THEN to_timestamp((floor(extract(epoch FROM now()) / $5) + 1) * $5) END){{stamp_val}}
 FROM {probe}
 WHERE {gate}
{on_conflict}"
            )),
            // The acquisitions of a batch (see `gather.rs`), one row each:
            // the same probe, bound and take-over as `acquire_held`, row by
            // row (the executor reads a row, checks it, inserts it, then
            // reads the next, so each row's `set_config` bounds that row's
            // own lock waits). A hold of 0 and a period of 0 mean no hold:
            // `held_until` is then the column's default, as in `acquire`.
            // Names are distinct and sorted, so two batches lock rows in the
            // same order. The arrays come through sub-selects: given as
            // parameters, the planner sizes each call's arrays, finds a
            // plan for that size cheaper than the cached generic one, and
            // plans the statement again on every call.
            acquire_batch: Stamped::new(&format!(
                "INSERT INTO {tbl} AS l (name, holder, token, taken_at, expires_at, held_until{{stamp_col}})
SELECT r.name, r.holder, nextval({seq}), now(), now() + make_interval(secs => r.ttl),
       CASE WHEN r.least > 0 OR r.period > 0 THEN
         greatest(now() + make_interval(secs => r.least),
                  CASE WHEN r.period > 0 THEN to_timestamp((floor(extract(epoch FROM now()) / r.period) + 1) * r.period) END)
       ELSE '-infinity'::timestamptz END{{stamp_val}}
  FROM (SELECT b.*, (SELECT c.expires_at >= now() OR c.held_until > now() FROM {tbl} c WHERE c.name = b.name) AS live
          FROM unnest((SELECT $1::text[]), (SELECT $2::text[]), (SELECT $3::float8[]), (SELECT $4::float8[]), (SELECT $5::float8[])) AS b(name, holder, ttl, least, period)
        OFFSET 0) AS r
 WHERE r.live IS NOT TRUE
   AND set_config('lock_timeout', CASE WHEN r.live IS NULL THEN '{}' ELSE '{}' END, true) IS NOT NULL
{on_conflict}, l.name",
                lock_ms(BATCH_LOCK_WAIT.min(timeout)),
                lock_ms(TAKEOVER_WAIT.min(timeout))
            )),
            free_in: format!(
                "SELECT date_part('epoch', greatest(expires_at, held_until) - now()) FROM {tbl} WHERE name = $1"
            ),
            // One statement renews every lease of the batch, each within its
            // own term only.
            renew: Stamped::new(&format!(
                "UPDATE {tbl} AS l SET expires_at = now() + make_interval(secs => r.ttl){{stamp_set}}
  FROM unnest($1::text[], $2::text[], $3::int8[], $4::float8[]) AS r(name, holder, token, ttl)
 WHERE {wait} AND l.name = r.name AND l.holder = r.holder AND l.token = r.token
RETURNING l.name, l.token"
            )),
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
            // The releases of a batch (see `gather.rs`): each name's row
            // whose holder is the one paired with it (a holder id is new
            // on every acquisition and written to its own name's row only).
            // `$3`: the holders whose hold goes too. The arrays come through
            // sub-selects, as in `acquire_batch`; the lock wait is bounded
            // short, as a blocked release is tried again alone.
            //
            // The pairs drive the plan, one primary-key lookup each: the
            // `LIMIT` (all of them) is there for the planner, which
            // estimates a limit it cannot see at a tenth of its input, so
            // that the cached generic plan is a nested loop over the index
            // at every table size. Written as `name = ANY (…)`, the generic
            // plan a connection fixes at its sixth call was a sequential
            // scan whenever the table then held about 600 to 1,000 rows and
            // had never been analysed (the planner's 10-page floor), and it
            // stayed while the table grew, until the first autoanalyze
            // (2.5 ms a call at tens of thousands of rows; BENCHMARKS.md,
            // row 4s).
            release_batch: format!(
                "UPDATE {tbl} AS l SET holder = '', expires_at = now(),
       held_until = CASE WHEN l.holder = ANY ((SELECT $3::text[])::text[]) THEN least(l.held_until, now()) ELSE l.held_until END
  FROM (SELECT b.name, b.holder FROM unnest((SELECT $1::text[]), (SELECT $2::text[])) AS b(name, holder)
         LIMIT (SELECT cardinality($1::text[]))) AS r
 WHERE {batch_wait} AND l.name = r.name AND l.holder = r.holder
RETURNING l.name"
            ),
            // The row locked `FOR KEY SHARE` (a take-over waits for the
            // transaction, a renewal does not), and the transaction bounded
            // on the server from the term's end by the database (`ms`: the
            // term's time left plus `$2` ms, see `db_left_ms`: the row as
            // read, or `$6`, the term as read outside a stale snapshot;
            // never the client's own term end, `$5`, which only bounds the
            // wait for the row and tells a stale read, see `stale`):
            //
            // - `statement_timeout` and `idle_in_transaction_session_timeout`
            //   for this transaction, each the tighter of that bound and the
            //   value it had before the transaction's first fence (the
            //   role's, the session's, or the transaction's own; 0 is none),
            //   kept in `pgwarden.fence_*` (transaction-local) so that a
            //   second fence can extend its own bound but never loosen the
            //   caller's;
            // - PostgreSQL 17 and later: `transaction_timeout` too, which
            //   bounds the transaction as a whole (its timer is re-armed
            //   from now: set to 0 first, then to the bound);
            // - earlier servers have no whole-transaction bound: the
            //   transaction takes pgwarden's *fence mark* instead, the
            //   shared advisory lock `(1885828964, low 32 bits of the
            //   token)` (pgwarden's own namespace, taken with a try, never
            //   waited on, released at the transaction's end), and only
            //   when the row is this term's (`$3`, `$4`). A take-over that
            //   finds the row locked past the term's end plus the grace
            //   ends the session carrying that term's mark (see
            //   `acquire.rs`): a fenced transaction that ran several
            //   statements and froze is not kept alive by per-statement
            //   bounds;
            // - `lock_timeout` too, the same way (the tighter of the bound
            //   and the value before the first fence, kept in
            //   `pgwarden.fence_lt`), set twice: in the inner `WHERE`,
            //   below the row lock (the other settings apply from the next
            //   statement on, but a lock wait reads `lock_timeout` when it
            //   starts, so the fence's own wait for the row, another
            //   session holding it `FOR UPDATE` or deleting it, ends at the
            //   bound, on the server, SQLSTATE 55P03, in this same round
            //   trip), and again with the rest once the row is locked.
            //
            // Two levels, so that the bounds are computed after the wait:
            // the sub-select that locks the row is never merged into the
            // outer one (it has `FOR KEY SHARE`), so its `LockRows` node
            // runs below the outer projection, which computes `ms` (and
            // the term check) only once the row is locked; computed in the
            // same projection as the scan, they would count the time left
            // from before the wait and land late by the wait's length. The
            // inner `w.lt` is passed up: read again above, it would read
            // the `lock_timeout` the inner `WHERE` just set.
            //
            // The table's own lock (`LOCK TABLE`, `ALTER TABLE`…) is taken
            // when the statement is parsed, before any of this runs: only
            // the transaction's own `lock_timeout` or `statement_timeout`
            // bounds that wait (see `LeaseHandle::fence`).
            fence: format!(
                "SELECT f.holder, f.token, f.expires_at > clock_timestamp(),
       {stale},
       f.holder = $3 AND f.token = $4 AND pg_catalog.pg_try_advisory_xact_lock_shared({ns}, b.mark),
       set_config('pgwarden.fence_st', b.st::text, true) IS NOT NULL
         AND set_config('pgwarden.fence_lt', f.lt::text, true) IS NOT NULL
         AND set_config('pgwarden.fence_it', b.it::text, true) IS NOT NULL
         AND set_config('statement_timeout', (CASE WHEN b.st > 0 THEN least(b.st, b.ms) ELSE b.ms END)::text, true) IS NOT NULL
         AND set_config('idle_in_transaction_session_timeout', (CASE WHEN b.it > 0 THEN least(b.it, b.ms) ELSE b.ms END)::text, true) IS NOT NULL
         AND set_config('lock_timeout', least(CASE WHEN f.lt > 0 THEN least(f.lt, b.ms) ELSE b.ms END, 2147483647)::text, true) IS NOT NULL
         AND (current_setting('server_version_num')::int < 170000
              OR (set_config('pgwarden.fence_tt', b.tt::text, true) IS NOT NULL
                  AND set_config('transaction_timeout', '0', true) IS NOT NULL
                  AND set_config('transaction_timeout', greatest(1, CASE WHEN b.tt > 0 THEN least(b.tt - b.age, b.ms) ELSE b.ms END)::text, true) IS NOT NULL))
  FROM (SELECT l.holder, l.token, l.expires_at, l.ctid, w.lt
          FROM {tbl} AS l,
               LATERAL (SELECT {ms_before} AS ms, {lt} AS lt) AS w
         WHERE l.name = $1
           AND set_config('lock_timeout', least(CASE WHEN w.lt > 0 THEN least(w.lt, w.ms) ELSE w.ms END, 2147483647)::text, true) IS NOT NULL
           FOR KEY SHARE OF l) AS f,
       LATERAL (SELECT {ms_after} AS ms,
                       {st} AS st,
                       {it} AS it,
                       {tt} AS tt,
                       ceil(extract(epoch FROM clock_timestamp() - now()) * 1000)::int8 AS age,
                       (CASE WHEN f.token & 2147483648 = 0 THEN f.token & 2147483647
                             ELSE (f.token & 2147483647) - 2147483648 END)::int4 AS mark) AS b",
                ns = Namespace::PGWARDEN.id(),
                ms_before = term_left_ms("l"),
                ms_after = db_left_ms("f"),
                stale = stale("f", &quote_literal(&tbl)),
                st = kept_ms("fence_st", "statement_timeout"),
                it = kept_ms("fence_it", "idle_in_transaction_session_timeout"),
                tt = kept_ms("fence_tt", "transaction_timeout"),
                lt = kept_ms("fence_lt", "lock_timeout"),
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
            // The current term of a name, read outside a fenced
            // transaction's snapshot (see `LeaseHandle::fence`): locks
            // nothing.
            term_now: format!(
                "SELECT holder, token, date_part('epoch', expires_at - clock_timestamp()) FROM {tbl} WHERE name = $1"
            ),
            // The session holding a lock on a row that a fence's `FOR KEY
            // SHARE` waits for (a `FOR UPDATE`, a `DELETE`, an update of
            // the key), for a blocked fence's error: the row's `xmax`
            // names the locking transaction when one holds it, but also a
            // locker that blocks no fence (another fenced transaction's
            // `FOR KEY SHARE`, a renewal's or a release's `FOR NO KEY
            // UPDATE`), which the row's lock bits alone would tell apart.
            // The probe asks for the fence's own lock, `SKIP LOCKED`: it
            // skips the row (and a locker is named) only when a lock that
            // conflicts with a fence is held. It never waits; when it gets
            // the lock, it holds it for this one statement, which only a
            // take-over or a `DELETE` could wait on, as on any fence.
            fence_row_blocker: format!(
                "SELECT a.pid
  FROM {tbl} AS t
  JOIN pg_locks AS k ON k.locktype = 'transactionid' AND k.transactionid = t.xmax AND k.granted
  JOIN pg_stat_activity AS a ON a.pid = k.pid
 WHERE t.name = $1 AND a.pid <> pg_backend_pid()
   AND NOT EXISTS (SELECT FROM {tbl} AS p WHERE p.name = $1 FOR KEY SHARE OF p SKIP LOCKED)
 LIMIT 1"
            ),
            // The session holding (or first in line for) a lock on the
            // lease table itself that a fence's `FOR KEY SHARE` waits for
            // (`EXCLUSIVE` or `ACCESS EXCLUSIVE`: `LOCK TABLE`, most `ALTER
            // TABLE`s, `VACUUM FULL`…; its pid NULL for a prepared
            // transaction), from `pg_locks` alone: the text names no user
            // table (`to_regclass` looks the name up without locking it),
            // so nothing here waits behind that lock. Looked up first when
            // a fence gave up: the row's locker (`blocker`) is read from
            // the table, which waits behind a table lock from its parse on.
            table_blocker: "SELECT k.pid FROM pg_locks k
 WHERE k.locktype = 'relation' AND k.mode IN ('ExclusiveLock', 'AccessExclusiveLock')
   AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND k.relation = to_regclass($1) AND k.pid IS DISTINCT FROM pg_backend_pid()
 ORDER BY k.granted DESC, k.pid
 LIMIT 1"
                .to_owned(),
            // The current term of each name: after a renewal found some of
            // its leases gone, whether each was taken over or revoked.
            terms: format!(
                "SELECT name, holder, token FROM {tbl} WHERE name = ANY ($1::text[])"
            ),
            // A purge round's mark (see `Statements::purge_mark`): the
            // token sequence's last value, read first (the sub-select in
            // FROM is scanned before the target list is computed), then the
            // transactions holding the table's `ROW EXCLUSIVE` lock, as
            // `pg_locks` shows them (to every role, fast-path locks
            // included). Only the sequence's value is read: nothing is
            // locked, nothing waited on.
            //
            // Not the ids ending in `/0`: a transaction that has committed
            // (or rolled back) but not yet released its locks shows there
            // under its backend's id and the local id 0, which PostgreSQL
            // clears first; it is over (its rows are what any later
            // snapshot sees; PostgreSQL's own `GetLockConflicts` skips such
            // holders too), and `B/0` is not its own: backend `B` shows
            // every lock it holds under it while idle between transactions
            // (a session advisory lock held for hours), and a sweep waiting
            // for `B/0` to go waited as long.
            purge_mark: "SELECT s.w, (SELECT coalesce(array_agg(DISTINCT k.virtualtransaction), '{}')
                FROM pg_locks k
               WHERE k.locktype = 'relation' AND k.granted AND k.mode = 'RowExclusiveLock'
                 AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                 AND k.relation = to_regclass($1) AND k.pid <> pg_backend_pid()
                 AND k.virtualtransaction NOT LIKE '%/0'),
       (SELECT coalesce(array_agg(DISTINCT k.pid), '{}')
                FROM pg_locks k
               WHERE k.locktype = 'relation' AND k.granted AND k.mode = 'RowExclusiveLock'
                 AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                 AND k.relation = to_regclass($1) AND k.pid <> pg_backend_pid()
                 AND k.virtualtransaction NOT LIKE '%/0')
  FROM (SELECT pg_sequence_last_value(to_regclass($2)) AS w OFFSET 0) AS s"
                .to_owned(),
            // A purge round's sweep: once none of the transactions the mark
            // saw holds the table any more (`$1`, checked in the same
            // statement: a transaction keeps its lock on the table until it
            // ends; only that lock is looked at, so that a virtual id used
            // again after a restart of the server, by a transaction that
            // does not touch the table, holds nothing back), the rows
            // whose term's token is at most the mark's (`$2`) and that are
            // released, their hold over, or expired for longer than `$3`
            // seconds plus the term's TTL, up to `$4` of them. A released
            // row (`holder = ''`) says nothing the next term will not, so it
            // goes at once; an expired one is a holder that stopped renewing
            // (a crash, a frozen process), which `pgwarden check` reports
            // once it has been expired for its TTL: it stays that long and
            // the age more (the TTL as stored, `expires_at - renewed_at`;
            // none on a table without `renewed_at`). Rows locked by anyone
            // are skipped, never waited for.
            purge_sweep: Stamped::new(&format!(
                "WITH d AS (SELECT NOT EXISTS (SELECT FROM pg_locks k
                             WHERE k.virtualtransaction = ANY ($1::text[]) AND k.locktype = 'relation'
                               AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                               AND k.relation = '{tbl}'::regclass) AS drained),
     x AS (DELETE FROM {tbl} WHERE ctid = ANY (ARRAY(
             SELECT ctid FROM {tbl}
              WHERE (SELECT drained FROM d) AND token <= $2
                AND greatest(expires_at, held_until)
                    < CASE WHEN holder = '' THEN now()
                           ELSE now() - make_interval(secs => $3){{stamp_ttl}} END
              LIMIT $4 FOR UPDATE SKIP LOCKED))
           RETURNING 1)
SELECT (SELECT drained FROM d), (SELECT count(*) FROM x)"
            )),
            ddl: t.ddl(),
            table: tbl,
            sequence: t.sequence_quoted(),
        }
    }
}

/// What kept a fence waiting (see [`Statements::fence_blocker`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FenceBlock {
    /// A lock on the lease table, not on its row.
    pub(crate) on_table: bool,
    /// The session holding it (`None`: a prepared transaction).
    pub(crate) pid: Option<i32>,
}

/// A name's term as the database has it now (see [`Statements::term_now`]).
#[derive(Debug, Clone)]
pub(crate) struct DbTerm {
    pub(crate) holder: String,
    pub(crate) token: i64,
    /// Seconds left by the database's clock (negative once expired).
    pub(crate) left_s: f64,
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
        client: &impl Exec,
        call: Call,
        name: &str,
        holder: &str,
        ttl: f64,
        hold: Option<(f64, f64)>,
    ) -> Result<Option<Taken>, SqlError> {
        let rows = match hold {
            None => {
                client
                    .query(
                        self.acquire.text(call),
                        &[Param::Text(name), Param::Text(holder), Param::Float8(ttl)],
                        call.how(),
                    )
                    .await?
            }
            Some((at_least, period)) => {
                client
                    .query(
                        self.acquire_held.text(call),
                        &[
                            Param::Text(name),
                            Param::Text(holder),
                            Param::Float8(ttl),
                            Param::Float8(at_least),
                            Param::Float8(period),
                        ],
                        call.how(),
                    )
                    .await?
            }
        };
        rows.first()
            .map(|r| {
                Ok(Taken {
                    token: r.col(0)?,
                    prev_holder: r.col(1)?,
                    taken_at: r.col(2)?,
                })
            })
            .transpose()
    }

    /// The acquisitions of a batch (distinct names): the terms taken, by
    /// name; a name missing from the answer is held.
    pub(crate) async fn acquire_batch(
        &self,
        client: &impl Exec,
        call: Call,
        b: &AcquireBatch,
    ) -> Result<Vec<(String, Taken)>, SqlError> {
        let rows = client
            .query(
                self.acquire_batch.text(call),
                &[
                    Param::Strings(&b.names),
                    Param::Strings(&b.holders),
                    Param::Float8s(&b.ttls),
                    Param::Float8s(&b.leasts),
                    Param::Float8s(&b.periods),
                ],
                call.how(),
            )
            .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.col(3)?,
                    Taken {
                        token: r.col(0)?,
                        prev_holder: r.col(1)?,
                        taken_at: r.col(2)?,
                    },
                ))
            })
            .collect()
    }

    /// Seconds until `name` may be free (database clock): `None` when there
    /// is no row.
    pub(crate) async fn free_in(
        &self,
        client: &impl Exec,
        call: Call,
        name: &str,
    ) -> Result<Option<f64>, SqlError> {
        let rows = client
            .query(&self.free_in, &[Param::Text(name)], call.how())
            .await?;
        rows.first().map(|r| r.col(0)).transpose()
    }

    /// Renews a batch; returns the `(name, token)` of the leases renewed.
    pub(crate) async fn renew(
        &self,
        client: &impl Exec,
        call: Call,
        names: &[&str],
        holders: &[&str],
        tokens: &[i64],
        ttls: &[f64],
    ) -> Result<Vec<(String, i64)>, SqlError> {
        let rows = client
            .query(
                self.renew.text(call),
                &[
                    Param::Texts(names),
                    Param::Texts(holders),
                    Param::Int8s(tokens),
                    Param::Float8s(ttls),
                ],
                call.how(),
            )
            .await?;
        rows.iter().map(|r| Ok((r.col(0)?, r.col(1)?))).collect()
    }

    /// Marks a term's row released, keeping the row (and, with
    /// `keep_hold`, its hold); true when the term was this holder's.
    pub(crate) async fn release(
        &self,
        client: &impl Exec,
        call: Call,
        name: &str,
        holder: &str,
        keep_hold: bool,
    ) -> Result<bool, SqlError> {
        let text = if keep_hold {
            &self.release
        } else {
            &self.release_unheld
        };
        let n = client
            .execute(text, &[Param::Text(name), Param::Text(holder)], call.how())
            .await?;
        Ok(n > 0)
    }

    /// Locks the lease row `FOR KEY SHARE` in the caller's transaction and
    /// bounds that transaction on the server (`statement_timeout`,
    /// `idle_in_transaction_session_timeout` and `lock_timeout` for the
    /// transaction only, each the tighter of its value before the first
    /// fence and the term's time left by the database plus
    /// [`FENCE_GRACE`]; `transaction_timeout` too on PostgreSQL 17 and
    /// later); bounds its own wait for the row (`lock_timeout` set below
    /// the row lock, from the later of the row's expiry and `term_left`,
    /// the client's term end); marks the transaction as a fence of this
    /// term (the shared advisory lock `(1885828964, token as i32)`, when
    /// the row is `holder`'s term `token`). `db_left`: the term's time left
    /// as [`Statements::term_now`] read it outside the transaction's
    /// snapshot (the bound is then at least that), or `None`.
    ///
    /// Returns the row's holder, its token, whether it is unexpired as
    /// read, whether the read may be older than the term (see [`stale`]:
    /// look the term up with [`Statements::term_now`]), and whether the
    /// mark is held.
    pub(crate) async fn fence(
        &self,
        tx: &impl Exec,
        name: &str,
        holder: &str,
        token: i64,
        term_left: Duration,
        db_left: Option<Duration>,
    ) -> Result<Option<(String, i64, bool, bool, bool)>, SqlError> {
        let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        let row = tx
            .query_opt(
                &self.fence,
                &[
                    Param::Text(name),
                    Param::Int8(ms(FENCE_GRACE)),
                    Param::Text(holder),
                    Param::Int8(token),
                    Param::Int8(ms(term_left)),
                    Param::Int8(db_left.map_or(0, ms)),
                ],
                Sent::Unnamed,
            )
            .await?;
        row.map(|r| {
            Ok((
                r.col(0)?,
                r.col(1)?,
                r.col(2)?,
                r.col(3)?,
                r.col::<Option<bool>>(4)?.unwrap_or(false),
            ))
        })
        .transpose()
    }

    /// `name`'s term as the database has it now, read outside any fenced
    /// transaction (a statement of its own, on the instance's pool; no
    /// lock): its holder, its token and its time left (negative once
    /// expired). For a fence whose transaction reads an old snapshot.
    pub(crate) async fn term_now(
        &self,
        client: &impl Exec,
        call: Call,
        name: &str,
    ) -> Result<Option<DbTerm>, SqlError> {
        let rows = client
            .query(&self.term_now, &[Param::Text(name)], call.how())
            .await?;
        rows.first()
            .map(|r| {
                Ok(DbTerm {
                    holder: r.col(0)?,
                    token: r.col(1)?,
                    left_s: r.col(2)?,
                })
            })
            .transpose()
    }

    /// The session holding a lock on `name`'s row, when one transaction
    /// holds it.
    pub(crate) async fn blocker(
        &self,
        client: &impl Exec,
        call: Call,
        name: &str,
    ) -> Result<Option<RowLocker>, SqlError> {
        let rows = client
            .query(&self.blocker, &[Param::Text(name)], call.how())
            .await?;
        rows.first()
            .map(|r| {
                Ok(RowLocker {
                    pid: r.col(0)?,
                    application_name: r.col(1)?,
                    state: r.col(2)?,
                    state_for_s: r.col(3)?,
                })
            })
            .transpose()
    }

    /// What kept a fence of `name` waiting, once it gave up: a session
    /// holding (or first in line for) a lock on the lease table that blocks
    /// a fence, read from `pg_locks` without touching the table; else the
    /// session holding a lock on the row that conflicts with a fence's
    /// (`fence_row_blocker`: not another fence's, nor a renewal's); `None`
    /// when neither is there (any more, or ever: a fence cut off by a
    /// `statement_timeout` while it ran slow, waiting for nothing).
    pub(crate) async fn fence_blocker(
        &self,
        client: &impl Exec,
        call: Call,
        name: &str,
    ) -> Result<Option<FenceBlock>, SqlError> {
        let table = client
            .query(&self.table_blocker, &[Param::Text(&self.table)], call.how())
            .await?;
        if let Some(r) = table.first() {
            return Ok(Some(FenceBlock {
                on_table: true,
                pid: r.col(0)?,
            }));
        }
        let row = client
            .query(&self.fence_row_blocker, &[Param::Text(name)], call.how())
            .await?;
        row.first()
            .map(|r| {
                Ok(FenceBlock {
                    on_table: false,
                    pid: Some(r.col(0)?),
                })
            })
            .transpose()
    }

    /// The mark of a purge round: the token sequence's last value (`None`
    /// before its first value), and the virtual transaction ids of the
    /// sessions holding the table's `ROW EXCLUSIVE` lock (every lease
    /// statement in flight, from before it draws a token until it ends).
    ///
    /// Why it makes the sweep safe: a row whose term's token is at most the
    /// mark's was drawn before the mark. An acquisition of a new row that
    /// drew an even smaller token before it, and has not inserted yet, held
    /// the table lock since before it drew, so it is in the mark's set; the
    /// sweep deletes nothing until every one of them has ended. No new row
    /// can then land after a purged row of its name with a smaller token.
    /// Nothing here locks or waits: the purge takes no table lock of its own.
    pub(crate) async fn purge_mark(
        &self,
        client: &impl Exec,
        call: Call,
    ) -> Result<PurgeMark, SqlError> {
        let rows = client
            .query(
                &self.purge_mark,
                &[Param::Text(&self.table), Param::Text(&self.sequence)],
                call.how(),
            )
            .await?;
        let Some(r) = rows.first() else {
            return Ok(PurgeMark::default());
        };
        Ok(PurgeMark {
            token: r.col(0)?,
            in_flight: r.col(1)?,
            pids: r.col(2)?,
        })
    }

    /// One sweep statement of a purge round: `None` while a transaction of
    /// the mark is still open (nothing deleted), else the rows deleted (at
    /// most `limit`; locked rows are skipped, never waited for).
    pub(crate) async fn purge_sweep(
        &self,
        client: &impl Exec,
        call: Call,
        mark: &PurgeMark,
        age: Duration,
        limit: i64,
    ) -> Result<Option<u64>, SqlError> {
        let Some(token) = mark.token else {
            return Ok(Some(0)); // no token drawn yet: no row to purge
        };
        let age = age.as_secs_f64();
        let rows = client
            .query(
                self.purge_sweep.text(call),
                &[
                    Param::Strings(&mark.in_flight),
                    Param::Int8(token),
                    Param::Float8(age),
                    Param::Int8(limit),
                ],
                call.how(),
            )
            .await?;
        let Some(r) = rows.first() else {
            return Ok(None);
        };
        let drained: bool = r.col(0)?;
        let n: i64 = r.col(1)?;
        Ok(drained.then(|| u64::try_from(n).unwrap_or(0)))
    }
}

/// What a purge round's mark saw (see [`Statements::purge_mark`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PurgeMark {
    /// The token sequence's last value.
    pub(crate) token: Option<i64>,
    /// The lease statements then in flight (virtual transaction ids).
    pub(crate) in_flight: Vec<String>,
    /// Their backends, for the log line of a purge that waits.
    pub(crate) pids: Vec<i32>,
}

/// The default lease table: `public.pgwarden_leases`.
pub(crate) const DEFAULT_TABLE: &str = "pgwarden_leases";

/// The schema of a table name given without one: `public`, whatever the
/// session's `search_path` (two instances whose search paths differ must
/// use the same table).
pub(crate) const DEFAULT_SCHEMA: &str = "public";

/// The longest table name part, in bytes: PostgreSQL truncates identifiers
/// past 63 bytes, and the token sequence adds `_token_seq` (10 bytes).
pub(crate) const MAX_TABLE_LEN: usize = 53;

/// The longest schema name, in bytes (PostgreSQL's identifier limit).
pub(crate) const MAX_SCHEMA_LEN: usize = 63;

const SEQ_SUFFIX: &str = "_token_seq";

/// The DDL shipped in `sql/leases.sql`, written for the default names.
pub(crate) const DDL_TEMPLATE: &str = include_str!("../../sql/leases.sql");

/// A validated `[schema.]table` name, always resolved to a schema: a name
/// given without one is in [`DEFAULT_SCHEMA`], never looked up through the
/// session's `search_path`.
///
/// Each part is 1 to 63 bytes (the table part 1 to [`MAX_TABLE_LEN`]) of
/// `[A-Za-z0-9_]`, not starting with a digit. Quotes, spaces, NUL bytes and
/// any other character are refused rather than escaped, so that the name
/// reads the same in SQL, logs and `psql`. Each part is double-quoted in the
/// statements, which keeps its case and allows reserved words (`user`).
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct TableName {
    schema: String,
    table: String,
    /// The name was given without a schema.
    defaulted: bool,
}

fn valid_part(part: &str, max: usize) -> Result<(), NameRule> {
    if part.is_empty() {
        return Err(NameRule::Empty);
    }
    if part.len() > max {
        return Err(NameRule::TooLong {
            len: part.len(),
            max,
        });
    }
    if part.as_bytes().first().is_some_and(u8::is_ascii_digit) {
        return Err(NameRule::StartsWithDigit);
    }
    if let Some(found) = part
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_'))
    {
        return Err(NameRule::Character {
            found,
            allowed: ALLOWED,
        });
    }
    Ok(())
}

/// What a table name may contain.
const ALLOWED: &str = "[A-Za-z0-9_] in each part, and one dot between schema and table";

impl TableName {
    /// Parses `table` or `schema.table`.
    pub(crate) fn parse(name: &str) -> Result<TableName, Error> {
        fn bad(part: &str) -> impl FnOnce(NameRule) -> Error + '_ {
            move |rule| name_error("lease table name", part, rule)
        }
        let mut parts = name.split('.');
        let (schema, table) = match (parts.next(), parts.next(), parts.next()) {
            (Some(t), None, _) => (None, t),
            (Some(s), Some(t), None) => (Some(s), t),
            _ => {
                return Err(bad(name)(NameRule::Character {
                    found: '.',
                    allowed: ALLOWED,
                }))
            }
        };
        if let Some(s) = schema {
            valid_part(s, MAX_SCHEMA_LEN).map_err(bad(s))?;
        }
        valid_part(table, MAX_TABLE_LEN).map_err(bad(table))?;
        Ok(TableName {
            schema: schema.unwrap_or(DEFAULT_SCHEMA).to_owned(),
            table: table.to_owned(),
            defaulted: schema.is_none(),
        })
    }

    fn qualified(&self, table: &str) -> String {
        format!("{}.{}", quote_ident(&self.schema), quote_ident(table))
    }

    /// The table part alone, quoted, as `search_path` would resolve it:
    /// for the check that no other table of that name shadows this one in
    /// the session's search path (set only when the schema was defaulted).
    pub(crate) fn unqualified_if_defaulted(&self) -> Option<String> {
        self.defaulted.then(|| quote_ident(&self.table))
    }

    /// The table, quoted for SQL: `"app"."leases"`.
    pub(crate) fn quoted(&self) -> String {
        self.qualified(&self.table)
    }

    /// The token sequence, quoted for SQL: `"app"."leases_token_seq"`.
    pub(crate) fn sequence_quoted(&self) -> String {
        self.qualified(&format!("{}{SEQ_SUFFIX}", self.table))
    }

    /// The token sequence as a string literal for `nextval(…)`.
    pub(crate) fn sequence_literal(&self) -> String {
        quote_literal(&self.sequence_quoted())
    }

    /// The DDL of `sql/leases.sql` for this table.
    pub(crate) fn ddl(&self) -> String {
        let seq = format!("\"{DEFAULT_SCHEMA}\".\"{DEFAULT_TABLE}{SEQ_SUFFIX}\"");
        let table = format!("\"{DEFAULT_SCHEMA}\".\"{DEFAULT_TABLE}\"");
        DDL_TEMPLATE
            .replace(&seq, &self.sequence_quoted())
            .replace(&table, &self.quoted())
    }
}

impl Default for TableName {
    fn default() -> TableName {
        TableName {
            schema: DEFAULT_SCHEMA.to_owned(),
            table: DEFAULT_TABLE.to_owned(),
            defaulted: true,
        }
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.schema, self.table)
    }
}

impl fmt::Debug for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.to_string())
    }
}

/// Quotes an identifier: wraps it in double quotes, doubling any inside.
pub(crate) fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// Quotes a string literal: wraps it in single quotes, doubling any inside.
pub(crate) fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The column stamping each write of a term's expiry with the database's
/// `now()` (acquisitions and renewals write both in one statement), so that
/// a reader knows the term's TTL exactly: `expires_at - renewed_at`, while
/// the term is held and `renewed_at >= taken_at`. Optional: a table made by
/// an earlier pgwarden lacks it until `install()` adds it (when the role
/// may); without it every statement runs without it and readers guess the
/// TTL. Why a stamp and not the TTL itself: a term taken over by an older
/// pgwarden (a mixed fleet) leaves the column as the previous term wrote
/// it; a stamp older than the term's `taken_at` is seen as stale, a TTL
/// would not be.
pub(crate) const RENEWED_AT: &str = "renewed_at";

/// Its type, as the catalog names it.
const RENEWED_AT_TYPE: &str = "timestamp with time zone";

/// How long the install's `ALTER TABLE … ADD COLUMN renewed_at` may wait
/// for the table's lock (every lease statement queues behind it meanwhile):
/// past it, the instance runs without the column, and the next install
/// tries again.
pub(crate) const MIGRATE_LOCK_WAIT: Duration = Duration::from_millis(200);

/// The columns pgwarden reads and writes: name, type, and whether NULL must
/// be allowed (`prev_holder` is NULL for a new row). [`RENEWED_AT`] is
/// checked apart: it may be missing.
const COLUMNS: &[(&str, &str, bool)] = &[
    ("name", "text", false),
    ("holder", "text", false),
    ("token", "bigint", false),
    ("taken_at", "timestamp with time zone", false),
    ("expires_at", "timestamp with time zone", false),
    ("held_until", "timestamp with time zone", false),
    ("prev_holder", "text", true),
];

/// One column as the catalog describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Column {
    pub(crate) name: String,
    pub(crate) type_name: String,
    pub(crate) not_null: bool,
    pub(crate) has_default: bool,
}

/// What the catalog says about the table and its sequence.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Shape {
    /// `relkind` of the table (`r`, `p`, or another kind), `None` if missing.
    pub(crate) table_kind: Option<String>,
    pub(crate) columns: Vec<Column>,
    /// The primary key's columns, in order (empty: none).
    pub(crate) primary_key: Vec<String>,
    /// `relkind` of the sequence, `None` if missing.
    pub(crate) sequence_kind: Option<String>,
    /// The sequence's data type (`bigint`, `integer`…).
    pub(crate) sequence_type: Option<String>,
    /// Its `INCREMENT`, `CACHE` and `CYCLE` (from `pg_sequence`).
    pub(crate) sequence_increment: Option<i64>,
    pub(crate) sequence_cache: Option<i64>,
    pub(crate) sequence_cycle: Option<bool>,
    /// The table's largest token and the sequence's last value (`None`
    /// before its first), when both exist: a sequence behind the table
    /// would give a new term a smaller token than an earlier one.
    pub(crate) tokens: Option<(Option<i64>, Option<i64>)>,
    /// The sequence is the one owned by the table's `token` column
    /// (`OWNED BY`): `Some(false)` when it is another, or owned by nothing;
    /// `None` without a `token` column.
    pub(crate) sequence_owned: Option<bool>,
    /// Another table that the session's `search_path` finds under the bare
    /// table name (only checked when the name was given without a schema):
    /// the table an older pgwarden (or a mistyped configuration) would use.
    pub(crate) shadowed_by: Option<String>,
}

impl Shape {
    /// What differs from the shape pgwarden needs; empty when it fits.
    pub(crate) fn differences(&self, sequence: &str) -> Vec<String> {
        let mut out = Vec::new();
        match self.table_kind.as_deref() {
            None => out.push("the table does not exist".to_owned()),
            Some("r" | "p") => {}
            Some(kind) => out.push(format!("it is not a table (relkind {kind:?})")),
        }
        for (name, ty, nullable) in COLUMNS {
            match self.columns.iter().find(|c| c.name == *name) {
                None => out.push(format!("column {name} ({ty}) is missing")),
                Some(c) if c.type_name != *ty => {
                    out.push(format!("column {name} is {}, expected {ty}", c.type_name))
                }
                Some(c) if *nullable && c.not_null && !c.has_default => {
                    out.push(format!("column {name} is NOT NULL, it must allow NULL"))
                }
                Some(_) => {}
            }
        }
        if let Some(c) = self.columns.iter().find(|c| c.name == RENEWED_AT) {
            if c.type_name != RENEWED_AT_TYPE {
                out.push(format!(
                    "column {RENEWED_AT} is {}, expected {RENEWED_AT_TYPE}",
                    c.type_name
                ));
            } else if c.not_null && !c.has_default {
                out.push(format!(
                    "column {RENEWED_AT} is NOT NULL, it must allow NULL"
                ));
            }
        }
        for c in &self.columns {
            let ours = c.name == RENEWED_AT || COLUMNS.iter().any(|(n, _, _)| *n == c.name);
            if !ours && c.not_null && !c.has_default {
                out.push(format!(
                    "extra column {} is NOT NULL without a default: pgwarden's inserts would fail",
                    c.name
                ));
            }
        }
        if self.primary_key != ["name"] {
            if self.primary_key.is_empty() {
                out.push("there is no primary key (expected PRIMARY KEY (name))".to_owned());
            } else {
                out.push(format!(
                    "the primary key is ({}), expected (name)",
                    self.primary_key.join(", ")
                ));
            }
        }
        match (self.sequence_kind.as_deref(), self.sequence_type.as_deref()) {
            (None, _) => out.push(format!("the token sequence {sequence} does not exist")),
            (Some("S"), Some("bigint")) => {}
            (Some("S"), other) => out.push(format!(
                "the token sequence {sequence} is {}, expected bigint",
                other.unwrap_or("of an unknown type")
            )),
            (Some(kind), _) => out.push(format!("{sequence} is not a sequence (relkind {kind:?})")),
        }
        // Tokens must grow with every term: a sequence that can hand out a
        // smaller value later is refused, naming the setting to change.
        if let Some(cache) = self.sequence_cache.filter(|c| *c > 1) {
            out.push(format!(
                "the token sequence {sequence} has CACHE {cache}: each session draws from a cache of its own, \
                 so a later term can get a smaller token (ALTER SEQUENCE {sequence} CACHE 1)"
            ));
        }
        if let Some(inc) = self.sequence_increment.filter(|i| *i <= 0) {
            out.push(format!(
                "the token sequence {sequence} has INCREMENT {inc}: tokens must grow \
                 (ALTER SEQUENCE {sequence} INCREMENT BY 1)"
            ));
        }
        if self.sequence_cycle == Some(true) {
            out.push(format!(
                "the token sequence {sequence} has CYCLE: past its maximum it starts again from its minimum \
                 (ALTER SEQUENCE {sequence} NO CYCLE)"
            ));
        }
        if let Some((Some(max), last)) = self.tokens {
            if last.is_none_or(|l| l < max) {
                out.push(format!(
                    "the token sequence {sequence} is behind the table's tokens (its last value is {}, the table \
                     holds token {max}): a new term would draw a smaller token than an earlier one \
                     (SELECT setval('{sequence}', {max}))",
                    last.map_or("none yet".to_owned(), |l| l.to_string())
                ));
            }
        }
        if self.sequence_kind.is_some() && self.sequence_owned == Some(false) {
            out.push(format!(
                "the token sequence {sequence} is not owned by the table's token column \
                 (ALTER SEQUENCE … OWNED BY <table>.token, as in sql/leases.sql)"
            ));
        }
        if let Some(other) = &self.shadowed_by {
            out.push(format!(
                "this session's search_path finds another table of that name, {other}: \
                 a table name without a schema means public; name the table with its \
                 schema (LeasesBuilder::table) so that every instance uses the same one"
            ));
        }
        out
    }

    /// The DDL has something to create (it skips what exists).
    fn is_missing(&self) -> bool {
        self.table_kind.is_none() || self.sequence_kind.is_none()
    }

    /// The table has the [`RENEWED_AT`] column.
    pub(crate) fn has_stamp(&self) -> bool {
        self.columns.iter().any(|c| c.name == RENEWED_AT)
    }
}

impl Statements {
    /// Reads the shape of the table and its sequence from the catalog.
    pub(crate) async fn shape(
        &self,
        client: &impl Exec,
        bare: Option<&str>,
    ) -> Result<Shape, SqlError> {
        let (t, s) = (&self.table, &self.sequence);
        let rel = client
            .query(
                "SELECT (SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)),
                        (SELECT relkind::text FROM pg_class WHERE oid = to_regclass($2)),
                        (SELECT format_type(seqtypid, NULL) FROM pg_sequence WHERE seqrelid = to_regclass($2)),
                        (SELECT seqincrement FROM pg_sequence WHERE seqrelid = to_regclass($2)),
                        (SELECT seqcache FROM pg_sequence WHERE seqrelid = to_regclass($2)),
                        (SELECT seqcycle FROM pg_sequence WHERE seqrelid = to_regclass($2)),
                        coalesce((SELECT array_agg(a.attname::text ORDER BY k.ord)
                                    FROM pg_index i
                                   CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
                                    JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                                   WHERE i.indrelid = to_regclass($1) AND i.indisprimary), '{}'),
                        (SELECT coalesce(to_regclass(pg_get_serial_sequence($1, 'token')) = to_regclass($2), false)
                           FROM pg_attribute
                          WHERE attrelid = to_regclass($1) AND attname = 'token' AND NOT attisdropped),
                        (SELECT format('%I.%I', n.nspname, c.relname)
                           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                          WHERE c.oid = to_regclass($3) AND c.oid IS DISTINCT FROM to_regclass($1))",
                &[Param::Text(t), Param::Text(s), Param::OptText(bare)],
                Sent::Unnamed,
            )
            .await?;
        let columns = client
            .query(
                "SELECT attname::text, format_type(atttypid, atttypmod), attnotnull, atthasdef
                   FROM pg_attribute
                  WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped
                  ORDER BY attnum",
                &[Param::Text(t)],
                Sent::Unnamed,
            )
            .await?;
        let mut shape = Shape::default();
        if let Some(r) = rel.first() {
            shape.table_kind = r.col(0)?;
            shape.sequence_kind = r.col(1)?;
            shape.sequence_type = r.col(2)?;
            shape.sequence_increment = r.col(3)?;
            shape.sequence_cache = r.col(4)?;
            shape.sequence_cycle = r.col(5)?;
            shape.primary_key = r.col(6)?;
            shape.sequence_owned = r.col(7)?;
            shape.shadowed_by = r.col(8)?;
        }
        for r in &columns {
            shape.columns.push(Column {
                name: r.col(0)?,
                type_name: r.col(1)?,
                not_null: r.col(2)?,
                has_default: r.col(3)?,
            });
        }
        Ok(shape)
    }

    /// The table's largest token and its sequence's last value.
    async fn tokens(&self, client: &impl Exec) -> Result<(Option<i64>, Option<i64>), SqlError> {
        let text = format!(
            "SELECT (SELECT max(token) FROM {}), pg_sequence_last_value(to_regclass($1))",
            self.table
        );
        let rows = client
            .query(&text, &[Param::Text(&self.sequence)], Sent::Unnamed)
            .await?;
        match rows.first() {
            Some(row) => Ok((row.col(0)?, row.col(1)?)),
            None => Ok((None, None)),
        }
    }

    /// Runs `text` (simple statements) in a transaction holding the
    /// transaction-scoped advisory lock [`INSTALL_LOCK_KEY`], waiting up to
    /// `wait` for it.
    async fn under_install_lock(
        client: &mut impl Conn,
        wait: Duration,
        text: &str,
    ) -> Result<(), Error> {
        let tx = client.begin().await?;
        xact_lock_on(&tx, INSTALL_LOCK_KEY, LockMode::Exclusive, Some(wait)).await?;
        tx.batch(text).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Adds the [`RENEWED_AT`] column to a table made by an earlier
    /// pgwarden, inside a transaction holding [`INSTALL_LOCK_KEY`] (as the
    /// DDL does), waiting at most [`MIGRATE_LOCK_WAIT`] for the table's lock.
    async fn add_stamp(&self, client: &mut impl Conn, wait: Duration) -> Result<(), Error> {
        // `IF NOT EXISTS`: another instance may have added it while this
        // one waited for the install lock.
        let text = format!(
            "SET LOCAL lock_timeout = '{}ms'; ALTER TABLE {} ADD COLUMN IF NOT EXISTS {RENEWED_AT} timestamptz",
            lock_ms(MIGRATE_LOCK_WAIT),
            self.table
        );
        Self::under_install_lock(client, wait, &text).await
    }

    /// Creates the table and its sequence when either is missing, inside a
    /// transaction holding the transaction-scoped advisory lock
    /// [`INSTALL_LOCK_KEY`] (waiting up to `wait` for it); adds the
    /// [`RENEWED_AT`] column to a table made without it, when the role may
    /// (else says so and goes on without it); then checks the shape of what
    /// exists.
    pub(crate) async fn install(
        &self,
        client: &mut impl Conn,
        wait: Duration,
        table_name: &str,
        bare: Option<&str>,
    ) -> Result<Installed, Error> {
        let mut ran = false;
        let mut shape = self.shape(client, bare).await?;
        if shape.is_missing() {
            // `IF NOT EXISTS`: another instance may have created it while
            // this one waited for the lock.
            Self::under_install_lock(client, wait, &self.ddl).await?;
            ran = true;
            shape = self.shape(client, bare).await?;
        }
        let mut unstamped_why = None;
        if shape.table_kind.is_some() && !shape.has_stamp() {
            match self.add_stamp(client, wait).await {
                Ok(()) => shape = self.shape(client, bare).await?,
                // Not the owner, a read-only session, the table's lock busy
                // past the bound: leases work without it.
                Err(e) => unstamped_why = Some(e.to_string()),
            }
        }
        // Tokens are compared once the columns and the sequence fit.
        if shape.differences(&self.sequence).is_empty() {
            shape.tokens = Some(self.tokens(client).await?);
        }
        let differences = shape.differences(&self.sequence);
        if differences.is_empty() {
            Ok(Installed {
                ran,
                stamped: shape.has_stamp(),
                unstamped_why,
            })
        } else {
            Err(Error::Lease(LeaseError::TableMismatch {
                table: table_name.to_owned(),
                differences,
            }))
        }
    }
}

/// One row of the lease table, as [`Leases::rows`](super::Leases::rows)
/// reads it (all times from the database clock), or as it was just before
/// [`Leases::revoke`](super::Leases::revoke) ended its term.
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
    /// The term's TTL, exactly (`expires_at` minus when it was last set):
    /// `None` once released, and when the table or the row cannot tell (a
    /// table made by an earlier pgwarden whose role may not add the
    /// `renewed_at` column, or a term taken by such a pgwarden in a mixed
    /// fleet): then guess it, as `pgwarden check` does, from `taken_at` and
    /// the expiry.
    pub ttl: Option<Duration>,
    /// The backend holding a row lock on this row (a fenced transaction, a
    /// statement in flight), when one transaction holds it: the running
    /// transaction the row's `xmax` names. A take-over of an expired term
    /// is blocked while it lasts (it answers busy). `None` when the row is
    /// not locked, when several transactions share the lock, on a hot
    /// standby, and for a prepared (two-phase) transaction, which has no
    /// backend: then [`blocker_state`](Self::blocker_state) says
    /// `prepared transaction` and the application name is its `gid`.
    pub blocker_pid: Option<i32>,
    /// That backend's `application_name` (a prepared transaction's `gid`).
    pub blocker_application_name: Option<String>,
    /// That backend's state (`idle in transaction`…); `None` when the role
    /// reading may not see it (another role's session, without
    /// `pg_read_all_stats`).
    pub blocker_state: Option<String>,
    /// How long that backend has been in its state, when it can be seen.
    pub blocker_state_for: Option<Duration>,
}

/// Every row with the session holding a lock on it, read without locking
/// anything: a row's `xmax` names the transaction that locked (or is
/// updating) it when one transaction does, and every running transaction
/// holds an `ExclusiveLock` on its own id in `pg_locks`, which every role
/// can read. A stale `xmax` (a locker that has ended) matches no running
/// transaction; a MultiXactId (several lockers at once) is a number of
/// another counter, and could equal an unrelated transaction's id: a match
/// counts only when that transaction holds a lock on the lease table too.
/// A prepared (two-phase) transaction has no backend: its state says so,
/// with its `gid`. Works from a read-only session and on a hot standby
/// (where the primary's transactions are not in `pg_locks`: no blocker).
fn rows_sql(tbl: &str, stamped: bool) -> String {
    let ttl = ttl_sql("l", stamped);
    let regclass = quote_literal(tbl);
    // `pg_locks` and `pg_stat_activity` are read once each (materialized,
    // then hash-joined), not once per row: the table may hold a million
    // released rows.
    format!(
        "WITH x AS MATERIALIZED (
       SELECT k.pid, k.transactionid, k.virtualtransaction FROM pg_locks k
        WHERE k.locktype = 'transactionid' AND k.mode = 'ExclusiveLock' AND k.granted
          AND k.pid IS DISTINCT FROM pg_backend_pid()),
     t AS MATERIALIZED (
       SELECT DISTINCT k.virtualtransaction FROM pg_locks k
        WHERE k.locktype = 'relation' AND k.granted AND k.relation = {regclass}::regclass),
     b AS MATERIALIZED (
       SELECT x.pid, x.transactionid,
              (SELECT p.gid FROM pg_prepared_xacts p WHERE p.transaction = x.transactionid) AS prepared
         FROM x JOIN t ON t.virtualtransaction = x.virtualtransaction)
SELECT l.name, l.holder, l.token, extract(epoch FROM l.taken_at)::float8,
       (extract(epoch FROM l.expires_at) - extract(epoch FROM now()))::float8,
       l.holder <> '' AND l.expires_at >= now(),
       CASE WHEN l.held_until > '-infinity' THEN extract(epoch FROM l.held_until)::float8 END,
       l.prev_holder,
       b.pid,
       CASE WHEN b.prepared IS NOT NULL THEN b.prepared ELSE a.application_name END,
       CASE WHEN b.prepared IS NOT NULL THEN 'prepared transaction' ELSE a.state END,
       CASE WHEN a.state_change IS NOT NULL
            THEN greatest(extract(epoch FROM clock_timestamp() - a.state_change), 0)::float8 END,
       {ttl}
  FROM {tbl} l
  LEFT JOIN b ON b.transactionid = l.xmax
  LEFT JOIN pg_stat_activity a ON a.pid = b.pid
 ORDER BY l.name"
    )
}

/// A row's TTL in seconds (see [`RENEWED_AT`]), from alias `t`: the term's
/// expiry minus when it was last set, while the term is held and that stamp
/// is its own (not older than its `taken_at`: a term taken by an earlier
/// pgwarden keeps the stamp of the term before), and both are finite (a
/// row edited by hand must not fail the listing). NULL otherwise, and
/// always on a table without the column.
fn ttl_sql(t: &str, stamped: bool) -> String {
    if stamped {
        format!(
            "CASE WHEN {t}.holder <> '' AND {t}.{RENEWED_AT} >= {t}.taken_at \
                  AND isfinite({t}.{RENEWED_AT}) AND isfinite({t}.expires_at) \
             THEN extract(epoch FROM {t}.expires_at - {t}.{RENEWED_AT})::float8 END"
        )
    } else {
        "NULL::float8".to_owned()
    }
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

/// The column of a [`LeaseRow`]'s TTL in the listing's and the revoke's
/// rows (after the blocker's columns in the listing; the revoke returns
/// NULLs in their place).
const LEASE_ROW_TTL: usize = 12;

fn lease_row<R: Row>(r: &R) -> Result<LeaseRow, SqlError> {
    Ok(LeaseRow {
        name: r.col(0)?,
        holder: r.col(1)?,
        token: r.col(2)?,
        taken_at: from_epoch(r.col(3)?),
        expires_in_s: r.col(4)?,
        live: r.col(5)?,
        held_until: r.col::<Option<f64>>(6)?.map(from_epoch),
        prev_holder: r.col(7)?,
        ttl: r
            .col::<Option<f64>>(LEASE_ROW_TTL)?
            .and_then(|s| Duration::try_from_secs_f64(s).ok()),
        blocker_pid: None,
        blocker_application_name: None,
        blocker_state: None,
        blocker_state_for: None,
    })
}

/// A row of [`rows_sql`]: the lease columns, then its blocker's.
fn lease_row_blocked<R: Row>(r: &R) -> Result<LeaseRow, SqlError> {
    Ok(LeaseRow {
        blocker_pid: r.col(8)?,
        blocker_application_name: r.col(9)?,
        blocker_state: r.col(10)?,
        blocker_state_for: r
            .col::<Option<f64>>(11)?
            .map(|s| Duration::try_from_secs_f64(s).unwrap_or_default()),
        ..lease_row(r)?
    })
}

/// Every row, with its blocker (see [`rows_sql`]): one statement, no
/// transaction, no lock but the table's `ACCESS SHARE`.
pub(crate) struct ReadRows;

/// A statement timeout as a server-side `lock_timeout` in milliseconds
/// (at least 1: 0 would mean no bound).
pub(crate) fn wait_ms(timeout: Duration) -> i32 {
    i32::try_from(timeout.as_millis().clamp(1, i32::MAX as u128)).unwrap_or(i32::MAX)
}

impl LeaseStatement for ReadRows {
    type Out = Vec<LeaseRow>;
    const WHAT: &'static str = "listing";
    async fn exec<'a, C: Conn>(
        &'a self,
        sql: &'a Statements,
        client: &'a mut C,
        call: Call,
    ) -> Result<Self::Out, SqlError> {
        client
            .query(&rows_sql(&sql.table, call.stamped), &[], Sent::Unnamed)
            .await?
            .iter()
            .map(lease_row_blocked)
            .collect()
    }
}

/// Ends the term of `name`: the row is marked released (holder `''`,
/// expired now); returned as it was before.
pub(crate) struct Revoke<'a> {
    pub(crate) name: &'a str,
    pub(crate) wait_ms: i32,
}

fn revoke_sql(tbl: &str, stamped: bool) -> String {
    let (stamp, ttl) = if stamped {
        (format!(", {RENEWED_AT}"), ttl_sql("o", true))
    } else {
        (String::new(), ttl_sql("o", false))
    };
    // The row is locked `FOR NO KEY UPDATE` (as a renewal does), which a
    // fenced transaction's `FOR KEY SHARE` does not hold up; `$2` bounds
    // the wait for a statement in flight on it. The term's expiry is kept:
    // the name stays busy until the revoked holder, which learns of it at
    // its next renewal, must have stopped trusting it.
    format!(
        "WITH o AS (
  SELECT name, holder, token, taken_at, expires_at, held_until, prev_holder{stamp} FROM {tbl}
   WHERE set_config('lock_timeout', $2::int4::text, true) IS NOT NULL
     AND name = $1 AND holder <> ''
     FOR NO KEY UPDATE)
UPDATE {tbl} AS l SET holder = ''
  FROM o WHERE l.name = o.name
RETURNING o.name, o.holder, o.token, extract(epoch FROM o.taken_at)::float8,
       (extract(epoch FROM o.expires_at) - extract(epoch FROM now()))::float8, o.expires_at >= now(),
       CASE WHEN o.held_until > '-infinity' THEN extract(epoch FROM o.held_until)::float8 END,
       o.prev_holder, NULL::int4, NULL::text, NULL::text, NULL::float8, {ttl}"
    )
}

impl LeaseStatement for Revoke<'_> {
    type Out = Option<LeaseRow>;
    const WHAT: &'static str = "revocation";
    async fn exec<'a, C: Conn>(
        &'a self,
        sql: &'a Statements,
        client: &'a mut C,
        call: Call,
    ) -> Result<Self::Out, SqlError> {
        let rows = client
            .query(
                &revoke_sql(&sql.table, call.stamped),
                &[Param::Text(self.name), Param::Int4(self.wait_ms)],
                Sent::Unnamed,
            )
            .await?;
        rows.first().map(lease_row).transpose()
    }
}

/// A statement [`Inner::run`] can run: its text lives in [`Statements`].
pub(crate) trait LeaseStatement: Sync {
    type Out: Send;
    /// What it is, in errors and metrics: `acquisition`, `renewal`…
    const WHAT: &'static str;
    /// Runs it once on `client`, named (prepared, cached) or unnamed.
    fn exec<'a, C: Conn>(
        &'a self,
        sql: &'a Statements,
        client: &'a mut C,
        call: Call,
    ) -> impl Future<Output = Result<Self::Out, SqlError>> + Send + 'a;
    /// What the server ending one of its lock waits (`lock_timeout`) means
    /// for it: `None`, a [`LeaseError::Timeout`]; an acquisition's take-over
    /// answers busy instead.
    fn on_lock_timeout() -> Option<Self::Out> {
        None
    }
    /// It runs a transaction of its own: cut short, its connection is
    /// closed rather than returned (sqlx 0.8 leaves the server inside a
    /// transaction when its `begin` is cut short: see
    /// `crate::pool::Beginning`).
    const TRANSACTIONAL: bool = false;
    /// What getting no connection of the pool within the statement's
    /// budget (`waited`; the pool has `pool_size` at most) means for it:
    /// `None`, a [`LeaseError::Timeout`]; a statement whose caller holds a
    /// connection of the same pool says so, and what to do.
    fn no_connection(&self, waited: Duration, pool_size: usize) -> Option<LeaseError> {
        let _ = (waited, pool_size);
        None
    }
}

/// How one statement is sent.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Call {
    /// A named prepared statement (direct connections), or unnamed.
    pub(crate) named: bool,
    /// The table has the `renewed_at` column (see [`Stamped`]).
    pub(crate) stamped: bool,
}

impl Call {
    /// How the statement layer sends it.
    pub(crate) fn how(self) -> Sent {
        Sent::named(self.named)
    }
}

/// Implements [`LeaseStatement`] for `$ty`: `$out` from the `Statements`
/// call `$body` makes with the statement `$s`, the statements `$sql`, the
/// client `$c` and how it is sent, `$call`.
macro_rules! lease_statement {
    ($ty:ty, $out:ty, $what:literal, |$s:ident, $sql:ident, $c:ident, $call:ident| $body:expr
     $(, no_connection: |$ns:ident, $waited:ident, $size:ident| $none:expr)?) => {
        impl LeaseStatement for $ty {
            type Out = $out;
            const WHAT: &'static str = $what;
            fn exec<'a, C: Conn>(
                &'a self,
                $sql: &'a Statements,
                $c: &'a mut C,
                $call: Call,
            ) -> impl Future<Output = Result<Self::Out, SqlError>> + Send + 'a {
                let $s = self;
                $body
            }
            $(
                fn no_connection(&self, $waited: Duration, $size: usize) -> Option<LeaseError> {
                    let $ns = self;
                    Some($none)
                }
            )?
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
    async fn exec<C: Conn>(
        &self,
        sql: &Statements,
        c: &mut C,
        call: Call,
    ) -> Result<Result<Taken, Busy>, SqlError> {
        let taken = sql
            .acquire(c, call, self.name, self.holder, self.ttl, self.hold)
            .await?;
        Ok(taken.ok_or(Busy::Held))
    }
    fn on_lock_timeout() -> Option<Result<Taken, Busy>> {
        Some(Err(Busy::Blocked))
    }
}

/// The releases of a batch, as parallel arrays (distinct names).
#[derive(Default)]
pub(crate) struct ReleaseBatch {
    pub(crate) names: Vec<String>,
    pub(crate) holders: Vec<String>,
    /// The holders of those whose hold goes too.
    pub(crate) forget_hold: Vec<String>,
}

impl LeaseStatement for ReleaseBatch {
    /// The names released; `None` when the server ended a lock wait
    /// (`lock_timeout`): nothing was released, each is tried alone.
    type Out = Option<Vec<String>>;
    const WHAT: &'static str = "release";
    async fn exec<C: Conn>(
        &self,
        sql: &Statements,
        c: &mut C,
        call: Call,
    ) -> Result<Option<Vec<String>>, SqlError> {
        let rows = c
            .query(
                &sql.release_batch,
                &[
                    Param::Strings(&self.names),
                    Param::Strings(&self.holders),
                    Param::Strings(&self.forget_hold),
                ],
                call.how(),
            )
            .await?;
        rows.iter()
            .map(|r| r.col(0))
            .collect::<Result<_, SqlError>>()
            .map(Some)
    }
    fn on_lock_timeout() -> Option<Option<Vec<String>>> {
        Some(None)
    }
}

/// The acquisitions of a batch, as parallel arrays (distinct names, in
/// order); a hold of 0 with a period of 0 is no hold.
#[derive(Default)]
pub(crate) struct AcquireBatch {
    pub(crate) names: Vec<String>,
    pub(crate) holders: Vec<String>,
    pub(crate) ttls: Vec<f64>,
    pub(crate) leasts: Vec<f64>,
    pub(crate) periods: Vec<f64>,
}

impl LeaseStatement for AcquireBatch {
    /// The terms taken, by name; `None` when the server ended a lock wait
    /// (`lock_timeout`): nothing was taken, each acquisition is tried alone.
    type Out = Option<Vec<(String, Taken)>>;
    const WHAT: &'static str = "acquisition";
    async fn exec<C: Conn>(
        &self,
        sql: &Statements,
        c: &mut C,
        call: Call,
    ) -> Result<Option<Vec<(String, Taken)>>, SqlError> {
        sql.acquire_batch(c, call, self).await.map(Some)
    }
    fn on_lock_timeout() -> Option<Option<Vec<(String, Taken)>>> {
        Some(None)
    }
}

/// Seconds until a held name may be free.
pub(crate) struct FreeIn<'a> {
    pub(crate) name: &'a str,
}

lease_statement!(FreeIn<'_>, Option<f64>, "busy check", |s, sql, c, call| sql
    .free_in(c, call, s.name));

/// The session holding a lock on a name's row (a blocked take-over's log).
pub(crate) struct Blocker<'a> {
    pub(crate) name: &'a str,
}

lease_statement!(
    Blocker<'_>,
    Option<RowLocker>,
    "busy check",
    |s, sql, c, call| sql.blocker(c, call, s.name)
);

/// What kept a fence waiting: a lock on the lease table, else on the row
/// (see [`Statements::fence_blocker`]).
pub(crate) struct FenceBlocker<'a> {
    pub(crate) name: &'a str,
}

lease_statement!(
    FenceBlocker<'_>,
    Option<FenceBlock>,
    "busy check",
    |s, sql, c, call| sql.fence_blocker(c, call, s.name)
);

/// A name's term as the database has it now (see [`Statements::term_now`]).
pub(crate) struct TermNow<'a> {
    pub(crate) name: &'a str,
}

lease_statement!(
    TermNow<'_>,
    Option<DbTerm>,
    "busy check",
    |s, sql, c, call| sql.term_now(c, call, s.name),
    // The fenced transaction holds a connection of the same pool.
    no_connection: |s, waited, pool_size| LeaseError::FenceNoConnection {
        name: s.name.to_owned(),
        waited,
        pool_size,
    }
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
    |s, sql, c, call| sql.renew(c, call, &s.names, &s.holders, &s.tokens, &s.ttls)
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
    call,
    s.name,
    s.holder,
    s.keep_hold
));

/// The current terms of some names: `(name, holder, token)`.
pub(crate) struct Terms<'a> {
    pub(crate) names: Vec<&'a str>,
}

lease_statement!(
    Terms<'_>,
    Vec<(String, String, i64)>,
    "renewal",
    |s, sql, c, call| async move {
        let rows = c
            .query(&sql.terms, &[Param::Texts(&s.names)], call.how())
            .await?;
        rows.iter()
            .map(|r| Ok((r.col(0)?, r.col(1)?, r.col(2)?)))
            .collect()
    }
);

/// A purge round's mark.
pub(crate) struct PurgeMarkStmt;

lease_statement!(PurgeMarkStmt, PurgeMark, "purge", |_s, sql, c, call| sql
    .purge_mark(c, call));

/// One sweep statement of a purge round.
pub(crate) struct PurgeSweep<'a> {
    pub(crate) mark: &'a PurgeMark,
    pub(crate) age: Duration,
    pub(crate) limit: i64,
}

lease_statement!(PurgeSweep<'_>, Option<u64>, "purge", |s, sql, c, call| sql
    .purge_sweep(c, call, s.mark, s.age, s.limit));

/// What an install did and found.
#[derive(Clone, Debug)]
pub(crate) struct Installed {
    /// It ran the DDL.
    pub(crate) ran: bool,
    /// The table has the [`RENEWED_AT`] column.
    pub(crate) stamped: bool,
    /// Why the column could not be added, when it was tried and failed.
    pub(crate) unstamped_why: Option<String>,
}

/// Create the table if missing, then check its shape.
pub(crate) struct Install<'a> {
    pub(crate) wait: Duration,
    pub(crate) table: &'a str,
    /// The bare table name, when it was given without a schema.
    pub(crate) bare: Option<&'a str>,
}

impl LeaseStatement for Install<'_> {
    type Out = Result<Installed, crate::error::Error>;
    const WHAT: &'static str = "install";
    const TRANSACTIONAL: bool = true;
    // Not `async fn`: the future's `Send` must be stated here (proven from
    // the bounds, not inferred through higher-ranked lifetimes, which
    // the compiler cannot for the service example's handler).
    #[allow(clippy::manual_async_fn)]
    fn exec<'a, C: Conn>(
        &'a self,
        sql: &'a Statements,
        c: &'a mut C,
        _call: Call,
    ) -> impl Future<Output = Result<Self::Out, SqlError>> + Send + 'a {
        async move { Ok(sql.install(c, self.wait, self.table, self.bare).await) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::InvalidInput;

    #[test]
    fn the_table_name_is_the_only_splice() {
        let s = Statements::new(
            &TableName::parse("app.leases").unwrap(),
            Duration::from_secs(10),
        );
        for text in [
            &s.acquire.stamped,
            &s.acquire_held.stamped,
            &s.acquire.legacy,
            &s.acquire_held.legacy,
            &s.free_in,
            &s.renew.stamped,
            &s.renew.legacy,
            &s.release,
            &s.release_unheld,
            &s.fence,
            &s.blocker,
            &s.purge_sweep.stamped,
            &s.purge_sweep.legacy,
        ] {
            assert!(text.contains(r#""app"."leases""#), "{text}");
            assert!(!text.contains("pgwarden_leases"));
            // No statement waits on an advisory lock (another session could
            // keep a name busy with one). The fence alone takes one: its
            // mark, shared and tried (never waited on), in pgwarden's
            // namespace, read by a blocked take-over.
            let advisory: Vec<&str> = text.matches("advisory").collect();
            if std::ptr::eq(text, &s.fence) {
                assert_eq!(advisory.len(), 1, "{text}");
                assert!(text.contains("pg_try_advisory_xact_lock_shared(1885828964, b.mark)"));
            } else {
                assert!(advisory.is_empty(), "{text}");
            }
        }
        assert!(s
            .acquire
            .stamped
            .contains(r#"nextval('"app"."leases_token_seq"')"#));
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
            .legacy
            .contains(r#"nextval('"public"."pgwarden_leases_token_seq"')"#));
    }

    /// `benches/profile/server.sh` profiles copies of the acquisition's
    /// and the release's texts (on the default table, with the default
    /// statement timeout): they must stay the ones shipped.
    #[test]
    fn the_profiled_texts_are_the_shipped_ones() {
        let s = Statements::new(
            &TableName::default(),
            crate::lease::options::DEFAULT_STATEMENT_TIMEOUT,
        );
        let words = |t: &str| t.split_whitespace().collect::<Vec<_>>().join(" ");
        let profiled = [
            include_str!("../../benches/profile/stmts/acquire.sql"),
            include_str!("../../benches/profile/stmts/release.sql"),
        ];
        assert_eq!(words(&s.acquire.stamped), words(profiled[0]));
        assert_eq!(words(&s.release), words(profiled[1]));
    }

    #[test]
    fn lock_waits_are_bounded_by_constants() {
        let s = Statements::new(&TableName::default(), Duration::from_millis(1500));
        for text in [&s.acquire.stamped, &s.acquire_held.legacy] {
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
        for text in [&s.renew.stamped, &s.release, &s.release_unheld] {
            assert!(
                text.contains("set_config('lock_timeout', '1500', true)"),
                "{text}"
            );
        }
        for text in [
            &s.free_in,
            &s.purge_mark,
            &s.purge_sweep.stamped,
            &s.purge_sweep.legacy,
            &s.blocker,
            &s.table_blocker,
        ] {
            assert!(!text.contains("set_config"), "{text}");
        }
        // A statement timeout under the take-over bound bounds it too.
        let short = Statements::new(&TableName::default(), Duration::from_millis(7));
        assert!(short
            .acquire
            .stamped
            .contains("CASE WHEN s.live IS NULL THEN '7' ELSE '7' END"));
        assert!(s.fence.contains("idle_in_transaction_session_timeout"));
        assert!(s.fence.contains("'statement_timeout'"));
        assert!(!s.acquire.legacy.contains("held_until)\nSELECT"));
        assert!(s.acquire_held.legacy.contains("held_until)\nSELECT"));
        assert!(s
            .acquire_held
            .stamped
            .contains("held_until, renewed_at)\nSELECT"));
    }

    #[test]
    fn every_statement_that_sets_an_expiry_stamps_it_unless_the_table_cannot() {
        let s = Statements::new(&TableName::default(), Duration::from_secs(10));
        for v in [&s.acquire, &s.acquire_held, &s.acquire_batch, &s.renew] {
            assert!(!v.legacy.contains(RENEWED_AT), "{}", v.legacy);
            assert!(!v.stamped.contains("{stamp"), "{}", v.stamped);
            assert!(!v.legacy.contains("{stamp"), "{}", v.legacy);
            // The expiry and the stamp come from the same `now()`.
            assert!(
                v.stamped.contains("renewed_at = now()") || v.stamped.contains(", now()\n"),
                "{}",
                v.stamped
            );
        }
        for v in [&s.acquire, &s.acquire_held, &s.acquire_batch] {
            // A take-over stamps the row too (the previous term's stamp
            // would be older than the new `taken_at` anyway).
            assert!(
                v.stamped
                    .contains("prev_holder = l.holder, renewed_at = now()"),
                "{}",
                v.stamped
            );
            assert!(
                v.stamped.contains("expires_at, held_until, renewed_at)")
                    || v.stamped.contains("expires_at, renewed_at)"),
                "{}",
                v.stamped
            );
        }
        // Nothing else sets an expiry while a term is held.
        for text in [&s.release, &s.release_unheld, &s.release_batch] {
            assert!(text.contains("holder = ''"), "{text}");
        }
        assert!(rows_sql("t", true).contains("l.expires_at - l.renewed_at"));
        assert!(!rows_sql("t", false).contains(RENEWED_AT));
        assert!(revoke_sql("t", true).contains("o.expires_at - o.renewed_at"));
        assert!(!revoke_sql("t", false).contains(RENEWED_AT));
    }

    #[test]
    fn accepts_plain_and_schema_qualified_names() {
        let t = TableName::parse("leases").unwrap();
        assert_eq!(t.quoted(), r#""public"."leases""#);
        assert_eq!(t.sequence_quoted(), r#""public"."leases_token_seq""#);
        assert_eq!(t.to_string(), "public.leases");
        assert_eq!(t.unqualified_if_defaulted().as_deref(), Some(r#""leases""#));
        let t = TableName::parse("app.Job_Leases2").unwrap();
        assert_eq!(t.quoted(), r#""app"."Job_Leases2""#);
        assert_eq!(t.sequence_literal(), r#"'"app"."Job_Leases2_token_seq"'"#);
        assert_eq!(t.to_string(), "app.Job_Leases2");
        assert_eq!(t.unqualified_if_defaulted(), None);
        let t = TableName::parse("user").unwrap();
        assert_eq!(t.quoted(), r#""public"."user""#);
        assert_eq!(
            TableName::default().quoted(),
            r#""public"."pgwarden_leases""#
        );
    }

    #[test]
    fn refuses_quotes_spaces_dots_and_nul() {
        for bad in [
            "",
            ".",
            "app.",
            ".leases",
            "a.b.c",
            "lea ses",
            "leases\"; DROP TABLE x; --",
            "lea'ses",
            "lea\0ses",
            "1leases",
            "app.1leases",
            "lé",
            "leases;",
            "\"leases\"",
        ] {
            let e = TableName::parse(bad).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Invalid(InvalidInput::Name {
                        what: "lease table name",
                        ..
                    })
                ),
                "{bad:?}: {e}"
            );
        }
        assert!(TableName::parse(&"t".repeat(MAX_TABLE_LEN)).is_ok());
        assert!(TableName::parse(&"t".repeat(MAX_TABLE_LEN + 1)).is_err());
        assert!(TableName::parse(&format!("{}.t", "s".repeat(MAX_SCHEMA_LEN))).is_ok());
        assert!(TableName::parse(&format!("{}.t", "s".repeat(MAX_SCHEMA_LEN + 1))).is_err());
    }

    #[test]
    fn quoting_doubles_quotes() {
        assert_eq!(quote_ident(r#"a"b"#), r#""a""b""#);
        assert_eq!(quote_literal("a'b"), "'a''b'");
    }

    #[test]
    fn ddl_is_the_shipped_file_with_the_names_replaced() {
        assert_eq!(TableName::default().ddl(), DDL_TEMPLATE);
        let ddl = TableName::parse("app.leases").unwrap().ddl();
        assert!(ddl.contains(
            r#"CREATE SEQUENCE IF NOT EXISTS "app"."leases_token_seq" AS bigint CACHE 1;"#
        ));
        assert!(ddl.contains(r#"CREATE TABLE IF NOT EXISTS "app"."leases" ("#));
        assert!(ddl
            .contains(r#"ALTER SEQUENCE "app"."leases_token_seq" OWNED BY "app"."leases".token;"#));
        assert!(!ddl.contains("\"pgwarden_leases"));
    }

    fn good() -> Shape {
        Shape {
            table_kind: Some("r".into()),
            columns: COLUMNS
                .iter()
                .map(|(n, t, nullable)| Column {
                    name: (*n).into(),
                    type_name: (*t).into(),
                    not_null: !nullable,
                    has_default: false,
                })
                .collect(),
            primary_key: vec!["name".into()],
            sequence_kind: Some("S".into()),
            sequence_type: Some("bigint".into()),
            sequence_increment: Some(1),
            sequence_cache: Some(1),
            sequence_cycle: Some(false),
            tokens: Some((Some(7), Some(9))),
            sequence_owned: Some(true),
            shadowed_by: None,
        }
    }

    #[test]
    fn a_sequence_that_can_go_backwards_is_refused_naming_the_setting() {
        let mut s = good();
        s.sequence_cache = Some(20);
        s.sequence_increment = Some(-1);
        s.sequence_cycle = Some(true);
        let all = s.differences("seq").join("\n");
        for want in [
            "has CACHE 20",
            "ALTER SEQUENCE seq CACHE 1",
            "has INCREMENT -1",
            "ALTER SEQUENCE seq INCREMENT BY 1",
            "has CYCLE",
            "ALTER SEQUENCE seq NO CYCLE",
        ] {
            assert!(all.contains(want), "{want:?} not in:\n{all}");
        }
        let mut ok = good();
        ok.sequence_increment = Some(3);
        assert!(ok.differences("seq").is_empty());
        let mut behind = good();
        behind.tokens = Some((Some(1_000_000), Some(1)));
        let all = behind.differences("seq").join("\n");
        assert!(
            all.contains(
                "is behind the table's tokens (its last value is 1, the table holds token 1000000)"
            ),
            "{all}"
        );
        assert!(all.contains("SELECT setval('seq', 1000000)"), "{all}");
        behind.tokens = Some((Some(3), None));
        assert!(behind
            .differences("seq")
            .join("\n")
            .contains("its last value is none yet"));
        behind.tokens = Some((None, None));
        assert!(behind.differences("seq").is_empty());
    }

    #[test]
    fn renewed_at_may_be_missing_but_not_of_another_type() {
        let mut s = good();
        assert!(!s.has_stamp());
        assert!(s.differences("s").is_empty());
        s.columns.push(Column {
            name: RENEWED_AT.into(),
            type_name: "timestamp with time zone".into(),
            not_null: false,
            has_default: false,
        });
        assert!(s.has_stamp());
        assert!(s.differences("s").is_empty());
        s.columns.last_mut().unwrap().type_name = "interval".into();
        let all = s.differences("s").join("\n");
        assert!(
            all.contains("column renewed_at is interval, expected timestamp with time zone"),
            "{all}"
        );
        s.columns.last_mut().unwrap().type_name = "timestamp with time zone".into();
        s.columns.last_mut().unwrap().not_null = true;
        let all = s.differences("s").join("\n");
        assert!(
            all.contains("column renewed_at is NOT NULL, it must allow NULL"),
            "{all}"
        );
    }

    #[test]
    fn the_shipped_shape_fits() {
        assert_eq!(good().differences("s"), Vec::<String>::new());
        let mut extra = good();
        extra.columns.push(Column {
            name: "note".into(),
            type_name: "text".into(),
            not_null: false,
            has_default: false,
        });
        assert!(extra.differences("s").is_empty());
    }

    #[test]
    fn every_difference_is_named() {
        let mut s = good();
        s.columns[2].type_name = "integer".into();
        s.columns.retain(|c| c.name != "held_until");
        s.columns[5].not_null = true; // prev_holder
        s.columns.push(Column {
            name: "owner".into(),
            type_name: "text".into(),
            not_null: true,
            has_default: false,
        });
        s.primary_key = vec!["name".into(), "holder".into()];
        s.sequence_type = Some("integer".into());
        let d = s.differences(r#""leases_token_seq""#);
        let all = d.join("\n");
        for want in [
            "column token is integer, expected bigint",
            "column held_until (timestamp with time zone) is missing",
            "column prev_holder is NOT NULL, it must allow NULL",
            "extra column owner is NOT NULL without a default",
            "the primary key is (name, holder), expected (name)",
            r#"the token sequence "leases_token_seq" is integer, expected bigint"#,
        ] {
            assert!(all.contains(want), "{want:?} not in:\n{all}");
        }
        assert_eq!(d.len(), 6, "{all}");
        let mut other = good();
        other.sequence_owned = Some(false);
        other.shadowed_by = Some("app.pgwarden_leases".into());
        let all = other.differences("seq").join("\n");
        assert!(
            all.contains("seq is not owned by the table's token column"),
            "{all}"
        );
        assert!(
            all.contains("finds another table of that name, app.pgwarden_leases"),
            "{all}"
        );
        let mut none = good();
        none.primary_key.clear();
        none.sequence_kind = None;
        none.table_kind = Some("v".into());
        let all = none.differences("seq").join("\n");
        assert!(all.contains("there is no primary key"), "{all}");
        assert!(
            all.contains("the token sequence seq does not exist"),
            "{all}"
        );
        assert!(all.contains("it is not a table"), "{all}");
    }

    #[test]
    fn the_listing_locks_nothing_and_the_revoke_does_not_wait_on_a_fence() {
        let rows = rows_sql(r#""app"."leases""#, true);
        assert!(!rows.contains("FOR "), "{rows}");
        assert!(!rows.contains("set_config"), "{rows}");
        assert!(rows.contains("b.transactionid = l.xmax"), "{rows}");
        assert!(
            rows.contains(r#"k.relation = '"app"."leases"'::regclass"#),
            "{rows}"
        );
        assert!(rows.contains(r#"FROM "app"."leases" l"#), "{rows}");
        let revoke = revoke_sql(r#""app"."leases""#, true);
        // FOR NO KEY UPDATE does not conflict with a fence's FOR KEY SHARE;
        // FOR UPDATE would.
        assert!(revoke.contains("FOR NO KEY UPDATE"), "{revoke}");
        assert!(!revoke.contains("FOR UPDATE"), "{revoke}");
        let bound = revoke.find("set_config('lock_timeout'").unwrap();
        assert!(bound < revoke.find("FOR NO KEY UPDATE").unwrap());
        // Only the term's holder changes: the key, the token and the expiry
        // stay (the name is busy until the revoked holder must have stopped).
        assert!(revoke.contains("SET holder = ''\n  FROM o"), "{revoke}");
    }

    #[test]
    fn epoch_seconds_become_times_without_panicking() {
        assert_eq!(from_epoch(1.5), UNIX_EPOCH + Duration::from_millis(1500));
        assert_eq!(from_epoch(-2.0), UNIX_EPOCH - Duration::from_secs(2));
        assert_eq!(from_epoch(f64::INFINITY), UNIX_EPOCH);
        assert_eq!(from_epoch(f64::NAN), UNIX_EPOCH);
    }
}
