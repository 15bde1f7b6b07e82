//! The census: the advisory locks in the database, read from `pg_locks`
//! joined with `pg_stat_activity`, matched to this pool's connections.
//!
//! A periodic census ([`PoolBuilder::census_interval`](crate::PoolBuilder::census_interval),
//! in a task of its own) flags advisory locks held by a connection idle in
//! the pool, which are locks taken with raw SQL on an ordinary connection
//! and never released: it logs one warning per connection with the count,
//! counts the locks (`pgwarden_census_leaks_total`), and closes the
//! connection at once (or, if it was checked out in the meantime, at its
//! next checkout) instead of letting it be reused.
//!
//! Owners are matched only on a pool that keeps its sessions (configured
//! `Direct`, or proven straight to PostgreSQL: never a sqlx pool at
//! `Auto`), an idle connection only by an id that names it for good
//! ([`Source::stable`]) and, where known, by its session's start as well
//! as its pid (a pid is given again once its session ends).
//!
//! Written once over the pool's backend ([`Source`]); the two differ in how
//! an idle connection is closed ([`Source::close_idle`]):
//!
//! - **deadpool**: its `retain` closes the idle connection made at the
//!   instant pgwarden kept with its pid (none: it was checked out since,
//!   and is discarded at its next checkout).
//! - **sqlx**: its pool keeps its idle connections to itself (no `retain`,
//!   no id). The sweep first marks the connection, under the pool's lock,
//!   never to be handed out again (pgwarden's checkout discards a marked
//!   connection before anyone sees it: every sqlx checkout names its
//!   connection under that lock), then, if no checkout record holds it,
//!   ends its session on the server (`pg_terminate_backend`, only while
//!   that backend is still idle, holds an advisory lock, and started
//!   before the pool first saw the connection, so that a pid the server
//!   gave to another session since is left alone): its locks are
//!   gone at once, and sqlx drops the dead connection at its next
//!   acquire (its ping fails) or pgwarden discards it (marked). A
//!   connection checked out in the meantime (by id or pid in the pool's
//!   books as the sweep decides) is discarded at its next checkout, as on
//!   deadpool; a session the pool's role may not end, or whose start is
//!   not known, is left to that discard too.
//!
//! The pool's mutex is held only to copy who holds which backend pid (one
//! entry per connection); the locks are matched outside it, in time linear
//! in their number.

use std::collections::{HashMap, HashSet};
use std::panic::Location;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::admission::Lane;
use crate::error::{BuildError, Error};
use crate::key::{LockKey, LockMode};
use crate::pool::{Client, PoolBuilder, Shared, Source, State};
use crate::pooler::{Announced, PoolerMode};
use crate::stmt::{Exec, Param, Row, Sent};

/// One advisory lock in the database, granted or awaited.
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
/// for lock in pool.census().await?.idle() {
///     eprintln!("lock {} ({}) left on an idle connection, pid {:?}", lock.key, lock.mode, lock.pid);
/// }
/// # Ok(()) }
/// ```
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
    /// The backend's `backend_start`, µs since the epoch: with the pid, it
    /// names the session (a pid is given again once its session ends).
    started: Option<i64>,
}

/// Whose backend holds an advisory lock, as this pool sees it.
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
/// use pgwarden::Owner;
/// for lock in &pool.census().await?.locks {
///     if lock.owner == Owner::Other {
///         println!("{} held by another client (pid {:?})", lock.key, lock.pid);
///     }
/// }
/// # Ok(()) }
/// ```
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

/// The advisory locks of the database at one moment.
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
/// let census = pool.census().await?;
/// println!("{} of ours, {} on idle connections", census.ours().count(), census.idle().count());
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Census {
    /// Every advisory lock in the current database.
    pub locks: Vec<AdvisoryLock>,
}

impl Census {
    /// The locks on this pool's connections.
    pub fn ours(&self) -> impl Iterator<Item = &AdvisoryLock> {
        self.locks.iter().filter(|l| l.owner != Owner::Other)
    }

    /// The locks on connections idle in this pool: leaks.
    pub fn idle(&self) -> impl Iterator<Item = &AdvisoryLock> {
        self.locks.iter().filter(|l| l.owner == Owner::Idle)
    }
}

