//! Session advisory locks: budgeted, held by a guard that owns its
//! connection, and never returned to the pool still held.

use std::fmt;
use std::panic::Location;
use std::time::{Duration, Instant};

use super::pooled::{self, Act};
use super::release::{Held, Tally};
use std::sync::Arc;

use super::{key_params, lock_error, lock_fn, lock_timeout_setting, LockKey, LockMode, Scope};
use crate::admission::Lane;
use crate::error::{Error, LockError};
use crate::pool::{Client, Shared, Source};
use crate::pooler::Announced;
use crate::stmt::{Exec, Param, Row};

/// A held session advisory lock: owns the connection it was taken on, for as
/// long as it is held, and unlocks on that same connection.
///
/// Re-entry is counted the way PostgreSQL counts it: [`lock_again`] takes one
/// more level, [`unlock_one`] gives one back, and [`unlock`] releases every
/// level left and returns the connection to the pool. An unbalanced unlock
/// is impossible ([`unlock`] consumes the guard) or an explicit error
/// ([`unlock_one`] refuses the last level); an unlock that PostgreSQL answers
/// with `false` ("you don't own a lock") is [`LockError::NotOwned`](crate::LockError::NotOwned).
///
/// Dropped without [`unlock`] (early return, panic, cancelled future), the
/// guard hands its connection to a spawned task that rolls back any
/// transaction your own SQL left open on it, runs
/// `pg_advisory_unlock_all()` (one round trip for both) and returns it to
/// the pool; where that is not
/// confirmed within the pool's unlock timeout
/// ([`PoolBuilder::unlock_timeout`](crate::PoolBuilder::unlock_timeout)), the
/// connection is closed instead, and PostgreSQL ends the session and its locks.
///
/// [`lock_again`]: SessionLock::lock_again
/// [`unlock_one`]: SessionLock::unlock_one
/// [`unlock`]: SessionLock::unlock
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
/// use pgwarden::{LockKey, LockMode};
/// if let Some(lock) = pool.session_lock(LockKey::Single(42), LockMode::Exclusive, None).await? {
///     lock.client().simple_query("SELECT 1").await?; // the lock's own session
///     lock.unlock().await?;
/// }
/// # Ok(()) }
/// ```
#[must_use = "a session lock is released when its guard is dropped"]
pub struct SessionLock<B: Source = deadpool_postgres::Pool> {
    held: Held<B>,
    depth: u32,
    /// A level statement went out without its answer: the count is unknown.
    uncertain: bool,
}

impl<B: Source> SessionLock<B> {
    /// The key held.
    pub fn key(&self) -> LockKey {
        self.held.key
    }

    /// The connection the lock lives on: statements that must run in the
    /// lock's session go here. Other work belongs on a request connection
    /// (`pool.get()`). Releasing the lock with raw SQL on it makes the next
    /// unlock fail with [`LockError::NotOwned`](crate::LockError::NotOwned).
    pub fn client(&self) -> &Client<B> {
        self.held.conn()
    }

