//! The `pgwarden` binary, run as a process against a throwaway PostgreSQL.
//!
//! Commands under `run` are small `sh` scripts that write files (their
//! token, a SIGTERM they trapped) and wait for a `go` file: the test waits
//! on those files, on process exits and on rows, each within a bound.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use pgwarden_testing::{eventually, within, Stopped, TestDb, TestServer};
use serde_json::Value;
use tokio::process::{Child, Command};

/// The TLS-only pool's cancel (a library test that needs this crate's TLS
/// stack): a module of this binary, not a binary of its own to link and
/// run after this one.
#[path = "cli/lease_tls_cancel.rs"]
mod lease_tls_cancel;

const BIN: &str = env!("CARGO_BIN_EXE_pgwarden");
const BOUND: Duration = Duration::from_secs(20);

async fn db() -> TestDb {
    TestServer::shared()
        .expect("test server")
        .create_database()
        .await
        .expect("test database")
}

fn pgwarden(url: &str) -> Command {
    command(BIN, url)
}

/// `program` with `DATABASE_URL` set to `url` and libpq's variables unset.
fn command(program: &str, url: &str) -> Command {
    let mut c = Command::new(program);
    c.env("DATABASE_URL", url);
    for k in [
        "PGHOST",
        "PGHOSTADDR",
        "PGPORT",
        "PGUSER",
        "PGPASSWORD",
        "PGDATABASE",
        "PGAPPNAME",
        "PGPASSFILE",
        "PGCONNECT_TIMEOUT",
        "PGSSLMODE",
        "PGSSLROOTCERT",
        "PGSSLCERT",
        "PGSSLKEY",
        "PGSERVICE",
        "PGSERVICEFILE",
        "PGSYSCONFDIR",
    ] {
        c.env_remove(k);
    }
    c.stdin(Stdio::null()).kill_on_drop(true);
    // The signals the tests send start at their defaults, whatever the test
    // runner inherited (`nohup cargo test` ignores SIGHUP, a background
    // job SIGINT and SIGQUIT): `run` keeps a signal ignored at its start
    // ignored, which is what a test of forwarding must not meet.
    // SAFETY: only signal dispositions are set between fork and exec.
    unsafe {
        c.pre_exec(|| {
            for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT] {
                libc::signal(sig, libc::SIG_DFL);
            }
            Ok(())
        });
    }
    c
}

