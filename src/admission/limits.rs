//! Validated lane limits and their defaults.

use super::lane::{BudgetPolicy, Lane};

/// The largest pool pgwarden accepts: PostgreSQL's own upper limit for
/// `max_connections` (2^18 - 1). A larger size can never be served, and
/// deadpool would try to allocate for it up front.
pub(crate) const MAX_POOL_SIZE: usize = 262_143;

/// A lane's reserved minimum and its maximum.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct LaneLimits {
    /// Connections that other lanes may never take from this one.
    pub(crate) reserved: usize,
    /// The most connections this lane may hold at once.
    pub(crate) max: usize,
}

/// Lane limits that cannot work: what a pool build, or a
/// [`resize`](crate::Pool::resize), refuses. Each names the numbers that
/// clash. [`crate::BuildError`] wraps it.
///
/// ```
/// let e = pgwarden::Pool::from_url("host=/tmp", 1 << 20).unwrap_err();
/// assert!(matches!(e, pgwarden::BuildError::Limits(pgwarden::LimitsError::TooLarge { .. })), "{e}");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LimitsError {
    /// Fewer than two connections: one is the readiness probe's reserve and
    /// one is for everything else.
    #[error(
        "pool size {size} is too small: pgwarden needs at least 2 (1 probe reserve + 1 for the rest)"
    )]
    TooSmall {
        /// The size given.
        size: usize,
    },
    /// More connections than PostgreSQL can ever allow.
    #[error(
        "pool size {size} is above the maximum {max} (PostgreSQL's own max_connections limit)"
    )]
    TooLarge {
        /// The size given.
        size: usize,
        /// The largest size accepted: 262 143 (PostgreSQL's own limit for
        /// `max_connections`).
        max: usize,
    },
    /// Reservations leave no connection unreserved: at least one must stay
    /// free of every reservation (lease acquisitions, and each lane's first
    /// connection beyond its reserve, take it).
    #[error(
        "lane reservations leave no connection of the pool unreserved: {request} (request) + \
         {session_lock} (session_lock) + {control} (control) + {probe} (probe) + {lease} (lease) = {} \
         with a pool size of {size}; reserve at most {}",
        request + session_lock + control + probe + lease,
        size - 1
    )]
    ReservationsExceedSize {
        /// Pool size.
        size: usize,
        /// Request reservation.
        request: usize,
        /// Session-lock reservation.
        session_lock: usize,
        /// Control reservation.
        control: usize,
        /// Probe reservation.
        probe: usize,
        /// Lease reservation.
        lease: usize,
    },
    /// A lane reserves more than its maximum.
    #[error("{lane} lane reserves {reserved} but its maximum is {max}")]
    ReservedAboveMax {
        /// The lane.
        lane: Lane,
        /// Its reservation.
        reserved: usize,
        /// Its maximum.
        max: usize,
    },
    /// A lane's maximum is above the pool size.
    #[error("{lane} lane maximum {max} is above the pool size {size}")]
    MaxAboveSize {
        /// The lane.
        lane: Lane,
        /// Its maximum.
        max: usize,
        /// Pool size.
        size: usize,
    },
    /// The probe lane must reserve at least one connection.
    #[error("the probe lane reserves {reserved}: it must reserve at least 1, or readiness probes queue behind traffic")]
    NoProbeReserve {
        /// The reservation given.
        reserved: usize,
    },
    /// The lease lane's maximum leaves acquisitions no slot beyond the one
    /// kept for renewals and releases.
    #[error(
        "lease lane maximum {max} is too small: renewals and releases keep {kept} slot(s) (the reservation, \
         at least 1) that acquisitions may not take; use a maximum of at least {}",
        kept + 1
    )]
    LeaseMaxTooSmall {
        /// The maximum given.
        max: usize,
        /// Slots kept for renewals and releases.
        kept: usize,
    },
    /// The session-lock maximum would leave the work under those locks no
    /// connection.
    #[error(
        "session_lock maximum {max} leaves the work under those locks no connection: pool size {size} - \
         other lanes' reservations {reserved} (request counted as at least 1, for that work) = {} is the \
         most session locks may pin",
        size.saturating_sub(*reserved)
    )]
    SessionLockMaxStarvesWork {
        /// The maximum asked for.
        max: usize,
        /// Pool size.
        size: usize,
        /// Reservations of every other lane, the request one counted as at
        /// least 1.
        reserved: usize,
    },
}

