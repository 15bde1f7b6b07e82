//! The keeper: the small process between `pgwarden run` and its command
//! that makes "CMD runs only while NAME is held" hold whatever happens to
//! `run` itself.
//!
//! `run` starts it (`pgwarden` re-executed with a hidden first argument) in
//! a session of its own (`setsid`: a signal to `run`'s process group, a
//! shell's `kill -9 %1`, `timeout -k`, a terminal's `SIGSTOP`, cannot take
//! the keeper along), with the read end of a control pipe as fd 3 and the
//! write end of a report pipe as fd 4. The keeper is a child subreaper
//! (`PR_SET_CHILD_SUBREAPER`: whatever the command starts and leaves behind,
//! a double-forked `setsid` daemon included, is re-parented to it, not to
//! init), starts the command in a process group of its own with
//! `PR_SET_PDEATHSIG` = `SIGKILL`, and kills the command's whole tree (its
//! process group, then every descendant found in `/proc`, until none is
//! left) when:
//!
//! - the control pipe closes: `run` is gone (`SIGKILL`, the OOM killer, a
//!   crash, its process group killed);
//! - the deadline `run` last sent passes: `run` is frozen (`SIGSTOP`, its
//!   process group stopped, a stalled machine), or the lease was lost, or a
//!   forwarded signal's grace is over;
//! - `run` says so (`K`): the lease is another holder's already;
//! - the command's own process exits: what it left running is killed, so
//!   nothing runs on once the lease is released.
//!
//! The control protocol, one line each: `D <ns> <why>` sets the deadline
//! (CLOCK_MONOTONIC nanoseconds) and says what it is ([`Until`]), `S <signal>`
//! sends a signal to every process of the command's tree (its process group
//! at once, then each other descendant once), `K` kills the tree now. The
//! keeper reports back: `P <pid>` (the command started), `A <ns>` (the
//! deadline it now enforces), `W <why>` (why it kills the tree). `run`
//! watches the keeper: one stopped for a second, or hung past the deadline
//! it acknowledged, is killed by `run`, with the tree. The keeper exits with the
//! command's exit code (128 + signal when a signal ended it).
//!
//! The keeper uses no async runtime and no database: it is a `poll(2)` loop.

use std::ffi::OsString;
use std::io;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::ExitCode;
use std::sync::atomic::{AtomicI32, Ordering};

/// The hidden first argument that makes `pgwarden` the keeper.
pub(crate) const KEEPER_ARG: &str = "__pgwarden-keeper";

/// The keeper's end of the control pipe (`run` → keeper), and of the
/// report pipe (keeper → `run`): the numbers the pipes had in `run`, passed
/// as the keeper's first two arguments. Fixed numbers (3 and 4) would
/// replace the caller's own descriptors of those numbers, which the command
/// inherits as it would without `run` (`pgwarden run … 3>file`).
static CONTROL: AtomicI32 = AtomicI32::new(-1);
static REPORT: AtomicI32 = AtomicI32::new(-1);

fn control_fd() -> i32 {
    CONTROL.load(Ordering::Relaxed)
}

fn report_fd() -> i32 {
    REPORT.load(Ordering::Relaxed)
}

/// CLOCK_MONOTONIC in nanoseconds: the clock both processes read (the one
/// `std::time::Instant` reads on Linux).
pub(crate) fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// What a deadline stands for: what has happened once it passes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Until {
    /// `run` confirmed the lease until then: past it, `run` stopped
    /// answering (stopped, frozen).
    Held,
    /// A signal was forwarded: past it, the grace (`--grace`) is over.
    Grace,
    /// The lease was lost: past it, its grace is over.
    Lost,
}

impl Until {
    pub(crate) fn code(self) -> char {
        match self {
            Until::Held => 'h',
            Until::Grace => 'g',
            Until::Lost => 'l',
        }
    }

    fn parse(s: &str) -> Until {
        match s {
            "g" => Until::Grace,
            "l" => Until::Lost,
            _ => Until::Held,
        }
    }
}

/// Why the keeper kills the tree (its `W` report: `r`, the [`Until`]
/// code, or `k`).
#[derive(Copy, Clone, Debug)]
enum Why {
    RunGone,
    Deadline(Until),
    Told,
}

impl Why {
    fn code(self) -> char {
        match self {
            Why::RunGone => 'r',
            Why::Deadline(u) => u.code(),
            Why::Told => 'k',
        }
    }

