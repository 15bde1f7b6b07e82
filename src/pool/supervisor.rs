//! The supervisor of a pool's background work: housekeeping, the periodic
//! work of the layers above (the census), and any task a layer registers
//! (the lease renewer). The pool knows each only by its name and a way to
//! start it.
//!
//! A task lives in the runtime that spawned it and dies with it: a pool
//! built on one runtime and used on another after the first was dropped
//! would otherwise lose its housekeeping silently. Each task carries a
//! marker that, when the task's future is dropped (it ended, panicked, was
//! aborted, or its runtime went away), marks it dead; the next checkout, on
//! whatever runtime it runs, starts the dead ones again there (one atomic
//! load when nothing died). [`Pool::close`](crate::Pool::close) stops them
//! all, for good: it aborts each, or tells it to wind down (a task that has
//! something to finish, such as the lease renewer reporting its leases lost
//! at their deadlines), and never starts one again.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::task::AbortHandle;

/// A supervised task's future.
pub(crate) type Task = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Makes a supervised task's future, or `None` once the work's owner is
/// gone for good (the supervisor then forgets it).
pub(crate) type Start = Box<dyn Fn() -> Option<Task> + Send + Sync>;

/// Tells a task to wind down at close (it ends on its own); without one,
/// the task is aborted.
pub(crate) type OnClose = Box<dyn Fn() + Send + Sync>;

pub(crate) struct Supervisor {
    /// Some task may be dead (or was never started): checked at the next
    /// [`Supervisor::revive`].
    stale: Arc<AtomicBool>,
    jobs: Mutex<Jobs>,
}

#[derive(Default)]
struct Jobs {
    closed: bool,
    list: Vec<Job>,
}

struct Job {
    name: &'static str,
    start: Start,
    on_close: Option<OnClose>,
    running: Option<Running>,
}

struct Running {
    alive: Arc<AtomicBool>,
    abort: AbortHandle,
}

/// Lives in a supervised task's future: dropped with it, it marks the task
/// dead and the supervisor stale.
struct Alive {
    alive: Arc<AtomicBool>,
    stale: Arc<AtomicBool>,
}

impl Drop for Alive {
    fn drop(&mut self) {
        self.alive.store(false, Ordering::Release);
        self.stale.store(true, Ordering::Release);
    }
}

impl Supervisor {
    pub(super) fn new() -> Supervisor {
        Supervisor {
            stale: Arc::new(AtomicBool::new(true)),
            jobs: Mutex::new(Jobs::default()),
        }
    }

    /// Adds a task, started by the next [`Supervisor::revive`] (the next
    /// checkout, on the runtime it runs on). Nothing is added to a closed
    /// pool.
    pub(super) fn add(&self, name: &'static str, start: Start, on_close: Option<OnClose>) {
        {
            let mut jobs = self.jobs.lock();
            if jobs.closed {
                return;
            }
            jobs.list.push(Job {
                name,
                start,
                on_close,
                running: None,
            });
        }
        self.stale.store(true, Ordering::Release);
    }

    /// Starts, in the current runtime, every task not running (never
    /// started, or dead with its runtime), unless the pool is closed.
    /// Outside a runtime it does nothing: the next call inside one does it.
    #[inline]
    pub(super) fn revive(&self) {
        // Every checkout asks: the answer is almost always no.
        if self.stale.load(Ordering::Acquire) {
            self.revive_stale();
        }
    }

    #[cold]
    fn revive_stale(&self) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut jobs = self.jobs.lock();
        if jobs.closed {
            return;
        }
        // Cleared before looking: a task that dies from here on sets it again.
        self.stale.store(false, Ordering::Release);
        jobs.list.retain_mut(|job| {
            if let Some(r) = &job.running {
                if r.alive.load(Ordering::Acquire) {
                    return true;
                }
                tracing::debug!(task = job.name, "background task gone: starting it again");
            }
            let Some(task) = (job.start)() else {
                return false;
            };
            let alive = Arc::new(AtomicBool::new(true));
            let marker = Alive {
                alive: alive.clone(),
                stale: self.stale.clone(),
            };
            let handle = rt.spawn(async move {
                let _marker = marker;
                task.await
            });
            job.running = Some(Running {
                alive,
                abort: handle.abort_handle(),
            });
            true
        });
    }

    /// Stops every task, for good: aborts it, or tells it to wind down.
    pub(super) fn close(&self) {
        let jobs = {
            let mut jobs = self.jobs.lock();
            jobs.closed = true;
            std::mem::take(&mut jobs.list)
        };
        for job in jobs {
            match (job.running, &job.on_close) {
                (Some(_), Some(wind_down)) => wind_down(),
                (Some(r), None) => r.abort.abort(),
                (None, _) => {}
            }
        }
    }

    /// Names of the tasks running now (tests).
    #[cfg(test)]
    pub(crate) fn running(&self) -> Vec<&'static str> {
        let jobs = self.jobs.lock();
        jobs.list
            .iter()
            .filter(|j| {
                j.running
                    .as_ref()
                    .is_some_and(|r| r.alive.load(Ordering::Acquire))
            })
            .map(|j| j.name)
            .collect()
    }
}
