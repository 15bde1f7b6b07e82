//! The part of a session lock that never lets a connection go back to the
//! pool still holding a lock: [`Held`] owns the connection from before the
//! lock statement goes out until the release is confirmed, and on drop hands
//! it to a spawned task that unlocks or closes it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::pooled::{self, Act};
use super::{LockKey, LockMode};
use crate::admission::{Lane, Priority};
use crate::error::{Error, LockError};
use crate::pool::{Client, Shared, Source};
use crate::stmt::{Exec, Param, Row, Sent};

/// Per-pool tallies of the lock machinery, in the pool's extension slot.
#[derive(Debug, Default)]
pub(crate) struct LockState {
    /// Session-lock levels held through guards (re-entries count).
    levels: AtomicUsize,
    /// Connections pinned by session-lock guards (held or being released).
    conns: AtomicUsize,
}

impl LockState {
    /// (levels, connections) held now.
    pub(crate) fn held(&self) -> (usize, usize) {
        (
            self.levels.load(Ordering::Acquire),
            self.conns.load(Ordering::Acquire),
        )
    }
}

/// Counts one pinned connection and its levels in the gauges, until dropped.
pub(crate) struct Tally<B: Source> {
    shared: Arc<Shared<B>>,
    state: Arc<LockState>,
    levels: usize,
}

impl<B: Source> Tally<B> {
    pub(crate) fn pin(shared: &Arc<Shared<B>>) -> Tally<B> {
        let state = shared.ext.get::<LockState>();
        state.conns.fetch_add(1, Ordering::AcqRel);
        let mut t = Tally {
            shared: shared.clone(),
            state,
            levels: 0,
        };
        t.add_level();
        t
    }

    pub(crate) fn add_level(&mut self) {
        self.levels += 1;
        self.state.levels.fetch_add(1, Ordering::AcqRel);
        self.publish();
    }

    pub(crate) fn remove_level(&mut self) {
        if self.levels > 0 {
            self.levels -= 1;
            self.state.levels.fetch_sub(1, Ordering::AcqRel);
            self.publish();
        }
    }

    fn publish(&self) {
        let (levels, conns) = self.state.held();
        self.shared.metrics.session_locks_held.set(levels as f64);
        self.shared
            .metrics
            .session_lock_connections
            .set(conns as f64);
    }
}

impl<B: Source> Drop for Tally<B> {
    fn drop(&mut self) {
        self.state.levels.fetch_sub(self.levels, Ordering::AcqRel);
        self.state.conns.fetch_sub(1, Ordering::AcqRel);
        self.publish();
    }
}

/// A session-lock connection and what it may hold.
pub(crate) struct Held<B: Source> {
    conn: Option<Client<B>>,
    pub(crate) key: LockKey,
    pub(crate) mode: LockMode,
    /// The session may hold an advisory lock not yet confirmed released.
    dirty: bool,
    /// The backend the lock was granted on, once known: every later
    /// statement of the guard acts only there ([`super::pooled`]).
    lock_pid: Option<i32>,
    tally: Option<Tally<B>>,
    unlock_timeout: Duration,
}

impl<B: Source> Held<B> {
    pub(crate) fn new(
        conn: Client<B>,
        key: LockKey,
        mode: LockMode,
        unlock_timeout: Duration,
    ) -> Held<B> {
        Held {
            conn: Some(conn),
            key,
            mode,
            dirty: false,
            lock_pid: None,
            tally: None,
            unlock_timeout,
        }
    }

    pub(crate) fn conn(&self) -> &Client<B> {
        // infallible: `conn` is Some until drop.
        self.conn.as_ref().expect("connection present until drop") // infallible
    }

    /// The connection, for statements (a sqlx connection executes on `&mut`).
    pub(crate) fn conn_mut(&mut self) -> &mut Client<B> {
        // infallible: `conn` is Some until drop.
        self.conn.as_mut().expect("connection present until drop") // infallible
    }

    /// A lock statement is about to go out.
    pub(crate) fn set_dirty(&mut self) {
        self.dirty = true;
    }

    /// Confirmed: the session holds no lock of this guard's.
    pub(crate) fn released(&mut self) {
        self.dirty = false;
    }

    pub(crate) fn set_tally(&mut self, tally: Tally<B>) {
        self.tally = Some(tally);
    }

