//! The admission state machine, the code that runs, driven through random
//! interleavings of checkouts (session locks that wait for the budget among
//! them), returns, releases, cancellations and resizes; every
//! effect it hands back is applied to a ledger of who holds and who waits,
//! and the invariants are checked after every step.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::budget::Decision;
use super::lane::{BudgetPolicy, Lane, Priority};
use super::limits::{LaneLimits, Limits};
use super::queue::{Admission, Answer, Effect, WaiterKey};

/// The classes of checkout the pool makes: lease statements urgent
/// (renewals, releases) or normal (acquisitions); every other lane normal.
fn class_strategy() -> impl Strategy<Value = (Lane, Priority)> {
    prop_oneof![
        3 => Just((Lane::Request, Priority::Normal)),
        3 => Just((Lane::SessionLock, Priority::Normal)),
        1 => Just((Lane::Control, Priority::Normal)),
        1 => Just((Lane::Probe, Priority::Normal)),
        2 => Just((Lane::Lease, Priority::Normal)),
        2 => Just((Lane::Lease, Priority::Urgent)),
    ]
}

#[derive(Clone, Debug)]
enum Op {
    /// A checkout asks (`patient`: a session lock that waits for the budget).
    Request(Lane, Priority, bool),
    /// The pool is resized to this size (refused sizes change nothing).
    Resize(usize),
    /// The k-th checkout out comes back.
    Return(usize),
    /// The k-th checkout out is let go, its return under way.
    MarkReleasing(usize),
    /// The k-th waiter gives up.
    Cancel(usize),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (class_strategy(), any::<bool>()).prop_map(|((l, p), patient)| Op::Request(l, p, patient)),
        1 => (2usize..12).prop_map(Op::Resize),
        3 => any::<usize>().prop_map(Op::Return),
        1 => any::<usize>().prop_map(Op::MarkReleasing),
        1 => any::<usize>().prop_map(Op::Cancel),
    ]
}

fn limits_strategy() -> impl Strategy<Value = Limits> {
    (
        2usize..10,
        any::<bool>(),
        0usize..3,
        0usize..2,
        0usize..3,
        any::<bool>(),
    )
        .prop_filter_map(
            "valid limits",
            |(size, defaults, sess_max, lease_res, ctl_res, warn)| {
                let policy = if warn {
                    BudgetPolicy::Warn
                } else {
                    BudgetPolicy::Refuse
                };
                let d = Limits::defaults(size).ok()?.with_policy(policy);
                if defaults {
                    return Some(d);
                }
                let mut lanes = d.lanes();
                lanes[Lane::SessionLock.idx()].max = sess_max;
                lanes[Lane::Lease.idx()] = LaneLimits {
                    reserved: lease_res,
                    max: (lease_res.max(1) + 1).max(lanes[Lane::Lease.idx()].max),
                };
                lanes[Lane::Control.idx()] = LaneLimits {
                    reserved: ctl_res,
                    max: ctl_res.max(1),
                };
                Limits::new(size, lanes, policy).ok()
            },
        )
}

#[derive(Clone, Copy, Debug)]
struct Out {
    lane: Lane,
    prio: Priority,
    releasing: bool,
}

/// Who holds and who waits, as the effects say.
struct Ledger {
    adm: Admission,
    out: Vec<Out>,
    /// Queued waiters by key: (lane, priority), in the order they queued.
    waiting: BTreeMap<WaiterKey, (Lane, Priority)>,
    /// Queued session locks that wait for the budget.
    patient: Vec<WaiterKey>,
    /// Since the last shrink: what was out past the new limits (the pool
    /// total, then per lane), never allowed to grow back while above them.
    over: (usize, [usize; Lane::COUNT]),
    /// A resize happened: waiters queued under other limits may wait until
    /// they reach the head of their queue to be refused.
    resized: bool,
    next_key: WaiterKey,
    cancelled: Vec<WaiterKey>,
}

