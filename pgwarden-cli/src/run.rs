//! `pgwarden run NAME -- CMD…`: CMD runs only while NAME is held.
//!
//! The command runs under a keeper process ([`crate::keeper`], in a
//! session of its own) that kills its whole process tree when `run` dies,
//! freezes past the lease's safety margin, or loses the lease; `run` sends
//! it a deadline after every check that the lease is still held. `run`
//! watches the keeper in turn: a keeper seen stopped for a second, or not
//! exited a second after the deadline it acknowledged (hung), is killed by
//! `run`, with everything under it, before the lease can be taken over.

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use pgwarden::{LeaseOptions, Leases, LostReason};
use tokio::process::{Child, Command};
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::format::human;
use crate::keeper::{mono_ns, Until, KEEPER_ARG};
use crate::{Failure, RunArgs, EXIT_LOST};

/// The signals `run` forwards to its command.
///
/// A signal that was ignored when `run` started (`nohup` ignores SIGHUP, a
/// shell's background job SIGINT and SIGQUIT) stays ignored: `run` does not
/// listen for it, so it neither forwards it nor stops for it, and the
/// command inherits it ignored, as it would without `run`.
struct Signals {
    term: Option<Signal>,
    int: Option<Signal>,
    hup: Option<Signal>,
    quit: Option<Signal>,
    /// Handled (and never acted on), so that a message to a stderr file at
    /// its size limit (`ulimit -f`, systemd's LimitFSIZE) fails with EFBIG
    /// instead of ending `run` with SIGXFSZ. A handler, not SIG_IGN: the
    /// keeper starts with the default again, and the command with it.
    _xfsz: Option<Signal>,
}

/// Whether `sig` is ignored (`SIG_IGN`) in this process now.
pub(crate) fn ignored(sig: i32) -> bool {
    // SAFETY: a query only (no new action); `old` is a plain C struct that
    // sigaction fills in.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_IGN
    }
}

/// The next delivery of `s`, or never when it is not listened for.
async fn recv(s: &mut Option<Signal>) {
    match s {
        Some(s) => {
            s.recv().await;
        }
        None => std::future::pending().await,
    }
}

impl Signals {
    fn new() -> Result<Signals, Failure> {
        let listen = |kind: SignalKind| {
            if ignored(kind.as_raw_value()) {
                return Ok(None);
            }
            signal(kind).map(Some).map_err(|e| Failure {
                code: 1,
                message: format!("cannot listen for signals: {e}"),
            })
        };
        Ok(Signals {
            term: listen(SignalKind::terminate())?,
            int: listen(SignalKind::interrupt())?,
            hup: listen(SignalKind::hangup())?,
            quit: listen(SignalKind::quit())?,
            _xfsz: listen(SignalKind::from_raw(libc::SIGXFSZ))?,
        })
    }

    /// The next SIGTERM, SIGINT, SIGHUP or SIGQUIT.
    async fn next(&mut self) -> i32 {
        tokio::select! {
            _ = recv(&mut self.term) => libc::SIGTERM,
            _ = recv(&mut self.int) => libc::SIGINT,
            _ = recv(&mut self.hup) => libc::SIGHUP,
            _ = recv(&mut self.quit) => libc::SIGQUIT,
        }
    }
}

/// The safety margin `run` holds its leases with: the local deadline falls
/// this long before anyone else can take the lease (the library's default,
/// set here so that the keeper's arithmetic knows it).
pub(crate) fn margin(ttl: Duration) -> Duration {
    ttl / 8
}

/// The longest the command may run on after `run` stops answering, or
/// after a lost lease: half the margin, so that its SIGKILL lands half a
/// margin before the lease can be taken over.
pub(crate) fn slack(ttl: Duration) -> Duration {
    margin(ttl) / 2
}

const SECOND: u64 = 1_000_000_000;

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// `run`'s side of the keeper: its process and the two pipes.
struct Keeper {
    child: Child,
    pid: i32,
    ctl: OwnedFd,
    /// The report pipe's read end (non-blocking).
    reports: OwnedFd,
    buf: Vec<u8>,
    /// The last deadline sent.
    deadline: u64,
    /// The last deadline the keeper acknowledged (it enforces it).
    acked: u64,
    /// The command's pid, once the keeper reported it.
    cmd: Option<i32>,
    /// Why the keeper killed the tree, once it said so (`W`).
    why: Option<char>,
}

