//! Jobs under a lease: [`Leases::run`](super::Leases::run) runs one once,
//! on one instance only; a [`Scheduler`] runs [`Job`]s every period on
//! exactly one instance of the cluster, or once per node, on table leases.
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
//!
//! # Jobs
//!
//! [`Job`]: what the [`Scheduler`](super::Scheduler) runs, and how often.
//!
//! # One job's loop
//!
//! One scheduled job's loop on one instance: poll for the job's lease at
//! each slot, run the job under it, survive the job.
//!
//! # Running once
//!
//! [`Leases::run`]: "run this on one instance only", answered by a lease.
//!
//! [`Leases::run`]: super::Leases::run

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use metrics::Counter;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::acquire::{Lease, LeaseHandle, MAX_POLL};
use super::backend::{Backend, LeasePool};
use super::options::{check_name, check_part, hostname, new_holder, LeaseOptions, OnLost};
use super::table::Busy;
use super::term::check_period;
use super::Leases;
use crate::error::{name_error, Error, InvalidInput, LeaseError, NameRule};
use crate::lost::LostReason;
use crate::pool::panic_message;

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
pub struct SchedulerBuilder<B: Backend = deadpool_postgres::Pool> {
    leases: Leases<B>,
    node: Option<String>,
    jobs: Vec<Job>,
    jitter: Duration,
}

impl<B: Backend> SchedulerBuilder<B> {
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
    pub fn builder<B: Backend>(leases: &Leases<B>) -> SchedulerBuilder<B> {
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

/// What a job returns: `()` or `Result<(), E>`; errors are logged.
///
/// ```
/// use std::time::Duration;
/// // A job returning a `Result`: its error is logged, and it runs again
/// // next period.
/// let job = pgwarden::Job::every("sync", Duration::from_secs(60), |_lease| async {
///     Err::<(), _>("upstream unavailable")
/// });
/// # let _ = job;
/// ```
pub trait JobOutcome: Send + 'static {
    /// The error to log, if any.
    fn into_error(self) -> Option<String>;
}

impl JobOutcome for () {
    fn into_error(self) -> Option<String> {
        None
    }
}

impl<E: fmt::Display + Send + 'static> JobOutcome for Result<(), E> {
    fn into_error(self) -> Option<String> {
        self.err().map(|e| e.to_string())
    }
}

pub(crate) type BoxJob = Pin<Box<dyn Future<Output = Option<String>> + Send>>;
pub(crate) type JobFn = Arc<dyn Fn(LeaseHandle) -> BoxJob + Send + Sync>;

/// A job for the [`Scheduler`](super::Scheduler): a name, a period, and what to run.
///
/// ```
/// use std::time::Duration;
/// use pgwarden::{Job, LeaseOptions};
/// let cleanup = Job::every("cleanup", Duration::from_secs(3600), |_lease| async {
///     // delete expired passkey challenges, SSO requests…
/// });
/// let uptime = Job::per_node("uptime", Duration::from_secs(10), |_lease| async {
///     Ok::<(), std::io::Error>(())
/// })
/// .options(LeaseOptions::new(Duration::from_secs(30)));
/// # let _ = (cleanup, uptime);
/// ```
#[derive(Clone)]
#[must_use = "a job does nothing until added to a scheduler"]
pub struct Job {
    pub(crate) name: String,
    pub(crate) period: Duration,
    pub(crate) per_node: bool,
    pub(crate) opts: LeaseOptions,
    pub(crate) run: JobFn,
}

impl Job {
    fn new<F, Fut, R>(name: impl Into<String>, period: Duration, per_node: bool, f: F) -> Job
    where
        F: Fn(LeaseHandle) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = R> + Send + 'static,
        R: JobOutcome,
    {
        let f = Arc::new(f);
        Job {
            name: name.into(),
            period,
            per_node,
            opts: LeaseOptions::default(),
            run: Arc::new(move |lease| {
                let fut = f(lease);
                Box::pin(async move { fut.await.into_error() })
            }),
        }
    }

    /// Runs `f` once per `period` on exactly one instance of the cluster
    /// (lease name: the job's name). The period is 1 s to 366 days; job
    /// names are unique within a scheduler, without `@`.
    pub fn every<F, Fut, R>(name: impl Into<String>, period: Duration, f: F) -> Job
    where
        F: Fn(LeaseHandle) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = R> + Send + 'static,
        R: JobOutcome,
    {
        Job::new(name, period, false, f)
    }

    /// Runs `f` once per `period` on each node, on exactly one instance of
    /// that node (lease name: `name@node`), so two instances on one node never
    /// count a check twice.
    pub fn per_node<F, Fut, R>(name: impl Into<String>, period: Duration, f: F) -> Job
    where
        F: Fn(LeaseHandle) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = R> + Send + 'static,
        R: JobOutcome,
    {
        Job::new(name, period, true, f)
    }

