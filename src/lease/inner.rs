//! The state one [`Leases`](super::Leases) instance shares with its
//! guards and its renewer, and the statements it runs.

use std::panic::Location;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use tokio::sync::{Notify, OnceCell};

use super::guard::{Lease, LeaseHandle, LeaseState, LostReason};
use super::leases::LeaseStats;
use super::name;
use super::options::LeaseOptions;
use super::renewer::Registry;
use super::sql::{Attempt, Statements};
use super::table::TableName;
use crate::admission::{Lane, Priority};
use crate::error::Error;
use crate::metrics::LeaseMetrics;
use crate::pool::{Conn, Pool, Shared};

/// The longest wait between two attempts of [`Leases::acquire`](super::Leases::acquire):
/// a holder may release early.
pub(crate) const MAX_POLL: Duration = Duration::from_millis(500);

pub(crate) enum PoolRef {
    Strong(Pool),
    /// The pool's own instance ([`Pool::leases`]) must not keep the pool alive.
    Weak(Weak<Shared>),
}

pub(crate) struct Inner {
    pub(crate) pool: PoolRef,
    pub(crate) pool_name: Arc<str>,
    pub(crate) table: TableName,
    pub(crate) sql: Statements,
    pub(crate) auto_install: bool,
    pub(crate) installed: OnceCell<()>,
    pub(crate) statement_timeout: Duration,
    pub(crate) registry: Mutex<Registry>,
    pub(crate) wake: Arc<Notify>,
    pub(crate) renewer_started: AtomicBool,
    /// Counts, updated under one lock so a snapshot is consistent.
    pub(crate) stats: Mutex<LeaseStats>,
    pub(crate) metrics: LeaseMetrics,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Lets the renewer task see that its instance is gone, and end.
        self.wake.notify_one();
    }
}

impl Inner {
    pub(crate) fn new(
        pool: PoolRef,
        pool_name: &str,
        table: TableName,
        statement_timeout: Duration,
        auto_install: bool,
    ) -> Inner {
        Inner {
            pool,
            pool_name: pool_name.into(),
            sql: Statements::new(&table),
            table,
            auto_install,
            installed: OnceCell::new(),
            statement_timeout,
            registry: Mutex::new(Registry::default()),
            wake: Arc::new(Notify::new()),
            renewer_started: AtomicBool::new(false),
            stats: Mutex::new(LeaseStats::default()),
            metrics: LeaseMetrics::register(pool_name),
        }
    }

    pub(crate) fn pool(&self) -> Result<Pool, Error> {
        match &self.pool {
            PoolRef::Strong(p) => Ok(p.clone()),
            PoolRef::Weak(w) => w
                .upgrade()
                .map(|shared| Pool { shared })
                .ok_or(Error::Pool(deadpool_postgres::PoolError::Closed)),
        }
    }

    /// A connection for one statement: lease statements on the lease lane
    /// (renewals and releases urgent, acquisitions normal), the install on
    /// the control lane.
    pub(crate) async fn control(
        &self,
        lane: Lane,
        priority: Priority,
        timeout: Duration,
    ) -> Result<Conn, Error> {
        let pool = self.pool()?;
        let site = Location::caller();
        pool.checkout_with(lane, priority, site, timeout).await
    }

    pub(crate) fn count_statement(&self) {
        self.stats.lock().statements += 1;
    }

