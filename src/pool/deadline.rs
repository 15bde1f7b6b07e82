//! [`Deadline`]: a bound on every checkout made inside a scope, whatever
//! the call's own bound.
//!
//! A task-local value, so that code deep inside a request handler (or any
//! unit of work with a deadline) waits for a connection no longer than what
//! is left of that work's time, without passing the deadline down: every
//! checkout of the pool (`get`, `get_within`, lock and lease
//! statements, the readiness probe) made inside [`Deadline::scope`] ends by
//! the deadline, and waits at most the scope's per-checkout maximum.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

tokio::task_local! {
    static SCOPE: Deadline;
}

/// When a unit of work must be done by, and how long any one checkout
/// inside it may wait.
///
/// Enter it with [`Deadline::scope`]: inside, every checkout of every
/// [`crate::Pool`] is bounded by the earlier of its own bound, the time
/// left until the deadline, and the per-checkout maximum
/// ([`Deadline::max_wait`]). Scopes nest: an inner scope never extends an
/// outer one. A checkout past its bound fails as any checkout timeout does
/// (`PoolError::Timeout` from [`crate::Pool::get`], [`CheckoutError::Timeout`](crate::CheckoutError::Timeout)
/// from the others).
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use pgwarden::Deadline;
///
/// let deadline = Deadline::after(Duration::from_secs(2)).max_wait(Duration::from_millis(200));
/// deadline.scope(async {
///     // Waits at most 200 ms for a connection, and never past the 2 s.
///     let conn = pool.get().await?;
///     conn.simple_query("SELECT 1").await?;
///     assert!(Deadline::current().is_some());
///     Ok::<_, Box<dyn std::error::Error>>(())
/// }).await?;
/// # Ok(()) }
/// ```
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Deadline {
    at: Instant,
    max_wait: Option<Duration>,
}

impl Deadline {
    /// A deadline at `at`, with no per-checkout maximum.
    fn at(at: Instant) -> Deadline {
        Deadline { at, max_wait: None }
    }

    /// A deadline `d` from now (a `d` too large to add is decades away).
    pub fn after(d: Duration) -> Deadline {
        Deadline::at(deadline(Instant::now(), d))
    }

    /// The same deadline, with every checkout inside it waiting at most
    /// `max_wait` (a new maximum replaces the old one).
    #[must_use]
    pub fn max_wait(self, max_wait: Duration) -> Deadline {
        Deadline {
            max_wait: Some(max_wait),
            ..self
        }
    }

    /// When the work must be done by.
    #[cfg(test)]
    pub(crate) fn instant(&self) -> Instant {
        self.at
    }

    /// Time left until the deadline (zero once it has passed).
    pub(crate) fn remaining(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    /// The longest a checkout started now may wait: the time left, capped
    /// by the per-checkout maximum.
    pub fn checkout_bound(&self) -> Duration {
        let left = self.remaining();
        self.max_wait.map_or(left, |m| m.min(left))
    }

    /// The tighter of two deadlines: the earlier instant, the smaller
    /// per-checkout maximum.
    #[must_use]
    pub(crate) fn min(self, other: Deadline) -> Deadline {
        Deadline {
            at: self.at.min(other.at),
            max_wait: match (self.max_wait, other.max_wait) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
        }
    }

    /// The deadline of the scope the current task runs in, if any.
    pub fn current() -> Option<Deadline> {
        SCOPE.try_with(|d| *d).ok()
    }

    /// Runs `fut` with this deadline bounding every checkout inside it
    /// (tightened by the enclosing scope's, if any). The deadline does not
    /// cut `fut` itself short: only its checkouts.
    pub fn scope<F: Future>(self, fut: F) -> impl Future<Output = F::Output> {
        let d = Deadline::current().map_or(self, |outer| outer.min(self));
        SCOPE.scope(d, fut)
    }

    /// Runs `f` with this deadline in scope (for the synchronous part of a
    /// call that returns a future, such as `tower::Service::call`).
    #[cfg_attr(not(feature = "http"), allow(dead_code))]
    pub(crate) fn sync_scope<R>(self, f: impl FnOnce() -> R) -> R {
        let d = Deadline::current().map_or(self, |outer| outer.min(self));
        SCOPE.sync_scope(d, f)
    }
}

/// A deadline `timeout` after `start`; a bound too large to add (say
/// `Duration::MAX`) is a deadline decades away.
pub(crate) fn deadline(start: tokio::time::Instant, timeout: Duration) -> tokio::time::Instant {
    const FAR: Duration = Duration::from_secs(86_400 * 365 * 30);
    start
        .checked_add(timeout)
        .or_else(|| start.checked_add(FAR))
        .unwrap_or(start)
}

/// The deadline of a checkout started at `start` with its own deadline
/// `own`, tightened by the scope it runs in.
pub(super) fn bounded(start: Instant, own: Instant) -> Instant {
    match SCOPE.try_with(|d| *d) {
        Err(_) => own,
        Ok(d) => {
            let by_wait = d.max_wait.map_or(d.at, |w| deadline(start, w));
            own.min(d.at).min(by_wait)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn scopes_nest_and_never_extend() {
        assert_eq!(Deadline::current(), None);
        let start = Instant::now();
        let far = start + Duration::from_secs(100);
        assert_eq!(bounded(start, far), far);
        let outer = Deadline::after(Duration::from_secs(10)).max_wait(Duration::from_secs(3));
        outer
            .scope(async {
                assert_eq!(bounded(start, far), start + Duration::from_secs(3));
                let inner = Deadline::after(Duration::from_secs(60));
                inner
                    .scope(async {
                        let d = Deadline::current().unwrap();
                        assert_eq!(d.instant(), start + Duration::from_secs(10));
                        assert_eq!(d.max_wait, Some(Duration::from_secs(3)));
                    })
                    .await;
                Deadline::after(Duration::from_secs(1))
                    .scope(async {
                        assert_eq!(bounded(start, far), start + Duration::from_secs(1));
                        tokio::time::advance(Duration::from_secs(2)).await;
                        let d = Deadline::current().unwrap();
                        assert!(d.remaining().is_zero());
                        assert_eq!(d.checkout_bound(), Duration::ZERO);
                    })
                    .await;
                let d = Deadline::current().unwrap();
                assert_eq!(d.checkout_bound(), Duration::from_secs(3));
                tokio::time::advance(Duration::from_secs(7) + Duration::from_millis(500)).await;
                assert_eq!(d.checkout_bound(), Duration::from_millis(500));
            })
            .await;
        assert_eq!(Deadline::current(), None);
        let huge = Deadline::after(Duration::MAX);
        assert!(huge.remaining() > Duration::from_secs(86_400 * 365));
        assert_eq!(
            Deadline::at(start).sync_scope(Deadline::current),
            Some(Deadline::at(start))
        );
    }
}
