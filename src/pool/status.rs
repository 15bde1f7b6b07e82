//! [`Status`]: the pool at one moment; [`DeadpoolView`]: the wrapped
//! deadpool pool, read only.

use std::fmt;

use super::Shared;
use crate::admission::Lane;

/// One lane of [`Status`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LaneStatus {
    /// The lane.
    pub lane: Lane,
    /// Connections of this lane checked out now.
    pub in_use: usize,
    /// Of those, connections being released (a dropped session-lock guard
    /// whose unlock is in flight): they come back within the unlock timeout.
    pub releasing: usize,
    /// Checkouts of this lane waiting now.
    pub waiting: usize,
    /// Its reservation.
    pub reserved: usize,
    /// Its maximum.
    pub max: usize,
}

/// The pool at one moment, as [`crate::Pool::status`] and timeout errors give it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    /// The pool's maximum size `N`.
    pub max: usize,
    /// Physical connections open now.
    pub size: usize,
    /// Physical connections idle in the pool.
    pub idle: usize,
    /// Connections checked out through pgwarden, all lanes.
    pub in_use: usize,
    /// Checkouts waiting, all lanes.
    pub waiting: usize,
    /// Per lane, in [`Lane::ALL`] order.
    pub lanes: [LaneStatus; Lane::COUNT],
}

impl Status {
    /// One lane's status.
    pub fn lane(&self, lane: Lane) -> LaneStatus {
        self.lanes[lane.idx()]
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "total {}, open {}, idle {}, in use {} (",
            self.max, self.size, self.idle, self.in_use
        )?;
        for (i, l) in self.lanes.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{} {}/{}", l.lane, l.in_use, l.max)?;
            if l.releasing > 0 {
                write!(f, " ({} releasing)", l.releasing)?;
            }
        }
        write!(f, "), waiting {}", self.waiting)?;
        if self.waiting > 0 {
            f.write_str(" (")?;
            let mut first = true;
            for l in self.lanes.iter().filter(|l| l.waiting > 0) {
                if !first {
                    f.write_str(", ")?;
                }
                first = false;
                write!(f, "{} {}", l.lane, l.waiting)?;
            }
            f.write_str(")")?;
        }
        Ok(())
    }
}

impl Shared {
    pub(crate) fn status(&self) -> Status {
        let d = self.inner.status();
        let st = self.state.lock();
        let limits = st.adm.limits();
        let lanes = Lane::ALL.map(|lane| LaneStatus {
            lane,
            in_use: st.adm.in_use(lane),
            releasing: st.adm.releasing(lane),
            waiting: st.adm.pending(lane),
            reserved: limits.lane(lane).reserved,
            max: limits.lane(lane).max,
        });
        Status {
            max: limits.size(),
            size: d.size,
            idle: d.available,
            in_use: st.adm.total(),
            waiting: st.adm.waiting(),
            lanes,
        }
    }
}

/// The wrapped deadpool pool, read only ([`crate::Pool::inner`]): pgwarden
/// owns its capacity, so its connections come only through pgwarden.
#[derive(Clone, Copy, Debug)]
pub struct DeadpoolView<'a>(pub(super) &'a deadpool_postgres::Pool);

impl DeadpoolView<'_> {
    /// deadpool's own status: `max_size`, `size` (open), `available` (idle),
    /// `waiting`.
    pub fn status(&self) -> deadpool_postgres::Status {
        self.0.status()
    }

    /// deadpool's configured timeouts.
    pub fn timeouts(&self) -> deadpool_postgres::Timeouts {
        self.0.timeouts()
    }

    /// Whether the pool was closed.
    pub fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}
