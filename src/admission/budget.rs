//! The admission rule: may this lane, at this priority, take one more
//! connection now, must it wait, or is it refused?
//!
//! Let `N` be the pool size. A lane may take one more connection when
//!
//! 1. it is below its own maximum (and, for a lease acquisition, below the
//!    lease lane's normal cap: the lane's maximum less the slots kept for
//!    renewals and releases), and
//! 2. after taking it, the free connections still cover every *other*
//!    lane's unmet reservation (`reserved - in_use`, when positive). Short
//!    statements (control, the probe, urgent lease statements) may borrow
//!    the request reservation; nobody borrows any other.
//!
//! The session-lock lane has a hard ceiling no [`BudgetPolicy`] lifts
//! ([`Limits::session_lock_ceiling`]). Past its configured maximum it is
//! refused ([`BudgetPolicy::Refuse`]) or admitted with a warning ([`BudgetPolicy::Warn`])
//! up to that ceiling. A session-lock checkout that would be refused only
//! because of connections being *released* (a dropped guard whose unlock is
//! in flight) waits instead: the release frees its slot.

use super::lane::{BudgetPolicy, Lane, Priority};
use super::limits::Limits;

/// The answer to "may this lane take one more connection now?".
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Take it.
    Admit,
    /// Take it, though it is past the lane's budget ([`BudgetPolicy::Warn`]).
    AdmitOverBudget,
    /// Not now: wait for a return.
    Wait,
    /// Never while the current holders hold: refuse.
    Refuse(Refusal),
}

/// Why a checkout was refused.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The lane is at its configured maximum and the policy is [`BudgetPolicy::Refuse`].
    Budget {
        /// The configured maximum.
        limit: usize,
    },
    /// The lane is at the hard ceiling that no policy lifts.
    HardFloor {
        /// The hard ceiling.
        limit: usize,
    },
}

/// Connections in use per lane, under [`Limits`].
#[derive(Clone, Debug)]
pub(crate) struct Budget {
    limits: Limits,
    in_use: [usize; Lane::COUNT],
    /// Of `in_use`, the urgent checkouts: only they meet a lane's reservation
    /// when the lane keeps one for them (the lease lane).
    urgent: [usize; Lane::COUNT],
    /// Of `in_use`, the checkouts being released (their owner let go; they
    /// come back within a bound).
    releasing: [usize; Lane::COUNT],
    total: usize,
    /// The sum of every lane's unmet reservation, kept as counts change.
    unmet_total: usize,
}

impl Budget {
    pub(crate) fn new(limits: Limits) -> Budget {
        let unmet_total = limits.lanes().iter().map(|l| l.reserved).sum();
        Budget {
            limits,
            in_use: [0; Lane::COUNT],
            urgent: [0; Lane::COUNT],
            releasing: [0; Lane::COUNT],
            total: 0,
            unmet_total,
        }
    }

