use proptest::prelude::*;

use super::*;

fn lane_strategy() -> impl Strategy<Value = Lane> {
    prop_oneof![
        Just(Lane::Request),
        Just(Lane::SessionLock),
        Just(Lane::Control)
    ]
}

#[derive(Clone, Debug)]
enum Op {
    /// Ask for a connection; when told to wait, queue.
    Acquire(Lane),
    /// Return the k-th held connection (modulo the number held).
    Release(usize),
    /// Cancel the k-th waiter (modulo the number waiting).
    Cancel(usize),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => lane_strategy().prop_map(Op::Acquire),
        3 => any::<usize>().prop_map(Op::Release),
        1 => any::<usize>().prop_map(Op::Cancel),
    ]
}

fn limits_strategy() -> impl Strategy<Value = Limits> {
    (
        2usize..12,
        any::<bool>(),
        0usize..4,
        0usize..4,
        any::<bool>(),
    )
        .prop_filter_map(
            "valid limits",
            |(size, defaults, ctl_extra, sess_max, warn)| {
                let policy = if warn { Policy::Warn } else { Policy::Refuse };
                if defaults {
                    let d = Limits::defaults(size).ok()?;
                    return Limits::new(
                        size,
                        d.lane(Lane::Request),
                        d.lane(Lane::SessionLock),
                        d.lane(Lane::Control),
                        policy,
                    )
                    .ok();
                }
                Limits::new(
                    size,
                    LaneLimits {
                        reserved: 1,
                        max: size - 1,
                    },
                    LaneLimits {
                        reserved: 0,
                        max: sess_max,
                    },
                    LaneLimits {
                        reserved: 1 + ctl_extra.min(size.saturating_sub(2)),
                        max: size,
                    },
                    policy,
                )
                .ok()
            },
        )
}

/// A model of the pool's checkout queue on top of the pure budget: waiters are
/// granted in FIFO order whenever a release lets them in.
struct Model {
    budget: Budget,
    held: Vec<Lane>,
    waiting: Vec<Lane>,
}

impl Model {
    fn grant_waiters(&mut self) {
        let mut i = 0;
        while i < self.waiting.len() {
            let lane = self.waiting[i];
            match self.budget.acquire(lane) {
                Decision::Admit | Decision::AdmitOverBudget => {
                    self.held.push(lane);
                    self.waiting.remove(i);
                }
                Decision::Refuse(_) => {
                    self.waiting.remove(i);
                }
                Decision::Wait => i += 1,
            }
        }
    }

