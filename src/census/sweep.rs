//! One census pass: gauges, and leaked locks on idle pooled connections
//! confirmed, reported once per connection and closed.

use std::collections::{HashMap, HashSet};
use std::panic::Location;
use std::time::{Instant, SystemTime};

use super::{read, AdvisoryLock, CensusSummary};
use crate::error::Error;
use crate::lock::LockKey;
use crate::pool::Pool;
use crate::pooler::PoolerMode;

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

impl Pool {
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
        &self,
    ) -> impl std::future::Future<Output = Result<CensusSummary, Error>> + Send + '_ {
        let site = Location::caller();
        async move {
            let began = Instant::now();
            let r = self.sweep(site).await;
            self.shared
                .metrics
                .census_duration
                .record(began.elapsed().as_secs_f64());
            r
        }
    }

    async fn sweep(&self, site: &'static Location<'static>) -> Result<CensusSummary, Error> {
        let (census, conn, owners) = self.census_at(site).await?;
        let m = &self.shared.metrics;
        let mut summary = CensusSummary {
            locks: census.locks.len(),
            ours: census.ours().count(),
            idle: census.idle().count(),
            leaked: 0,
        };
        m.census_locks.set(summary.ours as f64);
        m.census_idle_locks.set(summary.idle as f64);
        if summary.idle == 0 || self.pooler() == PoolerMode::Transaction {
            return Ok(summary);
        }
        let own = conn.pid();
        let others = census.idle().any(|l| l.pid != Some(own));
        let again: HashSet<Seen> = if others {
            read(&conn).await?.iter().filter_map(seen).collect()
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
            let Some(&(id, created)) = owners.idle.get(&leak.pid) else {
                continue;
            };
            if self.shared.state.lock().tainted.contains(&id) {
                continue;
            }
            let removed = self
                .shared
                .inner
                .retain(|_, m| m.created != created)
                .removed
                .len();
            let mut st = self.shared.state.lock();
            let how = if removed > 0 {
                st.pids.remove(&id);
                "closed"
            } else {
                st.tainted.insert(id);
                "to be discarded at its next checkout"
            };
            drop(st);
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
                pool = %self.shared.name,
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