/// Runs `pgwarden ARGS` to its end (bounded).
async fn cli(url: &str, args: &[&str]) -> Output {
    let out = within(BOUND, "pgwarden to exit", pgwarden(url).args(args).output())
        .await
        .expect("pgwarden runs");
    if out.status.code().is_none() {
        panic!("pgwarden {args:?} died of a signal: {out:?}");
    }
    out
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

async fn json(url: &str, args: &[&str]) -> Vec<Value> {
    let out = cli(url, args).await;
    assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
    match serde_json::from_slice(&out.stdout) {
        Ok(Value::Array(a)) => a,
        other => panic!(
            "{args:?}: not a JSON array: {other:?} from {}",
            stdout(&out)
        ),
    }
}

/// A command for `run`: writes its token to `dir/token`, traps SIGTERM
/// into `dir/term` (then exits `term_code`), waits (at most 60 s) for
/// `dir/go`, and exits 0.
fn job(dir: &Path, term_code: i32) -> Vec<String> {
    let d = dir.display();
    vec![
        "sh".into(),
        "-c".into(),
        format!(
            "trap 'echo term > {d}/term.tmp && mv {d}/term.tmp {d}/term; exit {term_code}' TERM
echo \"$PGWARDEN_LEASE $PGWARDEN_TOKEN\" > {d}/token.tmp && mv {d}/token.tmp {d}/token
i=0; while [ ! -f {d}/go ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
echo done >> {d}/ran"
        ),
    ]
}

fn spawn_run(url: &str, name: &str, opts: &[&str], cmd: &[String]) -> Child {
    let mut c = pgwarden(url);
    c.arg("run").arg(name).args(opts).arg("--").args(cmd);
    c.stdout(Stdio::null()).stderr(Stdio::piped());
    c.spawn().expect("spawn pgwarden run")
}

/// The file at `path` once it exists, read whole. Its writer writes a
/// temporary file and renames it (`echo … > f.tmp && mv f.tmp f`): a file
/// seen is complete (`echo … > f` is not: the shell creates `f` empty
/// before it writes, and a read in between got "").
async fn wait_file(path: &Path) -> String {
    eventually(
        BOUND,
        &format!("{} to be written", path.display()),
        || async { path.exists() },
    )
    .await;
    std::fs::read_to_string(path).expect("read")
}

/// The token the command saw: `dir/token` is `NAME TOKEN`.
async fn token_seen(dir: &Path, name: &str) -> i64 {
    let line = wait_file(&dir.join("token")).await;
    let (seen_name, token) = line.trim().split_once(' ').expect("NAME TOKEN");
    assert_eq!(seen_name, name);
    token.parse().expect("a token")
}

/// Polls `f` until it yields a value (within [`BOUND`]).
async fn until<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    within(BOUND, what, async {
        loop {
            if let Some(v) = f().await {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
}

async fn exit_code(child: &mut Child, limit: Duration) -> i32 {
    let status = within(limit, "pgwarden run to exit", child.wait())
        .await
        .expect("wait");
    status.code().expect("an exit code, not a signal")
}

fn lease<'a>(rows: &'a [Value], name: &str) -> Option<&'a Value> {
    rows.iter().find(|r| r["name"] == name)
}

fn pid(c: &Child) -> i32 {
    c.id().expect("running") as i32
}

fn tempdir() -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().expect("tempdir");
    let p = t.path().to_path_buf();
    (t, p)
}

#[tokio::test(flavor = "multi_thread")]
async fn two_runs_at_once_exactly_one_runs_the_other_exits_75() {
    let db = db().await;
    let url = db.url();
    let (_t, dir) = tempdir();
    let cmd = job(&dir, 0);
    let mut a = spawn_run(&url, "nightly", &["--ttl", "5s"], &cmd);
    let mut b = spawn_run(&url, "nightly", &["--ttl", "5s"], &cmd);
    // The command waits for `go`: the loser must have given up by then.
    let first = within(BOUND, "one run to give up", async {
        tokio::select! {
            s = a.wait() => (s.expect("wait").code(), 'a'),
            s = b.wait() => (s.expect("wait").code(), 'b'),
        }
    })
    .await;
    assert_eq!(first.0, Some(75), "the loser exits 75");
    token_seen(&dir, "nightly").await;
    std::fs::write(dir.join("go"), "").unwrap();
    let winner = if first.1 == 'a' { &mut b } else { &mut a };
    assert_eq!(exit_code(winner, BOUND).await, 0);
    let ran = std::fs::read_to_string(dir.join("ran")).unwrap();
    assert_eq!(ran.lines().count(), 1, "exactly one command ran: {ran:?}");
    // --skip-code changes the loser's code (cron's 0).
    let (_t2, dir2) = tempdir();
    let mut holder = spawn_run(&url, "nightly", &["--ttl", "5s"], &job(&dir2, 0));
    eventually(BOUND, "the lease to be held", || async {
        lease(&json(&url, &["leases", "--json"]).await, "nightly")
            .is_some_and(|r| r["live"] == true)
    })
    .await;
    let skipped = cli(
        &url,
        &[
            "run",
            "nightly",
            "--skip-code",
            "0",
            "--",
            "sh",
            "-c",
            "exit 9",
        ],
    )
    .await;
    assert_eq!(skipped.status.code(), Some(0), "{}", stderr(&skipped));
    assert!(
        stderr(&skipped).contains("is held by"),
        "{}",
        stderr(&skipped)
    );
    // --quiet: nothing on stderr either (cron mails whatever is written).
    let quiet = cli(
        &url,
        &[
            "run",
            "nightly",
            "--skip-code",
            "0",
            "--quiet",
            "--",
            "true",
        ],
    )
    .await;
    assert_eq!(quiet.status.code(), Some(0));
    assert_eq!(stderr(&quiet), "", "--quiet");
    std::fs::write(dir2.join("go"), "").unwrap();
    assert_eq!(exit_code(&mut holder, BOUND).await, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_command_sees_its_token_and_leases_shows_it_then_no_live_holder() {
    let db = db().await;
    let url = db.url();
    let (_t, dir) = tempdir();
    let mut run = spawn_run(&url, "report", &["--ttl", "10s"], &job(&dir, 0));
    let token = token_seen(&dir, "report").await;
    let rows = json(&url, &["leases", "--json"]).await;
    let row = lease(&rows, "report").expect("a row for report");
    assert_eq!(row["token"], token, "{row}");
    assert_eq!(row["live"], true);
    assert!(
        row["holder"].as_str().is_some_and(|h| !h.is_empty()),
        "{row}"
    );
    let expires = row["expires_in_s"].as_f64().unwrap();
    assert!(expires > 0.0 && expires <= 10.0, "{row}");
    assert_eq!(row["ttl_s"].as_f64(), Some(10.0), "{row}");
    assert!(row["blocked_by"].is_null());
    assert!(row["taken_at"].as_str().is_some_and(|t| t.ends_with('Z')));
    // The human table names it too.
    let table = stdout(&cli(&url, &["leases"]).await);
    println!("{table}");
    assert!(table.starts_with("NAME"), "{table}");
    assert!(
        table.contains("report") && table.contains(&token.to_string()),
        "{table}"
    );

    // --watch into a pipe: one sample after the other, each with its
    // header, no screen codes; until SIGINT.
    let mut watch = pgwarden(&url)
        .args(["leases", "--watch", "0.2"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = watch.stdout.take().unwrap();
    let mut seen = Vec::new();
    within(BOUND, "three samples", async {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 4096];
        while String::from_utf8_lossy(&seen)
            .matches("pgwarden leases  ")
            .count()
            < 3
        {
            let n = out.read(&mut buf).await.unwrap();
            assert!(n > 0, "watch ended early");
            seen.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    let seen = String::from_utf8_lossy(&seen).into_owned();
    assert!(seen.contains("report"), "{seen}");
    assert!(
        !seen.contains('\x1b'),
        "no screen codes into a pipe: {seen:?}"
    );
    kill(pid(&watch), libc::SIGINT);
    assert_eq!(exit_code(&mut watch, BOUND).await, 0);

    std::fs::write(dir.join("go"), "").unwrap();
    assert_eq!(exit_code(&mut run, BOUND).await, 0);
    let rows = json(&url, &["leases", "--json"]).await;
    assert!(
        rows.iter().all(|r| r["live"] == false),
        "no live holder once it ended: {rows:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn revoke_stops_the_command_within_ttl_and_run_exits_76() {
    let db = db().await;
    let url = db.url();
    let (_t, dir) = tempdir();
    // A TTL of 10 s: run learns of the revoke at its next renewal (a third
    // of the TTL), so within the TTL leaves a loaded machine more than 6 s.
    let mut run = spawn_run(
        &url,
        "sync",
        &["--ttl", "10s", "--grace", "5s"],
        &job(&dir, 0),
    );
    let token = token_seen(&dir, "sync").await;

    // Without --yes: only what it would do.
    let dry = cli(&url, &["revoke", "sync"]).await;
    assert_eq!(dry.status.code(), Some(0), "{}", stderr(&dry));
    assert!(stdout(&dry).contains("would revoke"), "{}", stdout(&dry));
    let rows = json(&url, &["leases", "--json"]).await;
    assert_eq!(lease(&rows, "sync").unwrap()["live"], true);
    let holder = lease(&rows, "sync").unwrap()["holder"]
        .as_str()
        .unwrap()
        .to_owned();

    let out = cli(&url, &["revoke", "sync", "--yes"]).await;
    let revoked = Instant::now();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let said = stdout(&out);
    assert!(
        said.contains(&holder) && said.contains(&token.to_string()),
        "{said}"
    );
    assert_eq!(exit_code(&mut run, BOUND).await, 76);
    let took = revoked.elapsed();
    assert!(
        took <= Duration::from_secs(10),
        "stopped {took:?} after the revoke"
    );
    // Revoked: the name is free at once, so the command is SIGKILLed at
    // once (no SIGTERM to trap), and did not finish on its own.
    assert!(!dir.join("term").exists(), "SIGKILL, not SIGTERM");
    assert!(
        !dir.join("ran").exists(),
        "the command did not finish on its own"
    );
    // Nothing to revoke any more.
    let again = cli(&url, &["revoke", "sync", "--yes"]).await;
    assert_eq!(again.status.code(), Some(1));
    assert!(
        stderr(&again).contains("nothing to revoke"),
        "{}",
        stderr(&again)
    );
    println!("revoke to run's exit 76: {took:?} (TTL 10 s)");
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_reaches_the_command_and_the_lease_is_released() {
    let db = db().await;
    let url = db.url();
    let (_t, dir) = tempdir();
    // A long TTL: only a release lets the next run in at once.
    let mut run = spawn_run(&url, "export", &["--ttl", "60s"], &job(&dir, 3));
    token_seen(&dir, "export").await;
    kill(pid(&run), libc::SIGTERM);
    // The command trapped it, and its code is run's.
    assert_eq!(exit_code(&mut run, BOUND).await, 3);
    assert_eq!(wait_file(&dir.join("term")).await.trim(), "term");
    let rows = json(&url, &["leases", "--json"]).await;
    assert!(rows.iter().all(|r| r["live"] == false), "{rows:?}");
    let next = cli(
        &url,
        &["run", "export", "--ttl", "60s", "--", "sh", "-c", "exit 0"],
    )
    .await;
    assert_eq!(
        next.status.code(),
        Some(0),
        "taken at once: {}",
        stderr(&next)
    );
}

/// Sends `sig` to `pid`, a child of this test not yet reaped.
fn kill(pid: i32, sig: i32) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    let rc = unsafe { libc::kill(pid, sig) };
    assert_eq!(
        rc,
        0,
        "kill({pid}, {sig}): {}",
        std::io::Error::last_os_error()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_frozen_run_is_taken_over_after_the_ttl_and_stops_its_command_when_it_wakes() {
    let db = db().await;
    let url = db.url();
    let (_ta, dir_a) = tempdir();
    let (_tb, dir_b) = tempdir();
    let mut a = spawn_run(
        &url,
        "rollup",
        &["--ttl", "2s", "--grace", "5s"],
        &job(&dir_a, 0),
    );
    let token_a = token_seen(&dir_a, "rollup").await;
    let frozen = Stopped::stop([pid(&a)]).expect("SIGSTOP pgwarden run");
    let stopped_at = Instant::now();
    // A's term as the database has it, frozen with its holder: a renewal
    // sent just before the stop has had time to land once the row reads
    // the same twice, 300 ms apart.
    let admin = db.connect().await.unwrap();
    let expiry = || async {
        let row = admin
            .query_one(
                "SELECT expires_at, token FROM pgwarden_leases WHERE name = 'rollup'",
                &[],
            )
            .await
            .unwrap();
        (row.get::<_, std::time::SystemTime>(0), row.get::<_, i64>(1))
    };
    let mut a_expires = expiry().await.0;
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (now, token) = expiry().await;
        assert_eq!(token, token_a);
        if now == a_expires {
            break;
        }
        a_expires = now;
    }
    // B's own TTL is not under test: 60 s (see `takeover_leaves_no_overlap`
    // for why not A's 2 s).
    let mut b = spawn_run(
        &url,
        "rollup",
        &["--ttl", "60s", "--wait", "15s"],
        &job(&dir_b, 0),
    );
    let token_b = token_seen(&dir_b, "rollup").await;
    let waited = stopped_at.elapsed();
    assert!(token_b > token_a, "a new term: {token_b} > {token_a}");
    let b_taken: std::time::SystemTime = admin
        .query_one(
            "SELECT taken_at FROM pgwarden_leases WHERE name = 'rollup' AND token = $1",
            &[&token_b],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        b_taken >= a_expires,
        "taken over only once A's term expired: {b_taken:?} < {a_expires:?}"
    );
    std::fs::write(dir_b.join("go"), "").unwrap();
    assert_eq!(exit_code(&mut b, BOUND).await, 0);
    // A's keeper killed A's command while A was frozen (before B took
    // over); woken, A exits 76.
    drop(frozen);
    assert_eq!(exit_code(&mut a, BOUND).await, 76);
    assert!(!dir_a.join("ran").exists());
    println!("take-over of a frozen run after {waited:?} (TTL 2 s)");
}

/// `run --wait` counts its lease's deadline from the statement that took
/// the lease, not from the start of its wait: a run that waited longer than
/// its TTL and is then stopped (a loaded machine, SIGSTOP) for part of its
/// term keeps its command. It counted from the start of the wait: its
/// command was protected by the slack alone (TTL/16) until the first
/// renewal, and a stop that long had its keeper kill the command (exit 76;
/// seen under load, and here every time).
#[tokio::test(flavor = "multi_thread")]
async fn a_run_that_waited_longer_than_its_ttl_keeps_its_command_through_a_stop() {
    let db = db().await;
    let url = db.url();
    let (_ta, dir_a) = tempdir();
    let (_tb, dir_b) = tempdir();
    let mut a = spawn_run(&url, "nightly", &["--ttl", "60s"], &job(&dir_a, 0));
    token_seen(&dir_a, "nightly").await;
    // B waits for A's release: 8 s, longer than its own 6 s TTL (its
    // margin 750 ms, its slack 375 ms).
    let mut b = spawn_run(
        &url,
        "nightly",
        &["--ttl", "6s", "--wait", "60s"],
        &job(&dir_b, 0),
    );
    tokio::time::sleep(Duration::from_secs(8)).await;
    std::fs::write(dir_a.join("go"), "").unwrap();
    assert_eq!(exit_code(&mut a, BOUND).await, 0);
    token_seen(&dir_b, "nightly").await;
    // B's command runs: stop B's `run` (its keeper goes on) for 2 s, well
    // inside the 5.25 s its lease is trusted from the statement that took
    // it, and far past the slack.
    let frozen = Stopped::stop([pid(&b)]).expect("SIGSTOP pgwarden run");
    tokio::time::sleep(Duration::from_secs(2)).await;
    drop(frozen);
    std::fs::write(dir_b.join("go"), "").unwrap();
    assert_eq!(
        exit_code(&mut b, BOUND).await,
        0,
        "B's command ran to its end (76: its keeper killed it)"
    );
    assert!(dir_b.join("ran").exists(), "B's command finished");
}

#[tokio::test(flavor = "multi_thread")]
async fn locks_lists_an_idle_sessions_advisory_lock_and_check_names_it_until_released() {
    let db = db().await;
    let url = db.url();
    let mut config = db.pg_config();
    config.application_name("psql");
    let (holder, conn) = config.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    let holder_pid: i32 = holder
        .query_one("SELECT pg_advisory_lock(4242), pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(1);
    // A second session waits for it.
    let (waiter, conn) = db.pg_config().connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    let waiter_pid: i32 = waiter
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let cancel = waiter.cancel_token();
    let wait =
        tokio::spawn(async move { waiter.execute("SELECT pg_advisory_lock(4242)", &[]).await });

    let locks = until("the waiter to show", || async {
        let locks = json(&url, &["locks", "--json"]).await;
        locks
            .iter()
            .any(|l| l["pid"] == waiter_pid && l["granted"] == false)
            .then_some(locks)
    })
    .await;
    let held = locks
        .iter()
        .find(|l| l["pid"] == holder_pid)
        .unwrap_or_else(|| panic!("the idle session's lock: {locks:?}"));
    assert_eq!(held["key"], "4242");
    assert_eq!(held["mode"], "exclusive");
    assert_eq!(held["granted"], true);
    assert_eq!(held["state"], "idle");
    assert_eq!(held["application_name"], "psql");
    assert!(
        held["state_for_s"].as_f64().is_some_and(|s| s >= 0.0),
        "{held}"
    );
    assert_eq!(held["waiting_pids"], serde_json::json!([waiter_pid]));
    assert!(held.get("client_addr").is_some());
    let table = stdout(&cli(&url, &["locks"]).await);
    println!("{table}");
    assert!(table.contains("4242") && table.contains("idle"), "{table}");

    let out = cli(&url, &["check", "--max-idle-lock", "0s"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let said = stdout(&out);
    println!("{said}");
    assert!(
        said.lines().any(|l| l.starts_with("idle_lock:")
            && l.contains("4242")
            && l.contains(&holder_pid.to_string())),
        "{said}"
    );
    assert!(
        said.lines().any(|l| l.starts_with("lock_waiter:")),
        "{said}"
    );
    // Above the threshold nothing is idle long enough.
    let out = cli(&url, &["check", "--max-idle-lock", "1h", "--no-leases"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));

    cancel.cancel_query(tokio_postgres::NoTls).await.unwrap();
    assert!(within(BOUND, "the wait to end", wait)
        .await
        .unwrap()
        .is_err());
    holder
        .execute("SELECT pg_advisory_unlock(4242)", &[])
        .await
        .unwrap();
    let out = cli(
        &url,
        &[
            "check",
            "--max-idle-lock",
            "0s",
            "--json",
            "--no-leases",
            "--database",
            db.name(),
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    assert_eq!(stdout(&out).trim(), "[]");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lease_blocked_by_a_frozen_fenced_holder_shows_as_blocked() {
    let db = db().await;
    let url = db.url();
    let (_t, dir) = tempdir();
    let mut run = spawn_run(
        &url,
        "ledger",
        &["--ttl", "2s", "--grace", "5s"],
        &job(&dir, 0),
    );
    token_seen(&dir, "ledger").await;
    // A fenced transaction's row lock, left open (its holder frozen).
    let mut config = db.pg_config();
    config.application_name("ledger-writer");
    let (fenced, conn) = config.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    fenced.batch_execute("BEGIN").await.unwrap();
    let fenced_pid: i32 = fenced
        .query_one(
            "SELECT pg_backend_pid() FROM pgwarden_leases WHERE name = 'ledger' FOR KEY SHARE",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let frozen = Stopped::stop([pid(&run)]).expect("SIGSTOP pgwarden run");
    let rows = until("the lease to expire", || async {
        let rows = json(&url, &["leases", "--json"]).await;
        lease(&rows, "ledger")
            .is_some_and(|r| r["live"] == false)
            .then_some(rows)
    })
    .await;
    let row = lease(&rows, "ledger").unwrap();
    let by = &row["blocked_by"];
    assert_eq!(by["pid"], fenced_pid, "{row}");
    assert_eq!(by["application_name"], "ledger-writer");
    assert_eq!(by["state"], "idle in transaction");
    assert!(by["state_for_s"].as_f64().is_some(), "{row}");
    let out = cli(&url, &["check"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(
        stdout(&out).lines().any(|l| l.starts_with("blocked_lease:")
            && l.contains("ledger")
            && l.contains(&fenced_pid.to_string())),
        "{}",
        stdout(&out)
    );
    // A read-only on-call role (SELECT and pg_monitor, no UPDATE: no
    // probe) still finds a lone fenced transaction through the row's xmax.
    let admin = db.connect().await.unwrap();
    admin
        .batch_execute(&format!(
            "DO $$ BEGIN CREATE ROLE oncall LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$;
             GRANT pg_monitor TO oncall; GRANT SELECT ON pgwarden_leases TO oncall;
             GRANT CONNECT ON DATABASE \"{}\" TO oncall",
            db.name()
        ))
        .await
        .unwrap();
    let oncall = format!("{url} user=oncall");
    let rows = json(&oncall, &["leases", "--json"]).await;
    assert_eq!(
        lease(&rows, "ledger").unwrap()["blocked_by"]["pid"],
        fenced_pid,
        "{rows:?}"
    );
    // The fenced transaction ends: nothing blocks it any more.
    fenced.batch_execute("COMMIT").await.unwrap();
    let rows = json(&url, &["leases", "--json"]).await;
    assert!(
        lease(&rows, "ledger").unwrap()["blocked_by"].is_null(),
        "{rows:?}"
    );
    drop(frozen);
    assert_eq!(exit_code(&mut run, BOUND).await, 76);
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_and_an_unreachable_database_get_clear_errors() {
    let db = db().await;
    let url = db.url();
    let help = cli(&url, &["--help"]).await;
    assert_eq!(help.status.code(), Some(0));
    for sub in ["run", "leases", "locks", "check", "revoke", "ddl"] {
        assert!(stdout(&help).contains(sub), "{sub}: {}", stdout(&help));
    }
    let cases: &[(&[&str], i32, &str)] = &[
        (
            &["run", "x", "--ttl", "soon", "--", "true"],
            2,
            "invalid duration",
        ),
        (&["run", "x"], 2, "CMD"),
        (&["revoke", "bad\nname", "--yes"], 2, "lease name"),
        (&["run", "x", "--ttl", "0s", "--", "true"], 2, "ttl"),
        (
            &["leases", "--table", "x; DROP TABLE y"],
            2,
            "lease table name",
        ),
        (&["frobnicate"], 2, "unrecognized subcommand"),
        (&["lokcs"], 2, "similar subcommand exists: 'locks'"),
        (
            &["run", "x", "--tll", "5s", "--", "true"],
            2,
            "similar argument exists: '--ttl'",
        ),
    ];
    for (args, code, says) in cases {
        let out = cli(&url, args).await;
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(*code), "{args:?}: {err}");
        assert!(
            err.to_lowercase().contains(&says.to_lowercase()),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    // No lease table yet: the server's message, and a hint.
    let out = cli(&url, &["leases", "--table", "nosuch"]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("42P01"), "{}", stderr(&out));
    // A command that does not exist: 127, and the lease released.
    let out = cli(
        &url,
        &["run", "x", "--ttl", "60s", "--", "/nonexistent/cmd"],
    )
    .await;
    assert_eq!(out.status.code(), Some(127), "{}", stderr(&out));
    let out = cli(
        &url,
        &["run", "x", "--ttl", "60s", "--", "sh", "-c", "exit 4"],
    )
    .await;
    assert_eq!(
        out.status.code(),
        Some(4),
        "released, then the child's code: {}",
        stderr(&out)
    );
    // Unreachable: 69 for every command that needs the database.
    let dir = tempfile::tempdir().unwrap();
    let gone = format!(
        "host={} port=1 user=postgres dbname=postgres",
        dir.path().display()
    );
    for args in [&["leases"][..], &["check"], &["run", "x", "--", "true"]] {
        let out = cli(&gone, args).await;
        assert_eq!(out.status.code(), Some(69), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("database unreachable"),
            "{}",
            stderr(&out)
        );
    }
    let out = pgwarden(&url)
        .env_remove("DATABASE_URL")
        .arg("leases")
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("DATABASE_URL"), "{}", stderr(&out));
    // Shell completions need no database either.
    let out = pgwarden("")
        .env_remove("DATABASE_URL")
        .args(["completions", "bash"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).contains("_pgwarden()"), "{}", stdout(&out));
    // ddl needs no database.
    let out = pgwarden("")
        .env_remove("DATABASE_URL")
        .args(["ddl", "--table", "app.leases"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).contains(r#"CREATE TABLE IF NOT EXISTS "app"."leases""#),
        "{}",
        stdout(&out)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sslmode_is_honoured_against_a_server_with_a_self_signed_certificate() {
    let key = rcgen::KeyPair::generate().unwrap();
    let params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    let cert = params.self_signed(&key).unwrap();
    // TLS only over TCP: a connection without it finds no pg_hba.conf entry.
    let hba = "local all all trust\nhostssl all all 127.0.0.1/32 trust\n";
    let server = tokio::task::spawn_blocking({
        let (c, k) = (cert.pem(), key.serialize_pem());
        move || {
            TestServer::start_local_with(
                &[("ssl", "on"), ("listen_addresses", "127.0.0.1")],
                &[
                    ("server.crt", c.as_bytes()),
                    ("server.key", k.as_bytes()),
                    ("pg_hba.conf", hba.as_bytes()),
                ],
            )
        }
    })
    .await
    .unwrap()
    .expect("a TLS server");
    let (_t, dir) = tempdir();
    let root = dir.join("root.pem");
    std::fs::write(&root, cert.pem()).unwrap();
    let root = root.display().to_string();
    let other = dir.join("other.pem");
    let stranger = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .self_signed(&rcgen::KeyPair::generate().unwrap())
        .unwrap();
    std::fs::write(&other, stranger.pem()).unwrap();
    let other = other.display().to_string();
    let port = server.port();
    let url = |host: &str, extra: &str| {
        format!("host={host} port={port} user=postgres dbname=postgres {extra}")
    };
    let ok = [
        url("127.0.0.1", "sslmode=require"),
        url("127.0.0.1", "sslmode=prefer"),
        url(
            "127.0.0.1",
            &format!("sslmode=verify-ca sslrootcert={root}"),
        ),
        url(
            "localhost",
            &format!("hostaddr=127.0.0.1 sslmode=verify-full sslrootcert={root}"),
        ),
        format!(
            "postgresql://postgres@127.0.0.1:{port}/postgres?sslmode=verify-ca&sslrootcert={root}"
        ),
    ];
    for u in &ok {
        let out = cli(u, &["locks", "--json"]).await;
        assert_eq!(out.status.code(), Some(0), "{u}: {}", stderr(&out));
        assert_eq!(stdout(&out).trim(), "[]", "{u}");
    }
    let refused = [
        // No TLS: the server's own refusal.
        (url("127.0.0.1", "sslmode=disable"), "no pg_hba.conf entry"),
        // The name on the certificate is localhost.
        (
            url(
                "127.0.0.1",
                &format!("sslmode=verify-full sslrootcert={root}"),
            ),
            "certificate",
        ),
        // Not signed by the root named.
        (
            url(
                "localhost",
                &format!("hostaddr=127.0.0.1 sslmode=verify-ca sslrootcert={other}"),
            ),
            "certificate",
        ),
    ];
    for (u, says) in &refused {
        let out = cli(u, &["locks"]).await;
        // Refused, not unreachable: 1, not 69.
        assert_eq!(out.status.code(), Some(1), "{u}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{u}: {}", stderr(&out));
    }
    let out = cli(&url("127.0.0.1", "sslmode=verify"), &["locks"]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("invalid sslmode"), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread")]
async fn revoke_refuses_the_holders_fence_and_fires_its_lost_signal() {
    let db = db().await;
    let url = db.url();
    let pool = pgwarden::Pool::builder(db.deadpool(4).unwrap())
        .build()
        .unwrap();
    let leases = pgwarden::Leases::new(&pool);
    // A TTL of 10 s: the revoked holder learns of it at its next renewal
    // (3.3 s), and the name is still busy after that until the term's
    // expiry, which leaves a loaded machine more than 6 s to see it busy.
    let opts = pgwarden::LeaseOptions::new(Duration::from_secs(10));
    let lease = leases
        .acquire("fenced", &opts, None)
        .await
        .unwrap()
        .expect("free");
    let mut conn = pool.get().await.unwrap();
    let tx = lease
        .fence(conn.transaction().await.unwrap())
        .await
        .expect("fenced before the revoke");
    // The open fenced transaction does not hold the revoke up.
    let out = cli(&url, &["revoke", "fenced", "--yes"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let said = stdout(&out);
    assert!(said.contains(&lease.term().holder), "{said}");
    assert!(said.contains(&lease.term().token.to_string()), "{said}");
    drop(tx); // rolls back
    let refused = lease
        .fence(conn.transaction().await.unwrap())
        .await
        .expect_err("refused after the revoke");
    assert!(refused.is_lease_lost(), "{refused}");
    // Revoked, not a deadline or an expiry: the reason says the renewal saw
    // the revoke. The bound is only against a hang.
    let reason = within(BOUND, "lost()", lease.lost()).await;
    assert_eq!(reason, pgwarden::LostReason::Revoked);
    // The name stays busy until the revoked term's expiry (the revoked
    // holder learns of it at its next renewal, and stops), then is free.
    let busy = leases.acquire("fenced", &opts, None).await.unwrap();
    assert!(busy.is_none(), "taken before the revoked term's expiry");
    let next = leases
        .acquire("fenced", &opts, Some(Duration::from_secs(30)))
        .await
        .unwrap();
    assert!(next.expect("free again").term().token > lease.term().token);
}

#[tokio::test(flavor = "multi_thread")]
async fn check_names_a_lease_that_nobody_took_over_after_its_holder_crashed() {
    let db = db().await;
    let url = db.url();
    let (_t, dir) = tempdir();
    let mut run = spawn_run(&url, "hourly", &["--ttl", "1s"], &job(&dir, 0));
    token_seen(&dir, "hourly").await;
    // The holder crashes (its command finishes on its own): no release.
    kill(pid(&run), libc::SIGKILL);
    within(BOUND, "the crash", run.wait()).await.unwrap();
    std::fs::write(dir.join("go"), "").unwrap();
    let said = until("the unclaimed lease to be reported", || async {
        let out = cli(
            &url,
            &["check", "--max-idle-lock", "1s", "--database", db.name()],
        )
        .await;
        (out.status.code() == Some(1)).then(|| stdout(&out))
    })
    .await;
    assert!(
        said.lines()
            .any(|l| l.starts_with("unclaimed_lease:") && l.contains("\"hourly\"")),
        "{said}"
    );
    // Taken over, it is healthy again.
    let next = cli(&url, &["run", "hourly", "--", "true"]).await;
    assert_eq!(next.status.code(), Some(0), "{}", stderr(&next));
    let out = cli(
        &url,
        &["check", "--max-idle-lock", "1s", "--database", db.name()],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
}

/// The findings of `check --json` on `db` (exit 0 or 1).
async fn findings(url: &str, db: &TestDb, extra: &[&str]) -> Vec<Value> {
    let mut args = vec!["check", "--json", "--database", db.name()];
    args.extend_from_slice(extra);
    let out = cli(url, &args).await;
    assert!(matches!(out.status.code(), Some(0 | 1)), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).expect("a JSON array")
}

/// Issue 31, point 2: `check` knows a term's TTL (stored with every
/// renewal), so a long job (its term began an hour ago) whose holder
/// crashed is flagged one TTL after its term ran out, at the default
/// `--max-idle-lock` (5 min): guessing the TTL from `taken_at` and the
/// expiry, as before, waited the whole 5 minutes. On a table made by
/// pgwarden 0.1 it still guesses, and says so.
#[tokio::test(flavor = "multi_thread")]
async fn check_flags_a_crashed_long_job_one_ttl_after_its_term_ran_out() {
    let db = db().await;
    let url = db.url();
    let admin = db.connect().await.unwrap();
    let (_t, dir) = tempdir();
    let mut run = spawn_run(&url, "long", &["--ttl", "1s"], &job(&dir, 0));
    token_seen(&dir, "long").await;
    // The job has run for an hour (renewals never move taken_at).
    admin
        .batch_execute(
            "UPDATE pgwarden_leases SET taken_at = taken_at - interval '1 hour' WHERE name = 'long'",
        )
        .await
        .unwrap();
    kill(pid(&run), libc::SIGKILL);
    within(BOUND, "the crash", run.wait()).await.unwrap();
    std::fs::write(dir.join("go"), "").unwrap();
    let found = until("the unclaimed lease to be reported", || async {
        findings(&url, &db, &[])
            .await
            .into_iter()
            .find(|f| f["kind"] == "unclaimed_lease")
    })
    .await;
    assert_eq!(found["subject"]["name"], "long", "{found}");
    assert_eq!(found["subject"]["ttl_s"].as_f64(), Some(1.0), "{found}");
    let message = found["message"].as_str().unwrap();
    assert!(!message.contains("guessed"), "{message}");

    // A table made by pgwarden 0.1: a crashed 0.1 holder's term (never
    // renewed: the guess is right) is flagged, saying the TTL is guessed.
    let old = self::db().await;
    let old_url = old.url();
    let admin = old.connect().await.unwrap();
    admin
        .batch_execute(pgwarden_testing::LEASES_DDL_0_1)
        .await
        .unwrap();
    admin
        .batch_execute(
            "INSERT INTO pgwarden_leases (name, holder, token, taken_at, expires_at)
             VALUES ('old', 'old-host:1:aa', nextval('pgwarden_leases_token_seq'),
                     now() - interval '3 s', now() - interval '2 s')",
        )
        .await
        .unwrap();
    let found = findings(&old_url, &old, &[])
        .await
        .into_iter()
        .find(|f| f["kind"] == "unclaimed_lease")
        .expect("the 0.1 term is flagged");
    assert!(found["subject"]["ttl_s"].is_null(), "{found}");
    let message = found["message"].as_str().unwrap();
    assert!(message.contains("TTL is not stored"), "{message}");
    assert!(message.contains("guessed as 1s"), "{message}");
    let table = stdout(&cli(&old_url, &["leases"]).await);
    assert!(table.contains("TTL"), "{table}");
    // Rows edited by hand with infinite times: both commands still answer.
    admin
        .batch_execute(
            "INSERT INTO pgwarden_leases (name, holder, token, taken_at, expires_at)
             VALUES ('odd-1', 'h:1:aa', nextval('pgwarden_leases_token_seq'), 'infinity', '-infinity'),
                    ('odd-2', 'h:1:bb', nextval('pgwarden_leases_token_seq'), '-infinity', 'infinity')",
        )
        .await
        .unwrap();
    let all = findings(&old_url, &old, &[]).await;
    assert!(
        all.iter().any(|f| f["subject"]["name"] == "odd-1"),
        "{all:?}"
    );
    let rows = json(&old_url, &["leases", "--json"]).await;
    assert_eq!(rows.len(), 3, "{rows:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn one_ctrl_c_reaches_the_command_once_and_an_ignored_one_is_escalated() {
    let db = db().await;
    let url = db.url();
    let (_t, dir) = tempdir();
    let d = dir.display();
    // Counts SIGINTs and ignores them (and SIGTERM).
    let stubborn = vec![
        "sh".to_owned(),
        "-c".to_owned(),
        format!(
            "trap 'echo int >> {d}/int' INT; trap '' TERM; echo $$ > {d}/pid.tmp && mv {d}/pid.tmp {d}/pid
i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done"
        ),
    ];
    // In a process group of its own, as a shell runs a foreground job: the
    // terminal's Ctrl-C goes to the whole group.
    let mut c = pgwarden(&url);
    c.args(["run", "stubborn", "--ttl", "10s", "--grace", "1s", "--"])
        .args(&stubborn)
        .process_group(0)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut run = c.spawn().unwrap();
    let child: i32 = wait_file(&dir.join("pid")).await.trim().parse().unwrap();
    let sent = Instant::now();
    kill(-pid(&run), libc::SIGINT);
    // Ignored: SIGKILL after the grace; run's code is 128 + 9.
    assert_eq!(exit_code(&mut run, BOUND).await, 137);
    let took = sent.elapsed();
    assert!(
        took >= Duration::from_secs(1),
        "the grace was given: {took:?}"
    );
    assert!(!alive(child), "the command {child} was killed");
    let ints = std::fs::read_to_string(dir.join("int")).unwrap_or_default();
    assert_eq!(ints.lines().count(), 1, "one Ctrl-C, one SIGINT: {ints:?}");
    let mut err = String::new();
    use tokio::io::AsyncReadExt;
    run.stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .await
        .unwrap();
    assert!(err.contains("SIGKILL"), "{err}");
    // SIGHUP and SIGQUIT are forwarded too, and the lease is released.
    for (sig, name) in [(libc::SIGHUP, "HUP"), (libc::SIGQUIT, "QUIT")] {
        let (_t, dir) = tempdir();
        let d = dir.display();
        let cmd = vec![
            "sh".to_owned(),
            "-c".to_owned(),
            format!(
                "trap 'echo {name} > {d}/got.tmp && mv {d}/got.tmp {d}/got; exit 5' {name}; touch {d}/up
i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done"
            ),
        ];
        let mut run = spawn_run(&url, "hup", &["--ttl", "60s"], &cmd);
        wait_file(&dir.join("up")).await;
        kill(pid(&run), sig);
        assert_eq!(exit_code(&mut run, BOUND).await, 5, "{name}");
        assert_eq!(wait_file(&dir.join("got")).await.trim(), name);
        let next = cli(&url, &["run", "hup", "--", "true"]).await;
        assert_eq!(next.status.code(), Some(0), "{name}: {}", stderr(&next));
    }
}

// ---------------------------------------------------------------------
// Point 1: the command's whole tree is dead before the next holder starts.

/// A command whose shell (`c`), a background grandchild in its process
/// group (`g`) and a daemon it starts with a double fork and `setsid` (`d`,
/// a session of its own) each append `TOKEN TAG` to `dir/ledger` every
/// 20 ms (unfenced writes). Each logs a SIGTERM into `dir/term.TOKEN` and
/// writes on; `dir/pids.TOKEN` holds the three pids.
fn ledger_writer(dir: &Path) -> Vec<String> {
    let d = dir.display();
    vec![
        "sh".into(),
        "-c".into(),
        format!(
            "T=$PGWARDEN_TOKEN
trap 'echo c >> {d}/term.$T' TERM
( trap 'echo g >> {d}/term.$T' TERM; while :; do echo \"$T g\" >> {d}/ledger; sleep 0.02; done ) &
g=$!
( setsid sh -c 'trap \"echo d >> {d}/term.$0\" TERM; echo $$ > {d}/dpid.tmp.$$ && mv {d}/dpid.tmp.$$ {d}/dpid.$0; while :; do echo \"$0 d\" >> {d}/ledger; sleep 0.02; done' $T < /dev/null > /dev/null 2>&1 & )
while [ ! -f {d}/dpid.$T ]; do sleep 0.01; done
echo \"$$ $g $(cat {d}/dpid.$T)\" > {d}/pids.tmp.$$ && mv {d}/pids.tmp.$$ {d}/pids.$T
while :; do echo \"$T c\" >> {d}/ledger; sleep 0.02; done"
        ),
    ]
}

/// The next holder's command: 40 lines `TOKEN n` into the same ledger.
fn ledger_next(dir: &Path) -> Vec<String> {
    let d = dir.display();
    vec![
        "sh".into(),
        "-c".into(),
        format!(
            "i=0; while [ $i -lt 40 ]; do echo \"$PGWARDEN_TOKEN n\" >> {d}/ledger; sleep 0.02; i=$((i+1)); done"
        ),
    ]
}

/// Is `pid` a live process (not gone, not a zombie)?
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            .is_some_and(|s| s != "Z" && s != "X"),
        Err(_) => false,
    }
}

/// The old holder's pids (its shell, grandchild and daemon), once all
/// three write.
async fn ledger_pids(dir: &Path) -> (i64, Vec<i32>) {
    let token = until("the old command's pids", || async {
        std::fs::read_dir(dir).ok()?.flatten().find_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_prefix("pids.")
                .filter(|t| !t.starts_with("tmp"))
                .and_then(|t| t.parse::<i64>().ok())
        })
    })
    .await;
    let pids = std::fs::read_to_string(dir.join(format!("pids.{token}")))
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    // The child, the grandchild and the daemon have written.
    eventually(BOUND, "the three writers to write", || async {
        let l = std::fs::read_to_string(dir.join("ledger")).unwrap_or_default();
        ["c", "g", "d"]
            .iter()
            .all(|tag| l.contains(&format!("{token} {tag}")))
    })
    .await;
    (token, pids)
}

/// Old-term writes after the new term's first write.
fn overlap(ledger: &str, old: i64, new: i64) -> usize {
    let lines: Vec<&str> = ledger.lines().collect();
    let first = lines
        .iter()
        .position(|l| l.starts_with(&format!("{new} ")))
        .expect("the new holder wrote");
    lines[first..]
        .iter()
        .filter(|l| l.starts_with(&format!("{old} ")))
        .count()
}

/// How the old `run` fails.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Failing {
    /// `SIGKILL` to `run`'s pid alone.
    Sigkill,
    /// `SIGSTOP` to `run`'s pid alone.
    Sigstop,
    /// The database stops answering `run`.
    LostDatabase,
    /// `SIGKILL` to `run`'s process group (`kill -9 %1`, `kill -9 -- -PGID`).
    GroupKill,
    /// `SIGSTOP` to `run`'s process group (`kill -STOP %1`).
    GroupStop,
    /// Cron's `timeout -k 1 T pgwarden run …`: SIGTERM to `run` and to
    /// timeout's process group, then SIGKILL to that group a second later
    /// (the test sends timeout its SIGTERM when the command runs: `T` is
    /// not waited out).
    TimeoutKill,
    /// The keeper stopped alone (`SIGSTOP`), then the lease revoked.
    KeeperStoppedRevoked,
    /// The keeper stopped alone, nothing else: `run` does not wait for
    /// the keeper's deadline (were `run` killed next, nobody would stop
    /// the tree).
    KeeperStopped,
    /// `run`'s stderr a pipe nobody reads any more (a log reader died),
    /// then `run` stopped: the keeper's message meets a closed pipe.
    SigstopStderrClosed,
    /// `run`'s stderr a full pipe whose reader stopped reading (a stuck
    /// log shipper, `| less` left open), then the lease revoked: the
    /// messages of `run` and the keeper meet a pipe with no room.
    StuckStderrRevoked,
}

/// Fills the pipe that is `pid`'s stderr, through an open of its own in
/// non-blocking mode (the pipe stays blocking for its other writers).
fn fill_stderr_pipe(pid: i32) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(format!("/proc/{pid}/fd/2"))
        .unwrap();
    for chunk in [4096, 1] {
        let buf = vec![b'x'; chunk];
        loop {
            match f.write(&buf) {
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("filling the pipe: {e}"),
            }
        }
    }
}

/// The child of `parent` (the keeper of a `run`), from `/proc`.
fn child_of(parent: i32) -> Option<i32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let ppid: i32 = stat[stat.rfind(')')? + 2..]
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        (ppid == parent).then_some(pid)
    })
}

/// SIGKILLs the listed processes when dropped (a failed test's survivors
/// do not write on into the next one).
struct Reaper(Vec<i32>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for &p in &self.0 {
            if alive(p) {
                // SAFETY: kill(2) has no memory-safety preconditions.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
        }
    }
}

/// A 3 s TTL and a 60 s grace (capped at TTL/16 after a lost lease); with
/// `timeout -k`, the default grace (10 s). The deadlines `run` and its
/// keeper keep are fixed fractions of the TTL (the margin TTL/8, the slack
/// TTL/16; only `run`'s backstop against a stopped or hung keeper has a 1 s
/// floor, and its poll a 250 ms cap): at the default TTL (60 s) the same
/// events come in the same order, 20 times as far apart. A frozen `run`'s
/// tree, or one cut off from the database, is SIGKILLed TTL/16 before the
/// take-over: 187 ms here, 3.75 s at the default. (A test that waited out
/// the default TTL for three of these cases cost a minute of every run;
/// the defaults themselves are read in
/// `a_forwarded_sigterm_reaches_the_whole_tree_and_its_grace_is_named`.)
async fn takeover_leaves_no_overlap(how: Failing) {
    let db = db().await;
    let url = db.url();
    let (_t, dir) = tempdir();
    let proxy = pgwarden_testing::Proxy::start(TestServer::shared().unwrap()).unwrap();
    let old_url = match how {
        Failing::LostDatabase => proxy.url(&db),
        _ => url.clone(),
    };
    // A grace far longer than the TTL: it is capped.
    let opts: &[&str] = match how {
        // The default grace (10 s): longer than timeout's `-k 1`.
        Failing::TimeoutKill => &["--ttl", "3s"],
        _ => &["--ttl", "3s", "--grace", "60s"],
    };
    let mut old = if how == Failing::TimeoutKill {
        // timeout puts itself (and so `run`) in a process group of its own.
        let mut c = command("timeout", &old_url);
        c.args(["-k", "1", "600", BIN, "run", "ledger"])
            .args(opts)
            .arg("--")
            .args(ledger_writer(&dir))
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        c.spawn().expect("spawn timeout pgwarden run")
    } else {
        // A process group of its own, as a shell runs a job.
        let mut c = pgwarden(&old_url);
        c.arg("run")
            .arg("ledger")
            .args(opts)
            .arg("--")
            .args(ledger_writer(&dir))
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        c.spawn().expect("spawn pgwarden run")
    };
    let (old_token, pids) = ledger_pids(&dir).await;
    let _reaper = Reaper(pids.clone());
    let _frozen = match how {
        Failing::Sigkill => {
            kill(pid(&old), libc::SIGKILL);
            None
        }
        Failing::Sigstop => Some(Stopped::stop([pid(&old)]).unwrap()),
        Failing::KeeperStopped => {
            let keeper = until("the keeper's pid", || async { child_of(pid(&old)) }).await;
            let stopped = Stopped::stop([keeper]).unwrap();
            // A TTL of 3 s: the keeper's deadline is renewed every 750 ms;
            // run ends the tree itself while the keeper is still stopped.
            assert_eq!(exit_code(&mut old, BOUND).await, 76, "{how:?}");
            Some(stopped)
        }
        Failing::SigstopStderrClosed => {
            drop(old.stderr.take());
            Some(Stopped::stop([pid(&old)]).unwrap())
        }
        Failing::StuckStderrRevoked => {
            fill_stderr_pipe(pid(&old));
            let out = cli(&url, &["revoke", "ledger", "--yes"]).await;
            assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
            None
        }
        Failing::LostDatabase => {
            proxy.blackhole();
            None
        }
        Failing::GroupKill => {
            kill(-pid(&old), libc::SIGKILL);
            None
        }
        Failing::GroupStop => Some(Stopped::stop([-pid(&old)]).unwrap()),
        Failing::TimeoutKill => {
            kill(pid(&old), libc::SIGTERM);
            None
        }
        Failing::KeeperStoppedRevoked => {
            let keeper = until("the keeper's pid", || async { child_of(pid(&old)) }).await;
            let stopped = Stopped::stop([keeper]).unwrap();
            // run may have killed the tree and released the lease already
            // (a keeper stopped for a second): then nothing is revoked.
            let out = cli(&url, &["revoke", "ledger", "--yes"]).await;
            assert!(
                out.status.code() == Some(0) || stderr(&out).contains("nothing to revoke"),
                "{}",
                stderr(&out)
            );
            // run itself stops the tree and exits 76 while its keeper is
            // still stopped.
            assert_eq!(exit_code(&mut old, BOUND).await, 76, "{how:?}");
            Some(stopped)
        }
    };
    // The next holder's own TTL is not under test: 60 s. `run` counts its
    // term's deadline from when it began to wait, so with a 3 s TTL and a
    // wait of about 3 s its keeper's deadline was only its slack (187 ms)
    // ahead until its first renewal, and a loaded machine that held `run`
    // off the CPU that long had its keeper kill the command (exit 76; once
    // in three runs with both cores busy).
    let next = within(
        Duration::from_secs(60),
        "the next holder to run",
        pgwarden(&url)
            .args(["run", "ledger", "--ttl", "60s", "--wait", "30s", "--"])
            .args(ledger_next(&dir))
            .output(),
    )
    .await
    .unwrap();
    assert_eq!(next.status.code(), Some(0), "{how:?}: {}", stderr(&next));
    let ledger = std::fs::read_to_string(dir.join("ledger")).unwrap();
    let new_token = ledger
        .lines()
        .find_map(|l| l.strip_suffix(" n"))
        .unwrap()
        .parse::<i64>()
        .unwrap();
    assert!(new_token > old_token);
    let n = overlap(&ledger, old_token, new_token);
    println!("{how:?}: {n} writes of the old term after the new term's first");
    assert_eq!(n, 0, "{how:?}: the old command wrote on:\n{ledger}");
    for p in &pids {
        assert!(!alive(*p), "{how:?}: process {p} of the old command lives");
    }
    drop(_frozen);
    if matches!(
        how,
        Failing::Sigstop
            | Failing::GroupStop
            | Failing::LostDatabase
            | Failing::SigstopStderrClosed
            | Failing::StuckStderrRevoked
    ) {
        let code = exit_code(&mut old, BOUND).await;
        assert_eq!(code, 76, "{how:?}");
    } else {
        // Killed (run, or timeout with it), or exited already.
        within(BOUND, "the old run to end", old.wait())
            .await
            .unwrap();
    }
    let mut err = String::new();
    use tokio::io::AsyncReadExt;
    if let Some(mut e) = old.stderr.take() {
        // Every writer of the pipe (run, its keeper, the command) is gone.
        within(
            BOUND,
            "the old run's stderr to close",
            e.read_to_string(&mut err),
        )
        .await
        .unwrap();
    }
    println!("{how:?}: {err}");
    if how == Failing::TimeoutKill {
        assert!(err.contains("`pgwarden run` is gone"), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn run_killed_with_sigkill_leaves_nothing_running() {
    takeover_leaves_no_overlap(Failing::Sigkill).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn run_frozen_with_sigstop_has_its_tree_killed_before_the_takeover() {
    takeover_leaves_no_overlap(Failing::Sigstop).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn run_cut_off_from_the_database_kills_a_tree_that_ignores_sigterm_in_time() {
    takeover_leaves_no_overlap(Failing::LostDatabase).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sigkill_to_runs_process_group_leaves_nothing_running() {
    takeover_leaves_no_overlap(Failing::GroupKill).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn timeout_k_killing_runs_group_during_the_grace_leaves_nothing_running() {
    takeover_leaves_no_overlap(Failing::TimeoutKill).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sigstop_to_runs_process_group_has_its_tree_killed_before_the_takeover() {
    takeover_leaves_no_overlap(Failing::GroupStop).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_keeper_whose_lease_is_revoked_has_its_tree_killed_by_run() {
    takeover_leaves_no_overlap(Failing::KeeperStoppedRevoked).await;
}

/// A forwarded SIGTERM reaches every process of the command, its `setsid`
/// daemon included; SIGKILL follows after the grace, and the message says
/// so (not a lost lease or a frozen `run`).
///
/// At `run`'s defaults (no `--ttl`, no `--grace`): the term the lease row
/// records is 60 s long (its expiry minus when it was last set, read from
/// the table: no waiting), and the SIGKILL comes no sooner than 10 s after
/// the SIGTERM (a lower bound: a loaded machine only makes it later). The
/// take-overs themselves (a frozen `run`, `timeout -k`, a lost database)
/// are waited out at a 3 s TTL by the tests of `takeover_leaves_no_overlap`
/// (the same code and order of events: see there).
#[tokio::test(flavor = "multi_thread")]
async fn a_forwarded_sigterm_reaches_the_whole_tree_and_its_grace_is_named() {
    let db = db().await;
    let url = db.url();
    let (_t, dir) = tempdir();
    // The default grace (10 s): the three traps have that long to log the
    // signal, a generous bound on a loaded machine.
    let mut run = spawn_run(&url, "graceful", &[], &ledger_writer(&dir));
    let (token, pids) = ledger_pids(&dir).await;
    let _reaper = Reaper(pids.clone());
    let admin = db.connect().await.unwrap();
    let ttl: f64 = admin
        .query_one(
            "SELECT extract(epoch FROM expires_at - renewed_at)::float8 \
               FROM pgwarden_leases WHERE name = 'graceful' AND token = $1",
            &[&token],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(ttl, 60.0, "run's default TTL, as its term records it");
    let signalled = Instant::now();
    kill(pid(&run), libc::SIGTERM);
    let term = dir.join(format!("term.{token}"));
    eventually(BOUND, "c, g and d to log SIGTERM", || async {
        let t = std::fs::read_to_string(&term).unwrap_or_default();
        ["c", "g", "d"]
            .iter()
            .all(|tag| t.lines().any(|l| l == *tag))
    })
    .await;
    // They ignore it: SIGKILL after the grace; run's code is 128 + 9.
    assert_eq!(exit_code(&mut run, BOUND).await, 137);
    let graced = signalled.elapsed();
    println!("SIGTERM to SIGKILL at the default grace: {graced:?}");
    assert!(
        graced >= Duration::from_secs(10),
        "{graced:?}: the grace is 10 s"
    );
    for p in &pids {
        assert!(!alive(*p), "process {p} of the command lives");
    }
    let t = std::fs::read_to_string(&term).unwrap();
    assert_eq!(t.lines().filter(|l| *l == "d").count(), 1, "once: {t}");
    let mut err = String::new();
    use tokio::io::AsyncReadExt;
    run.stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .await
        .unwrap();
    assert!(err.contains("--grace"), "{err}");
    assert!(!err.contains("stopped answering"), "{err}");
    assert!(!err.contains("lease was lost"), "{err}");
}

/// `nohup pgwarden run …`: a SIGHUP that was ignored when `run` started
/// stays ignored (not forwarded, the command inherits it ignored), as it
/// would be without `run`; a SIGTERM is still forwarded.
#[tokio::test(flavor = "multi_thread")]
async fn under_nohup_a_hangup_neither_reaches_nor_stops_the_command() {
    let db = db().await;
    let url = db.url();
    let (_t, dir) = tempdir();
    let d = dir.display();
    let script = format!(
        "trap 'echo hup >> {d}/sig; exit 3' HUP
trap 'echo term >> {d}/sig; exit 0' TERM
echo $$ > {d}/started.tmp && mv {d}/started.tmp {d}/started
while :; do sleep 0.05; done"
    );
    let mut c = pgwarden(&url);
    c.arg("run")
        .arg("nohup")
        .args(["--ttl", "60s", "--", "sh", "-c", &script]);
    c.stdout(Stdio::null()).stderr(Stdio::piped());
    // SAFETY: only a signal disposition is set between fork and exec.
    unsafe {
        c.pre_exec(|| {
            libc::signal(libc::SIGHUP, libc::SIG_IGN);
            Ok(())
        });
    }
    let mut run = c.spawn().expect("spawn pgwarden run");
    let sh: i32 = wait_file(&dir.join("started"))
        .await
        .trim()
        .parse()
        .unwrap();
    kill(pid(&run), libc::SIGHUP);
    // The command's shell itself, hung up on directly: ignored too.
    kill(sh, libc::SIGHUP);
    kill(pid(&run), libc::SIGTERM);
    // The SIGTERM ends it by its trap (exit 0); a forwarded or inherited
    // SIGHUP would have ended it by the other (exit 3), whichever came
    // first: the file would hold `hup`.
    assert_eq!(exit_code(&mut run, BOUND).await, 0);
    let sig = std::fs::read_to_string(dir.join("sig")).unwrap();
    assert_eq!(sig.trim(), "term", "{sig}");
}

/// `pgwarden run … 3>file`: the caller's descriptors reach the command as
/// they would without `run` (the keeper's pipes take numbers of their
/// own), and the keeper is named in `ps`.
#[tokio::test(flavor = "multi_thread")]
async fn the_callers_descriptors_reach_the_command_and_the_keeper_has_a_name() {
    use std::os::fd::AsRawFd;
    let db = db().await;
    let url = db.url();
    let (_t, dir) = tempdir();
    let out = std::fs::File::create(dir.join("fd3")).unwrap();
    let raw = out.as_raw_fd();
    let mut c = pgwarden(&url);
    c.arg("run").arg("fd3").args([
        "--ttl",
        "60s",
        "--",
        "sh",
        "-c",
        "echo hello >&3 && cat /proc/$PPID/comm >&3",
    ]);
    c.stdout(Stdio::null()).stderr(Stdio::piped());
    // SAFETY: only dup2 between fork and exec.
    unsafe {
        c.pre_exec(move || {
            if libc::dup2(raw, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut run = c.spawn().expect("spawn pgwarden run");
    assert_eq!(exit_code(&mut run, BOUND).await, 0);
    drop(out);
    let got = std::fs::read_to_string(dir.join("fd3")).unwrap();
    assert_eq!(got, "hello\npgwarden-keeper\n", "{got:?}");
}

/// `run`'s stderr a file at its size limit (`ulimit -f`, systemd's
/// LimitFSIZE): a message fails (EFBIG) instead of ending `run` and the
/// keeper with SIGXFSZ before they stop the command.
#[tokio::test(flavor = "multi_thread")]
async fn a_stderr_file_at_its_size_limit_does_not_end_run_or_its_keeper() {
    let db = db().await;
    let url = db.url();
    let (_t, dir) = tempdir();
    std::fs::File::create(dir.join("err"))
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    // Appended to (`2>>file`): every message would go past the limit.
    let err = std::fs::OpenOptions::new()
        .append(true)
        .open(dir.join("err"))
        .unwrap();
    let d = dir.display();
    let script = format!("(sleep 1000; echo late >> {d}/late) & echo $! > {d}/started.tmp && mv {d}/started.tmp {d}/started; wait");
    let mut c = pgwarden(&url);
    c.arg("run")
        .arg("fsize")
        .args(["--ttl", "60s", "--", "sh", "-c", &script]);
    c.stdout(Stdio::null()).stderr(Stdio::from(err));
    // SAFETY: only setrlimit between fork and exec.
    unsafe {
        c.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 1 << 20,
                rlim_max: 1 << 20,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut run = c.spawn().expect("spawn pgwarden run");
    let bg: i32 = wait_file(&dir.join("started"))
        .await
        .trim()
        .parse()
        .unwrap();
    let _reaper = Reaper(vec![bg]);
    let out = cli(&url, &["revoke", "fsize", "--yes"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    // Lost (revoked): 76, not 128 + SIGXFSZ (153); the background child
    // killed with the rest of the tree.
    assert_eq!(exit_code(&mut run, BOUND).await, 76);
    eventually(BOUND, "the background child to be gone", || async {
        !alive(bg)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_keeper_has_its_tree_killed_by_run() {
    takeover_leaves_no_overlap(Failing::KeeperStopped).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_closed_stderr_does_not_stop_the_keeper_killing_the_tree() {
    takeover_leaves_no_overlap(Failing::SigstopStderrClosed).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stuck_stderr_does_not_delay_killing_the_tree() {
    takeover_leaves_no_overlap(Failing::StuckStderrRevoked).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_revoked_run_and_a_command_that_exits_leave_no_process_behind() {
    let db = db().await;
    let url = db.url();
    let (_t, dir) = tempdir();
    let mut old = spawn_run(
        &url,
        "swept",
        &["--ttl", "3s", "--grace", "60s"],
        &ledger_writer(&dir),
    );
    let (token, pids) = ledger_pids(&dir).await;
    let out = cli(&url, &["revoke", "swept", "--yes"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(exit_code(&mut old, BOUND).await, 76);
    for p in &pids {
        assert!(!alive(*p), "process {p} of the revoked command lives");
    }
    let after = std::fs::read_to_string(dir.join("ledger")).unwrap();
    let mut err = String::new();
    use tokio::io::AsyncReadExt;
    old.stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .await
        .unwrap();
    assert!(err.contains("revoked"), "{err}");
    // The keeper itself killed: run (a subreaper too) kills what is left.
    let (_t3, dir3) = tempdir();
    let mut run = spawn_run(&url, "keeper", &["--ttl", "60s"], &ledger_writer(&dir3));
    let (_, pids3) = ledger_pids(&dir3).await;
    let run_pid = pid(&run);
    let keeper = until("the keeper's pid", || async { child_of(run_pid) }).await;
    kill(keeper, libc::SIGKILL);
    // Not the command's code (it is unknown): 76, and why.
    assert_eq!(exit_code(&mut run, BOUND).await, 76);
    for p in &pids3 {
        assert!(!alive(*p), "process {p} outlived its keeper");
    }
    let mut err = String::new();
    run.stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .await
        .unwrap();
    assert!(
        err.contains(&format!("the keeper (pid {keeper}) was killed by signal 9")),
        "{err}"
    );
    // A command that exits, leaving a background writer: run's exit code is
    // the command's, and the writer is gone with it. The revoked name is
    // busy until its term's expiry (the revoke keeps it): this run waits.
    let (_t2, dir2) = tempdir();
    let d = dir2.display();
    let out = cli(
        &url,
        &[
            "run",
            "swept",
            "--wait",
            "30s",
            "--",
            "sh",
            "-c",
            &format!(
                "( trap '' TERM HUP; while :; do echo x >> {d}/left; sleep 0.02; done ) &
echo $! > {d}/pid; while [ ! -s {d}/left ]; do sleep 0.01; done; exit 3"
            ),
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let left: i32 = std::fs::read_to_string(dir2.join("pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(!alive(left), "the background writer {left} lives on");
    // Nothing of the revoked term was written after its run exited.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let later = std::fs::read_to_string(dir.join("ledger")).unwrap();
    assert_eq!(
        after
            .lines()
            .filter(|l| l.starts_with(&format!("{token} ")))
            .count(),
        later
            .lines()
            .filter(|l| l.starts_with(&format!("{token} ")))
            .count()
    );
}

// ---------------------------------------------------------------------
// Point 4 of issue 31: output people can pipe and watch.

#[tokio::test(flavor = "multi_thread")]
async fn output_survives_a_closed_pipe_groups_many_locks_filters_and_watches_through_errors() {
    let db = db().await;
    let url = db.url();
    const MANY: i64 = 2000;
    let mut config = db.pg_config();
    config.application_name("bulk");
    let (bulk, conn) = config.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    let bulk_pid: i32 = bulk
        .query_one(
            "SELECT pg_backend_pid() FROM (SELECT count(pg_advisory_lock(g)) FROM generate_series(1, $1::int8) g) s",
            &[&MANY],
        )
        .await
        .unwrap()
        .get(0);
    // Another session waits for key 1.
    let (waiter, conn) = db.pg_config().connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    let waiter_pid: i32 = waiter
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let cancel = waiter.cancel_token();
    let wait = tokio::spawn(async move { waiter.execute("SELECT pg_advisory_lock(1)", &[]).await });
    eventually(BOUND, "the waiter to wait", || async {
        json(&url, &["locks", "--json", "--pid", &waiter_pid.to_string()])
            .await
            .iter()
            .any(|l| l["granted"] == false)
    })
    .await;

    // A closed pipe: no panic, nothing on stderr.
    let piped = Command::new("sh")
        .arg("-c")
        .arg(format!("{BIN} locks --json 2>&1 | head -c 10 >/dev/null; {BIN} locks 2>&1 | head -1 >/dev/null; {BIN} locks --watch 0.1 2>&1 | head -1 >/dev/null"))
        .env("DATABASE_URL", &url)
        .stdin(Stdio::null())
        .output();
    let piped = within(BOUND, "the pipes to end", piped).await.unwrap();
    let said = String::from_utf8_lossy(&piped.stdout);
    assert!(!said.contains("panicked"), "{said}");

    // One session's 2000 locks are one row, with a summary line.
    let out = cli(&url, &["locks", "--app", "bulk"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let table = stdout(&out);
    println!("{table}");
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "header, one row, summary: {table}");
    assert!(lines[0].starts_with("DATABASE"), "{table}");
    assert!(
        lines[1].contains(&format!("{MANY} keys: 1, 2, 3, …")),
        "{table}"
    );
    assert!(lines[1].contains(db.name()), "{table}");
    assert!(
        lines[1].contains(&waiter_pid.to_string()),
        "the waiter on key 1: {table}"
    );
    assert!(
        lines[2].starts_with(&format!(
            "{MANY} advisory locks ({MANY} held, 0 waiting), 1 session, 1 database"
        )),
        "{table}"
    );
    // Filters.
    let one = json(
        &url,
        &[
            "locks",
            "--json",
            "--key",
            "17",
            "--pid",
            &bulk_pid.to_string(),
        ],
    )
    .await;
    assert_eq!(one.len(), 1, "{one:?}");
    assert_eq!(one[0]["database"], db.name());
    // A name that is no database: an error, not an empty list.
    let out = cli(&url, &["locks", "--json", "--database", "nosuchdb"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(stderr(&out).contains("no database"), "{}", stderr(&out));
    // check: one finding for the session, and the waiter names its blocker.
    let out = cli(
        &url,
        &[
            "check",
            "--max-idle-lock",
            "0s",
            "--no-leases",
            "--database",
            db.name(),
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(1));
    let said = stdout(&out);
    println!("{said}");
    let idle: Vec<&str> = said
        .lines()
        .filter(|l| l.starts_with("idle_lock:"))
        .collect();
    assert_eq!(idle.len(), 1, "{said}");
    assert!(
        idle[0].contains(&format!("{MANY} advisory locks")),
        "{said}"
    );
    assert!(
        said.lines().any(|l| l.starts_with("lock_waiter:")
            && l.contains(&format!("blocked by pid {bulk_pid} (bulk"))),
        "{said}"
    );

    // --watch --json into a pipe: one JSON object per line.
    let proxy = pgwarden_testing::Proxy::start(TestServer::shared().unwrap()).unwrap();
    let mut watch = pgwarden(&proxy.url(&db))
        .args(["locks", "--json", "--watch", "0.2", "--app", "bulk"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines =
        tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(watch.stdout.take().unwrap()));
    let first = next_sample(&mut lines).await;
    assert_eq!(first["locks"].as_array().map(Vec::len), Some(MANY as usize));
    assert!(first["time"].as_str().is_some_and(|t| t.ends_with('Z')));
    // The database stops answering (its connections cut, new ones held):
    // an error sample naming the last good one, then good ones again.
    proxy.blackhole();
    proxy.reset_all();
    let mut saw_error = false;
    within(BOUND, "an error, then a good sample", async {
        loop {
            let s = next_sample(&mut lines).await;
            if s.get("error").is_some() {
                assert!(s["last_good"].as_str().is_some(), "{s}");
                if !saw_error {
                    println!("{s}");
                    proxy.heal();
                    proxy.reset_all();
                }
                saw_error = true;
            } else if saw_error {
                assert_eq!(s["locks"].as_array().map(Vec::len), Some(MANY as usize));
                break;
            }
        }
    })
    .await;
    // Still read what it writes (samples of 2000 locks outgrow a pipe's
    // buffer): a watch blocked writing to a full pipe does not see its
    // SIGINT until the write returns.
    let drain = tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    kill(pid(&watch), libc::SIGINT);
    assert_eq!(exit_code(&mut watch, BOUND).await, 0);
    within(BOUND, "the watch's output to end", drain)
        .await
        .unwrap();

    // --quiet for cron.
    let out = cli(
        &url,
        &[
            "check",
            "--quiet",
            "--no-leases",
            "--database",
            "postgres",
            "--max-idle-lock",
            "1h",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(stdout(&out), "");
    cancel.cancel_query(tokio_postgres::NoTls).await.unwrap();
    let _ = within(BOUND, "the wait to end", wait).await;
    drop(bulk);

    // A huge name is not echoed whole; the limit is in --help.
    let huge = "x".repeat(10_000);
    let out = cli(&url, &["run", &huge, "--", "true"]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).len() < 600, "{}", stderr(&out));
    assert!(stderr(&out).contains("at most 128"), "{}", stderr(&out));
    let help = stdout(&cli(&url, &["run", "--help"]).await);
    for says in [
        "at most 128 bytes",
        "PGWARDEN_TOKEN",
        "DATABASE_URL",
        "Exit codes",
        "76",
        "frozen",
    ] {
        assert!(help.contains(says), "{says}: {help}");
    }
}

async fn next_sample(
    lines: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
) -> Value {
    let line = within(BOUND, "a sample", lines.next_line())
        .await
        .unwrap()
        .expect("watch ended early");
    assert!(!line.contains('\x1b'), "{line:?}");
    serde_json::from_str::<Value>(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

// ---------------------------------------------------------------------
// Point 3 of issue 31: libpq's conventions.

/// Runs `openssl ARGS` in `dir`.
fn openssl(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the openssl command");
    assert!(out.status.success(), "openssl {args:?}: {out:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn libpq_environment_password_file_and_openssl_certificates_work_as_with_psql() {
    let (_t, dir) = tempdir();
    // As PostgreSQL's docs make them: a self-signed server certificate
    // (OpenSSL 3 marks it CA:TRUE), and a CA that signs a client's.
    openssl(
        &dir,
        &[
            "req",
            "-new",
            "-x509",
            "-days",
            "365",
            "-nodes",
            "-text",
            "-out",
            "server.crt",
            "-keyout",
            "server.key",
            "-subj",
            "/CN=localhost",
        ],
    );
    openssl(
        &dir,
        &[
            "req",
            "-new",
            "-x509",
            "-days",
            "365",
            "-nodes",
            "-out",
            "ca.crt",
            "-keyout",
            "ca.key",
            "-subj",
            "/CN=clients",
        ],
    );
    openssl(
        &dir,
        &[
            "req",
            "-new",
            "-nodes",
            "-out",
            "client.csr",
            "-keyout",
            "client.key",
            "-subj",
            "/CN=certuser",
        ],
    );
    openssl(
        &dir,
        &[
            "x509",
            "-req",
            "-in",
            "client.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "client.crt",
            "-days",
            "365",
        ],
    );
    openssl(
        &dir,
        &[
            "req",
            "-new",
            "-x509",
            "-days",
            "365",
            "-nodes",
            "-out",
            "other.crt",
            "-keyout",
            "other.key",
            "-subj",
            "/CN=localhost",
        ],
    );
    let text = std::fs::read_to_string(dir.join("server.crt")).unwrap();
    assert!(
        text.contains("CA:TRUE"),
        "OpenSSL 3 makes a CA:TRUE certificate: {text}"
    );
    let read = |f: &str| std::fs::read(dir.join(f)).unwrap();
    let hba = "local all all trust
hostssl all certuser 127.0.0.1/32 cert
hostssl all all 127.0.0.1/32 scram-sha-256
";
    let (crt, key, ca) = (read("server.crt"), read("server.key"), read("ca.crt"));
    let server = tokio::task::spawn_blocking(move || {
        TestServer::start_local_with(
            &[
                ("ssl", "on"),
                ("listen_addresses", "127.0.0.1"),
                ("ssl_ca_file", "ca.crt"),
            ],
            &[
                ("server.crt", &crt),
                ("server.key", &key),
                ("ca.crt", &ca),
                ("pg_hba.conf", hba.as_bytes()),
            ],
        )
    })
    .await
    .unwrap()
    .expect("a TLS server");
    let (admin, conn) = server
        .pg_config()
        .connect(tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    admin
        .batch_execute(
            "CREATE ROLE app LOGIN PASSWORD 'sekret'; CREATE ROLE certuser LOGIN;
             GRANT pg_monitor TO app, certuser; GRANT ALL ON SCHEMA public TO app, certuser",
        )
        .await
        .unwrap();
    let port = server.port().to_string();
    let f = |name: &str| dir.join(name).display().to_string();
    let home = dir.join("home");
    std::fs::create_dir_all(home.join(".postgresql")).unwrap();
    // Runs pgwarden with no URL, only `env`.
    let with_env = |env: Vec<(&str, String)>, args: Vec<&str>| {
        let mut c = pgwarden("");
        c.env_remove("DATABASE_URL").env("HOME", &home);
        for (k, v) in env {
            c.env(k, v);
        }
        c.args(args);
        async move { within(BOUND, "pgwarden to exit", c.output()).await.unwrap() }
    };
    let base = |extra: Vec<(&'static str, String)>| {
        let mut v = vec![
            ("PGHOST", "localhost".to_owned()),
            ("PGHOSTADDR", "127.0.0.1".to_owned()),
            ("PGPORT", port.clone()),
            ("PGUSER", "app".to_owned()),
            ("PGDATABASE", "postgres".to_owned()),
        ];
        v.extend(extra);
        v
    };

    // 1. All from libpq's variables; the CA:TRUE certificate is its own root.
    for mode in ["verify-full", "verify-ca"] {
        let out = with_env(
            base(vec![
                ("PGPASSWORD", "sekret".into()),
                ("PGSSLMODE", mode.into()),
                ("PGSSLROOTCERT", f("server.crt")),
            ]),
            vec!["locks", "--json"],
        )
        .await;
        assert_eq!(out.status.code(), Some(0), "{mode}: {}", stderr(&out));
    }
    // A wrong root: refused (exit 1, not 69), naming the server.
    let out = with_env(
        base(vec![
            ("PGPASSWORD", "sekret".into()),
            ("PGSSLMODE", "verify-ca".into()),
            ("PGSSLROOTCERT", f("other.crt")),
        ]),
        vec!["locks"],
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("localhost:{port}")),
        "{}",
        stderr(&out)
    );
    assert!(stderr(&out).contains("certificate"), "{}", stderr(&out));

    // 2. The password file (0600), and no password anywhere else.
    let pass = dir.join("pgpass");
    std::fs::write(&pass, format!("# comment\nlocalhost:{port}:*:app:sekret\n")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&pass, std::fs::Permissions::from_mode(0o600)).unwrap();
    let passfile = vec![
        ("PGPASSFILE", pass.display().to_string()),
        ("PGSSLMODE", "verify-full".into()),
        ("PGSSLROOTCERT", f("server.crt")),
    ];
    let out = with_env(base(passfile.clone()), vec!["locks", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    // A wrong password: exit 1, not 69, naming the server.
    let out = with_env(
        base(vec![
            ("PGPASSWORD", "wrong".into()),
            ("PGSSLMODE", "require".into()),
        ]),
        vec!["locks"],
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("password authentication failed"),
        "{}",
        stderr(&out)
    );
    assert!(
        stderr(&out).contains(&format!("localhost:{port}")),
        "{}",
        stderr(&out)
    );

    // 3. PGAPPNAME names the sessions; the command's DATABASE_URL has no
    // password.
    let mut env = base(passfile.clone());
    env.push(("PGAPPNAME", "oncall-job".into()));
    let d = dir.display();
    let run = with_env(
        env,
        vec![
            "run",
            "job",
            "--",
            "sh",
            "-c",
            &format!(
                "echo \"$DATABASE_URL\" > {d}/url.tmp && mv {d}/url.tmp {d}/url; while [ ! -f {d}/go ]; do sleep 0.05; done"
            ),
        ],
    );
    let run = tokio::spawn(run);
    let url_seen = wait_file(&dir.join("url")).await;
    let apps: Vec<String> = admin
        .query(
            "SELECT application_name FROM pg_stat_activity WHERE usename = 'app'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    std::fs::write(dir.join("go"), "").unwrap();
    let out = run.await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(apps.iter().any(|a| a == "oncall-job"), "{apps:?}");
    assert!(!url_seen.contains("sekret"), "{url_seen}");
    assert!(
        url_seen.starts_with("postgresql://app@localhost:"),
        "{url_seen}"
    );

    // 4. verify-ca without sslrootcert: ~/.postgresql/root.crt.
    let no_root = base(vec![
        ("PGPASSFILE", pass.display().to_string()),
        ("PGSSLMODE", "verify-ca".into()),
    ]);
    let out = with_env(no_root.clone(), vec!["locks"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("root.crt"), "{}", stderr(&out));
    std::fs::copy(dir.join("server.crt"), home.join(".postgresql/root.crt")).unwrap();
    let out = with_env(no_root, vec!["locks"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));

    // 5. A client certificate (the `cert` pg_hba line), in the URL.
    let cert_url = format!(
        "host=localhost hostaddr=127.0.0.1 port={port} user=certuser dbname=postgres sslmode=verify-full sslrootcert={} sslcert={} sslkey={}",
        f("server.crt"), f("client.crt"), f("client.key")
    );
    let out = cli(&cert_url, &["locks", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let without = format!(
        "postgresql://certuser@localhost:{port}/postgres?hostaddr=127.0.0.1&sslmode=verify-full&sslrootcert={}",
        f("server.crt")
    );
    let out = cli(&without, &["locks"]).await;
    assert_eq!(
        out.status.code(),
        Some(1),
        "no certificate: refused: {}",
        stderr(&out)
    );
    // 6. The command's DATABASE_URL keeps the client certificate (psql
    // connects with it, as run did); its application_name is the term's.
    let job = psql_job(
        &dir,
        "select current_user, current_setting('application_name')",
    );
    let out = cli(
        &format!("{cert_url} application_name=myjob"),
        &[
            "--table",
            "cert_leases",
            "run",
            "certjob",
            "--",
            &job[0],
            &job[1],
            &job[2],
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let seen = std::fs::read_to_string(dir.join("out")).unwrap();
    let child_url = std::fs::read_to_string(dir.join("url")).unwrap();
    assert!(
        seen.starts_with("certuser|pgwarden run certjob token"),
        "{seen} from {child_url}"
    );
    assert!(
        child_url.contains("sslcert=") && child_url.contains("hostaddr=127.0.0.1"),
        "{child_url}"
    );
}

// ---------------------------------------------------------------------
// Point 2 of issue 31: right answers on the databases people have.

#[tokio::test(flavor = "multi_thread")]
async fn check_sees_every_database_says_what_it_cannot_see_and_exits_69_only_when_unreachable() {
    let db1 = db().await;
    let db2 = db().await;
    let url = db1.url();
    // An idle session holds a lock in the other database.
    let mut config = db2.pg_config();
    config.application_name("elsewhere");
    let (holder, conn) = config.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    let holder_pid: i32 = holder
        .query_one(
            "SELECT pg_backend_pid() FROM (SELECT pg_advisory_lock(777)) s",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let out = cli(&url, &["check", "--max-idle-lock", "0s", "--no-leases"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let said = stdout(&out);
    println!("{said}");
    assert!(
        said.lines().any(|l| l.starts_with("idle_lock:")
            && l.contains("777")
            && l.contains(&holder_pid.to_string())
            && l.contains(db2.name())),
        "{said}"
    );
    let locks = json(&url, &["locks", "--json", "--pid", &holder_pid.to_string()]).await;
    assert_eq!(locks.len(), 1, "{locks:?}");
    assert_eq!(locks[0]["database"], db2.name());
    assert_eq!(locks[0]["hidden"], false);

    // A role without pg_monitor: never a silent ok.
    let admin = db1.connect().await.unwrap();
    admin
        .batch_execute(&format!(
            "DO $$ BEGIN CREATE ROLE nomon LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$;
             GRANT CONNECT ON DATABASE \"{}\" TO nomon",
            db1.name()
        ))
        .await
        .unwrap();
    let nomon = format!("{url} user=nomon");
    let locks = json(
        &nomon,
        &["locks", "--json", "--pid", &holder_pid.to_string()],
    )
    .await;
    assert_eq!(locks[0]["hidden"], true, "{locks:?}");
    let table = stdout(&cli(&nomon, &["locks", "--pid", &holder_pid.to_string()]).await);
    println!("{table}");
    assert!(
        table.contains("hidden") && !table.contains("local"),
        "{table}"
    );
    assert!(table.contains("grant it pg_monitor"), "{table}");
    let out = cli(&nomon, &["check", "--no-leases", "--max-idle-lock", "1h"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(
        stdout(&out)
            .lines()
            .any(|l| l.starts_with("hidden_sessions:") && l.contains(&holder_pid.to_string())),
        "{}",
        stdout(&out)
    );

    // A missing lease table (or a mistyped --table) is a finding, not ok.
    let out = cli(
        &url,
        &[
            "check",
            "--table",
            "pgwarden_lease",
            "--max-idle-lock",
            "1h",
            "--database",
            db1.name(),
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(
        stdout(&out).starts_with("no_lease_table:"),
        "{}",
        stdout(&out)
    );

    // Refusals are not unreachability: an unknown database or role exits 1.
    for bad in [
        format!("{url} dbname=nosuchdb"),
        format!("{url} user=nosuchrole"),
    ] {
        let out = cli(&bad, &["check"]).await;
        assert_eq!(out.status.code(), Some(1), "{bad}: {}", stderr(&out));
        assert!(stderr(&out).contains("does not exist"), "{}", stderr(&out));
    }

    // A paused PgBouncer: exit 69 within the connect timeout.
    let server = TestServer::shared().unwrap();
    let bouncer = pgwarden_testing::PgBouncer::start(server, &db1).expect("pgbouncer");
    let mut console = bouncer.pg_config();
    console.dbname("pgbouncer");
    let (console, conn) = console.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    console.simple_query("PAUSE").await.unwrap();
    for args in [&["check"][..], &["run", "x", "--", "true"]] {
        let out = within(
            BOUND,
            "pgwarden to give up on a paused PgBouncer",
            pgwarden(&format!("{} connect_timeout=2", bouncer.url()))
                .args(args)
                .output(),
        )
        .await
        .unwrap();
        assert_eq!(out.status.code(), Some(69), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("no answer within 2s"),
            "{}",
            stderr(&out)
        );
    }
    console.simple_query("RESUME").await.unwrap();
    drop(holder);
}

#[tokio::test(flavor = "multi_thread")]
async fn on_a_hot_standby_locks_and_check_say_the_locks_live_on_the_primary() {
    let cluster = pgwarden_testing::Cluster::start().await.expect("a cluster");
    let db = cluster.create_database().await.unwrap();
    cluster.wait_replayed().await.unwrap();
    let standby = cluster.replica().url(&db);
    let out = cli(&standby, &["locks"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).contains("hot standby"), "{}", stdout(&out));
    let out = cli(&standby, &["check", "--no-leases"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(stdout(&out).starts_with("standby:"), "{}", stdout(&out));
    // The lease table is readable there (its rows replicated), and from a
    // read-only session on the primary.
    let primary = cluster.primary().url(&db);
    let out = cli(&primary, &["run", "replicated", "--", "true"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    cluster.wait_replayed().await.unwrap();
    let rows = json(&standby, &["leases", "--json"]).await;
    assert!(lease(&rows, "replicated").is_some(), "{rows:?}");
    let read_only = format!("{primary} options='-c default_transaction_read_only=on'");
    let rows = json(&read_only, &["leases", "--json"]).await;
    assert!(lease(&rows, "replicated").is_some(), "{rows:?}");
    let out = cli(&read_only, &["check", "--max-idle-lock", "1h"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    // run cannot take a lease there, and says why.
    let out = cli(&standby, &["run", "x", "--", "true"]).await;
    assert_ne!(out.status.code(), Some(0));
    assert!(stderr(&out).contains("primary"), "{}", stderr(&out));
}

// ---------------------------------------------------------------------
// Issue 31, the hostile reading of the second round (L1-L4, S1-S4, P10).

/// A TLS server (the docs' self-signed certificate) with password
/// (scram) logins over TCP, TLS or not, and a role `app` (password
/// `sekret`); and the directory of its certificates (`server.crt`, and
/// `other.crt`, a self-signed certificate that did not sign it). One for
/// the tests of this binary that need it.
struct PasswordServer {
    server: TestServer,
    dir: PathBuf,
    _t: tempfile::TempDir,
}

async fn password_server() -> &'static PasswordServer {
    static SERVER: std::sync::OnceLock<PasswordServer> = std::sync::OnceLock::new();
    tokio::task::spawn_blocking(|| SERVER.get_or_init(start_password_server))
        .await
        .unwrap()
}

fn start_password_server() -> PasswordServer {
    let (t, dir) = tempdir();
    for (crt, key) in [("server.crt", "server.key"), ("other.crt", "other.key")] {
        openssl(
            &dir,
            &[
                "req",
                "-new",
                "-x509",
                "-days",
                "365",
                "-nodes",
                "-out",
                crt,
                "-keyout",
                key,
                "-subj",
                "/CN=localhost",
            ],
        );
    }
    let read = |f: &str| std::fs::read(dir.join(f)).unwrap();
    let (crt, key) = (read("server.crt"), read("server.key"));
    let hba = "local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n";
    let server = TestServer::start_local_with(
        &[("ssl", "on"), ("listen_addresses", "127.0.0.1")],
        &[
            ("server.crt", &crt),
            ("server.key", &key),
            ("pg_hba.conf", hba.as_bytes()),
        ],
    )
    .expect("a TLS server");
    let config = server.pg_config();
    // Its own runtime: the role is made once, whichever test comes first.
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (admin, conn) = config.connect(tokio_postgres::NoTls).await.unwrap();
            tokio::spawn(conn);
            admin
                .batch_execute("CREATE ROLE app LOGIN PASSWORD 'sekret'")
                .await
                .unwrap();
        })
    })
    .join()
    .unwrap();
    PasswordServer { server, dir, _t: t }
}

/// Runs pgwarden with no URL, HOME set to `home`, and `env`.
async fn with_env(home: &Path, env: Vec<(&str, String)>, args: Vec<&str>) -> Output {
    let mut c = pgwarden("");
    c.env_remove("DATABASE_URL").env("HOME", home);
    for (k, v) in env {
        c.env(k, v);
    }
    c.args(args);
    within(BOUND, "pgwarden to exit", c.output()).await.unwrap()
}

/// A service file: `oncall` is the password server (sslmode=require;
/// later lines and sections of the same name do not count).
fn service_file(port: u16) -> String {
    format!(
        "# on-call\n[other]\nhost=/nowhere\n\n  [oncall]  \nhost=localhost\nhostaddr=127.0.0.1\nport={port}\nuser=app\ndbname=postgres\nsslmode=require\nport=1\n[oncall]\nport=2\n"
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn service_files_are_read_as_libpq_reads_them() {
    let pw_server = password_server().await;
    let (_t, dir) = tempdir();
    let port = pw_server.server.port();
    let home = dir.join("home");
    let sysconf = dir.join("sysconf");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&sysconf).unwrap();
    let service = service_file(port);
    let file = dir.join("services.conf");
    std::fs::write(&file, &service).unwrap();
    let pw = ("PGPASSWORD", "sekret".to_owned());
    let file_env = ("PGSERVICEFILE", file.display().to_string());

    // PGSERVICE with PGSERVICEFILE; service= in a key=value string and in
    // a URL; the service's settings beat the environment's (PGHOST), the
    // URL's beat the service's.
    for (env, args) in [
        (
            vec![file_env.clone(), ("PGSERVICE", "oncall".into()), pw.clone()],
            vec!["locks", "--json"],
        ),
        (
            vec![file_env.clone(), pw.clone(), ("PGHOST", "/nowhere".into())],
            vec!["locks", "--json", "--url", "service=oncall"],
        ),
        (
            vec![file_env.clone(), pw.clone()],
            vec!["locks", "--json", "--url", "postgresql:///?service=oncall"],
        ),
    ] {
        let out = with_env(&home, env.clone(), args.clone()).await;
        assert_eq!(
            out.status.code(),
            Some(0),
            "{env:?} {args:?}: {}",
            stderr(&out)
        );
    }
    let out = with_env(
        &home,
        vec![file_env.clone(), pw.clone()],
        vec!["locks", "--url", "service=oncall port=1"],
    )
    .await;
    assert_eq!(
        out.status.code(),
        Some(69),
        "the URL's port wins: {}",
        stderr(&out)
    );
    // ~/.pg_service.conf, then PGSYSCONFDIR/pg_service.conf for a service
    // the first does not define.
    std::fs::write(home.join(".pg_service.conf"), &service).unwrap();
    std::fs::write(
        sysconf.join("pg_service.conf"),
        service.replace("[oncall]", "[system]"),
    )
    .unwrap();
    for name in ["oncall", "system"] {
        let out = with_env(
            &home,
            vec![
                ("PGSERVICE", name.into()),
                ("PGSYSCONFDIR", sysconf.display().to_string()),
                pw.clone(),
            ],
            vec!["locks", "--json"],
        )
        .await;
        assert_eq!(out.status.code(), Some(0), "{name}: {}", stderr(&out));
    }
    // Not defined anywhere, a missing PGSERVICEFILE, a syntax error: exit 2
    // with libpq's words and the files.
    let out = with_env(
        &home,
        vec![
            ("PGSERVICE", "nosuch".into()),
            ("PGSYSCONFDIR", sysconf.display().to_string()),
        ],
        vec!["locks"],
    )
    .await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("definition of service \"nosuch\" not found")
            && stderr(&out).contains(".pg_service.conf")
            && stderr(&out).contains("sysconf/pg_service.conf"),
        "{}",
        stderr(&out)
    );
    let out = with_env(
        &home,
        vec![
            ("PGSERVICE", "oncall".into()),
            (
                "PGSERVICEFILE",
                dir.join("nosuch.conf").display().to_string(),
            ),
        ],
        vec!["locks"],
    )
    .await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("nosuch.conf not found"),
        "{}",
        stderr(&out)
    );
    let bad = dir.join("bad.conf");
    std::fs::write(&bad, "[oncall]\nhost = localhost\n").unwrap();
    let out = with_env(
        &home,
        vec![
            ("PGSERVICE", "oncall".into()),
            ("PGSERVICEFILE", bad.display().to_string()),
        ],
        vec!["locks"],
    )
    .await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("line 2"), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_password_exits_1_with_libpqs_words_and_a_hint() {
    let pw_server = password_server().await;
    let (_t, dir) = tempdir();
    let port = pw_server.server.port();
    let home = dir.join("home");
    std::fs::create_dir_all(&home).unwrap();
    let env = |extra: Vec<(&'static str, String)>| {
        let mut v = vec![
            ("PGHOST", "localhost".to_owned()),
            ("PGHOSTADDR", "127.0.0.1".to_owned()),
            ("PGPORT", port.to_string()),
            ("PGUSER", "app".to_owned()),
            ("PGDATABASE", "postgres".to_owned()),
        ];
        v.extend(extra);
        v
    };
    // No password anywhere; then a password file with group access
    // (ignored, as libpq does): the server was reached and asked: exit 1.
    let pass = dir.join("pgpass");
    std::fs::write(&pass, format!("*:{port}:*:app:sekret\n")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&pass, std::fs::Permissions::from_mode(0o644)).unwrap();
    for (extra, why) in [
        (vec![], "no password file"),
        (
            vec![("PGPASSFILE", pass.display().to_string())],
            "has group or world access",
        ),
    ] {
        let out = with_env(&home, env(extra), vec!["locks"]).await;
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains("no password supplied")
                && err.contains("0600")
                && err.contains("PGPASSWORD")
                && err.contains(why),
            "{err}"
        );
    }
    std::fs::set_permissions(&pass, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = with_env(
        &home,
        env(vec![("PGPASSFILE", pass.display().to_string())]),
        vec!["locks", "--json"],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_root_that_did_not_sign_the_servers_certificate_is_named_as_psql_names_it() {
    let pw_server = password_server().await;
    let port = pw_server.server.port();
    let other = pw_server.dir.join("other.crt").display().to_string();
    let url = format!(
        "host=localhost hostaddr=127.0.0.1 port={port} user=app password=sekret dbname=postgres"
    );
    for mode in ["verify-ca", "verify-full"] {
        let out = cli(
            &format!("{url} sslmode={mode} sslrootcert={other}"),
            &["locks"],
        )
        .await;
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains("certificate verify failed")
                && err.contains(&other)
                && err.contains("unknown issuer"),
            "{err}"
        );
        assert!(
            !err.contains("CaUsedAsEndEntity") && !err.contains("Other("),
            "{err}"
        );
    }
    // The right root still works.
    let root = pw_server.dir.join("server.crt").display().to_string();
    let out = cli(
        &format!("{url} sslmode=verify-full sslrootcert={root}"),
        &["locks", "--json"],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread")]
async fn sslmode_disable_ignores_the_tls_files_as_libpq_does() {
    let pw_server = password_server().await;
    let port = pw_server.server.port();
    let out = cli(
        &format!(
            "host=localhost hostaddr=127.0.0.1 port={port} user=app password=sekret dbname=postgres sslmode=disable sslcert=/nonexistent/client.crt sslkey=/nonexistent/client.key"
        ),
        &["locks", "--json"],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

/// A database with a lease table (a lease was taken and released) and an
/// idle session holding advisory lock 4242 (its client, and its pid).
async fn db_with_table_and_idle_lock() -> (TestDb, tokio_postgres::Client, i32) {
    let db = db().await;
    let out = cli(&db.url(), &["run", "made", "--", "true"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (holder, conn) = db.pg_config().connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    let pid: i32 = holder
        .query_one(
            "SELECT pg_backend_pid() FROM (SELECT pg_advisory_lock(4242)) s",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    (db, holder, pid)
}

#[tokio::test(flavor = "multi_thread")]
async fn check_by_a_role_that_cannot_read_the_lease_table_reports_the_locks_and_the_grant() {
    let (db, _holder, holder_pid) = db_with_table_and_idle_lock().await;
    // A role with no rights at all (not even SELECT on the table): the
    // lock findings it can see, and one saying the leases were not read
    // and the GRANT that fixes it.
    let admin = db.connect().await.unwrap();
    admin
        .batch_execute(
            "DO $$ BEGIN CREATE ROLE norights LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$",
        )
        .await
        .unwrap();
    let norights = format!("{} user=norights", db.url());
    let out = cli(
        &norights,
        &["check", "--max-idle-lock", "0s", "--database", db.name()],
    )
    .await;
    let said = stdout(&out);
    println!("{said}");
    assert_eq!(out.status.code(), Some(1), "{said} {}", stderr(&out));
    assert!(
        said.lines()
            .any(|l| l.starts_with("hidden_sessions:") && l.contains(&holder_pid.to_string())),
        "the locks it can see: {said}"
    );
    assert!(
        said.lines()
            .any(|l| l.starts_with("lease_table_unreadable:")
                && l.contains("GRANT SELECT ON \"public\".\"pgwarden_leases\" TO \"norights\"")),
        "{said}"
    );
    let out = cli(&norights, &["check", "--json", "--max-idle-lock", "0s"]).await;
    let all: Vec<Value> = serde_json::from_slice(&out.stdout).expect("a JSON array");
    assert!(
        all.iter()
            .any(|f| f["kind"] == "lease_table_unreadable" && f["subject"]["sqlstate"] == "42501"),
        "{all:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn check_treats_a_mistyped_schema_as_a_missing_lease_table() {
    let (db, _holder, _) = db_with_table_and_idle_lock().await;
    let out = cli(
        &db.url(),
        &[
            "check",
            "--table",
            "nosuchschema.leases",
            "--max-idle-lock",
            "0s",
            "--database",
            db.name(),
        ],
    )
    .await;
    let said = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{said} {}", stderr(&out));
    assert!(
        said.lines()
            .any(|l| l.starts_with("no_lease_table:") && l.contains("nosuchschema")),
        "{said}"
    );
    assert!(
        said.lines()
            .any(|l| l.starts_with("idle_lock:") && l.contains("4242")),
        "{said}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn table_names_are_read_as_psql_reads_them() {
    let (db, _holder, _) = db_with_table_and_idle_lock().await;
    let url = db.url();
    // Unquoted: folded to lower case; quoted: kept.
    for t in [
        "Pgwarden_Leases",
        "PUBLIC.PGWARDEN_LEASES",
        "\"public\".pgwarden_leases",
    ] {
        let rows = json(&url, &["leases", "--json", "--table", t]).await;
        assert!(lease(&rows, "made").is_some(), "{t}: {rows:?}");
    }
    let out = cli(
        &url,
        &["run", "cased", "--table", "\"Mixed_Case\"", "--", "true"],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let admin = db.connect().await.unwrap();
    let exists: bool = admin
        .query_one(
            "SELECT to_regclass('public.\"Mixed_Case\"') IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(exists, "the quoted name keeps its case");
    let rows = json(&url, &["leases", "--json", "--table", "\"Mixed_Case\""]).await;
    assert!(lease(&rows, "cased").is_some(), "{rows:?}");
    let out = cli(&url, &["leases", "--table", "Mixed_Case"]).await;
    assert_eq!(
        out.status.code(),
        Some(1),
        "folded: another table: {}",
        stdout(&out)
    );
    let out = cli(&url, &["leases", "--table", "\"bad\"name"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread")]
async fn leases_on_a_standby_whose_replay_is_paused_say_so_in_text_and_json() {
    let cluster = pgwarden_testing::Cluster::start().await.expect("a cluster");
    let db = cluster.create_database().await.unwrap();
    let primary = cluster.primary().url(&db);
    let out = cli(&primary, &["run", "before-pause", "--", "true"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    cluster.wait_replayed().await.unwrap();
    let replica = cluster.replica().connect(&db).await.unwrap();
    replica
        .batch_execute("SELECT pg_wal_replay_pause()")
        .await
        .unwrap();
    eventually(BOUND, "replay to be paused", || async {
        replica
            .query_one("SELECT pg_get_wal_replay_pause_state() = 'paused'", &[])
            .await
            .unwrap()
            .get::<_, bool>(0)
    })
    .await;
    let standby = cluster.replica().url(&db);
    let out = cli(&standby, &["leases"]).await;
    let said = stdout(&out);
    println!("{said}");
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(said.contains("before-pause"), "{said}");
    assert!(
        said.contains("hot standby") && said.contains("replay paused") && said.contains("primary"),
        "{said}"
    );
    // --json: the array stays an array; the note goes to stderr.
    let out = cli(&standby, &["leases", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let rows: Vec<Value> = serde_json::from_slice(&out.stdout).expect("a JSON array");
    assert!(lease(&rows, "before-pause").is_some(), "{rows:?}");
    assert!(stderr(&out).contains("hot standby"), "{}", stderr(&out));
    // --watch --json: each sample says it.
    let mut c = pgwarden(&standby);
    c.args(["leases", "--json", "--watch", "0.2"])
        .stdout(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let mut lines =
        tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(child.stdout.take().unwrap()));
    let first = within(BOUND, "a sample", lines.next_line())
        .await
        .unwrap()
        .unwrap();
    child.kill().await.unwrap();
    let sample: Value = serde_json::from_str(&first).unwrap();
    assert_eq!(sample["standby"]["replay_paused"], true, "{sample}");
    assert!(sample["standby"]["last_replay"].is_string(), "{sample}");
    // The primary says nothing of the kind.
    let out = cli(&primary, &["leases"]).await;
    assert!(!stdout(&out).contains("standby"), "{}", stdout(&out));
    replica
        .batch_execute("SELECT pg_wal_replay_resume()")
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_sql_jobs_statement_does_not_outlive_its_term() {
    let Some(psql) = pgwarden_testing::find_tool("psql") else {
        panic!("psql is needed (PostgreSQL's client)");
    };
    let db = db().await;
    let url = db.url();
    let admin = db.connect().await.unwrap();
    admin
        .batch_execute("CREATE TABLE ledger (token int8, at timestamptz)")
        .await
        .unwrap();
    // The shape of most jobs under a PostgreSQL lease: one long statement
    // (psql reads DATABASE_URL through sh).
    let job = format!(
        "exec {} -X \"$DATABASE_URL\" -c 'INSERT INTO ledger SELECT 1, clock_timestamp() FROM pg_sleep(300)'",
        psql.display()
    );
    let mut c = pgwarden(&url);
    c.args(["run", "sql-job", "--ttl", "4s", "--", "sh", "-c", &job])
        .stderr(Stdio::piped());
    let mut run = c.spawn().unwrap();
    // Its session carries the term's name.
    let (pid, app) = until("the job's statement to run", || async {
        admin
            .query_opt(
                "SELECT pid, application_name FROM pg_stat_activity WHERE query LIKE 'INSERT INTO ledger%' AND state = 'active'",
                &[],
            )
            .await
            .unwrap()
            .map(|r| (r.get::<_, i32>(0), r.get::<_, String>(1)))
    })
    .await;
    assert!(app.starts_with("pgwarden run sql-job token "), "{app}");
    let out = cli(&url, &["revoke", "sql-job", "--yes"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(exit_code(&mut run, BOUND).await, 76);
    let mut err = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut run.stderr.take().unwrap(), &mut err)
        .await
        .unwrap();
    println!("{err}");
    assert!(
        err.contains("still running a statement: 1 cancelled"),
        "{err}"
    );
    // When run has exited, the statement has been cancelled: its backend
    // is gone or idle (psql is dead), and it wrote nothing.
    eventually(BOUND, "the killed job's backend to end", || async {
        admin
            .query_opt(
                "SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND state = 'active'",
                &[&pid],
            )
            .await
            .unwrap()
            .is_none()
    })
    .await;
    let n: i64 = admin
        .query_one("SELECT count(*) FROM ledger", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 0);
}

// ---------------------------------------------------------------------
// Issue 31, third round: the command's DATABASE_URL, libpq's server
// choice, a mistyped --database, a revoked lease.

/// `sh -c` that writes what the command's `psql "$DATABASE_URL"` answers
/// to `query` into `dir/out` (and the URL into `dir/url`).
fn psql_job(dir: &Path, query: &str) -> Vec<String> {
    let d = dir.display();
    vec![
        "sh".into(),
        "-c".into(),
        format!(
            "echo \"$DATABASE_URL\" > {d}/url; psql \"$DATABASE_URL\" -XtAc \"{query}\" > {d}/out.tmp 2>&1; mv {d}/out.tmp {d}/out"
        ),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn the_commands_url_keeps_libpqs_settings_and_the_server_is_chosen_as_libpq_does() {
    let cluster = pgwarden_testing::Cluster::start().await.expect("a cluster");
    let db = cluster.create_database().await.unwrap();
    cluster.wait_replayed().await.unwrap();
    let (p, s) = (cluster.primary(), cluster.replica());
    let (pp, sp) = (p.port().to_string(), s.port().to_string());
    let (_t, dir) = tempdir();
    let query = "select inet_server_port(), pg_is_in_recovery(), current_setting('search_path'), current_setting('application_name')";
    // The standby listed first, as HA URLs list hosts.
    let hosts = format!(
        "postgres://postgres@{}:{sp},{}:{pp}/{db}",
        s.host(),
        p.host()
    );
    let url = format!(
        "{hosts}?target_session_attrs=read-write&options=-c%20search_path%3Dpgw_sp&connect_timeout=5"
    );
    let job = psql_job(&dir, query);
    let out = cli(&url, &["run", "job", "--", &job[0], &job[1], &job[2]]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let seen = std::fs::read_to_string(dir.join("out")).unwrap();
    let child_url = std::fs::read_to_string(dir.join("url")).unwrap();
    // The command reached the primary, with the options given.
    assert!(
        seen.starts_with(&format!("{pp}|f|pgw_sp|pgwarden run job token")),
        "{seen} from {child_url}"
    );
    assert!(
        child_url.contains("target_session_attrs=read-write"),
        "{child_url}"
    );
    assert!(child_url.contains("connect_timeout=5"), "{child_url}");

    // libpq 14's values: `primary` (refused as an invalid URL before).
    let _ = std::fs::remove_file(dir.join("out"));
    let url = format!("{hosts}?target_session_attrs=primary");
    let out = cli(&url, &["run", "job", "--", &job[0], &job[1], &job[2]]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let seen = std::fs::read_to_string(dir.join("out")).unwrap();
    assert!(seen.starts_with(&format!("{pp}|f|")), "{seen}");

    // No target_session_attrs: run, which writes, takes the primary, and
    // tells the command to.
    let _ = std::fs::remove_file(dir.join("out"));
    let out = cli(&hosts, &["run", "job", "--", &job[0], &job[1], &job[2]]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let seen = std::fs::read_to_string(dir.join("out")).unwrap();
    assert!(seen.starts_with(&format!("{pp}|f|")), "{seen}");

    // The environment: PGTARGETSESSIONATTRS (the primary listed first).
    let env_run = |attrs: &'static str, options: Option<&'static str>, args: Vec<&'static str>| {
        let mut c = pgwarden("");
        c.env_remove("DATABASE_URL")
            .env("PGHOST", format!("{},{}", p.host(), s.host()))
            .env("PGPORT", format!("{pp},{sp}"))
            .env("PGUSER", "postgres")
            .env("PGDATABASE", &db)
            .env("PGTARGETSESSIONATTRS", attrs)
            .args(args);
        if let Some(o) = options {
            c.env("PGOPTIONS", o);
        }
        async move { within(BOUND, "pgwarden to exit", c.output()).await.unwrap() }
    };
    let out = env_run("standby", None, vec!["leases", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stderr(&out).contains("hot standby"), "{}", stderr(&out));
    // PGOPTIONS makes every session read-only: no server is read-write.
    let out = env_run(
        "read-write",
        Some("-c default_transaction_read_only=on"),
        vec!["leases", "--json"],
    )
    .await;
    assert_eq!(out.status.code(), Some(69), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("read-only") && stderr(&out).contains(&sp),
        "{}",
        stderr(&out)
    );
    let out = env_run(
        "any",
        Some("-c default_transaction_read_only=on"),
        vec!["leases"],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mistyped_database_is_a_finding_never_a_silent_ok() {
    let db = db().await;
    let url = db.url();
    let holder = db.connect().await.unwrap();
    holder
        .batch_execute("SELECT pg_advisory_lock(78)")
        .await
        .unwrap();
    let name = db.name().to_owned();
    let out = cli(
        &url,
        &[
            "check",
            "--no-leases",
            "--max-idle-lock",
            "1ms",
            "--database",
            &name,
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(stdout(&out).contains("idle_lock"), "{}", stdout(&out));
    let typo = name.to_uppercase();
    let out = cli(
        &url,
        &[
            "check",
            "--no-leases",
            "--max-idle-lock",
            "1ms",
            "--database",
            &typo,
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let said = stdout(&out);
    assert!(said.starts_with("unknown_database:"), "{said}");
    assert!(said.contains(&format!("did you mean {name:?}")), "{said}");
    let out = cli(&url, &["locks", "--database", "pgw_no_such_db"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(stderr(&out).contains("no database"), "{}", stderr(&out));
    drop(holder);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_revoked_lease_is_shown_and_refused_as_revoked() {
    let db = db().await;
    let url = db.url();
    let (_t, dir) = tempdir();
    let mut run = spawn_run(&url, "rv", &["--ttl", "60s"], &job(&dir, 0));
    let token = token_seen(&dir, "rv").await;
    let out = cli(&url, &["revoke", "rv", "--yes"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    // The command ends before run's next renewal (TTL/3) learns of it.
    std::fs::write(dir.join("go"), "").unwrap();
    let code = exit_code(&mut run, BOUND).await;
    let mut said = String::new();
    use tokio::io::AsyncReadExt as _;
    run.stderr
        .take()
        .unwrap()
        .read_to_string(&mut said)
        .await
        .unwrap();
    assert_eq!(code, 0, "{said}");
    assert!(said.contains("revoked"), "{said}");
    assert!(!said.contains("expires within"), "{said}");
    let rows = json(&url, &["leases", "--json"]).await;
    let row = lease(&rows, "rv").unwrap();
    assert_eq!(row["state"], "revoked", "{row}");
    assert_eq!(row["token"], token, "{row}");
    let text = stdout(&cli(&url, &["leases"]).await);
    assert!(
        text.contains("(revoked)") && text.contains("revoked; the term ends in"),
        "{text}"
    );
    assert!(!text.contains("expired in"), "{text}");
    let out = cli(&url, &["run", "rv", "--", "true"]).await;
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(stderr(&out).contains("was revoked"), "{}", stderr(&out));
    assert!(!stderr(&out).contains("within 0"), "{}", stderr(&out));
}