    /// The connection the lock lives on, mutably: a sqlx connection runs
    /// statements on `&mut PgConnection` (`sqlx::query(…).execute(lock.conn_mut())`).
    /// Run statements on it; do not swap it out (`std::mem::swap` would
    /// move the lock's session out of the guard's care).
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
    /// use pgwarden::{LockKey, LockMode};
    /// if let Some(mut lock) = pool.session_lock(LockKey::Single(42), LockMode::Exclusive, None).await? {
    ///     lock.conn_mut().batch_execute("SELECT 1").await?; // the lock's own session
    ///     lock.unlock().await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn conn_mut(&mut self) -> &mut B::Conn {
        self.held.conn_mut()
    }

    /// Takes the same lock once more on the same session (never waits: the
    /// session holds it already). Returns the new depth. Each level needs
    /// one unlock.
    pub async fn lock_again(&mut self) -> Result<u32, Error> {
        let key = self.held.key;
        // A level statement cut off before this one left the count unknown:
        // nothing this one does makes it known again.
        let was = self.uncertain;
        self.uncertain = true;
        let granted = match self.held.on_lock_backend(Act::Relock).await {
            Ok(granted) => granted,
            Err(e) => {
                // A pooler ran it elsewhere: nothing taken. Any other error
                // leaves it unknown: a lost connection, and a database error
                // too (a session lock outlives its statement's error: a
                // cancel or statement timeout that lands once the lock
                // function has run leaves the level taken).
                self.uncertain = was || !e.is_behind_pooler();
                return Err(e);
            }
        };
        self.uncertain = was;
        if !granted {
            // Another session holds it: this one lost it behind the guard.
            self.uncertain = true;
            return Err(Error::Lock(LockError::NotOwned { key }));
        }
        self.depth += 1;
        self.held.tally_mut().add_level();
        self.note();
        Ok(self.depth)
    }

    /// Releases one level, keeping the lock while others remain. Returns
    /// the depth left. The last level is [`SessionLock::unlock`]'s: here it is
    /// [`LockError::UnbalancedUnlock`](crate::LockError::UnbalancedUnlock).
    pub async fn unlock_one(&mut self) -> Result<u32, Error> {
        if self.depth <= 1 {
            return Err(Error::Lock(LockError::UnbalancedUnlock {
                key: self.held.key,
            }));
        }
        let was = self.uncertain;
        self.uncertain = true;
        if !self.held.on_lock_backend(Act::Unlock).await? {
            return Err(Error::Lock(LockError::NotOwned { key: self.held.key }));
        }
        self.uncertain = was;
        self.depth -= 1;
        self.held.tally_mut().remove_level();
        self.note();
        Ok(self.depth)
    }

    /// Releases every level held on this session and returns the connection
    /// to the pool. The statement of the last level, once PostgreSQL
    /// confirms it, also releases any other advisory lock your own SQL took
    /// on the guard's connection (as dropping the guard does), and first
    /// rolls back a transaction your SQL left open there (open or failed,
    /// with its transaction locks; in the same round trip): nothing taken
    /// there goes back into the pool. Commit your work before. Errors are reported: [`LockError::NotOwned`](crate::LockError::NotOwned) when PostgreSQL
    /// says the session did not hold the lock, [`LockError::MovedByPooler`](crate::LockError::MovedByPooler) when
    /// a transaction pooler ran the unlock on another server session than
    /// the lock's (and whether the lock could be released there after all),
    /// a database error otherwise; either way the connection is then cleaned
    /// up (or closed) as on drop.
    ///
    /// Bounded by the pool's unlock timeout
    /// ([`PoolBuilder::unlock_timeout`](crate::PoolBuilder::unlock_timeout)),
    /// as the drop path is, but never by less than one second (a zero or
    /// tiny unlock timeout closes dropped guards' connections at once; it
    /// does not refuse a healthy unlock whose answer takes a millisecond);
    /// the search for a lock's backend that a pooler moved, above, gets half
    /// of the bound. When the server has not confirmed
    /// the unlock by then (a backend frozen, a link cut off), its statement
    /// is cancelled and the connection closed, never returned to the pool,
    /// and the unlock fails with
    /// [`LockError::UnlockNotConfirmed`](crate::LockError::UnlockNotConfirmed):
    /// the lock goes with its session, as soon as the backend notices.
    pub async fn unlock(mut self) -> Result<(), Error> {
        let bound = self.held.explicit_bound();
        match tokio::time::timeout(bound, self.unlock_levels()).await {
            Ok(done) => done,
            Err(_) => Err(self.held.abandon()),
        }
    }

    /// [`SessionLock::unlock`]'s statements, unbounded.
    async fn unlock_levels(&mut self) -> Result<(), Error> {
        if self.uncertain {
            // A level statement was cut off: the count is unknown, and this
            // guard owns the session, so release everything it holds.
            self.held.release(Act::UnlockAll).await?;
            return Ok(());
        }
        while self.depth > 1 {
            if !self.held.on_lock_backend(Act::Unlock).await? {
                return Err(Error::Lock(LockError::NotOwned { key: self.held.key }));
            }
            self.depth -= 1;
            self.held.tally_mut().remove_level();
        }
        // The last level: the statement after which the connection goes
        // back, under the drop path's rule (an earlier statement's error
        // answered: unlock-all once more).
        if !self.held.release(Act::UnlockLast).await? {
            return Err(Error::Lock(LockError::NotOwned { key: self.held.key }));
        }
        self.depth = 0;
        self.held.tally_mut().remove_level();
        Ok(())
    }

    fn note(&self) {
        let key = self.held.key;
        let note = match self.depth {
            1 => format!("session lock {key}"),
            n => format!("session lock {key} (held {n} times)"),
        };
        self.held.conn().set_note(Some(note));
    }
}

