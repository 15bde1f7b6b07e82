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

mod admission;
mod builder;
mod checkout;
mod client;
mod deadline;
mod ext;
mod holds;
mod housekeeping;
// The load accessor serves `crate::http` (feature `http`).
#[cfg_attr(not(feature = "http"), allow(dead_code))]
mod load;
mod names;
mod probe;
mod shared;
mod status;
mod supervisor;
#[cfg(test)]
mod tests;

pub use builder::PoolBuilder;
pub(crate) use builder::{config_pool, url_pool};
pub use client::Client;
pub(crate) use deadline::deadline;
pub use deadline::Deadline;
pub(crate) use housekeeping::panic_message;
#[cfg(feature = "http")]
pub(crate) use load::LaneLoad;
pub use shared::Pool;
pub(crate) use shared::{Pass, Periodic};
pub(crate) use shared::{Shared, State};
pub(crate) use supervisor::Task;
