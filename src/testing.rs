//! Throwaway PostgreSQL (and PgBouncer) servers for tests, examples and your
//! own integration tests (feature `testing`).
//!
//! [`TestServer::shared`] starts one PostgreSQL server per process (per test
//! binary) on first use: `initdb` into a temporary directory, `postgres`
//! listening on a Unix socket only, durability switched off. Every test then
//! takes a fresh database of its own with [`TestServer::create_database`], so
//! tests run in parallel without seeing each other's tables or locks.
//!
//! ```no_run
//! use pgwarden::testing::TestServer;
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
//! [`PgBouncer`] works the same way.
//!
//! # Optional tools
//!
//! [`tool_available`] and [`require_tool`] let a test skip when an optional
//! tool (`pgbouncer`, `promtool`) is missing, except on CI ([`ci`]), where a
//! missing tool is an error.

use std::fmt;
use std::io::Write as _;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config, NoTls};

mod bouncer;
mod process;
mod prometheus;

pub use bouncer::PgBouncer;
pub use prometheus::Prometheus;

use process::{io_err, Probe, RunAs, Watchdog};

/// How long a server may take to accept connections before start fails.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Connect timeout put into every [`Config`] handed out.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of the test harness.
///
/// Cheap to clone: [`TestServer::shared`] reports the same error to every
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
    /// A statement or connection failed.
    #[error("PostgreSQL error: {0}")]
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
    /// An optional tool is missing and [`ci`] is true.
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

/// Whether the `CI` environment variable says we run on CI (`CI=true`, or
/// any value other than empty, `0`, `false`, `no`).
pub fn ci() -> bool {
    match std::env::var("CI") {
        Ok(v) => !matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "" | "0" | "false" | "no"
        ),
        Err(_) => false,
    }
}

/// Whether the executable `name` exists: on `PATH`, in `/usr/local/sbin`,
/// `/usr/sbin`, `/sbin` (often not on a non-root `PATH`, and where Debian
/// puts `pgbouncer`), or in `/usr/lib/postgresql/*/bin`.
pub fn tool_available(name: &str) -> bool {
    find_tool(name).is_some()
}

/// The path of the executable `name`, searched as in [`tool_available`].
pub fn find_tool(name: &str) -> Option<PathBuf> {
    process::find_tool(name)
}

/// The Debian package that provides a tool this harness knows about.
fn package_of(tool: &str) -> &str {
    match tool {
        "promtool" | "prometheus" => "prometheus",
        "initdb" | "postgres" | "pg_ctl" => "postgresql",
        "psql" | "pg_isready" => "postgresql-client",
        other => other,
    }
}

/// For tests that need an optional tool: `Ok(true)` when it is there;
/// when it is missing, `Ok(false)` (and a note on stderr: skip the test), or,
/// when [`ci`] is true, [`TestingError::ToolMissing`] (fail the test).
///
/// ```no_run
/// # fn t() -> Result<(), pgwarden::testing::TestingError> {
/// if !pgwarden::testing::require_tool("pgbouncer")? {
///     return Ok(()); // skipped
/// }
/// # Ok(())
/// # }
/// ```
pub fn require_tool(name: &str) -> Result<bool, TestingError> {
    if tool_available(name) {
        return Ok(true);
    }
    let package = package_of(name).to_owned();
    if ci() {
        return Err(TestingError::ToolMissing {
            tool: name.to_owned(),
            package,
        });
    }
    // Straight to stderr, past libtest's output capture, so the skip shows.
    let _ = writeln!(
        std::io::stderr(),
        "note: `{name}` not found, skipping; install it with `apt-get install -y {package}` \
         (with CI=true this is a failure)"
    );
    Ok(false)
}

/// A PostgreSQL server for tests: a throwaway one this process started, or
/// the external one named by `DATABASE_URL`.
///
/// A started server listens on a Unix socket in its temporary directory only,
/// runs with `fsync`, `synchronous_commit` and `full_page_writes` off and
/// `max_connections = 200`, and is stopped (its directory removed) on drop
/// or, failing that, by its watchdog when the process ends.
#[derive(Debug)]
pub struct TestServer {
    /// Connection to the maintenance database (`postgres`, or `DATABASE_URL`'s).
    config: Config,
    /// `None` for an external server.
    local: Option<LocalServer>,
}