    fn says(self) -> &'static str {
        match self {
            Why::RunGone => "`pgwarden run` is gone (killed or crashed)",
            Why::Deadline(Until::Held) => {
                "`pgwarden run` did not confirm the lease in time (stopped or frozen)"
            }
            Why::Deadline(Until::Grace) => "it still ran --grace after the signal forwarded to it",
            Why::Deadline(Until::Lost) => "the lease was lost and its grace is over",
            Why::Told => "the lease is lost",
        }
    }
}

/// The signals the keeper ignores (and resets for the command).
const IGNORED: [i32; 8] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGTSTP,
    libc::SIGTTIN,
    libc::SIGTTOU,
    // A message to a stderr file at its size limit (`ulimit -f`, systemd's
    // LimitFSIZE) fails with EFBIG instead of ending the keeper before it
    // kills the tree.
    libc::SIGXFSZ,
];

struct Keeper {
    me: libc::pid_t,
    child: libc::pid_t,
    deadline: u64,
    until: Until,
    buf: Vec<u8>,
    status: Option<i32>,
}

/// Writes `line` to the report pipe; a full or closed pipe (`run` stopped
/// or gone) drops it: the keeper's own deadline stands.
fn report(line: &str) {
    let b = line.as_bytes();
    // SAFETY: write from a live buffer to our own fd.
    unsafe { libc::write(report_fd(), b.as_ptr().cast(), b.len()) };
}

/// The keeper's `main`: `args` is what follows [`KEEPER_ARG`] (`--`, then
/// the command and its arguments).
pub(crate) fn main(args: Vec<OsString>) -> ExitCode {
    let fds: Vec<i32> = args
        .iter()
        .take_while(|a| *a != "--")
        .filter_map(|a| a.to_str()?.parse().ok())
        .collect();
    let [ctl, rep] = fds[..] else {
        say!("pgwarden: keeper: no pipes");
        return ExitCode::from(2);
    };
    CONTROL.store(ctl, Ordering::Relaxed);
    REPORT.store(rep, Ordering::Relaxed);
    // The process name `ps` and `top` show (`exe` otherwise: the keeper
    // is started as /proc/self/exe).
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"pgwarden-keeper".as_ptr(), 0, 0, 0) };
    let cmd: Vec<OsString> = args.into_iter().skip_while(|a| a != "--").skip(1).collect();
    let Some((program, rest)) = cmd.split_first() else {
        say!("pgwarden: keeper: no command");
        return ExitCode::from(2);
    };
    // SAFETY: plain syscalls on this process's own state.
    let me = unsafe {
        for fd in [control_fd(), report_fd()] {
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
        // Supervisor signals are `run`'s to handle; it forwards them (once)
        // to the command's tree. In a session of its own, the keeper gets
        // no terminal signal anyway.
        libc::getpid()
    };
    // What was ignored already when the keeper started (`nohup`'s SIGHUP,
    // a background job's SIGINT and SIGQUIT) stays ignored for the
    // command, as it would be without `run`; the rest goes back to its
    // default in the command.
    let inherited = IGNORED.map(crate::run::ignored);
    // SAFETY: setting a disposition to SIG_IGN, before any thread starts.
    unsafe {
        for sig in IGNORED {
            libc::signal(sig, libc::SIG_IGN);
        }
    }
    let mut k = Keeper {
        me,
        child: 0,
        deadline: mono_ns() + 1_000_000_000,
        until: Until::Held,
        buf: Vec::new(),
        status: None,
    };
    // The first deadline is in the pipe already; an empty pipe at once
    // closed means `run` is gone: do not start the command.
    if let Some(why) = k.read_control() {
        if matches!(why, Why::RunGone | Why::Told) {
            return ExitCode::from(crate::EXIT_LOST);
        }
    }
    let mut command = std::process::Command::new(program);
    command.args(rest).process_group(0);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        command.pre_exec(move || {
            // The command dies with the keeper, even if the keeper is
            // SIGKILLed (its descendants are then `run`'s to kill).
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
            if libc::getppid() != me {
                libc::_exit(1);
            }
            for (sig, was) in IGNORED.into_iter().zip(inherited) {
                if !was {
                    libc::signal(sig, libc::SIG_DFL);
                }
            }
            Ok(())
        });
    }
    let child = match command.spawn() {
        Ok(c) => c,
        Err(e) => {
            say!("pgwarden: cannot run {}: {e}", program.to_string_lossy());
            let code = if e.kind() == io::ErrorKind::NotFound {
                127
            } else {
                126
            };
            return ExitCode::from(code);
        }
    };
    k.child = child.id() as libc::pid_t;
    report(&format!("P {}\n", k.child));
    // Reaped by hand below (waitpid(-1) also reaps orphans); the handle is
    // only dropped.
    drop(child);
    let why = k.watch();
    if let Some(why) = why {
        report(&format!("W {}\n", why.code()));
        say!(
            "pgwarden: SIGKILL to the command (pid {}) and every process it started: {}",
            k.child,
            why.says()
        );
    }
    k.kill_tree();
    let code = match k.status {
        Some(st) => {
            let st = std::process::ExitStatus::from_raw(st);
            match (st.code(), st.signal()) {
                (Some(c), _) => (c & 0xff) as u8,
                (None, Some(s)) => (128 + s) as u8,
                _ => 1,
            }
        }
        None => 128 + libc::SIGKILL as u8,
    };
    ExitCode::from(code)
}

