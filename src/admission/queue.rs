//! The admission state machine: the budget, the FIFO queues of waiters,
//! grants, refusals, and the "releasing" state of a checkout whose owner
//! let go. Plain data: the pool's shell keeps each waiter's channel under
//! the key it passes in, and applies the [`Effect`]s handed back.
//!
//! Order: one FIFO queue per (lane, priority). When a connection comes back,
//! urgent waiters are served first, then the waiter that has waited longest
//! among those whose lane may take it. A waiter that can never be admitted
//! while the current holders hold is refused at once, when it asks or as
//! soon as that becomes true.

use std::collections::VecDeque;

use super::budget::{Budget, Decision, Refusal};
use super::lane::{Lane, Priority};
use super::limits::Limits;

/// The shell's name for a waiter (its slot in the shell's table).
pub(crate) type WaiterKey = usize;

const QUEUES: usize = Lane::COUNT * 2;

const fn queue_of(lane: Lane, prio: Priority) -> usize {
    prio.idx() * Lane::COUNT + lane.idx()
}

const fn class_of(q: usize) -> (Lane, Priority) {
    let lane = Lane::ALL[q % Lane::COUNT];
    let prio = if q < Lane::COUNT {
        Priority::Urgent
    } else {
        Priority::Normal
    };
    (lane, prio)
}

#[derive(Copy, Clone, Debug)]
struct Queued {
    key: WaiterKey,
    seq: u64,
    /// Waits for the session-lock budget rather than being refused while
    /// other locks hold it (a `session_lock` with a wait).
    patient: bool,
}

/// The answer to a checkout.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Admitted now (`over_budget`: past the session-lock budget, [`crate::BudgetPolicy::Warn`]).
    Admit {
        /// Admitted past the lane's budget.
        over_budget: bool,
    },
    /// Queued under the key given: an [`Effect`] names it later.
    Queued,
    /// Refused: it could never be admitted while the current holders hold.
    Refused(Refusal),
    /// The pool is closed.
    Closed,
}

/// What the shell must do for a queued waiter.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Effect {
    /// Hand it its connection: it is counted in the budget now.
    Grant {
        /// The waiter.
        key: WaiterKey,
        /// Its lane.
        lane: Lane,
        /// Its priority.
        prio: Priority,
        /// Admitted past the lane's budget.
        over_budget: bool,
    },
    /// Tell it no: it can no longer be admitted. It is off the queue.
    Refuse {
        /// The waiter.
        key: WaiterKey,
        /// Its lane.
        lane: Lane,
        /// Why.
        refusal: Refusal,
    },
}

/// The budget and the queues of one pool.
#[derive(Debug)]
pub(crate) struct Admission {
    budget: Budget,
    queues: [VecDeque<Queued>; QUEUES],
    /// A bit per non-empty queue: a return looks at those only.
    nonempty: u16,
    pending: [usize; Lane::COUNT],
    waiting: usize,
    seq: u64,
    closed: bool,
}

impl Admission {
    pub(crate) fn new(limits: Limits) -> Admission {
        Admission {
            budget: Budget::new(limits),
            queues: Default::default(),
            nonempty: 0,
            pending: [0; Lane::COUNT],
            waiting: 0,
            seq: 0,
            closed: false,
        }
    }

    pub(crate) fn limits(&self) -> &Limits {
        self.budget.limits()
    }

    pub(crate) fn in_use(&self, lane: Lane) -> usize {
        self.budget.in_use(lane)
    }

    pub(crate) fn releasing(&self, lane: Lane) -> usize {
        self.budget.releasing(lane)
    }

    pub(crate) fn total(&self) -> usize {
        self.budget.total()
    }

    /// Waiters queued on `lane`, every priority.
    pub(crate) fn pending(&self, lane: Lane) -> usize {
        self.pending[lane.idx()]
    }