    /// The lease settings of each run: TTL (default 2 min), renewal, safety
    /// margin, at-least-hold, and [`OnLost`](super::OnLost) (default: signal, keep running).
    pub fn options(mut self, opts: LeaseOptions) -> Job {
        self.opts = opts;
        self
    }
}

impl fmt::Debug for Job {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Job")
            .field("name", &self.name)
            .field("period", &self.period)
            .field("per_node", &self.per_node)
            .field("opts", &self.opts)
            .finish()
    }
}

/// Slack past a slot boundary, so the database sees it passed.
const BOUNDARY_SLACK: Duration = Duration::from_millis(5);

/// How a run ended.
enum Outcome {
    /// The job returned (its error, if any), or was cancelled on a lost lease.
    Done(Result<Option<String>, LostReason>),
    /// The job panicked.
    Panicked(String),
    /// Still running at shutdown past the grace period: dropped.
    Dropped,
}

pub(crate) struct Runner<B: Backend> {
    pub(crate) leases: Leases<B>,
    pub(crate) lease: String,
    pub(crate) job: Job,
    /// `Some(grace)` once the scheduler stops: how long a running job may
    /// still take.
    pub(crate) stop: watch::Receiver<Option<Duration>>,
    pub(crate) jitter: Duration,
    pub(crate) panics: Counter,
}

impl<B: Backend> Runner<B> {
    pub(crate) async fn run(mut self) {
        let inner = self.leases.inner.clone();
        loop {
            if self.stop.borrow().is_some() {
                return;
            }
            let holder = new_holder();
            let attempt = inner.attempt_as(&self.lease, &self.job.opts, holder.clone());
            let result = tokio::select! {
                r = attempt => r,
                _ = stopped(&mut self.stop) => {
                    // The attempt is dropped: cancelled on the server, and
                    // released if it took the lease first.
                    inner.release_cancelled(&self.lease, &holder).await;
                    return;
                }
            };
            let wait = match result {
                Ok(Ok(lease)) => {
                    if self.stop.borrow().is_some() {
                        // The job never started: its period is free.
                        let _ = lease.release_now().await;
                        return;
                    }
                    self.run_once(lease).await;
                    continue;
                }
                Ok(Err(busy)) => {
                    inner.metrics.skipped(&self.lease);
                    match busy {
                        Busy::Held => match inner.free_in(&self.lease).await {
                            Ok(free_in) => free_in.min(self.job.period) + BOUNDARY_SLACK,
                            Err(_) => self.job.period.min(Duration::from_secs(5)),
                        },
                        Busy::Blocked => MAX_POLL.min(self.job.period),
                    }
                }
                // Closed under it: the scheduler has nothing left to do.
                Err(_) if inner.pool.shared().is_closed() => {
                    tracing::debug!(job = %self.job.name, "scheduler job stops: its pool is closed");
                    return;
                }
                Err(e) => {
                    tracing::warn!(job = %self.job.name, lease = %self.lease, error = %e, "scheduler could not try the job's lease");
                    self.job.period.min(Duration::from_secs(5))
                }
            };
            let jitter = self.jitter.mul_f64(rand::random::<f64>());
            tokio::select! {
                _ = tokio::time::sleep(wait + jitter) => {}
                _ = stopped(&mut self.stop) => return,
            }
        }
    }

    async fn run_once(&mut self, lease: Lease<B>) {
        let outcome = self.run_job(&lease).await;
        let name = &self.job.name;
        match outcome {
            Outcome::Done(Ok(err)) => {
                if let Some(e) = err {
                    tracing::warn!(job = %name, lease = %self.lease, error = %e, "job failed");
                }
                self.release(lease).await;
            }
            Outcome::Done(Err(reason)) => {
                tracing::warn!(job = %name, lease = %self.lease, %reason, "job cancelled: its lease was lost");
                // The run started: its period stays used, whatever became
                // of it (at most one run per period).
                self.release(lease).await;
            }
            Outcome::Panicked(msg) => {
                self.panics.increment(1);
                tracing::error!(
                    job = %name, lease = %self.lease, panic = %msg,
                    "job panicked: caught; it runs again next period"
                );
                // Keeps the slot: a panicking job is not rerun at once.
                self.release(lease).await;
            }
            Outcome::Dropped => {
                tracing::warn!(job = %name, "job still running at shutdown past its grace: dropped");
                // Keeps its period: another instance runs the job next
                // period, not again in this one.
                self.release(lease).await;
            }
        }
    }

