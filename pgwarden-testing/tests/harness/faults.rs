//! Faults: a backend stopped with `Stopped`, a whole server frozen with
//! `TestServer::freeze`, both continued when the guard is dropped.

use std::time::Duration;

use pgwarden_testing::{eventually, within, Stopped, TestServer, TestingError};
use tokio_postgres::Client;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// How long a statement on a stopped process is given to (not) answer: far
/// above a `SELECT 1` on a loaded 2-core machine (a few ms).
const HANG: Duration = Duration::from_millis(500);
/// Bound on anything that must happen once the processes continue.
const RECOVER: Duration = Duration::from_secs(10);

/// The state letter of `/proc/<pid>/stat` (`T`: stopped by a signal).
fn state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..]
        .split_whitespace()
        .next()?
        .chars()
        .next()
}

async fn backend_pid(c: &Client) -> Result<i32> {
    Ok(c.query_one("SELECT pg_backend_pid()", &[]).await?.get(0))
}

async fn answers(c: &Client, limit: Duration) -> bool {
    matches!(
        tokio::time::timeout(limit, c.simple_query("SELECT 1")).await,
        Ok(Ok(_))
    )
}

#[tokio::test]
async fn stopped_backend_hangs_and_continues_on_drop() -> Result {
    let db = TestServer::shared()?.create_database().await?;
    let victim = db.connect().await?;
    let other = db.connect().await?;
    let pid = backend_pid(&victim).await?;

    let stopped = Stopped::stop([pid])?;
    assert_eq!(stopped.pids(), &[pid]);
    eventually(RECOVER, "the backend is stopped", || async {
        state(pid) == Some('T')
    })
    .await;
    assert!(!answers(&victim, HANG).await, "a stopped backend answered");
    assert!(
        answers(&other, RECOVER).await,
        "the other backends still answer"
    );

    drop(stopped);
    eventually(RECOVER, "the backend runs again", || async {
        state(pid) != Some('T')
    })
    .await;
    assert!(answers(&victim, RECOVER).await, "no answer after SIGCONT");
    Ok(())
}

#[tokio::test]
async fn stopped_continues_when_the_test_panics() -> Result {
    let db = TestServer::shared()?.create_database().await?;
    let victim = db.connect().await?;
    let pid = backend_pid(&victim).await?;
    let panicked = std::panic::catch_unwind(|| {
        let _stopped = Stopped::stop([pid]).expect("SIGSTOP");
        panic!("the test fails while the backend is stopped");
    });
    assert!(panicked.is_err());
    assert!(
        answers(&victim, RECOVER).await,
        "the backend stayed stopped"
    );
    Ok(())
}

#[test]
fn stopping_a_missing_process_is_an_error() {
    // pid_max is at most 2^22 on Linux: no such process.
    let err = Stopped::stop([i32::MAX]).unwrap_err();
    assert!(matches!(err, TestingError::Io { .. }), "{err}");
    assert!(err.to_string().contains("SIGSTOP"), "{err}");
}

#[tokio::test]
async fn freeze_stops_the_postmaster_and_every_child_until_dropped() -> Result {
    let server = TestServer::start_local()?;
    let postmaster = i32::try_from(server.pid().ok_or("no postmaster pid")?)?;
    let db = server.create_database().await?;
    let client = db.connect().await?;
    let backend = backend_pid(&client).await?;

    let frozen = server.freeze()?;
    let pids = frozen.pids().to_vec();
    assert_eq!(
        pids.first(),
        Some(&postmaster),
        "postmaster first: {pids:?}"
    );
    assert!(pids.contains(&backend), "{backend} not in {pids:?}");
    // The postmaster, the backend and at least the checkpointer, background
    // writer, WAL writer, autovacuum launcher and logging collector.
    assert!(pids.len() >= 5, "{pids:?}");
    // The postmaster and the test's backend are stopped. Any other child
    // is stopped too, or was exiting when its parent stopped: then it is a
    // zombie its stopped parent cannot reap, or already gone (seen under
    // load: an autovacuum worker ending at that moment).
    eventually(RECOVER, "every process stopped", || async {
        pids.iter().all(|&p| match state(p) {
            Some('T') => true,
            Some('Z') | None => p != postmaster && p != backend,
            _ => false,
        })
    })
    .await;
    assert!(!answers(&client, HANG).await, "a frozen server answered");
    let connect = tokio::time::timeout(HANG, db.connect()).await;
    assert!(connect.is_err(), "a frozen server accepted a connection");

    drop(frozen);
    eventually(RECOVER, "every process runs again", || async {
        pids.iter().all(|&p| state(p) != Some('T'))
    })
    .await;
    assert!(answers(&client, RECOVER).await, "no answer after the thaw");
    let fresh = within(RECOVER, "a new connection", db.connect()).await?;
    assert!(answers(&fresh, RECOVER).await);
    Ok(())
}

#[tokio::test]
async fn freezing_the_shared_server_is_refused() -> Result {
    let shared = TestServer::shared()?;
    let err = shared.freeze().unwrap_err();
    assert!(matches!(err, TestingError::NotLocal { .. }), "{err}");
    // Still answering: nothing was stopped.
    let db = shared.create_database().await?;
    assert!(answers(&db.connect().await?, RECOVER).await);
    Ok(())
}

/// A server whose listen queue is full refuses a non-blocking connect on
/// its Unix socket with `EAGAIN` at once; the harness's own connections
/// (a test's admin connection, a fresh database) wait for the queue to
/// drain instead of failing the test (seen on a loaded machine: "fresh
/// database: ... Resource temporarily unavailable").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_listen_queue_delays_the_harness_connections_instead_of_failing_them() -> Result {
    let server = TestServer::start_local()?;
    let db = server.create_database().await?;
    let socket = server
        .socket_dir()
        .ok_or("no socket directory")?
        .join(format!(".s.PGSQL.{}", server.port()));
    // The postmaster frozen, connects pile up in its listen queue until it
    // is full (PostgreSQL asks for twice max_connections, 800 here).
    let frozen = server.freeze()?;
    let mut queued = Vec::new();
    let full = loop {
        match tokio::net::UnixStream::connect(&socket).await {
            Ok(s) => queued.push(s),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break true,
            Err(e) => return Err(e.into()),
        }
        if queued.len() > 10_000 {
            break false;
        }
    };
    assert!(full, "no EAGAIN after {} queued connects", queued.len());
    // A plain connect now fails at once: the condition is there.
    let plain = tokio::time::timeout(HANG, db.pg_config().connect(tokio_postgres::NoTls)).await;
    match plain {
        Ok(Err(e)) => assert!(
            e.to_string().contains("temporarily unavailable")
                || format!("{e:?}").contains("WouldBlock"),
            "{e:?}"
        ),
        other => {
            return Err(format!(
                "a plain connect to a full queue: {:?}",
                other.map(|r| r.map(|_| ()))
            )
            .into())
        }
    }
    // The harness's connect waits; it has not failed while the queue is
    // full, and succeeds once the server runs and the queue drains.
    let waiting = tokio::spawn({
        let db = db.clone();
        async move { db.connect().await }
    });
    tokio::time::sleep(HANG).await;
    assert!(
        !waiting.is_finished(),
        "the harness's connect gave up on a full queue"
    );
    drop(queued);
    drop(frozen);
    let client = within(
        RECOVER,
        "the harness's connect after the queue drained",
        waiting,
    )
    .await??;
    assert!(answers(&client, RECOVER).await);
    Ok(())
}
