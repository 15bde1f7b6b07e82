//! The budget and the limits, decision by decision.

use proptest::prelude::*;

use super::budget::{Budget, Decision, Refusal};
use super::lane::{BudgetPolicy, Lane, Priority};
use super::limits::{LaneLimits, Limits, LimitsError, MAX_POOL_SIZE};

const N: Priority = Priority::Normal;
const U: Priority = Priority::Urgent;

fn take_all(b: &mut Budget, lane: Lane, prio: Priority) -> usize {
    let mut n = 0;
    while matches!(
        b.decide(lane, prio, 0),
        Decision::Admit | Decision::AdmitOverBudget
    ) {
        b.take(lane, prio);
        n += 1;
        assert!(n <= b.limits().size(), "{lane} took more than the pool");
    }
    n
}

#[test]
fn defaults_table() {
    // (size, request max, request reserved, session max, lease max)
    for (size, rmax, rres, smax, lmax) in [
        (2, 1, 0, 0, 2),
        (3, 2, 1, 1, 2),
        (4, 3, 1, 1, 2),
        (8, 7, 1, 2, 4),
        (16, 15, 1, 4, 8),
        (100, 99, 1, 25, 50),
    ] {
        let l = Limits::defaults(size).unwrap();
        let got = (
            l.lane(Lane::Request).max,
            l.lane(Lane::Request).reserved,
            l.lane(Lane::SessionLock).max,
            l.lane(Lane::Lease).max,
        );
        assert_eq!(got, (rmax, rres, smax, lmax), "size {size}");
        assert_eq!(
            l.lane(Lane::Probe),
            LaneLimits {
                reserved: 1,
                max: 1
            }
        );
        assert_eq!(
            l.lane(Lane::Control),
            LaneLimits {
                reserved: 0,
                max: 1
            }
        );
        assert_eq!(l.lane(Lane::Lease).reserved, 0);
    }
}

#[test]
fn sizes_out_of_range_are_errors_not_panics() {
    assert_eq!(
        Limits::defaults(1).unwrap_err(),
        LimitsError::TooSmall { size: 1 }
    );
    for size in [MAX_POOL_SIZE + 1, 1 << 40, usize::MAX] {
        assert_eq!(
            Limits::defaults(size).unwrap_err(),
            LimitsError::TooLarge {
                size,
                max: MAX_POOL_SIZE
            }
        );
        let lanes = Limits::default_lanes(size);
        assert!(Limits::new(size, lanes, BudgetPolicy::Warn).is_err());
    }
    let l = Limits::defaults(MAX_POOL_SIZE).unwrap();
    assert_eq!(l.lane(Lane::Request).max, MAX_POOL_SIZE - 1);
}

#[test]
fn the_probe_reserve_is_never_taken_by_another_lane() {
    for size in 2..12 {
        let l = Limits::defaults(size)
            .unwrap()
            .with_policy(BudgetPolicy::Warn);
        let mut b = Budget::new(l);
        take_all(&mut b, Lane::SessionLock, N);
        take_all(&mut b, Lane::Control, N);
        take_all(&mut b, Lane::Lease, N);
        take_all(&mut b, Lane::Lease, U);
        take_all(&mut b, Lane::Request, N);
        assert_eq!(b.total(), size - 1, "size {size}: everything but the probe");
        assert_eq!(b.decide(Lane::Probe, N, 0), Decision::Admit, "size {size}");
    }
}

#[test]
fn lease_acquisitions_never_hold_the_last_slot() {
    let l = Limits::defaults(4).unwrap();
    let mut b = Budget::new(l);
    assert_eq!(take_all(&mut b, Lane::Lease, N), 1, "max 2, one kept");
    assert_eq!(b.decide(Lane::Lease, U, 0), Decision::Admit);
    b.take(Lane::Lease, U);
    assert_eq!(b.decide(Lane::Lease, U, 0), Decision::Wait, "lane at max");
    // Two left: the probe's and the request reserve. A renewal may borrow
    // the request reserve, an acquisition may not.
    let mut b = Budget::new(Limits::defaults(4).unwrap());
    b.take(Lane::SessionLock, N);
    b.take(Lane::Control, N);
    assert_eq!(b.decide(Lane::Lease, N, 0), Decision::Wait);
    assert_eq!(b.decide(Lane::Lease, U, 0), Decision::Admit);
    assert_eq!(b.decide(Lane::Request, N, 0), Decision::Admit);
}

#[test]
fn a_lease_reservation_is_for_renewals_only() {
    let mut lanes = Limits::default_lanes(6);
    lanes[Lane::Lease.idx()] = LaneLimits {
        reserved: 1,
        max: 3,
    };
    lanes[Lane::Request.idx()].max = 4;
    let mut b = Budget::new(Limits::new(6, lanes, BudgetPolicy::Refuse).unwrap());
    assert_eq!(take_all(&mut b, Lane::Request, N), 4);
    assert_eq!(take_all(&mut b, Lane::Lease, N), 0, "the free one is kept");
    assert_eq!(b.decide(Lane::Lease, U, 0), Decision::Admit);
}

