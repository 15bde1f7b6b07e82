//! The readiness probe's work: `SELECT 1` on the probe lane, bounded, on a
//! connection whose set-up may outlive one probe.
//!
//! On a slow link (a far region, TLS) making a connection and asking it
//! `SELECT 1` can take longer than a probe's bound: a probe that threw its
//! half-made connection away would leave the next one to start from
//! scratch, and readiness would never succeed. So the probe (checkout and
//! `SELECT 1`) runs in a task of its own: when the probe's bound runs out,
//! the caller gets its timeout at once, and a connection still being made
//! for it (or just made, its `SELECT 1` under way) goes on for up to
//! [`SETUP_BOUND`] (or the probe's bound, when longer); once it answered, it
//! goes back to the pool, where the next probe (queued behind it on the
//! probe lane) finds it. A connection that does not answer within its bound
//! is closed, never reused; one in use before is held to the probe's own
//! bound (it not answering is the server's or the link's fault, not a
//! set-up's). One such probe per pool runs on past its bound at a time;
//! while one does, probes run in the caller's task as any other checkout
//! does.

use std::panic::Location;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::deadline::{bounded, deadline};
use super::shared::Shared;
use super::source::Source;
use crate::admission::Lane;
use crate::error::{CheckoutError, Error};

/// How long a probe's work (connection set-up, `SELECT 1`) may go on in the
/// background after the probe's own bound ran out (the probe's bound, when
/// longer).
pub(crate) const SETUP_BOUND: Duration = Duration::from_secs(10);

/// Clears the pool's "a probe runs in the background" flag when dropped
/// (it ended, or its runtime went away).
struct SetupInFlight<B: Source>(Arc<Shared<B>>);

impl<B: Source> Drop for SetupInFlight<B> {
    fn drop(&mut self) {
        self.0.probe_setup.store(false, Ordering::Release);
        // Wakes the probes waiting for it, whatever it came to.
        self.0.probe_answered.send_modify(|_| ());
    }
}

impl<B: Source> Shared<B> {
    /// `SELECT 1` on the probe lane within `timeout`, checkout included; its
    /// latency ([`Pool::readiness`]).
    pub(crate) async fn probe(
        self: &Arc<Self>,
        timeout: Duration,
        site: &'static Location<'static>,
    ) -> Result<Duration, Error> {
        let start = tokio::time::Instant::now();
        let m = &self.metrics;
        if timeout.is_zero() {
            // No probe can answer within nothing: say so at once, without
            // checking out (and then closing) a healthy connection.
            m.readiness_timeout.increment(1);
            return Err(Error::Checkout(CheckoutError::ReadinessTimeout(timeout)));
        }
        let result = match self.probe_kept(timeout, site, start).await {
            Err(e) if e.is_timeout() => {
                Err(Error::Checkout(CheckoutError::ReadinessTimeout(timeout)))
            }
            r => r,
        };
        let took = start.elapsed();
        let result = match result {
            // Answered, but after the bound (the answer and the timer came
            // in one wake-up, the answer polled first; a busy machine wakes
            // late): not ready within it, whatever the order of the polls.
            Ok(()) if took > timeout => {
                Err(Error::Checkout(CheckoutError::ReadinessTimeout(timeout)))
            }
            r => r,
        };
        match result {
            Ok(()) => {
                m.readiness.record(took.as_secs_f64());
                Ok(took)
            }
            Err(e) => {
                if e.is_timeout() {
                    m.readiness_timeout.increment(1);
                } else {
                    m.readiness_error.increment(1);
                }
                Err(e)
            }
        }
    }

