//! Getting a lease: readiness before the first statement (pooler
//! detection, install), one acquisition attempt, and how long a held name
//! may stay busy.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::guard::{Lease, LeaseHandle};
use super::inner::Inner;
use super::inner::{FollowUp, Urgency};
use super::options::LeaseOptions;
use super::options::{check_name, new_holder};
use super::table::{Acquire, Blocker, Busy, FreeIn, Install};
use super::term::{LeaseState, TermInfo};
use crate::error::Error;
use crate::pooler::PoolerMode;

/// The longest wait between two attempts of [`Leases::acquire`](super::Leases::acquire):
/// a holder may release early. Also the wait after a blocked take-over.
pub(crate) const MAX_POLL: Duration = Duration::from_millis(500);

/// At most one log line per this interval, per instance, for blocked
/// take-overs (each is counted).
const BLOCKED_LOG_EVERY: Duration = Duration::from_secs(10);

impl Inner {
    /// Before the first statement: find out, in the background, whether the
    /// pool talks to PostgreSQL directly (statements are sent unnamed until
    /// it is known), and install the table (with its shape check) when
    /// `auto_install` is on.
    pub(crate) async fn ensure_ready(&self) -> Result<(), Error> {
        self.detect_pooler_in_background();
        if !self.auto_install {
            return Ok(());
        }
        self.installed
            .get_or_try_init(|| async {
                self.install().await?;
                Ok::<(), Error>(())
            })
            .await
            .map(|_| ())
    }

    fn detect_pooler_in_background(&self) {
        if self
            .detect_started
            .load(std::sync::atomic::Ordering::Relaxed)
            || self
                .detect_started
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            return;
        }
        let pool = self.pool();
        if pool.pooler() != PoolerMode::Auto {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let bound = self.statement_timeout;
        rt.spawn(async move {
            match tokio::time::timeout(bound, pool.detect_pooler()).await {
                Ok(Ok(found)) => {
                    tracing::debug!(pool = %pool.name(), pooler = ?found, "lease statements: pooler known")
                }
                Ok(Err(e)) => tracing::warn!(
                    pool = %pool.name(), error = %e,
                    "pooler detection failed: lease statements stay unnamed (parsed on every call)"
                ),
                Err(_) => tracing::warn!(
                    pool = %pool.name(),
                    "pooler detection did not finish within {bound:?}: lease statements stay unnamed"
                ),
            }
        });
    }

    /// Creates the table unless it exists, then checks its shape (see
    /// [`super::Leases::install`]), bounded by the statement timeout.
    pub(crate) async fn install(&self) -> Result<bool, Error> {
        self.detect_pooler_in_background();
        let table = self.table.to_string();
        let bare = self.table.unqualified_if_defaulted();
        let stmt = Install {
            wait: self.statement_timeout,
            table: &table,
            bare: bare.as_deref(),
        };
        let ran = self
            .run(Urgency::Normal, self.statement_timeout, &stmt)
            .await??;
        if ran {
            tracing::info!(pool = %self.pool_name, table = %self.table, "lease table installed");
        }
        let _ = self.installed.set(());
        Ok(ran)
    }

    /// One acquisition attempt: the lease, or why not.
    pub(crate) async fn attempt(
        self: &Arc<Self>,
        name: &str,
        opts: &LeaseOptions,
    ) -> Result<Result<Lease, Busy>, Error> {
        self.attempt_as(name, opts, new_holder()).await
    }

