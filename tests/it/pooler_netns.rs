//! Detection with the server in a network namespace of its own (a
//! container, the database's host), PgBouncer beside it (transaction mode,
//! or session mode switched to transaction mode after detection) that
//! reaches it over loopback, and this process, in another namespace,
//! holding sockets that share the ends the server sees for PgBouncer's
//! connections (`127.0.0.1:Q` to `127.0.0.1:X`: anything local on port
//! `X` here, a sidecar, a local proxy, another server).
//!
//! The hostile reader of stop 50's proof of a direct sqlx connection by its
//! own socket (`src/pooler/peer.rs`) set this up: the server's ends are of
//! its namespace, this process reads its own, and a sqlx pool behind the
//! transaction pooler was proven direct (5 of 5 runs), after which three
//! holders took one exclusive session lock at once. A socket match counts
//! only after the motion probe now, which sees the transaction pooler.
//!
//! Needs root (`unshare -n`, PostgreSQL and PgBouncer run as `postgres`
//! through `runuser`) and the tools; on CI all of them.

use crate::support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use pgwarden::PoolerMode;
use support::backend::{Backend, Settings};
use support::eventually;

const T: Duration = Duration::from_secs(60);
/// The local ports PgBouncer's server connections may come from, in its
/// namespace; this process holds a socket from each of them.
const PORTS: u16 = 10;

/// PostgreSQL and PgBouncer in a network namespace of their own; stopped
/// (and the namespace gone with them) on drop, or when this process ends.
struct Beside {
    child: Child,
    dir: tempfile::TempDir,
}

impl Drop for Beside {
    fn drop(&mut self) {
        // SIGTERM: the script stops PgBouncer and PostgreSQL.
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
    }
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(1))
            == Some("0")
    })
}

fn tool(name: &str) -> Option<PathBuf> {
    pgwarden_testing::require_tool(name)
        .unwrap_or_else(|e| panic!("{name} is required on CI: {e}"))
        .then(|| pgwarden_testing::find_tool(name))
        .flatten()
}

/// Listens on `127.0.0.1:X` here and holds a connection to it from each of
/// `PORTS` consecutive local ports `L..L+PORTS`: returns `X`, `L` and what
/// must be kept.
async fn decoys() -> (
    u16,
    u16,
    tokio::net::TcpListener,
    Vec<tokio::net::TcpStream>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let x = listener.local_addr().unwrap().port();
    'base: for base in (20_000..30_000u16).step_by(97) {
        let mut held = Vec::new();
        for port in base..base + PORTS {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.set_reuseaddr(true).unwrap();
            if s.bind(SocketAddr::from(([127, 0, 0, 1], port))).is_err() {
                continue 'base;
            }
            let Ok(c) = s.connect(SocketAddr::from(([127, 0, 0, 1], x))).await else {
                continue 'base;
            };
            let (a, _) = listener.accept().await.unwrap();
            held.push(c);
            held.push(a);
        }
        return (x, base, listener, held);
    }
    panic!("no {PORTS} consecutive free local ports between 20000 and 30000");
}

