//! [`TestDb`]: one fresh database on a [`TestServer`](crate::TestServer), and
//! the connection helpers shared with [`PgBouncer`](crate::PgBouncer).

use std::fmt;
#[cfg(test)]
use std::path::PathBuf;
#[cfg(test)]
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config, NoTls};

use crate::TestingError;

/// A database created by [`TestServer::create_database`](crate::TestServer::create_database).
///
/// Dropping the last clone drops the database, `WITH (FORCE)`, on a
/// background thread of the harness (like a `TempDir`): keep a `TestDb`
/// for as long as the database is used, by this process or a child. A
/// test run creates about a thousand databases of 7.5 MB on the shared
/// server; kept to its end they took 6.3 GB (in memory when the server is
/// on tmpfs). [`TestDb::destroy`] drops it at once and waits.
#[derive(Debug, Clone)]
pub struct TestDb {
    pub(crate) config: Config,
    pub(crate) owner: Arc<DropOnLast>,
}

/// The database's name and its server's admin settings, shared by a
/// [`TestDb`]'s clones (and its clients): the last one to go queues the
/// drop.
#[derive(Debug)]
pub(crate) struct DropOnLast {
    name: String,
    admin: Config,
    armed: AtomicBool,
}

impl Drop for DropOnLast {
    fn drop(&mut self) {
        if self.armed.load(Ordering::Relaxed) {
            dropper::queue(
                std::mem::replace(&mut self.admin, Config::new()),
                std::mem::take(&mut self.name),
            );
        }
    }
}

impl TestDb {
    /// A database `name` reached with `config`, dropped through `admin`
    /// once the last clone goes.
    pub(crate) fn new(name: String, config: Config, admin: Config) -> TestDb {
        let owner = Arc::new(DropOnLast {
            name,
            admin,
            armed: AtomicBool::new(true),
        });
        TestDb { config, owner }
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.owner.name
    }

    /// Connection settings for this database.
    pub fn pg_config(&self) -> Config {
        self.config.clone()
    }

    /// The same database reached over TCP at `host` (an address its server
    /// listens on: see [`TestServer::start_local_with`]'s
    /// `listen_addresses`), on the same port, everything else of its
    /// settings kept. The database stays as long as any clone of either is
    /// kept.
    ///
    /// [`TestServer::start_local_with`]: crate::TestServer::start_local_with
    pub fn over_tcp(&self, host: &str) -> TestDb {
        let port = self.config.get_ports().first().copied().unwrap_or(5432);
        TestDb {
            config: retargeted(&self.config, host, port),
            owner: self.owner.clone(),
        }
    }

    /// The same settings as a `key=value` connection string, e.g.
    /// `host=/tmp/pgwarden-pg-x port=41234 user=postgres dbname=pgwarden_test_…`,
    /// which libpq and [`tokio_postgres::Config`]'s `FromStr` parse.
    pub fn url(&self) -> String {
        config_to_url(&self.config)
    }

    /// A `deadpool_postgres::Pool` of at most `max_size` connections to this
    /// database (`RecyclingMethod::Fast`, `Runtime::Tokio1`).
    pub fn deadpool(&self, max_size: usize) -> Result<Pool, TestingError> {
        deadpool(self.config.clone(), max_size)
    }

    /// A client outside any pool; its connection task is spawned on the
    /// current Tokio runtime. The connection keeps the database: it is not
    /// dropped while the client is open, even when this `TestDb` is gone
    /// (`server.create_database().await?.connect().await?` is a monitor
    /// connection that works).
    pub async fn connect(&self) -> Result<Client, TestingError> {
        connect_keeping(&self.config, Some(self.owner.clone())).await
    }

    /// Drops the database now (`WITH (FORCE)`: open connections are
    /// terminated), whatever clones remain.
    pub async fn destroy(self) -> Result<(), TestingError> {
        self.owner.armed.store(false, Ordering::Relaxed);
        let admin = connect_config(&self.owner.admin).await?;
        admin
            .batch_execute(&drop_statement(&self.owner.name))
            .await?;
        Ok(())
    }
}

fn drop_statement(name: &str) -> String {
    format!(
        "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
        name.replace('"', "\"\"")
    )
}

/// The thread that drops the databases of dropped [`TestDb`]s: each drop on
/// a connection of its own through its server's admin settings, up to
/// [`dropper::AT_ONCE`] at a time, each bounded by [`dropper::BOUND`]. A
/// drop waits for every backend of the server to answer a signal barrier
/// (PostgreSQL 15): one stopped backend (a test's `Stopped`, a frozen
/// server) holds up every drop on that server until it is continued, and
/// a drop must never hold up another server's or the next test's. A drop
/// that fails or runs out of its bound is logged at debug and forgotten:
/// the database stays until its server goes (as every database did before
/// stop 45).
mod dropper {
    use std::sync::{Arc, OnceLock};
    use std::time::Duration;

    use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
    use tokio::sync::Semaphore;
    use tokio_postgres::Config;

    use super::{connect_config, drop_statement};

    /// Drops in flight at most (each a connection of the server's).
    pub(super) const AT_ONCE: usize = 4;
    /// How long a drop (its connect included: a frozen server accepts the
    /// socket and never answers the start-up) may take.
    pub(super) const BOUND: Duration = Duration::from_secs(60);