impl Keeper {
    /// Waits until the command exits (`None`) or the tree must be killed.
    fn watch(&mut self) -> Option<Why> {
        // SAFETY: pidfd_open on our own child; -1 on old kernels (then the
        // loop wakes every 50 ms to reap).
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, self.child, 0) } as i32;
        let cap_ms: i64 = if pidfd >= 0 { 1000 } else { 50 };
        let result = loop {
            self.reap();
            if self.status.is_some() {
                break None;
            }
            let now = mono_ns();
            if now >= self.deadline {
                break Some(Why::Deadline(self.until));
            }
            let left_ms = ((self.deadline - now).div_ceil(1_000_000)) as i64;
            let mut fds = [
                libc::pollfd {
                    fd: control_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: pidfd,
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            let n = if pidfd >= 0 { 2 } else { 1 };
            // SAFETY: poll over `n` valid pollfd entries.
            let rc = unsafe {
                libc::poll(
                    fds.as_mut_ptr(),
                    n as libc::nfds_t,
                    left_ms.min(cap_ms) as i32,
                )
            };
            if rc < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    say!("pgwarden: keeper: poll: {e}");
                    break Some(Why::RunGone);
                }
                continue;
            }
            if fds[0].revents != 0 {
                if let Some(why) = self.read_control() {
                    break Some(why);
                }
            }
        };
        if pidfd >= 0 {
            // SAFETY: our own fd.
            unsafe { libc::close(pidfd) };
        }
        result
    }

    /// Reads what is in the pipe; `Some` when the tree must die now. A new
    /// deadline is acknowledged (`A`) once read.
    fn read_control(&mut self) -> Option<Why> {
        let mut chunk = [0u8; 512];
        let before = self.deadline;
        let ack = |k: &Keeper| {
            if k.deadline != before {
                report(&format!("A {}\n", k.deadline));
            }
        };
        loop {
            // SAFETY: read into a local buffer.
            let n = unsafe { libc::read(control_fd(), chunk.as_mut_ptr().cast(), chunk.len()) };
            if n == 0 {
                return Some(Why::RunGone);
            }
            if n < 0 {
                let e = io::Error::last_os_error();
                return match e.kind() {
                    io::ErrorKind::WouldBlock => {
                        ack(self);
                        None
                    }
                    io::ErrorKind::Interrupted => continue,
                    _ => Some(Why::RunGone),
                };
            }
            self.buf.extend_from_slice(&chunk[..n as usize]);
            while let Some(end) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=end).collect();
                let line = String::from_utf8_lossy(&line[..end]).into_owned();
                let mut f = line.split(' ');
                match (f.next(), f.next(), f.next()) {
                    (Some("D"), Some(at), why) => {
                        if let Ok(ns) = at.parse() {
                            self.deadline = ns;
                            self.until = Until::parse(why.unwrap_or("h"));
                        }
                    }
                    (Some("S"), Some(sig), _) => {
                        if let Ok(sig) = sig.parse::<i32>() {
                            self.forward(sig);
                        }
                    }
                    (Some("K"), _, _) => return Some(Why::Told),
                    _ => {}
                }
            }
        }
    }

    /// Sends `sig` once to every process of the command's tree: its
    /// process group at once (a fork cannot slip past it), then each
    /// other live descendant (a `setsid` daemon, another group).
    fn forward(&mut self, sig: i32) {
        if self.child <= 0 || self.status.is_some() {
            return;
        }
        // SAFETY: the command's process group; its leader is not reaped
        // yet, so the id cannot have been reused.
        unsafe { libc::kill(-self.child, sig) };
        for p in descendants(self.me) {
            if p.pgid != self.child {
                // SAFETY: a descendant of this process.
                unsafe { libc::kill(p.pid, sig) };
            }
        }
    }

    /// Reaps every exited child (orphans re-parented to the keeper too),
    /// keeping the command's status. True when it reaped one.
    fn reap(&mut self) -> bool {
        let mut any = false;
        loop {
            let mut st = 0;
            // SAFETY: waitpid on our own children.
            let pid = unsafe { libc::waitpid(-1, &mut st, libc::WNOHANG) };
            if pid <= 0 {
                return any;
            }
            any = true;
            if pid == self.child {
                self.status = Some(st);
            }
        }
    }

    /// Kills the command's process group and every descendant of the
    /// keeper, until none is left alive, and reaps them.
    fn kill_tree(&mut self) {
        let started = mono_ns();
        let mut warned = false;
        loop {
            if self.child > 0 && self.status.is_none() {
                // SAFETY: the command's process group; its leader is not
                // reaped yet, so the id cannot have been reused.
                unsafe { libc::kill(-self.child, libc::SIGKILL) };
            }
            let alive = sigkill_all(self.me);
            let reaped = self.reap();
            if alive.is_empty() && !reaped {
                return;
            }
            if !warned && mono_ns() - started > 2_000_000_000 {
                warned = true;
                survivors(&alive);
            }
            if !alive.is_empty() {
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        }
    }
}

