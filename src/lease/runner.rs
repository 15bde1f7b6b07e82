//! One scheduled job's loop on one instance: poll for the job's lease at
//! each slot, run the job under it, survive the job.

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures_util::FutureExt;
use metrics::Counter;
use tokio::sync::watch;

use super::acquire::MAX_POLL;
use super::acquire::{Lease, LeaseHandle};
use super::job::Job;
use super::options::new_holder;
use super::run::run_under;
use super::table::Busy;
use super::Leases;
use crate::lost::LostReason;
use crate::pool::panic_message;

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

pub(crate) struct Runner {
    pub(crate) leases: Leases,
    pub(crate) lease: String,
    pub(crate) job: Job,
    /// `Some(grace)` once the scheduler stops: how long a running job may
    /// still take.
    pub(crate) stop: watch::Receiver<Option<Duration>>,
    pub(crate) jitter: Duration,
    pub(crate) panics: Counter,
}

impl Runner {
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
                Err(_) if inner.pool.is_closed() => {
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

    async fn run_once(&mut self, lease: Lease) {
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
    async fn run_job(&mut self, lease: &Lease) -> Outcome {
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

    async fn release(&self, lease: Lease) {
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
