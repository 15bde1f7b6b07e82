//! The detection itself: what the server announced at connection start
//! against the backend a statement runs on, then, behind a proxy, whether
//! clients move between server sessions.
//!
//! Three signals, each one-sided, so neither can be wrong in the direction
//! that matters:
//!
//! - **The announced process id.** At connection start PostgreSQL sends the
//!   client its backend's pid (BackendKeyData, the key of cancel requests).
//!   Straight to PostgreSQL it is the pid `pg_backend_pid()` returns, always.
//!   A pooler must route cancel requests itself, so it makes up its own key
//!   (PgBouncer: random bytes): a mismatch means a proxy is in between, and
//!   a match on every probe connection means none is.
//! - **The connection's own socket** (sqlx, which keeps the announced pid
//!   to itself), once the motion probe (below) saw no motion: the server's
//!   view of the session's TCP connection (both ends) is a socket this
//!   process holds, so no proxy is in between (`peer.rs`,
//!   [`proven_by_socket`]: why only after the motion probe). Not matched
//!   (a Unix socket, NAT, no `/proc`): the motion probe's verdict stands,
//!   unproven.
//! - **Motion.** A transaction pooler hands a server session to whichever
//!   client needs one: a probe client that lands on a backend other than its
//!   first one, or on a backend another live probe client was on, proves it.
//!   Straight to PostgreSQL, or through a session pooler, a live client keeps
//!   its backend for its life: that cannot happen.
//!
//! Through a proxy that shows no motion in [`MOTION_STATEMENTS`] statements
//! the mode stays unproven; session locks are then checked again on the
//! lock's own connection (`crate::lock::pooled::Check`).

use std::collections::HashSet;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, TlsConnect, TlsStream};

use super::peer::{held_here, Ends};
use crate::error::Error;
use crate::stmt::{Exec, Row};

/// Probe statements after the first one per client, through a proxy, before
/// the mode is taken to keep sessions. Each is a `SELECT pg_backend_pid()`.
/// Measured through PgBouncer 1.18 in transaction mode, 500 tries per mix:
/// with 10 to 40 server connections and 32 busy clients a statement shows
/// no motion 3 to 12 times in 100; the worst mix, 2 server connections and
/// 1 to 32 busy clients, about 1 time in 2 (0.45 to 0.55 over each run, at
/// most 0.64 at any one statement). 40 in a row then miss with a probability
/// near 0.55^40 ≈ 4e-11 in that worst mix (0.64^40 ≈ 2e-8 at the very
/// worst), below 1e-36 in the common one; and the lock-time check draws
/// again.
pub(crate) const MOTION_STATEMENTS: usize = 40;

/// What detection found.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Detection {
    /// A transaction pooler, proven by motion; otherwise the clients kept
    /// their sessions (direct, or a session pooler).
    pub(crate) transaction: bool,
    /// A proxy is in between (announced and real pids differ, or could not
    /// be compared): with `Direct`, the mode is unproven and each session
    /// lock is checked on its own connection.
    pub(crate) proxied: bool,
    /// Statements the probe ran.
    pub(crate) statements: usize,
    /// Behind a proxy, the motion probe could not run (the pool cannot
    /// hold two connections outside the probe reserve): nothing is proven,
    /// and the pool's mode stays [`PoolerMode::Auto`](crate::PoolerMode::Auto).
    pub(crate) unproven: bool,
    /// Proven direct by the connection's own socket ([`proven_by_socket`]),
    /// not by the announced pid: session locks are still checked on their
    /// own connection (see there).
    pub(crate) by_socket: bool,
}

/// Backend pids seen by a set of live clients: proof that a pooler moves
/// clients between server sessions. Pure: fed by the probes.
#[derive(Debug, Default)]
pub(crate) struct Motion {
    first: Vec<Option<i32>>,
    seen: Vec<HashSet<i32>>,
}

impl Motion {
    pub(crate) fn new(clients: usize) -> Motion {
        Motion {
            first: vec![None; clients],
            seen: vec![HashSet::new(); clients],
        }
    }

    /// The first backend client `c` was seen on.
    pub(crate) fn first(&self, c: usize) -> Option<i32> {
        self.first[c]
    }

