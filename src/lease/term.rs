//! One term of a lease: what users read of it ([`Term`]), the state its
//! guard, its handles and the renewer share ([`LeaseState`]: holder, token,
//! local deadline, the lost signal), and the timing arithmetic behind the
//! deadline ([`Timing`]).
//!
//! The local deadline lives here, not in the renewer: whatever the renewer
//! is doing (stuck in a slow statement, panicked, its runtime gone), the
//! lease's own views (`lost()`, `is_lost()`, `fence()`) see the deadline
//! pass and report the lease lost.
//!
//! # Timing
//!
//! Lease timing arithmetic: when to renew, when to stop trusting a lease,
//! how long to back off. Pure: plain instants and durations, no clock read.
//!
//! The guarantee rests on one inequality. A renewal (or the acquisition)
//! sent at local instant `start` runs `now()` on the server no earlier than
//! `start`, so the database keeps the lease until at least `start + ttl`.
//! The holder stops trusting it at `start + ttl - margin`, measured on the
//! monotonic clock from the start of the last renewal that succeeded: the
//! local deadline always falls `margin` before anyone else can take the
//! lease over, whatever the wall clocks of the nodes say.

use std::ops::Bound;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::watch;

use crate::error::{at_most, in_range, within, Error};
use crate::lost::LostReason;

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
    /// The lease's safety margin: the database keeps the term at least this
    /// long past the local deadline (see [`LeaseState::term_end`]).
    margin: Duration,
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
    /// A term whose first local deadline is `deadline`, `margin` before
    /// the database's expiry.
    pub(crate) fn new(info: TermInfo, deadline: Instant, margin: Duration) -> LeaseState {
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
            margin,
            lost: watch::Sender::new(None),
        }
    }

    /// The instant the holder stops trusting the lease.
    pub(crate) fn deadline(&self) -> Instant {
        self.origin + Duration::from_nanos(self.deadline_ns.load(Ordering::Acquire))
    }

    /// The term's end as this client knows it: the local deadline plus the
    /// safety margin. Not later than the database's expiry of the term
    /// while the monotonic clock runs with the database's (the last renewal
    /// that succeeded, sent at `start`, set it to at least `start + ttl`;
    /// the deadline is `start + ttl - margin`), but later once the host was
    /// suspended (`Instant` stops meanwhile on Linux), and read from no
    /// snapshot. The fence compares it with the row it reads, to tell a
    /// read older than the term (see `Statements::fence`); it never bounds
    /// a transaction from it.
    pub(crate) fn term_end(&self) -> Instant {
        self.deadline() + self.margin
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

/// The shortest TTL accepted: 1 s.
pub(crate) const MIN_TTL: Duration = Duration::from_secs(1);
/// The longest TTL accepted: 24 h.
pub(crate) const MAX_TTL: Duration = Duration::from_secs(24 * 3600);
/// The shortest renewal interval accepted: 10 ms.
pub(crate) const MIN_RENEW_EVERY: Duration = Duration::from_millis(10);
/// The longest at-least-hold time and scheduling period accepted: 366 days.
pub(crate) const MAX_HOLD: Duration = Duration::from_secs(366 * 24 * 3600);
/// The shortest scheduling period accepted: 1 s.
pub(crate) const MIN_PERIOD: Duration = Duration::from_secs(1);

/// The first retry delay after a failed renewal; doubles per attempt.
const BACKOFF_BASE: Duration = Duration::from_millis(50);

/// Validated timing of one lease.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Timing {
    pub(crate) ttl: Duration,
    pub(crate) renew_every: Duration,
    pub(crate) margin: Duration,
}

impl Timing {
    /// Validates `ttl` and the optional renewal interval and safety margin.
    ///
    /// Defaults: renew every `ttl / 4` (30 s for the default 2 min), margin
    /// `ttl / 8`. The margin is at most `ttl / 2`; the renewal interval is at
    /// least 10 ms and strictly below `ttl - margin`, so that at least one
    /// renewal is attempted before the local deadline.
    pub(crate) fn new(
        ttl: Duration,
        renew_every: Option<Duration>,
        margin: Option<Duration>,
    ) -> Result<Timing, Error> {
        check_ttl(ttl)?;
        let margin = margin.unwrap_or(ttl / 8);
        at_most("lease safety margin", margin, ttl / 2)?;
        let renew_every = renew_every.unwrap_or(ttl / 4);
        // The lease must not expire before its first renewal.
        in_range(
            "lease renewal interval",
            renew_every,
            Bound::Included(MIN_RENEW_EVERY),
            Bound::Excluded(ttl - margin),
        )?;
        Ok(Timing {
            ttl,
            renew_every,
            margin,
        })
    }

