//! The harness's error type.

use std::path::PathBuf;
use std::sync::Arc;

/// Errors of the test harness.
///
/// Cheap to clone: [`TestServer::shared`](crate::TestServer::shared) reports the same error to every
/// caller when the shared server failed to start.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum TestingError {
    /// No PostgreSQL server binaries (`initdb`, `postgres`) were found.
    #[error(
        "PostgreSQL server binaries (initdb, postgres) not found (searched {}); \
         install the Debian package postgresql (apt-get install -y postgresql), \
         or set PGWARDEN_PG_BINDIR to the directory holding them, \
         or set DATABASE_URL to use an existing server",
        display_paths(.searched)
    )]
    NoBinaries {
        /// The directories that were searched.
        searched: Vec<PathBuf>,
    },
    /// Running as root, but there is no system user to run the servers as.
    #[error(
        "running as root and PostgreSQL/PgBouncer refuse to run as root, but there is \
         no `{name}` system user to run them as; install the Debian package postgresql \
         (apt-get install -y postgresql), which creates it, or run as a non-root user"
    )]
    NoUser {
        /// The user looked up.
        name: String,
    },
    /// A file system or process operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// A server process failed to start or did not accept connections in time.
    #[error("{program} failed: {reason}\n--- log tail ---\n{log_tail}")]
    Startup {
        /// Which program (`initdb`, `postgres`, `pgbouncer`).
        program: String,
        /// What went wrong.
        reason: String,
        /// The end of the program's log files.
        log_tail: String,
    },
    /// A statement or connection failed. Shown with the server's own
    /// message and SQLSTATE when it sent one (tokio-postgres's display is
    /// only "db error").
    #[error("PostgreSQL error: {}", pg_message(.0))]
    Postgres(#[source] Arc<tokio_postgres::Error>),
    /// `DATABASE_URL` is set but cannot be parsed.
    #[error("DATABASE_URL cannot be parsed: {0}")]
    DatabaseUrl(#[source] Arc<tokio_postgres::Error>),
    /// Building a `deadpool_postgres::Pool` failed.
    #[error("building the deadpool pool failed: {message}")]
    PoolBuild {
        /// The builder's error message.
        message: String,
    },
    /// The operation needs a throwaway server of the test's own, and this
    /// one is external (`DATABASE_URL`) or the per-process shared one.
    #[error("{operation} is not possible: start a server of the test's own with TestServer::start_local()")]
    NotLocal {
        /// What was attempted, and why it cannot be done on this server.
        operation: &'static str,
    },
    /// A step of a replication [`Cluster`](crate::Cluster) failed or did not
    /// finish within its bound.
    #[error("replication cluster: {step} failed: {reason}")]
    Cluster {
        /// The step: `pg_basebackup`, `pg_ctl stop`, `promotion`, a wait…
        step: String,
        /// What went wrong, with the end of the servers' logs where they help.
        reason: String,
    },
    /// An optional tool is missing and [`ci`](crate::ci) is true.
    #[error(
        "`{tool}` is required on CI (CI=true) but was not found; \
         install the Debian package {package} (apt-get install -y {package})"
    )]
    ToolMissing {
        /// The tool's binary name.
        tool: String,
        /// The Debian package that provides it.
        package: String,
    },
}

impl From<tokio_postgres::Error> for TestingError {
    fn from(e: tokio_postgres::Error) -> Self {
        TestingError::Postgres(Arc::new(e))
    }
}

fn display_paths(paths: &[PathBuf]) -> String {
    if paths.is_empty() {
        return "nothing".to_owned();
    }
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A tokio-postgres error with what the server said, when it said anything.
fn pg_message(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!(
            "{}: {} (SQLSTATE {})",
            db.severity(),
            db.message(),
            db.code().code()
        ),
        None => e.to_string(),
    }
}