    /// A database to drop: the server's admin settings and its name.
    type Job = (Config, String);

    static QUEUE: OnceLock<Option<UnboundedSender<Job>>> = OnceLock::new();

    pub(super) fn queue(admin: Config, name: String) {
        let queue = QUEUE.get_or_init(|| {
            let (tx, mut rx) = unbounded_channel::<Job>();
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            std::thread::Builder::new()
                .name("pgwarden-testing-dropdb".to_owned())
                .spawn(move || {
                    runtime.block_on(async move {
                        let slots = Arc::new(Semaphore::new(AT_ONCE));
                        while let Some((admin, name)) = rx.recv().await {
                            let Ok(slot) = slots.clone().acquire_owned().await else {
                                return;
                            };
                            tokio::spawn(async move {
                                let _slot = slot;
                                match tokio::time::timeout(BOUND, drop_one(&admin, &name)).await {
                                    Ok(Ok(())) => {}
                                    Ok(Err(e)) => tracing::debug!(error = %e, database = %name, "pgwarden_testing could not drop a database"),
                                    Err(_) => tracing::debug!(database = %name, bound = ?BOUND, "pgwarden_testing gave up dropping a database"),
                                }
                            });
                        }
                    });
                })
                .ok()?;
            Some(tx)
        });
        if let Some(tx) = queue {
            let _ = tx.send((admin, name));
        }
    }

    async fn drop_one(admin: &Config, name: &str) -> Result<(), crate::TestingError> {
        let client = connect_config(admin).await?;
        client.batch_execute(&drop_statement(name)).await?;
        Ok(())
    }
}

/// Connects with `NoTls` and spawns the connection task.
pub(crate) async fn connect_config(config: &Config) -> Result<Client, TestingError> {
    connect_keeping(config, None).await
}

/// [`connect_config`], the connection task holding `keep` until it ends.
async fn connect_keeping(
    config: &Config,
    keep: Option<Arc<DropOnLast>>,
) -> Result<Client, TestingError> {
    let deadline = tokio::time::Instant::now() + LISTEN_QUEUE_PATIENCE;
    let mut pause = Duration::from_millis(2);
    let (client, connection) = loop {
        match config.connect(NoTls).await {
            Err(e) if listen_queue_full(&e) && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(100));
            }
            r => break r?,
        }
    };
    tokio::spawn(async move {
        let _keep = keep;
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "pgwarden_testing connection ended with an error");
        }
    });
    Ok(client)
}

/// How long the harness's own connections (a test's admin connection, a
/// fresh database) retry a server whose listen queue is full.
const LISTEN_QUEUE_PATIENCE: Duration = Duration::from_secs(10);

/// A connect refused because the server's listen queue is full: on a Unix
/// socket a non-blocking `connect` then fails with `EAGAIN` at once (seen
/// on a loaded 2-core machine, the shared server's postmaster behind a
/// storm of other tests' connects: "fresh database: ... Resource
/// temporarily unavailable"). The harness's own connections wait for the
/// queue to drain, as a TCP connect would; what a test asserts about its
/// own connects is its own.
fn listen_queue_full(e: &tokio_postgres::Error) -> bool {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .is_some_and(|io| io.kind() == std::io::ErrorKind::WouldBlock)
}

/// A `deadpool_postgres::Pool` of at most `max_size` connections with any
/// settings (another user, an `application_name`, a [`PgBouncer`](crate::PgBouncer)),
/// as [`TestDb::deadpool`] builds them: `RecyclingMethod::Fast`, `Runtime::Tokio1`, `NoTls`.
///
/// ```no_run
/// # async fn t(db: pgwarden_testing::TestDb) -> Result<(), pgwarden_testing::TestingError> {
/// let mut config = db.pg_config();
/// config.application_name("worker-a"); // to find its backends in pg_stat_activity
/// let pool = pgwarden_testing::deadpool(config, 2)?;
/// # let _ = pool; Ok(()) }
/// ```
pub fn deadpool(config: Config, max_size: usize) -> Result<Pool, TestingError> {
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

/// `config` with its hosts replaced by `host` and `port`: everything else
/// that [`TestDb`] settings carry is kept (user, password, database,
/// options, application name, connect timeout, TLS mode).
pub(crate) fn retargeted(config: &Config, host: &str, port: u16) -> Config {
    let mut c = Config::new();
    c.host(host).port(port);
    if let Some(u) = config.get_user() {
        c.user(u);
    }
    if let Some(p) = config.get_password() {
        c.password(p);
    }
    if let Some(d) = config.get_dbname() {
        c.dbname(d);
    }
    if let Some(o) = config.get_options() {
        c.options(o);
    }
    if let Some(a) = config.get_application_name() {
        c.application_name(a);
    }
    if let Some(t) = config.get_connect_timeout() {
        c.connect_timeout(*t);
    }
    c.ssl_mode(config.get_ssl_mode());
    c
}

/// Renders a [`Config`] as a libpq `key=value` connection string.
pub(crate) fn config_to_url(c: &Config) -> String {
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
