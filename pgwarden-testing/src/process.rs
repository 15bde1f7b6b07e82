//! Process plumbing shared by the PostgreSQL and PgBouncer harnesses: finding
//! binaries, the `postgres` system user, watchdogs, stopping children, a tiny
//! wire-protocol readiness probe and log tails.

use std::ffi::CString;
use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use crate::TestingError;

mod children;

pub(crate) use children::{stop_child, wait_for_exit, Watchdog};

/// Wraps an `io::Error` with what we were doing.
pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> TestingError {
    let context = context.into();
    move |source| TestingError::Io {
        context,
        source: Arc::new(source),
    }
}

/// The uid/gid server processes run as when this process is root
/// (PostgreSQL and PgBouncer both refuse to run as root).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RunAs {
    pub(crate) uid: u32,
    pub(crate) gid: u32,
}

/// `Some(postgres user)` when running as root, `None` otherwise.
pub(crate) fn run_as() -> Result<Option<RunAs>, TestingError> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    lookup_user("postgres").map(Some)
}

fn lookup_user(name: &str) -> Result<RunAs, TestingError> {
    let no_user = || TestingError::NoUser {
        name: name.to_owned(),
    };
    let cname = CString::new(name).map_err(|_| no_user())?;
    let mut buf: Vec<libc::c_char> = vec![0; 16 * 1024];
    loop {
        // SAFETY: `passwd` is a plain C struct for which all-zero is a valid value.
        let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the duration of the call and
        // `buf.len()` is the real size of `buf`.
        let rc = unsafe {
            libc::getpwnam_r(
                cname.as_ptr(),
                &mut pwd,
                buf.as_mut_ptr(),
                buf.len(),
                &mut result,
            )
        };
        if rc == libc::ERANGE && buf.len() < (1 << 20) {
            buf.resize(buf.len() * 2, 0);
            continue;
        }
        if rc != 0 {
            return Err(io_err(format!("looking up the `{name}` system user"))(
                io::Error::from_raw_os_error(rc),
            ));
        }
        if result.is_null() {
            return Err(no_user());
        }
        return Ok(RunAs {
            uid: pwd.pw_uid,
            gid: pwd.pw_gid,
        });
    }
}

/// Changes the owner of `path` to `run_as`, when set.
pub(crate) fn chown(path: &Path, run_as: Option<RunAs>) -> Result<(), TestingError> {
    if let Some(u) = run_as {
        std::os::unix::fs::chown(path, Some(u.uid), Some(u.gid)).map_err(io_err(format!(
            "chown {} to the postgres user",
            path.display()
        )))?;
    }
    Ok(())
}

