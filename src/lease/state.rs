//! The state of one term, shared by its guard, its handles and the renewer:
//! who holds it, its token, its local deadline, and the lost signal.
//!
//! The local deadline lives here, not in the renewer: whatever the renewer
//! is doing (stuck in a slow statement, panicked, its runtime gone), the
//! lease's own views (`lost()`, `is_lost()`, `fence()`) see the deadline
//! pass and report the lease lost.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::watch;

use super::guard::LostReason;

/// One term of a lease: its name, fencing token, holder, when it began, and
/// whose expired term it replaced. Plain data, read through
/// [`LeaseHandle::term`](crate::LeaseHandle::term).
///
/// ```no_run
/// # async fn demo(leases: pgwarden::Leases) -> Result<(), pgwarden::Error> {
/// let opts = pgwarden::LeaseOptions::default();
/// if let Some(lease) = leases.acquire("report", &opts, None).await? {
///     let term = lease.term();
///     if let Some(crashed) = &term.took_over_from {
///         eprintln!("{}: taking over from {crashed}, token {}", term.name, term.token);
///     }
///     lease.release().await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Term {
    /// The lease's name.
    pub name: String,
    /// The fencing token of this term: it grows with every take-over of any
    /// lease of the table (one sequence), so a later term always carries a
    /// larger token, across take-overs, releases and purges. Pass it to
    /// systems that can reject stale writers.
    pub token: i64,
    /// This term's holder id: `host:pid:64 random bits`, new on every
    /// acquisition.
    pub holder: String,
    /// When the term began, on the database clock. A scheduled job's run
    /// belongs to the period this falls in.
    pub taken_at: SystemTime,
    /// The holder whose expired term this one took over (a crashed or
    /// cut-off instance); `None` for a free or released lease.
    pub took_over_from: Option<String>,
}

/// One term of one lease.
pub(crate) struct LeaseState {
    pub(crate) name: Arc<str>,
    pub(crate) holder: String,
    pub(crate) token: i64,
    /// The same, as users read it.
    pub(crate) term: Term,
    /// The origin of `deadline_ns`.
    origin: Instant,
    /// The local deadline, in nanoseconds after `origin`; only grows.
    deadline_ns: AtomicU64,
    lost: watch::Sender<Option<LostReason>>,
}

/// What the state is built from.
pub(crate) struct TermInfo {
    pub(crate) name: Arc<str>,
    pub(crate) holder: String,
    pub(crate) token: i64,
    pub(crate) taken_at: SystemTime,
    pub(crate) prev_holder: Option<String>,
}

impl LeaseState {
    /// A term whose first local deadline is `deadline`.
    pub(crate) fn new(info: TermInfo, deadline: Instant) -> LeaseState {
        let origin = Instant::now().min(deadline);
        let term = Term {
            name: info.name.to_string(),
            token: info.token,
            holder: info.holder.clone(),
            taken_at: info.taken_at,
            took_over_from: info.prev_holder.filter(|h| !h.is_empty()),
        };
        LeaseState {
            name: info.name,
            holder: info.holder,
            token: info.token,
            term,
            origin,
            deadline_ns: AtomicU64::new(nanos(deadline - origin)),
            lost: watch::Sender::new(None),
        }
    }

    /// The instant the holder stops trusting the lease.
    pub(crate) fn deadline(&self) -> Instant {
        self.origin + Duration::from_nanos(self.deadline_ns.load(Ordering::Acquire))
    }

    /// Moves the deadline later (a renewal succeeded); never earlier.
    pub(crate) fn extend(&self, deadline: Instant) {
        let ns = nanos(deadline.saturating_duration_since(self.origin));
        self.deadline_ns.fetch_max(ns, Ordering::AcqRel);
    }

    /// Fires the lost signal; true the first time only.
    pub(crate) fn lose(&self, reason: LostReason) -> bool {
        self.lost.send_if_modified(|r| {
            if r.is_none() {
                *r = Some(reason);
                true
            } else {
                false
            }
        })
    }

    /// The reason given, if the signal fired (the deadline is not looked at).
    pub(crate) fn lost_reason(&self) -> Option<LostReason> {
        *self.lost.borrow()
    }

    /// Whether the deadline has passed at `now`, the signal not yet fired.
    pub(crate) fn past_deadline(&self, now: Instant) -> bool {
        now >= self.deadline()
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<Option<LostReason>> {
        self.lost.subscribe()
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(deadline: Instant) -> LeaseState {
        LeaseState::new(
            TermInfo {
                name: "x".into(),
                holder: "h".into(),
                token: 1,
                taken_at: SystemTime::now(),
                prev_holder: None,
            },
            deadline,
        )
    }

    #[test]
    fn the_deadline_only_moves_later() {
        let t0 = Instant::now();
        let s = state(t0 + Duration::from_secs(2));
        assert_eq!(s.deadline(), t0 + Duration::from_secs(2));
        s.extend(t0 + Duration::from_secs(3));
        assert_eq!(s.deadline(), t0 + Duration::from_secs(3));
        s.extend(t0 + Duration::from_secs(1));
        assert_eq!(s.deadline(), t0 + Duration::from_secs(3));
        assert!(!s.past_deadline(t0 + Duration::from_millis(2999)));
        assert!(s.past_deadline(t0 + Duration::from_secs(3)));
    }

    #[test]
    fn the_first_reason_wins() {
        let s = state(Instant::now());
        assert!(s.lose(LostReason::Deadline));
        assert!(!s.lose(LostReason::Taken));
        assert_eq!(s.lost_reason(), Some(LostReason::Deadline));
    }
}
