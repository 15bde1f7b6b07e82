//! Tests of the throwaway PostgreSQL / PgBouncer harness (`pgwarden_testing`)
//! against real servers.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;
use std::time::Duration;

use pgwarden_testing::{eventually, require_tool, PgBouncer, TestServer};
use tokio_postgres::types::Type;
use tokio_postgres::{Config, NoTls};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

async fn can_connect(config: &Config) -> bool {
    let mut config = config.clone();
    config.connect_timeout(Duration::from_secs(2));
    match config.connect(NoTls).await {
        Ok((client, conn)) => {
            let task = tokio::spawn(conn);
            let ok = client.simple_query("SELECT 1").await.is_ok();
            drop(client);
            let _ = task.await;
            ok
        }
        Err(_) => false,
    }
}

/// Whether the process `pid` is alive and still the server whose command
/// line names `dir` (a zombie's command line is empty).
fn server_process_alive(pid: u32, dir: &Path) -> bool {
    match std::fs::read(format!("/proc/{pid}/cmdline")) {
        Ok(cmdline) => {
            let needle = dir.as_os_str().as_encoded_bytes();
            cmdline.windows(needle.len()).any(|w| w == needle)
        }
        Err(_) => false,
    }
}

#[tokio::test]
async fn shared_server_accepts_queries() -> Result {
    let server = TestServer::shared()?;
    let again = TestServer::shared()?;
    assert!(std::ptr::eq(server, again), "one server per process");
    if !server.is_external() {
        assert!(server.socket_dir().is_some());
        assert!(server.pid().is_some());
    }
    let (client, conn) = server.pg_config().connect(NoTls).await?;
    tokio::spawn(conn);
    let row = client
        .query_one("SELECT current_user::text, 40 + 2", &[])
        .await?;
    let n: i32 = row.get(1);
    assert_eq!(n, 42);
    if !server.is_external() {
        let user: String = row.get(0);
        assert_eq!(user, "postgres");
    }
    Ok(())
}

#[tokio::test]
async fn create_database_gives_distinct_working_databases() -> Result {
    let server = TestServer::shared()?;
    let a = server.create_database().await?;
    let b = server.create_database().await?;
    assert_ne!(a.name(), b.name());

    let ca = a.connect().await?;
    let cb = b.connect().await?;
    let name_a: String = ca
        .query_one("SELECT current_database()::text", &[])
        .await?
        .get(0);
    let name_b: String = cb
        .query_one("SELECT current_database()::text", &[])
        .await?
        .get(0);
    assert_eq!(name_a, a.name());
    assert_eq!(name_b, b.name());

    // A table in one is not in the other.
    ca.batch_execute("CREATE TABLE only_in_a (id int); INSERT INTO only_in_a VALUES (1)")
        .await?;
    let in_b: Option<String> = cb
        .query_one("SELECT to_regclass('only_in_a')::text", &[])
        .await?
        .get(0);
    assert_eq!(in_b, None);

    // url() parses back into a Config that reaches the same database.
    let (via_url, conn) = Config::from_str(&a.url())?.connect(NoTls).await?;
    tokio::spawn(conn);
    let n: i64 = via_url
        .query_one("SELECT count(*) FROM only_in_a", &[])
        .await?
        .get(0);
    assert_eq!(n, 1);

    // deadpool on the database.
    let pool = b.deadpool(2)?;
    let c = pool.get().await?;
    let n: i32 = c.query_one("SELECT 7", &[]).await?.get(0);
    assert_eq!(n, 7);
    drop(c);

    // destroy() drops it.
    drop((ca, via_url));
    let a_name = a.name().to_owned();
    a.destroy().await?;
    let (admin, conn) = server.pg_config().connect(NoTls).await?;
    tokio::spawn(conn);
    let left: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_database WHERE datname = $1",
            &[&a_name],
        )
        .await?
        .get(0);
    assert_eq!(left, 0);
    Ok(())
}

#[tokio::test]
async fn dropping_a_test_server_stops_postgres() -> Result {
    // Always a local server: this is about our own process.
    let server = TestServer::start_local()?;
    assert!(!server.is_external());
    let config = server.pg_config();
    let dir = server.dir().expect("local server has a dir").to_path_buf();
    let pid = server.pid().expect("local server has a pid");
    assert!(can_connect(&config).await);

    // A client left open does not keep the server alive (fast shutdown).
    let (open_client, conn) = config.connect(NoTls).await?;
    tokio::spawn(conn);
    open_client.simple_query("SELECT 1").await?;

    drop(server);

    eventually(Duration::from_secs(10), "socket stops accepting", || {
        let config = config.clone();
        async move { !can_connect(&config).await }
    })
    .await;
    eventually(Duration::from_secs(10), "open client sees the end", || {
        let c = &open_client;
        async move { c.simple_query("SELECT 1").await.is_err() }
    })
    .await;
    eventually(
        Duration::from_secs(10),
        "postgres process and directory gone",
        || {
            let dir = dir.clone();
            async move { !dir.exists() && !server_process_alive(pid, &dir) }
        },
    )
    .await;
    Ok(())
}

const CHILD_ENV: &str = "PGWARDEN_HARNESS_WATCHDOG_CHILD";

