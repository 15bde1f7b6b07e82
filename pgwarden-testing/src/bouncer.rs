//! PgBouncer in transaction mode in front of a [`TestServer`].

use std::fs;
use std::net::{Ipv4Addr, TcpStream};
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config};

use crate::db::{config_to_url, connect_config, TestDb};
use crate::process::{self, io_err, Probe, RunAs, Watchdog};
use crate::{TestServer, TestingError, CONNECT_TIMEOUT, STARTUP_TIMEOUT};

/// PgBouncer's `pool_mode`: when a server connection goes back to the pool.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum PoolMode {
    /// When the client disconnects: a client keeps its server session.
    Session,
    /// At the end of each transaction: the default of [`PgBouncer::start`].
    Transaction,
}

impl PoolMode {
    /// The value as `pgbouncer.ini` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
        }
    }
}

/// PgBouncer (`pool_mode = transaction`, or as given to
/// [`PgBouncer::start_with_mode`]) in front of one database of a
/// [`TestServer`], listening on `127.0.0.1` on a free port.
///
/// Settings: `auth_type = trust`, `default_pool_size = 10` (see
/// [`PgBouncer::start_with_pool_size`]), `max_client_conn = 200`,
/// `ignore_startup_parameters = extra_float_digits,options`, no Unix socket,
/// log file in its temporary directory. Runs as the `postgres` user when this
/// process is root (PgBouncer refuses root). Stopped on drop, or by its
/// watchdog when the process ends.
///
/// In transaction mode a server connection belongs to a client only for one
/// transaction: named prepared statements fail (`prepared statement "s3"
/// does not exist`) while `query_typed` and simple queries work, and session
/// state (`SET`, session advisory locks) leaks between clients.
#[derive(Debug)]
pub struct PgBouncer {
    child: Child,
    watchdog: Watchdog,
    port: u16,
    config: Config,
    dir: tempfile::TempDir,
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        self.watchdog.disarm();
        // SIGTERM: immediate shutdown (SIGINT would wait for clients).
        process::stop_child(&mut self.child, libc::SIGTERM);
        // A test failing with PgBouncer in front: what it logged (a client
        // it closed, a server login it failed) goes with the failure.
        if std::thread::panicking() {
            eprintln!(
                "PgBouncer on port {} (the test failed), its log:\n{}",
                self.port,
                bouncer_log_tail(self.dir.path(), 60)
            );
        }
    }
}

impl PgBouncer {
    /// Starts PgBouncer for `db` on `server` with `default_pool_size = 10`.
    /// Blocks until it accepts connections (at most 30 s). The `pgbouncer`
    /// binary is found as by [`crate::find_tool`] (Debian package `pgbouncer`).
    pub fn start(server: &TestServer, db: &TestDb) -> Result<PgBouncer, TestingError> {
        PgBouncer::start_with_pool_size(server, db, 10)
    }

    /// As [`PgBouncer::start`], with `default_pool_size = pool_size`: at most
    /// that many server connections are shared by all clients. With 1, every
    /// client shares a single backend, which makes transaction pooling's
    /// effects deterministic.
    pub fn start_with_pool_size(
        server: &TestServer,
        db: &TestDb,
        pool_size: usize,
    ) -> Result<PgBouncer, TestingError> {
        PgBouncer::start_with_mode(server, db, pool_size, PoolMode::Transaction)
    }

    /// As [`PgBouncer::start_with_pool_size`], in `mode`. In session mode
    /// each client holds a server connection for its life: `pool_size` must
    /// cover every client connected at once, or the others wait.
    pub fn start_with_mode(
        server: &TestServer,
        db: &TestDb,
        pool_size: usize,
        mode: PoolMode,
    ) -> Result<PgBouncer, TestingError> {
        let binary = process::find_tool("pgbouncer").ok_or_else(|| TestingError::ToolMissing {
            tool: "pgbouncer".to_owned(),
            package: "pgbouncer".to_owned(),
        })?;
        let run_as = process::run_as()?;
        let dir = process::temp_dir("pgwarden-bouncer-", run_as)?;
        let root = dir.path().to_path_buf();
        let mut watchdog = Watchdog::spawn(&root, "TERM")?;

        let target = server.pg_config();
        let user = target.get_user().unwrap_or("postgres").to_owned();
        let ini = root.join("pgbouncer.ini");

        let (child, port) = process::start_on_free_port(
            "pgbouncer",
            &mut watchdog,
            |port| {
                write_files(
                    &root,
                    &target,
                    &user,
                    db.name(),
                    port,
                    (pool_size, mode),
                    run_as,
                )?;
                let (out, err) = process::log_file(&root.join("pgbouncer.stderr"))?;
                process::server_command(&binary, run_as, &root)
                    .arg(&ini)
                    .stdout(out)
                    .stderr(err)
                    .spawn()
                    .map_err(io_err(format!("spawning {}", binary.display())))
            },
            |child, port| wait_ready(child, &root, port, &user, db.name()),
        )?;
        let mut config = Config::new();
        config
            .host("127.0.0.1")
            .port(port)
            .user(&user)
            .dbname(db.name())
            .connect_timeout(CONNECT_TIMEOUT);
        Ok(PgBouncer {
            child,
            watchdog,
            port,
            config,
            dir,
        })
    }

    /// Connection settings for the database, through PgBouncer.
    pub fn pg_config(&self) -> Config {
        self.config.clone()
    }

    /// The same settings as a `key=value` connection string.
    pub fn url(&self) -> String {
        config_to_url(&self.config)
    }