#[derive(Debug)]
struct LocalServer {
    postgres: Child,
    watchdog: Watchdog,
    socket_dir: PathBuf,
    port: u16,
    // Dropped (removed) after `Drop::drop` stopped the server.
    dir: tempfile::TempDir,
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        // First the watchdog, so it cannot signal a pid we are about to reap.
        self.watchdog.disarm();
        // SIGINT: fast shutdown (rolls back open transactions, ≈30 ms).
        process::stop_child(&mut self.postgres, libc::SIGINT);
    }
}

static SHARED: OnceLock<Result<TestServer, TestingError>> = OnceLock::new();
static NEXT_DB: AtomicU64 = AtomicU64::new(1);

impl TestServer {
    /// Starts a server: the external one if `DATABASE_URL` is set (see
    /// [`TestServer::from_url`]), else a throwaway one
    /// ([`TestServer::start_local`]). Blocks for about a second or two.
    pub fn start() -> Result<TestServer, TestingError> {
        match std::env::var("DATABASE_URL") {
            Ok(url) if !url.trim().is_empty() => TestServer::from_url(&url),
            _ => TestServer::start_local(),
        }
    }

    /// The per-process server, started by the first call ([`TestServer::start`]);
    /// later calls return the same server, or the same error again. Never
    /// dropped: its watchdog stops it when the process ends.
    pub fn shared() -> Result<&'static TestServer, TestingError> {
        SHARED
            .get_or_init(TestServer::start)
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Uses an existing server (no process is started). `url` is anything
    /// [`tokio_postgres::Config`] parses; its database is used for
    /// `CREATE DATABASE`. Nothing is connected until first use.
    pub fn from_url(url: &str) -> Result<TestServer, TestingError> {
        let mut config =
            Config::from_str(url.trim()).map_err(|e| TestingError::DatabaseUrl(Arc::new(e)))?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        Ok(TestServer {
            config,
            local: None,
        })
    }

    /// Starts a throwaway server, ignoring `DATABASE_URL`. Blocks until it
    /// accepts connections (about a second; at most 30 s, then
    /// [`TestingError::Startup`] with the end of its log).
    pub fn start_local() -> Result<TestServer, TestingError> {
        let bins = process::find_pg_binaries()?;
        let run_as = process::run_as()?;
        let dir = process::temp_dir("pgwarden-pg-", run_as)?;
        let root = dir.path().to_path_buf();
        // Armed with the pid below; until then it only removes the directory.
        let mut watchdog = Watchdog::spawn(&root, "INT")?;
        process::chown(&root, run_as)?;
        let data = root.join("data");
        initdb(&bins, run_as, &root, &data)?;

        let mut last_error = None;
        for _attempt in 0..3 {
            let port: u16 = rand::Rng::gen_range(&mut rand::thread_rng(), 20_000..60_000);
            let (out, err) = process::log_file(&root.join("postmaster.log"))?;
            let mut postgres = process::server_command(&bins.postgres, run_as, &root)
                .arg("-D")
                .arg(&data)
                .arg("-k")
                .arg(&root)
                .arg("-p")
                .arg(port.to_string())
                .args(["-c", "listen_addresses="])
                .args(["-c", "fsync=off"])
                .args(["-c", "synchronous_commit=off"])
                .args(["-c", "full_page_writes=off"])
                .args(["-c", "max_connections=200"])
                // A lock table for 51,200 locks (the default 64 per connection
                // holds about 13,000): the census is tested with tens of
                // thousands of advisory locks.
                .args(["-c", "max_locks_per_transaction=256"])
                .args(["-c", "logging_collector=on"])
                .arg("-c")
                .arg(format!("log_directory={}", root.join("log").display()))
                .stdout(out)
                .stderr(err)
                .spawn()
                .map_err(io_err(format!("spawning {}", bins.postgres.display())))?;
            let ready = watchdog
                .arm(postgres.id())
                .map_err(|e| (e, false))
                .and_then(|()| wait_ready(&mut postgres, &root, port));
            match ready {
                Ok(()) => {
                    let mut config = Config::new();
                    config
                        .host_path(&root)
                        .port(port)
                        .user("postgres")
                        .dbname("postgres")
                        .connect_timeout(CONNECT_TIMEOUT);
                    return Ok(TestServer {
                        config,
                        local: Some(LocalServer {
                            postgres,
                            watchdog,
                            socket_dir: root,
                            port,
                            dir,
                        }),
                    });
                }
                Err((e, retry)) => {
                    process::stop_child(&mut postgres, libc::SIGINT);
                    if !retry {
                        last_error = Some(e);
                        break;
                    }
                    last_error = Some(e);
                }
            }
        }
        // The server is stopped; `dir` is removed on return.
        watchdog.disarm();
        Err(last_error.unwrap_or_else(|| TestingError::Startup {
            program: "postgres".to_owned(),
            reason: "no attempt was made".to_owned(),
            log_tail: String::new(),
        }))
    }

