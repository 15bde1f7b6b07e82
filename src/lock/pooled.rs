//! Session locks and poolers: every statement a guard sends names the
//! backend its lock lives on and acts only there, the check on the lock's
//! own connection when the pool goes through a proxy whose mode detection
//! could not prove, and the way back to a lock that a transaction pooler
//! left on another server session.
//!
//! Through a transaction pooler, a client's next statement may run on any
//! server session: a guard's unlock could then release nothing of its own
//! (or another client's lock of the same key), while its lock stays on a
//! pooled server connection that other clients share. A single statement always
//! runs on one server session, so a statement of the form
//! `SELECT pg_backend_pid(), CASE WHEN pg_backend_pid() = $lock_pid THEN … END`
//! acts on the lock's session or on none, and says which one it ran on.

use std::panic::Location;
use std::time::{Duration, Instant};

use std::sync::Arc;

use super::{key_params, lock_fn, LockKey, LockMode, Scope};
use crate::admission::Lane;
use crate::error::{Error, LockError};
use crate::pool::{Client, Shared, Source};
use crate::pooler::{backend_pid, Motion, MOTION_STATEMENTS};
use crate::stmt::{Exec, Param, Row};

/// What a guard's statement does on the lock's backend.
#[derive(Copy, Clone, Debug)]
pub(crate) enum Act {
    /// One more level, never waiting (`pg_try_advisory_lock`).
    Relock,
    /// One level less (`pg_advisory_unlock`).
    Unlock,
    /// The guard's last level, then (only when PostgreSQL confirmed that
    /// one) every other advisory lock of the session: what user code took
    /// on the guard's connection goes with it, as on the drop path, instead
    /// of back into the pool. One statement, as `Unlock`.
    UnlockLast,
    /// Every advisory lock of the session (`pg_advisory_unlock_all`).
    UnlockAll,
    /// Every level of the key (`pg_advisory_unlock` until it answers false):
    /// answers whether there was one.
    UnlockKey,
}

/// Runs `act` for `key` if the statement lands on backend `pid`. Returns the
/// backend it ran on, and PostgreSQL's answer when that was `pid`
/// (`UnlockAll` answers true).
///
/// The two acts after which the connection goes back to the pool
/// (`UnlockLast`, `UnlockAll`) first end whatever transaction block user
/// code left on the guard's connection (an open one would go back to the
/// pool with its row and transaction-scoped locks; a failed one would
/// refuse the unlock), in the same round trip
/// ([`Exec::query_one_after_rollback`](crate::stmt::Exec::query_one_after_rollback)):
/// their statement binds no parameters, the pid and the key are written
/// out (integers only, [`LockKey::literals`]).
pub(crate) async fn on_backend(
    c: &impl Exec,
    pid: i32,
    act: Act,
    key: LockKey,
    mode: LockMode,
) -> Result<(i32, Option<bool>), Error> {
    let last = matches!(act, Act::UnlockLast | Act::UnlockAll);
    let (on, k) = match last {
        true => (pid.to_string(), key.literals()),
        false => ("$1".to_owned(), key.placeholders(2)),
    };
    let call = match act {
        Act::Relock => format!("{}({k})", lock_fn(Scope::Session, mode, false)),
        Act::Unlock => format!("{}({k})", unlock_fn(mode)),
        // `CASE` fixes the order: the guard's own unlock first (its answer
        // is the statement's), the rest only after it.
        Act::UnlockLast => format!(
            "CASE WHEN {}({k}) THEN pg_catalog.pg_advisory_unlock_all()::text = '' ELSE false END",
            unlock_fn(mode)
        ),
        // void, as text: '' once it ran.
        Act::UnlockAll => "pg_catalog.pg_advisory_unlock_all()::text = ''".to_owned(),
        Act::UnlockKey => {
            // Guarded again inside: whenever the subquery runs, it unlocks
            // on the lock's backend only.
            let once = format!(
                "CASE WHEN pg_catalog.pg_backend_pid() = {on} THEN {}({k}) ELSE false END",
                unlock_fn(mode)
            );
            format!(
                "(WITH RECURSIVE u(n) AS (SELECT 1 WHERE {once} \
                   UNION ALL SELECT n + 1 FROM u WHERE {once}) \
                 SELECT count(*) > 0 FROM u)"
            )
        }
    };
    let sql = format!("SELECT pg_catalog.pg_backend_pid(), CASE WHEN pg_catalog.pg_backend_pid() = {on} THEN {call} END");
    let row = if last {
        c.query_one_after_rollback(&sql).await?
    } else {
        let (k, n) = key_params(key);
        let params = [Param::Int4(pid), k[0], k[1]];
        c.query_one(&sql, &params[..1 + n]).await?
    };
    Ok((row.col(0)?, row.col(1)?))
}

fn unlock_fn(mode: LockMode) -> &'static str {
    match mode {
        LockMode::Exclusive => "pg_catalog.pg_advisory_unlock",
        LockMode::Shared => "pg_catalog.pg_advisory_unlock_shared",
    }
}