    /// Client `c` ran a statement on backend `pid`. True when that proves
    /// motion: `c` was on another backend before, or another live client was
    /// on this one.
    pub(crate) fn observe(&mut self, c: usize, pid: i32) -> bool {
        let moved = match self.first[c] {
            Some(first) => first != pid,
            None => {
                self.first[c] = Some(pid);
                false
            }
        };
        let shared = self
            .seen
            .iter()
            .enumerate()
            .any(|(o, s)| o != c && s.contains(&pid));
        self.seen[c].insert(pid);
        moved || shared
    }
}

/// The backend a statement runs on now.
pub(crate) async fn backend_pid(c: &impl Exec) -> Result<i32, Error> {
    let row = c.query_one("SELECT pg_backend_pid()", &[]).await?;
    Ok(row.col(0)?)
}

/// The first step, with one client: the backend a statement runs on
/// against the pid announced at connection start. `Ok(Ok(detection))`:
/// straight to PostgreSQL, proven; `Ok(Err(seen))`: a proxy may be in
/// between, the client was on backend `seen.pid` (the motion probe goes on
/// from there).
///
/// A connection that does not show the announced pid (sqlx) asks, with the
/// same statement, for the ends of its TCP connection as the server sees
/// them (`seen.ends`): see [`proven_by_socket`] for what they may prove,
/// and when.
pub(crate) async fn direct(
    a: &impl Exec,
    announced: Option<i32>,
) -> Result<Result<Detection, Seen>, Error> {
    if announced.is_some() {
        let pid = backend_pid(a).await?;
        return Ok(if announced == Some(pid) {
            Ok(found(false, false, 1))
        } else {
            Err(Seen { pid, ends: None })
        });
    }
    let row = a.query_one(ENDS, &[]).await?;
    let pid: i32 = row.col(0)?;
    let (client, client_port): (Option<String>, Option<i32>) = (row.col(1)?, row.col(2)?);
    let (server, server_port): (Option<String>, Option<i32>) = (row.col(3)?, row.col(4)?);
    let ends = Ends::from_server(
        client.as_deref(),
        client_port,
        server.as_deref(),
        server_port,
    );
    Ok(Err(Seen { pid, ends }))
}

/// What the first step saw on a connection it could not prove direct by
/// the announced pid.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Seen {
    /// The backend the statement ran on.
    pub(crate) pid: i32,
    /// Both ends of the session's TCP connection as the server sees them
    /// (asked only where no pid was announced; none on a Unix socket).
    pub(crate) ends: Option<Ends>,
}

/// The motion probe's verdict `motion` (no motion seen: direct, or a
/// proxy that keeps sessions), made a proof of a direct connection when a
/// socket of this process has the server's view of the first client's
/// ends ([`held_here`], read within [`SOCKET_READ_BOUND`]).
///
/// Only after the motion probe, never instead of it: the server's view is
/// of its own network namespace, and this process reads its own. A
/// pooler next to the server that reaches it over loopback
/// (`127.0.0.1:Q` to `127.0.0.1:5432`) shows ends that a socket of this
/// process, in another namespace, can share by chance (any socket of it
/// from local port `Q` to a `127.0.0.1:5432` of its own namespace: a
/// sidecar, a local proxy). Its hostile reader made that happen (ports
/// pinned in a namespace of PostgreSQL and a transaction-mode PgBouncer):
/// a sqlx pool behind the transaction pooler proven direct, and three
/// holders of one exclusive session lock at once. With the motion probe
/// first, such a chance match proves nothing behind a transaction pooler
/// (motion seen). Behind a session pooler it would, and a session pooler
/// switched to transaction mode later (a `RELOAD`) makes that verdict
/// stale: its second hostile reader then had two holders of one
/// exclusive session lock (6 of 11 runs, sqlx 0.8 and 0.9), because the
/// verdict had turned off each lock's own check. So a pool proven this way
/// (`by_socket`) still checks each session lock on its own connection, as
/// an unproven one does; what the proof buys is the lease statements named
/// (a statement of another client's that a stale verdict lets one bind
/// fails on its shape, and the pool sends its statements unnamed from the
/// first such failure on), the census's matching, and cut-short lease
/// statements cancelled by pid.
pub(crate) async fn proven_by_socket(motion: Detection, ends: Option<Ends>) -> Detection {
    match ends {
        Some(ends) if !motion.transaction && !motion.unproven && held_here_bounded(ends).await => {
            Detection {
                by_socket: true,
                ..found(false, false, motion.statements)
            }
        }
        _ => motion,
    }
}