    /// Whether this is the external server named by `DATABASE_URL` (or
    /// [`TestServer::from_url`]) rather than one this process started.
    pub fn is_external(&self) -> bool {
        self.local.is_none()
    }

    /// Connection settings for the maintenance database: `postgres` as user
    /// `postgres` on a started server, or exactly `DATABASE_URL`'s.
    pub fn pg_config(&self) -> Config {
        self.config.clone()
    }

    /// The same settings as a `key=value` connection string.
    pub fn url(&self) -> String {
        config_to_url(&self.config)
    }

    /// The directory holding the server's Unix socket (`.s.PGSQL.<port>`);
    /// `None` for an external server reached over TCP.
    pub fn socket_dir(&self) -> Option<&Path> {
        match &self.local {
            Some(l) => Some(&l.socket_dir),
            None => self.config.get_hosts().iter().find_map(|h| match h {
                Host::Unix(p) => Some(p.as_path()),
                Host::Tcp(_) => None,
            }),
        }
    }

    /// The server's port (for a started server it only names the socket file).
    pub fn port(&self) -> u16 {
        match &self.local {
            Some(l) => l.port,
            None => self.config.get_ports().first().copied().unwrap_or(5432),
        }
    }

    /// The pid of the postmaster of a started server.
    pub fn pid(&self) -> Option<u32> {
        self.local.as_ref().map(|l| l.postgres.id())
    }

    /// The temporary directory of a started server (data directory in
    /// `data/`, server logs in `log/`); removed when the server stops.
    pub fn dir(&self) -> Option<&Path> {
        self.local.as_ref().map(|l| l.dir.path())
    }

    /// The end of a started server's log files (empty for an external one).
    pub fn log_tail(&self, lines: usize) -> String {
        match &self.local {
            Some(l) => server_log_tail(l.dir.path(), lines),
            None => String::new(),
        }
    }

    /// Creates a fresh, uniquely named, empty database (from `template1`).
    /// Must run inside a Tokio runtime (the connection task is spawned).
    pub async fn create_database(&self) -> Result<TestDb, TestingError> {
        let admin = connect_config(&self.config).await?;
        let n = NEXT_DB.fetch_add(1, Ordering::Relaxed);
        let name = format!("pgwarden_test_{:08x}_{n}", rand::random::<u32>());
        admin
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .await?;
        let mut config = self.config.clone();
        config.dbname(&name);
        Ok(TestDb {
            name,
            config,
            admin: self.config.clone(),
        })
    }
}

/// The end of a started server's logs: the postmaster's stderr and the
/// logging collector's files.
fn server_log_tail(root: &Path, lines: usize) -> String {
    process::log_tail(&[root.join("postmaster.log"), root.join("log")], lines)
}

