//! [`Proxy`]: a TCP proxy in front of a server, for network faults (latency,
//! a partition that closes nothing, connection resets).

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener as StdTcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;
use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config};

use crate::db::{config_to_url, connect_config};
use crate::{TestDb, TestServer, TestingError};

/// How long [`Proxy::reset_all`] waits for the proxy's thread to close the
/// connections; closing a socket does not block, so only a wedged thread
/// gets near it.
const RESET_WAIT: Duration = Duration::from_secs(5);
/// Bytes read from one side at a time.
const CHUNK: usize = 16 * 1024;

/// Where a [`Proxy`] forwards its connections to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Upstream {
    /// A TCP address.
    Tcp(SocketAddr),
    /// A Unix socket file, e.g. `<socket_dir>/.s.PGSQL.<port>`.
    Unix(PathBuf),
}

/// A TCP proxy on `127.0.0.1` in front of a server, for network faults:
/// latency ([`Proxy::set_latency`]), a partition that closes nothing
/// ([`Proxy::blackhole`] / [`Proxy::heal`]), and connection resets
/// ([`Proxy::reset_all`]).
///
/// It runs on a thread and Tokio runtime of its own (stopped when the proxy is
/// dropped), so it keeps forwarding while a test's runtime blocks, and
/// outlives any one `#[tokio::test]` runtime. The controls take effect at
/// once, on the connections already open and on new ones.
///
/// A throwaway [`TestServer`] listens on a Unix socket only; the proxy
/// accepts TCP on `127.0.0.1` and connects to that socket (an external server
/// reached over TCP: to its address). To the server, a proxied client is a
/// Unix-socket client (`client_addr` is null in `pg_stat_activity`); find its
/// backends by `application_name` or by `pg_backend_pid()` asked before the
/// fault.
///
/// ```no_run
/// use std::time::Duration;
/// use pgwarden_testing::{Proxy, TestServer};
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let server = TestServer::shared()?;
/// let db = server.create_database().await?;
/// let proxy = Proxy::start(server)?;
/// let pool = proxy.deadpool(&db, 4)?; // through the proxy
///
/// proxy.set_latency(Duration::from_millis(175)); // a 350 ms round trip
/// let client = pool.get().await?;
/// client.execute("SELECT 1", &[]).await?; // ≥ 350 ms
///
/// proxy.blackhole(); // the next statement hangs; the server keeps the session
/// proxy.heal(); // held bytes are delivered: it completes
/// proxy.reset_all(); // RST to every client; their backends go away
/// # Ok(()) }
/// ```
///
/// # Latency
///
/// [`Proxy::set_latency`] sets a one-way delay: every chunk of bytes is
/// forwarded, in order, at its arrival time plus the delay, in both
/// directions, so a round trip costs twice the value. A new connection's
/// bytes also wait one round trip before they move, as a TCP handshake costs
/// (the client's `connect` itself completes at once: the kernel accepts for
/// the proxy).
///
/// # Partition
///
/// While [`Proxy::blackhole`] is on, nothing is forwarded either way and no
/// socket is closed: no FIN, no RST. The proxy stops reading, so bytes wait
/// in the proxy's memory or in the kernel's socket buffers, and a server or
/// client closing its end is not passed on either. The server sees an idle
/// client that never answers and keeps its session (with a Unix-socket
/// upstream, nothing like TCP keepalive ever ends it); the client's
/// statements hang. New connections are accepted and get nothing: the proxy
/// connects them to the server only after [`Proxy::heal`].
///
/// [`Proxy::heal`] delivers everything held, in order, as TCP does after a
/// partition shorter than its retransmission timeout: a statement that was
/// hanging completes, and a session the server ended meanwhile (e.g. by
/// `idle_in_transaction_session_timeout`) reaches the client as the server's
/// error and a closed connection. For a partition long enough that TCP gave
/// up, call [`Proxy::reset_all`] before (or instead of) `heal()`.
///
/// Keepalive probes from the client do not notice the partition: the
/// proxy's kernel answers them.
///
/// # Resets
///
/// [`Proxy::reset_all`] closes every open connection with an RST to the
/// client (`SO_LINGER` 0) and closes the server's end (an RST over TCP; a
/// Unix socket has none, the server reads end-of-file), so the backend ends.
/// A read or write error on either side ends a connection the same way.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    state: watch::Sender<State>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// The settings every connection follows.
#[derive(Debug, Clone, Copy, Default)]
struct State {
    latency: Duration,
    blackholed: bool,
}

