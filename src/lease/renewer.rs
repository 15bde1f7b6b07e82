//! The renewer: one background task per [`Leases`](crate::Leases) that
//! renews, in one statement per tick, every lease of the instance that is
//! due, and fires the lost signal of leases it cannot keep.
//!
//! Each tick it
//! 1. fires `lost(Deadline)` for every lease whose local deadline passed,
//! 2. renews every lease due now or within half its interval (so leases
//!    taken at different times fold into one statement per interval) in one
//!    `UPDATE … FROM unnest(…)`, up to [`MAX_BATCH`] leases per statement,
//! 3. fires `lost(Taken)` for leases of the batch that statement did not
//!    touch, and schedules a retry with back-off for all of the batch when
//!    it failed (a transient error never drops a lease before its deadline),
//! 4. sleeps until the earliest due time or deadline, or a registration.
//!
//! A renewal statement may run until the earliest local deadline of any lease
//! held; past that, its connection is discarded (it may be stuck on a stopped
//! backend), and the deadline fires on time.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::guard::{LeaseState, LostReason};
use super::timing::{self, Timing};
use super::Inner;
use crate::admission::{Lane, Priority};
use crate::error::Error;

/// The most leases one renewal statement carries.
pub const MAX_BATCH: usize = 5_000;

/// The leases an instance holds, by registration id.
#[derive(Default)]
pub(crate) struct Registry {
    next_id: u64,
    entries: HashMap<u64, Entry>,
    /// When the renewer plans to wake next (`None`: it waits for a
    /// registration). A registration wakes it only when it is due sooner.
    next_wake: Option<Instant>,
}

struct Entry {
    state: Arc<LeaseState>,
    timing: Timing,
    due: Instant,
    deadline: Instant,
    attempt: u32,
}

struct Item {
    id: u64,
    state: Arc<LeaseState>,
    ttl: f64,
    deadline: Instant,
}