    /// The instant the holder stops trusting the lease, given the start of
    /// the last successful renewal (or of the acquisition).
    pub(crate) fn deadline(&self, last_ok_start: Instant) -> Instant {
        last_ok_start + (self.ttl - self.margin)
    }

    /// When the next renewal is due after one that started at `start`.
    pub(crate) fn due_after(&self, start: Instant) -> Instant {
        start + self.renew_every
    }

    /// How early a lease may be renewed to join a batch: half its interval.
    /// Renewing early costs nothing (the batch runs anyway), and it folds
    /// leases taken at different times into one statement per interval.
    pub(crate) fn window(&self) -> Duration {
        self.renew_every / 2
    }

    /// The delay before retry `attempt` (1-based) after failed renewals:
    /// 50 ms doubling, at most half the renewal interval.
    pub(crate) fn backoff(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(16);
        BACKOFF_BASE
            .saturating_mul(1 << exp)
            .min(self.window())
            .max(Duration::from_millis(1))
    }
}

/// Is a lease whose renewal is due at `due` part of the batch sent at `now`?
/// A lease retrying after an error (`attempt > 0`) waits for its exact time;
/// others join up to `window` early.
pub(crate) fn is_due(now: Instant, due: Instant, attempt: u32, window: Duration) -> bool {
    if attempt > 0 {
        due <= now
    } else {
        due <= now + window
    }
}

/// How long a renewal statement sent at `now` may take: until the earliest
/// of the given local deadlines (`None` when it has passed).
pub(crate) fn statement_budget(
    now: Instant,
    deadlines: impl IntoIterator<Item = Instant>,
) -> Option<Duration> {
    let earliest = deadlines.into_iter().min()?;
    let left = earliest.saturating_duration_since(now);
    (!left.is_zero()).then_some(left)
}

/// Validates a TTL: 1 s to 24 h.
pub(crate) fn check_ttl(ttl: Duration) -> Result<(), Error> {
    Ok(within("lease TTL", ttl, MIN_TTL, MAX_TTL)?)
}

/// Validates an at-least-hold time: at most 366 days.
pub(crate) fn check_at_least(at_least: Duration) -> Result<(), Error> {
    Ok(at_most("lease at-least-hold time", at_least, MAX_HOLD)?)
}