/// A pipe, both ends close-on-exec.
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned here only.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn nonblocking(fd: &OwnedFd) {
    // SAFETY: fcntl on our own fd.
    unsafe {
        let fl = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK);
    }
}

impl Keeper {
    /// Starts the keeper (this binary, re-executed, in a session of its
    /// own) with `deadline` already in its pipe; it starts `cmd`.
    fn spawn(cmd: &[OsString], env: &[(&str, String)], deadline: u64) -> io::Result<Keeper> {
        let (read, write) = pipe()?;
        let (reports, report_w) = pipe()?;
        nonblocking(&write);
        nonblocking(&reports);
        write_line(&write, &format!("D {deadline} {}\n", Until::Held.code()));
        let exe = if std::path::Path::new("/proc/self/exe").exists() {
            std::path::PathBuf::from("/proc/self/exe")
        } else {
            std::env::current_exe()?
        };
        let mut c = Command::new(exe);
        let (rfd, wfd) = (read.as_raw_fd(), report_w.as_raw_fd());
        c.arg0("pgwarden")
            .arg(KEEPER_ARG)
            .arg(rfd.to_string())
            .arg(wfd.to_string())
            .arg("--")
            .args(cmd);
        for (k, v) in env {
            c.env(k, v);
        }
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            c.pre_exec(move || {
                // A session (and process group) of its own: what is sent
                // to `run`'s group or job does not reach the keeper.
                if libc::setsid() < 0 {
                    return Err(io::Error::last_os_error());
                }
                // The keeper's two ends, kept open across the exec under
                // their own numbers (the caller's descriptors are left as
                // they are: the command inherits them).
                if libc::fcntl(rfd, libc::F_SETFD, 0) < 0 || libc::fcntl(wfd, libc::F_SETFD, 0) < 0
                {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = c.spawn()?;
        drop(read);
        drop(report_w);
        Ok(Keeper {
            pid: child.id().map_or(0, |p| p as i32),
            child,
            ctl: write,
            reports,
            buf: Vec::new(),
            deadline,
            acked: deadline,
            cmd: None,
            why: None,
        })
    }

    fn send(&mut self, line: &str) {
        write_line(&self.ctl, line);
    }

    fn set_deadline(&mut self, at: u64, until: Until) {
        if at != self.deadline {
            self.deadline = at;
            self.send(&format!("D {at} {}\n", until.code()));
        }
    }

    fn signal(&mut self, sig: i32) {
        self.send(&format!("S {sig}\n"));
    }

    fn kill_now(&mut self) {
        self.send("K\n");
    }

    /// Reads the keeper's reports so far (`P`, `A`, `W`).
    fn read_reports(&mut self) {
        let mut chunk = [0u8; 512];
        loop {
            // SAFETY: read into a local buffer from our own fd.
            let n = unsafe {
                libc::read(
                    self.reports.as_raw_fd(),
                    chunk.as_mut_ptr().cast(),
                    chunk.len(),
                )
            };
            if n <= 0 {
                if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                break;
            }
            self.buf.extend_from_slice(&chunk[..n as usize]);
        }
        while let Some(end) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line[..end]).into_owned();
            match line.split_once(' ') {
                Some(("P", pid)) => self.cmd = pid.parse().ok(),
                Some(("A", at)) => {
                    if let Ok(at) = at.parse() {
                        self.acked = at;
                    }
                }
                Some(("W", why)) => self.why = why.chars().next(),
                _ => {}
            }
        }
    }
}

/// Writes `line` to the control pipe. A full pipe (the keeper stopped) or
/// a closed one (the keeper gone) is not an error here: the keeper's own
/// deadline stands.
fn write_line(fd: &OwnedFd, line: &str) {
    let b = line.as_bytes();
    // SAFETY: write from a live buffer to our own fd.
    unsafe { libc::write(fd.as_raw_fd(), b.as_ptr().cast(), b.len()) };
}

pub(crate) async fn run(
    pool: &pgwarden::Pool,
    leases: &Leases,
    args: RunArgs,
    env: Vec<(&str, String)>,
) -> Result<u8, Failure> {
    // Listening from the start: a signal while the lease is sought ends the
    // wait (the command never starts) instead of killing pgwarden mid-way.
    let mut signals = Signals::new()?;
    let margin = margin(args.ttl);
    let slack = ns(slack(args.ttl));
    let opts = LeaseOptions::new(args.ttl).safety_margin(margin);
    let wait = (!args.wait.is_zero()).then_some(args.wait);
    let acquired = tokio::select! {
        r = leases.acquire(&args.name, &opts, wait) => r?,
        sig = signals.next() => return Ok(128 + sig as u8),
    };
    let Some(lease) = acquired else {
        let held = match leases.rows().await {
            Ok(rows) => rows.into_iter().find(|r| r.name == args.name),
            Err(_) => None,
        };
        if !args.quiet {
            say!(
                "pgwarden: {}",
                crate::inspect::refusal(held.as_ref(), &args.name, args.wait)
            );
        }
        return Ok(args.skip_code);
    };
    let term = lease.term().clone();
    // While the lease is not lost at `t`, its local deadline is at least
    // `t`, and nobody can take it before that deadline + margin: the keeper
    // may let the command run until half a margin after it. The deadline is
    // the library's own (`LeaseHandle::deadline`): it counts from the start
    // of the statement that took the lease or of the last renewal, and
    // moves with each renewal. Counted from the start of `--wait` instead,
    // a wait of about a TTL left the command protected by the slack alone
    // until the first renewal, and a loaded machine that held `run` off the
    // CPU that long had it killed.
    let lease_floor = || {
        mono_ns().saturating_add(ns(lease
            .deadline()
            .saturating_duration_since(std::time::Instant::now())))
    };
    let mut floor = lease_floor();
    let held_until = |now: u64, floor: u64| now.max(floor) + slack;
    let mut env = env;
    env.push(("PGWARDEN_LEASE", term.name.clone()));
    env.push(("PGWARDEN_TOKEN", term.token.to_string()));
    let identity = session_identity(&mut env, &term);
    // A child subreaper too: if the keeper itself is killed, what the
    // command started comes here, and is killed below; a stopped keeper
    // and its tree stay `run`'s descendants, killed by `run` if need be.
    // SAFETY: prctl on this process's own attribute.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let mut keeper = match Keeper::spawn(&args.cmd, &env, held_until(mono_ns(), floor)) {
        Ok(k) => k,
        Err(e) => {
            if let Err(r) = lease.release().await {
                say!("pgwarden: releasing lease {:?}: {r}", term.name);
            }
            return Err(Failure {
                code: 1,
                message: format!("cannot start the command's keeper: {e}"),
            });
        }
    };
    let beat = Duration::from_nanos(slack / 4)
        .clamp(Duration::from_millis(10), Duration::from_millis(250));
    // How long past its deadline the keeper may take to kill the tree and
    // exit before `run` does it itself: a second (a loaded machine), but
    // never past half a slack after the last deadline at which the lease
    // was confirmed (`hold`), so that the tree is dead a quarter of the
    // margin before the lease can be taken over.
    let overdue = slack / 2;
    let mut hold = keeper.deadline;
    let mut ticker = tokio::time::interval(beat);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let lost = lease.lost();
    tokio::pin!(lost);
    // Once set (a forwarded signal, a lost lease), the deadline no longer
    // moves later.
    let mut pinned: Option<(u64, Until)> = None;
    let mut lost_reason: Option<LostReason> = None;
    // When the keeper was told to kill the tree now (`K`).
    let mut told_at: Option<u64> = None;
    // Whether `run` killed the keeper and the tree itself.
    let mut took_over = false;
    // Since when the keeper has been seen stopped.
    let mut stopped_since: Option<u64> = None;
    let status = loop {
        tokio::select! {
            status = keeper.child.wait() => break status,
            _ = ticker.tick() => {
                let now = mono_ns();
                keeper.read_reports();
                floor = floor.max(lease_floor());
                if lost_reason.is_none() && !lease.is_lost() {
                    let at = held_until(now, floor);
                    hold = at;
                    match pinned {
                        Some((p, why)) if p <= at => keeper.set_deadline(p, why),
                        _ => keeper.set_deadline(at, Until::Held),
                    }
                }
                // The keeper enforces the deadline it acknowledged; one
                // that has not exited well past it (or past `K`) is
                // stopped or hung: `run` kills it and the tree.
                let due = keeper
                    .acked
                    .min(keeper.deadline)
                    .min(told_at.unwrap_or(u64::MAX))
                    .saturating_add(overdue.max(SECOND))
                    .min(hold + overdue);
                // A keeper stopped (SIGSTOP, a debugger) for a second
                // protects nothing: if `run` went too, the tree would run
                // on. `run` does not wait for its deadline.
                let state = crate::keeper::state(keeper.pid).unwrap_or('?');
                let stopped_for = if matches!(state, 'T' | 't') {
                    now - *stopped_since.get_or_insert(now)
                } else {
                    stopped_since = None;
                    0
                };
                let late = now >= due;
                // (Exited and not reaped yet is done, not hung.)
                if !took_over
                    && (late || stopped_for >= SECOND)
                    && !matches!(keeper.child.try_wait(), Ok(Some(_)))
                {
                    took_over = true;
                    let what = if late {
                        "did not stop the command in time"
                    } else {
                        "is stopped: a stopped keeper cannot stop the command"
                    };
                    say!(
                        "pgwarden: the keeper (pid {}, state {state}) {what}{}: killing it and every process under it (SIGKILL)",
                        keeper.pid,
                        keeper.cmd.map(|c| format!(" (pid {c})")).unwrap_or_default(),
                    );
                    let n = kill_tree().await;
                    say!("pgwarden: killed {n} process(es)");
                }
            }
            sig = signals.next() => {
                keeper.signal(sig);
                if pinned.is_none() {
                    // An ignored signal is escalated to SIGKILL after the
                    // grace (the keeper's deadline).
                    let at = mono_ns() + ns(args.grace);
                    pinned = Some((at, Until::Grace));
                    if at < keeper.deadline {
                        keeper.set_deadline(at, Until::Grace);
                    }
                }
            }
            reason = &mut lost, if lost_reason.is_none() => {
                lost_reason = Some(reason);
                if matches!(keeper.child.try_wait(), Ok(Some(_))) {
                    // Its keeper killed it already (`run` was stopped or
                    // frozen past its deadline).
                    say!(
                        "pgwarden: lease {:?} lost ({reason}; token {}): the command was killed already",
                        term.name,
                        term.token
                    );
                } else if reason == LostReason::Deadline {
                    // Nobody can take it for another margin: SIGTERM, and
                    // SIGKILL half a margin from now at the latest.
                    let grace = args.grace.min(Duration::from_nanos(slack));
                    say!(
                        "pgwarden: lease {:?} lost ({reason}; token {}): stopping the command (SIGTERM, SIGKILL after {})",
                        term.name,
                        term.token,
                        human(grace)
                    );
                    keeper.signal(libc::SIGTERM);
                    let at = mono_ns() + ns(grace);
                    if pinned.is_none_or(|(p, _)| at < p) {
                        pinned = Some((at, Until::Lost));
                    }
                    if at < keeper.deadline {
                        keeper.set_deadline(at, Until::Lost);
                    }
                } else {
                    // The term is over in the database: another holder may
                    // run already. Kill first, then find out why.
                    keeper.kill_now();
                    told_at = Some(mono_ns());
                    let why = lost_why(leases, &term, reason).await;
                    say!(
                        "pgwarden: lease {:?} lost ({why}; token {}): killing the command and every process it started (SIGKILL)",
                        term.name,
                        term.token
                    );
                }
            }
        }
    };
    let status = status.map_err(|e| Failure {
        code: 1,
        message: format!("waiting for the command: {e}"),
    })?;
    keeper.read_reports();
    // The keeper kills the whole tree before it exits; if it was killed
    // itself, what the command started was re-parented here.
    let orphans = kill_tree().await;
    crate::keeper::reap_orphans();
    let keeper_killed = !took_over && status.signal().is_some();
    if keeper_killed {
        say!(
            "pgwarden: the keeper (pid {}) was killed by signal {}: killed the {orphans} process(es) the command left; the command's exit code is unknown",
            keeper.pid,
            status.signal().unwrap_or_default()
        );
    } else if orphans > 0 {
        say!("pgwarden: killed {orphans} process(es) the command left");
    }
    end_sessions(pool, identity.as_deref()).await;
    if lost_reason.is_some() {
        // Released already, or another term's: nothing of ours to release.
        drop(lease);
        return Ok(EXIT_LOST);
    }
    // `h`: the keeper killed the tree because `run` did not confirm the
    // lease in time (it was stopped or frozen); the lease may still be ours.
    let answered_late = keeper.why == Some(Until::Held.code());
    if answered_late {
        say!(
            "pgwarden: the command was killed: pgwarden run did not confirm lease {:?} in time",
            term.name
        );
    }
    let code = if took_over || keeper_killed || answered_late {
        EXIT_LOST
    } else {
        exit_code(status)
    };
    match lease.release().await {
        Ok(()) => {}
        // The term ended while the command ran (run had not seen it yet):
        // it is another's, or revoked, and nothing of ours is left.
        Err(pgwarden::Error::Lease(pgwarden::LeaseError::Lost { reason, .. })) => say!(
            "pgwarden: lease {:?} was no longer this run's when the command ended ({}; token {}): nothing to release",
            term.name,
            lost_why(leases, &term, reason).await,
            term.token
        ),
        Err(e) => say!(
            "pgwarden: releasing lease {:?}: {e}; this run's term (token {}) runs out within {}",
            term.name,
            term.token,
            human(args.ttl)
        ),
    }
    Ok(code)
}

