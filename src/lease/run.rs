//! [`Leases::run`]: "run this on one instance only", answered by a lease.

use std::future::Future;

use super::acquire::Lease;
use super::options::{LeaseOptions, OnLost};
use super::{LeaseHandle, Leases};
use crate::error::{Error, LeaseError};
use crate::lost::LostReason;

impl Leases {
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
    /// [`LeaseError::Lost`](crate::LeaseError::Lost). A failed release after a completed job is
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
pub(crate) async fn run_under<T>(
    lease: &Lease,
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
pub(crate) async fn finish<T>(lease: Lease, out: Result<T, LostReason>) -> Result<T, Error> {
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
