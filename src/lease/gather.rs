//! Acquisitions gathered into one statement.
//!
//! An instance sends at most [`IN_FLIGHT`] acquisition statements at a time.
//! An acquisition that comes while they are out waits, with the others that
//! come meanwhile, and they go to the server together in one statement (up
//! to [`MAX_BATCH`] distinct names; the table's `acquire_batch`) as soon as
//! one of those statements ends. One acquisition at a time runs exactly as
//! before, in its own statement: gathering starts only when acquisitions
//! overlap, and then each statement, its round trip and its transaction
//! serve many of them.
//!
//! Each acquisition of a batch gets what its own statement would have given:
//! the term taken, or busy. When the batch's statement fails on the server
//! (a take-over of one of its names met a row lock past its bound, say),
//! nothing was taken and each acquisition runs alone, so each gets its own
//! answer (busy for the blocked name, the lease for the others). When it
//! runs out of time, it may have taken some leases: each acquisition answers
//! the timeout, and the leases the batch took are released by holder, as
//! after a cancelled acquisition. An acquisition whose caller gave up while
//! it waited is left out of the next batch, or, if its batch took the lease
//! for it, released: the term travels to its caller in a `Won` (see `inner.rs`), which
//! releases it (in the background) when dropped before its caller took it,
//! whether the caller was gone when the batch answered or never polled
//! again after, and a batch answers every caller before any such release
//! runs. Callers waiting for the same name share one attempt: the batch
//! tries the name once, the first caller gets the term if it was taken,
//! the others the busy answer their own statements would have given then.
//! A statement sent alone runs in its caller's future (no task of its own:
//! where nothing is gathered, a lease pair costs what its two statements
//! cost): a caller that gives up leaves it to end on the server (cancelled
//! on a direct connection), and what it took is released by holder once it
//! has ended, never before (`InFlight`, in `inner.rs`), its slot held until
//! then. A
//! call still waiting after [`PATIENCE`] (100 ms, or
//! twice the statements' recent time on a slow link, up to 1 s: the
//! statements out are stuck on a lock or a slow server) leaves the queue
//! and sends its own statement, as it would without gathering. Releases are
//! gathered the same way.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::oneshot;

use super::backend::Backend;
use super::inner::{Acquiring, FollowUp, Gather, Inner, Joined, Releasing, Urgency, Won};
use super::table::{Acquire, AcquireBatch, Busy, Release, ReleaseBatch, Taken};
use crate::error::{Error, LeaseError};

/// Acquisition statements one instance sends at a time; acquisitions that
/// come while this many are out are gathered into the next one.
///
/// Measured on two cores against the plain lease SQL prepared (benchmark
/// rows 4b, 16 tasks acquiring and releasing new names on a pool of 16, and
/// 4c, attempts on held names; `--only` runs, one after the other): 1 gave
/// 4b 1.159 (0.42 statements per pair) and 4c 2.391; 2 gave 1.228 and, in
/// the full run, 1.237 and 1.954; 4 gave 0.999 (1.05 statements per pair)
/// and 2.090. Without gathering, 4b measured 0.70. Fewer out at a time make
/// larger batches, and make more calls wait for one slow statement.
pub(crate) const IN_FLIGHT: usize = 2;

/// How long a call waits for a batch at least before it sends its own
/// statement: twice the statements' recent time when that is longer (a
/// slow link: a 200 ms round trip makes every statement take 200 ms, and
/// the calls behind them still share the next), up to [`MAX_PATIENCE`]. A
/// batch normally answers within a few milliseconds; past this the
/// statements out are stuck (a lock, a slow server), and the calls behind
/// them go alone, as without gathering.
pub(crate) const PATIENCE: Duration = Duration::from_millis(100);

/// The longest a call waits for a batch, however slow the statements have
/// been lately (a statement stuck on a lock for seconds raises their
/// recent time for a while).
pub(crate) const MAX_PATIENCE: Duration = Duration::from_secs(1);

/// The most acquisitions in one statement.
pub(crate) const MAX_BATCH: usize = 64;