/// How long the read of this process's sockets may take before it proves
/// nothing: 3 s. It reads the network namespace's whole TCP table, every
/// process's sockets and the closing ones with them. Its first hostile
/// reader measured 176 ms for 25,500 lines in a debug build that parsed
/// every line; with 1 s, a CI run (a busy machine, the suite's many
/// closing connections) missed the proof once on both sqlx versions.
/// Lines are compared as text now, none parsed (`peer::matching_inodes`).
pub(crate) const SOCKET_READ_BOUND: std::time::Duration = std::time::Duration::from_secs(3);

/// The backend and both ends of its TCP connection (NULLs on a Unix
/// socket), as the server sees them.
const ENDS: &str = "SELECT pg_catalog.pg_backend_pid(), \
                    pg_catalog.host(pg_catalog.inet_client_addr()), pg_catalog.inet_client_port(), \
                    pg_catalog.host(pg_catalog.inet_server_addr()), pg_catalog.inet_server_port()";

/// [`held_here`] on tokio's blocking threads (it reads `/proc`), within
/// [`SOCKET_READ_BOUND`]; an error of its own or of the task, or no answer
/// in time, proves nothing (a read past the bound runs on to its end,
/// unread). Outside a tokio runtime (nothing to hand it to) it reads in
/// place.
async fn held_here_bounded(ends: Ends) -> bool {
    let read = match tokio::runtime::Handle::try_current() {
        Ok(rt) => {
            let task = rt.spawn_blocking(move || held_here(&ends));
            match tokio::time::timeout(SOCKET_READ_BOUND, task).await {
                Ok(read) => read,
                Err(_) => {
                    tracing::info!(
                        bound = ?SOCKET_READ_BOUND,
                        "this process's sockets not read within the bound: the connection is not proven direct"
                    );
                    return false;
                }
            }
        }
        Err(_) => Ok(held_here(&ends)),
    };
    match read {
        Ok(Ok(held)) => held,
        Ok(Err(e)) => {
            tracing::info!(
                error = %e,
                "could not read this process's sockets: the connection is not proven direct"
            );
            false
        }
        Err(_) => false,
    }
}

/// The motion probe, behind a proxy, with two live clients of the pool:
/// `a` already ran the first step and was on backend `a_pid`. The clients
/// are left as they were: nothing is set, only `pg_backend_pid()` is asked.
pub(crate) async fn motion(a: &impl Exec, a_pid: i32, b: &impl Exec) -> Result<Detection, Error> {
    let mut motion = Motion::new(2);
    motion.observe(0, a_pid);
    let mut statements = 1;
    let pid = backend_pid(b).await?;
    statements += 1;
    if motion.observe(1, pid) {
        return Ok(found(true, true, statements));
    }
    for _ in 0..MOTION_STATEMENTS {
        // Which client asks next is drawn at random: a pooler whose servers
        // free up in a rhythm (a few busy clients on a small pool) could
        // match a fixed alternation statement for statement.
        let i = usize::from(rand::random::<bool>());
        let pid = match i {
            0 => backend_pid(a).await?,
            _ => backend_pid(b).await?,
        };
        statements += 1;
        if motion.observe(i, pid) {
            return Ok(found(true, true, statements));
        }
    }
    Ok(found(false, true, statements))
}

/// Behind a proxy, when the pool cannot hold the two connections the motion
/// probe needs at once (a pool of 2 has one outside the probe reserve): the
/// mode stays unproven.
pub(crate) fn unproven() -> Detection {
    Detection {
        unproven: true,
        ..found(false, true, 1)
    }
}

fn found(transaction: bool, proxied: bool, statements: usize) -> Detection {
    Detection {
        transaction,
        proxied,
        statements,
        unproven: false,
        by_socket: false,
    }
}

/// A connection that can tell the process id the server announced at its
/// start (the first signal of detection). sqlx keeps it to itself: its
/// connections answer `None`, so detection there runs the motion probe,
/// then looks for the session's TCP ends among this process's sockets
/// ([`proven_by_socket`]; a pool straight to PostgreSQL over a Unix
/// socket stays unproven unless configured `PoolerMode::Direct`).
pub(crate) trait Announced {
    /// The pid announced at connection start, when known.
    fn announced_pid(&self) -> Option<i32>;
}