/// Validated limits of every lane of a pool of `size` connections.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Limits {
    size: usize,
    lanes: [LaneLimits; Lane::COUNT],
    policy: BudgetPolicy,
    /// Precomputed: the session-lock hard ceiling.
    ceiling: usize,
    /// The lanes set explicitly; the others follow the size (a resize
    /// derives them again).
    overrides: [Option<LaneLimits>; Lane::COUNT],
}

impl Limits {
    /// The defaults for a pool of `size` connections (2 to [`MAX_POOL_SIZE`]):
    ///
    /// | lane | reserved | max |
    /// |---|---|---|
    /// | request | 1 (0 when `size` is 2) | `size - 1` |
    /// | session lock | 0 | `min(max(1, size / 4), size - 2)` |
    /// | control | 0 | 1 |
    /// | probe | 1 | 1 |
    /// | lease | 0 | `max(2, size / 2)` |
    ///
    /// BudgetPolicy: [`BudgetPolicy::Refuse`].
    ///
    /// - No lane but the probe may take the probe's reserve.
    /// - The request reserve is for the work under held session locks; short
    ///   statements (control, the probe beyond its own reserve, lease renewals
    ///   and releases) may borrow it for a moment, session locks and lease
    ///   acquisitions may not.
    /// - In the lease lane, renewals and releases go before acquisitions and
    ///   every other waiter, and acquisitions hold at most `max - 1`
    ///   connections (a lease reservation, when set, is theirs alone).
    /// - A pool of 2 has the probe reserve and one shared connection: request
    ///   work, control and lease statements take turns on it, and it has no
    ///   session-lock budget. A pool of 3 has a session-lock budget of 1.
    ///
    #[cfg(test)]
    pub(crate) fn defaults(size: usize) -> Result<Limits, LimitsError> {
        check_size(size)?;
        Limits::derive(size, [None; Lane::COUNT], BudgetPolicy::Refuse)
    }

    /// The default limits of every lane (unvalidated; `size >= 2`).
    pub(crate) fn default_lanes(size: usize) -> [LaneLimits; Lane::COUNT] {
        let s = size.max(2);
        let request_reserved = usize::from(s >= 3);
        let mut lanes = [LaneLimits {
            reserved: 0,
            max: 0,
        }; Lane::COUNT];
        lanes[Lane::Request.idx()] = LaneLimits {
            reserved: request_reserved,
            max: s - 1,
        };
        lanes[Lane::SessionLock.idx()] = LaneLimits {
            reserved: 0,
            max: if s >= 3 { (s / 4).clamp(1, s - 2) } else { 0 },
        };
        lanes[Lane::Control.idx()] = LaneLimits {
            reserved: 0,
            max: 1,
        };
        lanes[Lane::Probe.idx()] = LaneLimits {
            reserved: 1,
            max: 1,
        };
        lanes[Lane::Lease.idx()] = LaneLimits {
            reserved: 0,
            max: (s / 2).max(2),
        };
        lanes
    }

    /// The limits of a pool of `size`: the lanes in `overrides` as set, the
    /// others at their defaults for that size, and unless set, the request
    /// maximum what the other lanes' reservations leave. Validated.
    pub(crate) fn derive(
        size: usize,
        overrides: [Option<LaneLimits>; Lane::COUNT],
        policy: BudgetPolicy,
    ) -> Result<Limits, LimitsError> {
        let mut lanes = Limits::default_lanes(size);
        for lane in Lane::ALL {
            if let Some(l) = overrides[lane.idx()] {
                lanes[lane.idx()] = l;
            }
        }
        if overrides[Lane::Request.idx()].is_none() {
            let reserved: usize = Lane::ALL
                .iter()
                .filter(|l| **l != Lane::Request)
                .map(|l| lanes[l.idx()].reserved)
                .fold(0, usize::saturating_add);
            let r = &mut lanes[Lane::Request.idx()];
            r.max = size.saturating_sub(reserved).max(r.reserved);
        }
        let mut limits = Limits::new(size, lanes, policy)?;
        limits.overrides = overrides;
        Ok(limits)
    }

    /// The same settings for a pool of `size`: the lanes set explicitly
    /// kept, the others derived again. Refused, with the numbers that clash,
    /// when a setting cannot work at that size (a reservation, or a lane's
    /// maximum, that no longer fits).
    pub(crate) fn resized(&self, size: usize) -> Result<Limits, LimitsError> {
        Limits::derive(size, self.overrides, self.policy)
    }