    /// Runs the job to its end, its panic, its lost lease (with
    /// [`OnLost::Cancel`](super::OnLost::Cancel)), or shutdown past the grace.
    async fn run_job(&mut self, lease: &Lease<B>) -> Outcome {
        let on_lost = self.job.opts.on_lost_policy();
        let run = &self.job.run;
        // Making the job's future is the job's code too.
        let fut =
            match std::panic::catch_unwind(AssertUnwindSafe(|| run(LeaseHandle::clone(lease)))) {
                Ok(fut) => fut,
                Err(panic) => return Outcome::Panicked(panic_message(&*panic)),
            };
        let fut = AssertUnwindSafe(run_under(lease, on_lost, fut)).catch_unwind();
        tokio::pin!(fut);
        let first = tokio::select! {
            out = &mut fut => Some(out),
            _ = stopped(&mut self.stop) => None,
        };
        let out = match first {
            Some(out) => out,
            None => match tokio::time::timeout(self.grace(), &mut fut).await {
                Ok(out) => out,
                Err(_) => return Outcome::Dropped,
            },
        };
        match out {
            Ok(done) => Outcome::Done(done),
            Err(panic) => Outcome::Panicked(panic_message(&*panic)),
        }
    }

    /// The grace shutdown gives a running job (zero until it stops).
    fn grace(&self) -> Duration {
        self.stop.borrow().unwrap_or_default()
    }

    async fn release(&self, lease: Lease<B>) {
        if let Err(e) = lease.release().await {
            if !e.is_lease_lost() {
                tracing::warn!(job = %self.job.name, error = %e, "job lease release failed; it expires after its TTL");
            }
        }
    }
}

/// Completes once the scheduler stops (or is gone).
pub(crate) async fn stopped(stop: &mut watch::Receiver<Option<Duration>>) {
    let _ = stop.wait_for(Option::is_some).await;
}

impl<B: Backend> Leases<B> {
    /// Runs `job` if this call takes `name` (one attempt), renewing the
    /// lease while it runs and releasing it after; `Ok(None)` when another
    /// holder has it (skip this round).
    ///
    /// Unlike a session advisory lock, the lease holds no connection: the
    /// job takes its connections from the pool like any request, and four
    /// jobs on a pool of four do not starve it.
    ///
    /// The job gets a [`LeaseHandle`]: its fencing token, and
    /// [`LeaseHandle::lost`] to stop early if it wants to. If the lease is
    /// lost mid-job, by default ([`OnLost::Signal`]) the job keeps running
    /// (the loss is logged and counted); with
    /// [`LeaseOptions::on_lost`]`(`[`OnLost::Cancel`]`)` the job's future is
    /// dropped (it stops at its next `.await`) and the call returns
    /// [`LeaseError::Lost`]. A failed release after a completed job is
    /// logged, not returned: the job ran, and the lease expires after its
    /// TTL.
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
    /// use std::time::Duration;
    /// let leases = pgwarden::Leases::new(&pool); // keep one per pool
    /// let opts = pgwarden::LeaseOptions::new(Duration::from_secs(120));
    /// let ran = leases
    ///     .run("cleanup", &opts, |lease| async move {
    ///         // … the hourly clean-up; lease.lost() fires if the lease is lost
    ///         lease.term().token
    ///     })
    ///     .await?;
    /// if ran.is_none() {
    ///     // another instance holds "cleanup": skip this round
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn run<F, Fut, T>(
        &self,
        name: &str,
        opts: &LeaseOptions,
        job: F,
    ) -> Result<Option<T>, Error>
    where
        F: FnOnce(LeaseHandle) -> Fut,
        Fut: Future<Output = T>,
    {
        let Some(lease) = self.acquire(name, opts, None).await? else {
            return Ok(None);
        };
        let out = run_under(
            &lease,
            opts.on_lost_policy(),
            job(LeaseHandle::clone(&lease)),
        )
        .await;
        finish(lease, out).await.map(Some)
    }
}

/// Runs `job` under `lease`: to completion, or until the lease is lost when
/// `on_lost` is [`OnLost::Cancel`].
pub(crate) async fn run_under<B: Backend, T>(
    lease: &Lease<B>,
    on_lost: OnLost,
    job: impl Future<Output = T>,
) -> Result<T, LostReason> {
    match on_lost {
        OnLost::Signal => Ok(job.await),
        OnLost::Cancel => {
            let lost = lease.lost();
            tokio::select! {
                out = job => Ok(out),
                reason = lost => Err(reason),
            }
        }
    }
}

/// Releases after a run: the job's output, or `LeaseError::Lost` if it was cancelled.
/// A failed release after a completed job is logged, not returned: the job
/// ran, and the lease expires after its TTL.
pub(crate) async fn finish<B: Backend, T>(
    lease: Lease<B>,
    out: Result<T, LostReason>,
) -> Result<T, Error> {
    let name = lease.term().name.clone();
    match out {
        Ok(v) => {
            if let Err(e) = lease.release().await {
                if !e.is_lease_lost() {
                    tracing::warn!(lease = %name, error = %e, "lease release after the job failed; it expires after its TTL");
                }
            }
            Ok(v)
        }
        Err(reason) => {
            tracing::warn!(lease = %name, %reason, "job cancelled: its lease was lost");
            // Nothing to keep: let the next holder in as soon as possible.
            let _ = lease.release_now().await;
            Err(Error::Lease(LeaseError::Lost { name, reason }))
        }
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
