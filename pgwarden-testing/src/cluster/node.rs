//! [`Node`]: one server of a replication [`Cluster`](crate::Cluster): its
//! own directory, port, watchdog and `postgres` process.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use tokio_postgres::{Client, Config};

use super::Replication;
use crate::db::{config_to_url, connect_config};
use crate::process::{self, io_err, PgBinaries, RunAs, Watchdog};
use crate::server::{initdb, server_log_tail, wait_ready};
use crate::{TestingError, CONNECT_TIMEOUT};

/// The address every node listens on.
const HOST: &str = "127.0.0.1";
/// How long `pg_basebackup` and `pg_ctl` may take.
const TOOL_TIMEOUT: Duration = Duration::from_secs(120);

/// One PostgreSQL server of a [`Cluster`](crate::Cluster): the primary or
/// its streaming replica.
///
/// It listens on `127.0.0.1:<port>` and on a Unix socket in its temporary
/// directory, runs as the `postgres` user when the tests run as root, and
/// is stopped (its directory removed) when the cluster is dropped or, failing
/// that, by its watchdog when the test process ends.
#[derive(Debug)]
pub struct Node {
    label: &'static str,
    port: u16,
    /// `None` once stopped (and reaped).
    postgres: Option<Child>,
    watchdog: Watchdog,
    bins: PgBinaries,
    run_as: Option<RunAs>,
    // Dropped (removed) after `Drop::drop` stopped the server.
    dir: tempfile::TempDir,
}

impl Drop for Node {
    fn drop(&mut self) {
        // First the watchdog, so it cannot signal a pid we are about to reap.
        self.watchdog.disarm();
        if let Some(mut postgres) = self.postgres.take() {
            // SIGINT: fast shutdown, for a primary and a standby alike.
            process::stop_child(&mut postgres, libc::SIGINT);
        }
    }
}

impl Node {
    /// `initdb`, then starts the server as a primary.
    pub(super) fn init_primary(
        bins: &PgBinaries,
        run_as: Option<RunAs>,
        replication: Replication,
    ) -> Result<Node, TestingError> {
        let (dir, watchdog) = new_dir(run_as)?;
        let data = dir.path().join("data");
        initdb(bins, run_as, dir.path(), &data)?;
        allow_replication(&data)?;
        let sync = match replication {
            Replication::Asynchronous => None,
            // Any standby: the cluster has one.
            Replication::Synchronous => Some("synchronous_standby_names=*"),
        };
        Node::start("node0", bins, run_as, dir, watchdog, sync)
    }

    /// A base backup of `primary` (`pg_basebackup -R`: `standby.signal` and
    /// `primary_conninfo` written), started as its streaming replica.
    pub(super) fn clone_replica(primary: &Node) -> Result<Node, TestingError> {
        let (bins, run_as) = (&primary.bins, primary.run_as);
        let (dir, watchdog) = new_dir(run_as)?;
        let log = dir.path().join("pg_basebackup.log");
        let (out, err) = process::log_file(&log)?;
        let program = tool(bins, "pg_basebackup")?;
        let mut child = process::server_command(&program, run_as, dir.path())
            .arg("-D")
            .arg(dir.path().join("data"))
            .args(["-R", "-X", "stream", "-c", "fast", "-U", "postgres"])
            // Throwaway data: no fsync of the copy (≈3 s saved on a busy
            // disk), no manifest to checksum.
            .args(["--no-sync", "--no-manifest"])
            .args(["-h", HOST, "-p"])
            .arg(primary.port.to_string())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(io_err(format!("spawning {}", program.display())))?;
        finish(&mut child, "pg_basebackup", &log)?;
        Node::start("node1", bins, run_as, dir, watchdog, None)
    }

