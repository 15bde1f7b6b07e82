//! [`Cluster`]: a throwaway primary and its streaming replica, for failover
//! tests: crash the primary, promote the replica, stop WAL shipping.

use std::fmt;
use std::future::Future;
use std::time::{Duration, Instant};

use tokio_postgres::config::TargetSessionAttrs;
use tokio_postgres::{Client, Config};

use crate::db::config_to_url;
use crate::process;
use crate::{TestingError, STARTUP_TIMEOUT};

mod node;

pub use node::Node;

/// How long the cluster's own waits (replay, promotion, streaming) may take.
const WAIT_LIMIT: Duration = Duration::from_secs(30);
/// How often those waits look.
const POLL: Duration = Duration::from_millis(10);
/// The connect timeout of [`Cluster::multi_host_config`], per host.
const MULTI_HOST_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// How the primary commits with respect to its replica.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Replication {
    /// A commit returns once the primary flushed its WAL; the replica
    /// follows when it can (PostgreSQL's default). A primary that crashes
    /// can take acknowledged commits with it.
    Asynchronous,
    /// `synchronous_standby_names = '*'` on the primary (with
    /// `synchronous_commit = on`): a commit returns once the replica has
    /// flushed its WAL, so every acknowledged commit survives the primary.
    /// While the replica does not stream, commits on the primary wait.
    Synchronous,
}

/// A throwaway primary and its streaming replica (`pg_basebackup -R`), each
/// on its own port on `127.0.0.1`, for failover tests.
///
/// Always started locally (`DATABASE_URL` is ignored: a failover needs
/// servers of the test's own). Both servers run as the `postgres` user when
/// the tests run as root, with `wal_level = replica`, `hot_standby = on` and
/// `fsync = off` (a crash here is a process crash, not a power cut);
/// `synchronous_commit` stays on. Dropping the cluster stops both and
/// removes their directories; each has a watchdog that does so when the test
/// process ends in any other way.
///
/// [`Cluster::primary`] is the server that takes writes: the one started as
/// primary, and after [`Cluster::promote_replica`] the promoted one.
/// [`Cluster::nodes`] keeps the start order (`node0`, `node1`), which is the
/// host order of [`Cluster::multi_host_config`].
///
/// ```no_run
/// # async fn t() -> Result<(), Box<dyn std::error::Error>> {
/// use pgwarden_testing::Cluster;
/// let mut cluster = Cluster::start().await?;
/// let db = cluster.create_database().await?; // created on the primary, replayed on the replica
/// let url = cluster.multi_host_url(&db); // host=127.0.0.1,127.0.0.1 port=…,… target_session_attrs=read-write
/// cluster.stop_primary_immediate().await?; // pg_ctl stop -m immediate
/// cluster.promote_replica().await?; // returns once pg_is_in_recovery() is false
/// let client = cluster.primary().connect(&db).await?; // the promoted server
/// client.batch_execute("CREATE TABLE t (x int)").await?;
/// # let _ = url; Ok(()) }
/// ```
pub struct Cluster {
    /// In start order: `node0` started as the primary, `node1` as the replica.
    nodes: [Node; 2],
    /// Index of the server that takes writes.
    primary: usize,
    replication: Replication,
    /// The replica's `primary_conninfo` while streaming is paused.
    paused_conninfo: Option<String>,
}

impl Cluster {
    /// Starts a primary and an asynchronous streaming replica; returns once
    /// the replica streams. Takes a few seconds (`initdb`, two starts, a base
    /// backup).
    pub async fn start() -> Result<Cluster, TestingError> {
        Cluster::start_with(Replication::Asynchronous).await
    }

    /// Starts a primary and a streaming replica, replicating as asked.
    pub async fn start_with(replication: Replication) -> Result<Cluster, TestingError> {
        let nodes = tokio::task::spawn_blocking(move || {
            let bins = process::find_pg_binaries()?;
            let run_as = process::run_as()?;
            let primary = node::Node::init_primary(&bins, run_as, replication)?;
            let replica = node::Node::clone_replica(&primary)?;
            Ok::<_, TestingError>([primary, replica])
        })
        .await
        .map_err(|e| failed("starting the servers", e.to_string()))??;
        let cluster = Cluster {
            nodes,
            primary: 0,
            replication,
            paused_conninfo: None,
        };
        cluster.wait_streaming(STARTUP_TIMEOUT).await?;
        Ok(cluster)
    }

    /// How the primary replicates.
    pub fn replication(&self) -> Replication {
        self.replication
    }

    /// The server that takes writes: the one started as primary, or, after
    /// [`Cluster::promote_replica`], the promoted one.
    pub fn primary(&self) -> &Node {
        &self.nodes[self.primary]
    }

    /// The other server: the replica, or after a promotion the old primary.
    pub fn replica(&self) -> &Node {
        &self.nodes[1 - self.primary]
    }

