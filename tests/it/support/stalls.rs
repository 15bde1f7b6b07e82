//! Stalls of a test's own runtime, for the liveness checks of the
//! scheduler's tests ("every whole period ran").
//!
//! The scheduler promises at most one run per period, not at least one: a
//! period in which no instance got to run (a process or a machine stalled
//! past the period) is skipped, by design. On a responsive machine every
//! whole period of a 1 s job runs, and a test that sees one missed has
//! found a bug; on a machine loaded far past its cores (load 15 to 28 on 2
//! cores) the runtime itself wakes hundreds of milliseconds late, and a
//! missed period says nothing about the scheduler. [`Stalls`] tells the
//! two apart by an event, not a clock bound: a task on the test's runtime
//! sleeps [`TICK`] again and again and records every wake-up later than
//! [`LATE`]; a missed period is excused only when such a stall overlapped
//! it (or the period before, when the boundary's sleep was set).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

/// The watcher's sleep.
pub const TICK: Duration = Duration::from_millis(10);
/// How late a wake-up must be to count as a stall: a quarter of the tests'
/// 1 s period.
pub const LATE: Duration = Duration::from_millis(250);

/// Stalls seen on this runtime since [`Stalls::watch`], as spans of Unix
/// time in seconds (the clock the slots are counted in).
pub struct Stalls {
    seen: Arc<Mutex<Vec<(f64, f64)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Stalls {
    /// Starts watching the current runtime.
    pub fn watch() -> Stalls {
        let seen: Arc<Mutex<Vec<(f64, f64)>>> = Arc::default();
        let log = Arc::clone(&seen);
        let task = tokio::spawn(async move {
            loop {
                let (at, t0) = (SystemTime::now(), Instant::now());
                tokio::time::sleep(TICK).await;
                let took = t0.elapsed();
                if took > TICK + LATE {
                    let from = at.duration_since(UNIX_EPOCH).unwrap().as_secs_f64();
                    log.lock().push((from, from + took.as_secs_f64()));
                }
            }
        });
        Stalls { seen, task }
    }

    /// A stall that overlapped slot `slot` of `period` (slots counted from
    /// the Unix epoch) or the slot before it, if any.
    pub fn during(&self, slot: i64, period: Duration) -> Option<(f64, f64)> {
        let p = period.as_secs_f64();
        let (from, to) = ((slot - 1) as f64 * p, (slot + 1) as f64 * p);
        self.seen
            .lock()
            .iter()
            .copied()
            .find(|(a, b)| *a < to && *b > from)
    }

    /// Every stall seen so far.
    pub fn all(&self) -> Vec<(f64, f64)> {
        self.seen.lock().clone()
    }
}

impl Drop for Stalls {
    fn drop(&mut self) {
        self.task.abort();
    }
}
