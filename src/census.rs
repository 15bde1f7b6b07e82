//! The census: the advisory locks in the database, read from `pg_locks`
//! joined with `pg_stat_activity`, matched to this pool's connections.
//!
//! A periodic census ([`PoolBuilder::census_interval`](crate::PoolBuilder::census_interval))
//! flags an advisory lock held by a connection idle in the pool, which is
//! a lock taken with raw SQL on an ordinary connection and never released:
//! it logs a warning, counts it (`pgwarden_census_leaks_total`), and the
//! connection is discarded at its next checkout instead of being reused.

use std::collections::{HashMap, HashSet};
use std::panic::Location;
use std::time::{Duration, SystemTime};

use crate::budget::Lane;
use crate::error::Error;
use crate::lock::{LockKey, LockMode};
use crate::pool::{Conn, Pool, State};
use crate::pooler::Pooler;

/// One advisory lock in the database, granted or awaited.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdvisoryLock {
    /// The backend that holds or awaits it (`None` for a prepared transaction).
    pub pid: Option<i32>,
    /// The key, decoded from `classid`, `objid` and `objsubid`.
    pub key: LockKey,
    /// Exclusive or shared.
    pub mode: LockMode,
    /// Held (`true`) or awaited.
    pub granted: bool,
    /// The backend's state (`active`, `idle`, `idle in transaction`…).
    pub state: Option<String>,
    /// The backend's `application_name`.
    pub application_name: Option<String>,
    /// Whether the backend is one of this pool's connections, and how.
    pub owner: Owner,
    state_change: Option<SystemTime>,
}

/// Whose backend holds an advisory lock, as this pool sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Owner {
    /// Not a connection of this pool.
    Other,
    /// A connection of this pool, checked out.
    CheckedOut {
        /// Its lane.
        lane: Lane,
        /// Where it was checked out.
        site: &'static Location<'static>,
        /// How long it has been out.
        age: Duration,
        /// What it is held for (e.g. `session lock 1:42`), when known.
        note: Option<String>,
    },
    /// A connection of this pool, idle in it: nothing should hold a lock there.
    Idle,
}

impl Owner {
    /// A connection of this pool, checked out or idle.
    pub fn is_ours(&self) -> bool {
        !matches!(self, Owner::Other)
    }
}

/// The advisory locks of the database at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Census {
    /// Every advisory lock in the current database.
    pub locks: Vec<AdvisoryLock>,
}

impl Census {
    /// The locks on this pool's connections.
    pub fn ours(&self) -> impl Iterator<Item = &AdvisoryLock> {
        self.locks.iter().filter(|l| l.owner.is_ours())
    }

    /// The locks on connections idle in this pool: leaks.
    pub fn idle(&self) -> impl Iterator<Item = &AdvisoryLock> {
        self.locks.iter().filter(|l| l.owner == Owner::Idle)
    }
}

/// What one [`Pool::census_sweep`] found.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct CensusSummary {
    /// Advisory locks in the database.
    pub locks: usize,
    /// Of those, on this pool's connections.
    pub ours: usize,
    /// Of those, on connections idle in the pool.
    pub idle: usize,
    /// Connections newly found holding a leaked lock while idle (confirmed
    /// twice, and now tainted: discarded at their next checkout).
    pub leaked: usize,
}

const CENSUS_SQL: &str = "\
SELECT l.pid, l.classid, l.objid, l.objsubid, l.mode, l.granted, \
       a.state, a.application_name, a.state_change \
  FROM pg_locks l \
  LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
 WHERE l.locktype = 'advisory' \
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
 ORDER BY l.pid, l.classid, l.objid, l.objsubid";