/// What the proxy and its connections share.
#[derive(Debug)]
struct Shared {
    open: AtomicUsize,
    accepted: AtomicU64,
    /// Open connections by id; sending one an acknowledgement sender resets
    /// it, and it drops that sender once its sockets are closed.
    resets: Mutex<HashMap<u64, oneshot::Sender<mpsc::Sender<()>>>>,
    /// Where new connections go ([`Proxy::set_upstream`]).
    upstream: Mutex<Upstream>,
}

impl Proxy {
    /// Starts a proxy in front of `server`: its Unix socket for a throwaway
    /// server, its TCP address for an external one (`DATABASE_URL`).
    pub fn start(server: &TestServer) -> Result<Proxy, TestingError> {
        let upstream = match server.socket_dir() {
            Some(dir) => Upstream::Unix(dir.join(format!(".s.PGSQL.{}", server.port()))),
            None => {
                let config = server.pg_config();
                let host = config
                    .get_hosts()
                    .iter()
                    .find_map(|h| match h {
                        Host::Tcp(h) => Some(h.clone()),
                        Host::Unix(_) => None,
                    })
                    .unwrap_or_else(|| "localhost".to_owned());
                let port = server.port();
                let addr = (host.as_str(), port)
                    .to_socket_addrs()
                    .map_err(io_err(format!("resolving {host}:{port}")))?
                    .next()
                    .ok_or_else(|| TestingError::Io {
                        context: format!("resolving {host}:{port}"),
                        source: Arc::new(std::io::Error::other("no address")),
                    })?;
                Upstream::Tcp(addr)
            }
        };
        Proxy::start_to(upstream)
    }

