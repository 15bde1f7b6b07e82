//! Housekeeping: one task per pool for the oldest-hold gauges, long-hold
//! warnings, connection gauges and the periodic census.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::{Pool, Shared};
use crate::budget::Lane;

impl Shared {
    pub(super) fn ensure_housekeeping(self: &Arc<Self>) {
        if self.housekeeping_started.load(Ordering::Relaxed) {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            if !self.housekeeping_started.swap(true, Ordering::AcqRel) {
                rt.spawn(housekeeping(Arc::downgrade(self), self.opts.housekeeping));
            }
        }
    }

    /// One housekeeping pass: the oldest hold per lane, long-hold warnings,
    /// connection gauges.
    pub(crate) fn housekeep(&self) {
        let now = Instant::now();
        let mut oldest = [Duration::ZERO; 3];
        let mut long = Vec::new();
        {
            let mut st = self.state.lock();
            for (_, c) in st.checkouts.iter_mut() {
                let age = now.saturating_duration_since(c.since);
                let o = &mut oldest[c.lane.idx()];
                *o = (*o).max(age);
                if age >= self.opts.long_hold && !c.long_warned {
                    c.long_warned = true;
                    long.push((c.lane, c.site, c.pid, age, c.note.clone()));
                }
            }
        }
        for l in Lane::ALL {
            self.metrics
                .lane(l)
                .oldest
                .set(oldest[l.idx()].as_secs_f64());
        }
        for (lane, site, pid, age, note) in long {
            self.metrics.lane(lane).long_holds.increment(1);
            tracing::warn!(
                pool = %self.name,
                %lane,
                %site,
                pid,
                ?age,
                held_for = note.as_deref().unwrap_or(""),
                threshold = ?self.opts.long_hold,
                "connection held past the long-hold threshold"
            );
        }
        let s = self.inner.status();
        self.metrics.idle.set(s.available as f64);
        self.metrics.in_use.set((s.size - s.available) as f64);
    }
}

async fn housekeeping(shared: Weak<Shared>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is immediate: nothing has been held yet.
    tick.tick().await;
    // The first census runs one interval after start, not at build time.
    let mut last_census = Instant::now();
    loop {
        tick.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if shared.inner.is_closed() {
            return;
        }
        shared.housekeep();
        if let Some(every) = shared.opts.census_interval {
            if last_census.elapsed() >= every {
                last_census = Instant::now();
                census_pass(Pool { shared }, every).await;
            }
        }
    }
}

/// The periodic census, bounded so that housekeeping never stalls on it.
async fn census_pass(pool: Pool, every: Duration) {
    let bound = pool.shared.opts.wait_timeout + every.min(Duration::from_secs(30));
    match tokio::time::timeout(bound, pool.census_sweep()).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::warn!(pool = %pool.shared.name, error = %e, "census failed"),
        Err(_) => tracing::warn!(pool = %pool.shared.name, ?bound, "census did not finish in time"),
    }
}
