//! The renewer's tasks: one renewal batch, one purge round. Each runs as a
//! task of its own, bounded by its own statement budget, so that none waits
//! for another.

use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;

use futures_util::FutureExt;

use super::guard::LostReason;
use super::inner::Urgency;
use super::inner::{Item, Registry};
use super::table::{Purge, Renew};
use super::term;
use super::Inner;
use crate::error::{Error, LeaseError};

/// The most rows one purge statement deletes: its transaction holds the
/// table's `SHARE` lock, during which lease statements wait; 500 rows keep
/// that short.
pub(crate) const PURGE_BATCH: i64 = 500;

/// Clears the in-flight mark of a batch's leases however the batch ends; a
/// batch that did not complete (it panicked) retries with back-off.
struct BatchGuard<'a> {
    inner: &'a Inner,
    ids: Vec<u64>,
    completed: bool,
}

impl Drop for BatchGuard<'_> {
    fn drop(&mut self) {
        let now = Instant::now();
        {
            let mut reg = self.inner.registry.lock();
            for id in &self.ids {
                if let Some(e) = reg.entries.get_mut(id) {
                    e.in_flight = false;
                    if !self.completed {
                        e.attempt = e.attempt.saturating_add(1);
                        e.due = now + e.timing.backoff(e.attempt);
                    }
                }
            }
        }
        self.inner.wake.notify_one();
    }
}

impl Inner {
    /// One renewal statement for `items`, and its outcome applied. It may
    /// run until the earliest local deadline of its leases: past that, its
    /// statement is cancelled, and their deadlines fire on time anyway.
    pub(super) async fn renew_batch(self: Arc<Self>, items: Vec<Item>) {
        let run = AssertUnwindSafe(self.renew_batch_inner(&items)).catch_unwind();
        if let Err(panic) = run.await {
            self.renewer_panicked(&*panic);
        }
    }

    async fn renew_batch_inner(&self, items: &[Item]) {
        let mut guard = BatchGuard {
            inner: self,
            ids: items.iter().map(|i| i.id).collect(),
            completed: false,
        };
        let start = Instant::now();
        let deadlines = items.iter().map(|i| i.state.deadline());
        let Some(budget) = term::statement_budget(start, deadlines) else {
            guard.completed = true;
            return; // a deadline passed meanwhile: the next tick drops it
        };
        let stmt = Renew {
            names: items.iter().map(|i| &*i.state.name).collect(),
            holders: items.iter().map(|i| i.state.holder.as_str()).collect(),
            tokens: items.iter().map(|i| i.state.token).collect(),
            ttls: items.iter().map(|i| i.ttl).collect(),
        };
        let result = self
            .run(Urgency::Urgent, budget.min(self.statement_timeout), &stmt)
            .await;
        let took = start.elapsed();
        // Apply the outcome first: whatever the metrics recorder does next,
        // the leases' state is right.
        let mut taken = Vec::new();
        let mut ok = 0u64;
        match &result {
            Ok(rows) => {
                let renewed: HashSet<(&str, i64)> =
                    rows.iter().map(|(n, t)| (n.as_str(), *t)).collect();
                let mut reg = self.registry.lock();
                for item in items {
                    if renewed.contains(&(&*item.state.name, item.state.token)) {
                        if let Some(e) = reg.entries.get_mut(&item.id) {
                            item.state.extend(e.timing.deadline(start));
                            e.due = e.timing.due_after(start);
                            e.attempt = 0;
                            ok += 1;
                        }
                    } else if let Some(e) = reg.entries.remove(&item.id) {
                        taken.push(e.state);
                    }
                }
            }
            Err(_) => {
                let now = Instant::now();
                let mut reg = self.registry.lock();
                for item in items {
                    if let Some(e) = reg.entries.get_mut(&item.id) {
                        e.attempt = e.attempt.saturating_add(1);
                        e.due = now + e.timing.backoff(e.attempt);
                    }
                }
            }
        }
        guard.completed = true;
        drop(guard);
        {
            // One lock: a snapshot never sees a statement without its renewals.
            let mut s = self.stats.lock();
            if matches!(
                result,
                Ok(_) | Err(Error::Db(_) | Error::Lease(LeaseError::Timeout { .. }))
            ) {
                s.renewal_statements += 1;
            }
            match &result {
                Ok(_) => {
                    s.renewed += ok;
                    s.last_batch = items.len();
                    s.last_renewal = took;
                }
                Err(_) => s.renewal_failures += 1,
            }
        }
        match result {
            Ok(_) => {
                self.metrics.renew_ok.increment(ok);
                self.metrics.renew_lost.increment(taken.len() as u64);
                for state in &taken {
                    self.metrics.held.decrement(1.0);
                    self.mark_lost(state, LostReason::Taken);
                }
            }
            Err(err) => {
                self.metrics.renew_error.increment(items.len() as u64);
                let first = items.first().map(|i| i.state.deadline());
                tracing::warn!(
                    pool = %self.pool_name,
                    leases = items.len(),
                    until_deadline = ?first.map(|d| d.saturating_duration_since(Instant::now())),
                    error = %err,
                    "lease renewal failed; retrying until the local deadline"
                );
            }
        }
        self.metrics.renewal.record(took.as_secs_f64());
    }

    /// Whether a purge is due at `now`; marks it started and schedules the
    /// next one.
    pub(super) fn purge_due(&self, reg: &mut Registry, now: Instant) -> bool {
        let p = self.purge;
        if !p.auto {
            return false;
        }
        let next = *reg.next_purge.get_or_insert(now + p.every);
        if reg.purging || now < next {
            return false;
        }
        reg.purging = true;
        reg.next_purge = Some(now + p.every);
        true
    }

    /// One purge statement (the renewer's round).
    pub(super) async fn purge_round(self: Arc<Self>) {
        let run = AssertUnwindSafe(self.purge_once()).catch_unwind().await;
        self.registry.lock().purging = false;
        match run {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(
                pool = %self.pool_name, error = %e,
                "lease purge failed; it runs again next interval"
            ),
            Err(panic) => self.renewer_panicked(&*panic),
        }
    }

    /// One purge statement: rows deleted.
    pub(crate) async fn purge_once(&self) -> Result<u64, Error> {
        let stmt = Purge {
            age: self.purge.age,
            limit: PURGE_BATCH,
        };
        let Some(n) = self
            .run(Urgency::Normal, self.statement_timeout, &stmt)
            .await?
        else {
            self.stats.lock().purge_statements += 1;
            tracing::debug!(
                pool = %self.pool_name,
                "lease purge skipped: lease statements kept the table busy; it runs again next interval"
            );
            return Ok(0);
        };
        {
            let mut s = self.stats.lock();
            s.purged += n;
            s.purge_statements += 1;
        }
        self.metrics.purged.increment(n);
        if n > 0 {
            tracing::debug!(pool = %self.pool_name, rows = n, "lease rows purged");
        }
        Ok(n)
    }
}