/// Validates a scheduling period: 1 s to 366 days.
pub(crate) fn check_period(period: Duration) -> Result<(), Error> {
    Ok(within("job period", period, MIN_PERIOD, MAX_HOLD)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::InvalidInput;

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
            Duration::from_secs(1),
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

    const S: Duration = Duration::from_secs(1);
    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn defaults_renew_at_a_quarter_and_trust_seven_eighths() {
        let t = Timing::new(120 * S, None, None).unwrap();
        assert_eq!(t.renew_every, 30 * S);
        assert_eq!(t.margin, 15 * S);
        let t0 = Instant::now();
        assert_eq!(t.deadline(t0), t0 + 105 * S);
        assert_eq!(t.due_after(t0), t0 + 30 * S);
    }

    #[test]
    fn the_local_deadline_falls_before_the_database_expiry() {
        // The database expires the lease at (server now() of the renewal) + ttl,
        // and the server's now() is no earlier than the local send instant.
        for (ttl, margin) in [
            (S, None),
            (2 * S, Some(500 * MS)),
            (120 * S, None),
            (3600 * S, Some(S)),
        ] {
            let t = Timing::new(ttl, None, margin).unwrap();
            let start = Instant::now();
            let earliest_db_expiry = start + ttl;
            assert!(t.deadline(start) < earliest_db_expiry);
            assert_eq!(earliest_db_expiry - t.deadline(start), t.margin);
            // and the renewal is due well before the deadline
            assert!(t.due_after(start) < t.deadline(start));
        }
    }

    #[test]
    fn refuses_zero_absurd_and_inverted_settings() {
        for ttl in [Duration::ZERO, 999 * MS, MAX_TTL + MS, Duration::MAX] {
            assert!(Timing::new(ttl, None, None).is_err(), "{ttl:?}");
        }
        assert!(Timing::new(MIN_TTL, None, None).is_ok());
        assert!(Timing::new(MAX_TTL, None, None).is_ok());
        // renewal not below the TTL (minus the margin)
        assert!(Timing::new(2 * S, Some(2 * S), None).is_err());
        assert!(Timing::new(2 * S, Some(3 * S), None).is_err());
        assert!(Timing::new(2 * S, Some(1750 * MS), Some(250 * MS)).is_err());
        assert!(Timing::new(2 * S, Some(1749 * MS), Some(250 * MS)).is_ok());
        assert!(Timing::new(2 * S, Some(Duration::ZERO), None).is_err());
        assert!(Timing::new(2 * S, Some(MS), None).is_err());
        // margin above half the TTL
        assert!(Timing::new(2 * S, None, Some(1001 * MS)).is_err());
        assert!(Timing::new(2 * S, Some(100 * MS), Some(S)).is_ok());
        // the error names the value and the range: below the TTL minus the margin
        let e = Timing::new(2 * S, Some(2 * S), None).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Invalid(InvalidInput::Duration {
                    what: "lease renewal interval",
                    value,
                    min: Bound::Included(MIN_RENEW_EVERY),
                    max: Bound::Excluded(max),
                }) if value == 2 * S && max == 1750 * MS
            ),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            "invalid lease renewal interval 2s: allowed [10ms, 1.75s)"
        );
    }

    #[test]
    fn backoff_doubles_and_stays_inside_the_window() {
        let t = Timing::new(2 * S, None, None).unwrap(); // renew 500 ms, window 250 ms
        assert_eq!(t.backoff(1), 50 * MS);
        assert_eq!(t.backoff(2), 100 * MS);
        assert_eq!(t.backoff(3), 200 * MS);
        assert_eq!(t.backoff(4), 250 * MS);
        assert_eq!(t.backoff(u32::MAX), 250 * MS);
        let long = Timing::new(120 * S, None, None).unwrap();
        assert_eq!(long.backoff(8), 50 * MS * 128);
        assert_eq!(long.backoff(30), 15 * S);
    }

    #[test]
    fn batching_folds_leases_due_within_half_an_interval() {
        let t = Timing::new(4 * S, None, None).unwrap(); // renew every 1 s
        let now = Instant::now();
        assert!(is_due(now, now, 0, t.window()));
        assert!(is_due(now, now + 500 * MS, 0, t.window()));
        assert!(!is_due(now, now + 501 * MS, 0, t.window()));
        // retries wait for their exact time
        assert!(!is_due(now, now + MS, 1, t.window()));
        assert!(is_due(now + MS, now + MS, 1, t.window()));
    }

    #[test]
    fn two_leases_taken_apart_converge_to_one_batch() {
        // Simulate the renewer: wake at the earliest due, renew every lease due
        // within its window, set each renewed lease due one interval later.
        let t = Timing::new(4 * S, None, None).unwrap();
        let t0 = Instant::now();
        let mut due = [t.due_after(t0), t.due_after(t0 + 700 * MS)];
        let mut batches = Vec::new();
        for _ in 0..6 {
            let now = *due.iter().min().unwrap();
            let batch: Vec<usize> = (0..2)
                .filter(|&i| is_due(now, due[i], 0, t.window()))
                .collect();
            for &i in &batch {
                due[i] = t.due_after(now);
            }
            batches.push(batch.len());
        }
        // 700 ms apart is past the 500 ms window: the first renewal goes alone;
        // the late lease's first renewal folds the other in, and from then on
        // both go in one statement per interval.
        assert_eq!(batches, [1, 2, 2, 2, 2, 2]);
    }

    #[test]
    fn statement_budget_runs_to_the_earliest_deadline() {
        let now = Instant::now();
        assert_eq!(statement_budget(now, [now + 3 * S, now + S]), Some(S));
        assert_eq!(statement_budget(now, [now, now + S]), None);
        assert_eq!(statement_budget(now, []), None);
    }

    #[test]
    fn hold_and_period_bounds() {
        assert!(check_at_least(Duration::ZERO).is_ok());
        assert!(check_at_least(MAX_HOLD).is_ok());
        assert!(check_at_least(MAX_HOLD + MS).is_err());
        assert!(check_period(Duration::ZERO).is_err());
        assert!(check_period(999 * MS).is_err());
        assert!(check_period(S).is_ok());
        assert!(check_period(MAX_HOLD + MS).is_err());
    }
}