/// Kills every live descendant of `run` until none is left, and returns
/// how many processes it killed. It yields between passes: the lease is
/// still renewed while a process resists (uninterruptible sleep, another
/// user's), so nobody else takes it while that process lives.
async fn kill_tree() -> usize {
    let started = mono_ns();
    let mut warned = false;
    let mut killed = 0;
    loop {
        let alive = crate::keeper::kill_pass();
        if alive.is_empty() {
            return killed;
        }
        killed += alive.len();
        if !warned && mono_ns() - started > 2 * SECOND {
            warned = true;
            crate::keeper::survivors(&alive);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Why a term ended, for the message: a row still of this token with no
/// holder was revoked (`pgwarden revoke`), not taken over.
async fn lost_why(leases: &Leases, term: &pgwarden::Term, reason: LostReason) -> String {
    if reason != LostReason::Taken {
        return reason.to_string();
    }
    let rows = tokio::time::timeout(Duration::from_secs(2), leases.rows()).await;
    match rows {
        Ok(Ok(rows)) => match rows.into_iter().find(|r| r.name == term.name) {
            Some(r) if r.token == term.token && r.holder.is_empty() => {
                "revoked: `pgwarden revoke` ended this term".to_owned()
            }
            Some(r) if r.token != term.token => format!(
                "taken over by another holder: {} with token {}",
                r.holder, r.token
            ),
            _ => reason.to_string(),
        },
        _ => reason.to_string(),
    }
}

/// The keeper's exit code: the command's (128 + the signal that ended it,
/// as shells do).
fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => (code & 0xff) as u8,
        (None, Some(sig)) => (128 + sig) as u8,
        (None, None) => 1,
    }
}

/// The longest `application_name` PostgreSQL keeps (NAMEDATALEN - 1).
const MAX_APP_NAME: usize = 63;

/// Names the command's sessions after its term, unless the user named
/// them (`PGAPPNAME`): `PGAPPNAME` and `application_name` in
/// `DATABASE_URL` become `pgwarden run NAME token N #ID` (printable ASCII, the
/// name shortened to fit 63 bytes: the token, unique to the term, is kept
/// whole). Returns that name, to find the sessions by.
fn session_identity(env: &mut Vec<(&str, String)>, term: &pgwarden::Term) -> Option<String> {
    if std::env::var_os("PGAPPNAME").is_some_and(|v| !v.is_empty()) {
        return None;
    }
    // Unique to this run: tokens are per lease table, so two tables in one
    // cluster (two databases, two schemas) hand out the same token to the
    // same name, and the lookup spans the cluster; run's pid and clock tell
    // two such runs apart.
    let nonce = (std::process::id() as u64) << 16 ^ (mono_ns() & 0xffff);
    let tail = format!(" token {} #{nonce:x}", term.token);
    let room = MAX_APP_NAME - "pgwarden run ".len() - tail.len();
    let mut name: String = term
        .name
        .chars()
        .map(|c| {
            if c == ' ' || c.is_ascii_graphic() {
                c
            } else {
                '?'
            }
        })
        .collect();
    if name.len() > room {
        name.truncate(room - 2);
        name.push_str("..");
    }
    let id = format!("pgwarden run {name}{tail}");
    for (k, v) in env.iter_mut() {
        if *k == "DATABASE_URL" {
            *v = crate::connect::set_param(v, "application_name", &id);
        }
    }
    env.push(("PGAPPNAME", id.clone()));
    Some(id)
}

/// `SELECT f(pid)` (`pg_cancel_backend`, `pg_terminate_backend`) for each
/// pid: how many were signalled; the server's refusals go to `refused`.
async fn signal_all(
    client: &tokio_postgres::Client,
    f: &str,
    pids: &[i32],
    refused: &mut std::collections::BTreeMap<i32, String>,
) -> usize {
    let mut sent = 0;
    for &pid in pids {
        match client.query_one(&format!("SELECT {f}($1)"), &[&pid]).await {
            Ok(row) => sent += usize::from(row.get::<_, bool>(0)),
            Err(e) => {
                let why = e
                    .as_db_error()
                    .map_or_else(|| e.to_string(), |d| d.message().to_owned());
                refused.insert(pid, why);
            }
        }
    }
    sent
}

/// The pids of the sessions named `id` that are not idle.
async fn left(client: &tokio_postgres::Client, id: &str) -> Result<Vec<i32>, String> {
    const LEFT: &str = "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid() AND state IS DISTINCT FROM 'idle'";
    let rows = client
        .query(LEFT, &[&id])
        .await
        .map_err(|e| e.to_string())?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// After the command's tree is dead, and before the lease is released:
/// its sessions still running a statement in the database (found by their
/// `application_name`, [`session_identity`]) are cancelled, and those
/// still there a second later terminated. A killed client's statement
/// runs on in its backend otherwise, and could commit after the next
/// holder started. Best effort, within 3 s: the database may not answer
/// (say so), and another role's sessions need `pg_signal_backend`.
async fn end_sessions(pool: &pgwarden::Pool, identity: Option<&str>) {
    let Some(id) = identity else { return };
    let work = async {
        let client = pool.get().await.map_err(|e| e.to_string())?;
        let pids = left(&client, id).await?;
        if pids.is_empty() {
            return Ok((0, 0, 0, std::collections::BTreeMap::new()));
        }
        // pid -> why it could not be signalled (the last error).
        let mut refused = std::collections::BTreeMap::new();
        let cancelled = signal_all(&client, "pg_cancel_backend", &pids, &mut refused).await;
        let mut still = left(&client, id).await?;
        for _ in 0..20 {
            if still.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            still = left(&client, id).await?;
        }
        let terminated = signal_all(&client, "pg_terminate_backend", &still, &mut refused).await;
        Ok::<_, String>((pids.len(), cancelled, terminated, refused))
    };
    let outcome = tokio::time::timeout(Duration::from_secs(3), work).await;
    let left_running = "a statement it started may still run in its backend (and commit) until it ends; client_connection_check_interval bounds that on the server, PGWARDEN_TOKEN fencing makes it harmless";
    match outcome {
        Ok(Ok((0, ..))) => {}
        Ok(Ok((n, cancelled, terminated, refused))) => {
            say!(
                "pgwarden: {n} session(s) of the command (application_name {id:?}) were still running a statement: {cancelled} cancelled, {terminated} terminated a second later"
            );
            if !refused.is_empty() {
                let why: Vec<String> = refused
                    .iter()
                    .map(|(pid, e)| format!("pid {pid}: {e}"))
                    .collect();
                say!(
                    "pgwarden: could not end {} (another role's sessions need pg_signal_backend): {left_running}",
                    why.join("; ")
                );
            }
        }
        Ok(Err(e)) => say!(
            "pgwarden: could not look for the command's sessions (application_name {id:?}): {e}; {left_running}"
        ),
        Err(_) => say!(
            "pgwarden: the database did not answer within 3s: could not end the command's sessions (application_name {id:?}); {left_running}"
        ),
    }
}
