//! The test harness of pgwarden: throwaway PostgreSQL, PgBouncer and
//! Prometheus servers for tests, examples, benches and your own integration
//! tests; faults ([`Stopped`] processes, a [`Frozen`] server); bounded waits
//! ([`eventually`], [`within`]).
//!
//! It does not depend on pgwarden: it hands out `deadpool_postgres::Pool`s,
//! `tokio_postgres::Client`s and connection settings, which pgwarden's tests
//! wrap in a `pgwarden::Pool`.
//!
//! [`TestServer::shared`] starts one PostgreSQL server per process (per test
//! binary) on first use: `initdb` into a temporary directory, `postgres`
//! listening on a Unix socket only, durability switched off. Every test then
//! takes a fresh database of its own with [`TestServer::create_database`], so
//! tests run in parallel without seeing each other's tables or locks.
//!
//! ```no_run
//! use pgwarden_testing::TestServer;
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let server = TestServer::shared()?;
//! let db = server.create_database().await?;
//! let pool = db.deadpool(4)?; // a deadpool_postgres::Pool on that database
//! let client = pool.get().await?;
//! let row = client.query_one("SELECT 1 + 1", &[]).await?;
//! assert_eq!(row.get::<_, i32>(0), 2);
//! # Ok(())
//! # }
//! ```
//!
//! # Where the server comes from
//!
//! * `DATABASE_URL` set (a URL or a `key=value` string that
//!   [`tokio_postgres::Config`] parses): that server is used, no process is
//!   started; [`TestServer::create_database`] still creates a fresh database
//!   on it for every call. The user needs `CREATEDB`.
//! * Otherwise `initdb` and `postgres` are looked up in `$PGWARDEN_PG_BINDIR`,
//!   then on `PATH`, then in the highest `/usr/lib/postgresql/<version>/bin`.
//!   None found: [`TestingError::NoBinaries`]; on Debian or Ubuntu install
//!   them with `apt-get install -y postgresql`.
//!
//! PostgreSQL refuses to run as root; when the tests run as root, `initdb`
//! and `postgres` run as the `postgres` system user instead.
//!
//! # Clean-up
//!
//! A [`TestServer`] stops its server and removes its directory when dropped.
//! The shared one is never dropped, so each server also has a watchdog: a
//! small `sh` process whose stdin is a pipe only the test process holds. When
//! the test process ends in any way (normal exit, panic, `SIGKILL`) the pipe
//! closes and the watchdog stops the server and removes its directory.
//! [`PgBouncer`] and [`Prometheus`] work the same way.
//!
//! A [`TestDb`] drops its database when its last clone, and the last client
//! [`TestDb::connect`] opened, are gone (on a thread of the harness, `WITH
//! (FORCE)`): keep it while the database is used.
//!
//! # Where the directories go
//!
//! `PGWARDEN_TEST_TMPDIR` when set; else `/dev/shm` when it is a tmpfs
//! with at least 2 GiB free (the servers' files in memory: about 15 % less
//! CPU for `tests/it`, which creates and drops about a thousand databases);
//! else the temporary directory (`/tmp` when the server user could not
//! reach it).
//!
//! # A primary and its replica
//!
//! [`Cluster`] starts a primary and a streaming replica (`pg_basebackup -R`)
//! on two ports of `127.0.0.1`, asynchronous or synchronous
//! ([`Replication`]), for failover tests: crash the primary
//! ([`Cluster::stop_primary_immediate`]), promote the replica
//! ([`Cluster::promote_replica`]), stop WAL shipping to construct a lost tail
//! ([`Cluster::pause_streaming`]), and reach whichever server takes writes
//! through a multi-host connection string ([`Cluster::multi_host_url`]).
//!
//! # Faults
//!
//! [`Stopped::stop`] stops processes (a backend, found by its pid) with
//! `SIGSTOP`; [`TestServer::freeze`] stops a whole server of the test's own.
//! Both continue them with `SIGCONT` when their guard is dropped, even when
//! the test panics.
//!
//! A [`Proxy`] in front of a server makes network faults: latency
//! ([`Proxy::set_latency`]), a partition that closes nothing
//! ([`Proxy::blackhole`], [`Proxy::heal`]) and connection resets
//! ([`Proxy::reset_all`]).
//!
//! # Optional tools
//!
//! [`tool_available`] and [`require_tool`] let a test skip when an optional
//! tool (`pgbouncer`, `promtool`) is missing, except on CI ([`ci`]), where a
//! missing tool is an error.
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

use std::time::Duration;

mod bouncer;
mod cluster;
mod db;
mod error;
mod fault;
mod process;
mod prometheus;
mod proxy;
mod server;
mod tools;
mod wait;

pub use bouncer::{PgBouncer, PoolMode};
pub use cluster::{Cluster, Node, Replication};
pub use db::{deadpool, TestDb};
pub use error::TestingError;
pub use fault::{Frozen, Stopped};
pub use prometheus::Prometheus;
pub use proxy::{Proxy, Upstream};
pub use server::TestServer;
pub use tools::{ci, find_tool, require_tool, tool_available};
pub use wait::{eventually, within};

/// How long a server may take to accept connections before start fails.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Connect timeout put into every [`Config`](tokio_postgres::Config) handed out.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The lease table's DDL as pgwarden 0.1 shipped it, before the
/// `renewed_at` column (default names `public.pgwarden_leases` and its
/// token sequence): for tests of a table made by that version, and of a
/// fleet where instances of it still write.
pub const LEASES_DDL_0_1: &str = r#"
CREATE SEQUENCE IF NOT EXISTS "public"."pgwarden_leases_token_seq" AS bigint CACHE 1;
CREATE TABLE IF NOT EXISTS "public"."pgwarden_leases" (name text PRIMARY KEY, holder text NOT NULL,
  token bigint NOT NULL, taken_at timestamptz NOT NULL DEFAULT now(), expires_at timestamptz NOT NULL,
  held_until timestamptz NOT NULL DEFAULT '-infinity', prev_holder text);
ALTER SEQUENCE "public"."pgwarden_leases_token_seq" OWNED BY "public"."pgwarden_leases".token;
"#;