impl<B: Backend> Gathered<B> for Acquiring<B> {
    fn name(&self) -> &str {
        &self.name
    }
    fn holder(&self) -> &str {
        &self.holder
    }
    fn gave_up(&self) -> bool {
        self.tx.is_closed()
    }
    fn gather(inner: &Inner<B>) -> &Mutex<Gather<Self>> {
        &inner.acquiring
    }
    async fn send(inner: Arc<Inner<B>>, batch: Vec<Self>) {
        inner.send_acquisitions(batch).await
    }
    fn alone(self) {
        let _ = self.tx.send(Joined::Alone);
        for f in self.followers {
            let _ = f.send(Joined::Alone);
        }
    }
    /// Callers of the same name share one attempt.
    fn follow(&mut self, other: Self) -> Result<(), Self> {
        self.followers.push(other.tx);
        self.followers.extend(other.followers);
        Ok(())
    }
}

impl<B: Backend> Gathered<B> for Releasing {
    fn name(&self) -> &str {
        &self.name
    }
    fn holder(&self) -> &str {
        &self.holder
    }
    /// A release goes even when its caller stopped waiting for it.
    fn gave_up(&self) -> bool {
        false
    }
    fn gather(inner: &Inner<B>) -> &Mutex<Gather<Self>> {
        &inner.releasing
    }
    async fn send(inner: Arc<Inner<B>>, batch: Vec<Self>) {
        inner.send_releases(batch).await
    }
    fn alone(self) {
        let _ = self.tx.send(Joined::Alone);
    }
}

/// What waits for a batch: its name (distinct within a batch), whether its
/// caller gave up, which gathering it belongs to, and how a batch of its
/// kind is sent and answered.
pub(crate) trait Gathered<B: Backend>: Sized + Send + 'static {
    fn name(&self) -> &str;
    /// Its term's holder id: new on every acquisition, so it tells one call
    /// from every other.
    fn holder(&self) -> &str;
    fn gave_up(&self) -> bool;
    fn gather(inner: &Inner<B>) -> &Mutex<Gather<Self>>;
    fn send(inner: Arc<Inner<B>>, batch: Vec<Self>) -> impl Future<Output = ()> + Send;
    /// Tells it to send its own statement.
    fn alone(self);
    /// Joins `other`, which waits for the same name, to this one's
    /// attempt; `Err(other)` when the kind does not share (it then waits
    /// for the next batch).
    fn follow(&mut self, other: Self) -> Result<(), Self> {
        Err(other)
    }
}

/// One of the [`IN_FLIGHT`] statements of a kind; dropped (ended,
/// cancelled or panicked), it goes to those waiting, if any.
struct Slot<B: Backend, W: Gathered<B>> {
    inner: Arc<Inner<B>>,
    /// Whether its drop may hand it to a new task: false for a slot on its
    /// way into a task not yet polled (a runtime shutting down drops such a
    /// task at once; then its drop hands over without spawning again).
    may_spawn: bool,
    kind: PhantomData<fn() -> W>,
}

impl<B: Backend, W: Gathered<B>> Slot<B, W> {
    fn new(inner: Arc<Inner<B>>) -> Slot<B, W> {
        Slot {
            inner,
            may_spawn: true,
            kind: PhantomData,
        }
    }

    async fn run_batches(mut self) {
        self.may_spawn = true;
        loop {
            let batch = take_batch::<B, W>(&mut W::gather(&self.inner).lock().waiting);
            if batch.is_empty() {
                return; // the slot's drop looks once more, under the lock
            }
            let began = Instant::now();
            W::send(self.inner.clone(), batch).await;
            W::gather(&self.inner).lock().observe(began.elapsed());
        }
    }
}

impl<B: Backend, W: Gathered<B>> Drop for Slot<B, W> {
    fn drop(&mut self) {
        let inner = self.inner.clone();
        let mut g = W::gather(&inner).lock();
        if g.waiting.is_empty() {
            g.in_flight -= 1;
            return;
        }
        if self.may_spawn {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                drop(g);
                // The slot goes on in the task: `in_flight` is unchanged.
                let next = Slot::<B, W> {
                    inner: inner.clone(),
                    may_spawn: false,
                    kind: PhantomData,
                };
                rt.spawn(next.run_batches());
                return;
            }
        }
        // No runtime to run a batch on: each runs alone (if its own runtime
        // still exists).
        g.in_flight -= 1;
        let waiting = std::mem::take(&mut g.waiting);
        drop(g);
        for w in waiting {
            w.alone();
        }
    }
}