/// What one census sweep found.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct CensusSummary {
    /// Advisory locks in the database.
    pub(crate) locks: usize,
    /// Of those, on this pool's connections.
    pub(crate) ours: usize,
    /// Of those, on connections idle in the pool.
    pub(crate) idle: usize,
    /// Connections newly found holding a leaked lock while idle (confirmed
    /// twice, and now closed, or discarded at their next checkout when they
    /// were checked out in the meantime).
    pub(crate) leaked: usize,
}

/// How often the census runs unless configured ([`PoolBuilder::census_interval`]).
pub(crate) const DEFAULT_INTERVAL: Duration = Duration::from_secs(60);

/// The periodic census, plugged into the pool as periodic work.
#[derive(Debug)]
struct Periodic(Duration);

impl<B: Source> crate::pool::Periodic<B> for Periodic
where
    B::Conn: Announced,
{
    fn name(&self) -> &'static str {
        "census"
    }

    fn every(&self) -> Duration {
        self.0
    }

    fn pass(&self, pool: Arc<Shared<B>>) -> crate::pool::Pass {
        Box::pin(async move { pool.census_sweep().await.map(drop) })
    }
}

// `Announced` is the crate's; every backend's connection has it.
#[allow(private_bounds)]
impl<B: Source> PoolBuilder<B>
where
    B::Conn: Announced,
{
    /// How often the periodic census of `pg_locks` runs (in its own task):
    /// it sets the census gauges and closes idle pooled connections found
    /// holding a leaked advisory lock. `None` turns it off; above zero.
    /// Default: 60 s.
    ///
    /// ```no_run
    /// # fn demo() -> Result<(), pgwarden::BuildError> {
    /// let pool = pgwarden::Pool::from_url("postgres://app@db/app", 16)?
    ///     .census_interval(Some(std::time::Duration::from_secs(10)))
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn census_interval(self, every: Option<Duration>) -> Self {
        let invalid = every
            .filter(|e| e.is_zero())
            .map(|value| BuildError::InvalidDuration {
                setting: "census_interval",
                value,
                why: "must be above zero",
            });
        let hook = every.map(|e| Arc::new(Periodic(e)) as Arc<dyn crate::pool::Periodic<B>>);
        self.invalid("census_interval", invalid)
            .periodic("census", hook)
    }
}

const CENSUS_SQL: &str = "\
SELECT l.pid, l.classid, l.objid, l.objsubid, l.mode, l.granted, \
       a.state, a.application_name, a.state_change, \
       (extract(epoch FROM a.backend_start) * 1000000)::int8 \
  FROM pg_locks l \
  LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
 WHERE l.locktype = 'advisory' \
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
 ORDER BY l.pid, l.classid, l.objid, l.objsubid";

/// Ends the session of backend `$1` when it is still idle, holds an
/// advisory lock, is the session that started at `$3` (µs since the
/// epoch, as the pool saw it: a pid the server gave since to another
/// session, after the pool's connection ended unseen, is left alone), and
/// started at least `$2` seconds ago (before the pool first saw the
/// connection). The sqlx sweep: see the module docs.
const END_IDLE_SQL: &str = "\
SELECT pg_terminate_backend(a.pid) \
  FROM pg_stat_activity a \
 WHERE a.pid = $1 AND a.state = 'idle' \
   AND a.datname = current_database() \
   AND a.backend_start <= now() - make_interval(secs => $2) \
   AND (extract(epoch FROM a.backend_start) * 1000000)::int8 = $3 \
   AND EXISTS (SELECT 1 FROM pg_locks l \
                WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted)";

impl<B: Source> Shared<B>
where
    B::Conn: Announced,
{
    /// Reads the census on a control connection, and returns it, that
    /// connection, and the pool's connections as they were. The connection
    /// was idle in the pool a moment ago and runs nothing but the census: a
    /// lock on it is a lock on an idle connection.
    pub(crate) async fn census_at(
        self: &Arc<Self>,
        site: &'static Location<'static>,
    ) -> Result<(Census, Client<B>, Owners<B>), Error> {
        // Owners are matched by backend pid, which names a connection of the
        // pool only where each keeps its server session: know that first
        // (probed once per pool). Behind a transaction pooler, or a proxy
        // whose mode is unproven (every sqlx pool left at `Auto`: sqlx hides
        // the pid announced at connection start), a pid names a server
        // connection other clients share: nothing is matched.
        if crate::pooler::mode(self) == PoolerMode::Auto {
            crate::pooler::detect(self, site).await?;
        }
        let mut conn = self
            .checkout(Lane::Control, site, self.opts.wait_timeout)
            .await?;
        let mut locks = read(&conn.exec()).await?;
        if !crate::pooler::keeps_sessions(self) {
            return Ok((Census { locks }, conn, Owners::default()));
        }
        let owners = Owners::snapshot(&self.state.lock());
        for (i, l) in locks.iter_mut().enumerate() {
            if i % 4096 == 4095 {
                tokio::task::yield_now().await;
            }
            l.owner = match l.pid {
                Some(pid) if pid == conn.pid() => Owner::Idle,
                pid => owners.owner(pid, l.started),
            };
        }
        Ok((Census { locks }, conn, owners))
    }
}

