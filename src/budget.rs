//! The admission rule: which lane may take one more connection, now.
//!
//! This module is pure: plain data in, a [`Decision`] out, no I/O and no clock.
//! [`crate::Pool`] holds one [`Budget`] behind a mutex and asks it before every
//! checkout; the property tests at the bottom of this file drive it through
//! random interleavings of acquire, release and cancel.
//!
//! # The rule
//!
//! Let `N` be the pool size. A lane may take one more connection when
//!
//! 1. it is below its own maximum, and
//! 2. after taking it, the free connections still cover every *other* lane's
//!    unmet reservation (`reserved - in_use`, when positive).
//!
//! The session-lock lane has one more, hard, ceiling that no setting or
//! [`Policy`] lifts: it never holds more than
//! `N - control.reserved - request.reserved` connections, and
//! `request.reserved >= 1`, so the work done under held session locks can
//! always get a connection and the readiness probe always has its reserve.
//! Past its configured maximum, the session-lock lane is refused
//! ([`Policy::Refuse`]) or admitted with a warning ([`Policy::Warn`]) up to
//! that hard ceiling. Request and control checkouts that cannot be admitted
//! wait.

use std::fmt;

use crate::error::BuildError;

/// Why a connection is checked out.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Lane {
    /// Ordinary work: handlers, and the work done under a lock or a lease.
    /// The default lane of [`crate::Pool::get`].
    Request,
    /// A connection pinned by a session advisory lock.
    SessionLock,
    /// Short control statements that must never queue behind traffic:
    /// readiness probes, lease renewal and release.
    Control,
}

impl Lane {
    /// Every lane, in index order.
    pub const ALL: [Lane; 3] = [Lane::Request, Lane::SessionLock, Lane::Control];

    /// The lane's name as used in logs and metric labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            Lane::Request => "request",
            Lane::SessionLock => "session_lock",
            Lane::Control => "control",
        }
    }

    pub(crate) const fn idx(self) -> usize {
        match self {
            Lane::Request => 0,
            Lane::SessionLock => 1,
            Lane::Control => 2,
        }
    }
}

impl fmt::Display for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A lane's reserved minimum and its maximum.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LaneLimits {
    /// Connections that other lanes may never take from this one.
    pub reserved: usize,
    /// The most connections this lane may hold at once.
    pub max: usize,
}

/// What a session-lock checkout past its budget gets.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Refuse with [`crate::Error::BudgetExhausted`]. Default.
    #[default]
    Refuse,
    /// Admit, log once per call site through `tracing`, and count it; up to the
    /// hard floor (the control reserve and one request connection), past which
    /// it refuses too.
    Warn,
}

impl Policy {
    /// The policy's name as used in logs and metric labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            Policy::Refuse => "refuse",
            Policy::Warn => "warn",
        }
    }
}

/// Validated limits of every lane of a pool of `size` connections.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    size: usize,
    lanes: [LaneLimits; 3],
    policy: Policy,
}

impl Limits {
    /// The defaults for a pool of `size` connections:
    ///
    /// | lane | reserved | max |
    /// |---|---|---|
    /// | request | 1 | `size - 1` |
    /// | session lock | 0 | `min(max(1, size / 4), size - 2)` |
    /// | control | 1 | `size` |
    ///
    /// Policy: [`Policy::Refuse`]. A pool of 2 has no session-lock budget:
    /// one connection is the control reserve and one the request floor.
    pub fn defaults(size: usize) -> Result<Limits, BuildError> {
        let s = size.max(2);
        Limits::new(
            size,
            LaneLimits {
                reserved: 1,
                max: s - 1,
            },
            LaneLimits {
                reserved: 0,
                max: (s / 4).max(1).min(s - 2),
            },
            LaneLimits {
                reserved: 1,
                max: s,
            },
            Policy::Refuse,
        )
    }

    /// Validates a full set of limits.
    pub fn new(
        size: usize,
        request: LaneLimits,
        session_lock: LaneLimits,
        control: LaneLimits,
        policy: Policy,
    ) -> Result<Limits, BuildError> {
        if size < 2 {
            return Err(BuildError::TooSmall { size });
        }
        let lanes = [request, session_lock, control];
        for lane in Lane::ALL {
            let l = lanes[lane.idx()];
            if l.reserved > l.max {
                return Err(BuildError::ReservedAboveMax {
                    lane,
                    reserved: l.reserved,
                    max: l.max,
                });
            }
            if l.max > size {
                return Err(BuildError::MaxAboveSize {
                    lane,
                    max: l.max,
                    size,
                });
            }
        }
        if request.reserved < 1 {
            return Err(BuildError::NoRequestReserve);
        }
        if control.reserved < 1 {
            return Err(BuildError::NoControlReserve);
        }
        let sum = request.reserved + session_lock.reserved + control.reserved;
        if sum > size {
            return Err(BuildError::ReservationsExceedSize {
                size,
                request: request.reserved,
                session_lock: session_lock.reserved,
                control: control.reserved,
            });
        }
        let ceiling = size - control.reserved - request.reserved;
        if session_lock.max > ceiling {
            return Err(BuildError::SessionLockMaxStarvesWork {
                max: session_lock.max,
                size,
                control_reserved: control.reserved,
                request_reserved: request.reserved,
            });
        }
        Ok(Limits {
            size,
            lanes,
            policy,
        })
    }

