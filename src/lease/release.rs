//! Releasing a term: by its guard or runner, in the background when the
//! guard is dropped, and after a cancelled acquisition.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::guard::LostReason;
use super::inner::Inner;
use super::inner::Urgency;
use super::table::Release;
use super::term::LeaseState;
use crate::error::{Error, LeaseError};

/// The least time left worth a second release attempt.
const MIN_RETRY_BUDGET: Duration = Duration::from_millis(50);

/// Whether a failed release is worth a second attempt: not when the term is
/// known to be over, nor when the bound is spent.
fn retryable(e: &Error) -> bool {
    !matches!(
        e,
        Error::Lease(LeaseError::Lost { .. }) | Error::Lease(LeaseError::Timeout { .. })
    )
}

impl Inner {
    /// Releases one term for its guard or runner: stops renewing it, then
    /// releases its row.
    pub(crate) async fn release(
        &self,
        id: u64,
        state: &LeaseState,
        forget_hold: bool,
    ) -> Result<(), Error> {
        self.unregister(id);
        match state.lost_reason() {
            Some(LostReason::Taken) => Err(Error::Lease(LeaseError::Lost {
                name: state.name.to_string(),
                reason: LostReason::Taken,
            })),
            // `release_all` released it already.
            Some(LostReason::Released) => Ok(()),
            _ => self.release_row(state, forget_hold).await,
        }
    }

    /// The release of one term: its row is marked released (and kept, with
    /// its hold unless `forget_hold`). Bounded by the statement timeout.
    ///
    /// A release that fails (a connection the server closed, as right after
    /// a primary failover, or any other error) is tried once more within
    /// what is left of the bound: otherwise the lease would stay held until
    /// its TTL. The first attempt's answer may have been lost after the
    /// server ran it, so a retry that finds the term gone counts as
    /// released.
    pub(crate) async fn release_row(
        &self,
        state: &LeaseState,
        forget_hold: bool,
    ) -> Result<(), Error> {
        let began = Instant::now();
        let name = &*state.name;
        let ours = match self
            .release_once(state, forget_hold, self.statement_timeout)
            .await
        {
            Err(e) if retryable(&e) => {
                let left = self.statement_timeout.saturating_sub(began.elapsed());
                if left < MIN_RETRY_BUDGET {
                    return Err(e);
                }
                tracing::info!(
                    pool = %self.pool_name, lease = name, error = %e,
                    "lease release failed: trying once more"
                );
                if !self.release_once(state, forget_hold, left).await? {
                    tracing::debug!(
                        pool = %self.pool_name, lease = name,
                        "lease release retried: the term is gone (released by the first attempt, or taken over)"
                    );
                }
                true
            }
            other => other?,
        };
        if ours {
            return Ok(());
        }
        tracing::warn!(
            pool = %self.pool_name,
            lease = name,
            token = state.token,
            "late release: the lease had been taken over; the new holder's lease is untouched"
        );
        Err(Error::Lease(LeaseError::Lost {
            name: name.to_owned(),
            reason: LostReason::Taken,
        }))
    }

    /// One release attempt within `budget`: whether the term was still ours.
    async fn release_once(
        &self,
        state: &LeaseState,
        forget_hold: bool,
        budget: Duration,
    ) -> Result<bool, Error> {
        let stmt = Release {
            name: &state.name,
            holder: state.holder.as_str(),
            keep_hold: !forget_hold,
        };
        self.run(Urgency::Urgent, budget, &stmt).await
    }

    /// After a cancelled acquisition: releases the lease if the statement
    /// took it before the cancel reached the server.
    pub(crate) async fn release_cancelled(&self, name: &str, holder: &str) {
        let stmt = Release {
            name,
            holder,
            keep_hold: false,
        };
        match self
            .run(Urgency::Urgent, self.statement_timeout, &stmt)
            .await
        {
            Ok(true) => tracing::info!(
                pool = %self.pool_name, lease = name,
                "a cancelled acquisition had taken the lease: released"
            ),
            Ok(false) => {}
            Err(e) => tracing::warn!(
                pool = %self.pool_name, lease = name, error = %e,
                "could not release after a cancelled acquisition; if it took the lease, it expires after its TTL"
            ),
        }
    }

    /// The guard's drop: stop renewing now, release in the background.
    pub(crate) fn release_in_background(self: &Arc<Self>, id: u64, state: Arc<LeaseState>) {
        self.unregister(id);
        if matches!(
            state.lost_reason(),
            Some(LostReason::Taken | LostReason::Released)
        ) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let inner = self.clone();
                rt.spawn(async move {
                    if let Err(e) = inner.release(id, &state, false).await {
                        if !e.is_lease_lost() {
                            tracing::warn!(
                                pool = %inner.pool_name,
                                lease = %state.name,
                                error = %e,
                                "lease release on drop failed; it expires after its TTL"
                            );
                        }
                    }
                });
            }
            Err(_) => tracing::warn!(
                pool = %self.pool_name,
                lease = %state.name,
                "lease dropped outside a tokio runtime; it expires after its TTL"
            ),
        }
    }
}
