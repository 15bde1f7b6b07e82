//! The pool core: [`Pool`], its builder, the checked-out [`Client`], and the
//! pool's [`Status`](crate::Status).
//!
//! The pool is a thin shell around the pure admission core
//! ([`crate::admission`]): it keeps each waiter's channel, the checkout
//! records and the backend pids, applies the core's grants and refusals, and
//! takes the admitted connection from deadpool, whose capacity it owns. It
//! knows nothing of locks, leases, the census or poolers: those keep their
//! per-pool state in its extension slot and plug periodic work in through
//! [`Periodic`]. Its user-facing methods are in `crate::api`.
//!
//! One concept per file:
//! - `shared.rs`: what every clone of a `Pool` shares, and everything done
//!   under its state lock: the admission shell (admit, release, resize,
//!   close), the pool's name, recent hold times, and
//!   the reads (`Status`, a lane's load);
//! - `checkout.rs`: a checkout bounded end to end by one deadline, and the
//!   `Client` it hands out;
//! - `deadline.rs`: [`Deadline`], the bound on every checkout in a scope;
//! - `ext.rs`: the extension slot the layers above keep per-pool state in
//!   (handed to a backend as the pool is built);
//! - `builder.rs`: [`PoolBuilder`], and the deadpool pools pgwarden builds;
//! - `housekeeping.rs`: the background passes (housekeeping, the layers'
//!   periodic work) and how a layer puts a task under the supervisor;
//! - `supervisor.rs`: the supervisor, which starts the background tasks,
//!   starts them again on the runtime in use, and stops them at close;
//! - `probe.rs`: the readiness probe;
//! - `source.rs`: the seam, [`Source`]: what a backend (the deadpool pool;
//!   sqlx's `PgPool` in `crate::sqlx`) supplies; everything above is
//!   generic over it (the deadpool one unless said otherwise);
//! - `tests.rs`: the shell's timeouts, cancellation and housekeeping on
//!   tokio's paused clock.
//!
//! Calls go one way (`.ci/layers.py` checks it): `builder` calls
//! `housekeeping`; `probe` calls `checkout`; `builder`, `checkout`,
//! `housekeeping` and `probe` call `shared`; `checkout`, `housekeeping` and
//! `probe` call `deadline`; `builder` and `shared` use `ext`; `builder`,
//! `shared`, `checkout` and `housekeeping` call `supervisor`; `deadline`,
//! `source` and `supervisor` call nothing in the pool (`source` names
//! `ext`).

mod builder;
mod checkout;
mod deadline;
mod ext;
mod housekeeping;
mod probe;
mod shared;
mod source;
mod supervisor;
#[cfg(test)]
mod tests;

pub use builder::PoolBuilder;
pub(crate) use builder::{config_pool, url_pool};
pub(crate) use checkout::Beginning;
pub use checkout::Client;
pub(crate) use deadline::deadline;
pub use deadline::Deadline;
pub(crate) use ext::Extensions;
pub(crate) use housekeeping::panic_message;
#[cfg(feature = "http")]
pub(crate) use shared::AnyPool;
#[cfg(feature = "http")]
pub(crate) use shared::LaneLoad;
pub use shared::Pool;
pub(crate) use shared::{Pass, Periodic};
pub(crate) use shared::{Shared, State};
pub(crate) use source::Source;
#[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
pub(crate) use source::{Backend, Identified, Refused, SourceStatus, ASK};
pub(crate) use supervisor::Task;
