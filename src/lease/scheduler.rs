//! [`Scheduler`]: jobs every period on exactly one instance of the cluster,
//! or once per node, on table leases.
//!
//! Periods are slots of the database clock aligned on the Unix epoch
//! (`[k·P, (k+1)·P)`). Taking a job's lease stores the start of the next slot
//! in the row (`held_until`), and nobody can take the lease again before
//! then, even once it is released: however fast the job, it runs at most
//! once per slot, on whichever instance asked first. Every instance sleeps
//! until the slot boundary the database reports (plus a random jitter, so
//! that a fleet does not poll in the same millisecond), and one of them
//! takes the next slot as soon as it opens. A job still running at the
//! boundary keeps its lease (renewed): the slots its run covers whole are
//! skipped, and the slot it ends in gets its run at once after it (the
//! holder asks again as soon as its run is done). A run belongs to the slot
//! its term began in ([`Term::taken_at`](crate::Term::taken_at)), not the
//! one it ends in.
//!
//! # The guarantee, and what a crash does
//!
//! A job starts **at most once per period across the cluster**: the slot is
//! recorded in the row when its lease is taken, and no instance can take
//! the lease again before the next slot, whatever happens to the run.
//!
//! - A run that panics is caught, logged and counted
//!   (`pgwarden_lease_job_panics_total`); its lease is released keeping its
//!   slot, and the job runs again the next period.
//! - A holder that crashes mid-job leaves its run unfinished, and nobody
//!   reruns it within that period. Its lease stays until its TTL expires;
//!   the next period's run starts on another instance once both the slot
//!   has come and the TTL has passed (with a TTL longer than the period, a
//!   crash skips the periods in between). The next holder sees the crashed
//!   one in [`Term::took_over_from`](crate::Term::took_over_from).
//! - A holder cut off from the database longer than its TTL keeps running
//!   its job by default ([`OnLost::Signal`](super::OnLost::Signal)): the next
//!   period's run on another instance may then overlap it. Jobs that must
//!   never overlap use [`OnLost::Cancel`](super::OnLost::Cancel) and fenced
//!   transactions.
//! - It is at most once per period, not at least once: a period in which
//!   every instance is down or crashed, or which one run covers whole, is
//!   skipped.

use std::collections::HashSet;
use std::fmt;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::job::Job;
use super::options::{check_name, check_part, hostname};
use super::runner::Runner;
use super::term::check_period;
use super::Leases;
use crate::error::{name_error, Error, InvalidInput, NameRule};

/// The default largest random delay added to each poll: 100 ms.
pub(crate) const DEFAULT_POLL_JITTER: Duration = Duration::from_millis(100);

/// Builds a [`Scheduler`]: its node, its jobs, the poll jitter.
///
/// ```no_run
/// # fn demo(leases: pgwarden::Leases) -> Result<(), pgwarden::Error> {
/// use std::time::Duration;
/// use pgwarden::{Job, Scheduler};
/// let scheduler = Scheduler::builder(&leases)
///     .node(std::env::var("NODE_NAME").unwrap_or_else(|_| "local".into()))
///     .poll_jitter(Duration::from_millis(250))
///     .job(Job::per_node("uptime", Duration::from_secs(10), |_| async {}))
///     .start()?;
/// # let _ = scheduler;
/// # Ok(()) }
/// ```
#[must_use = "builder does nothing until .start()"]
#[derive(Debug)]
pub struct SchedulerBuilder {
    leases: Leases,
    node: Option<String>,
    jobs: Vec<Job>,
    jitter: Duration,
}

impl SchedulerBuilder {
    /// This instance's node, for per-node jobs: two instances with the same
    /// node share each per-node job. Default: the host name (in a container
    /// that is often the container's own name: set the node's name here).
    pub fn node(mut self, node: impl Into<String>) -> Self {
        self.node = Some(node.into());
        self
    }

    /// Adds a job. Job names are unique, without `@`.
    pub fn job(mut self, job: Job) -> Self {
        self.jobs.push(job);
        self
    }

    /// The largest random delay added to each poll (uniform in
    /// `[0, jitter)`; at most a quarter of the job's period), so that the
    /// instances of a fleet do not all poll at the slot boundary.
    /// Default: 100 ms.
    pub fn poll_jitter(mut self, jitter: Duration) -> Self {
        self.jitter = jitter;
        self
    }

    /// Validates every job and starts one task per job. Call inside a tokio
    /// runtime.
    pub fn start(self) -> Result<Scheduler, Error> {
        let node = self.node.unwrap_or_else(|| hostname().to_owned());
        let mut seen = HashSet::new();
        let mut planned = Vec::new();
        for job in self.jobs {
            check_part("job name", &job.name)?;
            if !seen.insert(job.name.clone()) {
                return Err(name_error("job name", &job.name, NameRule::Duplicate));
            }
            check_period(job.period)?;
            let lease = if job.per_node {
                check_part("node name", &node)?;
                format!("{}@{node}", job.name)
            } else {
                job.name.clone()
            };
            check_name(&lease)?;
            let mut opts = job.opts.clone();
            opts.period = Some(job.period);
            opts.validate()?;
            planned.push((lease, Job { opts, ..job }));
        }
        let rt = tokio::runtime::Handle::try_current().map_err(|_| InvalidInput::NoRuntime {
            what: "Scheduler start()",
        })?;
        let (stop, _) = watch::channel(None);
        let metrics = &self.leases.inner.metrics;
        let tasks = planned
            .into_iter()
            .map(|(lease, job)| {
                // Declared: the job's runs count under its own name (a
                // per-node job's under its job name, not its host).
                metrics.declare(&lease, &job.name);
                let r = Runner {
                    leases: self.leases.clone(),
                    panics: metrics.job_panics(&job.name),
                    jitter: self.jitter.min(job.period / 4),
                    lease,
                    job,
                    stop: stop.subscribe(),
                };
                rt.spawn(r.run())
            })
            .collect();
        Ok(Scheduler { node, stop, tasks })
    }
}