    fn check_invariants(&self) -> Result<(), TestCaseError> {
        let l = self.budget.limits().clone();
        prop_assert!(self.budget.total() <= l.size(), "more than N out");
        prop_assert_eq!(self.budget.total(), self.held.len());
        prop_assert!(
            self.budget.in_use(Lane::SessionLock) <= l.session_lock_ceiling(),
            "session locks past the hard floor"
        );
        if l.policy() == Policy::Refuse {
            prop_assert!(self.budget.in_use(Lane::SessionLock) <= l.lane(Lane::SessionLock).max);
        }
        // The control lane can always get a connection while under its reserve.
        if self.budget.in_use(Lane::Control) < l.lane(Lane::Control).reserved {
            prop_assert_eq!(self.budget.decide(Lane::Control), Decision::Admit);
        }
        // Whatever number of session locks is held, request work can get a
        // connection as soon as no request connection is out: the seed's
        // self-deadlock (every connection pinned by a lock, the work under the
        // locks waiting for one) cannot happen.
        if self.budget.in_use(Lane::Request) == 0 {
            prop_assert_eq!(self.budget.decide(Lane::Request), Decision::Admit);
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn interleavings_keep_the_invariants(
        limits in limits_strategy(),
        ops in prop::collection::vec(op_strategy(), 1..200),
    ) {
        let mut m = Model { budget: Budget::new(limits), held: vec![], waiting: vec![] };
        for op in ops {
            match op {
                Op::Acquire(lane) => {
                    let before = m.budget.clone();
                    match m.budget.acquire(lane) {
                        Decision::Admit | Decision::AdmitOverBudget => m.held.push(lane),
                        Decision::Wait => m.waiting.push(lane),
                        Decision::Refuse(_) => {
                            // A refused request changes no state.
                            prop_assert_eq!(before.in_use, m.budget.in_use);
                        }
                    }
                }
                Op::Release(k) => {
                    if !m.held.is_empty() {
                        let lane = m.held.remove(k % m.held.len());
                        m.budget.release(lane);
                        // Once a connection is returned, a control waiter under
                        // its reserve is served.
                        m.grant_waiters();
                    }
                }
                Op::Cancel(k) => {
                    if !m.waiting.is_empty() {
                        let i = k % m.waiting.len();
                        m.waiting.remove(i);
                    }
                }
            }
            m.check_invariants()?;
        }
    }

    #[test]
    fn session_locks_up_to_the_max_never_starve_request_work(size in 2usize..64, warn in any::<bool>()) {
        let d = Limits::defaults(size).unwrap();
        let policy = if warn { Policy::Warn } else { Policy::Refuse };
        let limits = Limits::new(size, d.lane(Lane::Request), d.lane(Lane::SessionLock), d.lane(Lane::Control), policy).unwrap();
        let mut b = Budget::new(limits.clone());
        // Take every session lock the policy admits.
        let mut granted = 0;
        while matches!(b.acquire(Lane::SessionLock), Decision::Admit | Decision::AdmitOverBudget) {
            granted += 1;
            prop_assert!(granted <= size);
        }
        prop_assert!(granted <= limits.session_lock_ceiling());
        // The work under those locks gets a connection, and so does readiness.
        prop_assert_eq!(b.acquire(Lane::Request), Decision::Admit);
        prop_assert_eq!(b.decide(Lane::Control), Decision::Admit);
    }
}

#[test]
fn defaults_for_the_seed_pool_of_four() {
    let l = Limits::defaults(4).unwrap();
    assert_eq!(l.lane(Lane::SessionLock).max, 1);
    assert_eq!(l.session_lock_ceiling(), 2);
    let mut b = Budget::new(l);
    assert_eq!(b.acquire(Lane::SessionLock), Decision::Admit);
    assert_eq!(
        b.acquire(Lane::SessionLock),
        Decision::Refuse(Refusal::Budget { limit: 1 })
    );
}

#[test]
fn warn_admits_up_to_the_hard_floor_only() {
    let d = Limits::defaults(4).unwrap();
    let l = Limits::new(
        4,
        d.lane(Lane::Request),
        d.lane(Lane::SessionLock),
        d.lane(Lane::Control),
        Policy::Warn,
    )
    .unwrap();
    let mut b = Budget::new(l);
    assert_eq!(b.acquire(Lane::SessionLock), Decision::Admit);
    assert_eq!(b.acquire(Lane::SessionLock), Decision::AdmitOverBudget);
    assert_eq!(
        b.acquire(Lane::SessionLock),
        Decision::Refuse(Refusal::HardFloor { limit: 2 })
    );
    assert_eq!(b.in_use(Lane::SessionLock), 2);
}

#[test]
fn a_pool_of_two_has_no_session_lock_budget() {
    let l = Limits::defaults(2).unwrap();
    assert_eq!(l.lane(Lane::SessionLock).max, 0);
    let b = Budget::new(l);
    assert_eq!(
        b.decide(Lane::SessionLock),
        Decision::Refuse(Refusal::HardFloor { limit: 0 })
    );
}

#[test]
fn build_rejects_impossible_settings_naming_the_numbers() {
    let r = |reserved, max| LaneLimits { reserved, max };
    assert_eq!(
        Limits::defaults(1).unwrap_err(),
        BuildError::TooSmall { size: 1 }
    );
    let e = Limits::new(4, r(2, 3), r(1, 1), r(2, 4), Policy::Refuse).unwrap_err();
    assert_eq!(
        e,
        BuildError::ReservationsExceedSize {
            size: 4,
            request: 2,
            session_lock: 1,
            control: 2
        }
    );
    assert!(
        e.to_string()
            .contains("2 (request) + 1 (session_lock) + 2 (control) = 5 > 4"),
        "{e}"
    );
    let e = Limits::new(4, r(1, 3), r(0, 3), r(1, 4), Policy::Refuse).unwrap_err();
    assert_eq!(
        e,
        BuildError::SessionLockMaxStarvesWork {
            max: 3,
            size: 4,
            control_reserved: 1,
            request_reserved: 1
        }
    );
    assert_eq!(
        Limits::new(4, r(0, 3), r(0, 1), r(1, 4), Policy::Refuse).unwrap_err(),
        BuildError::NoRequestReserve
    );
    assert_eq!(
        Limits::new(4, r(1, 3), r(0, 1), r(0, 4), Policy::Refuse).unwrap_err(),
        BuildError::NoControlReserve
    );
    assert_eq!(
        Limits::new(4, r(1, 5), r(0, 1), r(1, 4), Policy::Refuse).unwrap_err(),
        BuildError::MaxAboveSize {
            lane: Lane::Request,
            max: 5,
            size: 4
        }
    );
}