/// The pool's connections at one moment, by backend pid: copied under the
/// pool's mutex (one entry per connection), read without it.
pub(crate) struct Owners<B: Source> {
    out: HashMap<i32, Owner>,
    /// Idle connections named for good ([`Source::stable`]), by pid: their
    /// id in the pool, creation instant and session start (when known).
    idle: HashMap<i32, Idle<B>>,
}

impl<B: Source> Default for Owners<B> {
    fn default() -> Self {
        Owners {
            out: HashMap::new(),
            idle: HashMap::new(),
        }
    }
}

impl<B: Source> Owners<B> {
    fn snapshot(st: &State<B>) -> Owners<B> {
        let now = Instant::now();
        let mut out = HashMap::with_capacity(st.checkouts.len());
        for (_, c) in st.checkouts.iter() {
            if let Some(pid) = c.pid {
                out.insert(
                    pid,
                    Owner::CheckedOut {
                        lane: c.lane,
                        site: c.site,
                        age: c.age(now),
                        note: c.note.clone(),
                    },
                );
            }
        }
        let idle = st
            .pids
            .iter()
            .filter(|(id, k)| B::stable(id) && !out.contains_key(&k.pid))
            .map(|(id, k)| {
                let idle = Idle {
                    id: *id,
                    created: k.created,
                    started: k.started,
                };
                (k.pid, idle)
            })
            .collect();
        Owners { out, idle }
    }

    /// The pool's view of backend `pid`, whose session started at
    /// `started`: an idle connection of the pool only when it is that
    /// session (a stale entry, of a connection the wrapped pool closed on
    /// its own, names no session that took its pid since).
    fn owner(&self, pid: Option<i32>, started: Option<i64>) -> Owner {
        let Some(pid) = pid else { return Owner::Other };
        if let Some(o) = self.out.get(&pid) {
            return o.clone();
        }
        match self.idle.get(&pid) {
            Some(i) if i.started.is_none() || i.started == started => Owner::Idle,
            _ => Owner::Other,
        }
    }
}

/// An idle connection of the pool, as [`Owners`] saw it.
struct Idle<B: Source> {
    id: B::Id,
    created: Instant,
    started: Option<i64>,
}

/// Reads the advisory locks of the current database (owners not yet matched).
async fn read(conn: &impl Exec) -> Result<Vec<AdvisoryLock>, Error> {
    let rows = conn.query(CENSUS_SQL, &[], Sent::Unnamed).await?;
    let mut locks = Vec::with_capacity(rows.len());
    for (i, r) in rows.into_iter().enumerate() {
        // Tens of thousands of locks take a while to decode: let the other
        // tasks of this worker run in between.
        if i % 1024 == 1023 {
            tokio::task::yield_now().await;
        }
        let (classid, objid, objsubid): (u32, u32, i16) = (r.col(1)?, r.col(2)?, r.col(3)?);
        let mode: String = r.col(4)?;
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
            pid: r.col(0)?,
            key,
            mode,
            granted: r.col(5)?,
            state: r.col(6)?,
            application_name: r.col(7)?,
            owner: Owner::Other,
            state_change: r.col(8)?,
            started: r.col(9)?,
        });
    }
    Ok(locks)
}

// --- the periodic sweep -----------------------------------------------------

// One census pass: gauges, and leaked locks on idle pooled connections
// confirmed, reported once per connection and closed.

/// What a suspect connection was seen holding, to confirm on a second look.
type Seen = (i32, LockKey, bool, Option<SystemTime>);

fn seen(l: &AdvisoryLock) -> Option<Seen> {
    Some((l.pid?, l.key, l.granted, l.state_change))
}

