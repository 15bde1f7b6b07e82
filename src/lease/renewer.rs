//! The renewer: one supervised background task per [`Leases`](crate::Leases)
//! that sends, for every lease of the instance that is due, one renewal
//! statement per batch, and purges old rows.
//!
//! Each tick it
//! 1. drops the leases whose local deadline passed (firing `lost(Deadline)`,
//!    which the lease's own views fire too, whatever the renewer does),
//! 2. gathers every lease due now or within half its interval (so leases
//!    taken at different times fold into one statement per interval) and
//!    not already in a batch, and starts batches of up to [`MAX_BATCH`] as
//!    tasks of their own: a slow batch never holds up another lease,
//! 3. starts a purge when one is due (at most one per interval),
//! 4. sleeps until the earliest due time, deadline or purge, or a wake-up
//!    (a registration due sooner, a batch done).
//!
//! Supervision: a panic inside a tick or a batch (pgwarden's bug, or a
//! metrics recorder's) is caught, logged and counted, and renewal goes on.
//! The task runs under the pool's supervisor: when it is gone (its runtime
//! was dropped), the next checkout of the pool (an acquisition, any
//! statement) starts a new one in the current runtime; until then every
//! lease still reports itself lost at its deadline. Once the pool is closed
//! it is never started again, and it ends when no lease is left to report
//! lost.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::guard::LostReason;
use super::inner::{Entry, Item};
use super::term::LeaseState;
use super::term::{self, Timing};
use super::Inner;
use crate::pool::panic_message;

/// The most leases one renewal statement carries.
pub(crate) const MAX_BATCH: usize = 5_000;

/// How long the renewer pauses after a panic, so that a panic on every tick
/// does not spin.
const PANIC_PAUSE: Duration = Duration::from_millis(50);