/// A command for a server-side program: runs as `run_as` (when root), in its
/// own process group (a Ctrl-C aimed at the test run does not hit it; its
/// watchdog stops it), with no stdin and without `PG*` variables that could
/// redirect it.
pub(crate) fn server_command(program: &Path, run_as: Option<RunAs>, cwd: &Path) -> Command {
    let mut cmd = Command::new(program);
    if let Some(u) = run_as {
        // std drops supplementary groups (setgroups(0)) when root sets a uid.
        cmd.uid(u.uid).gid(u.gid);
    }
    cmd.process_group(0).current_dir(cwd).stdin(Stdio::null());
    for var in [
        "PGDATA",
        "PGPORT",
        "PGHOST",
        "PGUSER",
        "PGDATABASE",
        "PGOPTIONS",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// Opens (creating, appending) a file to receive a child's stdout/stderr.
pub(crate) fn log_file(path: &Path) -> Result<(Stdio, Stdio), TestingError> {
    let f = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io_err(format!("opening {}", path.display())))?;
    let g = f
        .try_clone()
        .map_err(io_err(format!("duplicating {}", path.display())))?;
    Ok((Stdio::from(f), Stdio::from(g)))
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

fn path_dirs() -> Vec<PathBuf> {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default()
}

/// `/usr/lib/postgresql/<version>/bin`, highest version first.
fn debian_pg_bindirs() -> Vec<PathBuf> {
    let mut found: Vec<(Vec<u64>, PathBuf)> = Vec::new();
    if let Ok(entries) = fs::read_dir("/usr/lib/postgresql") {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let version: Vec<u64> = name.split('.').filter_map(|p| p.parse().ok()).collect();
            if version.is_empty() {
                continue;
            }
            found.push((version, entry.path().join("bin")));
        }
    }
    found.sort_by(|a, b| b.0.cmp(&a.0));
    found.into_iter().map(|(_, dir)| dir).collect()
}

/// `initdb` and `postgres`, from the same directory.
#[derive(Clone, Debug)]
pub(crate) struct PgBinaries {
    pub(crate) initdb: PathBuf,
    pub(crate) postgres: PathBuf,
}

/// `$PGWARDEN_PG_BINDIR`, else the first `PATH` directory holding both
/// `initdb` and `postgres`, else the highest `/usr/lib/postgresql/*/bin`.
pub(crate) fn find_pg_binaries() -> Result<PgBinaries, TestingError> {
    let mut candidates = Vec::new();
    if let Some(dir) = std::env::var_os("PGWARDEN_PG_BINDIR").filter(|d| !d.is_empty()) {
        candidates.push(PathBuf::from(dir));
    }
    candidates.extend(path_dirs());
    candidates.extend(debian_pg_bindirs());
    let mut searched = Vec::new();
    for dir in candidates {
        let initdb = dir.join("initdb");
        let postgres = dir.join("postgres");
        if is_executable(&initdb) && is_executable(&postgres) {
            return Ok(PgBinaries { initdb, postgres });
        }
        if !searched.contains(&dir) {
            searched.push(dir);
        }
    }
    if !searched
        .iter()
        .any(|d| d.starts_with("/usr/lib/postgresql"))
    {
        searched.push(PathBuf::from("/usr/lib/postgresql/*/bin"));
    }
    Err(TestingError::NoBinaries { searched })
}

/// `PATH`, then the sbin directories (often not on a non-root `PATH`), then
/// the PostgreSQL bin directories.
pub(crate) fn find_tool(name: &str) -> Option<PathBuf> {
    if name.is_empty() || name.contains('/') {
        let p = PathBuf::from(name);
        return is_executable(&p).then_some(p);
    }
    path_dirs()
        .into_iter()
        .chain(
            ["/usr/local/sbin", "/usr/sbin", "/sbin"]
                .iter()
                .map(PathBuf::from),
        )
        .chain(debian_pg_bindirs())
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

/// Outcome of [`probe`].
#[derive(Debug)]
pub(crate) enum Probe {
    /// The server answered the startup message with an authentication request/ok.
    Ready,
    /// The server answered with an error (e.g. "the database system is starting up").
    NotReady(String),
}

/// Sends a protocol 3.0 startup message and reads the first reply.
pub(crate) fn probe<S: Read + Write>(mut s: S, user: &str, db: &str) -> io::Result<Probe> {
    let mut body = 196_608_i32.to_be_bytes().to_vec();
    for (k, v) in [("user", user), ("database", db)] {
        body.extend_from_slice(k.as_bytes());
        body.push(0);
        body.extend_from_slice(v.as_bytes());
        body.push(0);
    }
    body.push(0);
    let len = i32::try_from(body.len() + 4)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "startup message too long"))?;
    let mut msg = len.to_be_bytes().to_vec();
    msg.extend_from_slice(&body);
    s.write_all(&msg)?;
    let mut head = [0u8; 5];
    s.read_exact(&mut head)?;
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if !(4..=1 << 20).contains(&len) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad message length {len}"),
        ));
    }
    let mut rest = vec![0u8; len - 4];
    s.read_exact(&mut rest)?;
    match head[0] {
        b'R' => {
            // Terminate, politely.
            let _ = s.write_all(&[b'X', 0, 0, 0, 4]);
            Ok(Probe::Ready)
        }
        b'E' => {
            let message = rest
                .split(|b| *b == 0)
                .find(|f| f.first() == Some(&b'M'))
                .map(|f| String::from_utf8_lossy(&f[1..]).into_owned())
                .unwrap_or_else(|| "error".to_owned());
            Ok(Probe::NotReady(message))
        }
        other => Ok(Probe::NotReady(format!(
            "unexpected first message type {:?}",
            other as char
        ))),
    }
}

