//! The shell around the admission core: permits, each waiter's channel and
//! deadline, returns, the "releasing" mark, and closing. Every change to the
//! core happens under the state lock, and the lane gauges it moves are set
//! there too, so they always describe the state they were read from.

use std::panic::Location;
use std::sync::Arc;
use std::time::Instant;

use deadpool_postgres::PoolError;
use tokio::sync::oneshot;

use std::collections::HashSet;

use slab::Slab;

use super::shared::{Checkout, Outcome, Permit, Shared, State, Waiter};
use crate::admission::{Answer as Admitted, Effect, Lane, Priority, Refusal, WaiterKey};
use crate::error::{BuildError, CheckoutError, Error, Stage};

/// Removes a waiter from the queue when its checkout gives up or is dropped.
struct WaiterGuard<'a> {
    shared: &'a Arc<Shared>,
    key: WaiterKey,
    id: u64,
    lane: Lane,
    prio: Priority,
}

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        let mut fired = Fired::default();
        {
            let mut guard = self.shared.state.lock();
            let st = &mut *guard;
            // Still in the table under its own id: still queued (a grant or
            // refusal takes it out, and its key may serve another since).
            let queued = st.waiters.get(self.key).is_some_and(|w| w.id == self.id);
            if queued {
                st.waiters.try_remove(self.key);
                let mut t = Tables {
                    waiters: &mut st.waiters,
                    checkouts: &mut st.checkouts,
                    warned_sites: &mut st.warned_sites,
                };
                st.adm.cancel(self.lane, self.prio, self.key, |e| {
                    self.shared.apply(&mut t, e, &mut fired)
                });
                self.shared.publish(st, 1 << self.lane.idx() | fired.lanes);
            }
        }
        fired.send(self.shared);
    }
}

/// A grant's checkout slot and lane, or a refusal: made into what the
/// waiter is told once the lock is released (the permit's `Arc` clone is
/// an atomic every checkout touches: not under the lock).
type Answer = Result<(usize, Lane), Refusal>;

/// Channels to fire once the lock is released, and what changed.
#[derive(Default)]
struct Fired {
    first: Option<(oneshot::Sender<Outcome>, Answer)>,
    rest: Vec<(oneshot::Sender<Outcome>, Answer)>,
    /// Lanes whose gauges moved (bit per lane index).
    lanes: u8,
    /// Session locks admitted past the budget: (site, first at that site).
    overs: Vec<(&'static Location<'static>, bool)>,
}

impl Fired {
    fn push(&mut self, tx: oneshot::Sender<Outcome>, a: Answer) {
        if self.first.is_none() {
            self.first = Some((tx, a));
        } else {
            self.rest.push((tx, a));
        }
    }

    fn send(self, shared: &Arc<Shared>) {
        for (site, first) in self.overs {
            shared.over_budget(site, first);
        }
        for (tx, answer) in self.first.into_iter().chain(self.rest) {
            let outcome = answer.map(|(slot, lane)| Permit {
                shared: shared.clone(),
                slot,
                lane,
            });
            // A waiter that gave up in the meantime hands a permit back,
            // whose drop releases it again.
            let _ = tx.send(outcome);
        }
    }
}

/// The shell's tables, apart from the admission core that is borrowed
/// while its effects are applied to them.
struct Tables<'a> {
    waiters: &'a mut Slab<Waiter>,
    checkouts: &'a mut Slab<Checkout>,
    warned_sites: &'a mut HashSet<usize>,
}

impl Shared {
    /// Applies one of the core's effects (under the lock).
    fn apply(&self, t: &mut Tables<'_>, e: Effect, fired: &mut Fired) {
        match e {
            Effect::Grant {
                key,
                lane,
                prio,
                over_budget,
            } => {
                let Some(w) = t.waiters.try_remove(key) else {
                    debug_assert!(false, "granted an unknown waiter");
                    return;
                };
                let slot = t
                    .checkouts
                    .insert(Checkout::new(lane, prio, w.site, w.start));
                if over_budget {
                    let first = t.warned_sites.insert(w.site as *const _ as usize);
                    fired.overs.push((w.site, first));
                }
                fired.lanes |= 1 << lane.idx();
                fired.push(w.tx, Ok((slot, lane)));
            }
            Effect::Refuse { key, lane, refusal } => {
                if let Some(w) = t.waiters.try_remove(key) {
                    fired.lanes |= 1 << lane.idx();
                    fired.push(w.tx, Err(refusal));
                }
            }
        }
    }