/// The leaked locks of one connection idle in the pool.
struct Leak {
    pid: i32,
    locks: usize,
    /// A few of its keys, for the log line.
    keys: Vec<LockKey>,
    application_name: Option<String>,
}

impl<B: Source> Shared<B>
where
    B::Conn: Announced,
{
    /// One census pass, as the census task runs every census interval: sets
    /// the census gauges, and closes connections idle in the pool that hold
    /// advisory locks (logged once per connection with the count of locks,
    /// and counted per lock). A suspect is confirmed by a second look: its
    /// backend ran no statement in between and still holds the locks, so a
    /// lock seen while a connection was being returned is not mistaken for a
    /// leak. A confirmed leaker still idle is closed at once; one checked
    /// out in the meantime is discarded at its next checkout; the census's
    /// own connection is closed when it is the leaker.
    ///
    /// Behind a transaction pooler, pids say nothing about this pool's
    /// connections: the gauges are set, nothing is flagged.
    #[track_caller]
    pub(crate) fn census_sweep(
        self: &Arc<Self>,
    ) -> impl std::future::Future<Output = Result<CensusSummary, Error>> + Send + '_ {
        let site = Location::caller();
        async move {
            let began = Instant::now();
            let r = self.sweep(site).await;
            self.metrics
                .census_duration
                .record(began.elapsed().as_secs_f64());
            r
        }
    }

    async fn sweep(
        self: &Arc<Self>,
        site: &'static Location<'static>,
    ) -> Result<CensusSummary, Error> {
        let (census, mut conn, owners) = self.census_at(site).await?;
        let m = &self.metrics;
        let mut summary = CensusSummary {
            locks: census.locks.len(),
            ours: census.ours().count(),
            idle: census.idle().count(),
            leaked: 0,
        };
        m.census_locks.set(summary.ours as f64);
        m.census_idle_locks.set(summary.idle as f64);
        if summary.idle == 0 || !crate::pooler::keeps_sessions(self) {
            return Ok(summary);
        }
        let own = conn.pid();
        let others = census.idle().any(|l| l.pid != Some(own));
        let again: HashSet<Seen> = if others {
            read(&conn.exec()).await?.iter().filter_map(seen).collect()
        } else {
            HashSet::new()
        };
        // Confirmed leaks, per connection.
        let mut leaks: HashMap<i32, Leak> = HashMap::new();
        for l in census.idle().filter(|l| l.granted) {
            let (Some(pid), Some(s)) = (l.pid, seen(l)) else {
                continue;
            };
            if pid != own && !again.contains(&s) {
                continue;
            }
            let leak = leaks.entry(pid).or_insert_with(|| Leak {
                pid,
                locks: 0,
                keys: Vec::new(),
                application_name: l.application_name.clone(),
            });
            leak.locks += 1;
            if leak.keys.len() < 3 {
                leak.keys.push(l.key);
            }
        }
        // Close each confirmed leaker: idle, at once; checked out since, at
        // its next checkout. One already tainted was reported before.
        let mut reported = Vec::new();
        for leak in leaks.into_values() {
            if leak.pid == own {
                reported.push((leak, "closed"));
                continue;
            }
            let Some(&Idle {
                id,
                created,
                started,
            }) = owners.idle.get(&leak.pid)
            else {
                continue;
            };
            if self.state.lock().tainted.contains(&id) {
                continue;
            }
            let how = match self.inner.close_idle(id, created) {
                Some(true) => {
                    self.state.lock().pids.remove(&id);
                    "closed"
                }
                Some(false) => {
                    self.state.lock().tainted.insert(id);
                    "to be discarded at its next checkout"
                }
                None => {
                    self.end_idle(&mut conn, id, created, leak.pid, started)
                        .await?
                }
            };
            reported.push((leak, how));
        }
        if reported.iter().any(|(l, _)| l.pid == own) {
            conn.discard();
        } else {
            drop(conn);
        }
        summary.leaked = reported.len();
        for (leak, how) in reported {
            m.census_leaks.increment(leak.locks as u64);
            let keys: Vec<String> = leak.keys.iter().map(ToString::to_string).collect();
            tracing::warn!(
                pool = %self.name,
                pid = leak.pid,
                locks = leak.locks,
                keys = %keys.join(", "),
                application_name = leak.application_name.as_deref().unwrap_or(""),
                connection = how,
                "advisory locks held by a connection idle in the pool (taken with raw SQL and never \
                 released?): the connection is not reused"
            );
        }
        Ok(summary)
    }
}

