//! The pool's [`Status`](crate::Status), read from its state.

use super::shared::Shared;
use crate::admission::Lane;
use crate::status::{LaneStatus, Status};

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
            max_size: limits.size(),
            size: d.size,
            idle: d.available,
            available: d.available,
            in_use: st.adm.total(),
            waiting: st.adm.waiting(),
            lanes,
        }
    }
}
