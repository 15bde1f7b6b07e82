//! `pgwarden run NAME -- CMD…`: CMD runs only while NAME is held.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

use pgwarden::{LeaseOptions, Leases};
use tokio::process::{Child, Command};
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::format::{human, human_signed};
use crate::{Failure, RunArgs, EXIT_LOST};

/// The signals `run` forwards to its command.
struct Signals {
    term: Signal,
    int: Signal,
}

impl Signals {
    fn new() -> Result<Signals, Failure> {
        let listen = |kind| {
            signal(kind).map_err(|e| Failure {
                code: 1,
                message: format!("cannot listen for signals: {e}"),
            })
        };
        Ok(Signals {
            term: listen(SignalKind::terminate())?,
            int: listen(SignalKind::interrupt())?,
        })
    }

    /// The next SIGTERM or SIGINT.
    async fn next(&mut self) -> i32 {
        tokio::select! {
            _ = self.term.recv() => libc::SIGTERM,
            _ = self.int.recv() => libc::SIGINT,
        }
    }
}

pub(crate) async fn run(leases: &Leases, args: RunArgs) -> Result<u8, Failure> {
    // Listening from the start: a signal while the lease is sought ends the
    // wait (the command never starts) instead of killing pgwarden mid-way.
    let mut signals = Signals::new()?;
    let opts = LeaseOptions::new(args.ttl);
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
        match held {
            Some(r) if r.live => eprintln!(
                "pgwarden: lease {:?} is held by {} (token {}, expires {}); not running the command",
                args.name,
                r.holder,
                r.token,
                human_signed(r.expires_in_s)
            ),
            _ => eprintln!(
                "pgwarden: lease {:?} not acquired within {}; not running the command",
                args.name,
                human(args.wait)
            ),
        }
        return Ok(args.skip_code);
    };
    let term = lease.term().clone();
    let (program, rest) = args
        .cmd
        .split_first()
        .ok_or_else(|| Failure::usage("no command given after --"))?;
    let spawned = Command::new(program)
        .args(rest)
        .env("PGWARDEN_LEASE", &term.name)
        .env("PGWARDEN_TOKEN", term.token.to_string())
        .spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            };
            if let Err(r) = lease.release().await {
                eprintln!("pgwarden: releasing lease {:?}: {r}", term.name);
            }
            return Err(Failure {
                code,
                message: format!("cannot run {}: {e}", program.to_string_lossy()),
            });
        }
    };
    let lost = lease.lost();
    tokio::pin!(lost);
    let reason = loop {
        tokio::select! {
            status = child.wait() => {
                let code = exit_code(status.map_err(|e| Failure {
                    code: 1,
                    message: format!("waiting for the command: {e}"),
                })?);
                if let Err(e) = lease.release().await {
                    eprintln!(
                        "pgwarden: releasing lease {:?}: {e}; it expires within {}",
                        term.name,
                        human(args.ttl)
                    );
                }
                return Ok(code);
            }
            sig = signals.next() => send(&child, sig),
            reason = &mut lost => break reason,
        }
    };
    eprintln!(
        "pgwarden: lease {:?} lost ({reason}; token {}): stopping the command (SIGTERM, SIGKILL after {})",
        term.name,
        term.token,
        human(args.grace)
    );
    send(&child, libc::SIGTERM);
    stop(&mut child, args.grace, &mut signals).await;
    // Released already, or another term's: nothing of ours to release.
    drop(lease);
    Ok(EXIT_LOST)
}

/// Waits up to `grace` for the command (forwarding signals meanwhile), then
/// kills it.
async fn stop(child: &mut Child, grace: std::time::Duration, signals: &mut Signals) {
    let deadline = tokio::time::Instant::now() + grace;
    let ended = loop {
        tokio::select! {
            r = child.wait() => {
                if let Err(e) = r {
                    eprintln!("pgwarden: waiting for the command: {e}");
                }
                break true;
            }
            sig = signals.next() => send(child, sig),
            _ = tokio::time::sleep_until(deadline) => break false,
        }
    };
    if !ended {
        eprintln!(
            "pgwarden: the command did not stop within {}: SIGKILL",
            human(grace)
        );
        if let Err(e) = child.start_kill() {
            eprintln!("pgwarden: killing the command: {e}");
        }
        if let Err(e) = child.wait().await {
            eprintln!("pgwarden: waiting for the command: {e}");
        }
    }
}

/// Sends `sig` to the command, if it still runs.
fn send(child: &Child, sig: i32) {
    let Some(pid) = child.id() else {
        return; // already reaped
    };
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: kill(2) with a pid this process spawned and has not reaped
    // (`Child::id` is `None` once it has), so the pid is not reused.
    let rc = unsafe { libc::kill(pid, sig) };
    if rc != 0 {
        eprintln!(
            "pgwarden: signal {sig} to the command (pid {pid}): {}",
            std::io::Error::last_os_error()
        );
    }
}

/// The command's exit code; 128 + the signal that ended it, as shells do.
fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => (code & 0xff) as u8,
        (None, Some(sig)) => (128 + sig) as u8,
        (None, None) => 1,
    }
}
