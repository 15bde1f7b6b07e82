//! Recent hold times per lane, kept in the return path.

use std::time::Duration;

use crate::admission::Lane;

/// Recent hold times per lane: an exponentially weighted moving average,
/// in nanoseconds, 0 until the first return. Part of the pool's state.
///
/// It rises fast (half the gap per sample) and falls slowly (an eighth),
/// so a wait estimated from it errs on the long side when holds grow.
#[derive(Debug, Default)]
pub(crate) struct RecentHolds([u64; Lane::COUNT]);

impl RecentHolds {
    /// Folds one hold into the lane's average.
    pub(crate) fn record(&mut self, lane: Lane, held: Duration) {
        let slot = &mut self.0[lane.idx()];
        let x = u64::try_from(held.as_nanos()).unwrap_or(u64::MAX);
        let old = *slot;
        let new = if old == 0 {
            x
        } else if x > old {
            // Up: half the gap.
            old + (x - old) / 2
        } else {
            // Down: an eighth of the gap.
            old - (old - x) / 8
        };
        *slot = new.max(1);
    }

    pub(crate) fn get(&self, lane: Lane) -> Option<Duration> {
        match self.0[lane.idx()] {
            0 => None,
            n => Some(Duration::from_nanos(n)),
        }
    }
}
