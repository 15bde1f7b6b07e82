//! Table leases: background exclusivity that holds no connection.
//!
//! A lease is a row of a table (default `public.pgwarden_leases`, see
//! `sql/leases.sql`), taken with one `INSERT … ON CONFLICT … WHERE
//! expires_at < now()` statement, renewed by its holder, released by its
//! holder only. Each statement borrows a connection for that statement only,
//! so a process holding any number of leases holds no connection between
//! statements, and renewals never queue behind request traffic.
//!
//! ```no_run
//! # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
//! use std::time::Duration;
//! use pgwarden::{Job, LeaseOptions, Leases, Scheduler};
//! let leases = Leases::new(&pool); // one per process: it owns the renewer
//! // One attempt (None) or a wait (Some): Ok(None) when another holder has it.
//! if let Some(lease) = leases.acquire("cleanup", &LeaseOptions::default(), None).await? {
//!     // … the work; lease.term().token fences it, lease.lost() warns of a loss
//!     lease.release().await?;
//! }
//! // Or let a scheduler run jobs every period on one instance of the cluster.
//! let scheduler = Scheduler::builder(&leases)
//!     .job(Job::every("alerts", Duration::from_secs(30), |_lease| async {}))
//!     .start()?;
//! scheduler.shutdown(Duration::from_secs(10)).await;
//! # Ok(()) }
//! ```
//!
//! Beyond the plain lease row:
//!
//! - **Fencing tokens.** Every term draws a new token from one sequence: a
//!   later term of a name always has a larger token ([`Term::token`]),
//!   across take-overs, releases and purges, and [`LeaseHandle::fence`] makes
//!   a transaction's writes commit only under the current term.
//! - **A contender never waits.** An attempt on a name held by a live term
//!   is a skip in one round trip, even while the holder sits in a fenced
//!   transaction; the take-over of an expired term waits at most 20 ms for a
//!   lock on its row, then answers busy (counted, and logged with the
//!   session holding it). No lease statement takes an advisory lock, so no
//!   other session can keep a free name busy with one.
//! - **One table whatever the `search_path`.** A table name without a
//!   schema means `public`: instances whose search paths differ share it.
//! - **A lost signal that cannot be silenced.** [`LeaseHandle::lost`] fires
//!   when a renewal finds the lease taken, or at the local deadline (start
//!   of the last successful renewal + TTL − safety margin, monotonic clock),
//!   which falls before anyone else can take it over. The deadline lives in
//!   the lease itself: it fires whatever the renewer does. Transient renewal
//!   errors are retried until then.
//! - **Batched, supervised renewal.** One task per [`Leases`] renews every
//!   lease due in one statement (1,000 leases: one statement per interval;
//!   at most 5,000 leases per statement);
//!   a slow batch holds up no other lease; a panic is caught and counted.
//! - **Bounded statements.** Every statement is bounded end to end; one
//!   that times out is cancelled on the server before its connection closes.
//! - **Holds, schedules, purge.** An at-least-hold ([`LeaseOptions::at_least`]),
//!   a [`Scheduler`] that runs jobs every period on at most one instance (or
//!   once per node), and a purge of old rows.
//! - **Cheap statements.** Prepared once per connection on direct
//!   connections; unnamed behind a transaction pooler (or until the pool
//!   knows it is direct).
//!
//! # Trade-offs
//!
//! A crashed holder delays the next run by up to its TTL (nobody releases
//! its lease), and a holder frozen or cut off inside a fenced transaction by
//! at most its TTL + 1 s: [`LeaseHandle::fence`] bounds its transaction on
//! the server. A holder cut off from the database for longer than the TTL
//! while another instance reaches it can overlap with the next holder: it
//! learns of it through the lost signal, and by default ([`OnLost::Signal`])
//! its job keeps running, which is fine for idempotent jobs. Use
//! [`OnLost::Cancel`] to stop the job instead, and a fenced transaction for
//! writes a stale holder must never make.
//!
//! # Clocks
//!
//! Every time is the database's (`now()`, `clock_timestamp()`); the local
//! clock only measures intervals (monotonic). Node clocks may drift freely.
//!
//! The safety margin ([`LeaseOptions::safety_margin`], TTL / 8 by default)
//! is how much earlier than the database the holder gives up. It covers the
//! time between the holder's view and the database's: the local deadline is
//! measured from the moment a renewal was *sent*, which is before the
//! database ran it, so the holder always stops trusting the lease at least
//! a margin before the database can let anyone in; and the margin absorbs
//! how late the lost signal reaches a busy job (timer and scheduling
//! delays), and a difference in *rate* between the local monotonic clock and
//! the server's clock (1/8 of a TTL is far beyond any real drift).
//!
//! It does not cover:
//!
//! - **A forward jump of the server's clock.** `now()` jumps, and every
//!   lease's `expires_at` is suddenly that much nearer: a jump of more than
//!   the margin lets another instance take a lease over while its holder
//!   still trusts it (its local deadline is measured on its own monotonic
//!   clock, which did not jump). Both may run the job for a while, until the
//!   old holder's next renewal finds the row taken and fires `lost(Taken)`.
//!   Fenced writes stay safe: a fence checks the term under a row lock, not
//!   the clock. A backward jump only delays take-overs.
//! - **A holder paused longer than the margin** (a stopped process, a long
//!   GC-like stall) between checking its lease and acting on it: it acts
//!   after the deadline. Check [`LeaseHandle::is_lost`] just before acting,
//!   and put writes that must never come from a stale holder under
//!   [`LeaseHandle::fence`].
//!
//! Keep the server clock slewed, not stepped (NTP `slew`/chrony `makestep`
//! only at boot), or make the margin larger than any step you expect.

mod acquire;
mod builder;
mod inner;
mod leases;
mod metrics;
mod options;
mod renewer;
mod scheduler;
mod table;
mod term;

pub use crate::lost::LostReason;
pub use acquire::{Lease, LeaseHandle};
pub use builder::LeasesBuilder;

pub use leases::Leases;
pub use metrics::LeaseStats;
pub use options::{LeaseOptions, OnLost};
pub use scheduler::{Job, JobOutcome, Scheduler, SchedulerBuilder};
pub use table::LeaseRow;
pub use term::Term;