/// Up to [`MAX_BATCH`] of distinct names, in the order they came, then
/// sorted by name (two batches lock rows in one order); those whose caller
/// gave up are left out. A call for a name already in the batch joins that
/// name's attempt when its kind shares ([`Gathered::follow`]), else waits
/// for the next batch.
fn take_batch<B: Backend, W: Gathered<B>>(waiting: &mut Vec<W>) -> Vec<W> {
    waiting.retain(|w| !w.gave_up());
    let mut at: HashMap<String, usize> = HashMap::new();
    let mut batch: Vec<W> = Vec::new();
    let mut rest = Vec::new();
    for w in waiting.drain(..) {
        if let Some(&i) = at.get(w.name()) {
            if let Err(w) = batch[i].follow(w) {
                rest.push(w);
            }
        } else if batch.len() < MAX_BATCH {
            at.insert(w.name().to_owned(), batch.len());
            batch.push(w);
        } else {
            rest.push(w);
        }
    }
    *waiting = rest;
    batch.sort_by(|a, b| a.name().cmp(b.name()));
    batch
}

/// Takes one of the [`IN_FLIGHT`] slots, or else a place among those
/// waiting (`waiting` makes it, with the receiver its caller awaits).
fn enter<B: Backend, W: Gathered<B>, A>(
    inner: &Arc<Inner<B>>,
    waiting: impl FnOnce(oneshot::Sender<A>) -> W,
) -> Result<Slot<B, W>, oneshot::Receiver<A>> {
    let mut g = W::gather(inner).lock();
    if g.in_flight < IN_FLIGHT {
        g.in_flight += 1;
        return Ok(Slot::new(inner.clone()));
    }
    let (tx, rx) = oneshot::channel();
    g.waiting.push(waiting(tx));
    Err(rx)
}

impl<B: Backend> Inner<B> {
    /// One acquisition statement, alone or gathered with others (see the
    /// module docs), bounded by the statement timeout.
    pub(crate) async fn acquire_gathered(
        self: &Arc<Self>,
        stmt: &Acquire<'_>,
    ) -> Result<Result<Taken, Busy>, Error> {
        let began = Instant::now();
        let entered = enter(self, |tx| Acquiring {
            name: stmt.name.to_owned(),
            holder: stmt.holder.to_owned(),
            ttl: stmt.ttl,
            hold: stmt.hold,
            tx,
            followers: Vec::new(),
        });
        let rx = match entered {
            Ok(slot) => return self.acquire_alone(stmt, began, Some(slot)).await,
            Err(rx) => rx,
        };
        match self
            .joined::<Acquiring<B>, _>(
                rx,
                stmt.holder,
                began,
                self.statement_timeout,
                "acquisition",
            )
            .await?
        {
            Some(answer) => Ok(answer.map(Won::take)),
            None => self.acquire_alone(stmt, began, None).await,
        }
    }

    /// One acquisition in its own statement (with `slot`, when it holds
    /// one), in its caller's future: no task, no channel. Cut short (out of
    /// time, or this future dropped while the statement is out), the
    /// statement is cancelled on the server where a cancel can reach it and
    /// left to end there; whatever it took is released by holder once it
    /// has ended, seen on its own connection (`InFlight`, in `inner.rs`),
    /// and the slot is held until then, so that no more than [`IN_FLIGHT`]
    /// acquisition statements are ever out. Bounded by the statement
    /// timeout from `began`.
    async fn acquire_alone(
        self: &Arc<Self>,
        stmt: &Acquire<'_>,
        began: Instant,
        slot: Option<Slot<B, Acquiring<B>>>,
    ) -> Result<Result<Taken, Busy>, Error> {
        let had_slot = slot.is_some();
        let (name, holder) = (stmt.name, stmt.holder);
        let follow_up = move || -> Option<FollowUp> {
            let (inner, name, holder) = (self.clone(), name.to_owned(), holder.to_owned());
            Some(Box::pin(async move {
                inner.release_cancelled(&name, &holder).await;
                drop(slot); // the next batch may go
            }))
        };
        let answer = self
            .run_then(
                Urgency::Normal,
                began,
                self.statement_timeout,
                stmt,
                follow_up,
            )
            .await;
        // Ended (its slot, if any, dropped with the follow-up it was not
        // needed for): its time is the statements' recent time.
        if had_slot {
            self.acquiring.lock().observe(began.elapsed());
        }
        answer
    }

