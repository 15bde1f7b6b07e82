//! Child processes of the harness: watchdogs that stop a server when the
//! test process goes away, and stopping a child for good.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use super::io_err;
use crate::TestingError;

/// The shell program of a watchdog. `$1` is the directory to remove, `$2`
/// the signal that stops the server. It reads pids (one a line, the last
/// wins) until its stdin reaches end of file, which happens when the owning
/// process closes it or dies in any way; then it stops that pid if it is
/// still the server (its command line names the directory), waits up to 10 s
/// (then SIGKILL) and removes the directory.
const WATCHDOG_SCRIPT: &str = r#"
pid=
while read -r line; do pid=$line; done
alive() {
  [ -n "$pid" ] || return 1
  if [ -d /proc/self ]; then
    grep -qaF -- "$1" "/proc/$pid/cmdline" 2>/dev/null
  else
    kill -0 "$pid" 2>/dev/null
  fi
}
if alive "$1"; then kill -"$2" "$pid" 2>/dev/null; fi
i=0
while [ "$i" -lt 100 ] && alive "$1"; do sleep 0.1; i=$((i+1)); done
if alive "$1"; then kill -KILL "$pid" 2>/dev/null; sleep 0.5; fi
rm -rf -- "$1"
"#;

/// A `sh` process that stops a server and removes its directory once this
/// process goes away (normal exit, panic, `SIGKILL`): its stdin is a pipe
/// only this process holds. Not `PR_SET_PDEATHSIG`, which fires when the
/// spawning *thread* exits.
#[derive(Debug)]
pub(crate) struct Watchdog {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Watchdog {
    pub(crate) fn spawn(dir: &Path, signal: &str) -> Result<Watchdog, TestingError> {
        let mut child = Command::new("/bin/sh")
            .arg("-c")
            .arg(WATCHDOG_SCRIPT)
            .arg("pgwarden-watchdog")
            .arg(dir)
            .arg(signal)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(io_err("spawning the watchdog (/bin/sh)"))?;
        let stdin = child.stdin.take();
        Ok(Watchdog { child, stdin })
    }

    /// Tells the watchdog which pid to stop.
    pub(crate) fn arm(&mut self, pid: u32) -> Result<(), TestingError> {
        match self.stdin.as_mut() {
            Some(stdin) => writeln!(stdin, "{pid}")
                .and_then(|()| stdin.flush())
                .map_err(io_err("arming the watchdog")),
            None => Ok(()),
        }
    }

    /// Stops the watchdog without it doing anything: the owner cleans up.
    pub(crate) fn disarm(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.stdin = None;
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        // If the owner did not disarm it, closing stdin lets it do its job;
        // then reap it (a disarmed one was reaped already).
        self.stdin = None;
        let _ = self.child.wait();
    }
}

/// Sends `signal` to a child.
pub(crate) fn signal(child: &Child, signal: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: kill has no memory-safety preconditions; the pid is our
        // own unreaped child, so it cannot have been reused.
        unsafe {
            libc::kill(pid, signal);
        }
    }
}

/// Waits for a child up to `timeout`; `true` if it exited (and was reaped).
pub(crate) fn wait_for_exit(child: &mut Child, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(_)) | Err(_) => return true,
            Ok(None) if Instant::now() >= deadline => return false,
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// Stops a child: `first` signal, then `SIGQUIT`, then `SIGKILL`; always reaps.
pub(crate) fn stop_child(child: &mut Child, first: libc::c_int) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    signal(child, first);
    if wait_for_exit(child, Duration::from_secs(10)) {
        return;
    }
    signal(child, libc::SIGQUIT);
    if wait_for_exit(child, Duration::from_secs(2)) {
        return;
    }
    let _ = child.kill();
    let _ = child.wait();
}