    /// [`Inner::attempt`] under a holder id the caller made
    /// ([`new_holder`]), so that it can release by holder after
    /// cancelling the attempt.
    pub(crate) async fn attempt_as(
        self: &Arc<Self>,
        name: &str,
        opts: &LeaseOptions,
        holder: String,
    ) -> Result<Result<Lease, Busy>, Error> {
        check_name(name)?;
        let timing = opts.validate()?;
        self.ensure_renewer();
        self.ensure_ready().await?;
        let at_least = opts.at_least_time();
        let has_hold = !at_least.is_zero() || opts.period.is_some();
        let stmt = Acquire {
            name,
            holder: &holder,
            ttl: timing.ttl.as_secs_f64(),
            hold: has_hold.then(|| {
                (
                    at_least.as_secs_f64(),
                    opts.period.map_or(0.0, |p| p.as_secs_f64()),
                )
            }),
        };
        let start = Instant::now();
        // Cancelled after it reached the server, the statement may have
        // taken the lease: release whatever this holder got.
        let follow_up = || -> Option<FollowUp> {
            let (inner, name, holder) = (self.clone(), name.to_owned(), holder.clone());
            Some(Box::pin(async move {
                inner.release_cancelled(&name, &holder).await;
            }))
        };
        let taken = match self
            .run_then(Urgency::Normal, self.statement_timeout, &stmt, follow_up)
            .await?
        {
            Ok(taken) => taken,
            Err(busy) => {
                if busy == Busy::Blocked {
                    self.takeover_blocked(name).await;
                }
                return Ok(Err(busy));
            }
        };
        let taken_at = Duration::try_from_secs_f64(taken.taken_at)
            .ok()
            .and_then(|d| UNIX_EPOCH.checked_add(d))
            .unwrap_or_else(SystemTime::now);
        let info = TermInfo {
            name: name.into(),
            holder,
            token: taken.token,
            taken_at,
            prev_holder: taken.prev_holder,
        };
        let state = Arc::new(LeaseState::new(info, timing.deadline(start)));
        self.metrics.acquired(name);
        if let Some(prev) = state.term.took_over_from.as_deref() {
            self.metrics.takeover(name);
            tracing::warn!(
                pool = %self.pool_name,
                lease = name,
                token = taken.token,
                previous_holder = prev,
                "lease taken over from an expired holder"
            );
        }
        let id = self.register(state.clone(), timing, start);
        Ok(Ok(Lease {
            handle: LeaseHandle {
                state,
                inner: self.clone(),
            },
            id,
            done: false,
        }))
    }

    /// A take-over that met a row lock: counted, and logged (at most once
    /// per [`BLOCKED_LOG_EVERY`] per instance) with the session that holds
    /// the row when the server can tell.
    async fn takeover_blocked(&self, name: &str) {
        self.metrics.takeover_blocked(name);
        self.stats.lock().takeovers_blocked += 1;
        let now = self.created.elapsed();
        {
            let mut last = self.blocked_logged.lock();
            if last.is_some_and(|t| now.saturating_sub(t) < BLOCKED_LOG_EVERY) {
                return;
            }
            *last = Some(now);
        }
        let blocker = self
            .run(Urgency::Normal, self.statement_timeout, &Blocker { name })
            .await;
        match blocker {
            Ok(Some(b)) => tracing::warn!(
                pool = %self.pool_name, lease = name,
                blocking_pid = b.pid, application_name = %b.application_name,
                state = %b.state, state_for_s = b.state_for_s,
                "lease take-over blocked by a row lock on its expired row: answered busy, tried again later \
                 (a fenced transaction of the expired term ends at most 1 s past the term; another session \
                 holding the row blocks it as long as it holds it)"
            ),
            Ok(None) => tracing::warn!(
                pool = %self.pool_name, lease = name,
                "lease take-over blocked by a row lock on its expired row: answered busy, tried again later"
            ),
            Err(e) => tracing::warn!(
                pool = %self.pool_name, lease = name, error = %e,
                "lease take-over blocked by a row lock on its expired row (its holder could not be read): answered busy"
            ),
        }
    }

    /// How long until a held name may be free (database clock), for callers
    /// that wait: at most [`MAX_POLL`]'s worth is ever slept at once.
    pub(crate) async fn free_in(&self, name: &str) -> Result<Duration, Error> {
        let secs = self
            .run(Urgency::Normal, self.statement_timeout, &FreeIn { name })
            .await?;
        // No row: taken and released, or being inserted. Ask again soon.
        Ok(secs
            .and_then(|s| Duration::try_from_secs_f64(s.max(0.0)).ok())
            .unwrap_or(Duration::from_millis(10)))
    }
}