    fn start(
        label: &'static str,
        bins: &PgBinaries,
        run_as: Option<RunAs>,
        dir: tempfile::TempDir,
        mut watchdog: Watchdog,
        extra: Option<&str>,
    ) -> Result<Node, TestingError> {
        let root = dir.path().to_path_buf();
        let data = root.join("data");
        let spawn = |port: u16| {
            let (out, err) = process::log_file(&root.join("postmaster.log"))?;
            let mut cmd = process::server_command(&bins.postgres, run_as, &root);
            cmd.arg("-D").arg(&data).arg("-k").arg(&root);
            cmd.arg("-p").arg(port.to_string());
            let settings = [
                format!("listen_addresses={HOST}"),
                // A process crash (`-m immediate`) loses nothing fsync would
                // keep; synchronous_commit stays on: an acknowledged commit
                // is in the WAL the replica receives.
                "fsync=off".to_owned(),
                "max_connections=200".to_owned(),
                "logging_collector=on".to_owned(),
                format!("log_directory={}", root.join("log").display()),
                format!("cluster_name={label}"),
                "wal_level=replica".to_owned(),
                "max_wal_senders=8".to_owned(),
                // A paused replica catches up from the primary's pg_wal.
                "wal_keep_size=256MB".to_owned(),
                "hot_standby=on".to_owned(),
            ];
            for setting in settings.iter().map(String::as_str).chain(extra) {
                cmd.arg("-c").arg(setting);
            }
            cmd.stdout(out)
                .stderr(err)
                .spawn()
                .map_err(io_err(format!("spawning {}", bins.postgres.display())))
        };
        let ready = |child: &mut Child, port| wait_ready(child, &root, port);
        let (postgres, port) =
            process::start_on_free_port("postgres", &mut watchdog, spawn, ready)?;
        Ok(Node {
            label,
            port,
            postgres: Some(postgres),
            watchdog,
            bins: bins.clone(),
            run_as,
            dir,
        })
    }

    /// Takes the server process out of the node, to be stopped with
    /// [`ImmediateStop::run`] (blocking) on another thread; `None` when it
    /// is stopped already. From here on the node counts as stopped.
    pub(super) fn immediate_stop(&mut self) -> Option<ImmediateStop> {
        Some(ImmediateStop {
            postgres: self.postgres.take()?,
            pg_ctl: tool(&self.bins, "pg_ctl"),
            run_as: self.run_as,
            root: self.dir.path().to_path_buf(),
        })
    }

    /// Its name in the cluster: `node0` (started as the primary) or `node1`
    /// (started as the replica). Also its `cluster_name`, which the replica
    /// reports as `application_name` in the primary's `pg_stat_replication`.
    pub fn label(&self) -> &'static str {
        self.label
    }

    /// The TCP host it listens on: `127.0.0.1`.
    pub fn host(&self) -> &'static str {
        HOST
    }

    /// Its TCP port (also the name of its Unix socket, `.s.PGSQL.<port>`, in
    /// [`Node::dir`]).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The postmaster's pid; `None` once stopped.
    pub fn pid(&self) -> Option<u32> {
        self.postgres.as_ref().map(Child::id)
    }

    /// Whether its server runs (it was not stopped).
    pub fn is_running(&self) -> bool {
        self.postgres.is_some()
    }

    /// Its temporary directory: data in `data/`, logs in `log/` and
    /// `postmaster.log`, the Unix socket. Removed when the cluster is dropped.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Its data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Connection settings for database `dbname` on this node alone, over
    /// TCP, as user `postgres`.
    pub fn pg_config(&self, dbname: &str) -> Config {
        let mut config = Config::new();
        config
            .host(HOST)
            .port(self.port)
            .user("postgres")
            .dbname(dbname)
            .connect_timeout(CONNECT_TIMEOUT);
        config
    }

    /// The same settings as a `key=value` connection string.
    pub fn url(&self, dbname: &str) -> String {
        config_to_url(&self.pg_config(dbname))
    }

    /// A client on database `dbname` of this node; its connection task is
    /// spawned on the current Tokio runtime.
    pub async fn connect(&self, dbname: &str) -> Result<Client, TestingError> {
        connect_config(&self.pg_config(dbname)).await
    }

    /// The end of its logs (the postmaster's stderr and the logging
    /// collector's files).
    pub fn log_tail(&self, lines: usize) -> String {
        server_log_tail(self.dir.path(), lines)
    }
}

/// A server being stopped with `pg_ctl stop -m immediate`.
pub(super) struct ImmediateStop {
    postgres: Child,
    pg_ctl: Result<PathBuf, TestingError>,
    run_as: Option<RunAs>,
    root: PathBuf,
}