/// Polls until the server answers a startup message on its socket. On
/// failure: the error, and whether another port is worth a try.
fn wait_ready(postgres: &mut Child, root: &Path, port: u16) -> Result<(), (TestingError, bool)> {
    let socket = root.join(format!(".s.PGSQL.{port}"));
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    let mut last = String::from("no answer yet");
    loop {
        if let Ok(Some(status)) = postgres.try_wait() {
            let log_tail = server_log_tail(root, 40);
            let retry = log_tail.contains("lock file") || log_tail.contains("already in use");
            return Err((
                TestingError::Startup {
                    program: "postgres".to_owned(),
                    reason: format!("exited with {status}"),
                    log_tail,
                },
                retry,
            ));
        }
        if socket.exists() {
            match UnixStream::connect(&socket).and_then(|s| {
                s.set_read_timeout(Some(Duration::from_secs(2)))?;
                s.set_write_timeout(Some(Duration::from_secs(2)))?;
                process::probe(s, "postgres", "postgres")
            }) {
                Ok(Probe::Ready) => return Ok(()),
                Ok(Probe::NotReady(m)) => last = m,
                Err(e) => last = e.to_string(),
            }
        }
        if Instant::now() >= deadline {
            return Err((
                TestingError::Startup {
                    program: "postgres".to_owned(),
                    reason: format!(
                        "not accepting connections after {STARTUP_TIMEOUT:?} (last: {last})"
                    ),
                    log_tail: server_log_tail(root, 40),
                },
                false,
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `initdb` (as the server user), trying the `C.UTF-8` locale, then `C`.
fn initdb(
    bins: &process::PgBinaries,
    run_as: Option<RunAs>,
    root: &Path,
    data: &Path,
) -> Result<(), TestingError> {
    let log = root.join("initdb.log");
    let mut status = None;
    for locale in ["C.UTF-8", "C"] {
        let (out, err) = process::log_file(&log)?;
        let mut child = process::server_command(&bins.initdb, run_as, root)
            .arg("-D")
            .arg(data)
            .args(["-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8"])
            .arg(format!("--locale={locale}"))
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(io_err(format!("spawning {}", bins.initdb.display())))?;
        if !process::wait_for_exit(&mut child, Duration::from_secs(180)) {
            process::stop_child(&mut child, libc::SIGTERM);
            return Err(TestingError::Startup {
                program: "initdb".to_owned(),
                reason: "did not finish within 180 s".to_owned(),
                log_tail: process::log_tail(&[log], 40),
            });
        }
        match child.wait() {
            Ok(s) if s.success() => return Ok(()),
            Ok(s) => status = Some(s),
            Err(e) => return Err(io_err("waiting for initdb")(e)),
        }
        // initdb removes the data directory it created when it fails.
        let _ = std::fs::remove_dir_all(data);
    }
    Err(TestingError::Startup {
        program: "initdb".to_owned(),
        reason: match status {
            Some(s) => format!("exited with {s}"),
            None => "failed".to_owned(),
        },
        log_tail: process::log_tail(&[log], 40),
    })
}

/// A database created by [`TestServer::create_database`].
///
/// Dropping it does not drop the database (a throwaway server goes away as
/// a whole); call [`TestDb::destroy`] to drop it, e.g. on an external server.
#[derive(Debug, Clone)]
pub struct TestDb {
    name: String,
    config: Config,
    admin: Config,
}

impl TestDb {
    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Connection settings for this database.
    pub fn pg_config(&self) -> Config {
        self.config.clone()
    }

    /// The same settings as a `key=value` connection string, e.g.
    /// `host=/tmp/pgwarden-pg-x port=41234 user=postgres dbname=pgwarden_test_…`,
    /// which [`tokio_postgres::Config::from_str`] (and libpq) parse.
    pub fn url(&self) -> String {
        config_to_url(&self.config)
    }

    /// A `deadpool_postgres::Pool` of at most `max_size` connections to this
    /// database (`RecyclingMethod::Fast`, `Runtime::Tokio1`).
    pub fn deadpool(&self, max_size: usize) -> Result<Pool, TestingError> {
        build_pool(self.config.clone(), max_size)
    }

    /// A client outside any pool; its connection task is spawned on the
    /// current Tokio runtime.
    pub async fn connect(&self) -> Result<Client, TestingError> {
        connect_config(&self.config).await
    }

    /// Drops the database (`WITH (FORCE)`: open connections are terminated).
    pub async fn destroy(self) -> Result<(), TestingError> {
        let admin = connect_config(&self.admin).await?;
        admin
            .batch_execute(&format!(
                "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
                self.name
            ))
            .await?;
        Ok(())
    }
}

/// Connects with `NoTls` and spawns the connection task.
async fn connect_config(config: &Config) -> Result<Client, TestingError> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "pgwarden::testing connection ended with an error");
        }
    });
    Ok(client)
}