/// Starts them: PostgreSQL on `127.0.0.1:x` in the new namespace, PgBouncer
/// (`pool_mode`: `mode`; `postgres` its admin) on a Unix socket in the
/// directory, reaching it over TCP from local ports `low..low+PORTS`.
fn beside(x: u16, low: u16, tools: &Tools, mode: &str) -> Beside {
    let dir = tempfile::Builder::new()
        .prefix("pgwarden-netns-")
        .tempdir()
        .unwrap();
    let d = dir.path().display().to_string();
    Command::new("chown")
        .args(["postgres", &d])
        .status()
        .unwrap();
    let high = low + PORTS - 1;
    let parent = std::process::id();
    let script = format!(
        r#"
set -e
ip link set lo up
echo '{low} {high}' > /proc/sys/net/ipv4/ip_local_port_range
runuser -u postgres -- {initdb} -D {d}/data -A trust -U postgres >{d}/initdb.log 2>&1
runuser -u postgres -- {pg_ctl} -w -D {d}/data -l {d}/pg.log -o "-c listen_addresses=127.0.0.1 -p {x} -c unix_socket_directories={d} -c logging_collector=off -c fsync=off" start >/dev/null
cat > {d}/pgb.ini <<EOF
[databases]
* = host=127.0.0.1 port={x}
[pgbouncer]
listen_addr =
listen_port = 6432
unix_socket_dir = {d}
auth_type = trust
auth_file = {d}/users.txt
pool_mode = {mode}
admin_users = postgres
max_client_conn = 200
default_pool_size = 4
logfile = {d}/pgb.log
pidfile = {d}/pgb.pid
ignore_startup_parameters = extra_float_digits,options
EOF
echo '"postgres" ""' > {d}/users.txt
chown postgres {d}/pgb.ini {d}/users.txt
runuser -u postgres -- {pgbouncer} -d {d}/pgb.ini
stop() {{ kill $(cat {d}/pgb.pid) 2>/dev/null; runuser -u postgres -- {pg_ctl} -D {d}/data stop -m immediate >/dev/null 2>&1; exit 0; }}
trap stop TERM INT
# PgBouncer's parent returns before its socket is there.
n=0; while [ ! -S {d}/.s.PGSQL.6432 ] && [ $n -lt 600 ]; do sleep 0.05; n=$((n+1)); done
touch {d}/ready
while kill -0 {parent} 2>/dev/null; do sleep 1 & wait $!; done
stop
"#,
        initdb = tools.initdb.display(),
        pg_ctl = tools.pg_ctl.display(),
        pgbouncer = tools.pgbouncer.display(),
    );
    let child = Command::new(&tools.unshare)
        .args(["-n", "sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("script.log")).unwrap())
        .spawn()
        .expect("unshare -n");
    Beside { child, dir }
}

struct Tools {
    unshare: PathBuf,
    initdb: PathBuf,
    pg_ctl: PathBuf,
    pgbouncer: PathBuf,
}

fn tools() -> Option<Tools> {
    if !is_root() {
        assert!(
            !pgwarden_testing::ci(),
            "CI runs as root: this test needs it (unshare -n)"
        );
        eprintln!("not root: skipped (unshare -n)");
        return None;
    }
    for name in ["ip", "runuser"] {
        tool(name)?;
    }
    Some(Tools {
        unshare: tool("unshare")?,
        initdb: tool("initdb")?,
        pg_ctl: tool("pg_ctl")?,
        pgbouncer: tool("pgbouncer")?,
    })
}

fn through(dir: &Path) -> tokio_postgres::Config {
    let mut c = tokio_postgres::Config::new();
    c.host_path(dir)
        .port(6432)
        .user("postgres")
        .dbname("postgres")
        .connect_timeout(Duration::from_secs(10));
    c
}

/// Waits for them, then checks the chance match: the server sees
/// PgBouncer's connection with the ends of one of this process's sockets.
/// The settings that reach PgBouncer.
async fn up_with_a_chance_match(ns: &Beside, x: u16, low: u16) -> tokio_postgres::Config {
    let ready = ns.dir.path().join("ready");
    let log = ns.dir.path().join("script.log");
    eventually(T, "PostgreSQL and PgBouncer up in their namespace", || {
        let (ready, log) = (ready.clone(), log.clone());
        async move {
            let up = ready.exists();
            if !up {
                let said = std::fs::read_to_string(&log).unwrap_or_default();
                assert!(!said.contains("unshare:"), "unshare failed: {said}");
            }
            up
        }
    })
    .await;
    let cfg = through(ns.dir.path());
    // The chance match: the server sees PgBouncer's connection with the
    // ends of one of the sockets above.
    let (client, conn) = cfg
        .connect(tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| {
            let log = |f: &str| std::fs::read_to_string(ns.dir.path().join(f)).unwrap_or_default();
            panic!(
                "a client through PgBouncer: {e}\nPgBouncer's log:\n{}\nthe server's log:\n{}",
                log("pgb.log"),
                log("pg.log")
            )
        });
    tokio::spawn(conn);
    let row = client
        .query_one(
            "SELECT host(inet_client_addr()), inet_client_port(), inet_server_port()",
            &[],
        )
        .await
        .unwrap();
    let (addr, port, server_port): (String, i32, i32) = (row.get(0), row.get(1), row.get(2));
    assert_eq!(addr, "127.0.0.1");
    assert_eq!(server_port, i32::from(x));
    assert!(
        (i32::from(low)..i32::from(low + PORTS)).contains(&port),
        "PgBouncer's server connection from port {port}, outside {low}..{}: the sockets here match nothing",
        low + PORTS
    );
    drop(client);
    cfg
}

/// What a test holds: the namespace, the sockets of the chance match, the
/// settings that reach PgBouncer, and a pool of `B` on `Auto` through it.
struct SetUp<B: Backend> {
    ns: Beside,
    x: u16,
    cfg: tokio_postgres::Config,
    pool: B::Pool,
    _decoys: (tokio::net::TcpListener, Vec<tokio::net::TcpStream>),
}

/// PgBouncer in `mode` beside the server with the chance match checked,
/// and a pool of `size` named `name` through it (sqlx's statement cache
/// off, as behind a transaction pooler); `None` where the test cannot run
/// (not root, off CI).
async fn set_up<B: Backend>(mode: &str, name: &'static str, size: usize) -> Option<SetUp<B>> {
    let tools = tools()?;
    let (x, low, listener, held) = decoys().await;
    let ns = beside(x, low, &tools, mode);
    let cfg = up_with_a_chance_match(&ns, x, low).await;
    let s = Settings::new(name, size)
        .pooler(PoolerMode::Auto)
        .statement_cache(false);
    let pool = B::build_on(&cfg, &s);
    Some(SetUp {
        ns,
        x,
        cfg,
        pool,
        _decoys: (listener, held),
    })
}

backends!(a_pooler_beside_the_server_is_not_taken_for_a_direct_connection);
/// Through the transaction pooler beside the server, on `PoolerMode::Auto`,
/// detection answers `Transaction` on every backend, while the server's
/// view of PgBouncer's connection is the ends of a socket this process
/// holds (checked first: the chance match the proof must not trust). The
/// socket proof taken alone (stop 50's first version) answered `Direct`
/// on sqlx here.
async fn a_pooler_beside_the_server_is_not_taken_for_a_direct_connection<B: Backend>() {
    // Whole: its namespace and sockets kept to the end.
    let Some(up) = set_up::<B>("transaction", "netns", 4).await else {
        return;
    };
    let pool = &up.pool;
    assert_eq!(
        B::detect_pooler(pool).await.unwrap(),
        PoolerMode::Transaction,
        "a transaction pooler whose server connections share the ends of sockets of this process"
    );
    B::close(pool).await;
}

backends!(a_verdict_by_socket_made_stale_still_checks_each_session_lock);
/// Behind PgBouncer in *session* mode beside the server, with the chance
/// match: the motion probe sees no motion (a session pooler keeps its
/// clients' sessions), so on sqlx the socket proves the pool direct. Then
/// PgBouncer is switched to transaction mode (`RELOAD`), which makes that
/// verdict stale. Three tries of one exclusive session lock, each kept:
/// never two holders at once, and none is held at the end, because a pool
/// proven by its socket still checks each session lock on its own
/// connection. Its hostile reader had two holders in 6 of 11 runs on sqlx
/// while the socket proof turned that check off (deadpool, proven by the
/// announced pid, never is proven direct through a pooler).
async fn a_verdict_by_socket_made_stale_still_checks_each_session_lock<B: Backend>() {
    use pgwarden::{LockKey, LockMode};
    // Whole: its namespace and sockets kept to the end.
    let Some(up) = set_up::<B>("session", "netns-stale", 8).await else {
        return;
    };
    let (ns, x, cfg, pool) = (&up.ns, up.x, &up.cfg, &up.pool);
    assert_eq!(B::detect_pooler(pool).await.unwrap(), PoolerMode::Direct);
    // Transaction mode from now on.
    let ini = ns.dir.path().join("pgb.ini");
    let text = std::fs::read_to_string(&ini).unwrap();
    std::fs::write(
        &ini,
        text.replace("pool_mode = session", "pool_mode = transaction"),
    )
    .unwrap();
    let mut admin = cfg.clone();
    admin.dbname("pgbouncer");
    let (console, conn) = admin.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    console.simple_query("RELOAD").await.unwrap();
    // Switched: two clients taking turns land on one server session.
    // Simple queries: tokio-postgres names its statements, which a
    // transaction pooler breaks.
    async fn pid(c: &tokio_postgres::Client) -> String {
        let rows = c.simple_query("SELECT pg_backend_pid()").await.unwrap();
        rows.iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                _ => None,
            })
            .expect("a pid")
    }
    let connect = || async {
        let (c, conn) = cfg.connect(tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(conn);
        c
    };
    let (c1, c2) = (connect().await, connect().await);
    eventually(T, "PgBouncer switched to transaction mode", || {
        let (c1, c2) = (&c1, &c2);
        async move { pid(c1).await == pid(c2).await }
    })
    .await;
    drop((c1, c2));
    let key = LockKey::Single(4343);
    let mut held = Vec::new();
    let mut said = Vec::new();
    for _ in 0..3 {
        match B::session_lock(pool, key, LockMode::Exclusive, None).await {
            Ok(Some(l)) => {
                said.push("held".to_owned());
                held.push(l);
            }
            Ok(None) => said.push("busy".to_owned()),
            Err(e) => said.push(e.to_string()),
        }
        assert!(
            held.len() <= 1,
            "two holders of one exclusive lock: {said:?}"
        );
    }
    for l in held {
        let _ = B::unlock(l).await;
    }
    // Asked on the server, past PgBouncer: nobody holds the key.
    let mut direct = tokio_postgres::Config::new();
    direct
        .host_path(ns.dir.path())
        .port(x)
        .user("postgres")
        .dbname("postgres");
    let (c, conn) = direct.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    let granted: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 4343 AND granted",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(granted, 0, "the lock left held on the server: {said:?}");
    B::close(pool).await;
}