    /// Validates a full set of limits, one per lane in [`Lane::ALL`] order
    /// (`budget_tests` covers each refusal). Every lane counts as set.
    pub(crate) fn new(
        size: usize,
        lanes: [LaneLimits; Lane::COUNT],
        policy: BudgetPolicy,
    ) -> Result<Limits, LimitsError> {
        check_size(size)?;
        for lane in Lane::ALL {
            let l = lanes[lane.idx()];
            if l.reserved > l.max {
                return Err(LimitsError::ReservedAboveMax {
                    lane,
                    reserved: l.reserved,
                    max: l.max,
                });
            }
            if l.max > size {
                return Err(LimitsError::MaxAboveSize {
                    lane,
                    max: l.max,
                    size,
                });
            }
        }
        let probe = lanes[Lane::Probe.idx()];
        if probe.reserved < 1 {
            return Err(LimitsError::NoProbeReserve {
                reserved: probe.reserved,
            });
        }
        let lease = lanes[Lane::Lease.idx()];
        let kept = lease.reserved.max(1);
        if lease.max < kept + 1 {
            return Err(LimitsError::LeaseMaxTooSmall {
                max: lease.max,
                kept,
            });
        }
        // Each reservation is at most `size` (checked above): no overflow.
        let sum: usize = lanes.iter().map(|l| l.reserved).sum();
        if sum >= size {
            return Err(LimitsError::ReservationsExceedSize {
                size,
                request: lanes[Lane::Request.idx()].reserved,
                session_lock: lanes[Lane::SessionLock.idx()].reserved,
                control: lanes[Lane::Control.idx()].reserved,
                probe: probe.reserved,
                lease: lease.reserved,
            });
        }
        let reserved = others_reserved(&lanes);
        let ceiling = size.saturating_sub(reserved);
        let session = lanes[Lane::SessionLock.idx()];
        if session.max > ceiling {
            return Err(LimitsError::SessionLockMaxStarvesWork {
                max: session.max,
                size,
                reserved,
            });
        }
        Ok(Limits {
            size,
            lanes,
            policy,
            ceiling,
            overrides: lanes.map(Some),
        })
    }

    /// The pool size `N`.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// One lane's limits.
    pub(crate) fn lane(&self, lane: Lane) -> LaneLimits {
        self.lanes[lane.idx()]
    }

    /// Every lane's limits, in [`Lane::ALL`] order.
    pub(crate) fn lanes(&self) -> [LaneLimits; Lane::COUNT] {
        self.lanes
    }

    /// The session-lock policy.
    pub(crate) fn policy(&self) -> BudgetPolicy {
        self.policy
    }

    /// The same limits under another policy.
    #[cfg(test)]
    pub(crate) fn with_policy(mut self, policy: BudgetPolicy) -> Limits {
        self.policy = policy;
        self
    }

    /// The hard ceiling of the session-lock lane, whatever the policy: the
    /// pool size less every other lane's reservation and one connection for
    /// the work under the locks (the request reservation, at least 1).
    pub(crate) fn session_lock_ceiling(&self) -> usize {
        self.ceiling
    }

    /// How many connections acquisitions (normal-priority lease
    /// statements) may hold: the lease maximum less the slots kept for
    /// renewals and releases.
    pub(crate) fn lease_normal_cap(&self) -> usize {
        let l = self.lanes[Lane::Lease.idx()];
        l.max.saturating_sub(l.reserved.max(1))
    }
}

fn check_size(size: usize) -> Result<(), LimitsError> {
    if size < 2 {
        return Err(LimitsError::TooSmall { size });
    }
    if size > MAX_POOL_SIZE {
        return Err(LimitsError::TooLarge {
            size,
            max: MAX_POOL_SIZE,
        });
    }
    Ok(())
}

/// Every reservation but the session-lock lane's, the request one counted as
/// at least 1 (the work under held locks).
fn others_reserved(lanes: &[LaneLimits; Lane::COUNT]) -> usize {
    Lane::ALL
        .iter()
        .filter(|l| **l != Lane::SessionLock)
        .map(|l| match l {
            Lane::Request => lanes[l.idx()].reserved.max(1),
            _ => lanes[l.idx()].reserved,
        })
        .sum()
}
