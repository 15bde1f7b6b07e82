#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod admission;
mod census;
mod error;
#[cfg(feature = "http")]
pub mod http;
pub mod lease;
mod lock;
pub mod metrics;
mod pool;
mod pooler;

pub use admission::{Lane, LaneLimits, Limits, LimitsError, Policy, MAX_POOL_SIZE};
pub use census::{AdvisoryLock, Census, CensusSummary, Owner};
pub use error::{BuildError, Error, Holder, Stage};
pub use lease::{
    Job, JobOutcome, Lease, LeaseHandle, LeaseOptions, LeaseStats, Leases, LeasesBuilder,
    LostReason, OnLost, Scheduler, SchedulerBuilder, Term,
};
pub use lock::{
    fnv1a32, try_xact_lock, try_xact_lock_shared, xact_lock, xact_lock_shared, LockKey, LockMode,
    Namespace, RunOnce, SessionLock, RUN_ONCE_LEDGER,
};
pub use pool::{Conn, Deadline, DeadpoolView, LaneStatus, Pool, PoolBuilder, Status};
pub use pooler::Pooler;
