//! The load-shedding rule, pure: from one lane's load and the bound a
//! request's checkout would get, admit it or shed it.

use std::time::Duration;

use crate::pool::LaneLoad;

/// Why a request was shed (the `reason` label of
/// `pgwarden_requests_shed_total`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum ShedReason {
    /// The wait the lane's queue implies is over the bound.
    Busy,
    /// The pool is closed.
    Closed,
}

impl ShedReason {
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            ShedReason::Busy => "busy",
            ShedReason::Closed => "closed",
        }
    }
}

/// Admit or shed, with the wait the lane's state implies.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Let it through: a checkout now should wait about `expected`.
    Admit { expected: Duration },
    /// Answer 503 at once.
    Shed {
        reason: ShedReason,
        expected: Duration,
    },
}

/// The longest a checkout queued now should wait: the rounds of holds
/// before its turn (its place in the queue, the waiters ahead plus itself,
/// over the connections the lane cycles through, rounded up) times the
/// lane's recent hold time. The k-th waiter is served at the k-th return,
/// and each connection returns once per hold: the first round ends when
/// the current holds end (at most one hold from now), each further round
/// one hold later. With no hold seen yet the hold is taken to be `bound`,
/// so that no more wait than the lane holds at once.
pub(crate) fn expected_wait(load: &LaneLoad, bound: Duration) -> Duration {
    if load.admits_now {
        return Duration::ZERO;
    }
    let hold = load.recent_hold.unwrap_or(bound).as_nanos();
    let place = load.pending as u128 + 1;
    let rounds = place.div_ceil(load.capacity.max(1) as u128);
    let nanos = hold.saturating_mul(rounds);
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
}

/// Admit when a checkout would be admitted at once, or when the wait the
/// queue implies fits in `bound`; shed otherwise (and always when the pool
/// is closed, or the bound is zero and the lane has no room now).
pub(crate) fn decide(load: &LaneLoad, bound: Duration) -> Verdict {
    if load.closed {
        return Verdict::Shed {
            reason: ShedReason::Closed,
            expected: Duration::ZERO,
        };
    }
    let expected = expected_wait(load, bound);
    if load.admits_now || (!bound.is_zero() && expected <= bound) {
        Verdict::Admit { expected }
    } else {
        Verdict::Shed {
            reason: ShedReason::Busy,
            expected,
        }
    }
}

/// The `Retry-After` for a shed request, in whole seconds: the wait it
/// would have had, rounded up, from 1 to 60.
pub(crate) fn retry_after(expected: Duration) -> u64 {
    let secs = expected
        .as_secs()
        .saturating_add(u64::from(expected.subsec_nanos() > 0));
    secs.clamp(1, 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn busy(pending: usize, hold_ms: Option<u64>) -> LaneLoad {
        LaneLoad {
            in_use: 3,
            max: 3,
            pending,
            capacity: 3,
            admits_now: false,
            recent_hold: hold_ms.map(Duration::from_millis),
            closed: false,
        }
    }

    #[test]
    fn room_now_is_admitted_whatever_the_bound() {
        let free = LaneLoad {
            in_use: 1,
            admits_now: true,
            ..busy(0, Some(50))
        };
        assert_eq!(
            decide(&free, 250 * MS),
            Verdict::Admit {
                expected: Duration::ZERO
            }
        );
        assert_eq!(
            decide(&free, Duration::ZERO),
            Verdict::Admit {
                expected: Duration::ZERO
            }
        );
    }

    #[test]
    fn rounds_of_holds_over_the_capacity_decide() {
        // 50 ms holds over 3 connections: waiters 1 to 3 are served within
        // one hold, 13 to 15 within five.
        assert_eq!(expected_wait(&busy(0, Some(50)), 250 * MS), 50 * MS);
        assert_eq!(expected_wait(&busy(2, Some(50)), 250 * MS), 50 * MS);
        assert_eq!(expected_wait(&busy(3, Some(50)), 250 * MS), 100 * MS);
        assert_eq!(
            decide(&busy(14, Some(50)), 250 * MS),
            Verdict::Admit { expected: 250 * MS }
        );
        assert_eq!(
            decide(&busy(15, Some(50)), 250 * MS),
            Verdict::Shed {
                reason: ShedReason::Busy,
                expected: 300 * MS
            }
        );
        // Shorter holds, longer queues.
        assert!(matches!(
            decide(&busy(300, Some(2)), 250 * MS),
            Verdict::Admit { .. }
        ));
        assert!(matches!(
            decide(&busy(400, Some(2)), 250 * MS),
            Verdict::Shed { .. }
        ));
        // A lane that can hold fewer now (other lanes hold the rest).
        let squeezed = LaneLoad {
            in_use: 1,
            capacity: 1,
            ..busy(4, Some(50))
        };
        assert_eq!(expected_wait(&squeezed, 250 * MS), 250 * MS);
    }

    #[test]
    fn no_hold_seen_yet_admits_one_round_of_waiters() {
        assert!(matches!(
            decide(&busy(2, None), 250 * MS),
            Verdict::Admit { .. }
        ));
        assert!(matches!(
            decide(&busy(3, None), 250 * MS),
            Verdict::Shed { .. }
        ));
    }

    #[test]
    fn a_zero_bound_sheds_all_but_room_now_and_a_closed_pool_sheds_all() {
        assert!(matches!(
            decide(&busy(0, Some(0)), Duration::ZERO),
            Verdict::Shed {
                reason: ShedReason::Busy,
                ..
            }
        ));
        let closed = LaneLoad {
            admits_now: false,
            closed: true,
            ..busy(0, Some(5))
        };
        assert_eq!(
            decide(&closed, 250 * MS),
            Verdict::Shed {
                reason: ShedReason::Closed,
                expected: Duration::ZERO
            }
        );
    }

    #[test]
    fn extreme_loads_do_not_overflow() {
        let huge = LaneLoad {
            pending: usize::MAX,
            recent_hold: Some(Duration::MAX),
            capacity: 1,
            ..busy(0, None)
        };
        // The wait saturates at u64::MAX nanoseconds (about 584 years): an
        // unbounded checkout is admitted to it, any finite bound sheds.
        let saturated = Duration::from_nanos(u64::MAX);
        assert_eq!(expected_wait(&huge, Duration::MAX), saturated);
        assert_eq!(
            decide(&huge, Duration::MAX),
            Verdict::Admit {
                expected: saturated
            }
        );
        assert_eq!(
            decide(&huge, Duration::from_secs(3600)),
            Verdict::Shed {
                reason: ShedReason::Busy,
                expected: saturated
            }
        );
        assert_eq!(retry_after(Duration::MAX), 60);
        assert_eq!(retry_after(Duration::ZERO), 1);
        assert_eq!(retry_after(1001 * MS), 2);
        assert_eq!(retry_after(Duration::from_secs(3)), 3);
    }
}