    /// Starts a proxy in front of any address (a [`PgBouncer`](crate::PgBouncer),
    /// another service).
    pub fn start_to(upstream: Upstream) -> Result<Proxy, TestingError> {
        let listener = StdTcpListener::bind("127.0.0.1:0")
            .map_err(io_err("binding the proxy to 127.0.0.1:0".to_owned()))?;
        listener.set_nonblocking(true).map_err(io_err(
            "setting the proxy's listener non-blocking".to_owned(),
        ))?;
        let addr = listener
            .local_addr()
            .map_err(io_err("reading the proxy's address".to_owned()))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(io_err("building the proxy's Tokio runtime".to_owned()))?;
        let shared = Arc::new(Shared {
            open: AtomicUsize::new(0),
            accepted: AtomicU64::new(0),
            resets: Mutex::default(),
            upstream: Mutex::new(upstream),
        });
        let (state, state_rx) = watch::channel(State::default());
        let (stop, stop_rx) = oneshot::channel();
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("pgwarden-proxy-{}", addr.port()))
                .spawn(move || {
                    runtime.block_on(async move {
                        let listener = match TcpListener::from_std(listener) {
                            Ok(l) => l,
                            Err(e) => {
                                tracing::error!(error = %e, "the proxy cannot listen");
                                return;
                            }
                        };
                        tokio::select! {
                            () = accept_loop(listener, shared, state_rx) => {}
                            _ = stop_rx => {}
                        }
                    });
                    // Dropping the runtime drops every connection task and
                    // its sockets.
                    drop(runtime);
                })
                .map_err(io_err("spawning the proxy's thread".to_owned()))?
        };
        Ok(Proxy {
            addr,
            shared,
            state,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The address the proxy listens on (`127.0.0.1`, a free port).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where the proxy forwards new connections to.
    pub fn upstream(&self) -> Upstream {
        let up = self.shared.upstream.lock();
        up.unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Forwards connections accepted from now on to `upstream`, as a virtual
    /// IP or a DNS name moved to a promoted server does; the open ones keep
    /// theirs.
    ///
    /// ```no_run
    /// # async fn t(mut cluster: pgwarden_testing::Cluster) -> Result<(), pgwarden_testing::TestingError> {
    /// use pgwarden_testing::{Proxy, Upstream};
    /// let at = |port| Upstream::Tcp(([127, 0, 0, 1], port).into());
    /// let front = Proxy::start_to(at(cluster.primary().port()))?;
    /// cluster.stop_primary_immediate().await?;
    /// cluster.promote_replica().await?;
    /// front.set_upstream(at(cluster.primary().port())); // the "VIP" follows
    /// # Ok(()) }
    /// ```
    pub fn set_upstream(&self, upstream: Upstream) {
        let up = self.shared.upstream.lock();
        *up.unwrap_or_else(PoisonError::into_inner) = upstream;
    }

    /// Connection settings for `db` through the proxy: `db`'s user, password,
    /// database, options and `application_name`, host `127.0.0.1` and the
    /// proxy's port.
    pub fn pg_config(&self, db: &TestDb) -> Config {
        self.retarget(&db.pg_config())
    }

    /// [`Proxy::pg_config`] as a `key=value` connection string.
    pub fn url(&self, db: &TestDb) -> String {
        config_to_url(&self.pg_config(db))
    }

    /// A `deadpool_postgres::Pool` of at most `max_size` connections to `db`
    /// through the proxy, built like [`TestDb::deadpool`].
    pub fn deadpool(&self, db: &TestDb, max_size: usize) -> Result<Pool, TestingError> {
        crate::deadpool(self.pg_config(db), max_size)
    }

    /// A client to `db` through the proxy, outside any pool; its connection
    /// task is spawned on the current Tokio runtime.
    pub async fn connect(&self, db: &TestDb) -> Result<Client, TestingError> {
        connect_config(&self.pg_config(db)).await
    }

    /// `config` with its hosts replaced by the proxy's address: everything
    /// else that [`TestDb`] settings carry is kept.
    pub fn retarget(&self, config: &Config) -> Config {
        crate::db::retargeted(config, &self.addr.ip().to_string(), self.addr.port())
    }

    /// Sets the one-way delay added to every chunk in each direction (a
    /// round trip costs twice `latency`: 175 ms gives a 350 ms round trip).
    /// Default: zero.
    pub fn set_latency(&self, latency: Duration) {
        self.state.send_modify(|s| s.latency = latency);
    }

    /// The one-way delay set by [`Proxy::set_latency`].
    pub fn latency(&self) -> Duration {
        self.state.borrow().latency
    }

    /// Stops forwarding in both directions without closing anything (see
    /// "Partition" above). Lasts until [`Proxy::heal`].
    pub fn blackhole(&self) {
        self.state.send_modify(|s| s.blackholed = true);
    }

    /// Ends [`Proxy::blackhole`]: what was held is delivered, in order.
    pub fn heal(&self) {
        self.state.send_modify(|s| s.blackholed = false);
    }

    /// Whether [`Proxy::blackhole`] is on.
    pub fn is_blackholed(&self) -> bool {
        self.state.borrow().blackholed
    }

    /// Closes every open connection with an RST (see "Resets" above) and
    /// returns how many it closed. When it returns, their sockets are closed.
    /// Connections accepted later are not affected.
    ///
    /// # Panics
    ///
    /// When the proxy's thread has not closed them within 5 s (it closes them
    /// in microseconds; only a wedged thread gets there).
    pub fn reset_all(&self) -> usize {
        let senders: Vec<_> = self
            .shared
            .resets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .map(|(_, s)| s)
            .collect();
        let (ack, done) = mpsc::channel();
        let count = senders
            .into_iter()
            .filter(|s| !s.is_closed())
            .filter_map(|s| s.send(ack.clone()).ok())
            .count();
        drop(ack);
        // Every connection drops its clone once its sockets are closed.
        match done.recv_timeout(RESET_WAIT) {
            Err(mpsc::RecvTimeoutError::Disconnected) => count,
            _ => panic!(
                "proxy on {}: connections not reset within {RESET_WAIT:?}",
                self.addr
            ),
        }
    }

    /// How many proxied connections are open now.
    pub fn connections(&self) -> usize {
        self.shared.open.load(Ordering::SeqCst)
    }

    /// How many connections the proxy has accepted since it started.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    /// Stops the proxy's thread; its connections are closed.
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn io_err(context: String) -> impl FnOnce(std::io::Error) -> TestingError {
    move |e| TestingError::Io {
        context,
        source: Arc::new(e),
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, state: watch::Receiver<State>) {
    let mut next_id = 0u64;
    loop {
        let client = match listener.accept().await {
            Ok((client, _)) => client,
            Err(e) => {
                // EMFILE and the like: wait and try again rather than spin.
                tracing::warn!(error = %e, "the proxy failed to accept a connection");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        next_id += 1;
        let (reset_tx, reset_rx) = oneshot::channel();
        shared
            .resets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(next_id, reset_tx);
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        shared.open.fetch_add(1, Ordering::SeqCst);
        let guard = OpenGuard {
            shared: Arc::clone(&shared),
            id: next_id,
        };
        let upstream = shared
            .upstream
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        tokio::spawn(connection(client, upstream, state.clone(), reset_rx, guard));
    }
}

/// Counts a connection open until dropped (also when its task is dropped
/// with the runtime).
struct OpenGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.shared
            .resets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.id);
        self.shared.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The server side of a connection.
enum UpstreamStream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

/// How a connection ended.
enum End {
    /// Both directions forwarded their end-of-file: close normally.
    Done,
    /// An error on either side, or a reset asked for: close with RST.
    Reset,
}

async fn connection(
    mut client: TcpStream,
    upstream: Upstream,
    mut state: watch::Receiver<State>,
    reset: oneshot::Receiver<mpsc::Sender<()>>,
    guard: OpenGuard,
) {
    let accepted = Instant::now();
    let _ = client.set_nodelay(true);
    let mut server: Option<UpstreamStream> = None;
    let mut ack = None;
    let end = tokio::select! {
        r = serve(&mut client, &mut server, &upstream, &mut state, accepted) => match r {
            Ok(()) => End::Done,
            Err(e) => {
                tracing::debug!(error = %e, "a proxied connection failed");
                End::Reset
            }
        },
        a = reset => {
            ack = a.ok();
            End::Reset
        }
    };
    if let End::Reset = end {
        set_zero_linger(&client);
        if let Some(UpstreamStream::Tcp(s)) = &server {
            set_zero_linger(s);
        }
    }
    drop(client);
    drop(server);
    // Uncounted before [`Proxy::reset_all`] hears it is closed.
    drop(guard);
    drop(ack);
}

#[allow(deprecated)] // tokio deprecates SO_LINGER for blocking close; zero never blocks
fn set_zero_linger(s: &TcpStream) {
    if let Err(e) = s.set_linger(Some(Duration::ZERO)) {
        tracing::warn!(error = %e, "the proxy could not set SO_LINGER 0: the close sends FIN, not RST");
    }
}

async fn serve(
    client: &mut TcpStream,
    server: &mut Option<UpstreamStream>,
    upstream: &Upstream,
    state: &mut watch::Receiver<State>,
    accepted: Instant,
) -> std::io::Result<()> {
    // The handshake's round trip, and no connection while partitioned.
    wait_until(state, accepted, 2).await;
    let stream = match upstream {
        Upstream::Tcp(addr) => {
            let s = TcpStream::connect(addr).await?;
            let _ = s.set_nodelay(true);
            server.insert(UpstreamStream::Tcp(s))
        }
        Upstream::Unix(path) => {
            server.insert(UpstreamStream::Unix(UnixStream::connect(path).await?))
        }
    };
    match stream {
        UpstreamStream::Tcp(s) => relay(client, s, state).await,
        UpstreamStream::Unix(s) => relay(client, s, state).await,
    }
}

/// Forwards both ways until both have forwarded their end-of-file.
async fn relay<S: AsyncRead + AsyncWrite + Unpin>(
    client: &mut TcpStream,
    server: &mut S,
    state: &watch::Receiver<State>,
) -> std::io::Result<()> {
    let (client_read, client_write) = client.split();
    let (server_read, server_write) = tokio::io::split(server);
    tokio::try_join!(
        direction(client_read, server_write, state.clone()),
        direction(server_read, client_write, state.clone()),
    )?;
    Ok(())
}

/// One direction: a reader stamps each chunk with its arrival, a writer
/// forwards it at arrival + latency; `None` is the end-of-file.
async fn direction<R, W>(
    mut from: R,
    mut to: W,
    state: watch::Receiver<State>,
) -> std::io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Option<Vec<u8>>)>();
    let mut read_state = state.clone();
    let reader = async move {
        let mut buf = vec![0u8; CHUNK];
        loop {
            // Not reading while partitioned: bytes and end-of-file wait in the kernel.
            wait_until(&mut read_state, Instant::now(), 0).await;
            let n = from.read(&mut buf).await?;
            let chunk = (n > 0).then(|| buf[..n].to_vec());
            if tx.send((Instant::now(), chunk)).is_err() || n == 0 {
                return Ok::<(), std::io::Error>(());
            }
        }
    };
    let mut write_state = state;
    let writer = async move {
        while let Some((arrival, chunk)) = rx.recv().await {
            wait_until(&mut write_state, arrival, 1).await;
            match chunk {
                Some(bytes) => to.write_all(&bytes).await?,
                None => {
                    to.shutdown().await?;
                    return Ok(());
                }
            }
        }
        Ok::<(), std::io::Error>(())
    };
    tokio::try_join!(reader, writer)?;
    Ok(())
}

/// Waits until the proxy is not partitioned and `since + trips × latency`
/// has passed, following changes to either while it waits.
async fn wait_until(state: &mut watch::Receiver<State>, since: Instant, trips: u32) {
    loop {
        let s = *state.borrow_and_update();
        if s.blackholed {
            if state.changed().await.is_err() {
                // The proxy is gone; its runtime drops this task next.
                std::future::pending::<()>().await;
            }
            continue;
        }
        let due = since + s.latency * trips;
        if Instant::now() >= due {
            return;
        }
        tokio::select! {
            () = tokio::time::sleep_until(due) => return,
            r = state.changed() => {
                if r.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        }
    }
}
