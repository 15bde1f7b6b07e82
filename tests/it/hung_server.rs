//! Every checkout bounded end to end against a server that accepts
//! connections but never answers: the postmaster and its backends stopped
//! with SIGSTOP, on a server of the test's own (never the shared one, which
//! other tests use meanwhile). The processes are continued by a guard that
//! also runs when the test fails. On every backend.

use std::time::{Duration, Instant};

use crate::support;

use pgwarden::{CheckoutError, Error, Lane, PoolerMode, Stage};
use pgwarden_testing::{TestDb, TestServer};
use support::backend::{settled, Backend, Settings};

/// Processes stopped with SIGSTOP; continued (SIGCONT) on drop.
struct Stopped(Vec<u32>);

impl Stopped {
    fn stop(pids: Vec<u32>) -> Stopped {
        assert!(!pids.is_empty(), "nothing to stop");
        let guard = Stopped(pids);
        for pid in &guard.0 {
            signal("STOP", *pid);
        }
        guard
    }

    /// The postmaster, then every process it started: listed once the
    /// postmaster is stopped (it starts no more), each stopped unless it
    /// has exited meanwhile (a backend whose session just ended: nothing
    /// left to stop).
    fn server(server: &TestServer) -> Stopped {
        let pm = server.pid().expect("a server of this test's own");
        let mut guard = Stopped::stop(vec![pm]);
        for pid in children(pm) {
            if stop_unless_gone(pid) {
                guard.0.push(pid);
            }
        }
        assert!(
            guard.0.len() > 1,
            "the postmaster of {pm} has no child to stop"
        );
        guard
    }
}

/// Stops `pid`; false when it no longer exists (it exited after it was
/// listed). A process that exists and cannot be stopped fails the test.
fn stop_unless_gone(pid: u32) -> bool {
    let stopped = kill("STOP", pid);
    if !stopped {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "kill -STOP {pid}: the process exists and was not stopped"
        );
    }
    stopped
}

impl Drop for Stopped {
    fn drop(&mut self) {
        for pid in self.0.iter().rev() {
            signal("CONT", *pid);
        }
    }
}

fn signal(sig: &str, pid: u32) {
    let ok = kill(sig, pid);
    // Continuing runs in Drop, maybe while panicking: never panic there.
    if sig != "CONT" {
        assert!(ok, "kill -{sig} {pid}");
    }
}

