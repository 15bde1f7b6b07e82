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

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

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

/// One address of `/proc/net/tcp{,6}`: `0100007F:1538` (an IPv4 address
/// as the kernel's 32-bit word, in this machine's byte order, then the
/// port) or 32 hex digits (four such words) and the port.
fn proc_addr(s: &str) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |hex: &str| u32::from_str_radix(hex, 16).ok().map(u32::to_ne_bytes);
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(ip)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_mut(4).enumerate() {
                chunk.copy_from_slice(&word(ip.get(i * 8..i * 8 + 8)?)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(canonical(ip), port))
}

/// The inodes of the sockets in a `/proc/net/tcp{,6}` table whose local
/// end is `ends.client` and remote end `ends.server` (the header line and
/// lines that do not parse are skipped).
fn matching_inodes(table: &str, ends: &Ends) -> Vec<u64> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local = proc_addr(fields.get(1)?)?;
            let remote = proc_addr(fields.get(2)?)?;
            let inode = fields.get(9)?.parse::<u64>().ok()?;
            (local == ends.client && remote == ends.server && inode != 0).then_some(inode)
        })
        .collect()
}

/// Whether this process holds the TCP socket of `ends`: `Ok(false)` when
/// no socket of the namespace has those ends or this process holds none
/// of them. Blocking file reads of `/proc` (run it off the async threads).
#[cfg(target_os = "linux")]
pub(crate) fn held_here(ends: &Ends) -> std::io::Result<bool> {
    let mut inodes = Vec::new();
    for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        match std::fs::read_to_string(table) {
            Ok(text) => inodes.extend(matching_inodes(&text, ends)),
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
    fn proc_addresses_parse_in_the_kernels_byte_order() {
        let v4 = u32::from_ne_bytes([127, 0, 0, 1]);
        assert_eq!(
            proc_addr(&format!("{v4:08X}:1538")),
            Some("127.0.0.1:5432".parse().unwrap())
        );
        let loopback6: String = Ipv6Addr::LOCALHOST
            .octets()
            .chunks(4)
            .map(|c| format!("{:08X}", u32::from_ne_bytes(c.try_into().unwrap())))
            .collect();
        assert_eq!(
            proc_addr(&format!("{loopback6}:0050")),
            Some("[::1]:80".parse().unwrap())
        );
        // A mapped IPv4 address is the IPv4 address.
        let mapped: String = Ipv4Addr::new(10, 1, 2, 3)
            .to_ipv6_mapped()
            .octets()
            .chunks(4)
            .map(|c| format!("{:08X}", u32::from_ne_bytes(c.try_into().unwrap())))
            .collect();
        assert_eq!(
            proc_addr(&format!("{mapped}:1538")),
            Some("10.1.2.3:5432".parse().unwrap())
        );
        for bad in [
            "",
            "0100007F",
            "0100007F:",
            "XYZ:1538",
            "0100:1538",
            "0100007F:123456",
        ] {
            assert_eq!(proc_addr(bad), None, "{bad:?}");
        }
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
    /// them: the same ends reversed (the listener's accepted side is ours
    /// too, so reversed they match: the check is of ends, not of which
    /// side), another port, or a socket of another process are not.
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