/// Not a test of its own: the body of the child process of
/// `watchdog_stops_server_when_process_*`. Does nothing unless `CHILD_ENV` is set.
#[test]
fn watchdog_child_helper() {
    let Ok(how) = std::env::var(CHILD_ENV) else {
        return;
    };
    let server = match TestServer::shared() {
        Ok(s) => s,
        Err(e) => {
            println!("PGWARDEN_CHILD error={e}");
            std::process::exit(3);
        }
    };
    println!(
        "PGWARDEN_CHILD pid={} dir={}",
        server.pid().unwrap_or(0),
        server
            .dir()
            .map(|d| d.display().to_string())
            .unwrap_or_default()
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    match how.as_str() {
        // A crash or SIGKILL: no destructors, no unwinding.
        "abort" => std::process::abort(),
        // A normal exit with the shared server still in its static.
        _ => std::process::exit(0),
    }
}

async fn watchdog_case(how: &str) -> Result {
    let out = Command::new(std::env::current_exe()?)
        .args(["server::watchdog_child_helper", "--exact", "--nocapture"])
        .args(["--test-threads", "1"])
        .env(CHILD_ENV, how)
        .env_remove("DATABASE_URL")
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("PGWARDEN_CHILD ").map(|(_, rest)| rest))
        .unwrap_or_else(|| {
            panic!(
                "no report from the child ({}): {stdout}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
        });
    assert!(!line.starts_with("error="), "child failed: {line}");
    let mut pid = 0u32;
    let mut dir = PathBuf::new();
    for field in line.split(' ') {
        if let Some(v) = field.strip_prefix("pid=") {
            pid = v.parse()?;
        } else if let Some(v) = field.strip_prefix("dir=") {
            dir = PathBuf::from(v);
        }
    }
    assert!(
        pid != 0 && !dir.as_os_str().is_empty(),
        "bad report: {line}"
    );
    assert!(!out.status.success() || how == "exit");

    let socket_dir = dir.clone();
    eventually(
        Duration::from_secs(20),
        "watchdog stopped postgres and removed its directory",
        || {
            let dir = dir.clone();
            async move { !server_process_alive(pid, &dir) && !dir.exists() }
        },
    )
    .await;
    assert!(!socket_dir.exists());
    Ok(())
}

#[tokio::test]
async fn watchdog_stops_server_when_process_exits() -> Result {
    watchdog_case("exit").await
}

#[tokio::test]
async fn watchdog_stops_server_when_process_aborts() -> Result {
    watchdog_case("abort").await
}

#[tokio::test]
async fn pgbouncer_runs_in_transaction_mode() -> Result {
    if !require_tool("pgbouncer")? {
        return Ok(());
    }
    let server = TestServer::shared()?;
    let db = server.create_database().await?;

    // One server connection shared by all clients: transaction pooling makes
    // both clients use the same backend, and session state leaks.
    let bouncer = PgBouncer::start_with_pool_size(server, &db, 1)?;
    let a = bouncer.connect().await?;
    let b = bouncer.connect().await?;

    // query_typed (unnamed statements) works through it.
    let row = a
        .query_typed("SELECT $1::int4 + 1", &[(&41i32, Type::INT4)])
        .await?;
    assert_eq!(row[0].get::<_, i32>(0), 42);

    let step = Duration::from_secs(10); // in session mode, b would wait for a forever
    a.query_typed("SELECT set_config('pgwarden.leak', 'from_a', false)", &[])
        .await?;
    let seen = tokio::time::timeout(
        step,
        b.query_typed("SELECT current_setting('pgwarden.leak', true)", &[]),
    )
    .await??;
    assert_eq!(
        seen[0].get::<_, Option<String>>(0).as_deref(),
        Some("from_a"),
        "client b sees client a's session setting"
    );
    let pid_a: i32 = a.query_typed("SELECT pg_backend_pid()", &[]).await?[0].get(0);
    let pid_b: i32 =
        tokio::time::timeout(step, b.query_typed("SELECT pg_backend_pid()", &[])).await??[0].get(0);
    assert_eq!(pid_a, pid_b, "two clients, one backend");

    // A direct client is a different backend and does not see the setting.
    let direct = db.connect().await?;
    let direct_pid: i32 = direct
        .query_one("SELECT pg_backend_pid()", &[])
        .await?
        .get(0);
    assert_ne!(direct_pid, pid_a);

    // The default pool size, through deadpool, with url() round-tripping.
    drop((a, b));
    let bouncer = PgBouncer::start(server, &db)?;
    let pool = bouncer.deadpool(4)?;
    let mut pids = Vec::new();
    let conns = futures_util::future::try_join_all((0..4).map(|_| pool.get())).await?;
    for c in &conns {
        let rows = c
            .query_typed("SELECT pg_backend_pid(), $1::text", &[(&"x", Type::TEXT)])
            .await?;
        pids.push(rows[0].get::<_, i32>(0));
        c.simple_query("SELECT 1").await?;
    }
    assert_eq!(pids.len(), 4);
    drop(conns);
    let (via_url, conn) = Config::from_str(&bouncer.url())?.connect(NoTls).await?;
    tokio::spawn(conn);
    via_url.simple_query("SELECT 1").await?;
    drop(via_url);

    // Stopped on drop.
    let config = bouncer.pg_config();
    let dir = bouncer.dir().to_path_buf();
    drop(pool);
    drop(bouncer);
    eventually(Duration::from_secs(10), "pgbouncer stops accepting", || {
        let config = config.clone();
        async move { !can_connect(&config).await }
    })
    .await;
    assert!(!dir.exists());
    Ok(())
}