/// Clears [`Inner::renewer_alive`] when the renewer task is dropped: it
/// ended, or its runtime went away with it.
struct Alive(Arc<AtomicBool>);

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Inner {
    /// Starts renewing a lease taken by a statement sent at `start`.
    pub(crate) fn register(
        self: &Arc<Self>,
        state: Arc<LeaseState>,
        timing: Timing,
        start: Instant,
    ) -> u64 {
        let (id, sooner) = {
            let mut reg = self.registry.lock();
            let id = reg.next_id;
            reg.next_id += 1;
            let due = timing.due_after(start);
            let wake = due.min(state.deadline());
            reg.entries.insert(
                id,
                Entry {
                    state,
                    timing,
                    due,
                    attempt: 0,
                    in_flight: false,
                },
            );
            // Acquiring many leases must not wake the renewer (and its scan
            // of every lease held) once per lease.
            let sooner = reg.next_wake.is_none_or(|w| wake < w);
            if sooner {
                reg.next_wake = Some(wake);
            }
            (id, sooner)
        };
        self.metrics.held.increment(1.0);
        self.ensure_renewer();
        if sooner {
            self.wake.notify_one();
        }
        id
    }

    /// Stops renewing a lease; false when it was no longer registered.
    pub(crate) fn unregister(&self, id: u64) -> bool {
        let gone = self.registry.lock().entries.remove(&id).is_some();
        if gone {
            self.metrics.held.decrement(1.0);
        }
        gone
    }

    /// Ids and states of every lease held now.
    pub(crate) fn held(&self) -> Vec<(u64, Arc<LeaseState>)> {
        let reg = self.registry.lock();
        reg.entries
            .iter()
            .map(|(id, e)| (*id, e.state.clone()))
            .collect()
    }

    /// Puts the renewer under the pool's supervisor (once, when the
    /// instance is made): started by the pool's next checkout (the first
    /// acquisition) on the runtime it runs on, started again on the runtime
    /// in use when its own is gone; once the pool is closed, it ends when no
    /// lease is left to report lost.
    pub(crate) fn supervise_renewer(self: &Arc<Self>) {
        let (weak, wake, alive) = (
            Arc::downgrade(self),
            self.wake.clone(),
            self.renewer_alive.clone(),
        );
        // At close it winds down: it goes on reporting its leases lost at
        // their deadlines (no statement can succeed), then ends.
        let wind_down = {
            let wake = wake.clone();
            Box::new(move || wake.notify_one())
        };
        let start = move || {
            weak.upgrade()?;
            alive.store(true, Ordering::Release);
            let task = run(weak.clone(), wake.clone(), Alive(alive.clone()));
            Some(Box::pin(task) as crate::pool::Task)
        };
        self.pool.supervise("lease renewer", start, Some(wind_down));
    }

    /// Starts the renewer again in the current runtime if its task is gone.
    pub(crate) fn ensure_renewer(self: &Arc<Self>) {
        if !self.renewer_alive.load(Ordering::Acquire) {
            self.pool.revive_background();
        }
    }

    /// A panic caught in the renewer: logged and counted.
    pub(super) fn renewer_panicked(&self, panic: &(dyn Any + Send)) {
        tracing::error!(
            pool = %self.pool_name,
            panic = %panic_message(panic),
            "panic in the lease renewer: caught, renewal goes on"
        );
        // The recorder that panicked may panic again: never let the count
        // take the renewer down.
        let _ = std::panic::catch_unwind(AssertUnwindSafe(|| {
            self.metrics.renewer_panics.increment(1)
        }));
    }

    /// One tick; returns when to wake next (`None`: nothing to do until a
    /// registration). Starts batches and the purge as tasks of their own.
    fn tick(self: &Arc<Self>) -> Option<Instant> {
        let now = Instant::now();
        let mut gone = Vec::new();
        let mut batch = Vec::new();
        let purge = {
            let mut reg = self.registry.lock();
            reg.entries.retain(|_, e| {
                if e.state.past_deadline(now) || e.state.lost_reason().is_some() {
                    gone.push(e.state.clone());
                    return false;
                }
                true
            });
            for (id, e) in reg.entries.iter_mut() {
                if !e.in_flight && term::is_due(now, e.due, e.attempt, e.timing.window()) {
                    e.in_flight = true;
                    batch.push(Item {
                        id: *id,
                        state: e.state.clone(),
                        ttl: e.timing.ttl.as_secs_f64(),
                    });
                }
            }
            self.purge_due(&mut reg, now)
        };
        for state in &gone {
            self.metrics.held.decrement(1.0);
            self.mark_lost(state, LostReason::Deadline);
        }
        if !batch.is_empty() || purge {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                while !batch.is_empty() {
                    let rest = batch.split_off(batch.len().min(MAX_BATCH));
                    rt.spawn(
                        self.clone()
                            .renew_batch(std::mem::replace(&mut batch, rest)),
                    );
                }
                if purge {
                    rt.spawn(self.clone().purge_round());
                }
            }
        }
        let mut reg = self.registry.lock();
        let min_interval = reg.entries.values().map(|e| e.timing.renew_every).min();
        self.metrics
            .renew_interval
            .set(min_interval.unwrap_or(Duration::ZERO).as_secs_f64());
        let leases = reg
            .entries
            .values()
            .map(|e| {
                let deadline = e.state.deadline();
                if e.in_flight {
                    deadline
                } else {
                    e.due.min(deadline)
                }
            })
            .min();
        let purge_at = reg.next_purge.filter(|_| self.purge.auto);
        reg.next_wake = match (leases, purge_at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        reg.next_wake
    }
}

/// The renewer task: runs while its [`Inner`] lives.
async fn run(inner: Weak<Inner>, wake: Arc<Notify>, _alive: Alive) {
    loop {
        let next = {
            let Some(inner) = inner.upgrade() else { return };
            let next = match std::panic::catch_unwind(AssertUnwindSafe(|| inner.tick())) {
                Ok(next) => next,
                Err(panic) => {
                    inner.renewer_panicked(&*panic);
                    Some(Instant::now() + PANIC_PAUSE)
                }
            };
            // Closed: done once every lease was reported lost and dropped.
            if inner.pool.is_closed() && inner.registry.lock().entries.is_empty() {
                return;
            }
            next
        };
        match next {
            Some(at) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(at.into()) => {}
                    _ = wake.notified() => {}
                }
            }
            None => wake.notified().await,
        }
    }
}
