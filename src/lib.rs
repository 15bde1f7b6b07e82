//! A budgeted connection pool for PostgreSQL-backed Rust services that run
//! more than one instance: a drop-in wrapper over [`deadpool_postgres::Pool`]
//! that knows why each connection is out.
//!
//! # The model
//!
//! - Every checkout has a [`Lane`]: why the connection is out. Request work
//!   (`pool.get()`), connections pinned by session advisory locks, the
//!   readiness probe, lease statements and pgwarden's own control statements
//!   each have a reserved count and a maximum within the pool's size.
//! - Session advisory locks pin their connection until they are released, so
//!   the session-lock lane is budgeted: a lock that would leave request work
//!   or the work under held locks without a connection is refused (or
//!   warned, by [`BudgetPolicy`]). The readiness probe has a reserve that no
//!   other lane may take.
//! - Every checkout is bounded end to end by its caller's bound: admission,
//!   connecting, recycling.
//! - For background work that must run on one instance at a time, a table
//!   [lease] holds no connection at all: it is a row with an
//!   expiry, a fencing token and a lost-lease signal.
//! - Everything is measured through the [`metrics`] facade.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use pgwarden::{LeaseOptions, Leases, Pool};
//!
//! // Before: deadpool_postgres::Config::create_pool(…); now the same config:
//! let cfg = deadpool_postgres::Config::new();
//! let pool = Pool::from_config(&cfg)?.name("api").build()?;
//!
//! // Request work: as with deadpool (the checkout derefs to its Client).
//! let client = pool.get().await?;
//! client.simple_query("SELECT 1").await?;
//! drop(client);
//!
//! // Readiness: the probe's reserve answers whatever locks and jobs do.
//! let latency = pool.readiness(Duration::from_secs(1)).await?;
//!
//! // A background job on one instance only, holding no connection.
//! let leases = Leases::new(&pool);
//! if let Some(lease) = leases.acquire("cleanup", &LeaseOptions::new(Duration::from_secs(60)), None).await? {
//!     // … the job, on ordinary request connections; lease.lost() fires if it is lost …
//!     lease.release().await?;
//! }
//! # let _ = latency; Ok(()) }
//! ```
//!
//! # Where to read on
//!
//! The [guide] (the repository's README) has the longer sections:
//! [the drop-in change](crate::guide#the-drop-in-change),
//! [lanes and the budget](crate::guide#lanes-and-the-budget),
//! [advisory locks](crate::guide#advisory-locks-done-right),
//! [table leases](crate::guide#table-leases-background-exclusivity-that-holds-no-connection),
//! [failover and replication](crate::guide#failover-and-replication),
//! [HTTP readiness and load shedding](crate::guide#http-readiness-and-load-shedding-feature-http),
//! [metrics, dashboard and alerts](crate::guide#metrics-dashboard-and-alerts) and
//! [the architecture](crate::guide#architecture).
//! The API: [`Pool`] and [`PoolBuilder`]; session and transaction locks
//! ([`Pool::session_lock`], [`xact_lock`], [`Pool::with_xact_lock`],
//! [`Pool::migrate_once`]); the [`Census`] of advisory locks; [`lease`];
//! `http` (feature `http`); [`metrics`]; [`Error`].
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod admission;
mod api;
mod census;
mod error;
/// The guide: the repository's README, with the longer sections.
#[doc = include_str!("../README.md")]
pub mod guide {}
#[cfg(feature = "http")]
pub mod http;
mod key;
pub mod lease;
mod lock;
mod lost;
pub mod metrics;
mod pool;
mod pooler;
#[cfg(feature = "sqlx-0_9")]
#[path = "sqlx/v09.rs"]
pub mod sqlx;
#[cfg(all(feature = "sqlx-0_8", not(feature = "sqlx-0_9")))]
#[path = "sqlx/v08.rs"]
pub mod sqlx;
// With both sqlx features on, `pgwarden::sqlx` is the sqlx 0.9 pool and
// this module the sqlx 0.8 one (one source: `src/sqlx/pool.rs`).
#[cfg(all(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
#[path = "sqlx/v08.rs"]
pub mod sqlx_0_8;
mod status;
mod stmt;

pub use admission::{BudgetPolicy, Lane, LimitsError};
pub use census::{AdvisoryLock, Census, Owner};
pub use error::{
    BuildError, CheckoutError, Error, InvalidInput, LaneHolder, LeaseError, LockError, NameRule,
    Stage,
};
pub use lease::{
    Fenced, Job, JobOutcome, Lease, LeaseHandle, LeaseOptions, LeaseStats, Leases, LeasesBuilder,
    LostReason, OnLost, Scheduler, SchedulerBuilder, Term,
};
pub use lock::{xact_lock, LockKey, LockMode, Migrated, Namespace, SessionLock};
pub use pool::{Client, Deadline, Pool, PoolBuilder};
pub use pooler::PoolerMode;
pub use status::{LaneStatus, Status};
