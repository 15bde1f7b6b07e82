//! [`Job`]: what the [`Scheduler`](super::Scheduler) runs, and how often.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use super::options::LeaseOptions;
use super::LeaseHandle;

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
