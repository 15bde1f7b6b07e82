//! [`Scheduler`]: jobs every period on exactly one instance of the cluster,
//! or once per node, on table leases.
//!
//! Periods are slots of the database clock aligned on the Unix epoch
//! (`[k·P, (k+1)·P)`). Taking a job's lease stores the start of the next slot
//! in the row (`held_until`), and nobody can take the lease again before
//! then, even once it is released: however fast the job, it runs at most
//! once per slot, on whichever instance asked first. Every instance sleeps
//! until the slot boundary the database reports, so one of them takes the
//! next slot as soon as it opens. A job still running at the boundary keeps
//! its lease (renewed), and the slots it overlaps are skipped.

use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::exclusive::run_under;
use super::guard::Lease;
use super::job::Job;
use super::name::{check_name, hostname};
use super::timing::check_period;
use super::Leases;
use crate::error::Error;

/// Builds a [`Scheduler`].
#[must_use = "builder does nothing until .start()"]
#[derive(Debug)]
pub struct SchedulerBuilder {
    leases: Leases,
    node: Option<String>,
    jobs: Vec<Job>,
    grace: Duration,
}

impl SchedulerBuilder {
    /// This instance's node, for per-node jobs. Default: the host name.
    pub fn node(mut self, node: impl Into<String>) -> Self {
        self.node = Some(node.into());
        self
    }

    /// Adds a job. Job names are unique, without `@`.
    pub fn job(mut self, job: Job) -> Self {
        self.jobs.push(job);
        self
    }

    /// How long [`Scheduler::shutdown`] lets running jobs finish before
    /// dropping them. Default: 10 s.
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Validates every job and starts one task per job. Call inside a tokio
    /// runtime.
    pub fn start(self) -> Result<Scheduler, Error> {
        let node = self.node.unwrap_or_else(|| hostname().to_owned());
        let mut seen = HashSet::new();
        let mut planned = Vec::new();
        for job in self.jobs {
            if job.name.is_empty() || job.name.contains('@') {
                return Err(Error::invalid(
                    "job name",
                    format!("{:?} is empty or contains '@'", job.name),
                ));
            }
            if !seen.insert(job.name.clone()) {
                return Err(Error::invalid(
                    "job name",
                    format!("{:?} is registered twice", job.name),
                ));
            }
            check_period(job.period)?;
            let lease = if job.per_node {
                if node.is_empty() || node.contains('@') {
                    return Err(Error::invalid(
                        "node name",
                        format!("{node:?} is empty or contains '@'"),
                    ));
                }
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
        let rt = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::invalid("scheduler", "start() needs a running tokio runtime"))?;
        let (stop, _) = watch::channel(false);
        let runs = Arc::new(AtomicU64::new(0));
        let tasks = planned
            .into_iter()
            .map(|(lease, job)| {
                let r = Runner {
                    leases: self.leases.clone(),
                    lease,
                    job,
                    stop: stop.subscribe(),
                    grace: self.grace,
                    runs: runs.clone(),
                };
                rt.spawn(r.run())
            })
            .collect();
        Ok(Scheduler {
            node,
            stop,
            tasks,
            runs,
        })
    }
}

/// Runs registered [`Job`]s every period on exactly one instance of the
/// cluster (or of each node), on table leases that hold no connection.
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
/// use std::time::Duration;
/// use pgwarden::{Job, Scheduler};
/// let s = Scheduler::builder(&pool.leases())
///     .node("node-a")
///     .job(Job::every("cleanup", Duration::from_secs(3600), |_| async {}))
///     .job(Job::every("alerts", Duration::from_secs(30), |_| async {}))
///     .job(Job::every("mail-checks", Duration::from_secs(15 * 60), |_| async {}))
///     .job(Job::per_node("uptime", Duration::from_secs(10), |_| async {}))
///     .start()?;
/// // … on SIGTERM:
/// s.shutdown().await; // lets running jobs finish (grace), releases leases
/// # Ok(()) }
/// ```
///
/// Dropping it stops the jobs at once (their leases are released in the
/// background); [`Scheduler::shutdown`] is the graceful way.
pub struct Scheduler {
    node: String,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    runs: Arc<AtomicU64>,
}

impl Scheduler {
    /// Starts a builder over a lease table.
    pub fn builder(leases: &Leases) -> SchedulerBuilder {
        SchedulerBuilder {
            leases: leases.clone(),
            node: None,
            jobs: Vec::new(),
            grace: Duration::from_secs(10),
        }
    }

    /// This instance's node name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Job runs completed on this instance.
    pub fn runs(&self) -> u64 {
        self.runs.load(Ordering::Relaxed)
    }

    /// Graceful shutdown: starts no new run, lets running jobs finish within
    /// the grace period (then drops them), and releases every lease held. A
    /// completed run keeps its slot (no other instance reruns it in the same
    /// period); an interrupted one frees its lease at once.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
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
        let _ = self.stop.send(true);
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
            .field("runs", &self.runs())
            .finish()
    }
}

/// One job's loop on one instance.
struct Runner {
    leases: Leases,
    lease: String,
    job: Job,
    stop: watch::Receiver<bool>,
    grace: Duration,
    runs: Arc<AtomicU64>,
}

/// Slack past a slot boundary, so the database sees it passed.
const BOUNDARY_SLACK: Duration = Duration::from_millis(5);

impl Runner {
    async fn run(mut self) {
        loop {
            if *self.stop.borrow() {
                return;
            }
            let wait = match self.leases.inner.attempt(&self.lease, &self.job.opts).await {
                Ok(Ok(lease)) => {
                    self.run_once(lease).await;
                    continue;
                }
                Ok(Err(retry_in)) => {
                    self.leases.inner.metrics.skipped(&self.lease);
                    retry_in.min(self.job.period) + BOUNDARY_SLACK
                }
                Err(e) => {
                    tracing::warn!(job = %self.job.name, lease = %self.lease, error = %e, "scheduler could not try the job's lease");
                    self.job.period.min(Duration::from_secs(5))
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = stopped(&mut self.stop) => return,
            }
        }
    }

    async fn run_once(&mut self, lease: Lease) {
        let on_lost = self.job.opts.on_lost_policy();
        let outcome = {
            let fut = run_under(&lease, on_lost, (self.job.run)(lease.handle()));
            tokio::pin!(fut);
            let first = tokio::select! {
                out = &mut fut => Some(out),
                _ = stopped(&mut self.stop) => None,
            };
            match first {
                Some(out) => Some(out),
                None => tokio::time::timeout(self.grace, &mut fut).await.ok(),
            }
        };
        let name = &self.job.name;
        match outcome {
            Some(Ok(err)) => {
                self.runs.fetch_add(1, Ordering::Relaxed);
                if let Some(e) = err {
                    tracing::warn!(job = %name, lease = %self.lease, error = %e, "job failed");
                }
                if let Err(e) = lease.release().await {
                    if !e.is_lease_lost() {
                        tracing::warn!(job = %name, error = %e, "job lease release failed; it expires after its TTL");
                    }
                }
            }
            Some(Err(reason)) => {
                tracing::warn!(job = %name, lease = %self.lease, %reason, "job cancelled: its lease was lost");
                let _ = lease.release_now().await;
            }
            None => {
                tracing::warn!(job = %name, grace = ?self.grace, "job still running at shutdown past its grace: dropped");
                let _ = lease.release_now().await;
            }
        }
    }
}

/// Completes once the scheduler stops (or is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
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
        assert_eq!(s.node(), "n");
        drop(s);
    }
}
