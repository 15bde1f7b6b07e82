//! [`TestServer`]: a throwaway PostgreSQL server (or the one `DATABASE_URL`
//! names).

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio_postgres::config::Host;
use tokio_postgres::Config;

use crate::db::{config_to_url, connect_config, TestDb};
use crate::process::{self, io_err, Probe, RunAs, Watchdog};
use crate::{TestingError, CONNECT_TIMEOUT, STARTUP_TIMEOUT};

/// A PostgreSQL server for tests: a throwaway one this process started, or
/// the external one named by `DATABASE_URL`.
///
/// A started server listens on a Unix socket in its temporary directory only,
/// runs with `fsync`, `synchronous_commit` and `full_page_writes` off and
/// `max_connections = 1000`, and is stopped (its directory removed) on drop
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
        // A server of a failing test's own: its log goes with the failure.
        if std::thread::panicking() {
            eprintln!(
                "server on port {} (the test failed), its log:\n{}",
                self.port,
                server_log_tail(self.dir.path(), 60)
            );
        }
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
        TestServer::start_local_with(&[], &[])
    }

    /// [`TestServer::start_local`] with extra server settings (`-c
    /// name=value`, after the harness's own, so they win) and files written
    /// into the data directory before start (owned by the server's user,
    /// mode 0600: a key file passes PostgreSQL's check). Relative paths in
    /// settings are relative to the data directory.
    ///
    /// ```no_run
    /// # fn demo(cert: &[u8], key: &[u8]) -> Result<(), pgwarden_testing::TestingError> {
    /// // TLS over TCP on 127.0.0.1 (the socket stays too): the server's
    /// // default file names, server.crt and server.key.
    /// let server = pgwarden_testing::TestServer::start_local_with(
    ///     &[("ssl", "on"), ("listen_addresses", "127.0.0.1")],
    ///     &[("server.crt", cert), ("server.key", key)],
    /// )?;
    /// # let _ = server; Ok(()) }
    /// ```
    pub fn start_local_with(
        settings: &[(&str, &str)],
        files: &[(&str, &[u8])],
    ) -> Result<TestServer, TestingError> {
        let bins = process::find_pg_binaries()?;
        let run_as = process::run_as()?;
        let dir = process::temp_dir("pgwarden-pg-", run_as)?;
        let root = dir.path().to_path_buf();
        // Armed with the pid below; until then it only removes the directory.
        let mut watchdog = Watchdog::spawn(&root, "INT")?;
        process::chown(&root, run_as)?;
        let data = root.join("data");
        initdb(&bins, run_as, &root, &data)?;
        for (name, bytes) in files {
            let path = data.join(name);
            std::fs::write(&path, bytes).map_err(io_err(format!("writing {}", path.display())))?;
            std::fs::set_permissions(
                &path,
                <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600),
            )
            .map_err(io_err(format!("chmod {}", path.display())))?;
            process::chown(&path, run_as)?;
        }

        let mut last_error = None;
        for _attempt in 0..5 {
            // A port the kernel had free (a random one collided now and
            // then with a client's local port, taken from the same range).
            let port = process::free_port()?;
            // Each attempt's logs alone: the reason read when it exits is
            // its own, not an earlier attempt's.
            let _ = std::fs::remove_dir_all(root.join("log"));
            let _ = std::fs::remove_file(root.join("postmaster.log"));
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
                // 1000: the tests of one binary share this server on 10
                // threads, and two loaded PgBouncer tests at once hold about
                // 90 of its connections (with 200, a third test's connect
                // was refused with 53300 on a busy machine; a sampler every
                // 200 ms saw 266 at once in a whole run, where 400 was the
                // limit, and a CI run saw two PgBouncer tests and a sqlx
                // test fail at once). Its Unix socket's listen queue is
                // twice this; its lock table (below) grows with it, about
                // 100 MB.
                .args(["-c", "max_connections=1000"])
                // A lock table for 256,000 locks (256 per connection; the
                // default 64 held about 26,000 with 400 connections): the
                // census is tested with tens of thousands of advisory locks.
                .args(["-c", "max_locks_per_transaction=256"])
                // The run creates about a thousand databases, each written
                // whole to the WAL: checkpoints every 64 MB recycle it,
                // where the default 1 GB let it reach gigabytes (and the
                // directory may be on tmpfs, in memory: `temp_base`).
                .args(["-c", "max_wal_size=64MB"])
                .args(["-c", "min_wal_size=32MB"])
                .args(["-c", "logging_collector=on"])
                .arg("-c")
                .arg(format!("log_directory={}", root.join("log").display()))
                .args(
                    settings
                        .iter()
                        .flat_map(|(k, v)| ["-c".to_owned(), format!("{k}={v}")]),
                )
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

    /// Whether this is [`TestServer::shared`]'s server.
    pub(crate) fn is_shared(&self) -> bool {
        SHARED
            .get()
            .and_then(|r| r.as_ref().ok())
            .is_some_and(|shared| std::ptr::eq(shared, self))
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
        Ok(TestDb::new(name, config, self.config.clone()))
    }
}