/// The last `lines` lines of each file (files of a directory, in name order),
/// each headed by its path.
pub(crate) fn log_tail(paths: &[PathBuf], lines: usize) -> String {
    let mut files = Vec::new();
    for p in paths {
        if p.is_dir() {
            let mut inner: Vec<PathBuf> = fs::read_dir(p)
                .map(|rd| rd.flatten().map(|e| e.path()).collect())
                .unwrap_or_default();
            inner.sort();
            files.extend(inner);
        } else if p.is_file() {
            files.push(p.clone());
        }
    }
    let mut out = String::new();
    for f in files {
        let Ok(bytes) = fs::read(&f) else { continue };
        let text = String::from_utf8_lossy(&bytes);
        let all: Vec<&str> = text.lines().collect();
        if all.is_empty() {
            continue;
        }
        out.push_str(&format!("==> {} <==\n", f.display()));
        for line in &all[all.len().saturating_sub(lines)..] {
            out.push_str(line);
            out.push('\n');
        }
    }
    if out.is_empty() {
        out.push_str("(no log output)");
    }
    out
}

/// A base directory for temp dirs, chosen once per process:
///
/// 1. `PGWARDEN_TEST_TMPDIR`, when set and not empty: a directory the
///    server user can reach, at most 60 bytes long (else an error that
///    names the variable and what is wrong);
/// 2. else `/dev/shm`, when it is a tmpfs with at least [`SHM_FREE_MIN`]
///    free, and twice that in `MemAvailable`: the servers' files live in
///    memory. A test run creates and drops about a thousand databases and
///    writes gigabytes of WAL: on a quiet
///    2-core machine `tests/it` on 8 threads took 161.9 s and 246
///    CPU-seconds with its servers on ext4, 147.6 s and 210 on tmpfs, one
///    run after the other (stop 45). A container's `/dev/shm` is often
///    64 MB: too small, so skipped;
/// 3. else `std::env::temp_dir()`, unless we run as root and the server
///    user could not reach it, or a Unix socket path in it would be too
///    long; then `/tmp`.
///
/// Chosen once for the servers run as another user and once for those run
/// as this one (Prometheus): a choice made first for the latter was never
/// checked for the former.
pub(crate) fn temp_base(run_as: Option<RunAs>) -> Result<PathBuf, TestingError> {
    static BASE: [std::sync::OnceLock<Result<PathBuf, String>>; 2] =
        [std::sync::OnceLock::new(), std::sync::OnceLock::new()];
    BASE[usize::from(run_as.is_some())]
        .get_or_init(|| choose_temp_base(run_as, std::env::var_os("PGWARDEN_TEST_TMPDIR")))
        .clone()
        .map_err(|reason| TestingError::Io {
            context: reason,
            source: Arc::new(io::Error::from(io::ErrorKind::InvalidInput)),
        })
}

/// The free space `/dev/shm` needs before the harness puts servers there:
/// `tests/it` peaked at 489 MB in it on 8 threads and 643 MB on 12 (each
/// test's database dropped when the test is done, the shared server's WAL
/// capped by `max_wal_size`, the failover clusters and PgBouncers' own
/// servers); three times that leaves room for a neighbour. The memory the
/// kernel reports available must be twice this too: a tmpfs's free space
/// is a limit, not memory set aside (a full one makes the server PANIC,
/// `No space left on device`, and every later test of the binary fail).
pub(crate) const SHM_FREE_MIN: u64 = 2 << 30;

/// The longest directory the harness puts servers under: their Unix
/// sockets (`<dir>/pgwarden-pg-XXXXXX/.s.PGSQL.<port>`) must fit in 107
/// bytes.
const MAX_BASE_LEN: usize = 60;

fn choose_temp_base(
    run_as: Option<RunAs>,
    chosen: Option<std::ffi::OsString>,
) -> Result<PathBuf, String> {
    if let Some(dir) = chosen.filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        let named = format!("PGWARDEN_TEST_TMPDIR={}", dir.display());
        if !dir.is_dir() {
            return Err(format!("{named}: not a directory"));
        }
        if dir.as_os_str().len() > MAX_BASE_LEN {
            return Err(format!(
                "{named}: longer than {MAX_BASE_LEN} bytes (the servers' Unix socket paths must fit in 107)"
            ));
        }
        if !reachable(&dir, run_as) {
            return Err(format!(
                "{named}: the postgres user cannot reach it (every directory above it needs o+x)"
            ));
        }
        return Ok(dir);
    }
    let shm = Path::new("/dev/shm");
    let room = tmpfs_free(shm).is_some_and(|free| free >= SHM_FREE_MIN)
        && mem_available().is_some_and(|m| m >= 2 * SHM_FREE_MIN);
    if room && reachable(shm, run_as) {
        return Ok(shm.to_path_buf());
    }
    let t = std::env::temp_dir();
    let short = t.as_os_str().len() <= MAX_BASE_LEN;
    if short && reachable(&t, run_as) {
        Ok(t)
    } else {
        Ok(PathBuf::from("/tmp"))
    }
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
fn mem_available() -> Option<u64> {
    let info = fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb.saturating_mul(1024))
}