/// Sends `sig` to `pid`; whether it was delivered.
fn kill(sig: &str, pid: u32) -> bool {
    std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Children of `parent`, from /proc/<pid>/stat (the field after the
/// command name, which is in parentheses and may hold spaces).
fn children(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let ppid = rest.split_whitespace().nth(1).and_then(|p| p.parse().ok());
        if ppid == Some(parent) {
            out.push(pid);
        }
    }
    out
}

/// A dedicated throwaway server, started even when `DATABASE_URL` is set:
/// the test stops its processes, which it cannot do to an external server.
async fn own_server() -> (TestServer, TestDb) {
    let server = tokio::task::spawn_blocking(TestServer::start_local)
        .await
        .unwrap()
        .expect("throwaway PostgreSQL (started even with DATABASE_URL set)");
    assert!(!server.is_external());
    let db = server.create_database().await.expect("database");
    (server, db)
}

/// The settings of a pool here: waits of 2 s, direct.
fn settings(name: &'static str) -> Settings {
    Settings::new(name, 4)
        .wait(Duration::from_secs(2))
        .pooler(PoolerMode::Direct)
}

/// Polls until `f` succeeds; fails the test after `limit`.
async fn recovers<F, Fut, T, E>(limit: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    let start = Instant::now();
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) => assert!(
                start.elapsed() < limit,
                "{what}: still failing after {limit:?}: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Only against a hang: a stopped server answers nothing, ever, so a call
/// that did not end at its own bound would wait past this on any machine.
const HANG: Duration = Duration::from_secs(60);

/// Runs `fut`, which must fail (at its bound, about `limit`: printed, not
/// asserted, since a loaded machine adds its own delay; a call held by the
/// stopped server would never end, and fails at [`HANG`]); returns its
/// error.
async fn fails_within<T, E: std::fmt::Debug>(
    limit: Duration,
    what: &str,
    fut: impl std::future::Future<Output = Result<T, E>>,
) -> E {
    let start = Instant::now();
    let r = pgwarden_testing::within(HANG, what, fut).await;
    let took = start.elapsed();
    eprintln!("{what}: failed after {took:?} (about {limit:?} expected)");
    match r {
        Ok(_) => panic!("{what}: succeeded against a stopped server"),
        Err(e) => e,
    }
}

backends!(
    a_stopped_server_cannot_hold_get_or_readiness_past_their_bounds,
    flavor = "multi_thread",
    worker_threads = 2
);
async fn a_stopped_server_cannot_hold_get_or_readiness_past_their_bounds<B: Backend>() {
    let (server, db) = own_server().await;
    let pool = B::build_on(&db.pg_config(), &settings("hung"));
    // One connection open and idle: the probe will find it and its query
    // will hang; a second checkout must connect, and connecting hangs.
    B::readiness(&pool, Duration::from_secs(60)).await.unwrap();
    settled::<B>(&pool).await;
    let stopped = Stopped::server(&server);

    let ms = Duration::from_millis;
    let readiness = || B::readiness(&pool, Duration::from_secs(1));
    let e = fails_within(ms(1200), "readiness(1 s), query hung", readiness()).await;
    assert!(e.is_timeout(), "{e}");
    let e = fails_within(ms(2200), "get() bound 2 s, connecting hung", B::get(&pool)).await;
    assert!(B::is_drop_in_timeout(&e), "{e:?}");
    // The probe's connection was closed: the next probe connects, and hangs.
    let e = fails_within(ms(1200), "readiness(1 s), connecting hung", readiness()).await;
    assert!(e.is_timeout(), "{e}");

    let e = B::get_within(&pool, Duration::from_millis(500))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Checkout(CheckoutError::Timeout {
                stage: Stage::Connection,
                ..
            })
        ),
        "{e}"
    );
    // Nothing stays checked out but the last probe's connection set-up,
    // kept going in the background (at most 10 s) for the next probe.
    let s = B::status(&pool);
    assert_eq!(s.in_use - s.lane(Lane::Probe).in_use, 0, "{s}");
    assert!(s.lane(Lane::Probe).in_use <= 1, "{s}");

    // Continued: everything recovers, with no manual action.
    drop(stopped);
    let took = recovers(HANG, "readiness", || {
        B::readiness(&pool, Duration::from_secs(1))
    })
    .await;
    eprintln!("{}: readiness after SIGCONT: {took:?}", B::NAME);
    let mut c = recovers(HANG, "get", || B::get(&pool)).await;
    B::select_1(&mut c).await;
    drop(c);
    settled::<B>(&pool).await;
}

backends!(
    a_hang_while_recycling_or_connecting_is_bounded,
    flavor = "multi_thread",
    worker_threads = 2
);
async fn a_hang_while_recycling_or_connecting_is_bounded<B: Backend>() {
    let (server, db) = own_server().await;
    // Verified recycling (sqlx: its test before acquire) runs a statement
    // on every checkout of an idle connection: with its backend stopped,
    // recycling hangs.
    let pool = B::build_checked(&db.pg_config(), &settings("hung-recycle"));
    let c = B::get(&pool).await.unwrap();
    let idle_backend = B::pid(&c) as u32;
    drop(c);
    settled::<B>(&pool).await;

    let stopped = Stopped::stop(vec![idle_backend]);
    let bound = Duration::from_secs(1);
    let limit = Duration::from_millis(1200);
    let get = || B::get_within(&pool, bound);
    let e = fails_within(limit, "checkout bound 1 s, recycling hung", get()).await;
    assert!(
        matches!(
            e,
            Error::Checkout(CheckoutError::Timeout {
                stage: Stage::Connection,
                ..
            })
        ),
        "{e}"
    );
    drop(stopped);

    // Connecting: one connection out and working, the postmaster stopped
    // (its backends run): a second checkout must connect, and cannot.
    let mut working = recovers(HANG, "get", || B::get(&pool)).await;
    let stopped = Stopped::stop(vec![server.pid().unwrap()]);
    B::select_1(&mut working).await;
    let e = fails_within(limit, "checkout bound 1 s, connecting hung", get()).await;
    assert!(e.is_timeout(), "{e}");
    drop(stopped);
    drop(working);
    let mut c = recovers(HANG, "get after SIGCONT", || {
        B::get_within(&pool, Duration::from_secs(2))
    })
    .await;
    B::select_1(&mut c).await;
}
