//! A proof of a direct connection for clients that do not show the pid the
//! server announced (sqlx): the session's TCP connection, as the server
//! sees it, is a socket of this very process (with no motion seen).
//!
//! The server tells a session both ends of its TCP connection
//! (`inet_client_addr()`, `inet_client_port()`, `inet_server_addr()`,
//! `inet_server_port()`: no privilege needed, on a standby too). Within one
//! network namespace a TCP connection's four values name one connection.
//! When this process holds a socket whose local end is the server's client
//! end and whose remote end is the server's own end, nothing sits between
//! this process and the backend on that connection: a pooler or any other
//! proxy opens its own connection to the server, from its own socket, in
//! its own process (PgBouncer, a sidecar, a port forwarder on the same
//! host: the server sees the forwarder's end, which this process does not
//! hold). A forwarder in this very process (a test's fault-injecting
//! proxy) carries one client connection on one server connection: a
//! session kept, which is all the proof is for.
//!
//! The server's four values are of *its* network namespace, and this
//! process reads its own: a pooler beside the server that reaches it over
//! loopback shows ends (`127.0.0.1:Q` to `127.0.0.1:5432`) that a socket of
//! this process in another namespace can share by chance. So a match is
//! taken as proof only after the motion probe saw no motion
//! (`probe::proven_by_socket`): never behind a transaction pooler.
//!
//! A connection it cannot match (a Unix socket, the server's addresses
//! rewritten by NAT, a system without `/proc`, a `/proc` that cannot be
//! read) proves nothing: the motion probe's verdict stands, unproven.
//!
//! Read on Linux from `/proc/self/net/tcp`, `/proc/self/net/tcp6` (every
//! socket of the process's network namespace, with its inode) and
//! `/proc/self/fd` (which of those inodes this process holds).

use std::net::{IpAddr, SocketAddr};

/// Both ends of a session's TCP connection, as the server sees them.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ends {
    /// The client's end (`inet_client_addr()`, `inet_client_port()`).
    pub(crate) client: SocketAddr,
    /// The server's end (`inet_server_addr()`, `inet_server_port()`).
    pub(crate) server: SocketAddr,
}

impl Ends {
    /// From the server's text of each address (`host(inet_…_addr())`) and
    /// its port; `None` for a Unix-socket session (NULLs) or a value that
    /// does not parse.
    pub(crate) fn from_server(
        client: Option<&str>,
        client_port: Option<i32>,
        server: Option<&str>,
        server_port: Option<i32>,
    ) -> Option<Ends> {
        let end = |addr: Option<&str>, port: Option<i32>| -> Option<SocketAddr> {
            let ip: IpAddr = addr?.parse().ok()?;
            let port = u16::try_from(port?).ok()?;
            Some(SocketAddr::new(canonical(ip), port))
        };
        Some(Ends {
            client: end(client, client_port)?,
            server: end(server, server_port)?,
        })
    }
}

/// An IPv4 address mapped into IPv6 (`::ffff:a.b.c.d`, a dual-stack
/// socket's view of an IPv4 peer) as the IPv4 address it is.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// `addr` as the kernel writes it in `/proc/net/tcp` (`v6` false: an
/// IPv4 address as its 32-bit word in this machine's byte order, `%08X`,
/// then `:` and the port, `%04X`) or `/proc/net/tcp6` (`v6`: four such
/// words; an IPv4 address mapped, as a dual-stack socket holds it).
/// `None` for an IPv6 address in the IPv4 table.
fn proc_text(addr: SocketAddr, v6: bool) -> Option<String> {
    let word = |b: &[u8]| match b {
        [a, b, c, d] => format!("{:08X}", u32::from_ne_bytes([*a, *b, *c, *d])),
        _ => String::new(),
    };
    let ip: String = match (addr.ip(), v6) {
        (IpAddr::V4(ip), false) => word(&ip.octets()),
        (IpAddr::V4(ip), true) => ip.to_ipv6_mapped().octets().chunks(4).map(word).collect(),
        (IpAddr::V6(ip), true) => ip.octets().chunks(4).map(word).collect(),
        (IpAddr::V6(_), false) => return None,
    };
    Some(format!("{ip}:{:04X}", addr.port()))
}

/// The inodes of the sockets in a `/proc/net/tcp{,6}` table (`v6`) whose
/// local end is `ends.client` and remote end `ends.server`: each line's
/// two address fields compared as text with those ends written the
/// kernel's way, nothing parsed or allocated per line (a namespace's
/// table holds every process's sockets and the closing ones: tens of
/// thousands of lines on a busy host). The header line, and lines that do
/// not have the fields, are skipped; a closing socket (inode 0) is none.
fn matching_inodes(table: &str, ends: &Ends, v6: bool) -> Vec<u64> {
    let (Some(local), Some(remote)) = (proc_text(ends.client, v6), proc_text(ends.server, v6))
    else {
        return Vec::new();
    };
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            // sl, local, remote, st, tx:rx, tr:when, retrnsmt, uid, timeout, inode
            let mut fields = line.split_whitespace();
            let (l, r) = (fields.nth(1)?, fields.next()?);
            if !l.eq_ignore_ascii_case(&local) || !r.eq_ignore_ascii_case(&remote) {
                return None;
            }
            let inode = fields.nth(6)?.parse::<u64>().ok()?;
            (inode != 0).then_some(inode)
        })
        .collect()
}