    /// The TCP port PgBouncer listens on (on `127.0.0.1`).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// PgBouncer's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The temporary directory holding `pgbouncer.ini` and `pgbouncer.log`.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Switches PgBouncer to `mode` while it runs: rewrites `pool_mode` in
    /// `pgbouncer.ini` and sends `RELOAD` on its admin console, which
    /// returns once the file is read. A client linked to a server connection
    /// keeps it until its next transaction (or statement) ends.
    pub async fn set_pool_mode(&self, mode: PoolMode) -> Result<(), TestingError> {
        let ini = self.dir.path().join("pgbouncer.ini");
        let text =
            fs::read_to_string(&ini).map_err(io_err(format!("reading {}", ini.display())))?;
        let text = text
            .lines()
            .map(|l| {
                if l.starts_with("pool_mode =") {
                    format!("pool_mode = {}", mode.as_str())
                } else {
                    l.to_owned()
                }
            })
            .collect::<Vec<_>>()
            .join("\n");
        fs::write(&ini, text + "\n").map_err(io_err(format!("writing {}", ini.display())))?;
        let mut admin = self.config.clone();
        admin.dbname("pgbouncer");
        let console = connect_config(&admin).await?;
        console.simple_query("RELOAD").await?;
        Ok(())
    }

    /// The end of PgBouncer's log.
    pub fn log_tail(&self, lines: usize) -> String {
        bouncer_log_tail(self.dir.path(), lines)
    }

    /// A `deadpool_postgres::Pool` of at most `max_size` connections through
    /// PgBouncer (`RecyclingMethod::Fast`, `Runtime::Tokio1`). Do not use
    /// `prepare_cached` on it: prepared statements do not survive transaction
    /// pooling.
    pub fn deadpool(&self, max_size: usize) -> Result<Pool, TestingError> {
        crate::deadpool(self.config.clone(), max_size)
    }

    /// A client through PgBouncer, outside any pool; its connection task is
    /// spawned on the current Tokio runtime.
    pub async fn connect(&self) -> Result<Client, TestingError> {
        connect_config(&self.config).await
    }
}

fn bouncer_log_tail(root: &Path, lines: usize) -> String {
    process::log_tail(
        &[root.join("pgbouncer.stderr"), root.join("pgbouncer.log")],
        lines,
    )
}

/// Quotes a value for PgBouncer's connection strings when it needs quoting.
fn bq(v: &str) -> String {
    if !v.is_empty()
        && !v
            .chars()
            .any(|c| c.is_whitespace() || c == '\'' || c == '\\' || c == '"' || c == '=')
    {
        v.to_owned()
    } else {
        format!("'{}'", v.replace('\'', "''"))
    }
}

fn write_files(
    root: &Path,
    target: &Config,
    user: &str,
    dbname: &str,
    port: u16,
    (pool_size, mode): (usize, PoolMode),
    run_as: Option<RunAs>,
) -> Result<(), TestingError> {
    let host = match target.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        Some(Host::Unix(p)) => p.display().to_string(),
        None => "/var/run/postgresql".to_owned(),
    };
    let target_port = target.get_ports().first().copied().unwrap_or(5432);
    let mut db_line = format!(
        "{dbname} = host={} port={target_port} dbname={} user={}",
        bq(&host),
        bq(dbname),
        bq(user)
    );
    if let Some(pw) = target.get_password() {
        db_line.push_str(&format!(" password={}", bq(&String::from_utf8_lossy(pw))));
    }
    let log = root.join("pgbouncer.log");
    let userlist = root.join("userlist.txt");
    let ini = format!(
        "[databases]\n\
         {db_line}\n\
         \n\
         [pgbouncer]\n\
         listen_addr = 127.0.0.1\n\
         listen_port = {port}\n\
         unix_socket_dir =\n\
         auth_type = trust\n\
         auth_file = {userlist}\n\
         pool_mode = {mode}\n\
         default_pool_size = {pool_size}\n\
         min_pool_size = 0\n\
         reserve_pool_size = 0\n\
         max_client_conn = 200\n\
         ignore_startup_parameters = extra_float_digits,options\n\
         logfile = {log}\n\
         admin_users = {user}\n",
        userlist = userlist.display(),
        log = log.display(),
        mode = mode.as_str(),
    );
    let ini_path = root.join("pgbouncer.ini");
    fs::write(&ini_path, ini).map_err(io_err(format!("writing {}", ini_path.display())))?;
    let quoted_user = user.replace('"', "\"\"");
    fs::write(&userlist, format!("\"{quoted_user}\" \"\"\n"))
        .map_err(io_err(format!("writing {}", userlist.display())))?;
    for p in [root, ini_path.as_path(), userlist.as_path()] {
        process::chown(p, run_as)?;
    }
    Ok(())
}

fn wait_ready(
    child: &mut Child,
    root: &Path,
    port: u16,
    user: &str,
    db: &str,
) -> Result<(), (TestingError, bool)> {
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let log_tail = bouncer_log_tail(root, 40);
            let retry = log_tail.contains("in use");
            return Err((
                TestingError::Startup {
                    program: "pgbouncer".to_owned(),
                    reason: format!("exited with {status}"),
                    log_tail,
                },
                retry,
            ));
        }
        let last = match TcpStream::connect_timeout(
            &(Ipv4Addr::LOCALHOST, port).into(),
            Duration::from_secs(2),
        )
        .and_then(|s| {
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            s.set_write_timeout(Some(Duration::from_secs(5)))?;
            process::probe(s, user, db)
        }) {
            Ok(Probe::Ready) => return Ok(()),
            Ok(Probe::NotReady(m)) => m,
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            return Err((
                TestingError::Startup {
                    program: "pgbouncer".to_owned(),
                    reason: format!(
                        "not accepting connections after {STARTUP_TIMEOUT:?} (last: {last})"
                    ),
                    log_tail: bouncer_log_tail(root, 40),
                },
                false,
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
