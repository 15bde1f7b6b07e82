//! The admission state machine, one scenario at a time.

use super::lane::{BudgetPolicy, Lane, Priority};
use super::limits::Limits;
use super::queue::{Admission, Answer, Effect, WaiterKey};

fn adm(size: usize, policy: BudgetPolicy) -> Admission {
    Admission::new(Limits::defaults(size).unwrap().with_policy(policy))
}

fn collect(f: impl FnOnce(&mut Vec<Effect>)) -> Vec<Effect> {
    let mut v = Vec::new();
    f(&mut v);
    v
}

const N: Priority = Priority::Normal;

#[test]
fn a_session_lock_taken_again_while_its_guard_releases_waits_then_gets_it() {
    let mut a = adm(4, BudgetPolicy::Refuse);
    assert_eq!(
        a.request(Lane::SessionLock, N, 0),
        Answer::Admit { over_budget: false }
    );
    assert!(a.mark_releasing(Lane::SessionLock));
    assert_eq!(a.request(Lane::SessionLock, N, 1), Answer::Queued);
    let e = collect(|v| assert!(a.release(Lane::SessionLock, N, true, |e| v.push(e))));
    assert_eq!(
        e,
        [Effect::Grant {
            key: 1,
            lane: Lane::SessionLock,
            prio: N,
            over_budget: false
        }]
    );
}

#[test]
fn a_session_lock_that_can_never_be_admitted_is_refused_at_once() {
    let mut a = adm(4, BudgetPolicy::Refuse);
    assert_eq!(
        a.request(Lane::SessionLock, N, 0),
        Answer::Admit { over_budget: false }
    );
    a.mark_releasing(Lane::SessionLock);
    assert_eq!(a.request(Lane::SessionLock, N, 1), Answer::Queued);
    // The one slot the release frees is the first waiter's.
    assert!(matches!(
        a.request(Lane::SessionLock, N, 2),
        Answer::Refused(_)
    ));
    // Warn: over budget, the pool full, two waiting for room; the first one
    // in takes the lane to its hard ceiling and the second is refused then.
    let mut a = adm(4, BudgetPolicy::Warn);
    assert_eq!(
        a.request(Lane::SessionLock, N, 0),
        Answer::Admit { over_budget: false }
    );
    for k in 1..=2 {
        assert_eq!(
            a.request(Lane::Request, N, k),
            Answer::Admit { over_budget: false }
        );
    }
    assert_eq!(a.request(Lane::SessionLock, N, 3), Answer::Queued);
    assert!(matches!(
        a.request(Lane::SessionLock, N, 4),
        Answer::Refused(_)
    ));
    let e = collect(|v| assert!(a.release(Lane::Request, N, false, |e| v.push(e))));
    assert_eq!(
        e,
        [Effect::Grant {
            key: 3,
            lane: Lane::SessionLock,
            prio: N,
            over_budget: true
        }]
    );
}

#[test]
fn fifo_within_a_lane_urgent_first_across() {
    let mut a = adm(4, BudgetPolicy::Refuse);
    for k in 0..3 {
        assert_eq!(
            a.request(Lane::Request, N, k),
            Answer::Admit { over_budget: false }
        );
    }
    for k in 10..13 {
        assert_eq!(a.request(Lane::Request, N, k), Answer::Queued);
    }
    assert_eq!(a.request(Lane::Lease, Priority::Urgent, 20), Answer::Queued);
    let mut granted = Vec::new();
    for _ in 0..4 {
        a.release(Lane::Request, N, false, |e| granted.push(e));
        if let Some(Effect::Grant { lane, prio, .. }) = granted.last().copied() {
            a.release(lane, prio, false, |e| granted.push(e));
        }
    }
    let keys: Vec<WaiterKey> = granted
        .iter()
        .map(|e| match e {
            Effect::Grant { key, .. } | Effect::Refuse { key, .. } => *key,
        })
        .collect();
    assert_eq!(
        keys,
        [20, 10, 11, 12],
        "the renewal first, then requests in order"
    );
}

#[test]
fn close_drops_every_waiter() {
    let mut a = adm(2, BudgetPolicy::Refuse);
    assert_eq!(
        a.request(Lane::Request, N, 0),
        Answer::Admit { over_budget: false }
    );
    assert_eq!(a.request(Lane::Request, N, 1), Answer::Queued);
    let mut gone = Vec::new();
    a.close(|k| gone.push(k));
    assert_eq!(
        (gone, a.waiting(), a.pending(Lane::Request)),
        (vec![1], 0, 0)
    );
    assert_eq!(a.request(Lane::Probe, N, 2), Answer::Closed);
    assert!(a.release(Lane::Request, N, false, |_| panic!("nobody waits")));
}