impl Announced for deadpool_postgres::Client {
    fn announced_pid(&self) -> Option<i32> {
        announced_pid(self)
    }
}

#[cfg(feature = "sqlx-0_8")]
impl Announced for ::sqlx08::PgConnection {
    fn announced_pid(&self) -> Option<i32> {
        None
    }
}

#[cfg(feature = "sqlx-0_9")]
impl Announced for ::sqlx09::PgConnection {
    fn announced_pid(&self) -> Option<i32> {
        None
    }
}

/// The process id announced at connection start (BackendKeyData), read
/// from the cancel request tokio-postgres would send: it is written into
/// memory, nothing goes over the network. `None` if it cannot be read.
pub(crate) fn announced_pid(c: &tokio_postgres::Client) -> Option<i32> {
    let mut out = Vec::with_capacity(32);
    let token = c.cancel_token();
    let write = token.cancel_query_raw(Capture { out: &mut out }, Passthrough);
    // In memory: every poll completes at once.
    let written = futures_util::FutureExt::now_or_never(write)?;
    written.ok()?;
    cancel_request_pid(&out)
}

/// The pid of the CancelRequest in `bytes` (after an SSLRequest, if any).
fn cancel_request_pid(mut bytes: &[u8]) -> Option<i32> {
    const CANCEL: i32 = 80_877_102;
    while bytes.len() >= 8 {
        let len = i32::from_be_bytes(bytes[0..4].try_into().ok()?);
        let code = i32::from_be_bytes(bytes[4..8].try_into().ok()?);
        if code == CANCEL && len == 16 && bytes.len() >= 12 {
            return Some(i32::from_be_bytes(bytes[8..12].try_into().ok()?));
        }
        bytes = bytes.get(usize::try_from(len).ok()?.max(8)..)?;
    }
    None
}

/// An in-memory stream that records what is written and answers an
/// SSLRequest with "S" (the "TLS" that follows is [`Passthrough`]).
struct Capture<'a> {
    out: &'a mut Vec<u8>,
}

impl AsyncRead for Capture<'_> {
    fn poll_read(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if buf.remaining() > 0 {
            buf.put_slice(b"S");
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Capture<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().out.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl TlsStream for Capture<'_> {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

/// A "TLS handshake" that leaves the stream as it is, so that the cancel
/// request reaches [`Capture`] in clear whatever the connection's `sslmode`.
struct Passthrough;

impl<'a> TlsConnect<Capture<'a>> for Passthrough {
    type Stream = Capture<'a>;
    type Error = io::Error;
    type Future = std::future::Ready<Result<Capture<'a>, io::Error>>;

    fn connect(self, stream: Capture<'a>) -> Self::Future {
        std::future::ready(Ok(stream))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_client_on_another_backend_is_motion() {
        let mut m = Motion::new(2);
        assert!(!m.observe(0, 10));
        assert!(!m.observe(1, 11));
        assert!(!m.observe(0, 10));
        assert!(!m.observe(1, 11));
        assert!(m.observe(0, 12), "client 0 moved");
        let mut m = Motion::new(2);
        assert!(!m.observe(0, 10));
        assert!(m.observe(1, 10), "two live clients, one backend");
        let mut m = Motion::new(2);
        assert!(!m.observe(0, 10));
        assert!(!m.observe(1, 11));
        assert!(m.observe(1, 10), "client 1 on client 0's backend");
    }

    #[test]
    fn cancel_request_parsed_after_an_ssl_request() {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&8i32.to_be_bytes());
        bytes.extend_from_slice(&80_877_103i32.to_be_bytes());
        for v in [16i32, 80_877_102, 4242, -7] {
            bytes.extend_from_slice(&v.to_be_bytes());
        }
        assert_eq!(cancel_request_pid(&bytes), Some(4242));
        assert_eq!(cancel_request_pid(&bytes[8..]), Some(4242));
        assert_eq!(cancel_request_pid(&bytes[..19]), None);
        assert_eq!(cancel_request_pid(&[]), None);
        assert_eq!(cancel_request_pid(&[0, 0, 0, 0, 0, 0, 0, 1]), None);
    }
}
