#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

pub mod budget;
mod error;
pub mod lease;
pub mod metrics;
mod pool;
#[cfg(feature = "testing")]
pub mod testing;

pub use budget::{Lane, LaneLimits, Limits, Policy};
pub use error::{BuildError, Error, Holder};
pub use lease::{
    Job, JobOutcome, Lease, LeaseHandle, LeaseOptions, LeaseStats, Leases, LeasesBuilder, LostReason, OnLost,
    Scheduler, SchedulerBuilder,
};
pub use pool::{Conn, LaneStatus, Pool, PoolBuilder, Status};
