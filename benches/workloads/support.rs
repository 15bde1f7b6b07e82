//! The tests' backend seam, `tests/it/support/backend.rs`: the scenario of
//! `paused_holder.rs` is one source for this benchmark and for
//! `tests/it/readiness_reserve.rs`, generic over its `Backend`.

#[path = "../../tests/it/support/backend.rs"]
#[allow(dead_code, unused_macros, unused_imports)]
pub mod backend;

pub use pgwarden_testing::eventually;
