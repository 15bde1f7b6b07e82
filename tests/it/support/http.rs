//! A plain async HTTP/1.1 client over `tokio::net::TcpStream`, for the HTTP
//! tests and the HTTP benchmark (`benches/workloads/http.rs` includes this
//! file): one request per connection (`Connection: close`, the answer read
//! to the end) or requests on a kept-alive connection ([`KeepAlive`]), each
//! timed from the request's first byte to the answer's last.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// One answer.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    /// Header names lower-cased, in order.
    pub headers: Vec<(String, String)>,
    pub body: String,
    /// From writing the request (connected already) to the answer's end.
    pub took: Duration,
}

impl Reply {
    /// The first header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// A header parsed as a number.
    pub fn header_u64(&self, name: &str) -> Option<u64> {
        self.header(name).and_then(|v| v.parse().ok())
    }
}

/// Connects (bounded by 5 s).
pub async fn connect(addr: SocketAddr) -> Result<TcpStream> {
    let s = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
        .await
        .map_err(|_| format!("connecting to {addr} took over 5 s"))??;
    s.set_nodelay(true)?;
    Ok(s)
}

/// Sends `method path` on a connected stream and reads the answer, all of
/// it within `limit`.
pub async fn send(mut s: TcpStream, method: &str, path: &str, limit: Duration) -> Result<Reply> {
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    let start = Instant::now();
    let io = async {
        s.write_all(req.as_bytes()).await?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await?;
        Ok::<_, std::io::Error>(raw)
    };
    let raw = tokio::time::timeout(limit, io)
        .await
        .map_err(|_| format!("{method} {path}: no complete answer within {limit:?}"))??;
    let took = start.elapsed();
    parse(&raw, took)
}

/// A kept-alive HTTP/1.1 connection: requests one after another, each
/// answer read by its `Content-Length`.
pub struct KeepAlive {
    stream: tokio::io::BufReader<TcpStream>,
}

impl KeepAlive {
    pub async fn connect(addr: SocketAddr) -> Result<KeepAlive> {
        Ok(KeepAlive {
            stream: tokio::io::BufReader::new(connect(addr).await?),
        })
    }

    /// Sends `method path` and reads its answer, within `limit`. After an
    /// error, or an answer with `Connection: close`, connect again.
    pub async fn send(&mut self, method: &str, path: &str, limit: Duration) -> Result<Reply> {
        use tokio::io::AsyncBufReadExt;
        let req = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\n\r\n");
        let start = Instant::now();
        let s = &mut self.stream;
        let io = async {
            s.get_mut().write_all(req.as_bytes()).await?;
            let mut head = String::new();
            loop {
                let n = s.read_line(&mut head).await?;
                if n == 0 {
                    return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
                }
                if head.ends_with("\r\n\r\n") {
                    break;
                }
            }
            let len = head
                .lines()
                .filter_map(|l| l.split_once(':'))
                .find(|(n, _)| n.trim().eq_ignore_ascii_case("content-length"))
                .and_then(|(_, v)| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            let mut body = vec![0; if method == "HEAD" { 0 } else { len }];
            s.read_exact(&mut body).await?;
            let mut raw = head.into_bytes();
            raw.extend_from_slice(&body);
            Ok::<_, std::io::Error>(raw)
        };
        let raw = tokio::time::timeout(limit, io)
            .await
            .map_err(|_| format!("{method} {path}: no complete answer within {limit:?}"))??;
        parse(&raw, start.elapsed())
    }
}

/// Connects and sends, within `limit` for the answer.
pub async fn request(addr: SocketAddr, method: &str, path: &str, limit: Duration) -> Result<Reply> {
    send(connect(addr).await?, method, path, limit).await
}

fn parse(raw: &[u8], took: Duration) -> Result<Reply> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no HTTP header end in {text:?}"))?;
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("bad status line in {head:?}"))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Ok(Reply {
        status,
        headers,
        body: body.to_owned(),
        took,
    })
}

/// The value of the sample `name{labels}` in Prometheus text (labels in
/// the exporter's order, e.g. `pool="service",lane="request"`).
pub fn sample(metrics: &str, name: &str, labels: &str) -> Option<f64> {
    metrics.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        let rest = rest.strip_prefix('{')?;
        let (ls, v) = rest.split_once("} ")?;
        let mut want: Vec<&str> = labels.split(',').collect();
        let mut have: Vec<&str> = ls.split(',').collect();
        want.sort_unstable();
        have.sort_unstable();
        (want == have).then(|| v.trim().parse().ok()).flatten()
    })
}
