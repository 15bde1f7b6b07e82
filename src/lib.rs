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

pub use admission::{BudgetPolicy, Lane, LimitsError};
pub use census::{AdvisoryLock, Census, Owner};
pub use error::{
    BuildError, CheckoutError, Error, InvalidInput, LaneHolder, LeaseError, LockError, NameRule,
    Stage,
};
pub use lease::{
    Job, JobOutcome, Lease, LeaseHandle, LeaseOptions, LeaseStats, Leases, LeasesBuilder,
    LostReason, OnLost, Scheduler, SchedulerBuilder, Term,
};
pub use lock::{xact_lock, LockKey, LockMode, Migrated, Namespace, SessionLock};
pub use pool::{Client, Deadline, Pool, PoolBuilder};
pub use pooler::PoolerMode;
pub use status::{LaneStatus, Status};
