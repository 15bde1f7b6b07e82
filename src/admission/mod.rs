//! The admission core: lanes, their limits, the budget and the queue state
//! machine that decides, for every checkout, admit, wait or refuse.
//!
//! Pure: plain data and functions, no I/O, no clock, no channels, and
//! nothing from the rest of the crate. [`crate::Pool`] holds one
//! [`Admission`] behind its mutex, keeps each waiter's channel under the key
//! it passes in, and applies the grants and refusals handed back. The
//! property tests in `tests.rs` drive this code, the code that runs, through
//! random interleavings of requests, returns, releases and cancellations.

mod budget;
mod lane;
mod limits;
mod queue;

#[cfg(test)]
mod budget_tests;
#[cfg(test)]
mod queue_tests;
#[cfg(test)]
mod tests;

pub(crate) use budget::Refusal;
pub(crate) use lane::Priority;
pub use lane::{BudgetPolicy, Lane};
pub use limits::LimitsError;
pub(crate) use limits::{LaneLimits, Limits, MAX_POOL_SIZE};
pub(crate) use queue::{Admission, Answer, Effect, WaiterKey};
