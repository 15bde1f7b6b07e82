//! The harness's tests against real servers: one test binary (one link,
//! one process whose tests run on libtest's threads side by side), one
//! module per part of the harness.
//!
//! A test that needs a process of its own (a watchdog's, which must end
//! without unwinding) runs this binary again with `MODULE::TEST --exact`.

mod cluster;
mod drops;
mod faults;
mod prometheus;
mod proxy;
mod server;