/// Runs registered [`Job`]s every period on exactly one instance of the
/// cluster (or of each node), on table leases that hold no connection.
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
/// use std::time::Duration;
/// use pgwarden::{Job, Scheduler};
/// let leases = pgwarden::Leases::new(&pool);
/// let s = Scheduler::builder(&leases)
///     .node("node-a")
///     .job(Job::every("cleanup", Duration::from_secs(3600), |_| async {}))
///     .job(Job::every("alerts", Duration::from_secs(30), |_| async {}))
///     .job(Job::every("mail-checks", Duration::from_secs(15 * 60), |_| async {}))
///     .job(Job::per_node("uptime", Duration::from_secs(10), |_| async {}))
///     .start()?;
/// // … on SIGTERM:
/// s.shutdown(Duration::from_secs(10)).await; // running jobs get 10 s; leases released
/// # Ok(()) }
/// ```
///
/// Dropping it stops the jobs at once (their leases are released in the
/// background); [`Scheduler::shutdown`] is the graceful way.
pub struct Scheduler {
    node: String,
    stop: watch::Sender<Option<Duration>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Scheduler {
    /// Starts a builder over a lease table.
    pub fn builder(leases: &Leases) -> SchedulerBuilder {
        SchedulerBuilder {
            leases: leases.clone(),
            node: None,
            jobs: Vec::new(),
            jitter: DEFAULT_POLL_JITTER,
        }
    }

    /// Graceful shutdown: starts no new run, cancels acquisitions in flight
    /// (on the server too, releasing what one took before the cancel), lets
    /// running jobs finish within `grace` (then drops them), and releases
    /// every lease held. A completed run keeps its slot (no other instance
    /// reruns it in the same period); an interrupted one frees its lease at
    /// once. Returns when every job's task has ended.
    ///
    /// ```no_run
    /// # async fn demo(s: pgwarden::Scheduler) {
    /// // on SIGTERM: running jobs get up to 10 s
    /// s.shutdown(std::time::Duration::from_secs(10)).await;
    /// # }
    /// ```
    pub async fn shutdown(mut self, grace: Duration) {
        let _ = self.stop.send(Some(grace));
        for t in std::mem::take(&mut self.tasks) {
            if let Err(e) = t.await {
                if e.is_panic() {
                    tracing::error!(node = %self.node, "a scheduler task panicked: {e}");
                }
            }
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        let _ = self.stop.send(Some(Duration::ZERO));
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scheduler")
            .field("node", &self.node)
            .field("jobs", &self.tasks.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LeaseOptions;
    use crate::Pool;

    fn pool() -> Pool {
        let cfg = deadpool_postgres::Config {
            host: Some("/nonexistent".into()),
            dbname: Some("none".into()),
            ..Default::default()
        };
        Pool::from_config(&cfg).unwrap().build().unwrap()
    }

    #[tokio::test]
    async fn refuses_bad_jobs_at_start() {
        let leases = Leases::new(&pool());
        let ok = |n: &str| Job::every(n.to_owned(), Duration::from_secs(1), |_| async {});
        let start = |jobs: Vec<Job>, node: &str| {
            jobs.into_iter()
                .fold(Scheduler::builder(&leases).node(node), |b, j| b.job(j))
                .start()
        };
        assert!(start(vec![ok("a"), ok("a")], "n").is_err());
        assert!(start(vec![ok("")], "n").is_err());
        assert!(start(vec![ok("a@b")], "n").is_err());
        assert!(start(vec![Job::every("a", Duration::ZERO, |_| async {})], "n").is_err());
        assert!(start(
            vec![Job::per_node("a", Duration::from_secs(1), |_| async {})],
            ""
        )
        .is_err());
        assert!(start(
            vec![Job::per_node("a", Duration::from_secs(1), |_| async {})],
            "x\0y"
        )
        .is_err());
        let long = "n".repeat(200);
        assert!(start(
            vec![Job::per_node("a", Duration::from_secs(1), |_| async {})],
            &long
        )
        .is_err());
        let ttl0 = ok("a").options(LeaseOptions::new(Duration::ZERO));
        assert!(start(vec![ttl0], "n").is_err());
        let s = start(
            vec![
                ok("a"),
                Job::per_node("b", Duration::from_secs(1), |_| async {}),
            ],
            "n",
        )
        .unwrap();
        assert_eq!(s.node, "n");
        drop(s);
    }
}