impl ImmediateStop {
    /// `pg_ctl stop -m immediate`: the postmaster and every backend quit at
    /// once, without a shutdown checkpoint, as in a crash. Blocks until the
    /// process is gone (about 0.1 s; pg_ctl may take up to 2 min).
    pub(super) fn run(mut self) -> Result<(), TestingError> {
        let log = self.root.join("pg_ctl.log");
        let stopped = self.pg_ctl.clone().and_then(|program| {
            let (out, err) = process::log_file(&log)?;
            let mut child = process::server_command(&program, self.run_as, &self.root)
                .arg("stop")
                .arg("-D")
                .arg(self.root.join("data"))
                .args(["-m", "immediate", "-w", "-t", "60"])
                .stdout(out)
                .stderr(err)
                .spawn()
                .map_err(io_err(format!("spawning {}", program.display())))?;
            finish(&mut child, "pg_ctl stop -m immediate", &log)
        });
        // Whatever pg_ctl said, the server is gone before this returns
        // (SIGQUIT is what pg_ctl sends for an immediate stop); reaped.
        process::stop_child(&mut self.postgres, libc::SIGQUIT);
        stopped
    }
}

/// Lets the replica (and `pg_basebackup`) connect for replication, over the
/// Unix socket and local TCP, without a password. `initdb -A trust` writes
/// these lines too; they are stated here rather than relied upon.
fn allow_replication(data: &Path) -> Result<(), TestingError> {
    use std::io::Write as _;
    let path = data.join("pg_hba.conf");
    std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .and_then(|mut f| {
            f.write_all(
                b"\n# pgwarden-testing: the replica's WAL stream\n\
                  local   replication   all                  trust\n\
                  host    replication   all   127.0.0.1/32   trust\n",
            )
        })
        .map_err(io_err(format!("adding replication to {}", path.display())))
}

/// A fresh directory for a node, owned by the server user, and its watchdog.
fn new_dir(run_as: Option<RunAs>) -> Result<(tempfile::TempDir, Watchdog), TestingError> {
    let dir = process::temp_dir("pgwarden-pg-", run_as)?;
    // Armed with the pid once started; until then it only removes the directory.
    let watchdog = Watchdog::spawn(dir.path(), "INT")?;
    process::chown(dir.path(), run_as)?;
    Ok((dir, watchdog))
}

/// A tool of the same installation as `postgres` (`pg_ctl`,
/// `pg_basebackup`): next to the binary `postgres` resolves to (it may be a
/// symbolic link, as in `/usr/local/bin`), next to the link, or wherever
/// [`find_tool`](crate::find_tool) finds it.
fn tool(bins: &PgBinaries, name: &str) -> Result<PathBuf, TestingError> {
    let real = std::fs::canonicalize(&bins.postgres).ok();
    // Returned as it is: on edition 2024 the tail's temporaries (the
    // iterator borrowing `real`) are dropped before `real`.
    real.iter()
        .chain([&bins.postgres])
        .map(|p| p.with_file_name(name))
        .find(|p| p.is_file())
        .or_else(|| process::find_tool(name))
        .ok_or_else(|| TestingError::Cluster {
            step: name.to_owned(),
            reason: format!(
                "{name} not found next to {} nor on PATH; install the Debian package \
                 postgresql (apt-get install -y postgresql)",
                bins.postgres.display()
            ),
        })
}

/// Waits for a tool to exit successfully, within [`TOOL_TIMEOUT`].
fn finish(child: &mut Child, step: &str, log: &Path) -> Result<(), TestingError> {
    let failed = |reason: String| TestingError::Cluster {
        step: step.to_owned(),
        reason: format!(
            "{reason}\n--- log tail ---\n{}",
            process::log_tail(&[log.to_path_buf()], 40)
        ),
    };
    if !process::wait_for_exit(child, TOOL_TIMEOUT) {
        process::stop_child(child, libc::SIGTERM);
        return Err(failed(format!("did not finish within {TOOL_TIMEOUT:?}")));
    }
    match child.wait() {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(failed(format!("exited with {s}"))),
        Err(e) => Err(io_err(format!("waiting for {step}"))(e)),
    }
}
