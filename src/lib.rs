#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod admission;
mod api;
mod census;
mod error;
#[cfg(feature = "http")]
pub mod http;
mod key;
pub mod lease;
mod lock;
mod lost;
pub mod metrics;
mod pool;
mod pooler;
mod status;

pub use admission::{BudgetPolicy, Lane, LaneLimits, Limits, LimitsError, MAX_POOL_SIZE};
pub use census::{AdvisoryLock, Census, CensusSummary, Owner};
pub use error::{BuildError, Error, LaneHolder, Stage};
pub use lease::{
    Job, JobOutcome, Lease, LeaseHandle, LeaseOptions, LeaseStats, Leases, LeasesBuilder,
    LostReason, OnLost, Scheduler, SchedulerBuilder,
};
pub use lock::{
    fnv1a32, try_xact_lock, try_xact_lock_shared, xact_lock, xact_lock_shared, LockKey, LockMode,
    Namespace, RunOnce, SessionLock, RUN_ONCE_LEDGER,
};
pub use pool::{Client, Deadline, Pool, PoolBuilder};
pub use pooler::PoolerMode;
pub use status::{LaneStatus, Status};