    /// Sets the in-use and pending gauges of the lanes in `lanes` (a bit per
    /// lane index), under the lock that guards what they describe.
    pub(super) fn publish(&self, st: &State, lanes: u8) {
        let mut bits = lanes & ((1 << Lane::COUNT) - 1);
        while bits != 0 {
            let lane = Lane::ALL[bits.trailing_zeros() as usize];
            bits &= bits - 1;
            let m = self.metrics.lane(lane);
            m.in_use.set(st.adm.in_use(lane) as f64);
            m.pending.set(st.adm.pending(lane) as f64);
        }
    }

    fn refusal(&self, st: &State, lane: Lane, r: Refusal) -> Error {
        let (limit, hard_floor) = match r {
            Refusal::Budget { limit } => (limit, false),
            Refusal::HardFloor { limit } => (limit, true),
        };
        Error::Checkout(CheckoutError::BudgetExhausted {
            lane,
            limit,
            in_use: st.adm.in_use(lane),
            hard_floor,
            holders: st.holders(lane, Instant::now()),
            pool_size: st.adm.limits().size(),
        })
    }

    fn refused(&self, lane: Lane, r: Refusal, err: Error) -> Error {
        self.metrics.lane(lane).fail_refused.increment(1);
        if matches!(r, Refusal::Budget { .. }) {
            self.metrics.overrun_refuse.increment(1);
        }
        err
    }

    fn closed(&self, lane: Lane) -> Error {
        self.metrics.lane(lane).fail_closed.increment(1);
        Error::Checkout(CheckoutError::Pool(PoolError::Closed))
    }

