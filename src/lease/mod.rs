//! Table leases: background exclusivity that holds no connection.
//!
//! A lease is a row of a table (default `pgwarden_leases`, see
//! `sql/leases.sql`), taken with one `INSERT … ON CONFLICT … WHERE
//! expires_at < now()` statement, renewed by its holder, released by its
//! holder only. Each statement borrows a connection of the pool's control
//! lane for that statement only, so a process holding any number of leases
//! holds no connection between statements, and renewals never queue behind
//! request traffic. This is seed 000's design, with what it lacked:
//!
//! - **Fencing tokens.** Every take draws a new token from one sequence, a
//!   take-over with the row locked (rows stay after release, one per name):
//!   a later term always has a larger token ([`LeaseHandle::token`]), and
//!   [`LeaseHandle::fence`] makes a transaction's writes commit only under the
//!   current term.
//! - **A lost signal.** [`LeaseHandle::lost`] fires when a renewal finds the
//!   lease taken, or when no renewal succeeded by the local deadline (start
//!   of the last successful renewal + TTL − safety margin, monotonic clock),
//!   which falls before anyone else can take it over. Transient renewal
//!   errors are retried until then.
//! - **Batched renewal.** One task per [`Leases`] renews every lease due in
//!   one statement: 1,000 leases cost one statement per interval.
//! - **Holds and schedules.** An at-least-hold ([`LeaseOptions::at_least`])
//!   and a [`Scheduler`] that runs jobs every period on exactly one instance,
//!   or once per node.
//!
//! # Trade-offs
//!
//! A crashed holder delays the next run by up to its TTL (nobody releases
//! its lease). A holder cut off from the database for longer than the TTL
//! while another instance reaches it can overlap with the next holder: it
//! learns of it through the lost signal, and by default ([`OnLost::Signal`])
//! its job keeps running, which is fine for idempotent jobs (seed 000's four
//! are). Use [`OnLost::Cancel`] to stop the job instead, and a fenced
//! transaction for writes a stale holder must never make.
//!
//! Every time is the database's (`now()`, `clock_timestamp()`); the local
//! clock only measures intervals (monotonic). Node clocks may drift freely.

// `Error` is large (its `Timeout` variant carries the pool's `Status`); the
// synchronous validators here return it as the rest of the crate does.
#![allow(clippy::result_large_err)]

use crate::error::Error;

mod exclusive;
mod guard;
mod inner;
mod job;
mod leases;
mod name;
mod options;
mod renewer;
mod scheduler;
mod sql;
mod table;
mod timing;

pub use guard::{Lease, LeaseHandle, LostReason};
pub use job::{Job, JobOutcome};
pub use leases::{LeaseStats, Leases, LeasesBuilder, DEFAULT_STATEMENT_TIMEOUT};
pub use name::MAX_NAME_LEN;
pub use options::{LeaseOptions, OnLost, DEFAULT_TTL};
pub use renewer::MAX_BATCH;
pub use scheduler::{Scheduler, SchedulerBuilder};
pub use sql::INSTALL_LOCK_KEY;
pub use table::{DEFAULT_TABLE, MAX_SCHEMA_LEN, MAX_TABLE_LEN};
pub use timing::{MAX_HOLD, MAX_TTL, MIN_PERIOD, MIN_RENEW_EVERY, MIN_TTL};

pub(crate) use inner::Inner;

impl Error {
    /// The lease is no longer this holder's ([`Error::LeaseLost`]).
    pub fn is_lease_lost(&self) -> bool {
        matches!(self, Error::LeaseLost { .. })
    }

    /// Another holder kept the lease for the whole wait ([`Error::LeaseBusy`]).
    pub fn is_lease_busy(&self) -> bool {
        matches!(self, Error::LeaseBusy { .. })
    }

    /// A lease statement timed out ([`Error::LeaseTimeout`]).
    pub fn is_lease_timeout(&self) -> bool {
        matches!(self, Error::LeaseTimeout { .. })
    }
}
