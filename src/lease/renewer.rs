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
//!
//! # Batches and purges
//!
//! The renewer's tasks: one renewal batch, one purge round. Each runs as a
//! task of its own, bounded by its own statement budget, so that none waits
//! for another.

use std::any::Any;
use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use tokio::sync::Notify;

use super::backend::{Backend, LeasePool};
use super::inner::{Entry, Inner, Item, Registry, Urgency};
use super::table::{PurgeMark, PurgeMarkStmt, PurgeSweep, Renew, Terms};
use super::term::{self, LeaseState, Timing};
use crate::error::{Error, LeaseError};
use crate::lost::LostReason;
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

impl<B: Backend> Inner<B> {
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
        self.pool
            .shared()
            .supervise("lease renewer", start, Some(wind_down));
    }

    /// Starts the renewer again in the current runtime if its task is gone.
    pub(crate) fn ensure_renewer(self: &Arc<Self>) {
        if !self.renewer_alive.load(Ordering::Acquire) {
            self.pool.shared().revive_background();
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
            // Each task gets the guard of what it marked here: a task its
            // runtime drops before its first poll (the runtime dropped, or
            // its `block_on` ended) clears the marks as it goes, and so do
            // these guards when no task can be spawned.
            let mut batches = Vec::new();
            while !batch.is_empty() {
                let rest = batch.split_off(batch.len().min(MAX_BATCH));
                let items = std::mem::replace(&mut batch, rest);
                batches.push((BatchGuard::new(self.clone(), &items), items));
            }
            let round = purge.then(|| PurgeRound(self.clone()));
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                for (guard, items) in batches {
                    tracing::trace!(
                        pool = %self.pool_name, leases = items.len(), spawned = "renewal batch"
                    );
                    rt.spawn(Self::renew_batch(guard, items));
                }
                if let Some(round) = round {
                    tracing::trace!(pool = %self.pool_name, spawned = "purge round");
                    rt.spawn(Self::purge_round(round));
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

/// A statement error from a sqlx pool's connection: the statement went out.
fn sent_on_sqlx(e: &Error) -> bool {
    #[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
    if let Error::Sqlx(_) = e {
        return true;
    }
    let _ = e;
    false
}

/// The renewer task: runs while its [`Inner`] lives.
async fn run<B: Backend>(inner: Weak<Inner<B>>, wake: Arc<Notify>, _alive: Alive) {
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
            if inner.pool.shared().is_closed() && inner.registry.lock().entries.is_empty() {
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

/// The most rows one purge statement deletes; a round sends as many
/// statements as it needs. Small, because a statement locks its rows until
/// it commits: an acquisition of one of those (old, free) names waits for
/// it, up to the take-over bound (20 ms) before it answers busy. 5,000 rows
/// took about 30 ms a statement on two busy cores, and free names answered
/// busy (2 to 3 in 250); 500 take a few milliseconds.
pub(crate) const PURGE_BATCH: i64 = 500;

/// At most one log line per this interval, per instance, for a purge that
/// waits on a session holding the lease table.
const PURGE_WAIT_LOG_EVERY: Duration = Duration::from_secs(60);

/// Clears the in-flight mark of a batch's leases however the batch ends
/// (its task dropped before its first poll too: made where the marks are
/// set); a batch that did not complete (it panicked, or was dropped)
/// retries with back-off.
struct BatchGuard<B: Backend> {
    inner: Arc<Inner<B>>,
    ids: Vec<u64>,
    completed: bool,
}

impl<B: Backend> BatchGuard<B> {
    fn new(inner: Arc<Inner<B>>, items: &[Item]) -> Self {
        BatchGuard {
            inner,
            ids: items.iter().map(|i| i.id).collect(),
            completed: false,
        }
    }
}

impl<B: Backend> Drop for BatchGuard<B> {
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

/// Clears the registry's `purging` mark when a purge round ends, or its
/// task is dropped (before its first poll too: made where the mark is set).
struct PurgeRound<B: Backend>(Arc<Inner<B>>);

impl<B: Backend> Drop for PurgeRound<B> {
    fn drop(&mut self) {
        self.0.registry.lock().purging = false;
    }
}

impl<B: Backend> Inner<B> {
    /// One renewal statement for `items`, and its outcome applied. It may
    /// run until the earliest local deadline of its leases: past that, its
    /// statement is cancelled, and their deadlines fire on time anyway.
    async fn renew_batch(guard: BatchGuard<B>, items: Vec<Item>) {
        let inner = guard.inner.clone();
        let run = AssertUnwindSafe(inner.renew_batch_inner(&items, guard)).catch_unwind();
        if let Err(panic) = run.await {
            inner.renewer_panicked(&*panic);
        }
    }

    async fn renew_batch_inner(&self, items: &[Item], mut guard: BatchGuard<B>) {
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
            ) || result.as_ref().is_err_and(sent_on_sqlx)
            {
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
                let revoked = self.revoked(&taken).await;
                for state in &taken {
                    self.metrics.held.decrement(1.0);
                    let reason = if revoked.contains(&(&*state.name, state.token)) {
                        LostReason::Revoked
                    } else {
                        LostReason::Taken
                    };
                    self.mark_lost(state, reason);
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

    /// Of leases a renewal found gone, those whose row still carries their
    /// token with no holder: ended by hand ([`LostReason::Revoked`]), not
    /// taken over. Read once, bounded; on error none is (they are `Taken`).
    async fn revoked<'a>(&self, gone: &'a [Arc<LeaseState>]) -> HashSet<(&'a str, i64)> {
        if gone.is_empty() {
            return HashSet::new();
        }
        let stmt = Terms {
            names: gone.iter().map(|s| &*s.name).collect(),
        };
        let Ok(rows) = self
            .run(Urgency::Urgent, self.statement_timeout, &stmt)
            .await
        else {
            return HashSet::new();
        };
        gone.iter()
            .filter(|s| {
                rows.iter()
                    .any(|(n, h, t)| n.as_str() == &*s.name && h.is_empty() && *t == s.token)
            })
            .map(|s| (&*s.name, s.token))
            .collect()
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

    /// One purge round (the renewer's): see [`Inner::purge_once`].
    async fn purge_round(round: PurgeRound<B>) {
        // `round` clears the mark however the round ends: dropped with its
        // runtime too (else no round of this instance would ever run again).
        let inner = round.0.clone();
        let run = AssertUnwindSafe(inner.purge_once()).catch_unwind().await;
        drop(round);
        match run {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(
                pool = %inner.pool_name, error = %e,
                "lease purge failed; it runs again next interval"
            ),
            Err(panic) => inner.renewer_panicked(&*panic),
        }
    }

    /// One purge round: the sweep of the previous round's mark, then a new
    /// mark; returns the rows deleted.
    ///
    /// The sweep deletes the rows released or expired for longer than the
    /// purge age whose token is at most the mark's, once every lease
    /// statement that was in flight at the mark has ended (see
    /// `Statements::purge_mark` for why that keeps tokens growing), in
    /// statements of at most [`PURGE_BATCH`] rows until none is left or the
    /// statement timeout is spent. It takes no table lock of its own and
    /// waits for no row lock (a locked row stays for the next round), so
    /// no renewal, release or acquisition ever waits for it. While a
    /// transaction of the mark is still open (a statement still running, or
    /// a session holding the table for long: a user's transaction that wrote
    /// to it, a frozen backend), nothing is deleted and the next round
    /// sweeps with the same mark: its sessions are a fixed set, which ends.
    pub(crate) async fn purge_once(&self) -> Result<u64, Error> {
        let began = Instant::now();
        let previous = self.purge_mark.lock().take();
        let mut deleted = 0;
        let mut result = Ok(());
        if let Some((mark, marked)) = previous {
            loop {
                let left = self.statement_timeout.saturating_sub(began.elapsed());
                if left.is_zero() {
                    break;
                }
                let stmt = PurgeSweep {
                    mark: &mark,
                    age: self.purge.age,
                    limit: PURGE_BATCH,
                };
                let swept = match self.run(Urgency::Normal, left, &stmt).await {
                    Ok(swept) => swept,
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                };
                self.stats.lock().purge_statements += 1;
                let Some(n) = swept else {
                    // Still open: the same mark is swept next round (a new
                    // one would hold newer statements, and under a steady
                    // stream of them it might never drain).
                    self.purge_waited(&mark, marked.elapsed());
                    *self.purge_mark.lock() = Some((mark, marked));
                    break;
                };
                deleted += n;
                if n < PURGE_BATCH as u64 {
                    break;
                }
            }
        }
        {
            let mut s = self.stats.lock();
            s.purged += deleted;
        }
        self.metrics.purged.increment(deleted);
        if deleted > 0 {
            tracing::debug!(pool = %self.pool_name, rows = deleted, "lease rows purged");
        }
        result?;
        // A new mark, unless the last one still waits for its sessions.
        if self.purge_mark.lock().is_none() {
            let mark = self
                .run(Urgency::Normal, self.statement_timeout, &PurgeMarkStmt)
                .await?;
            self.stats.lock().purge_statements += 1;
            *self.purge_mark.lock() = Some((mark, Instant::now()));
        }
        Ok(deleted)
    }

    /// A sweep found a transaction of its mark still open: counted; logged
    /// (at most once per [`PURGE_WAIT_LOG_EVERY`]) once the mark is older
    /// than the statement timeout, which no lease statement outlives.
    fn purge_waited(&self, mark: &PurgeMark, waited: Duration) {
        self.stats.lock().purges_waited += 1;
        if waited < self.statement_timeout {
            return;
        }
        let now = self.created.elapsed();
        let mut last = self.purge_wait_logged.lock();
        if last.is_some_and(|t| now.saturating_sub(t) < PURGE_WAIT_LOG_EVERY) {
            return;
        }
        *last = Some(now);
        tracing::info!(
            pool = %self.pool_name,
            pids = ?mark.pids,
            vxids = ?mark.in_flight,
            waited_s = waited.as_secs_f64(),
            "lease purge waits: a transaction that held the lease table when the purge marked (pids and vxids: \
             the mark's) has not ended (one left open on it, or a stopped backend); nothing is deleted until it ends"
        );
    }
}
