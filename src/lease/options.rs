//! [`LeaseOptions`]: a lease's TTL, renewal, safety margin and hold.

use std::time::Duration;

use super::term::{self, Timing};
use crate::error::Error;

/// The default lease TTL: 2 minutes.
pub(crate) const DEFAULT_TTL: Duration = Duration::from_secs(120);

/// What a job does when its lease is lost while it runs.
///
/// ```
/// use pgwarden::{LeaseOptions, OnLost};
/// // A job whose second concurrent run would do harm stops at the loss.
/// let opts = LeaseOptions::default().on_lost(OnLost::Cancel);
/// # let _ = opts;
/// ```
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum OnLost {
    /// Keep running; the loss is logged, counted, and visible through
    /// [`LeaseHandle::lost`](crate::LeaseHandle::lost). Default: an
    /// idempotent job may run twice rather than stop halfway.
    /// Writes that a second run would damage belong in a fenced transaction
    /// ([`LeaseHandle::fence`](crate::LeaseHandle::fence)).
    #[default]
    Signal,
    /// Drop the job's future at once (it is cancelled at its next `.await`)
    /// and return [`LeaseError::Lost`](crate::LeaseError::Lost).
    Cancel,
}

/// How to hold one lease: TTL, renewal, safety margin, at-least-hold, and
/// what a job does on loss. Validated when used (by
/// [`Leases::acquire`](crate::Leases::acquire), [`Leases::run`](crate::Leases::run)
/// or [`SchedulerBuilder::start`](crate::SchedulerBuilder::start)), with a
/// typed error.
///
/// ```
/// use std::time::Duration;
/// let opts = pgwarden::LeaseOptions::new(Duration::from_secs(120))
///     .renew_every(Duration::from_secs(30))
///     .at_least(Duration::from_secs(10))
///     .on_lost(pgwarden::OnLost::Cancel);
/// assert_ne!(opts, pgwarden::LeaseOptions::default()); // default: 2 min TTL
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use = "options do nothing until passed to an acquire or run call"]
pub struct LeaseOptions {
    ttl: Duration,
    renew_every: Option<Duration>,
    safety_margin: Option<Duration>,
    at_least: Duration,
    on_lost: OnLost,
    pub(crate) period: Option<Duration>,
}

impl Default for LeaseOptions {
    fn default() -> Self {
        LeaseOptions::new(DEFAULT_TTL)
    }
}

impl LeaseOptions {
    /// A lease of `ttl`: how long the database keeps it without a renewal,
    /// 1 s to 24 h. Default (through `Default`): 2 min.
    pub fn new(ttl: Duration) -> LeaseOptions {
        LeaseOptions {
            ttl,
            renew_every: None,
            safety_margin: None,
            at_least: Duration::ZERO,
            on_lost: OnLost::Signal,
            period: None,
        }
    }

    /// How often the lease is renewed while held: at least 10 ms and below
    /// the TTL minus the safety margin. Default: TTL / 4.
    pub fn renew_every(mut self, every: Duration) -> Self {
        self.renew_every = Some(every);
        self
    }

    /// How long before the database could let another holder in the holder
    /// stops trusting its lease: [`LeaseHandle::lost`](crate::LeaseHandle::lost)
    /// fires at (start of the last successful renewal) + TTL − margin.
    /// At most TTL / 2. Default: TTL / 8.
    pub fn safety_margin(mut self, margin: Duration) -> Self {
        self.safety_margin = Some(margin);
        self
    }

    /// Keep the lease for at least this long after it was taken, even when
    /// released earlier (ShedLock's `lockAtLeastFor`): a fast job cannot run
    /// again on another instance within that time. A crashed holder still
    /// loses the lease at its TTL. At most 366 days. Default: zero.
    pub fn at_least(mut self, at_least: Duration) -> Self {
        self.at_least = at_least;
        self
    }

    /// What [`Leases::run`](crate::Leases::run) and a scheduled
    /// [`Job`](crate::Job) do when the lease is lost mid-job. Default:
    /// [`OnLost::Signal`].
    pub fn on_lost(mut self, on_lost: OnLost) -> Self {
        self.on_lost = on_lost;
        self
    }

    pub(crate) fn on_lost_policy(&self) -> OnLost {
        self.on_lost
    }

    pub(crate) fn at_least_time(&self) -> Duration {
        self.at_least
    }

    /// Validates everything; the timing of the lease.
    pub(crate) fn validate(&self) -> Result<Timing, Error> {
        let t = Timing::new(self.ttl, self.renew_every, self.safety_margin)?;
        term::check_at_least(self.at_least)?;
        if let Some(p) = self.period {
            term::check_period(p)?;
        }
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_at_the_call() {
        let s = Duration::from_secs(1);
        assert!(LeaseOptions::default().validate().is_ok());
        assert!(LeaseOptions::new(Duration::ZERO).validate().is_err());
        assert!(LeaseOptions::new(2 * s)
            .renew_every(2 * s)
            .validate()
            .is_err());
        assert!(LeaseOptions::new(2 * s)
            .at_least(400 * 24 * 3600 * s)
            .validate()
            .is_err());
        let mut o = LeaseOptions::new(2 * s);
        o.period = Some(Duration::from_millis(10));
        assert!(o.validate().is_err());
    }
}
