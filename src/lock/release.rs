//! The part of a session lock that never lets a connection go back to the
//! pool still holding a lock: [`Held`] owns the connection from before the
//! lock statement goes out until the release is confirmed, and on drop hands
//! it to a spawned task that unlocks or closes it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OnceCell;

use super::{LockKey, LockMode};
use crate::error::Error;
use crate::pool::{Conn, Shared};
use crate::pooler::Pooler;

/// Per-pool state of the lock machinery, in [`Shared`].
#[derive(Debug, Default)]
pub(crate) struct LockShared {
    /// Session-lock levels held through guards (re-entries count).
    levels: AtomicUsize,
    /// Connections pinned by session-lock guards (held or being released).
    conns: AtomicUsize,
    /// Whether the pool talks through a transaction pooler, once known.
    pub(crate) pooler: OnceCell<Pooler>,
}

impl LockShared {
    /// (levels, connections) held now.
    pub(crate) fn held(&self) -> (usize, usize) {
        (
            self.levels.load(Ordering::Acquire),
            self.conns.load(Ordering::Acquire),
        )
    }
}

/// Counts one pinned connection and its levels in the gauges, until dropped.
pub(crate) struct Tally {
    shared: Arc<Shared>,
    levels: usize,
}

impl Tally {
    pub(crate) fn pin(shared: &Arc<Shared>) -> Tally {
        shared.locks.conns.fetch_add(1, Ordering::AcqRel);
        let mut t = Tally {
            shared: shared.clone(),
            levels: 0,
        };
        t.add_level();
        t
    }

    pub(crate) fn add_level(&mut self) {
        self.levels += 1;
        self.shared.locks.levels.fetch_add(1, Ordering::AcqRel);
        self.publish();
    }

    pub(crate) fn remove_level(&mut self) {
        if self.levels > 0 {
            self.levels -= 1;
            self.shared.locks.levels.fetch_sub(1, Ordering::AcqRel);
            self.publish();
        }
    }

    fn publish(&self) {
        let (levels, conns) = self.shared.locks.held();
        self.shared.metrics.session_locks_held.set(levels as f64);
        self.shared
            .metrics
            .session_lock_connections
            .set(conns as f64);
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        self.shared
            .locks
            .levels
            .fetch_sub(self.levels, Ordering::AcqRel);
        self.shared.locks.conns.fetch_sub(1, Ordering::AcqRel);
        self.publish();
    }
}

/// A session-lock connection and what it may hold.
pub(crate) struct Held {
    conn: Option<Conn>,
    pub(crate) key: LockKey,
    pub(crate) mode: LockMode,
    /// The session may hold an advisory lock not yet confirmed released.
    dirty: bool,
    tally: Option<Tally>,
    unlock_timeout: Duration,
}

impl Held {
    pub(crate) fn new(conn: Conn, key: LockKey, mode: LockMode, unlock_timeout: Duration) -> Held {
        Held {
            conn: Some(conn),
            key,
            mode,
            dirty: false,
            tally: None,
            unlock_timeout,
        }
    }

    pub(crate) fn conn(&self) -> &Conn {
        // infallible: `conn` is Some until drop.
        self.conn.as_ref().expect("connection present until drop") // infallible
    }

    /// A lock statement is about to go out.
    pub(crate) fn set_dirty(&mut self) {
        self.dirty = true;
    }

    /// Confirmed: the session holds no lock of this guard's.
    pub(crate) fn released(&mut self) {
        self.dirty = false;
    }

    pub(crate) fn set_tally(&mut self, tally: Tally) {
        self.tally = Some(tally);
    }

    pub(crate) fn tally_mut(&mut self) -> &mut Tally {
        // infallible: a SessionLock is built with its tally set.
        self.tally.as_mut().expect("tally set at acquisition") // infallible
    }

    /// One `pg_advisory_unlock`: PostgreSQL's answer (false: not held).
    pub(crate) async fn unlock_level(&self) -> Result<bool, Error> {
        let f = match self.mode {
            LockMode::Exclusive => "pg_advisory_unlock",
            LockMode::Shared => "pg_advisory_unlock_shared",
        };
        let sql = format!("SELECT {f}({})", self.key.placeholders(1));
        let row = self
            .conn()
            .query_typed_one(&sql, &self.key.params())
            .await?;
        Ok(row.try_get::<_, bool>(0)?)
    }

    /// Releases every advisory lock of the session; confirmed, it is clean.
    pub(crate) async fn unlock_all(&mut self) -> Result<(), Error> {
        unlock_all(self.conn()).await?;
        self.released();
        Ok(())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else { return };
        let tally = self.tally.take();
        if !self.dirty {
            conn.set_note(None);
            drop(tally);
            drop(conn);
            return;
        }
        let (key, bound) = (self.key, self.unlock_timeout);
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                // Its slot frees when the unlock below is done: a session
                // lock asked for meanwhile waits for it instead of being
                // refused because of it.
                conn.mark_releasing();
                let mut guard = DiscardOnDrop(Some(conn));
                rt.spawn(async move {
                    release(&mut guard, key, bound).await;
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
struct DiscardOnDrop(Option<Conn>);

impl DiscardOnDrop {
    fn keep(&mut self) -> Option<Conn> {
        self.0.take()
    }
}

impl Drop for DiscardOnDrop {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            conn.discard();
        }
    }
}

async fn unlock_all(conn: &Conn) -> Result<(), Error> {
    conn.simple_query("SELECT pg_advisory_unlock_all()").await?;
    Ok(())
}

/// The drop path: `pg_advisory_unlock_all()` on the guard's connection, then
/// back to the pool; not confirmed within `bound`, the connection is closed.
async fn release(guard: &mut DiscardOnDrop, key: LockKey, bound: Duration) {
    let Some(conn) = guard.0.as_ref() else { return };
    let pid = conn.pid();
    match tokio::time::timeout(bound, unlock_all(conn)).await {
        Ok(Ok(())) => {
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
            // The backend is likely still waiting for the lock: closing the
            // socket does not stop that wait (nor keep it out of the lock's
            // queue), a cancel request does. Best effort: plain TCP or socket,
            // bounded; the connection is closed either way.
            let token = conn.cancel_token();
            tokio::spawn(async move {
                let _ =
                    tokio::time::timeout(bound, token.cancel_query(tokio_postgres::NoTls)).await;
            });
        }
    }
}
