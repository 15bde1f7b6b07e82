//! What a lane looks like to someone deciding whether to queue for it: in
//! use, limits, waiters, whether a checkout would be admitted now, and how
//! long its connections have been held lately (an average kept in the
//! return path, under the lock the return takes anyway: no shared cache
//! line of its own to bounce between cores).

use std::time::Duration;

use super::shared::Shared;
use crate::admission::{Lane, Priority};

/// One lane's load, read under the pool's lock in one go.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct LaneLoad {
    /// Connections of the lane out now.
    pub(crate) in_use: usize,
    /// The lane's maximum.
    pub(crate) max: usize,
    /// Checkouts of the lane waiting now.
    pub(crate) pending: usize,
    /// How many connections the lane can hold at once now: its maximum,
    /// less what the other lanes hold or keep in reserve (at least what it
    /// holds, and at least 1).
    pub(crate) capacity: usize,
    /// Whether a checkout of the lane would be admitted at once.
    pub(crate) admits_now: bool,
    /// The lane's recent hold time (`None` before its first return).
    pub(crate) recent_hold: Option<Duration>,
    /// The pool is closed.
    pub(crate) closed: bool,
}

impl Shared {
    pub(crate) fn lane_load(&self, lane: Lane) -> LaneLoad {
        let st = self.state.lock();
        let recent_hold = st.holds.get(lane);
        let adm = &st.adm;
        let limits = adm.limits();
        let in_use = adm.in_use(lane);
        let max = limits.lane(lane).max;
        let others: usize = Lane::ALL
            .iter()
            .filter(|l| **l != lane)
            .map(|l| adm.in_use(*l).max(limits.lane(*l).reserved))
            .sum();
        let capacity = max
            .min(limits.size().saturating_sub(others))
            .max(in_use)
            .max(1);
        LaneLoad {
            in_use,
            max,
            pending: adm.pending(lane),
            capacity,
            admits_now: adm.admits_now(lane, Priority::Normal),
            recent_hold,
            closed: adm.is_closed(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::holds::RecentHolds;

    #[test]
    fn recent_holds_rise_fast_and_fall_slowly() {
        let mut h = RecentHolds::default();
        assert_eq!(h.get(Lane::Request), None);
        let ms = Duration::from_millis;
        h.record(Lane::Request, ms(5));
        assert_eq!(h.get(Lane::Request), Some(ms(5)));
        for _ in 0..4 {
            h.record(Lane::Request, ms(50));
        }
        let up = h.get(Lane::Request).unwrap();
        assert!(up > ms(45) && up <= ms(50), "{up:?}");
        h.record(Lane::Request, ms(10));
        let down = h.get(Lane::Request).unwrap();
        assert!(down > ms(40), "{down:?}");
        assert_eq!(h.get(Lane::Probe), None);
        h.record(Lane::Probe, Duration::ZERO);
        assert!(
            h.get(Lane::Probe).is_some(),
            "a zero hold still counts as seen"
        );
        h.record(Lane::Lease, Duration::MAX);
        assert!(h.get(Lane::Lease).is_some());
    }
}