    /// Waiters queued, every lane.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting
    }

    /// Whether a checkout of `lane` at `prio` would be admitted at once
    /// (nothing changes).
    #[cfg_attr(not(feature = "http"), allow(dead_code))]
    pub(crate) fn admits_now(&self, lane: Lane, prio: Priority) -> bool {
        let claims = if lane == Lane::SessionLock {
            self.pending[lane.idx()]
        } else {
            0
        };
        !self.closed
            && self.queues[queue_of(lane, prio)].is_empty()
            && matches!(
                self.budget.decide(lane, prio, claims),
                Decision::Admit | Decision::AdmitOverBudget
            )
    }

    /// Whether [`Admission::close`] was called.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed
    }

    /// A checkout of `lane` at `prio` asks for a connection. When queued, it
    /// is known as `key` from then on.
    #[cfg(test)]
    pub(crate) fn request(&mut self, lane: Lane, prio: Priority, key: WaiterKey) -> Answer {
        self.request_with(lane, prio, key, false)
    }

    /// [`Admission::request`], and when `patient`, a session-lock checkout
    /// refused only because other checkouts hold the budget now waits in
    /// FIFO order for one of them to come back instead. One that can never
    /// be admitted (a budget or hard ceiling of 0) is still refused at once.
    pub(crate) fn request_with(
        &mut self,
        lane: Lane,
        prio: Priority,
        key: WaiterKey,
        patient: bool,
    ) -> Answer {
        if self.closed {
            return Answer::Closed;
        }
        let q = queue_of(lane, prio);
        // Session locks queued ahead claim the slots that releases free
        // first (other lanes never refuse: a queue ahead means wait).
        let claims = if lane == Lane::SessionLock {
            self.pending[lane.idx()]
        } else {
            0
        };
        match self.budget.decide(lane, prio, claims) {
            Decision::Refuse(r) if !(patient && self.budget.ever_admits(lane)) => {
                Answer::Refused(r)
            }
            d @ (Decision::Admit | Decision::AdmitOverBudget) if self.queues[q].is_empty() => {
                self.budget.take(lane, prio);
                Answer::Admit {
                    over_budget: d == Decision::AdmitOverBudget,
                }
            }
            _ => {
                self.seq += 1;
                self.queues[q].push_back(Queued {
                    key,
                    seq: self.seq,
                    patient,
                });
                self.nonempty |= 1 << q;
                self.pending[lane.idx()] += 1;
                self.waiting += 1;
                Answer::Queued
            }
        }
    }

    /// A queued waiter gave up (timed out, or its future was dropped): it
    /// leaves no trace. False when it was not queued (granted or refused
    /// already, or never queued).
    pub(crate) fn cancel(
        &mut self,
        lane: Lane,
        prio: Priority,
        key: WaiterKey,
        emit: impl FnMut(Effect),
    ) -> bool {
        let q = queue_of(lane, prio);
        let Some(pos) = self.queues[q].iter().position(|w| w.key == key) else {
            return false;
        };
        self.queues[q].remove(pos);
        self.mark(q);
        self.pending[lane.idx()] -= 1;
        self.waiting -= 1;
        // Those behind it claimed less than they thought: serve again.
        self.serve(emit);
        true
    }

    /// A checkout of `lane` at `prio` came back (`releasing`: it had been
    /// marked so). Serves the waiters it makes room for.
    pub(crate) fn release(
        &mut self,
        lane: Lane,
        prio: Priority,
        releasing: bool,
        emit: impl FnMut(Effect),
    ) -> bool {
        if !self.budget.give_back(lane, prio, releasing) {
            return false;
        }
        self.serve(emit);
        true
    }

    /// The owner of a checkout of `lane` let go and its return is under way
    /// (a dropped session-lock guard whose unlock is in flight): a checkout
    /// that would be refused only because of it waits instead. False when
    /// every checkout of the lane is marked already.
    pub(crate) fn mark_releasing(&mut self, lane: Lane) -> bool {
        self.budget.mark_releasing(lane)
    }

    /// Puts `limits` in force (a resize) and serves the waiters they make
    /// room for, or refuses those that can never be admitted under them.
    /// Checkouts out stay out: a pool shrunk below what is out admits
    /// nothing more until returns bring it below the new size.
    pub(crate) fn set_limits(&mut self, limits: Limits, emit: impl FnMut(Effect)) {
        self.budget.set_limits(limits);
        self.serve(emit);
    }

    /// Closes: every waiter is dropped from the queues (`gone` names each),
    /// and every later request gets [`Answer::Closed`]. Checkouts out still
    /// come back through [`Admission::release`].
    pub(crate) fn close(&mut self, mut gone: impl FnMut(WaiterKey)) {
        self.closed = true;
        for q in &mut self.queues {
            for w in q.drain(..) {
                gone(w.key);
            }
        }
        self.pending = [0; Lane::COUNT];
        self.waiting = 0;
        self.nonempty = 0;
    }

    /// Keeps queue `q`'s bit in `nonempty` true to its contents.
    fn mark(&mut self, q: usize) {
        if self.queues[q].is_empty() {
            self.nonempty &= !(1 << q);
        }
    }

    /// Grants every queued waiter that may be admitted now, urgent ones
    /// first, then oldest first; refuses those that never can be.
    fn serve(&mut self, mut emit: impl FnMut(Effect)) {
        if self.waiting == 0 {
            return;
        }
        // One queue waiting (the usual case under load): its heads in order.
        if self.nonempty.count_ones() == 1 {
            let q = self.nonempty.trailing_zeros() as usize;
            let (lane, _) = class_of(q);
            while let Some((_, over_budget)) = self.head(q, lane, &mut emit) {
                self.grant(q, over_budget, &mut emit);
            }
            return;
        }
        while self.waiting > 0 {
            // The admissible queue head to serve: urgent before normal, then
            // the lowest sequence number.
            let mut best: Option<(usize, bool, u64, bool)> = None;
            let mut bits = self.nonempty;
            while bits != 0 {
                let q = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let (lane, prio) = class_of(q);
                let Some(head) = self.head(q, lane, &mut emit) else {
                    continue;
                };
                let (seq, over) = head;
                let urgent = prio == Priority::Urgent;
                let better = match best {
                    None => true,
                    Some((_, b_urgent, b_seq, _)) => {
                        (urgent && !b_urgent) || (urgent == b_urgent && seq < b_seq)
                    }
                };
                if better {
                    best = Some((q, urgent, seq, over));
                }
            }
            let Some((q, _, _, over_budget)) = best else {
                return;
            };
            self.grant(q, over_budget, &mut emit);
        }
    }

    /// Grants the head of queue `q` (the caller decided it may be admitted).
    fn grant(&mut self, q: usize, over_budget: bool, emit: &mut impl FnMut(Effect)) {
        let (lane, prio) = class_of(q);
        let Some(w) = self.queues[q].pop_front() else {
            return;
        };
        self.mark(q);
        self.pending[lane.idx()] -= 1;
        self.waiting -= 1;
        self.budget.take(lane, prio);
        emit(Effect::Grant {
            key: w.key,
            lane,
            prio,
            over_budget,
        });
    }

    /// The head of queue `q` when it may be admitted now (its sequence
    /// number, and whether past the budget); heads that never can be are
    /// refused on the way.
    fn head(&mut self, q: usize, lane: Lane, emit: &mut impl FnMut(Effect)) -> Option<(u64, bool)> {
        let (_, prio) = class_of(q);
        loop {
            let head = *self.queues[q].front()?;
            match self.budget.decide(lane, prio, 0) {
                Decision::Admit => return Some((head.seq, false)),
                Decision::AdmitOverBudget => return Some((head.seq, true)),
                Decision::Wait => return None,
                Decision::Refuse(_) if head.patient && self.budget.ever_admits(lane) => {
                    return None
                }
                Decision::Refuse(refusal) => {
                    self.queues[q].pop_front();
                    self.mark(q);
                    self.pending[lane.idx()] -= 1;
                    self.waiting -= 1;
                    emit(Effect::Refuse {
                        key: head.key,
                        lane,
                        refusal,
                    });
                }
            }
        }
    }
}

#[cfg(test)]
impl Admission {
    /// The budget, for the property tests' invariants.
    pub(crate) fn budget(&self) -> &Budget {
        &self.budget
    }

    /// The kept summaries match the queues and the budget.
    pub(crate) fn consistent(&self) -> bool {
        let bits =
            (0..QUEUES).all(|q| (self.nonempty & (1 << q) != 0) != self.queues[q].is_empty());
        bits && self.budget.consistent()
    }
}