    pub(crate) fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Puts `limits` in force (a resize): the counts stay as they are. A
    /// lane holding more than its new maximum, or a pool more than its new
    /// size, admits nothing more until returns bring it below.
    pub(crate) fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
        self.unmet_total = Lane::ALL.iter().map(|l| self.unmet(*l)).sum();
    }

    pub(crate) fn in_use(&self, lane: Lane) -> usize {
        self.in_use[lane.idx()]
    }

    /// The kept unmet total matches the lanes' (for the property tests).
    #[cfg(test)]
    pub(crate) fn consistent(&self) -> bool {
        self.unmet_total == Lane::ALL.iter().map(|l| self.unmet(*l)).sum::<usize>()
    }

    #[cfg(test)]
    pub(crate) fn urgent(&self, lane: Lane) -> usize {
        self.urgent[lane.idx()]
    }

    pub(crate) fn releasing(&self, lane: Lane) -> usize {
        self.releasing[lane.idx()]
    }

    pub(crate) fn total(&self) -> usize {
        self.total
    }

    /// Decides for a checkout with `claims` checkouts of the same lane queued
    /// ahead of it, without changing anything.
    #[inline]
    pub(crate) fn decide(&self, lane: Lane, prio: Priority, claims: usize) -> Decision {
        let i = lane.idx();
        let held = self.in_use[i];
        if lane == Lane::SessionLock {
            return self.decide_session_lock(held, claims, prio);
        }
        if held + claims >= self.limits.lane(lane).max {
            return Decision::Wait;
        }
        if lane == Lane::Lease
            && prio == Priority::Normal
            && held - self.urgent[i] >= self.limits.lease_normal_cap()
        {
            return Decision::Wait;
        }
        if self.fits(lane, prio) {
            Decision::Admit
        } else {
            Decision::Wait
        }
    }

    #[inline(never)]
    fn decide_session_lock(&self, held: usize, claims: usize, prio: Priority) -> Decision {
        let lane = Lane::SessionLock;
        // Occupancy once the releases in flight are done and the checkouts
        // queued ahead are served: what this one would then have to fit in.
        let settled = held - self.releasing[lane.idx()] + claims;
        let now = held + claims;
        let ceiling = self.limits.session_lock_ceiling();
        let max = self.limits.lane(lane).max;
        let refuse_policy = self.limits.policy() == BudgetPolicy::Refuse;
        if settled >= ceiling {
            return Decision::Refuse(Refusal::HardFloor { limit: ceiling });
        }
        if refuse_policy && settled >= max {
            return Decision::Refuse(Refusal::Budget { limit: max });
        }
        // Room once the releases in flight are done: wait for them.
        if now >= ceiling || (refuse_policy && now >= max) {
            return Decision::Wait;
        }
        let over = now >= max;
        if claims > 0 || !self.fits(lane, prio) {
            return Decision::Wait;
        }
        if over {
            Decision::AdmitOverBudget
        } else {
            Decision::Admit
        }
    }

    /// Whether a checkout of `lane` can ever be admitted under these limits
    /// (the session-lock lane cannot when its budget, or under
    /// [`BudgetPolicy::Warn`] its hard ceiling, is 0).
    pub(crate) fn ever_admits(&self, lane: Lane) -> bool {
        if lane != Lane::SessionLock {
            return true;
        }
        let ceiling = self.limits.session_lock_ceiling();
        match self.limits.policy() {
            BudgetPolicy::Refuse => ceiling.min(self.limits.lane(lane).max) > 0,
            BudgetPolicy::Warn => ceiling > 0,
        }
    }

    /// The part of `lane`'s reservation not met now.
    fn unmet(&self, lane: Lane) -> usize {
        let i = lane.idx();
        let met = if lane == Lane::Lease {
            self.urgent[i]
        } else {
            self.in_use[i]
        };
        self.limits.lane(lane).reserved.saturating_sub(met)
    }

    /// Does one more connection for `lane` leave every other lane's unmet
    /// reservation covered?
    fn fits(&self, lane: Lane, prio: Priority) -> bool {
        let free = self.limits.size().saturating_sub(self.total);
        if free == 0 {
            return false;
        }
        // Short statements may borrow the request reserve (the work under
        // held session locks waits for them a moment); session locks and
        // lease acquisitions, which may hold on for long, may not.
        let borrows_request = matches!(lane, Lane::Control | Lane::Probe)
            || (lane == Lane::Lease && prio == Priority::Urgent);
        let mut owed = self.unmet_total;
        // A lease acquisition owes its own lane's reservation too: it is
        // the renewals'.
        if !(lane == Lane::Lease && prio == Priority::Normal) {
            owed -= self.unmet(lane);
        }
        if borrows_request {
            owed -= self.unmet(Lane::Request);
        }
        free > owed
    }

    /// Counts one connection of `lane` as taken (the caller decided first).
    pub(crate) fn take(&mut self, lane: Lane, prio: Priority) {
        let i = lane.idx();
        let before = self.unmet(lane);
        self.in_use[i] += 1;
        self.total += 1;
        if prio == Priority::Urgent {
            self.urgent[i] += 1;
        }
        self.unmet_total = self.unmet_total - before + self.unmet(lane);
    }

    /// Marks one connection of `lane` as being released. False when every
    /// connection of the lane is marked already (nothing changes).
    pub(crate) fn mark_releasing(&mut self, lane: Lane) -> bool {
        let i = lane.idx();
        if self.releasing[i] >= self.in_use[i] {
            return false;
        }
        self.releasing[i] += 1;
        true
    }

    /// Counts one connection of `lane` as returned. False (and nothing
    /// changes) for a return that was never taken.
    pub(crate) fn give_back(&mut self, lane: Lane, prio: Priority, releasing: bool) -> bool {
        let i = lane.idx();
        if self.in_use[i] == 0
            || (prio == Priority::Urgent && self.urgent[i] == 0)
            || (releasing && self.releasing[i] == 0)
        {
            return false;
        }
        let before = self.unmet(lane);
        self.in_use[i] -= 1;
        self.total -= 1;
        if prio == Priority::Urgent {
            self.urgent[i] -= 1;
        }
        if releasing {
            self.releasing[i] -= 1;
        }
        self.unmet_total = self.unmet_total - before + self.unmet(lane);
        true
    }
}