    pub(crate) fn tally_mut(&mut self) -> &mut Tally<B> {
        // infallible: a SessionLock is built with its tally set.
        self.tally.as_mut().expect("tally set at acquisition") // infallible
    }

    /// The lock was granted on backend `pid`.
    pub(crate) fn granted_on(&mut self, pid: i32) {
        self.lock_pid = Some(pid);
    }

    /// `act` on the lock's backend: PostgreSQL's answer (for an unlock,
    /// false: not held). A statement that a pooler ran on another backend
    /// did nothing there; it is [`LockError::MovedByPooler`](crate::LockError::MovedByPooler), after an unlock
    /// has tried to reach the lock's backend ([`pooled::reach`]).
    pub(crate) async fn on_lock_backend(&mut self, act: Act) -> Result<bool, Error> {
        // infallible: set at the grant (`granted_on`), before the guard that
        // calls this exists.
        let held_on = self.lock_pid.expect("lock pid set at the grant"); // infallible
        let (key, mode, bound) = (self.key, self.mode, self.explicit_bound());
        let conn = self.conn_mut().exec();
        let (ran_on, answer) = pooled::on_backend(&conn, held_on, act, key, mode).await?;
        if let Some(answer) = answer {
            return Ok(answer);
        }
        if matches!(act, Act::Relock) {
            // Nothing taken anywhere; the lock stays where it was.
            return Err(Error::Lock(LockError::MovedByPooler {
                key,
                held_on,
                ran_on,
                released: false,
            }));
        }
        // Half the bound, as on the drop path: `unlock()`'s timeout around
        // this (the whole bound) must not cut the report off.
        let released =
            pooled::reach(&conn, None::<&B::Exec<'_>>, held_on, key, mode, bound / 2).await;
        drop(conn);
        // Whatever happened, an unlock on this connection's session now would
        // release other clients' locks, not this guard's.
        self.released();
        Err(if released {
            Error::Lock(LockError::MovedByPooler {
                key: self.key,
                held_on,
                ran_on,
                released,
            })
        } else {
            pooled::stranded(self.key, held_on, ran_on)
        })
    }

    /// The bound of a release its caller waits for (`unlock()`): the
    /// pool's unlock timeout, at least [`super::EXPLICIT_UNLOCK_FLOOR`]. The
    /// drop path's is the unlock timeout itself.
    pub(crate) fn explicit_bound(&self) -> Duration {
        super::explicit_unlock_bound(self.unlock_timeout)
    }

    /// An unlock that got no answer within its bound ([`Held::explicit_bound`]): now, what
    /// the drop path does then (its statement cancelled, the connection
    /// closed, never returned to the pool, its slot and budget freed), and
    /// the error that says so. The guard holds nothing afterwards.
    pub(crate) fn abandon(&mut self) -> Error {
        let (key, bound) = (self.key, self.explicit_bound());
        if let Some(conn) = self.conn.take() {
            let pid = conn.pid();
            tracing::warn!(%key, pid, ?bound, "session lock unlock not confirmed in time: closing its connection");
            cancel_in_flight(&conn, self.lock_pid.unwrap_or(pid), bound);
            conn.discard();
        }
        self.tally = None;
        self.dirty = false;
        Error::Lock(LockError::UnlockNotConfirmed {
            key,
            timeout: bound,
        })
    }

    /// The release after which the connection goes back to the pool
    /// (`act`: [`Act::UnlockLast`] or [`Act::UnlockAll`]), under the one
    /// rule of both release paths ([`release_once_more_if_stale`]).
    /// Confirmed, the guard holds nothing: PostgreSQL's answer (for
    /// `UnlockLast`, false: the lock was not the session's).
    pub(crate) async fn release(&mut self, act: Act) -> Result<bool, Error> {
        let key = self.key;
        let answer = release_once_more_if_stale(self, key, act).await?;
        if answer {
            self.released();
        }
        Ok(answer)
    }
}

/// One attempt of a release after which the connection goes back to the
/// pool: [`Held::on_lock_backend`] for `unlock()`, [`unlock_all_once`] for
/// the drop path.
trait Release {
    /// `act` once: PostgreSQL's answer (`UnlockAll` answers true).
    fn once(&mut self, act: Act) -> impl std::future::Future<Output = Result<bool, Error>> + Send;
}

impl<B: Source> Release for Held<B> {
    fn once(&mut self, act: Act) -> impl std::future::Future<Output = Result<bool, Error>> + Send {
        self.on_lock_backend(act)
    }
}

/// The drop path's connection and what it knows of the lock.
struct Dropped<'c, B: Source> {
    conn: &'c mut Client<B>,
    key: LockKey,
    mode: LockMode,
    lock_pid: Option<i32>,
    bound: Duration,
}

