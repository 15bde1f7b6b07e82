//! Running jobs under a lease: [`Leases::run_exclusive`], and
//! [`Pool::try_exclusive`], "run this on one instance only", answered by a
//! lease.

use std::future::Future;
use std::time::Duration;

use super::guard::{Lease, LostReason};
use super::options::{LeaseOptions, OnLost, DEFAULT_TTL};
use super::{LeaseHandle, Leases};
use crate::error::Error;
use crate::pool::Pool;

impl Leases {
    /// Runs `job` if this call takes `name`, renewing the lease while it
    /// runs and releasing it after; `Ok(None)` when another holder has it
    /// (skip this round).
    ///
    /// The job gets a [`LeaseHandle`]: its fencing token, and
    /// [`LeaseHandle::lost`] to stop early if it wants to. If the lease is
    /// lost mid-job, the job keeps running ([`OnLost::Signal`], the default;
    /// the loss is logged and counted): use [`Leases::run_exclusive_with`]
    /// and [`OnLost::Cancel`] to stop it instead.
    pub async fn run_exclusive<F, Fut, T>(
        &self,
        name: &str,
        ttl: Duration,
        job: F,
    ) -> Result<Option<T>, Error>
    where
        F: FnOnce(LeaseHandle) -> Fut,
        Fut: Future<Output = T>,
    {
        self.run_exclusive_with(name, &LeaseOptions::new(ttl), job)
            .await
    }

    /// [`Leases::run_exclusive`] with every option: renewal interval, safety
    /// margin, at-least-hold, and what to do on loss.
    ///
    /// With [`OnLost::Cancel`], a lost lease drops the job's future (it stops
    /// at its next `.await`) and returns [`Error::LeaseLost`].
    pub async fn run_exclusive_with<F, Fut, T>(
        &self,
        name: &str,
        opts: &LeaseOptions,
        job: F,
    ) -> Result<Option<T>, Error>
    where
        F: FnOnce(LeaseHandle) -> Fut,
        Fut: Future<Output = T>,
    {
        let Some(lease) = self.try_acquire_with(name, opts).await? else {
            return Ok(None);
        };
        let out = run_under(&lease, opts.on_lost_policy(), job(lease.handle())).await;
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

/// Releases after a run: the job's output, or `LeaseLost` if it was cancelled.
/// A failed release after a completed job is logged, not returned: the job
/// ran, and the lease expires after its TTL.
pub(crate) async fn finish<T>(lease: Lease, out: Result<T, LostReason>) -> Result<T, Error> {
    let name = lease.name().to_owned();
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
            Err(Error::LeaseLost { name, reason })
        }
    }
}

impl Pool {
    /// The pool's own lease table ([`super::DEFAULT_TABLE`], installed at
    /// first use), as [`Pool::try_exclusive`] uses it. Created on first call;
    /// it does not keep the pool alive. For another table or settings, build
    /// a [`Leases`] with [`Leases::builder`].
    pub fn leases(&self) -> Leases {
        self.shared
            .leases
            .get_or_init(|| Leases::for_pool(self))
            .clone()
    }

    /// "Run this on one instance only", answered by a table lease instead of
    /// a session advisory lock: `Some(lease)` if this call took `name` (run
    /// the work, then `lease.release().await` or drop it), `None` if another
    /// instance (or task) holds it.
    ///
    /// Unlike the advisory-lock version, it holds no connection: the work
    /// under it takes its connections from the pool like any request, and
    /// four jobs on a pool of four no longer starve it. The lease lasts
    /// [`DEFAULT_TTL`] (2 min), renewed every 30 s while held; the table
    /// [`super::DEFAULT_TABLE`] is created at the first call if missing
    /// (needs `CREATE` on the schema once, or run `sql/leases.sql`).
    ///
    /// ```no_run
    /// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
    /// if let Some(lease) = pool.try_exclusive("cleanup").await? {
    ///     let conn = pool.get().await?; // the work's own connection
    ///     conn.execute("DELETE FROM sso_requests WHERE expires_at < now()", &[]).await?;
    ///     drop(conn);
    ///     lease.release().await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn try_exclusive(&self, name: &str) -> Result<Option<Lease>, Error> {
        self.leases().try_acquire(name, DEFAULT_TTL).await
    }
}