    /// Both servers in start order (`node0`, `node1`): the host order of
    /// [`Cluster::multi_host_config`].
    pub fn nodes(&self) -> [&Node; 2] {
        [&self.nodes[0], &self.nodes[1]]
    }

    /// Connection settings naming both servers, for a client that must find
    /// the primary by itself: `host=127.0.0.1,127.0.0.1 port=<node0>,<node1>
    /// target_session_attrs=read-write`, user `postgres`, database `dbname`,
    /// a 2 s connect timeout per host. tokio-postgres tries the hosts in
    /// order and keeps the first that accepts writes.
    pub fn multi_host_config(&self, dbname: &str) -> Config {
        let mut config = Config::new();
        for node in &self.nodes {
            config.host(node.host()).port(node.port());
        }
        config
            .user("postgres")
            .dbname(dbname)
            .target_session_attrs(TargetSessionAttrs::ReadWrite)
            .connect_timeout(MULTI_HOST_CONNECT_TIMEOUT);
        config
    }

    /// [`Cluster::multi_host_config`] as a `key=value` connection string
    /// (which libpq parses too).
    pub fn multi_host_url(&self, dbname: &str) -> String {
        format!(
            "{} target_session_attrs=read-write",
            config_to_url(&self.multi_host_config(dbname))
        )
    }

    /// Creates a fresh, uniquely named database on the primary and returns
    /// its name once the replica has replayed its creation (when there is
    /// one running: after a failover the old primary is stopped).
    pub async fn create_database(&self) -> Result<String, TestingError> {
        let name = format!("pgwarden_failover_{:016x}", rand::random::<u64>());
        let admin = self.primary().connect("postgres").await?;
        admin
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .await?;
        if self.replica().is_running() {
            self.wait_replayed().await?;
        }
        Ok(name)
    }

    /// Waits (up to 30 s) until the replica has replayed everything the
    /// primary has written so far: `pg_last_wal_replay_lsn()` on the replica
    /// at or past the primary's `pg_current_wal_lsn()`. Fails at once when
    /// the replica is stopped, and after the 30 s when it is not a standby.
    pub async fn wait_replayed(&self) -> Result<(), TestingError> {
        if !self.replica().is_running() {
            return Err(self.failed(
                "waiting for replay",
                &format!("{} is stopped: there is no replica", self.replica().label()),
            ));
        }
        let primary = self.primary().connect("postgres").await?;
        let lsn: String = primary
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await?
            .get(0);
        let replica = self.replica().connect("postgres").await?;
        let what = format!("the replica replaying up to {lsn}");
        self.poll(&what, WAIT_LIMIT, || async {
            let row = replica
                .query_one(
                    "SELECT coalesce(pg_last_wal_replay_lsn() >= $1::text::pg_lsn, false)",
                    &[&lsn],
                )
                .await?;
            Ok(row.get::<_, bool>(0))
        })
        .await
    }

    /// Stops the primary as a crash would: `pg_ctl stop -m immediate` (no
    /// shutdown checkpoint, every backend quits at once, clients see their
    /// connections drop). Returns once its processes are gone. Does nothing
    /// when it is stopped already.
    pub async fn stop_primary_immediate(&mut self) -> Result<(), TestingError> {
        let Some(stop) = self.nodes[self.primary].immediate_stop() else {
            return Ok(());
        };
        tokio::task::spawn_blocking(move || stop.run())
            .await
            .map_err(|e| failed("pg_ctl stop -m immediate", e.to_string()))?
    }

    /// Promotes the replica (`pg_promote(wait => true)`, which waits up to
    /// 30 s), and returns once it answers `pg_is_in_recovery() = false`
    /// (another 30 s at most), with how long that took. From then on [`Cluster::primary`] is the promoted
    /// server and [`Cluster::replica`] the old primary.
    ///
    /// The old primary is not touched: stop it first
    /// ([`Cluster::stop_primary_immediate`]) unless the test wants two
    /// primaries.
    pub async fn promote_replica(&mut self) -> Result<Duration, TestingError> {
        let started = Instant::now();
        let replica = self.replica().connect("postgres").await?;
        let promoted: bool = replica
            .query_one("SELECT pg_promote(true, 30)", &[])
            .await?
            .get(0);
        if !promoted {
            return Err(self.failed("promotion", "pg_promote(true, 30) returned false"));
        }
        self.poll(
            "the promoted server leaving recovery",
            WAIT_LIMIT,
            || async {
                let row = replica.query_one("SELECT pg_is_in_recovery()", &[]).await?;
                Ok(!row.get::<_, bool>(0))
            },
        )
        .await?;
        self.primary = 1 - self.primary;
        Ok(started.elapsed())
    }