    /// The probe within `timeout` from `start`, its work kept going in the
    /// background when it outlives that bound.
    async fn probe_kept(
        self: &Arc<Self>,
        timeout: Duration,
        site: &'static Location<'static>,
        start: tokio::time::Instant,
    ) -> Result<(), Error> {
        let rt = match tokio::runtime::Handle::try_current() {
            Ok(rt) if !self.probe_setup.swap(true, Ordering::AcqRel) => rt,
            // Outside a runtime: in the caller's task.
            Err(_) => return self.probe_once(timeout, timeout, site, start).await,
            // One kept already: its answer, when it comes within this
            // probe's bound, then (it failed, or none is kept any more) in
            // the caller's task.
            Ok(_) => {
                if self.setup_answered(start, deadline(start, timeout)).await? {
                    return Ok(());
                }
                return self.probe_once(timeout, timeout, site, start).await;
            }
        };
        let in_flight = SetupInFlight(self.clone());
        let pool = self.clone();
        let work = rt.spawn(async move {
            let _in_flight = in_flight;
            let r = pool
                .probe_once(timeout, timeout.max(SETUP_BOUND), site, start)
                .await;
            if r.is_ok() {
                pool.probe_answered
                    .send_replace(Some(tokio::time::Instant::now()));
            }
            r
        });
        // The probe's own bound, tightened by the `Deadline` scope it runs in
        // (the task above runs outside it).
        let own = bounded(start, deadline(start, timeout));
        match tokio::time::timeout_at(own, work).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // Cancelled (its runtime is shutting down), or the bound ran out:
            // the work goes on, its connection kept for the next probe.
            Ok(Err(_)) | Err(_) => Err(Error::Checkout(CheckoutError::ReadinessTimeout(timeout))),
        }
    }

    /// Waits, until `until`, for the probe kept in the background to end:
    /// `true` when it answered after `start` (the pool's connection answered
    /// within this probe's bound: a probe of its own now would wait on the
    /// probe lane for that very connection's return); `false` when none is
    /// kept (any more) and it did not answer. A timeout at `until`.
    async fn setup_answered(
        &self,
        start: tokio::time::Instant,
        until: tokio::time::Instant,
    ) -> Result<bool, Error> {
        let mut answered = self.probe_answered.subscribe();
        loop {
            // Read after subscribing: an end in between is seen here.
            if answered.borrow_and_update().is_some_and(|at| at >= start) {
                return Ok(true);
            }
            if !self.probe_setup.load(Ordering::Acquire) {
                return Ok(false);
            }
            match tokio::time::timeout_at(bounded(start, until), answered.changed()).await {
                // It ended (or answered): look again.
                Ok(Ok(())) => {}
                // The pool is gone with its sender: nothing kept.
                Ok(Err(_)) => return Ok(false),
                Err(_) => {
                    return Err(Error::Checkout(CheckoutError::ReadinessTimeout(
                        until.saturating_duration_since(start),
                    )))
                }
            }
        }
    }

    /// Checkout and `SELECT 1` within `bound` from `start`; on a new
    /// connection (its set-up under way), within `kept` (at least `bound`).
    /// A connection that did not answer in time is closed. One in use
    /// before whose `SELECT 1` failed (its session ended: a network blip,
    /// a restart, `pg_terminate_backend`) is closed and the next taken, up
    /// to the pool's size, within the same bounds: a dead idle connection
    /// is not the server being unready, and the wrapped pool may hand those
    /// out unchecked (sqlx's probe take, deadpool's `Fast` recycle before
    /// its connection task saw the end).
    async fn probe_once(
        self: &Arc<Self>,
        bound: Duration,
        kept: Duration,
        site: &'static Location<'static>,
        start: tokio::time::Instant,
    ) -> Result<(), Error> {
        let mut dead = 0;
        loop {
            let left = kept.saturating_sub(start.elapsed());
            let mut c = self.checkout(Lane::Probe, site, left).await?;
            if c.answered {
                // The server answered a round trip on this connection during
                // the checkout (the wrapped pool's ping of an idle one, or
                // pgwarden's naming or pid statement): a `SELECT 1` would
                // only repeat it. Whether that came within a probe's bound
                // is each caller's to judge (`probe`, `setup_answered`).
                return Ok(());
            }
            let new = c.is_new();
            let bound = if new { kept } else { bound };
            // A connection in use before, found after the probe gave up (it
            // waited on the probe lane): asked all the same, within what is
            // left of `kept` and at most a probe's bound, never handed back
            // unasked. On sqlx it came without a ping (the probe's take),
            // and sqlx pings a connection it takes back with no bound: a
            // hung one would hold the probe lane for as long as it hangs.
            let left = match bound.checked_sub(start.elapsed()) {
                Some(left) => left,
                None => kept.saturating_sub(start.elapsed()).min(bound),
            };
            let mut asking = Asking {
                client: &mut c,
                armed: true,
            };
            let answer = tokio::time::timeout(left, B::select_1(asking.client)).await;
            asking.armed = false;
            drop(asking);
            match answer {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(_)) if !new && dead < self.status().max => {
                    c.discard();
                    dead += 1;
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    // The server did not answer: this connection is in an
                    // unknown state, never reuse it.
                    c.discard();
                    return Err(Error::Checkout(CheckoutError::ReadinessTimeout(bound)));
                }
            }
        }
    }
}

/// A probe's connection while its `SELECT 1` is out: closed when the probe
/// is dropped before the answer (a caller that gave up on a probe run in
/// its own task), never handed back. Its answer is still to come, and sqlx
/// pings a connection it takes back with no bound: a hung one would hold
/// the probe lane for as long as it hangs.
struct Asking<'a, B: Source> {
    client: &'a mut crate::pool::checkout::Client<B>,
    armed: bool,
}

impl<B: Source> Drop for Asking<'_, B> {
    fn drop(&mut self) {
        if self.armed {
            self.client.close_in_place();
        }
    }
}