/// SIGKILLs every live descendant of `root` once; returns their pids.
fn sigkill_all(root: libc::pid_t) -> Vec<libc::pid_t> {
    let alive: Vec<libc::pid_t> = descendants(root).into_iter().map(|p| p.pid).collect();
    for &pid in &alive {
        // SAFETY: a descendant of `root`.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    alive
}

/// The warning for processes that outlive SIGKILL for two seconds.
pub(crate) fn survivors(alive: &[libc::pid_t]) {
    let denied: Vec<libc::pid_t> = alive
        .iter()
        .copied()
        // SAFETY: signal 0 only checks the permission to signal.
        .filter(|&p| unsafe { libc::kill(p, 0) } != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
        .collect();
    if denied.is_empty() {
        say!(
            "pgwarden: processes {alive:?} of the command survive SIGKILL (uninterruptible sleep?); still trying"
        );
    } else {
        say!(
            "pgwarden: processes {denied:?} of the command may not be signalled by this user (setuid, sudo?); still trying"
        );
    }
}

/// `run`'s own line of defence, one pass: SIGKILLs every live descendant
/// of this process (the keeper included, stopped or not, and the
/// command's whole tree under it, or what the keeper left re-parented to
/// `run`, a child subreaper too), without reaping (the keeper is reaped by
/// its handle, the rest by [`reap_orphans`]). Returns the pids it killed.
pub(crate) fn kill_pass() -> Vec<libc::pid_t> {
    // SAFETY: getpid has no preconditions.
    sigkill_all(unsafe { libc::getpid() })
}

/// Reaps every exited child of `run` (once the keeper is reaped).
pub(crate) fn reap_orphans() {
    loop {
        let mut st = 0;
        // SAFETY: waitpid on our own children.
        if unsafe { libc::waitpid(-1, &mut st, libc::WNOHANG) } <= 0 {
            return;
        }
    }
}

/// The state of `pid` (`R`, `S`, `T` stopped, `D`…), from `/proc`.
pub(crate) fn state(pid: libc::pid_t) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..].trim_start().chars().next()
}

/// A live process of a tree.
struct Proc {
    pid: libc::pid_t,
    pgid: libc::pid_t,
}

/// Every live (not zombie) descendant of `root`, from `/proc`.
fn descendants(root: libc::pid_t) -> Vec<Proc> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    // (pid, ppid, pgid, zombie)
    let mut procs: Vec<(libc::pid_t, libc::pid_t, libc::pid_t, bool)> = Vec::new();
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) S ppid pgrp ...`; comm may hold anything, even `)`.
        let Some(after) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let mut f = after.split_whitespace();
        let state = f.next().unwrap_or("");
        let (Some(ppid), Some(pgid)) = (
            f.next().and_then(|p| p.parse().ok()),
            f.next().and_then(|p| p.parse().ok()),
        ) else {
            continue;
        };
        procs.push((pid, ppid, pgid, state == "Z" || state == "X"));
    }
    let mut tree = vec![root];
    let mut out = Vec::new();
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        for &(pid, ppid, pgid, zombie) in &procs {
            if ppid == parent && pid != root && !tree.contains(&pid) {
                tree.push(pid);
                if !zombie {
                    out.push(Proc { pid, pgid });
                }
            }
        }
        i += 1;
    }
    out
}
