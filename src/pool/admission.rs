//! Admission: permits, the FIFO wait queue, and returns.

use std::panic::Location;
use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::PoolError;
use tokio::sync::oneshot;

use super::{Shared, State, Waiter};
use crate::budget::{Decision, Lane, Refusal};
use crate::error::Error;

/// The right to one connection of a lane: counted in the budget until dropped.
pub(crate) struct Permit {
    pub(super) shared: Arc<Shared>,
    pub(super) slot: usize,
    pub(super) lane: Lane,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.shared.release(self.slot, self.lane);
    }
}

/// Removes a waiter from the queue when its checkout gives up or is dropped.
pub(super) struct WaiterGuard<'a> {
    shared: &'a Shared,
    id: u64,
    lane: Lane,
}

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        let mut st = self.shared.state.lock();
        if let Some(pos) = st.waiters.iter().position(|w| w.id == self.id) {
            st.waiters.remove(pos);
            st.pending[self.lane.idx()] -= 1;
            let n = st.pending[self.lane.idx()];
            drop(st);
            self.shared.metrics.lane(self.lane).pending.set(n as f64);
        }
    }
}

impl Shared {
    fn refusal(&self, st: &State, lane: Lane, r: Refusal) -> Error {
        let (limit, hard_floor) = match r {
            Refusal::Budget { limit } => (limit, false),
            Refusal::HardFloor { limit } => (limit, true),
        };
        Error::BudgetExhausted {
            lane,
            limit,
            in_use: st.budget.in_use(lane),
            hard_floor,
            holders: st.holders(lane, Instant::now()),
        }
    }

    /// Admits one checkout of `lane`, waiting in FIFO order up to `timeout`.
    pub(super) async fn acquire(
        self: &Arc<Self>,
        lane: Lane,
        site: &'static Location<'static>,
        start: Instant,
        timeout: Duration,
    ) -> Result<Permit, Error> {
        let lm = self.metrics.lane(lane);
        let (id, rx) = {
            let mut st = self.state.lock();
            let queued = st.pending[lane.idx()] > 0;
            let d = match st.budget.decide(lane) {
                // Others of this lane wait already: queue behind them.
                Decision::Admit | Decision::AdmitOverBudget if queued => Decision::Wait,
                Decision::Admit | Decision::AdmitOverBudget => st.budget.acquire(lane),
                d => d,
            };
            match d {
                Decision::Admit | Decision::AdmitOverBudget => {
                    let slot = st.insert(lane, site, start);
                    let in_use = st.budget.in_use(lane);
                    let over = d == Decision::AdmitOverBudget;
                    let first = over && st.warned_sites.insert(site as *const _ as usize);
                    drop(st);
                    lm.in_use.set(in_use as f64);
                    if over {
                        self.over_budget(site, first, in_use);
                    }
                    return Ok(Permit {
                        shared: self.clone(),
                        slot,
                        lane,
                    });
                }
                Decision::Refuse(r) => {
                    let err = self.refusal(&st, lane, r);
                    drop(st);
                    lm.fail_refused.increment(1);
                    if matches!(r, Refusal::Budget { .. }) {
                        self.metrics.overrun_refuse.increment(1);
                    }
                    return Err(err);
                }
                Decision::Wait => {
                    let (tx, rx) = oneshot::channel();
                    let id = st.next_waiter;
                    st.next_waiter += 1;
                    st.waiters.push_back(Waiter {
                        id,
                        lane,
                        site,
                        start,
                        tx,
                    });
                    st.pending[lane.idx()] += 1;
                    lm.pending.set(st.pending[lane.idx()] as f64);
                    (id, rx)
                }
            }
        };
        let guard = WaiterGuard {
            shared: self,
            id,
            lane,
        };
        let res = tokio::time::timeout(timeout.saturating_sub(start.elapsed()), rx).await;
        match res {
            Ok(Ok(permit)) => {
                // `release` took this waiter off the queue before granting
                // it: nothing to remove, skip the guard's scan of the queue.
                std::mem::forget(guard);
                Ok(permit)
            }
            // The sender went away without a permit: the pool is closing.
            Ok(Err(_)) => Err(Error::Pool(PoolError::Closed)),
            Err(_) => {
                // The status as this waiter saw it, itself still counted.
                let status = self.status();
                drop(guard);
                lm.fail_timeout.increment(1);
                tracing::warn!(pool = %self.name, %lane, waited = ?start.elapsed(), %status, "checkout timed out");
                Err(Error::Timeout {
                    lane,
                    waited: start.elapsed(),
                    status,
                })
            }
        }
    }