impl Ledger {
    fn apply(&mut self, effects: Vec<Effect>) -> Result<(), TestCaseError> {
        for e in effects {
            match e {
                Effect::Grant {
                    key, lane, prio, ..
                } => {
                    prop_assert!(
                        !self.cancelled.contains(&key),
                        "a cancelled waiter was granted"
                    );
                    let class = self.waiting.remove(&key);
                    prop_assert_eq!(class, Some((lane, prio)), "granted a waiter not queued");
                    // FIFO within a lane and priority: nobody of its class
                    // queued before it is still waiting.
                    let older = self
                        .waiting
                        .iter()
                        .any(|(k, c)| *k < key && *c == (lane, prio));
                    prop_assert!(!older, "{lane} {prio:?}: granted out of order");
                    self.out.push(Out {
                        lane,
                        prio,
                        releasing: false,
                    });
                }
                Effect::Refuse { key, lane, .. } => {
                    prop_assert!(!self.cancelled.contains(&key));
                    prop_assert_eq!(lane, Lane::SessionLock, "only session locks are refused");
                    prop_assert!(self.waiting.remove(&key).is_some());
                    if self.patient.contains(&key) {
                        prop_assert_eq!(
                            self.session_limit(),
                            0,
                            "a patient waiter refused with a budget"
                        );
                    }
                    // Refused only when it can never be admitted while the
                    // current holders hold.
                    let (held, rel) = (self.adm.in_use(lane), self.adm.releasing(lane));
                    prop_assert!(
                        held - rel >= self.session_limit(),
                        "refused with room to come"
                    );
                }
            }
        }
        Ok(())
    }

    /// The most session locks may hold under the policy.
    fn session_limit(&self) -> usize {
        let l = self.adm.limits();
        match l.policy() {
            BudgetPolicy::Refuse => l.lane(Lane::SessionLock).max.min(l.session_lock_ceiling()),
            BudgetPolicy::Warn => l.session_lock_ceiling(),
        }
    }

    /// What was out past a shrink may only come down: the allowance follows
    /// the counts down, and never goes back up.
    fn settle(&mut self) {
        let b = self.adm.budget();
        self.over.0 = self.over.0.min(b.total());
        for lane in Lane::ALL {
            self.over.1[lane.idx()] = self.over.1[lane.idx()].min(b.in_use(lane));
        }
    }