impl<B: Source> Release for Dropped<'_, B> {
    /// `act` is always [`Act::UnlockAll`] here: the drop path knows no
    /// depth, and its one statement is the unlock-all.
    fn once(&mut self, act: Act) -> impl std::future::Future<Output = Result<bool, Error>> + Send {
        let _ = act;
        let (key, mode, lock_pid, bound) = (self.key, self.mode, self.lock_pid, self.bound);
        async move {
            unlock_all_once(self.conn, key, mode, lock_pid, bound).await?;
            Ok(true)
        }
    }
}

/// The rule of both release paths (`unlock()`'s last statement and the
/// drop path's): a database error may be an earlier statement's
/// ([`stale`]); then `pg_advisory_unlock_all()` is sent once more (what
/// the drop path sends: idempotent, and it releases the guard's lock
/// whether or not the first attempt ran). A second error is the answer.
async fn release_once_more_if_stale(
    r: &mut impl Release,
    key: LockKey,
    act: Act,
) -> Result<bool, Error> {
    match r.once(act).await {
        Err(e) if stale(&e, key) => r.once(Act::UnlockAll).await,
        done => done,
    }
}

impl<B: Source> Drop for Held<B> {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else { return };
        let tally = self.tally.take();
        if !self.dirty {
            conn.set_note(None);
            drop(tally);
            drop(conn);
            return;
        }
        let (key, mode, lock_pid, bound) =
            (self.key, self.mode, self.lock_pid, self.unlock_timeout);
        if bound.is_zero() && tokio::runtime::Handle::try_current().is_ok() {
            // Zero: closed at once, no unlock tried (an unlock answered
            // before a zero timer's first tick would keep it otherwise).
            tracing::debug!(%key, "session lock dropped with a zero unlock timeout: closing its connection");
            cancel_in_flight(&conn, lock_pid.unwrap_or(conn.pid()), self.explicit_bound());
            conn.discard();
            drop(tally);
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                // Its slot frees when the unlock below is done: a session
                // lock asked for meanwhile waits for it instead of being
                // refused because of it.
                conn.mark_releasing();
                let mut guard = DiscardOnDrop(Some(conn));
                rt.spawn(async move {
                    release(&mut guard, key, mode, lock_pid, bound).await;
                    drop(tally);
                });
            }
            // No runtime to unlock on: close the connection.
            Err(_) => {
                tracing::warn!(%key, "session lock dropped outside a tokio runtime: closing its connection");
                drop(DiscardOnDrop(Some(conn)));
                drop(tally);
            }
        }
    }
}

/// Closes its connection when dropped, unless [`DiscardOnDrop::keep`] took it
/// back: a release task dropped unfinished (runtime shutting down) closes the
/// connection rather than returning it.
struct DiscardOnDrop<B: Source>(Option<Client<B>>);

impl<B: Source> DiscardOnDrop<B> {
    fn keep(&mut self) -> Option<Client<B>> {
        self.0.take()
    }
}

impl<B: Source> Drop for DiscardOnDrop<B> {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            conn.discard();
        }
    }
}

/// Whether the database error `e` of an unlock-all may be an earlier
/// statement's, which makes the unlock worth sending once more. On sqlx a
/// statement cut off in flight (the guard dropped while its lock waited)
/// reports its own error, say the lock timeout that ended the wait, at the
/// connection's next statement, before sending that one (sqlx's
/// `wait_until_ready`): the unlock was not run, and the next answer is its
/// own. On deadpool the first answer is the unlock's own already; an
/// unlock-all is idempotent, and one failing twice is an error.
fn stale(e: &Error, key: LockKey) -> bool {
    let Some(code) = e.sqlstate() else {
        return false;
    };
    tracing::debug!(%key, code, error = %e, "unlock answered with an error, maybe an earlier statement's: sent once more");
    true
}

