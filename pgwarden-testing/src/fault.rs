//! Faults for tests: processes stopped with `SIGSTOP` (a backend that hangs,
//! a server that hangs) and continued when the guard is dropped.

use crate::process::io_err;
use crate::{TestServer, TestingError};
use std::collections::{BTreeSet, HashMap};
use std::io;

/// Processes stopped with `SIGSTOP`, continued with `SIGCONT` when the guard
/// is dropped, also when the test panics while holding it.
///
/// A stopped backend holds its locks and its socket but answers nothing: the
/// client's next statement hangs, as on a frozen host.
///
/// ```no_run
/// # async fn t(db: pgwarden_testing::TestDb) -> Result<(), Box<dyn std::error::Error>> {
/// let victim = db.connect().await?;
/// let admin = db.connect().await?;
/// let pid: i32 = victim.query_one("SELECT pg_backend_pid()", &[]).await?.get(0);
/// let stopped = pgwarden_testing::Stopped::stop([pid])?;
/// // ... victim's statements hang here ...
/// drop(stopped); // SIGCONT: the backend carries on
/// # let _ = admin; Ok(()) }
/// ```
#[derive(Debug)]
#[must_use = "the processes are continued as soon as the guard is dropped"]
pub struct Stopped {
    pids: Vec<i32>,
}

impl Stopped {
    /// Stops every process of `pids` with `SIGSTOP`.
    ///
    /// The test process must be allowed to signal them (same user, or root:
    /// the harness's servers run as `postgres` when the tests run as root).
    ///
    /// # Errors
    ///
    /// [`TestingError::Io`] when `pids` is empty or a signal cannot be sent
    /// (no such process, not permitted); the processes stopped before the
    /// failure are continued.
    pub fn stop(pids: impl IntoIterator<Item = i32>) -> Result<Stopped, TestingError> {
        let mut stopped = Stopped { pids: Vec::new() };
        for pid in pids {
            send(pid, libc::SIGSTOP)
                .map_err(|e| io_error(format!("SIGSTOP to process {pid}"), e))?;
            stopped.pids.push(pid);
        }
        if stopped.pids.is_empty() {
            return Err(io_error(
                "stopping processes: no pid given".to_owned(),
                io::Error::from(io::ErrorKind::InvalidInput),
            ));
        }
        Ok(stopped)
    }

    /// The stopped processes, in the order they were stopped.
    pub fn pids(&self) -> &[i32] {
        &self.pids
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        // Last stopped, first continued: a server's children before its postmaster.
        for &pid in self.pids.iter().rev() {
            // Nothing to do if it fails: the process is gone.
            let _ = send(pid, libc::SIGCONT);
        }
    }
}

/// A whole PostgreSQL server stopped with `SIGSTOP` (its postmaster, every
/// backend and every auxiliary process), made by [`TestServer::freeze`];
/// continued when dropped, also when the test panics while holding it.
#[derive(Debug)]
#[must_use = "the server is continued as soon as the guard is dropped"]
pub struct Frozen {
    stopped: Stopped,
}

impl Frozen {
    /// The stopped processes: the postmaster first, then its descendants.
    pub fn pids(&self) -> &[i32] {
        self.stopped.pids()
    }
}

impl TestServer {
    /// Hangs the whole server: stops its postmaster, then all the
    /// postmaster's descendants (backends, checkpointer, WAL writer,
    /// autovacuum, logging collector…) with `SIGSTOP`, until no new one
    /// appears. Connections stay open and every statement hangs, as when a
    /// database host freezes. The server continues when the [`Frozen`] guard
    /// is dropped.
    ///
    /// A hung-server test must start a server of its own
    /// ([`TestServer::start`] with `DATABASE_URL` unset, or
    /// [`TestServer::start_local`]); never freeze [`TestServer::shared`]:
    /// every other test of the binary would hang with it (it is refused).
    ///
    /// ```no_run
    /// # async fn t() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// let server = pgwarden_testing::TestServer::start_local()?;
    /// let db = server.create_database().await?;
    /// let client = db.connect().await?;
    /// let frozen = server.freeze()?;
    /// let hung = tokio::time::timeout(Duration::from_millis(300), client.simple_query("SELECT 1")).await;
    /// assert!(hung.is_err());
    /// drop(frozen);
    /// client.simple_query("SELECT 1").await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`TestingError::NotLocal`] for an external server (`DATABASE_URL`)
    /// or the shared one; [`TestingError::Io`] when a signal cannot be sent
    /// or `/proc` cannot be read (the processes already stopped are
    /// continued).
    pub fn freeze(&self) -> Result<Frozen, TestingError> {
        if self.is_shared() {
            return Err(TestingError::NotLocal {
                operation: "freezing the shared server (every test of the binary would hang)",
            });
        }
        let postmaster =
            self.pid()
                .and_then(|p| i32::try_from(p).ok())
                .ok_or(TestingError::NotLocal {
                    operation: "freezing a server (DATABASE_URL names an external one)",
                })?;
        // The postmaster first: once stopped it forks no new process.
        let mut frozen = Frozen {
            stopped: Stopped::stop([postmaster])?,
        };
        // A child forked just before may not be listed yet: scan again until
        // a scan finds nothing new.
        for _ in 0..10 {
            let fresh: Vec<i32> = descendants(postmaster)?
                .into_iter()
                .filter(|p| !frozen.stopped.pids.contains(p))
                .collect();
            if fresh.is_empty() {
                return Ok(frozen);
            }
            for pid in fresh {
                match send(pid, libc::SIGSTOP) {
                    Ok(()) => frozen.stopped.pids.push(pid),
                    // It exited between the scan and the signal.
                    Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                    Err(e) => return Err(io_error(format!("SIGSTOP to process {pid}"), e)),
                }
            }
        }
        Ok(frozen)
    }
}

/// Every descendant of `root`, from the parent pids in `/proc/<pid>/stat`.
fn descendants(root: i32) -> Result<BTreeSet<i32>, TestingError> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    let entries =
        std::fs::read_dir("/proc").map_err(|e| io_error("reading /proc".to_owned(), e))?;
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        // A process that exits meanwhile has no stat file any more: skip it.
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        if let Some(ppid) = parent_pid(&stat) {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let mut out = BTreeSet::new();
    let mut todo = vec![root];
    while let Some(p) = todo.pop() {
        for &c in children.get(&p).into_iter().flatten() {
            if out.insert(c) {
                todo.push(c);
            }
        }
    }
    Ok(out)
}

/// The parent pid in a `/proc/<pid>/stat` line: `pid (comm) state ppid …`,
/// where `comm` may hold spaces and parentheses.
fn parent_pid(stat: &str) -> Option<i32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

fn send(pid: i32, signal: libc::c_int) -> io::Result<()> {
    // SAFETY: kill(2) has no memory-safety preconditions; it only sends a
    // signal (or fails with an errno that is read below).
    if unsafe { libc::kill(pid, signal) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn io_error(context: String, source: io::Error) -> TestingError {
    io_err(context)(source)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parent_pid_reads_past_a_command_with_spaces_and_parentheses() {
        assert_eq!(parent_pid("42 (postgres: a (b) c) S 7 42 42 0"), Some(7));
        assert_eq!(parent_pid("garbage"), None);
    }

    #[test]
    fn stopping_nothing_is_an_error() {
        assert!(Stopped::stop(Vec::new()).is_err());
    }
}