    /// One release statement within `budget`, alone or gathered with others:
    /// whether the term was still this holder's.
    pub(crate) async fn release_gathered(
        self: &Arc<Self>,
        stmt: &Release<'_>,
        budget: Duration,
    ) -> Result<bool, Error> {
        let began = Instant::now();
        let entered = enter(self, |tx| Releasing {
            name: stmt.name.to_owned(),
            holder: stmt.holder.to_owned(),
            keep_hold: stmt.keep_hold,
            tx,
        });
        let rx = match entered {
            Ok(_slot) => {
                let r = self.run(Urgency::Urgent, budget, stmt).await;
                self.releasing.lock().observe(began.elapsed());
                return r;
            }
            Err(rx) => rx,
        };
        match self
            .joined::<Releasing, _>(rx, stmt.holder, began, budget, "release")
            .await?
        {
            Some(ours) => Ok(ours),
            None => self.run_since(Urgency::Urgent, began, budget, stmt).await,
        }
    }

    /// The batch's answer for one of its own within `budget`: `None` when
    /// it must send its own statement. Still waiting for a batch after
    /// [`PATIENCE`], or twice the statements' recent time when longer (up
    /// to [`MAX_PATIENCE`]; the statements out are slower than lately:
    /// waiting on a lock, a slow server), it leaves the queue and sends its
    /// own, as it would without gathering; if a batch has it already, it
    /// waits for that batch.
    async fn joined<W: Gathered<B>, T>(
        &self,
        mut rx: oneshot::Receiver<Joined<T>>,
        holder: &str,
        began: Instant,
        budget: Duration,
        what: &'static str,
    ) -> Result<Option<T>, Error> {
        let timed_out = || {
            Error::Lease(LeaseError::Timeout {
                what,
                waited: began.elapsed(),
            })
        };
        let patience = W::gather(self).lock().recent.map_or(PATIENCE, |r| {
            r.saturating_mul(2).clamp(PATIENCE, MAX_PATIENCE)
        });
        let answer = match tokio::time::timeout(patience.min(budget), &mut rx).await {
            Ok(answer) => Ok(answer),
            Err(_) => {
                let left = {
                    let mut g = W::gather(self).lock();
                    let at = g.waiting.iter().position(|w| w.holder() == holder);
                    at.map(|at| g.waiting.remove(at))
                };
                if left.is_some() {
                    tracing::debug!(
                        pool = %self.pool_name, statement = what,
                        "no batch within {patience:?}: sent alone"
                    );
                    return Ok(None);
                }
                let left = budget.saturating_sub(began.elapsed());
                tokio::time::timeout(left, rx).await
            }
        };
        match answer {
            Ok(Ok(Joined::Done(answer))) => Ok(Some(answer)),
            Ok(Ok(Joined::TimedOut)) => Err(timed_out()),
            // Dropping the receiver leaves it out of its batch (or has the
            // batch undo what it did for it).
            Err(_) => {
                self.metrics.timed_out(what);
                Err(timed_out())
            }
            // Told to, or its batch is gone (a panic, a runtime shut down).
            Ok(Ok(Joined::Alone)) | Ok(Err(_)) => Ok(None),
        }
    }

    /// Acquisitions waiting for the next statement now.
    pub(crate) fn waiting(&self) -> usize {
        let g = self.acquiring.lock();
        g.waiting.iter().filter(|w| !w.gave_up()).count()
    }

    fn count_gathered(&self, n: usize) {
        let mut stats = self.stats.lock();
        stats.gathered += n as u64;
        stats.gathered_statements += 1;
    }

