//! Housekeeping, which cannot die: one task per pool for the oldest-hold
//! gauges, long-hold warnings and the republished lane and connection
//! gauges, and one for each layer's periodic work (the census), all under
//! the pool's supervisor (`supervisor.rs`), which starts them again on the
//! runtime in use when theirs is gone. Every pass runs under
//! `catch_unwind`: a panic is logged, counted
//! (`pgwarden_housekeeping_panics_total`) and the task goes on. All their
//! duration arithmetic saturates.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use futures_util::FutureExt;

use super::deadline::deadline;
use super::shared::{Periodic, Shared};
use super::source::Source;
use super::supervisor::Task;
use crate::admission::Lane;

impl<B: Source> Shared<B> {
    /// Puts each layer's periodic work under the pool's supervisor, and
    /// starts it (and housekeeping) when built inside a runtime.
    pub(crate) fn supervise_periodic(self: &Arc<Self>, hooks: Vec<Arc<dyn Periodic<B>>>) {
        let weak = Arc::downgrade(self);
        for hook in hooks {
            let weak = weak.clone();
            self.supervisor.add(
                hook.name(),
                Box::new(move || {
                    live(&weak)?;
                    Some(Box::pin(periodic(weak.clone(), hook.clone())))
                }),
                None,
            );
        }
        self.supervisor.revive();
    }
}

impl<B: Source> Shared<B> {
    /// Puts housekeeping under the pool's supervisor, and starts it when
    /// built inside a runtime (otherwise the first checkout does).
    pub(super) fn supervise_housekeeping(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let every = self.opts.housekeeping;
        self.supervisor.add(
            "housekeeping",
            Box::new(move || {
                live(&weak)?;
                Some(Box::pin(housekeeping(weak.clone(), every)))
            }),
            None,
        );
        self.supervisor.revive();
    }

    /// One housekeeping pass: the oldest hold per lane, long-hold warnings,
    /// the lane gauges republished from the state (under its lock), the
    /// connection gauges, and a check that deadpool still has the size
    /// pgwarden owns.
    pub(crate) fn housekeep(&self) {
        #[cfg(test)]
        if self.inject_panic.swap(false, Ordering::AcqRel) {
            panic!("injected housekeeping panic");
        }
        let now = Instant::now();
        let mut oldest = [Duration::ZERO; Lane::COUNT];
        let mut long = Vec::new();
        let size = {
            let mut st = self.state.lock();
            for (_, c) in st.checkouts.iter_mut() {
                let age = c.age(now);
                let o = &mut oldest[c.lane.idx()];
                *o = (*o).max(age);
                if age >= self.opts.long_hold && !c.long_warned {
                    c.long_warned = true;
                    long.push((c.lane, c.site, c.pid, age, c.note.clone()));
                }
            }
            self.publish(&st, u8::MAX);
            st.adm.limits().size()
        };
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
        self.metrics.idle.set(s.idle as f64);
        self.metrics
            .in_use
            .set(s.size.saturating_sub(s.idle) as f64);
        if s.max != size
            && !self.inner.is_closed()
            && !self.resize_warned.swap(true, Ordering::AcqRel)
        {
            tracing::warn!(
                pool = %self.name,
                deadpool_max_size = s.max,
                size,
                "the wrapped deadpool pool was resized outside pgwarden: checkouts past its new size fail"
            );
        }
    }

    /// A housekeeping pass that cannot take the task down.
    fn housekeep_caught(&self) {
        if let Err(panic) = std::panic::catch_unwind(AssertUnwindSafe(|| self.housekeep())) {
            self.panicked("housekeeping", &*panic);
        }
    }

    fn panicked(&self, what: &str, panic: &(dyn std::any::Any + Send)) {
        self.metrics.housekeeping_panics.increment(1);
        let msg = panic_message(panic);
        tracing::error!(pool = %self.name, task = what, panic = %msg, "housekeeping pass panicked; the task goes on");
    }
}

/// The pool, unless it is gone or closed.
fn live<B: Source>(shared: &Weak<Shared<B>>) -> Option<Arc<Shared<B>>> {
    shared.upgrade().filter(|s| !s.inner.is_closed())
}

/// Sleeps `every`, then the pool, unless it is gone or closed: the tasks
/// hold no strong reference between passes.
async fn tick<B: Source>(shared: &Weak<Shared<B>>, every: Duration) -> Option<Arc<Shared<B>>> {
    tokio::time::sleep_until(deadline(tokio::time::Instant::now(), every)).await;
    live(shared)
}

async fn housekeeping<B: Source>(shared: Weak<Shared<B>>, every: Duration) {
    while let Some(shared) = tick(&shared, every).await {
        shared.housekeep_caught();
    }
}

/// A layer's periodic work (the census), in its own task: a slow pass never
/// delays the housekeeping pass, and each pass is bounded.
async fn periodic<B: Source>(weak: Weak<Shared<B>>, hook: Arc<dyn Periodic<B>>) {
    let every = hook.every();
    let name = hook.name();
    while let Some(shared) = tick(&weak, every).await {
        let bound = shared
            .opts
            .wait_timeout
            .saturating_add(every.min(Duration::from_secs(30)));
        let pass = tokio::time::timeout(bound, hook.pass(shared.clone()));
        match AssertUnwindSafe(pass).catch_unwind().await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(pool = %shared.name, error = %e, "{name} failed"),
            Ok(Err(_)) => {
                tracing::warn!(pool = %shared.name, ?bound, "{name} did not finish in time")
            }
            Err(panic) => shared.panicked(name, &*panic),
        }
    }
}

impl<B: Source> Shared<B> {
    /// Puts background work of a layer above under the pool's supervisor:
    /// `start` makes the task's future, or `None` once the work's owner is
    /// gone (the supervisor then forgets it). Started by the next checkout
    /// (or `revive_background`) on the runtime it runs on, started
    /// again on the runtime in use when its task is gone, never started again
    /// once the pool is closed. At [`Pool::close`](crate::Pool::close) the
    /// task is aborted, or, given `wind_down`, told to end on its own (it
    /// then sees [`Pool::closed`]). `start` and `wind_down` must hold no
    /// strong reference to the pool or to the work's owner.
    pub(crate) fn supervise(
        &self,
        name: &'static str,
        start: impl Fn() -> Option<Task> + Send + Sync + 'static,
        wind_down: Option<Box<dyn Fn() + Send + Sync>>,
    ) {
        self.supervisor.add(name, Box::new(start), wind_down);
    }

    /// Starts again, in the current runtime, the supervised tasks whose
    /// runtime is gone (each checkout does it too).
    pub(crate) fn revive_background(&self) {
        self.supervisor.revive();
    }
}

/// The message of a caught panic (`panic!("…")` gives a `&str` or a
/// `String`), for logs.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_owned())
}