    /// Admits one checkout of `lane` at `prio`, waiting in FIFO order up to
    /// `deadline` (and, when `patient`, waiting for the session-lock budget
    /// rather than being refused while other locks hold it).
    pub(super) async fn admit(
        self: &Arc<Self>,
        lane: Lane,
        prio: Priority,
        patient: bool,
        site: &'static Location<'static>,
        start: tokio::time::Instant,
        deadline: tokio::time::Instant,
    ) -> Result<Permit, Error> {
        let (key, id, rx) = {
            let mut st = self.state.lock();
            let key = st.waiters.vacant_key();
            match st.adm.request_with(lane, prio, key, patient) {
                Admitted::Admit { over_budget } => {
                    let slot = st.insert(lane, prio, site, start.into_std());
                    let in_use = st.adm.in_use(lane);
                    self.metrics.lane(lane).in_use.set(in_use as f64);
                    let first = over_budget && st.warned_sites.insert(site as *const _ as usize);
                    drop(st);
                    if over_budget {
                        self.over_budget(site, first);
                    }
                    return Ok(Permit {
                        shared: self.clone(),
                        slot,
                        lane,
                    });
                }
                Admitted::Refused(r) => {
                    let err = self.refusal(&st, lane, r);
                    drop(st);
                    return Err(self.refused(lane, r, err));
                }
                Admitted::Closed => {
                    drop(st);
                    return Err(self.closed(lane));
                }
                Admitted::Queued => {
                    let (tx, rx) = oneshot::channel();
                    st.next_waiter += 1;
                    let id = st.next_waiter;
                    st.waiters.insert(Waiter {
                        id,
                        site,
                        start: start.into_std(),
                        tx,
                    });
                    self.publish(&st, 1 << lane.idx());
                    (key, id, rx)
                }
            }
        };
        let guard = WaiterGuard {
            shared: self,
            key,
            id,
            lane,
            prio,
        };
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(Ok(permit))) => {
                // Granted: off the queue already, skip the guard's scan.
                std::mem::forget(guard);
                Ok(permit)
            }
            Ok(Ok(Err(r))) => {
                std::mem::forget(guard);
                let err = self.refusal(&self.state.lock(), lane, r);
                Err(self.refused(lane, r, err))
            }
            // The sender went away without an answer: the pool closed.
            Ok(Err(_)) => {
                std::mem::forget(guard);
                Err(self.closed(lane))
            }
            Err(_) => {
                // The status as this waiter saw it, itself still counted.
                let status = self.status();
                drop(guard);
                Err(self.timed_out(lane, Stage::Admission, start, status))
            }
        }
    }

    /// Counts and logs a checkout whose bound ran out.
    pub(super) fn timed_out(
        &self,
        lane: Lane,
        stage: Stage,
        start: tokio::time::Instant,
        status: crate::status::Status,
    ) -> Error {
        self.metrics.lane(lane).fail_timeout.increment(1);
        let waited = start.elapsed();
        tracing::warn!(pool = %self.name, %lane, ?waited, %stage, %status, "checkout timed out");
        Error::Checkout(CheckoutError::Timeout {
            lane,
            waited,
            stage,
            status: Box::new(status),
        })
    }

    fn over_budget(&self, site: &'static Location<'static>, first: bool) {
        self.metrics.overrun_warn.increment(1);
        if first {
            let (in_use, limit) = {
                let st = self.state.lock();
                let lane = Lane::SessionLock;
                (st.adm.in_use(lane), st.adm.limits().lane(lane).max)
            };
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

    /// Returns one checkout to the budget and serves the waiters it makes
    /// room for.
    pub(super) fn release(self: &Arc<Self>, slot: usize) {
        let mut fired = Fired::default();
        let now = Instant::now();
        {
            let mut guard = self.state.lock();
            let st = &mut *guard;
            let Some(c) = st.checkouts.try_remove(slot) else {
                debug_assert!(false, "released an unknown checkout");
                return;
            };
            // A connection was handed out (not a checkout that failed
            // after admission): its hold counts in the lane's average.
            if c.object.is_some() {
                st.holds
                    .record(c.lane, now.saturating_duration_since(c.since));
            }
            let mut t = Tables {
                waiters: &mut st.waiters,
                checkouts: &mut st.checkouts,
                warned_sites: &mut st.warned_sites,
            };
            st.adm.release(c.lane, c.prio, c.releasing, |e| {
                self.apply(&mut t, e, &mut fired)
            });
            self.publish(st, 1 << c.lane.idx() | fired.lanes);
        }
        fired.send(self);
    }

    /// The owner of checkout `slot` let go and its return is under way: a
    /// checkout of its lane refused only because of it waits instead.
    pub(super) fn mark_releasing(&self, slot: usize) {
        let mut st = self.state.lock();
        let lane = match st.checkouts.get_mut(slot) {
            Some(c) if !c.releasing => {
                c.releasing = true;
                c.lane
            }
            _ => return,
        };
        st.adm.mark_releasing(lane);
    }

    /// Resizes the pool to `size`: the lanes' limits derived again for it
    /// (the lanes set explicitly kept), then deadpool resized in the same
    /// critical section (grown before the new limits admit more, shrunk
    /// after they stop admitting past the new size). Checkouts out stay
    /// out; a shrink below them admits nothing more until returns bring the
    /// pool below its new size, and deadpool closes the connections that
    /// come back past it.
    pub(crate) fn resize(self: &Arc<Self>, size: usize) -> Result<(), BuildError> {
        let mut fired = Fired::default();
        let limits = {
            let mut guard = self.state.lock();
            let st = &mut *guard;
            if st.adm.is_closed() || self.inner.is_closed() {
                return Err(BuildError::DeadpoolClosed);
            }
            let limits = st.adm.limits().resized(size)?;
            let grow = size > st.adm.limits().size();
            if grow {
                self.inner.resize(size);
            }
            let mut t = Tables {
                waiters: &mut st.waiters,
                checkouts: &mut st.checkouts,
                warned_sites: &mut st.warned_sites,
            };
            st.adm
                .set_limits(limits.clone(), |e| self.apply(&mut t, e, &mut fired));
            if !grow {
                self.inner.resize(size);
            }
            self.publish(st, u8::MAX);
            limits
        };
        self.metrics.publish_limits(&self.name, &limits);
        fired.send(self);
        Ok(())
    }

    /// Whether the pool was closed.
    pub(crate) fn is_closed(&self) -> bool {
        self.state.lock().adm.is_closed() || self.inner.is_closed()
    }

    /// Closes deadpool, stops the background work and fails every waiter.
    pub(crate) fn close(&self) {
        self.inner.close();
        self.supervisor.close();
        let mut gone = Vec::new();
        {
            let mut st = self.state.lock();
            let st = &mut *st;
            let mut keys = Vec::new();
            st.adm.close(|k| keys.push(k));
            for k in keys {
                if let Some(w) = st.waiters.try_remove(k) {
                    gone.push(w);
                }
            }
            self.publish(st, u8::MAX);
        }
        // Their receivers see the sender gone: `closed`.
        drop(gone);
    }
}