    pub(crate) async fn ensure_installed(&self) -> Result<(), Error> {
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

    /// Creates the table unless it exists (see [`super::Leases::install`]),
    /// bounded by the statement timeout.
    pub(crate) async fn install(&self) -> Result<bool, Error> {
        let began = Instant::now();
        let mut conn = self
            .control(Lane::Control, Priority::Normal, self.statement_timeout)
            .await?;
        let left = self.statement_timeout.saturating_sub(began.elapsed());
        self.count_statement();
        let ran = match tokio::time::timeout(left, self.sql.install(&mut conn, left)).await {
            Ok(r) => r?,
            Err(_) => {
                conn.discard();
                return Err(Error::LeaseTimeout {
                    what: "install",
                    waited: began.elapsed(),
                });
            }
        };
        if ran {
            tracing::info!(pool = %self.pool_name, table = %self.table, "lease table installed");
        }
        let _ = self.installed.set(());
        Ok(ran)
    }

    /// One acquisition attempt: the lease, or how long until it may be free.
    pub(crate) async fn attempt(
        self: &Arc<Self>,
        name: &str,
        opts: &LeaseOptions,
    ) -> Result<Result<Lease, Duration>, Error> {
        name::check_name(name)?;
        let timing = opts.validate()?;
        self.ensure_installed().await?;
        let holder = name::new_holder();
        let began = Instant::now();
        let conn = self
            .control(Lane::Lease, Priority::Normal, self.statement_timeout)
            .await?;
        let start = Instant::now();
        let left = self.statement_timeout.saturating_sub(began.elapsed());
        self.count_statement();
        let fut = self.sql.acquire(
            &conn,
            name,
            &holder,
            timing.ttl.as_secs_f64(),
            opts.at_least_time().as_secs_f64(),
            opts.period.map_or(0.0, |p| p.as_secs_f64()),
        );
        let attempt = match tokio::time::timeout(left, fut).await {
            Ok(r) => r?,
            Err(_) => {
                conn.discard();
                return Err(Error::LeaseTimeout {
                    what: "acquisition",
                    waited: began.elapsed(),
                });
            }
        };
        drop(conn);
        let (token, prev_holder, taken_at) = match attempt {
            Attempt::Busy { retry_in } => {
                return Ok(Err(
                    Duration::try_from_secs_f64(retry_in).unwrap_or(MAX_POLL)
                ));
            }
            Attempt::Taken {
                token,
                prev_holder,
                taken_at,
            } => (token, prev_holder, taken_at),
        };
        let taken_at = Duration::try_from_secs_f64(taken_at)
            .ok()
            .and_then(|d| UNIX_EPOCH.checked_add(d))
            .unwrap_or_else(SystemTime::now);
        let state = Arc::new(LeaseState::new(
            name.into(),
            holder,
            token,
            timing.ttl,
            taken_at,
            prev_holder,
        ));
        self.metrics.acquired(name);
        if let Some(prev) = state.prev_holder.as_deref().filter(|h| !h.is_empty()) {
            self.metrics.takeover(name);
            tracing::warn!(
                pool = %self.pool_name,
                lease = name,
                token,
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

    /// Releases one term for its guard or runner: stops renewing it, then
    /// marks its row released.
    pub(crate) async fn release(
        &self,
        id: u64,
        state: &LeaseState,
        forget_hold: bool,
    ) -> Result<(), Error> {
        self.unregister(id);
        match state.lost_reason() {
            Some(LostReason::Taken) => Err(Error::LeaseLost {
                name: state.name.to_string(),
                reason: LostReason::Taken,
            }),
            // `release_all` released it already.
            Some(LostReason::Released) => Ok(()),
            _ => self.release_row(state, forget_hold).await,
        }
    }

    /// The release statement of one term.
    pub(crate) async fn release_row(
        &self,
        state: &LeaseState,
        forget_hold: bool,
    ) -> Result<(), Error> {
        let began = Instant::now();
        let conn = self
            .control(Lane::Lease, Priority::Urgent, self.statement_timeout)
            .await?;
        let left = self.statement_timeout.saturating_sub(began.elapsed());
        self.count_statement();
        let fut = self
            .sql
            .release(&conn, &state.name, &state.holder, state.token, forget_hold);
        let ours = match tokio::time::timeout(left, fut).await {
            Ok(r) => r?,
            Err(_) => {
                conn.discard();
                return Err(Error::LeaseTimeout {
                    what: "release",
                    waited: began.elapsed(),
                });
            }
        };
        if ours {
            return Ok(());
        }
        tracing::warn!(
            pool = %self.pool_name,
            lease = %state.name,
            token = state.token,
            "late release: the lease had been taken over; the new holder's lease is untouched"
        );
        Err(Error::LeaseLost {
            name: state.name.to_string(),
            reason: LostReason::Taken,
        })
    }

    /// The guard's drop: stop renewing now, release in the background.
    pub(crate) fn release_in_background(self: &Arc<Self>, id: u64, state: Arc<LeaseState>) {
        self.unregister(id);
        if matches!(
            state.lost_reason(),
            Some(LostReason::Taken | LostReason::Released)
        ) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let inner = self.clone();
                rt.spawn(async move {
                    if let Err(e) = inner.release(id, &state, false).await {
                        if !e.is_lease_lost() {
                            tracing::warn!(
                                pool = %inner.pool_name,
                                lease = %state.name,
                                error = %e,
                                "lease release on drop failed; it expires after its TTL"
                            );
                        }
                    }
                });
            }
            Err(_) => tracing::warn!(
                pool = %self.pool_name,
                lease = %state.name,
                "lease dropped outside a tokio runtime; it expires after its TTL"
            ),
        }
    }
}