fn build_pool(config: Config, max_size: usize) -> Result<Pool, TestingError> {
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(max_size)
        .runtime(Runtime::Tokio1)
        .build()
        .map_err(|e| TestingError::PoolBuild {
            message: e.to_string(),
        })
}

/// Renders a [`Config`] as a libpq `key=value` connection string.
fn config_to_url(c: &Config) -> String {
    let mut parts = Vec::new();
    let hosts: Vec<String> = c
        .get_hosts()
        .iter()
        .map(|h| match h {
            Host::Tcp(s) => s.clone(),
            Host::Unix(p) => p.display().to_string(),
        })
        .collect();
    if !hosts.is_empty() {
        parts.push(Kv("host", hosts.join(",")));
    }
    let addrs: Vec<String> = c.get_hostaddrs().iter().map(|a| a.to_string()).collect();
    if !addrs.is_empty() {
        parts.push(Kv("hostaddr", addrs.join(",")));
    }
    let ports: Vec<String> = c.get_ports().iter().map(|p| p.to_string()).collect();
    if !ports.is_empty() {
        parts.push(Kv("port", ports.join(",")));
    }
    if let Some(u) = c.get_user() {
        parts.push(Kv("user", u.to_owned()));
    }
    if let Some(p) = c.get_password() {
        parts.push(Kv("password", String::from_utf8_lossy(p).into_owned()));
    }
    if let Some(d) = c.get_dbname() {
        parts.push(Kv("dbname", d.to_owned()));
    }
    if let Some(o) = c.get_options() {
        parts.push(Kv("options", o.to_owned()));
    }
    if let Some(a) = c.get_application_name() {
        parts.push(Kv("application_name", a.to_owned()));
    }
    if let Some(t) = c.get_connect_timeout() {
        parts.push(Kv("connect_timeout", t.as_secs().max(1).to_string()));
    }
    if c.get_ssl_mode() == tokio_postgres::config::SslMode::Disable {
        parts.push(Kv("sslmode", "disable".to_owned()));
    }
    parts
        .iter()
        .map(|kv| kv.to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

/// One `key=value` pair, the value quoted when it needs to be.
struct Kv(&'static str, String);

impl fmt::Display for Kv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plain = !self.1.is_empty()
            && !self
                .1
                .chars()
                .any(|c| c.is_whitespace() || c == '\'' || c == '\\' || c == '=');
        if plain {
            write!(f, "{}={}", self.0, self.1)
        } else {
            write!(f, "{}='", self.0)?;
            for c in self.1.chars() {
                if c == '\'' || c == '\\' {
                    f.write_str("\\")?;
                }
                write!(f, "{c}")?;
            }
            f.write_str("'")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_round_trips_through_config() {
        let mut c = Config::new();
        c.host_path("/tmp/a b")
            .port(5433)
            .user("postgres")
            .password("it's\\x")
            .dbname("t_1")
            .connect_timeout(Duration::from_secs(10));
        let url = config_to_url(&c);
        let back = Config::from_str(&url).unwrap();
        assert_eq!(back.get_hosts(), c.get_hosts());
        assert_eq!(back.get_ports(), c.get_ports());
        assert_eq!(back.get_user(), Some("postgres"));
        assert_eq!(back.get_password(), Some(&b"it's\\x"[..]));
        assert_eq!(back.get_dbname(), Some("t_1"));
    }

    #[test]
    fn missing_binaries_message_names_the_package() {
        let e = TestingError::NoBinaries {
            searched: vec![PathBuf::from("/usr/bin")],
        };
        assert!(e.to_string().contains("apt-get install -y postgresql"));
    }
}