    /// Sends one batch of acquisitions and answers each.
    async fn send_acquisitions(self: &Arc<Self>, batch: Vec<Acquiring<B>>) {
        let mut stmt = AcquireBatch::default();
        for w in &batch {
            let (least, period) = w.hold.unwrap_or((0.0, 0.0));
            stmt.names.push(w.name.clone());
            stmt.holders.push(w.holder.clone());
            stmt.ttls.push(w.ttl);
            stmt.leasts.push(least);
            stmt.periods.push(period);
        }
        // Cancelled after it reached the server (out of time), the batch may
        // have taken some of its leases: release each by holder.
        let follow_up = || -> Option<FollowUp> {
            let inner = self.clone();
            let terms: Vec<(String, String)> = batch
                .iter()
                .map(|w| (w.name.clone(), w.holder.clone()))
                .collect();
            Some(Box::pin(async move {
                for (name, holder) in terms {
                    inner.release_cancelled(&name, &holder).await;
                }
            }))
        };
        let answer = self
            .run_then(
                Urgency::Normal,
                Instant::now(),
                self.statement_timeout,
                &stmt,
                follow_up,
            )
            .await;
        match answer {
            Ok(Some(taken)) => {
                self.count_gathered(batch.iter().map(|w| 1 + w.followers.len()).sum());
                let mut taken: HashMap<String, Taken> = taken.into_iter().collect();
                // Every caller is answered here, at once: a term whose
                // caller is gone is released in the background as its
                // `Won` drops, never in this loop.
                for w in batch {
                    let answer = match taken.remove(&w.name) {
                        Some(t) => Ok(Won::new(self, &w.name, &w.holder, t)),
                        None => Err(Busy::Held),
                    };
                    // The other callers of the name: its own statement,
                    // sent now, would have found it held (by this one's
                    // term, or as this one did).
                    for f in w.followers {
                        let _ = f.send(Joined::Done(Err(Busy::Held)));
                    }
                    let _ = w.tx.send(Joined::Done(answer));
                }
            }
            Err(Error::Lease(LeaseError::Timeout { .. })) => {
                for w in batch {
                    for f in w.followers {
                        let _ = f.send(Joined::TimedOut);
                    }
                    let _ = w.tx.send(Joined::TimedOut);
                }
            }
            // Its answer lost with its connection: what it took is released
            // by holder (`run_then`), so no caller may send its own
            // statement under the same holder (that release would undo the
            // term it took: two holders). Each answers as after a timeout:
            // its outcome unknown, nothing of it kept.
            Err(e) if super::inner::answer_lost(&e) => {
                tracing::debug!(pool = %self.pool_name, error = %e, "a batch of acquisitions lost its answer with its connection: each answers the timeout");
                for w in batch {
                    for f in w.followers {
                        let _ = f.send(Joined::TimedOut);
                    }
                    let _ = w.tx.send(Joined::TimedOut);
                }
            }
            // A lock wait ended by the server, or any other failure: the
            // statement took nothing; each tries alone.
            Ok(None) => {
                tracing::debug!(pool = %self.pool_name, "a batch of acquisitions met a lock wait past its bound: each is sent alone");
                batch.into_iter().for_each(Gathered::<B>::alone)
            }
            Err(e) => {
                tracing::debug!(pool = %self.pool_name, error = %e, "a batch of acquisitions failed: each is sent alone");
                batch.into_iter().for_each(Gathered::<B>::alone)
            }
        }
    }

    /// Sends one batch of releases and answers each.
    async fn send_releases(self: &Arc<Self>, batch: Vec<Releasing>) {
        let mut stmt = ReleaseBatch::default();
        for w in &batch {
            stmt.names.push(w.name.clone());
            stmt.holders.push(w.holder.clone());
            if !w.keep_hold {
                stmt.forget_hold.push(w.holder.clone());
            }
        }
        match self
            .run(Urgency::Urgent, self.statement_timeout, &stmt)
            .await
        {
            Ok(Some(released)) => {
                self.count_gathered(batch.len());
                let released: HashSet<String> = released.into_iter().collect();
                for w in batch {
                    let ours = released.contains(&w.name);
                    let _ = w.tx.send(Joined::Done(ours));
                }
            }
            Err(Error::Lease(LeaseError::Timeout { .. })) => {
                for w in batch {
                    let _ = w.tx.send(Joined::TimedOut);
                }
            }
            Ok(None) => batch.into_iter().for_each(Gathered::<B>::alone),
            Err(e) => {
                tracing::debug!(pool = %self.pool_name, error = %e, "a batch of releases failed: each is sent alone");
                batch.into_iter().for_each(Gathered::<B>::alone)
            }
        }
    }
}

#[cfg(test)]
mod tests;