impl<B: Source> Shared<B> {
    /// A leaker the backend cannot close from outside (sqlx): marked never
    /// to be handed out again, then, when no checkout holds it (by its id
    /// or its pid, in the pool's books at this moment), its session
    /// (backend `pid`, started at `started`, first seen by the pool at
    /// `seen`) ended on the server from the census's own connection `conn`
    /// (see the module docs). A session whose start is not known is only
    /// marked. How it was dealt with, for the log line.
    async fn end_idle(
        &self,
        conn: &mut Client<B>,
        id: B::Id,
        seen: Instant,
        pid: i32,
        started: Option<i64>,
    ) -> Result<&'static str, Error> {
        let idle = {
            let mut st = self.state.lock();
            st.tainted.insert(id);
            !st.checkouts
                .iter()
                .any(|(_, c)| c.object == Some(id) || c.pid == Some(pid))
        };
        let (true, Some(started)) = (idle, started) else {
            return Ok("to be discarded at its next checkout");
        };
        let ended = match conn
            .exec()
            .query(
                END_IDLE_SQL,
                &[
                    Param::Int4(pid),
                    Param::Float8(seen.elapsed().as_secs_f64()),
                    Param::Int8(started),
                ],
                Sent::Unnamed,
            )
            .await
        {
            Ok(rows) => rows.first().map(|r| r.col::<bool>(0)).transpose()?,
            // Not allowed to (another role's session): the mark stays.
            Err(e) => {
                tracing::debug!(pool = %self.name, pid, error = %e, "could not end a leaking session");
                None
            }
        };
        let ended = ended == Some(true);
        Ok(if ended {
            "closed (its session ended on the server)"
        } else {
            "to be discarded at its next checkout"
        })
    }
}

#[cfg(test)]
mod tests {
    use pgwarden_testing::TestServer;

    use super::END_IDLE_SQL;
    use crate::stmt::{Exec, Param, Row, Sent};

    /// The sqlx sweep's statement ends an idle session holding an advisory
    /// lock only when it is the session the pool saw (its start) and that
    /// backend started before the pool first saw its connection: a session
    /// younger than that, or another start (a pid given again), is left
    /// alone, and so is one holding no advisory lock.
    #[tokio::test]
    async fn end_idle_spares_a_session_younger_than_the_pools_connection() {
        let db = TestServer::shared()
            .unwrap()
            .create_database()
            .await
            .unwrap();
        let census = db.connect().await.unwrap();
        let victim = db.connect().await.unwrap();
        let row = victim
            .query_one(
                "SELECT a.pid, (extract(epoch FROM a.backend_start) * 1000000)::int8 \
                   FROM pg_stat_get_activity(pg_backend_pid()) a",
                &[],
            )
            .await
            .unwrap();
        let (pid, started): (i32, i64) = (row.get(0), row.get(1));
        let end = |seen_secs_ago: f64, started: i64| {
            let census = &census;
            async move {
                let params = [
                    Param::Int4(pid),
                    Param::Float8(seen_secs_ago),
                    Param::Int8(started),
                ];
                let rows = Exec::query(census, END_IDLE_SQL, &params, Sent::Unnamed)
                    .await
                    .unwrap();
                rows.first().map(|r| r.col::<bool>(0).unwrap())
            }
        };
        // No advisory lock: spared.
        assert_eq!(end(0.0, started).await, None);
        victim
            .batch_execute("SELECT pg_advisory_lock(61)")
            .await
            .unwrap();
        // The pool saw its connection an hour ago: this session, younger,
        // is another one on a pid given again: spared.
        assert_eq!(end(3600.0, started).await, None);
        // Another session's start on this pid (the pool's connection ended
        // and the pid was given again): spared.
        assert_eq!(end(0.0, started - 1).await, None);
        assert!(victim.simple_query("SELECT 1").await.is_ok());
        // Seen after the session started, the same session: ended.
        assert_eq!(end(0.0, started).await, Some(true));
        tokio::time::timeout(std::time::Duration::from_secs(60), async {
            while victim.simple_query("SELECT 1").await.is_ok() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the session ends");
    }
}