    fn over_budget(&self, site: &'static Location<'static>, first: bool, in_use: usize) {
        self.metrics.overrun_warn.increment(1);
        if first {
            let limit = self
                .state
                .lock()
                .budget
                .limits()
                .lane(Lane::SessionLock)
                .max;
            tracing::warn!(
                pool = %self.name,
                %site,
                in_use,
                limit,
                "session lock admitted past its budget (policy warn): hold no connection for \
                 background exclusivity; use a table lease or a transaction-scoped lock"
            );
        }
    }

    /// Returns one connection of `lane` to the budget and serves waiters.
    fn release(self: &Arc<Self>, slot: usize, lane: Lane) {
        // Usually one grant per return: the first needs no allocation.
        let mut grant: Option<(oneshot::Sender<Permit>, usize, Lane)> = None;
        let mut grants = Vec::new();
        let mut overs = Vec::new();
        let mut st = self.state.lock();
        if st.checkouts.try_remove(slot).is_none() {
            debug_assert!(false, "released an unknown checkout");
        }
        st.budget.release(lane);
        // A lane that must wait stays blocked for the rest of this pass:
        // granting a connection never makes room for another lane. Stop
        // once every lane with waiters is blocked, instead of asking the
        // budget again for each of the waiters queued behind.
        let mut blocked = [false; 3];
        let mut i = 0;
        while i < st.waiters.len() {
            let wl = st.waiters[i].lane;
            if blocked[wl.idx()] {
                i += 1;
                continue;
            }
            match st.budget.acquire(wl) {
                d @ (Decision::Admit | Decision::AdmitOverBudget) => {
                    let Some(w) = st.waiters.remove(i) else { break };
                    st.pending[wl.idx()] -= 1;
                    let slot = st.insert(wl, w.site, w.start);
                    if d == Decision::AdmitOverBudget {
                        let first = st.warned_sites.insert(w.site as *const _ as usize);
                        overs.push((w.site, first, st.budget.in_use(wl)));
                    }
                    if grant.is_none() {
                        grant = Some((w.tx, slot, wl));
                    } else {
                        grants.push((w.tx, slot, wl));
                    }
                }
                Decision::Refuse(_) | Decision::Wait => {
                    blocked[wl.idx()] = true;
                    let pending = st.pending;
                    if Lane::ALL
                        .iter()
                        .all(|l| blocked[l.idx()] || pending[l.idx()] == 0)
                    {
                        break;
                    }
                    i += 1;
                }
            }
        }
        let in_use = st.budget.in_use(lane);
        // Lanes whose gauges changed besides the returned one: those granted.
        let mut granted: [Option<(usize, usize)>; 3] = [None; 3];
        for (_, _, l) in grant.iter().chain(&grants) {
            granted[l.idx()] = Some((st.budget.in_use(*l), st.pending[l.idx()]));
        }
        drop(st);
        self.metrics.lane(lane).in_use.set(in_use as f64);
        for l in Lane::ALL {
            if let Some((n, p)) = granted[l.idx()] {
                let m = self.metrics.lane(l);
                m.in_use.set(n as f64);
                m.pending.set(p as f64);
            }
        }
        for (site, first, n) in overs {
            self.over_budget(site, first, n);
        }
        for (tx, slot, lane) in grant.into_iter().chain(grants) {
            let permit = Permit {
                shared: self.clone(),
                slot,
                lane,
            };
            // A waiter that gave up in the meantime hands the permit back,
            // whose drop releases it again.
            let _ = tx.send(permit);
        }
    }
}