impl Registry {
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
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
            let deadline = timing.deadline(start);
            reg.entries.insert(
                id,
                Entry {
                    state,
                    timing,
                    due,
                    deadline,
                    attempt: 0,
                },
            );
            // Acquiring many leases must not wake the renewer (and its scan
            // of every lease held) once per lease.
            let sooner = reg.next_wake.is_none_or(|w| due.min(deadline) < w);
            if sooner {
                reg.next_wake = Some(due.min(deadline));
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

    fn ensure_renewer(self: &Arc<Self>) {
        if self.renewer_started.load(Ordering::Acquire) {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            if !self.renewer_started.swap(true, Ordering::AcqRel) {
                rt.spawn(run(Arc::downgrade(self), self.wake.clone()));
            }
        }
    }

    /// Fires the lost signal of a lease the renewer gave up on: logged and
    /// counted once.
    fn lost(&self, state: &LeaseState, reason: LostReason) {
        if !state.lose(reason) {
            return;
        }
        self.metrics.lost(&state.name, reason);
        tracing::warn!(
            pool = %self.pool_name,
            lease = %state.name,
            token = state.token,
            reason = reason.as_str(),
            "lease lost: {reason}; a job still running under it may overlap with the next holder"
        );
    }

    /// One tick; returns when to wake next (`None`: nothing held).
    async fn tick(&self) -> Option<Instant> {
        let now = Instant::now();
        let mut expired = Vec::new();
        let mut batch = Vec::new();
        let earliest = {
            let mut reg = self.registry.lock();
            reg.entries.retain(|_, e| {
                if now >= e.deadline {
                    expired.push(e.state.clone());
                    return false;
                }
                true
            });
            for (id, e) in reg.entries.iter() {
                if timing::is_due(now, e.due, e.attempt, e.timing.window()) {
                    batch.push(Item {
                        id: *id,
                        state: e.state.clone(),
                        ttl: e.timing.ttl.as_secs_f64(),
                        deadline: e.deadline,
                    });
                }
            }
            reg.entries.values().map(|e| e.deadline).min()
        };
        for state in &expired {
            self.metrics.held.decrement(1.0);
            self.lost(state, LostReason::Deadline);
        }
        for chunk in batch.chunks(MAX_BATCH) {
            self.renew_batch(chunk, earliest).await;
        }
        let mut reg = self.registry.lock();
        let min_interval = reg.entries.values().map(|e| e.timing.renew_every).min();
        self.metrics
            .renew_interval
            .set(min_interval.unwrap_or(Duration::ZERO).as_secs_f64());
        reg.next_wake = reg.entries.values().map(|e| e.due.min(e.deadline)).min();
        reg.next_wake
    }

    /// Sends one renewal statement for `items` and applies its outcome.
    /// It may run until `earliest`, the first local deadline of any lease
    /// held, so that no deadline waits for a stuck statement.
    async fn renew_batch(&self, items: &[Item], earliest: Option<Instant>) {
        let start = Instant::now();
        let deadlines = items.iter().map(|i| i.deadline).chain(earliest);
        let Some(budget) = timing::statement_budget(start, deadlines) else {
            return; // a deadline passed meanwhile: the next tick fires it
        };
        let budget = budget.min(self.statement_timeout);
        let names: Vec<&str> = items.iter().map(|i| &*i.state.name).collect();
        let holders: Vec<&str> = items.iter().map(|i| i.state.holder.as_str()).collect();
        let tokens: Vec<i64> = items.iter().map(|i| i.state.token).collect();
        let ttls: Vec<f64> = items.iter().map(|i| i.ttl).collect();
        let mut sent = false;
        let result = async {
            let conn = self.control(Lane::Lease, Priority::Urgent, budget).await?;
            let left = budget.saturating_sub(start.elapsed());
            sent = true;
            let fut = self.sql.renew(&conn, &names, &holders, &tokens, &ttls);
            match tokio::time::timeout(left, fut).await {
                Ok(r) => Ok(r?),
                Err(_) => {
                    conn.discard();
                    Err(Error::LeaseTimeout {
                        what: "renewal",
                        waited: start.elapsed(),
                    })
                }
            }
        }
        .await;
        let took = start.elapsed();
        self.metrics.renewal.record(took.as_secs_f64());
        let (ok_count, failed) = match &result {
            Ok(rows) => (rows.len() as u64, false),
            Err(_) => (0, true),
        };
        {
            // One lock: a snapshot never sees a statement without its renewals.
            let mut s = self.stats.lock();
            if sent {
                s.statements += 1;
                s.renewal_statements += 1;
            }
            if failed {
                s.renewal_failures += 1;
            } else {
                s.renewed += ok_count;
                s.last_batch = items.len();
                s.last_renewal = took;
            }
        }
        match result {
            Ok(rows) => {
                let renewed: HashSet<(&str, i64)> =
                    rows.iter().map(|(n, t)| (n.as_str(), *t)).collect();
                let mut taken = Vec::new();
                let mut ok = 0u64;
                {
                    let mut reg = self.registry.lock();
                    for item in items {
                        let Some(e) = reg.entries.get_mut(&item.id) else {
                            continue; // released meanwhile
                        };
                        if renewed.contains(&(&*item.state.name, item.state.token)) {
                            e.due = e.timing.due_after(start);
                            e.deadline = e.timing.deadline(start);
                            e.attempt = 0;
                            ok += 1;
                        } else if let Some(e) = reg.entries.remove(&item.id) {
                            taken.push(e.state);
                        }
                    }
                }
                self.metrics.renew_ok.increment(ok);
                self.metrics.renew_lost.increment(taken.len() as u64);
                for state in &taken {
                    self.metrics.held.decrement(1.0);
                    self.lost(state, LostReason::Taken);
                }
            }
            Err(err) => {
                self.metrics.renew_error.increment(items.len() as u64);
                let now = Instant::now();
                let mut reg = self.registry.lock();
                let mut first = None;
                for item in items {
                    if let Some(e) = reg.entries.get_mut(&item.id) {
                        e.attempt = e.attempt.saturating_add(1);
                        e.due = now + e.timing.backoff(e.attempt);
                        first.get_or_insert((e.attempt, e.deadline));
                    }
                }
                drop(reg);
                if let Some((attempt, deadline)) = first {
                    tracing::warn!(
                        pool = %self.pool_name,
                        leases = items.len(),
                        attempt,
                        until_deadline = ?deadline.saturating_duration_since(now),
                        error = %err,
                        "lease renewal failed; retrying until the local deadline"
                    );
                }
            }
        }
    }
}

/// The renewer task: runs while its [`Inner`] lives.
async fn run(inner: Weak<Inner>, wake: Arc<Notify>) {
    loop {
        let next = {
            let Some(inner) = inner.upgrade() else { return };
            inner.tick().await
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