/// Whether this process holds the TCP socket of `ends`: `Ok(false)` when
/// no socket of the namespace has those ends or this process holds none
/// of them. Blocking file reads of `/proc` (run it off the async threads).
#[cfg(target_os = "linux")]
pub(crate) fn held_here(ends: &Ends) -> std::io::Result<bool> {
    let mut inodes = Vec::new();
    for (table, v6) in [("/proc/self/net/tcp", false), ("/proc/self/net/tcp6", true)] {
        // IPv6 ends are only in the IPv6 table; IPv4 ends found in the
        // IPv4 table need no look at the other (a dual-stack socket's
        // mapped ends are only there).
        if (!v6 && ends.client.is_ipv6()) || (v6 && !inodes.is_empty()) {
            continue;
        }
        match std::fs::read_to_string(table) {
            Ok(text) => inodes.extend(matching_inodes(&text, ends, v6)),
            // No IPv6 in this kernel: its table is missing.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    if inodes.is_empty() {
        return Ok(false);
    }
    let wanted: Vec<String> = inodes.iter().map(|i| format!("socket:[{i}]")).collect();
    for entry in std::fs::read_dir("/proc/self/fd")? {
        // An fd closed while the directory is read is skipped.
        let Ok(entry) = entry else { continue };
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if wanted.iter().any(|w| target.as_os_str() == w.as_str()) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Elsewhere nothing is proven.
#[cfg(not(target_os = "linux"))]
pub(crate) fn held_here(_: &Ends) -> std::io::Result<bool> {
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_written_as_the_kernel_writes_them() {
        let word = |b: [u8; 4]| format!("{:08X}", u32::from_ne_bytes(b));
        let v4: SocketAddr = "127.0.0.1:5432".parse().unwrap();
        assert_eq!(
            proc_text(v4, false),
            Some(format!("{}:1538", word([127, 0, 0, 1])))
        );
        // In the IPv6 table, mapped: ::ffff:127.0.0.1.
        assert_eq!(
            proc_text(v4, true),
            Some(format!(
                "{}{}{}{}:1538",
                word([0; 4]),
                word([0; 4]),
                word([0, 0, 0xff, 0xff]),
                word([127, 0, 0, 1])
            ))
        );
        let v6: SocketAddr = "[::1]:80".parse().unwrap();
        assert_eq!(
            proc_text(v6, true),
            Some(format!(
                "{}{}{}{}:0050",
                word([0; 4]),
                word([0; 4]),
                word([0; 4]),
                word([0, 0, 0, 1])
            ))
        );
        assert_eq!(proc_text(v6, false), None);
        // A table's line: found by both ends, its inode read; a closing
        // socket (inode 0), a line cut short and the header are not.
        let ends = Ends {
            client: "127.0.0.1:40000".parse().unwrap(),
            server: v4,
        };
        let (l, r) = (
            proc_text(ends.client, false).unwrap(),
            proc_text(ends.server, false).unwrap(),
        );
        let table = format!(
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
             \x20  0: {l} {r} 01 00000000:00000000 00:00000000 00000000     0        0 4242 1 0 20 4 30 10 -1\n\
             \x20  1: {r} {l} 01 00000000:00000000 00:00000000 00000000   100        0 4343 1 0 20 4 30 10 -1\n\
             \x20  2: {l} {r} 06 00000000:00000000 03:00000DB3 00000000     0        0 0 3 0\n\
             \x20  3: {l} {r}\n"
        );
        assert_eq!(matching_inodes(&table, &ends, false), vec![4242]);
        assert_eq!(matching_inodes(&table, &ends, true), Vec::<u64>::new());
    }

    #[test]
    fn ends_from_the_servers_text() {
        let e = Ends::from_server(
            Some("::ffff:127.0.0.1"),
            Some(40000),
            Some("127.0.0.1"),
            Some(5432),
        );
        assert_eq!(
            e,
            Some(Ends {
                client: "127.0.0.1:40000".parse().unwrap(),
                server: "127.0.0.1:5432".parse().unwrap(),
            })
        );
        // A Unix-socket session: NULLs.
        assert_eq!(Ends::from_server(None, None, None, None), None);
        assert_eq!(
            Ends::from_server(Some("x"), Some(1), Some("127.0.0.1"), Some(1)),
            None
        );
        assert_eq!(
            Ends::from_server(Some("127.0.0.1"), Some(-1), Some("127.0.0.1"), Some(1)),
            None
        );
    }

    /// A socket of this process is found by its two ends, and only by
    /// them: with another local port it is not, nor once it is closed.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_socket_of_this_process_is_found_by_its_ends_and_only_by_them() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_accepted, _) = listener.accept().unwrap();
        let ends = Ends {
            client: client.local_addr().unwrap(),
            server: client.peer_addr().unwrap(),
        };
        assert!(held_here(&ends).unwrap(), "{ends:?}");
        let mut other_port = ends;
        other_port
            .client
            .set_port(ends.client.port().wrapping_add(1).max(1));
        assert!(!held_here(&other_port).unwrap(), "{other_port:?}");
        drop(client);
        drop(_accepted);
        // Closed: the table may still list it (TIME_WAIT has no inode) but
        // no fd of this process holds it.
        assert!(!held_here(&ends).unwrap(), "closed: {ends:?}");
    }
}
