#![doc = include_str!("../README.md")]
#![deny(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

pub mod budget;
mod error;
pub mod lease;
pub mod metrics;
mod pool;
// The test harness calls libc (euid, getpwnam, kill); the library proper has no unsafe code.
#[cfg(feature = "testing")]
#[allow(unsafe_code)]
pub mod testing;

pub use budget::{Lane, LaneLimits, Limits, Policy};
pub use error::{BuildError, Error, Holder};
pub use lease::{
    Job, JobOutcome, Lease, LeaseHandle, LeaseOptions, LeaseStats, Leases, LeasesBuilder,
    LostReason, OnLost, Scheduler, SchedulerBuilder,
};
pub use pool::{Conn, LaneStatus, Pool, PoolBuilder, Status};