    /// Stops WAL shipping: the replica's `primary_conninfo` is emptied
    /// (`ALTER SYSTEM`, reload), its WAL receiver stops, and it stays at
    /// what it has received. Returns once the primary lists no WAL sender.
    /// The replica keeps serving reads; writes on the primary go on (and,
    /// with [`Replication::Synchronous`], their commits wait).
    ///
    /// What the primary writes from now on is lost if it crashes before
    /// [`Cluster::resume_streaming`]: the construction of a lost tail.
    /// (Pausing replay with `pg_wal_replay_pause()` loses nothing: a
    /// promotion replays all the WAL the replica received.)
    pub async fn pause_streaming(&mut self) -> Result<(), TestingError> {
        if self.paused_conninfo.is_some() {
            return Ok(());
        }
        let replica = self.replica().connect("postgres").await?;
        let conninfo: String = replica
            .query_one("SELECT current_setting('primary_conninfo')", &[])
            .await?
            .get(0);
        set_conninfo(&replica, "").await?;
        self.paused_conninfo = Some(conninfo);
        self.poll("the replica's WAL receiver stopping", WAIT_LIMIT, || {
            count(&replica, "SELECT count(*) FROM pg_stat_wal_receiver")
        })
        .await?;
        if self.primary().is_running() {
            let primary = self.primary().connect("postgres").await?;
            self.poll("the primary's WAL sender stopping", WAIT_LIMIT, || {
                count(&primary, "SELECT count(*) FROM pg_stat_replication")
            })
            .await?;
        }
        Ok(())
    }

    /// Restores the replica's `primary_conninfo` after
    /// [`Cluster::pause_streaming`]; returns once it streams again.
    pub async fn resume_streaming(&mut self) -> Result<(), TestingError> {
        let Some(conninfo) = self.paused_conninfo.clone() else {
            return Ok(());
        };
        let replica = self.replica().connect("postgres").await?;
        set_conninfo(&replica, &conninfo).await?;
        self.paused_conninfo = None;
        self.wait_streaming(WAIT_LIMIT).await
    }

    /// Waits until the primary lists the replica as streaming (and, in
    /// synchronous mode, as its synchronous standby).
    async fn wait_streaming(&self, limit: Duration) -> Result<(), TestingError> {
        let primary = self.primary().connect("postgres").await?;
        let sql = match self.replication {
            Replication::Asynchronous => {
                "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
            }
            Replication::Synchronous => {
                "SELECT count(*) FROM pg_stat_replication \
                  WHERE state = 'streaming' AND sync_state = 'sync'"
            }
        };
        self.poll("the replica streaming from the primary", limit, || async {
            Ok(!count(&primary, sql).await?)
        })
        .await
    }

    /// Checks `cond` every 10 ms until it holds, up to `limit`.
    async fn poll<F, Fut>(
        &self,
        what: &str,
        limit: Duration,
        mut cond: F,
    ) -> Result<(), TestingError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<bool, TestingError>>,
    {
        let deadline = Instant::now() + limit;
        loop {
            if cond().await? {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(self.failed(
                    &format!("waiting for {what}"),
                    &format!("not done within {limit:?}"),
                ));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// An error for `step`, with the end of both servers' logs.
    fn failed(&self, step: &str, reason: &str) -> TestingError {
        let mut reason = reason.to_owned();
        for node in &self.nodes {
            reason.push_str(&format!(
                "\n--- {} log tail ---\n{}",
                node.label(),
                node.log_tail(20)
            ));
        }
        failed(step, reason)
    }
}

impl fmt::Debug for Cluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cluster")
            .field("replication", &self.replication)
            .field("primary", &self.primary().label())
            .field("nodes", &self.nodes)
            .field("streaming_paused", &self.paused_conninfo.is_some())
            .finish()
    }
}

fn failed(step: &str, reason: impl Into<String>) -> TestingError {
    TestingError::Cluster {
        step: step.to_owned(),
        reason: reason.into(),
    }
}

/// `true` when `sql` (a `count(*)`) counts zero rows.
async fn count(client: &Client, sql: &str) -> Result<bool, TestingError> {
    let n: i64 = client.query_one(sql, &[]).await?.get(0);
    Ok(n == 0)
}

/// `ALTER SYSTEM SET primary_conninfo` (a literal: ALTER SYSTEM takes no
/// parameters), then a configuration reload.
async fn set_conninfo(replica: &Client, conninfo: &str) -> Result<(), TestingError> {
    let literal = format!("'{}'", conninfo.replace('\'', "''"));
    // One statement per message: ALTER SYSTEM refuses a transaction block,
    // and a multi-statement simple query is one.
    replica
        .batch_execute(&format!("ALTER SYSTEM SET primary_conninfo = {literal}"))
        .await?;
    replica.batch_execute("SELECT pg_reload_conf()").await?;
    Ok(())
}