impl<B: Source> fmt::Debug for SessionLock<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionLock")
            .field("key", &self.held.key)
            .field("mode", &self.held.mode)
            .field("depth", &self.depth)
            .field("conn", self.held.conn())
            .finish()
    }
}

/// The statement of a bounded session lock, in autocommit: the bound is set
/// transaction-local in a subquery (`OFFSET 0` keeps it from being
/// flattened, so it runs first) and lasts only as long as this statement's
/// implicit transaction; the session lock outlives it.
pub(crate) fn bounded_session_sql(key: LockKey, mode: LockMode) -> String {
    format!(
        "SELECT {f}({k}) AS locked, pg_backend_pid() \
           FROM (SELECT set_config('lock_timeout', $1, true) AS bound OFFSET 0) t",
        f = lock_fn(Scope::Session, mode, true),
        k = key.placeholders(2),
    )
}

/// Takes a session lock: waits up to `wait` (checkout included, and the
/// session-lock budget while other locks hold it), or tries once when `wait`
/// is `None` (refused at once past the budget; the checkout otherwise waits
/// up to the pool's wait timeout). `Ok(None)`: tried and not granted.
pub(crate) async fn acquire<B: Source>(
    pool: &Arc<Shared<B>>,
    key: LockKey,
    mode: LockMode,
    wait: Option<Duration>,
    site: &'static Location<'static>,
) -> Result<Option<SessionLock<B>>, Error>
where
    B::Conn: Announced,
{
    let start = Instant::now();
    if let Some(how) = crate::pooler::behind_pooler(pool) {
        return Err(Error::Lock(LockError::BehindPooler { how }));
    }
    let bound = wait.unwrap_or(pool.opts.wait_timeout);
    // A wait covers the budget too: while other locks hold it, wait in
    // FIFO order (holding no connection) for one to come back.
    let mut conn = match wait {
        Some(_) => pool.checkout_waiting_for_budget(site, bound).await?,
        None => pool.checkout(Lane::SessionLock, site, bound).await?,
    };
    let left = |start: Instant| bound.saturating_sub(start.elapsed());
    let check = crate::pooler::ensure_direct(pool, &mut conn, site, left(start)).await?;
    let check = match check {
        // Through a proxy whose mode detection could not prove: check on the
        // lock's own connection, before and after the lock statement.
        true => Some(pooled::Check::run(pool, &mut conn, key, site, left(start)).await?),
        false => None,
    };
    conn.set_note(Some(format!("session lock {key}")));
    // From here on the guard owns the connection: dropped at any await
    // point, it cleans up whatever the statement in flight may have taken.
    let mut held = Held::new(conn, key, mode, super::unlock_timeout(pool));
    let row = match wait {
        Some(timeout) => {
            let setting = lock_timeout_setting(timeout.saturating_sub(start.elapsed()));
            let sql = bounded_session_sql(key, mode);
            let (k, n) = key_params(key);
            let params = [Param::Text(&setting), k[0], k[1]];
            held.set_dirty();
            let sent = held
                .conn_mut()
                .exec()
                .query_one(&sql, &params[..1 + n])
                .await;
            match sent {
                Ok(row) => row,
                // Even a lock timeout leaves the guard dirty: PostgreSQL
                // reports it also when the lock was granted as the timeout
                // fired (the grant is kept, and a session lock outlives its
                // statement's error). The guard, dropped here, unlocks on
                // the connection before it goes back, or closes it.
                Err(e) => return Err(lock_error(e, key, timeout)),
            }
        }
        None => {
            let sql = format!(
                "SELECT {}({}), pg_backend_pid()",
                lock_fn(Scope::Session, mode, false),
                key.placeholders(1)
            );
            held.set_dirty();
            let (k, n) = key_params(key);
            let sent = held.conn_mut().exec().query_one(&sql, &k[..n]).await;
            sent?
        }
    };
    // The waiting form returns void once granted; the try form, whether.
    let granted = wait.is_some() || row.col::<bool>(0)?;
    let pid: i32 = row.col(1)?;
    if !granted {
        held.released();
        return Ok(None);
    }
    held.granted_on(pid);
    if let Some(check) = check {
        if let Err(e) = check.confirm(pool, held.conn_mut(), key, mode, pid).await {
            // Nothing of this guard's is on the session its connection
            // reaches now: an unlock there would release other clients' locks.
            held.released();
            return Err(e);
        }
    }
    held.set_tally(Tally::pin(pool));
    Ok(Some(SessionLock {
        held,
        depth: 1,
        uncertain: false,
    }))
}
