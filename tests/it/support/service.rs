//! Running the `service` example as real processes for the end-to-end tests:
//! build it, start instances, talk HTTP to them, stop them with SIGTERM.
//!
//! Separate processes rather than two apps in the test process: each
//! instance then has its own global metrics recorder (one `/metrics` per
//! instance, as in production), its own pool and lease holder, and receives
//! a real SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub type Error = Box<dyn std::error::Error + Send + Sync>;
pub type Result<T = ()> = std::result::Result<T, Error>;

/// Prints past libtest's capture, so progress shows in `cargo test` output.
#[macro_export]
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

/// The path of the `service` example binary, built once per test process
/// with this crate's features (`cargo build --example service`): a no-op
/// when `cargo test --all-features` built it already.
pub fn service_binary() -> Result<PathBuf> {
    static BIN: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| build().map_err(|e| e.to_string()))
        .clone()
        .map_err(Into::into)
}

/// Builds the example with the test binary's own profile (its directory:
/// `target/<profile>`): never another profile inside a test.
fn build() -> Result<PathBuf> {
    // target/<profile>/deps/<test binary>
    let exe = std::env::current_exe()?;
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .ok_or("cannot locate the target directory from the test binary")?;
    let target_dir = profile_dir
        .parent()
        .ok_or("cannot locate the target directory from the test binary")?;
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "--quiet", "--example", "service", "--all-features"])
        .arg("--manifest-path")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
        .arg("--target-dir")
        .arg(target_dir);
    let release = profile_dir.file_name().is_some_and(|n| n == "release");
    if release {
        cmd.arg("--release");
    }
    let started = Instant::now();
    let out = cmd.output()?;
    if !out.status.success() {
        return Err(format!(
            "cargo build --example service failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let dir = if release {
        target_dir.join("release")
    } else {
        profile_dir.to_owned()
    };
    let bin = dir.join("examples").join("service");
    if !bin.is_file() {
        return Err(format!("{} not found after the build", bin.display()).into());
    }
    say!("built {} in {:.1?}", bin.display(), started.elapsed());
    Ok(bin)
}

/// One running instance of the service.
pub struct Instance {
    pub name: String,
    pub node: String,
    pub addr: SocketAddr,
    child: Child,
    stdout: Arc<Mutex<Vec<String>>>,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Instance {
    /// Starts an instance on `database_url`, listening on a free port, and
    /// waits (at most 30 s) for its "listening on" line.
    pub fn start(
        database_url: &str,
        name: &str,
        node: &str,
        env: &[(&str, &str)],
    ) -> Result<Instance> {
        Instance::start_binary(&service_binary()?, database_url, name, node, env)
    }

    /// [`Instance::start`] with the binary `bin` (e.g. [`service_binary`]).
    pub fn start_binary(
        bin: &Path,
        database_url: &str,
        name: &str,
        node: &str,
        env: &[(&str, &str)],
    ) -> Result<Instance> {
        let dir = tempfile::tempdir()?;
        let log = dir.path().join("stderr.log");
        let mut cmd = Command::new(bin);
        cmd.env("DATABASE_URL", database_url)
            .env("LISTEN_ADDR", "127.0.0.1:0")
            .env("NODE_NAME", node)
            .env("INSTANCE_ID", name)
            .env(
                "RUST_LOG",
                std::env::var("SERVICE_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log)?);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn()?;
        let out = child.stdout.take().ok_or("no stdout pipe")?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
                    if let Some(url) = line.split("listening on http://").nth(1) {
                        let _ = tx.send(url.trim().to_owned());
                    }
                    if let Ok(mut l) = lines.lock() {
                        l.push(line);
                    }
                }
            });
        }
        let mut inst = Instance {
            name: name.to_owned(),
            node: node.to_owned(),
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            child,
            stdout: lines,
            log,
            _dir: dir,
        };
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(a) => inst.addr = a.parse()?,
            Err(_) => {
                return Err(format!(
                    "instance {name} did not report its address in 30 s; stderr:\n{}",
                    inst.log_tail(30)
                )
                .into())
            }
        }
        Ok(inst)
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`…) with kill(1).
    pub fn signal(&self, signal: &str) -> Result {
        let pid = self.child.id().to_string();
        let st = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(&pid)
            .status()?;
        if !st.success() {
            return Err(format!("kill -{signal} {pid} failed").into());
        }
        Ok(())
    }

    /// The last lines of its stderr (the tracing log).
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Its tracing log (stderr) so far, one line each, colour codes taken
    /// out.
    pub fn log_lines(&self) -> Vec<String> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines().map(strip_ansi).collect()
    }

    /// What it printed on stdout so far.
    pub fn stdout(&self) -> Vec<String> {
        self.stdout.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Sends SIGTERM and waits up to `timeout` for it to exit.
    pub fn terminate(&mut self, timeout: Duration) -> Result<ExitStatus> {
        self.signal("TERM")?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                // Let the reader thread see the last lines.
                std::thread::sleep(Duration::from_millis(50));
                return Ok(status);
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "instance {} still running {timeout:?} after SIGTERM; stderr:\n{}",
                    self.name,
                    self.log_tail(30)
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `GET path` on this instance.
    pub fn get(&self, path: &str) -> Result<(u16, String)> {
        http(self.addr, "GET", path)
    }

    /// `POST path` on this instance (empty body).
    pub fn post(&self, path: &str) -> Result<(u16, String)> {
        http(self.addr, "POST", path)
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `line` without its ANSI escape sequences (`ESC [ ... letter`).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// One HTTP/1.1 request with `Connection: close` (the service does not
/// chunk its small answers; `/metrics` is read whole either way).
pub fn http(addr: SocketAddr, method: &str, path: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("no HTTP header end")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or("bad HTTP status line")?;
    Ok((status, body.to_owned()))
}

/// Polls `cond` every 50 ms on this thread until it returns `Some`,
/// failing after `limit`: the blocking wait of the process tests (the async
/// one is [`super::eventually`]).
pub fn wait_for<T>(
    limit: Duration,
    what: &str,
    mut cond: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = cond()? {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            return Err(format!("timed out after {limit:?}: {what}").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
