//! The library's integration tests, one test binary (`cargo test --test it`).
//!
//! Each module is a former `tests/<name>.rs` binary, unchanged but for its
//! `use crate::support;` line: one binary links the crate and its
//! dependencies once instead of once per file (54 links were most of a cold
//! `cargo test`). A test's name starts with its module's:
//! `cargo test --all-features --test it lease_run::` runs one former file.
//!
//! A new test file: `tests/it/<name>.rs`, listed below, starting with
//! `use crate::support;` when it uses the shared support module. A file
//! left at `tests/<name>.rs` is a binary of its own (and finds no
//! `support`): don't.
//!
//! Every module shares the process: one throwaway server
//! (`TestServer::shared`), one global `tracing` subscriber
//! ([`support::logs`]), no global metrics recorder (pools record under a
//! local one, [`support::with_recorder`]), no environment variable set by a
//! test. A test that needs a server to itself starts its own.

#[macro_use]
mod support;

mod backends;
mod backends_layers;
mod census;
mod census_load;
mod dashboards;
mod deadpool_api;
mod e2e_prometheus;
mod errors;
mod failover;
mod fifo;
mod gauges;
mod hostile_fence;
mod hostile_fence2;
mod hostile_fence3;
mod hostile_naming;
mod hostile_release;
mod hostile_release2;
mod hostile_release3;
mod hostile_s40;
mod http_edges;
mod http_flood;
mod hung_server;
mod incident;
mod lease_backends;
mod lease_contention;
mod lease_environments;
mod lease_faults;
mod lease_fence_blocked;
mod lease_fence_bounds;
mod lease_fence_db_clock;
mod lease_fencing;
mod lease_gather;
mod lease_gather_faults;
mod lease_install;
mod lease_isolation;
mod lease_listing_blockers;
mod lease_metrics;
mod lease_observers;
mod lease_pgbouncer;
mod lease_purge;
mod lease_renewer;
mod lease_run;
mod lease_ttl;
mod leases;
mod lock_backends;
mod lock_unlock_bound;
mod locks;
mod metrics;
mod migrate_name;
mod pool;
mod pool_application_name;
mod pooler;
mod pooler_load;
mod pooler_netns;
mod pooler_session;
mod pooler_statements;
mod readiness_reserve;
mod relock;
mod scheduler;
mod scheduler_faults;
mod server_errors;
mod service;
mod session_lock_wait;
mod settings;
mod slow_link;
mod sqlx_no_runtime;
mod sqlx_pool;
mod sqlx_xact_lock;
mod supervisor;
mod xact;