    fn check(&self) -> Result<(), TestCaseError> {
        let l = self.adm.limits().clone();
        let b = self.adm.budget();
        prop_assert!(self.adm.consistent(), "kept summaries drifted");
        prop_assert_eq!(b.total(), self.out.len());
        prop_assert!(b.total() <= l.size().max(self.over.0), "more than N out");
        for lane in Lane::ALL {
            let mine: Vec<&Out> = self.out.iter().filter(|o| o.lane == lane).collect();
            prop_assert_eq!(b.in_use(lane), mine.len(), "{} in use", lane);
            prop_assert_eq!(
                b.releasing(lane),
                mine.iter().filter(|o| o.releasing).count()
            );
            let urgent = mine.iter().filter(|o| o.prio == Priority::Urgent).count();
            prop_assert_eq!(b.urgent(lane), urgent);
            let max = if lane == Lane::SessionLock {
                self.session_limit()
            } else {
                l.lane(lane).max
            };
            prop_assert!(
                mine.len() <= max.max(self.over.1[lane.idx()]),
                "{} past its max",
                lane
            );
            let queued = self.waiting.values().filter(|c| c.0 == lane).count();
            prop_assert_eq!(self.adm.pending(lane), queued);
        }
        prop_assert_eq!(self.adm.waiting(), self.waiting.len());
        // The probe reserve is never taken by another lane.
        let others = b.total() - b.in_use(Lane::Probe);
        prop_assert!(
            others <= (l.size() - l.lane(Lane::Probe).reserved).max(self.over.0),
            "probe reserve taken"
        );
        // Lease acquisitions never hold the slots kept for renewals.
        let lease_normal = b.in_use(Lane::Lease) - b.urgent(Lane::Lease);
        prop_assert!(lease_normal <= l.lease_normal_cap().max(self.over.1[Lane::Lease.idx()]));
        // Session locks: the hard ceiling, and the budget under Refuse.
        prop_assert!(
            b.in_use(Lane::SessionLock)
                <= self
                    .session_limit()
                    .max(self.over.1[Lane::SessionLock.idx()])
        );
        // Nobody waits who could be admitted now, and every queued session
        // lock will fit once the releases in flight and those ahead are done.
        let mut session_pos = 0;
        for (key, (lane, _)) in &self.waiting {
            if *lane == Lane::SessionLock && !self.patient.contains(key) && !self.resized {
                let settled = b.in_use(*lane) - b.releasing(*lane) + session_pos;
                prop_assert!(
                    settled < self.session_limit(),
                    "a session lock waits for nothing"
                );
                session_pos += 1;
            }
        }
        let mut heads: Vec<(Lane, Priority)> = self.waiting.values().copied().collect();
        heads.dedup();
        for (lane, prio) in heads {
            let d = b.decide(lane, prio, 0);
            prop_assert!(
                !matches!(d, Decision::Admit | Decision::AdmitOverBudget),
                "{lane} {prio:?} waits though admissible"
            );
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn interleavings_keep_the_invariants(
        limits in limits_strategy(),
        ops in prop::collection::vec(op_strategy(), 1..200),
    ) {
        let mut g = Ledger {
            adm: Admission::new(limits),
            out: vec![],
            waiting: BTreeMap::new(),
            patient: vec![],
            over: (0, [0; Lane::COUNT]),
            resized: false,
            next_key: 0,
            cancelled: vec![],
        };
        for op in ops {
            let mut effects = Vec::new();
            match op {
                Op::Request(lane, prio, patient) => {
                    let patient = patient && lane == Lane::SessionLock;
                    let key = g.next_key;
                    g.next_key += 1;
                    let claims = g.waiting.values().filter(|c| c.0 == Lane::SessionLock).count();
                    let before = (g.adm.in_use(lane), g.adm.releasing(lane));
                    // The read-only query predicts the answer exactly.
                    let predicted = g.adm.admits_now(lane, prio);
                    let answer = g.adm.request_with(lane, prio, key, patient);
                    prop_assert_eq!(predicted, matches!(answer, Answer::Admit { .. }), "{:?}", answer);
                    match answer {
                        Answer::Admit { .. } => g.out.push(Out { lane, prio, releasing: false }),
                        Answer::Queued => {
                            g.waiting.insert(key, (lane, prio));
                            if patient {
                                g.patient.push(key);
                            }
                        }
                        Answer::Refused(_) => {
                            prop_assert_eq!(lane, Lane::SessionLock);
                            if patient {
                                prop_assert_eq!(g.session_limit(), 0, "a patient request refused with a budget");
                            }
                            prop_assert_eq!((g.adm.in_use(lane), g.adm.releasing(lane)), before);
                            prop_assert!(before.0 - before.1 + claims >= g.session_limit());
                        }
                        Answer::Closed => prop_assert!(false, "not closed"),
                    }
                }
                Op::Resize(size) => {
                    if let Ok(limits) = g.adm.limits().resized(size) {
                        let b = g.adm.budget();
                        let lane_over = Lane::ALL.map(|l| b.in_use(l));
                        g.over = (b.total(), lane_over);
                        g.resized = true;
                        g.adm.set_limits(limits, |e| effects.push(e));
                    }
                }
                Op::Return(k) if !g.out.is_empty() => {
                    let o = g.out.remove(k % g.out.len());
                    let ok = g.adm.release(o.lane, o.prio, o.releasing, |e| effects.push(e));
                    prop_assert!(ok);
                }
                Op::MarkReleasing(k) if !g.out.is_empty() => {
                    let i = k % g.out.len();
                    if !g.out[i].releasing {
                        prop_assert!(g.adm.mark_releasing(g.out[i].lane));
                        g.out[i].releasing = true;
                    }
                }
                Op::Cancel(k) if !g.waiting.is_empty() => {
                    let (&key, &(lane, prio)) = g.waiting.iter().nth(k % g.waiting.len()).unwrap();
                    prop_assert!(g.adm.cancel(lane, prio, key, |e| effects.push(e)));
                    g.waiting.remove(&key);
                    g.cancelled.push(key);
                    // Gone without a trace: cancelling again finds nothing.
                    prop_assert!(!g.adm.cancel(lane, prio, key, |e| effects.push(e)));
                }
                _ => {}
            }
            g.apply(effects)?;
            g.check()?;
            g.settle();
        }
        // Everyone returns: every waiter is served or refused, nothing is left.
        while let Some(o) = g.out.pop() {
            let mut effects = Vec::new();
            g.adm.release(o.lane, o.prio, o.releasing, |e| effects.push(e));
            g.apply(effects)?;
            g.check()?;
            g.settle();
        }
        prop_assert!(g.waiting.is_empty(), "left waiting: {:?}", g.waiting);
    }
}