impl Pool {
    /// The advisory locks in the database now, each matched to this pool's
    /// connections. Runs on a control connection; a lock found on that very
    /// connection is reported [`Owner::Idle`]: it was idle in the pool a
    /// moment before, and runs nothing but the census.
    ///
    /// Behind a transaction pooler, backend pids do not identify this pool's
    /// connections: every lock is then reported as [`Owner::Other`]; use the
    /// keys. On a [`Pooler::Auto`] pool not probed yet, the first census
    /// runs [`Pool::detect_pooler`] first.
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
    /// for lock in pool.census().await?.ours() {
    ///     println!("{:?} holds {} ({}): {:?}", lock.pid, lock.key, lock.mode, lock.owner);
    /// }
    /// # Ok(()) }
    /// ```
    #[track_caller]
    pub fn census(&self) -> impl std::future::Future<Output = Result<Census, Error>> + Send + '_ {
        let site = Location::caller();
        async move { self.census_at(site).await.map(|(census, _)| census) }
    }

    /// One census pass, as the housekeeping task runs every census interval:
    /// sets the census gauges, and flags connections idle in the pool that
    /// hold an advisory lock (warned, counted, tainted: discarded at their
    /// next checkout). A suspect is confirmed by a second look: its backend
    /// ran no statement in between and still holds the lock, so a lock seen
    /// while a connection was being returned is not mistaken for a leak.
    /// When the leaking connection is the one the census itself was handed,
    /// it is closed at once.
    ///
    /// Behind a transaction pooler, pids say nothing about this pool's
    /// connections: the gauges are set, nothing is flagged.
    #[track_caller]
    pub fn census_sweep(
        &self,
    ) -> impl std::future::Future<Output = Result<CensusSummary, Error>> + Send + '_ {
        let site = Location::caller();
        async move {
            let (census, conn) = self.census_at(site).await?;
            let m = &self.shared.metrics;
            let mut summary = CensusSummary {
                locks: census.locks.len(),
                ours: census.ours().count(),
                idle: census.idle().count(),
                leaked: 0,
            };
            m.census_locks.set(summary.ours as f64);
            m.census_idle_locks.set(summary.idle as f64);
            if summary.idle == 0 || self.pooler() == Pooler::Transaction {
                return Ok(summary);
            }
            let own = conn.pid();
            let others = census.idle().any(|l| l.pid != Some(own));
            let again = if others {
                read(&conn).await?
            } else {
                Vec::new()
            };
            let mut leaks = Vec::new();
            {
                let mut st = self.shared.state.lock();
                let ids: HashMap<i32, deadpool_postgres::ObjectId> =
                    st.pids.iter().map(|(id, pid)| (*pid, *id)).collect();
                for l in census.idle().filter(|l| l.granted) {
                    let Some(pid) = l.pid else { continue };
                    let confirmed = pid == own
                        || again.iter().any(|a| {
                            a.pid == Some(pid)
                                && a.key == l.key
                                && a.granted
                                && a.state_change == l.state_change
                        });
                    let Some(&id) = ids.get(&pid) else { continue };
                    if confirmed && (pid == own || st.tainted.insert(id)) {
                        leaks.push(l.clone());
                    }
                }
            }
            if leaks.iter().any(|l| l.pid == Some(own)) {
                conn.discard();
            } else {
                drop(conn);
            }
            let pids: HashSet<i32> = leaks.iter().filter_map(|l| l.pid).collect();
            summary.leaked = pids.len();
            m.census_leaks.increment(leaks.len() as u64);
            for l in &leaks {
                tracing::warn!(
                    pool = %self.shared.name,
                    pid = l.pid,
                    key = %l.key,
                    mode = %l.mode,
                    application_name = l.application_name.as_deref().unwrap_or(""),
                    "advisory lock held by a connection idle in the pool (taken with raw SQL and never \
                     released?): the connection is discarded instead of reused"
                );
            }
            Ok(summary)
        }
    }

    /// Reads the census on a control connection, and returns it too. That
    /// connection was idle in the pool a moment ago and runs nothing but the
    /// census: a lock on it is a lock on an idle connection.
    async fn census_at(&self, site: &'static Location<'static>) -> Result<(Census, Conn), Error> {
        // Owners are matched by backend pid, which means nothing behind a
        // transaction pooler: know which it is first (probed once per pool).
        if self.pooler() == Pooler::Auto {
            self.detect_pooler().await?;
        }
        let conn = self
            .checkout(Lane::Control, site, self.shared.opts.wait_timeout)
            .await?;
        let mut locks = read(&conn).await?;
        if self.pooler() == Pooler::Transaction {
            return Ok((Census { locks }, conn));
        }
        let st = self.shared.state.lock();
        for l in &mut locks {
            l.owner = match l.pid {
                Some(pid) if pid == conn.pid() => Owner::Idle,
                pid => owner(&st, pid),
            };
        }
        drop(st);
        Ok((Census { locks }, conn))
    }
}

/// Reads the advisory locks of the current database (owners not yet matched).
async fn read(conn: &tokio_postgres::Client) -> Result<Vec<AdvisoryLock>, Error> {
    let rows = conn.query_typed(CENSUS_SQL, &[]).await?;
    let mut locks = Vec::with_capacity(rows.len());
    for r in rows {
        let (classid, objid, objsubid): (u32, u32, i16) =
            (r.try_get(1)?, r.try_get(2)?, r.try_get(3)?);
        let mode: String = r.try_get(4)?;
        let (Some(key), Some(mode)) = (
            LockKey::from_pg_locks(classid, objid, objsubid),
            LockMode::from_pg_mode(&mode),
        ) else {
            tracing::debug!(
                classid,
                objid,
                objsubid,
                mode,
                "advisory lock row not understood; skipped"
            );
            continue;
        };
        locks.push(AdvisoryLock {
            pid: r.try_get(0)?,
            key,
            mode,
            granted: r.try_get(5)?,
            state: r.try_get(6)?,
            application_name: r.try_get(7)?,
            owner: Owner::Other,
            state_change: r.try_get(8)?,
        });
    }
    Ok(locks)
}

/// The pool's view of a backend pid.
fn owner(st: &State, pid: Option<i32>) -> Owner {
    let Some(pid) = pid else { return Owner::Other };
    let now = std::time::Instant::now();
    if let Some((_, c)) = st.checkouts.iter().find(|(_, c)| c.pid == Some(pid)) {
        return Owner::CheckedOut {
            lane: c.lane,
            site: c.site,
            age: now.saturating_duration_since(c.since),
            note: c.note.clone(),
        };
    }
    if st.pids.values().any(|p| *p == pid) {
        Owner::Idle
    } else {
        Owner::Other
    }
}