/// `pg_advisory_unlock_all()` on the guard's connection: on the lock's
/// backend only, once that is known (a lock statement cut off in flight
/// leaves it unknown: then on whatever session the connection has).
async fn unlock_all_once<B: Source>(
    conn: &mut Client<B>,
    key: LockKey,
    mode: LockMode,
    lock_pid: Option<i32>,
    bound: Duration,
) -> Result<(), Error> {
    let conn = conn.exec();
    let Some(held_on) = lock_pid else {
        conn.query_one_after_rollback("SELECT pg_catalog.pg_advisory_unlock_all()::text = ''")
            .await?;
        return Ok(());
    };
    let (ran_on, done) = pooled::on_backend(&conn, held_on, Act::UnlockAll, key, mode).await?;
    // Half the bound: the caller's timeout around this must not cut the report off.
    let one = None::<&B::Exec<'_>>;
    if done.is_none() && !pooled::reach(&conn, one, held_on, key, mode, bound / 2).await {
        return Err(pooled::stranded(key, held_on, ran_on));
    }
    Ok(())
}

/// The drop path: `pg_advisory_unlock_all()` on the guard's connection, then
/// back to the pool; not confirmed within `bound`, the connection is closed.
async fn release<B: Source>(
    guard: &mut DiscardOnDrop<B>,
    key: LockKey,
    mode: LockMode,
    lock_pid: Option<i32>,
    bound: Duration,
) {
    let Some(conn) = guard.0.as_mut() else { return };
    let pid = conn.pid();
    let mut dropped = Dropped {
        conn,
        key,
        mode,
        lock_pid,
        bound,
    };
    let all = release_once_more_if_stale(&mut dropped, key, Act::UnlockAll);
    let done = tokio::time::timeout(bound, all).await;
    match done {
        Ok(Ok(_)) => {
            tracing::debug!(%key, pid, "session lock released after its guard was dropped");
            if let Some(conn) = guard.keep() {
                conn.set_note(None);
            }
        }
        Ok(Err(e)) => {
            tracing::warn!(%key, pid, error = %e, "session lock release failed: closing its connection");
        }
        Err(_) => {
            tracing::warn!(%key, pid, ?bound, "session lock release not confirmed in time: closing its connection");
            cancel_in_flight(conn, lock_pid.unwrap_or(pid), bound);
        }
    }
}

/// The least time the cancel of an abandoned lock statement is given (see
/// [`cancel_in_flight`]): it runs in a task of its own, so nothing waits
/// for it, and on a loaded machine a control checkout (a new connection,
/// perhaps) and its round trip took longer than a 100 ms unlock bound,
/// leaving the backend waiting for the lock for its whole wait.
const CANCEL_AT_LEAST: Duration = Duration::from_secs(5);

/// Cancels the statement in flight on `conn`, whose backend is `pid`,
/// before its connection is closed. The backend is likely still waiting
/// for the lock: closing the socket does not stop that wait (nor keep it
/// out of the lock's queue), a cancel does. Best effort, bounded (`bound`,
/// at least [`CANCEL_AT_LEAST`]), in a task of its own; the connection is
/// closed either way. Deadpool: a cancel request (plain TCP or socket).
/// sqlx sends none: `pg_cancel_backend` on another connection of the
/// pool, on the lock's backend.
fn cancel_in_flight<B: Source>(conn: &Client<B>, pid: i32, bound: Duration) {
    let bound = bound.max(CANCEL_AT_LEAST);
    match B::cancel(&**conn) {
        Some(cancel) => {
            tokio::spawn(tokio::time::timeout(bound, cancel));
        }
        None => {
            let pool = conn.pool().clone();
            tokio::spawn(tokio::time::timeout(
                bound,
                cancel_backend(pool, pid, bound),
            ));
        }
    }
}

/// `pg_cancel_backend(pid)` on a control connection of the pool (urgent:
/// ahead of the queue), for a backend whose own connection cannot send a
/// cancel request (sqlx). The same role may cancel its own sessions.
async fn cancel_backend<B: Source>(pool: Arc<Shared<B>>, pid: i32, bound: Duration) {
    let site = std::panic::Location::caller();
    let Ok(mut conn) = pool
        .checkout_with(Lane::Control, Priority::Urgent, site, bound)
        .await
    else {
        return;
    };
    let sent = conn
        .exec()
        .query(
            "SELECT pg_cancel_backend($1)",
            &[Param::Int4(pid)],
            Sent::Unnamed,
        )
        .await;
    let cancelled = sent.ok().and_then(|rows| rows.first()?.col::<bool>(0).ok());
    tracing::debug!(
        pid,
        ?cancelled,
        "lock statement cancelled with pg_cancel_backend"
    );
}
