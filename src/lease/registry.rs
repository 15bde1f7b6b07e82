//! The leases an instance holds, as its renewer sees them: [`Registry`],
//! one [`Entry`] per lease, and the [`Item`]s of a renewal batch.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::term::LeaseState;
use super::term::Timing;

/// The leases an instance holds, by registration id.
#[derive(Default)]
pub(crate) struct Registry {
    pub(super) next_id: u64,
    pub(super) entries: HashMap<u64, Entry>,
    /// When the renewer plans to wake next (`None`: it waits for a
    /// registration). A registration wakes it only when it is due sooner.
    pub(super) next_wake: Option<Instant>,
    /// When the next purge is due (set at the renewer's first tick).
    pub(super) next_purge: Option<Instant>,
    /// A purge is running.
    pub(super) purging: bool,
}

pub(super) struct Entry {
    pub(super) state: Arc<LeaseState>,
    pub(super) timing: Timing,
    pub(super) due: Instant,
    pub(super) attempt: u32,
    /// Part of a batch in flight.
    pub(super) in_flight: bool,
}

/// One lease of a batch.
pub(super) struct Item {
    pub(super) id: u64,
    pub(super) state: Arc<LeaseState>,
    pub(super) ttl: f64,
}

impl Registry {
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}