/// The end of a started server's logs: the postmaster's stderr and the
/// logging collector's files.
pub(crate) fn server_log_tail(root: &Path, lines: usize) -> String {
    process::log_tail(&[root.join("postmaster.log"), root.join("log")], lines)
}

/// The logs of a server that exited while starting: the logging
/// collector writes the reason (`FATAL: could not bind …`) a moment after
/// the postmaster exits, so wait up to a second for a `FATAL` line.
fn exit_log(root: &Path) -> String {
    let until = Instant::now() + Duration::from_secs(1);
    loop {
        let tail = server_log_tail(root, 40);
        if tail.contains("FATAL") || Instant::now() >= until {
            return tail;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls until the server answers a startup message on its socket. On
/// failure: the error, and whether another port is worth a try.
pub(crate) fn wait_ready(
    postgres: &mut Child,
    root: &Path,
    port: u16,
) -> Result<(), (TestingError, bool)> {
    let socket = root.join(format!(".s.PGSQL.{port}"));
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    let mut last = String::from("no answer yet");
    loop {
        if let Ok(Some(status)) = postgres.try_wait() {
            let log_tail = exit_log(root);
            // A port taken meanwhile, or a reason the log does not give:
            // another port is worth a try (the attempts are bounded).
            let retry = log_tail.contains("lock file")
                || log_tail.contains("already in use")
                || log_tail.contains("could not bind")
                || !log_tail.contains("FATAL");
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

/// A data directory `initdb` made once per process, which every server of
/// the process starts from a copy of: `initdb` (a bootstrap and a
/// single-user pass over the catalogs) costs about a second of CPU, a
/// copy of its 40 MB a tenth of that, and a test binary starts dozens of
/// servers (clusters, servers of a test's own). Removed by its watchdog when
/// the process ends.
#[derive(Debug)]
struct Template {
    data: PathBuf,
    _dir: tempfile::TempDir,
    _watchdog: Watchdog,
}

static TEMPLATE: OnceLock<Result<Template, TestingError>> = OnceLock::new();

/// A fresh data directory at `data` (as the server user): a copy of the
/// process's template ([`Template`], made by `initdb` on first use), the
/// same files `initdb` would write there.
pub(crate) fn initdb(
    bins: &process::PgBinaries,
    run_as: Option<RunAs>,
    root: &Path,
    data: &Path,
) -> Result<(), TestingError> {
    let template = TEMPLATE
        .get_or_init(|| {
            let dir = process::temp_dir("pgwarden-initdb-", run_as)?;
            let watchdog = Watchdog::spawn(dir.path(), "INT")?;
            process::chown(dir.path(), run_as)?;
            let data = dir.path().join("data");
            run_initdb(bins, run_as, dir.path(), &data)?;
            Ok(Template {
                data,
                _dir: dir,
                _watchdog: watchdog,
            })
        })
        .as_ref()
        .map_err(Clone::clone)?;
    let log = root.join("initdb.log");
    let (out, err) = process::log_file(&log)?;
    let status = process::server_command(Path::new("cp"), run_as, root)
        .arg("-a")
        .arg(&template.data)
        .arg(data)
        .stdout(out)
        .stderr(err)
        .status()
        .map_err(io_err("spawning cp"))?;
    if status.success() {
        return Ok(());
    }
    Err(TestingError::Startup {
        program: "cp".to_owned(),
        reason: format!(
            "copying the initdb template {} exited with {status}",
            template.data.display()
        ),
        log_tail: process::log_tail(&[log], 40),
    })
}

/// Runs `initdb` (as the server user), trying the `C.UTF-8` locale, then `C`.
fn run_initdb(
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