/// The check on a session lock's own connection, through a proxy whose mode
/// detection could not prove. Before the lock statement, the lock's
/// connection and a control connection ask for their backend, at random,
/// [`MOTION_STATEMENTS`] times ([`Check::run`]): any motion proves a
/// transaction pooler, and the lock is refused before it exists. Then the
/// backend the lock statement ran on must be the one the lock's connection
/// showed throughout ([`Check::confirm`]).
pub(crate) struct Check<B: Source> {
    other: Client<B>,
    motion: Motion,
}

impl<B: Source> Check<B> {
    /// Probes with `lock_conn` and a control connection, within `timeout`.
    pub(crate) async fn run(
        pool: &Arc<Shared<B>>,
        lock_conn: &mut Client<B>,
        key: LockKey,
        site: &'static Location<'static>,
        timeout: Duration,
    ) -> Result<Check<B>, Error> {
        let start = Instant::now();
        let mut other = pool.checkout(Lane::Control, site, timeout).await?;
        let mut motion = Motion::new(2);
        let (a, b) = (lock_conn.exec(), other.exec());
        let probe = async {
            for n in 0..MOTION_STATEMENTS + 2 {
                // Each connection first, then either at random.
                let i = match n {
                    0 | 1 => n,
                    _ => usize::from(rand::random::<bool>()),
                };
                let pid = match i {
                    0 => backend_pid(&a).await?,
                    _ => backend_pid(&b).await?,
                };
                if motion.observe(i, pid) {
                    return Ok::<_, Error>(true);
                }
            }
            Ok(false)
        };
        let probed = tokio::time::timeout(timeout.saturating_sub(start.elapsed()), probe).await;
        drop((a, b));
        match probed {
            Ok(Ok(false)) => Ok(Check { other, motion }),
            Ok(Ok(true)) => {
                crate::pooler::proven_by_lock(pool);
                Err(Error::Lock(LockError::BehindPooler {
                    how: "detected at the lock",
                }))
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(Error::Lock(LockError::Timeout { key, timeout })),
        }
    }

    /// The lock was granted on `held_on`, on `lock_conn`: the backend the
    /// lock's connection showed throughout the probe, or a transaction
    /// pooler moved it there. Then the lock is released on `held_on`
    /// (reached from both connections, within the pool's unlock timeout)
    /// and refused with [`LockError::BehindPooler`](crate::LockError::BehindPooler), or reported and refused
    /// with [`LockError::MovedByPooler`](crate::LockError::MovedByPooler). Either error means nothing of the
    /// lock's is on the session `lock_conn` reaches now.
    pub(crate) async fn confirm(
        mut self,
        pool: &Shared<B>,
        lock_conn: &mut Client<B>,
        key: LockKey,
        mode: LockMode,
        held_on: i32,
    ) -> Result<(), Error> {
        if !self.motion.observe(0, held_on) {
            return Ok(());
        }
        crate::pooler::proven_by_lock(pool);
        // The caller waits for this clean-up: not cut short by a zero or
        // tiny unlock timeout (which is for dropped guards).
        let bound = super::explicit_unlock_bound(super::unlock_timeout(pool));
        let (a, b) = (lock_conn.exec(), self.other.exec());
        if reach(&a, Some(&b), held_on, key, mode, bound).await {
            Err(Error::Lock(LockError::BehindPooler {
                how: "detected at the lock",
            }))
        } else {
            let ran_on = self.motion.first(0).unwrap_or(held_on);
            Err(stranded(key, held_on, ran_on))
        }
    }
}

/// Sends, from `a` and `b` (when given) in turn, the unlock of every level
/// of `key` that acts only on backend `held_on`, until one lands there or
/// `bound` passes. True once released there (or found not held there any
/// more).
pub(crate) async fn reach<A: Exec, C: Exec>(
    a: &A,
    b: Option<&C>,
    held_on: i32,
    key: LockKey,
    mode: LockMode,
    bound: Duration,
) -> bool {
    // Saturating: an unlock timeout of `Duration::MAX` is decades away.
    let deadline = crate::pool::deadline(tokio::time::Instant::now(), bound);
    let attempt = async {
        for second in [false, true].into_iter().cycle() {
            let sent = match (second, b) {
                (false, _) => on_backend(a, held_on, Act::UnlockKey, key, mode).await,
                (true, Some(b)) => on_backend(b, held_on, Act::UnlockKey, key, mode).await,
                (true, None) => continue,
            };
            match sent {
                Ok((_, Some(_))) => return true,
                Ok((_, None)) => {}
                Err(e) => {
                    tracing::debug!(%key, held_on, error = %e, "reaching a stranded lock failed");
                    return false;
                }
            }
        }
        false
    };
    let found = tokio::time::timeout_at(deadline, attempt)
        .await
        .unwrap_or(false);
    if found {
        tracing::warn!(
            %key,
            pid = held_on,
            "session lock taken through a transaction pooler released on its server session"
        );
    }
    found
}

/// Reports a lock left on a pooled server connection, loudly, and returns
/// the error that says so.
pub(crate) fn stranded(key: LockKey, held_on: i32, ran_on: i32) -> Error {
    let e = Error::Lock(LockError::MovedByPooler {
        key,
        held_on,
        ran_on,
        released: false,
    });
    tracing::error!(%key, pid = held_on, error = %e, "session advisory lock left on a pooled server connection");
    e
}