/// Whether the server user (when we run as root) can reach `dir`.
fn reachable(dir: &Path, run_as: Option<RunAs>) -> bool {
    run_as.is_none()
        || dir.ancestors().all(|a| {
            fs::metadata(a)
                .map(|m| m.permissions().mode() & 0o001 != 0)
                .unwrap_or(false)
        })
}

/// The bytes free to an unprivileged user on `dir` when it is a tmpfs;
/// `None` when it is not one, or cannot be read.
fn tmpfs_free(dir: &Path) -> Option<u64> {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    let path = CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: an all-zero `statfs` is a valid value of this plain C struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated and `st` is a valid out-pointer.
    if unsafe { libc::statfs(path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    #[allow(clippy::unnecessary_cast)] // the field's type differs by target
    let kind = st.f_type as i64;
    if kind != TMPFS_MAGIC {
        return None;
    }
    #[allow(clippy::unnecessary_cast)]
    Some((st.f_bavail as u64).saturating_mul(st.f_bsize as u64))
}

/// A fresh temporary directory named `prefix…` under [`temp_base`].
pub(crate) fn temp_dir(
    prefix: &str,
    run_as: Option<RunAs>,
) -> Result<tempfile::TempDir, TestingError> {
    let base = temp_base(run_as)?;
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(&base)
        .map_err(io_err(format!(
            "creating a temporary directory in {}",
            base.display()
        )))
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub(crate) fn free_port() -> Result<u16, TestingError> {
    let l = std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))
        .map_err(io_err("binding 127.0.0.1:0 to find a free port"))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(io_err("reading a bound port"))
}

/// Starts `program` on a free loopback port, up to five times: another
/// process may take the port between [`free_port`] and the bind. `spawn`
/// starts the child for a port; `ready` waits for it and says, on failure,
/// whether another port is worth a try. The watchdog is armed with each
/// child, and disarmed when every attempt failed.
pub(crate) fn start_on_free_port(
    program: &str,
    watchdog: &mut Watchdog,
    mut spawn: impl FnMut(u16) -> Result<Child, TestingError>,
    mut ready: impl FnMut(&mut Child, u16) -> Result<(), (TestingError, bool)>,
) -> Result<(Child, u16), TestingError> {
    let mut last_error = None;
    for _attempt in 0..5 {
        let port = free_port()?;
        let mut child = spawn(port)?;
        let up = watchdog
            .arm(child.id())
            .map_err(|e| (e, false))
            .and_then(|()| ready(&mut child, port));
        match up {
            Ok(()) => return Ok((child, port)),
            Err((e, retry)) => {
                stop_child(&mut child, libc::SIGTERM);
                last_error = Some(e);
                if !retry {
                    break;
                }
            }
        }
    }
    watchdog.disarm();
    Err(last_error.unwrap_or_else(|| TestingError::Startup {
        program: program.to_owned(),
        reason: "no attempt was made".to_owned(),
        log_tail: String::new(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chosen_directory_is_checked_and_named_when_wrong() {
        let ok = choose_temp_base(None, Some("/tmp".into()));
        assert_eq!(ok, Ok(PathBuf::from("/tmp")));
        let missing = choose_temp_base(None, Some("/nonexistent-pgwarden-dir".into()));
        assert_eq!(
            missing,
            Err("PGWARDEN_TEST_TMPDIR=/nonexistent-pgwarden-dir: not a directory".to_owned())
        );
        let long = std::env::temp_dir().join("d".repeat(MAX_BASE_LEN));
        std::fs::create_dir_all(&long).unwrap();
        let e = choose_temp_base(None, Some(long.clone().into_os_string())).unwrap_err();
        assert!(e.starts_with("PGWARDEN_TEST_TMPDIR="), "{e}");
        assert!(e.contains("longer than 60 bytes"), "{e}");
        let _ = std::fs::remove_dir(&long);
        // Unset or empty: one of the defaults, never an error.
        assert!(choose_temp_base(None, Some("".into())).is_ok());
        assert!(choose_temp_base(None, None).is_ok());
    }
}