#[test]
fn session_lock_refusals_and_the_releasing_state() {
    let mut b = Budget::new(Limits::defaults(4).unwrap());
    b.take(Lane::SessionLock, N);
    let refused = Decision::Refuse(Refusal::Budget { limit: 1 });
    assert_eq!(b.decide(Lane::SessionLock, N, 0), refused);
    assert!(b.mark_releasing(Lane::SessionLock));
    assert!(
        !b.mark_releasing(Lane::SessionLock),
        "one checkout, one mark"
    );
    // Refused only because of a release in flight: wait for it.
    assert_eq!(b.decide(Lane::SessionLock, N, 0), Decision::Wait);
    // A second one would still find the slot taken by the first.
    assert_eq!(b.decide(Lane::SessionLock, N, 1), refused);
    assert!(b.give_back(Lane::SessionLock, N, true));
    assert_eq!(b.decide(Lane::SessionLock, N, 0), Decision::Admit);
    assert!(!b.give_back(Lane::SessionLock, N, false), "nothing out");
}

#[test]
fn warn_admits_up_to_the_hard_floor_only() {
    let l = Limits::defaults(4).unwrap().with_policy(BudgetPolicy::Warn);
    let mut b = Budget::new(l);
    assert_eq!(b.decide(Lane::SessionLock, N, 0), Decision::Admit);
    b.take(Lane::SessionLock, N);
    assert_eq!(b.decide(Lane::SessionLock, N, 0), Decision::AdmitOverBudget);
    b.take(Lane::SessionLock, N);
    assert_eq!(
        b.decide(Lane::SessionLock, N, 0),
        Decision::Refuse(Refusal::HardFloor { limit: 2 })
    );
}

#[test]
fn validation_names_the_numbers() {
    let r = |reserved, max| LaneLimits { reserved, max };
    let with = |changes: &[(Lane, LaneLimits)]| {
        let mut lanes = Limits::default_lanes(4);
        for (lane, l) in changes {
            lanes[lane.idx()] = *l;
        }
        Limits::new(4, lanes, BudgetPolicy::Refuse)
    };
    let e = with(&[
        (Lane::Request, r(2, 3)),
        (Lane::SessionLock, r(1, 1)),
        (Lane::Control, r(1, 1)),
    ])
    .unwrap_err();
    assert_eq!(
        e,
        LimitsError::ReservationsExceedSize {
            size: 4,
            request: 2,
            session_lock: 1,
            control: 1,
            probe: 1,
            lease: 0
        }
    );
    assert!(
        e.to_string()
            .contains("= 5 with a pool size of 4; reserve at most 3"),
        "{e}"
    );
    let e = with(&[(Lane::SessionLock, r(0, 3))]).unwrap_err();
    assert_eq!(
        e,
        LimitsError::SessionLockMaxStarvesWork {
            max: 3,
            size: 4,
            reserved: 2
        }
    );
    assert!(e.to_string().contains("= 2 is the most"), "{e}");
    assert_eq!(
        with(&[(Lane::Probe, r(0, 1))]).unwrap_err(),
        LimitsError::NoProbeReserve { reserved: 0 }
    );
    assert_eq!(
        with(&[(Lane::Lease, r(1, 1))]).unwrap_err(),
        LimitsError::LeaseMaxTooSmall { max: 1, kept: 1 }
    );
    assert_eq!(
        with(&[(Lane::Request, r(1, 5))]).unwrap_err(),
        LimitsError::MaxAboveSize {
            lane: Lane::Request,
            max: 5,
            size: 4
        }
    );
    assert_eq!(
        with(&[(Lane::Control, r(2, 1))]).unwrap_err(),
        LimitsError::ReservedAboveMax {
            lane: Lane::Control,
            reserved: 2,
            max: 1
        }
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn session_locks_never_starve_request_work_nor_the_probe(size in 2usize..64, warn in any::<bool>()) {
        let policy = if warn { BudgetPolicy::Warn } else { BudgetPolicy::Refuse };
        let limits = Limits::defaults(size).unwrap().with_policy(policy);
        let mut b = Budget::new(limits.clone());
        let granted = take_all(&mut b, Lane::SessionLock, N);
        prop_assert!(granted <= limits.session_lock_ceiling());
        // The work under those locks gets a connection, and so does readiness.
        prop_assert_eq!(b.decide(Lane::Request, N, 0), Decision::Admit);
        b.take(Lane::Request, N);
        prop_assert_eq!(b.decide(Lane::Probe, N, 0), Decision::Admit);
    }
}