    /// The pool size `N`.
    pub fn size(&self) -> usize {
        self.size
    }

    /// One lane's limits.
    pub fn lane(&self, lane: Lane) -> LaneLimits {
        self.lanes[lane.idx()]
    }

    /// The session-lock policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The hard ceiling of the session-lock lane, whatever the policy:
    /// `size - control.reserved - request.reserved`.
    pub fn session_lock_ceiling(&self) -> usize {
        self.size
            - self.lanes[Lane::Control.idx()].reserved
            - self.lanes[Lane::Request.idx()].reserved
    }
}

/// The answer to "may this lane take one more connection now?".
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Take it.
    Admit,
    /// Take it, though it is past the lane's budget ([`Policy::Warn`]).
    AdmitOverBudget,
    /// Not now: wait for a return.
    Wait,
    /// Never while the current holders hold: refuse.
    Refuse(Refusal),
}

/// Why a checkout was refused.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The lane is at its configured maximum and the policy is [`Policy::Refuse`].
    Budget {
        /// The configured maximum.
        limit: usize,
    },
    /// The lane is at the hard floor that no policy lifts.
    HardFloor {
        /// The hard ceiling (`size - control.reserved - request.reserved`).
        limit: usize,
    },
}

/// Connections in use per lane, under [`Limits`].
#[derive(Clone, Debug)]
pub struct Budget {
    limits: Limits,
    in_use: [usize; 3],
}

impl Budget {
    /// An empty budget.
    pub fn new(limits: Limits) -> Budget {
        Budget {
            limits,
            in_use: [0; 3],
        }
    }

    /// The limits.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Connections in use on `lane`.
    pub fn in_use(&self, lane: Lane) -> usize {
        self.in_use[lane.idx()]
    }

    /// Connections in use on every lane.
    pub fn total(&self) -> usize {
        self.in_use.iter().sum()
    }

    /// Decides, without changing anything.
    pub fn decide(&self, lane: Lane) -> Decision {
        let i = lane.idx();
        let held = self.in_use[i];
        let fits = self.fits(lane);
        if lane == Lane::SessionLock {
            let ceiling = self.limits.session_lock_ceiling();
            if held >= ceiling {
                return Decision::Refuse(Refusal::HardFloor { limit: ceiling });
            }
            let max = self.limits.lanes[i].max;
            if held >= max {
                return match self.limits.policy {
                    Policy::Refuse => Decision::Refuse(Refusal::Budget { limit: max }),
                    Policy::Warn if fits => Decision::AdmitOverBudget,
                    Policy::Warn => Decision::Wait,
                };
            }
        } else if held >= self.limits.lanes[i].max {
            return Decision::Wait;
        }
        if fits {
            Decision::Admit
        } else {
            Decision::Wait
        }
    }

    /// Does one more connection for `lane` leave every other lane's unmet
    /// reservation covered?
    fn fits(&self, lane: Lane) -> bool {
        let free = self.limits.size.saturating_sub(self.total());
        let owed: usize = Lane::ALL
            .iter()
            .filter(|l| **l != lane)
            .map(|l| {
                self.limits.lanes[l.idx()]
                    .reserved
                    .saturating_sub(self.in_use[l.idx()])
            })
            .sum();
        free > owed
    }

    /// Decides and, when admitted, counts the connection as taken.
    pub fn acquire(&mut self, lane: Lane) -> Decision {
        let d = self.decide(lane);
        if matches!(d, Decision::Admit | Decision::AdmitOverBudget) {
            self.in_use[lane.idx()] += 1;
        }
        d
    }

    /// Counts one connection of `lane` as returned.
    pub fn release(&mut self, lane: Lane) {
        let i = lane.idx();
        debug_assert!(self.in_use[i] > 0, "release without acquire on {lane}");
        self.in_use[i] = self.in_use[i].saturating_sub(1);
    }
}

#[cfg(test)]
mod tests;
