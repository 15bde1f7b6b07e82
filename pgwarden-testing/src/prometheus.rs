//! A real Prometheus server for tests: scrapes the targets it is given and
//! answers instant queries through its HTTP API.

use std::fmt::Write as _;
use std::fs;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use crate::process::{self, io_err, Watchdog};
use crate::{TestingError, STARTUP_TIMEOUT};

mod http;

use http::{http_get, percent_encode};

/// A throwaway Prometheus (`/usr/bin/prometheus`, Debian package
/// `prometheus`) scraping a fixed list of targets.
///
/// The configuration has one scrape job, `pgwarden`, with static targets;
/// `scrape_interval` and `evaluation_interval` are the interval given to
/// [`Prometheus::start`]. It listens on `127.0.0.1` on a free port, keeps its
/// TSDB and its log in a temporary directory, and is stopped on drop or, if
/// the test process dies first, by its watchdog.
///
/// A freshly started Prometheus takes a few seconds (≈6 s measured here) to
/// return its first scraped sample: poll with [`Prometheus::wait_for_series`]
/// rather than sleeping.
///
/// ```no_run
/// # fn t() -> Result<(), pgwarden_testing::TestingError> {
/// use std::time::Duration;
/// let target: std::net::SocketAddr = "127.0.0.1:8080".parse().unwrap();
/// let prom = pgwarden_testing::Prometheus::start(&[target], Duration::from_secs(1))?;
/// let json = prom.wait_for_series("up{job=\"pgwarden\"} == 1", Duration::from_secs(20))?;
/// assert!(json.contains("\"status\":\"success\""));
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Prometheus {
    child: Child,
    watchdog: Watchdog,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        self.watchdog.disarm();
        process::stop_child(&mut self.child, libc::SIGTERM);
    }
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` (`/metrics` over HTTP) every
    /// `scrape_interval`. Blocks until `/-/ready` answers 200 (at most 30 s).
    ///
    /// The binary is looked up as by [`crate::find_tool`]; when it is missing
    /// the error is [`TestingError::ToolMissing`] (package `prometheus`).
    pub fn start(
        targets: &[SocketAddr],
        scrape_interval: Duration,
    ) -> Result<Prometheus, TestingError> {
        Prometheus::start_with_rules::<&Path>(targets, scrape_interval, &[])
    }

    /// As [`Prometheus::start`], also loading the given rule files (recording
    /// and alerting rules), evaluated every `scrape_interval`.
    pub fn start_with_rules<P: AsRef<Path>>(
        targets: &[SocketAddr],
        scrape_interval: Duration,
        rule_files: &[P],
    ) -> Result<Prometheus, TestingError> {
        let binary = process::find_tool("prometheus").ok_or_else(|| TestingError::ToolMissing {
            tool: "prometheus".to_owned(),
            package: "prometheus".to_owned(),
        })?;
        let mut rules = Vec::new();
        for r in rule_files {
            let r = r.as_ref();
            let abs = fs::canonicalize(r)
                .map_err(io_err(format!("resolving the rule file {}", r.display())))?;
            rules.push(abs);
        }
        let dir = process::temp_dir("pgwarden-prom-", None)?;
        let root = dir.path().to_path_buf();
        let config = root.join("prometheus.yml");
        fs::write(&config, config_yaml(targets, scrape_interval, &rules))
            .map_err(io_err(format!("writing {}", config.display())))?;
        let mut watchdog = Watchdog::spawn(&root, "TERM")?;

        let (child, port) = process::start_on_free_port(
            "prometheus",
            &mut watchdog,
            |port| {
                let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
                let (out, err) = process::log_file(&root.join("prometheus.log"))?;
                process::server_command(&binary, None, &root)
                    .arg(format!("--config.file={}", config.display()))
                    .arg(format!(
                        "--storage.tsdb.path={}",
                        root.join("data").display()
                    ))
                    .arg(format!("--web.listen-address={addr}"))
                    .stdout(out)
                    .stderr(err)
                    .spawn()
                    .map_err(io_err(format!("spawning {}", binary.display())))
            },
            |child, port| {
                let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
                wait_ready_child(child, &root, addr, STARTUP_TIMEOUT)
            },
        )?;
        Ok(Prometheus {
            child,
            watchdog,
            addr: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
            dir,
        })
    }

    /// The address Prometheus listens on (`127.0.0.1:<port>`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its base URL, `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Prometheus's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The temporary directory holding `prometheus.yml`, `prometheus.log`
    /// and the TSDB (`data/`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The end of Prometheus's log.
    pub fn log_tail(&self, lines: usize) -> String {
        process::log_tail(&[self.dir.path().join("prometheus.log")], lines)
    }

    /// Polls `/-/ready` until it answers 200, at most `timeout`.
    /// ([`Prometheus::start`] has done this once already.)
    pub fn wait_ready(&self, timeout: Duration) -> Result<(), TestingError> {
        let deadline = Instant::now() + timeout;
        loop {
            let last = match http_get(self.addr, "/-/ready") {
                Ok((200, _)) => return Ok(()),
                Ok((status, body)) => format!("HTTP {status}: {}", body.trim()),
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                return Err(TestingError::Startup {
                    program: "prometheus".to_owned(),
                    reason: format!("not ready after {timeout:?} (last: {last})"),
                    log_tail: self.log_tail(40),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A GET of `path_and_query` (e.g. `/api/v1/targets`): the body of a
    /// 2xx answer; any other status is an error carrying the body.
    pub fn get(&self, path_and_query: &str) -> Result<String, TestingError> {
        match http_get(self.addr, path_and_query) {
            Ok((status, body)) if (200..300).contains(&status) => Ok(body),
            Ok((status, body)) => Err(io_err(format!("GET {path_and_query} on Prometheus"))(
                io::Error::other(format!("HTTP {status}: {}", body.trim())),
            )),
            Err(e) => Err(io_err(format!("GET {path_and_query} on Prometheus"))(e)),
        }
    }

    /// An instant query (`/api/v1/query?query=…`, evaluated now): the JSON
    /// body of the answer, `{"status":"success","data":{"resultType":…,
    /// "result":[…]}}`. An expression that does not parse is an error (HTTP
    /// 400) whose message carries Prometheus's explanation.
    pub fn query(&self, expr: &str) -> Result<String, TestingError> {
        self.get(&format!("/api/v1/query?query={}", percent_encode(expr)))
    }

    /// Polls [`Prometheus::query`] until the result holds at least one
    /// series (or a scalar/string), at most `timeout`; returns that body.
    /// Use it to wait for the first scrape instead of sleeping.
    pub fn wait_for_series(&self, expr: &str, timeout: Duration) -> Result<String, TestingError> {
        let deadline = Instant::now() + timeout;
        loop {
            let last = self.query(expr)?;
            if !last.contains("\"result\":[]") {
                return Ok(last);
            }
            if Instant::now() >= deadline {
                return Err(io_err(format!("waiting for `{expr}` on Prometheus"))(
                    io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("no series after {timeout:?} (last answer: {last})"),
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Renders a duration the way Prometheus's configuration reads it.
fn prom_duration(d: Duration) -> String {
    format!("{}ms", d.as_millis().max(1))
}

/// A YAML double-quoted string.
fn yaml_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn config_yaml(targets: &[SocketAddr], interval: Duration, rules: &[PathBuf]) -> String {
    let every = prom_duration(interval);
    let mut y = format!(
        "global:\n  scrape_interval: {every}\n  scrape_timeout: {every}\n  evaluation_interval: {every}\n"
    );
    if !rules.is_empty() {
        y.push_str("rule_files:\n");
        for r in rules {
            let _ = writeln!(y, "  - {}", yaml_str(&r.display().to_string()));
        }
    }
    y.push_str("scrape_configs:\n  - job_name: pgwarden\n    static_configs:\n      - targets: [");
    let list: Vec<String> = targets.iter().map(|t| yaml_str(&t.to_string())).collect();
    y.push_str(&list.join(", "));
    y.push_str("]\n");
    y
}

/// Polls `/-/ready` of a starting child. On failure: the error, and whether
/// another port is worth a try.
fn wait_ready_child(
    child: &mut Child,
    root: &Path,
    addr: SocketAddr,
    timeout: Duration,
) -> Result<(), (TestingError, bool)> {
    let log = || process::log_tail(&[root.join("prometheus.log")], 40);
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let log_tail = log();
            let retry = log_tail.contains("address already in use");
            return Err((
                TestingError::Startup {
                    program: "prometheus".to_owned(),
                    reason: format!("exited with {status}"),
                    log_tail,
                },
                retry,
            ));
        }
        let last = match http_get(addr, "/-/ready") {
            Ok((200, _)) => return Ok(()),
            Ok((status, body)) => format!("HTTP {status}: {}", body.trim()),
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            return Err((
                TestingError::Startup {
                    program: "prometheus".to_owned(),
                    reason: format!("not ready after {timeout:?} (last: {last})"),
                    log_tail: log(),
                },
                false,
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_names_targets_interval_and_rules() {
        let y = config_yaml(
            &["127.0.0.1:9000".parse().unwrap()],
            Duration::from_secs(1),
            &[PathBuf::from("/x/alerts.yml")],
        );
        assert!(y.contains("scrape_interval: 1000ms"));
        assert!(y.contains("evaluation_interval: 1000ms"));
        assert!(y.contains("job_name: pgwarden"));
        assert!(y.contains("targets: [\"127.0.0.1:9000\"]"));
        assert!(y.contains("  - \"/x/alerts.yml\""));
    }
}
