//! Tests of the replication [`Cluster`]: streaming, a crash of the primary,
//! promotion, the multi-host connection string, paused WAL shipping,
//! synchronous commits, clean-up.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;
use std::time::Duration;

use pgwarden_testing::{eventually, within, Cluster, Replication};
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, Config, NoTls};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

const STEP: Duration = Duration::from_secs(30);

async fn connect(config: &Config) -> std::result::Result<Client, tokio_postgres::Error> {
    let (client, conn) = config.connect(NoTls).await?;
    tokio::spawn(conn);
    Ok(client)
}

async fn port_of(client: &Client) -> Result<u16> {
    let port: i32 = client
        .query_one("SELECT inet_server_port()", &[])
        .await?
        .get(0);
    Ok(u16::try_from(port)?)
}

async fn values(client: &Client) -> Result<Vec<String>> {
    let rows = client.query("SELECT v FROM t ORDER BY v", &[]).await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Whether `pid` is alive and still a server of `dir`.
fn alive(pid: u32, dir: &Path) -> bool {
    match std::fs::read(format!("/proc/{pid}/cmdline")) {
        Ok(cmdline) => {
            let needle = dir.as_os_str().as_encoded_bytes();
            cmdline.windows(needle.len()).any(|w| w == needle)
        }
        Err(_) => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_streams_then_takes_over_after_a_crash() -> Result {
    let mut cluster = within(STEP, "cluster start", Cluster::start()).await?;
    assert_eq!(cluster.replication(), Replication::Asynchronous);
    let [n0, n1] = cluster.nodes();
    assert_eq!((n0.label(), n1.label()), ("node0", "node1"));
    assert_ne!(n0.port(), n1.port());
    assert_eq!(cluster.primary().label(), "node0");
    let dirs: Vec<PathBuf> = [n0, n1].iter().map(|n| n.dir().to_path_buf()).collect();
    let pids: Vec<u32> = [n0, n1].iter().map(|n| n.pid().unwrap()).collect();

    let db = cluster.create_database().await?;
    let primary = cluster.primary().connect(&db).await?;
    primary
        .batch_execute("CREATE TABLE t (v text PRIMARY KEY); INSERT INTO t VALUES ('before')")
        .await?;
    cluster.wait_replayed().await?;

    // The replica has it, reads it, refuses writes.
    let replica = cluster.replica().connect(&db).await?;
    assert_eq!(values(&replica).await?, ["before"]);
    let in_recovery: bool = replica
        .query_one("SELECT pg_is_in_recovery()", &[])
        .await?
        .get(0);
    assert!(in_recovery);
    let refused = replica
        .batch_execute("INSERT INTO t VALUES ('x')")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Some(&SqlState::READ_ONLY_SQL_TRANSACTION));
    let streaming: String = primary
        .query_one("SELECT application_name FROM pg_stat_replication", &[])
        .await?
        .get(0);
    assert_eq!(streaming, "node1");

    // The multi-host string finds the writable server, both as a Config and
    // parsed back from the URL.
    let url = cluster.multi_host_url(&db);
    assert!(url.contains("target_session_attrs=read-write"), "{url}");
    let multi = connect(&cluster.multi_host_config(&db)).await?;
    assert_eq!(port_of(&multi).await?, n0.port());
    let parsed = connect(&Config::from_str(&url)?).await?;
    assert_eq!(port_of(&parsed).await?, n0.port());

    // A crash: open clients see their connection end, nothing answers on the
    // old port, and with the replica still read-only no host qualifies.
    within(STEP, "immediate stop", cluster.stop_primary_immediate()).await?;
    let [n0, _] = cluster.nodes();
    assert!(!n0.is_running() && n0.pid().is_none());
    assert!(!alive(pids[0], &dirs[0]));
    eventually(STEP, "the primary's clients see the end", || async {
        primary.simple_query("SELECT 1").await.is_err()
    })
    .await;
    assert!(cluster.nodes()[0].connect(&db).await.is_err());
    assert!(connect(&cluster.multi_host_config(&db)).await.is_err());

    // Promotion: the replica takes writes and keeps what it had.
    let took = within(STEP, "promotion", cluster.promote_replica()).await?;
    assert!(took < STEP);
    assert_eq!(cluster.primary().label(), "node1");
    assert_eq!(cluster.replica().label(), "node0");
    let multi = connect(&cluster.multi_host_config(&db)).await?;
    assert_eq!(port_of(&multi).await?, cluster.primary().port());
    multi
        .batch_execute("INSERT INTO t VALUES ('after')")
        .await?;
    assert_eq!(values(&multi).await?, ["after", "before"]);
    // No replica any more: nothing to wait for, and saying so at once.
    let fresh = cluster.create_database().await?;
    cluster.primary().connect(&fresh).await?;
    let err = cluster.wait_replayed().await.unwrap_err();
    assert!(err.to_string().contains("node0 is stopped"), "{err}");

    // Dropped: both servers stop and their directories go.
    drop((primary, replica, multi, parsed));
    drop(cluster);
    for (pid, dir) in pids.iter().zip(&dirs) {
        assert!(!alive(*pid, dir), "server {pid} still runs");
        assert!(!dir.exists(), "{} still exists", dir.display());
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_streaming_loses_the_unshipped_tail() -> Result {
    let mut cluster = within(STEP, "cluster start", Cluster::start()).await?;
    let db = cluster.create_database().await?;
    let primary = cluster.primary().connect(&db).await?;
    primary
        .batch_execute("CREATE TABLE t (v text PRIMARY KEY)")
        .await?;
    cluster.wait_replayed().await?;
    let replica = cluster.replica().connect(&db).await?;

    // Paused: the primary commits, the replica does not see it.
    cluster.pause_streaming().await?;
    primary
        .batch_execute("INSERT INTO t VALUES ('caught up')")
        .await?;
    let receivers: i64 = replica
        .query_one("SELECT count(*) FROM pg_stat_wal_receiver", &[])
        .await?
        .get(0);
    assert_eq!(receivers, 0);
    assert!(values(&replica).await?.is_empty());

    // Resumed: it catches up.
    cluster.resume_streaming().await?;
    cluster.wait_replayed().await?;
    assert_eq!(values(&replica).await?, ["caught up"]);

    // Paused again, a commit, a crash, a promotion: the tail is gone.
    cluster.pause_streaming().await?;
    primary
        .batch_execute("INSERT INTO t VALUES ('tail')")
        .await?;
    assert_eq!(values(&primary).await?, ["caught up", "tail"]);
    cluster.stop_primary_immediate().await?;
    cluster.promote_replica().await?;
    let promoted = cluster.primary().connect(&db).await?;
    assert_eq!(values(&promoted).await?, ["caught up"]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synchronous_commits_wait_for_the_replica() -> Result {
    let mut cluster = within(
        STEP,
        "cluster start",
        Cluster::start_with(Replication::Synchronous),
    )
    .await?;
    assert_eq!(cluster.replication(), Replication::Synchronous);
    let db = cluster.create_database().await?;
    let primary = cluster.primary().connect(&db).await?;
    let watcher = cluster.primary().connect(&db).await?;
    let sync: String = primary
        .query_one("SELECT sync_state FROM pg_stat_replication", &[])
        .await?
        .get(0);
    assert_eq!(sync, "sync");
    primary
        .batch_execute("CREATE TABLE t (v text PRIMARY KEY)")
        .await?;

    // Without the replica, a commit cannot be acknowledged...
    cluster.pause_streaming().await?;
    let waiting = tokio::spawn(async move {
        primary
            .batch_execute("INSERT INTO t VALUES ('waited')")
            .await
    });
    // Committed locally, it waits for the standby's acknowledgement.
    eventually(STEP, "the commit waits on SyncRep", || async {
        watcher
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 1
    })
    .await;
    assert!(
        !waiting.is_finished(),
        "a synchronous commit returned with no standby"
    );
    // ...until it streams again.
    cluster.resume_streaming().await?;
    within(STEP, "the waiting commit", waiting).await??;
    cluster.wait_replayed().await?;
    let replica = cluster.replica().connect(&db).await?;
    assert_eq!(values(&replica).await?, ["waited"]);

    // The promoted server is not synchronous itself: with nothing to wait
    // for, its commits return.
    cluster.stop_primary_immediate().await?;
    cluster.promote_replica().await?;
    let promoted = cluster.primary().connect(&db).await?;
    within(
        Duration::from_secs(5),
        "a commit on the promoted server",
        promoted.batch_execute("INSERT INTO t VALUES ('after')"),
    )
    .await?;
    Ok(())
}

const CHILD_ENV: &str = "PGWARDEN_CLUSTER_WATCHDOG_CHILD";

/// Not a test of its own: the body of the child process of
/// `watchdogs_stop_both_servers_when_the_process_aborts`. Does nothing
/// unless `CHILD_ENV` is set.
#[test]
fn cluster_watchdog_child_helper() {
    if std::env::var(CHILD_ENV).is_err() {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let cluster = match rt.block_on(Cluster::start()) {
        Ok(c) => c,
        Err(e) => {
            println!("PGWARDEN_CHILD error={e}");
            std::process::exit(3);
        }
    };
    for node in cluster.nodes() {
        println!(
            "PGWARDEN_CHILD pid={} dir={}",
            node.pid().unwrap_or(0),
            node.dir().display()
        );
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
    // No destructors, no unwinding: only the watchdogs can clean up.
    std::process::abort();
}

#[tokio::test]
async fn watchdogs_stop_both_servers_when_the_process_aborts() -> Result {
    let out = Command::new(std::env::current_exe()?)
        .args([
            "cluster::cluster_watchdog_child_helper",
            "--exact",
            "--nocapture",
        ])
        .args(["--test-threads", "1"])
        .env(CHILD_ENV, "1")
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let servers: Vec<(u32, PathBuf)> = stdout
        .lines()
        .filter_map(|l| l.split_once("PGWARDEN_CHILD pid=").map(|(_, rest)| rest))
        .filter_map(|rest| {
            let (pid, dir) = rest.split_once(" dir=")?;
            Some((pid.parse().ok()?, PathBuf::from(dir)))
        })
        .collect();
    assert_eq!(
        servers.len(),
        2,
        "child reported no servers: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success());
    for (pid, dir) in servers {
        assert_ne!(pid, 0);
        eventually(
            STEP,
            "a watchdog stopped its server and removed its directory",
            || {
                let dir = dir.clone();
                async move { !alive(pid, &dir) && !dir.exists() }
            },
        )
        .await;
    }
    Ok(())
}
