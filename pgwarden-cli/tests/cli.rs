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
    let mut c = Command::new(BIN);
    c.env("DATABASE_URL", url)
        .env_remove("PGSSLMODE")
        .env_remove("PGSSLROOTCERT")
        .stdin(Stdio::null())
        .kill_on_drop(true);
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
            "trap 'echo term > {d}/term; exit {term_code}' TERM
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

    // --watch redraws in place until SIGINT.
    let mut watch = pgwarden(&url)
        .args(["leases", "--watch", "0.2"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = watch.stdout.take().unwrap();
    let mut seen = Vec::new();
    within(BOUND, "two redraws", async {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 4096];
        while String::from_utf8_lossy(&seen)
            .matches("\x1b[H\x1b[2J")
            .count()
            < 3
        {
            let n = out.read(&mut buf).await.unwrap();
            assert!(n > 0, "watch ended early");
            seen.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    assert!(String::from_utf8_lossy(&seen).contains("report"));
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
    let mut run = spawn_run(
        &url,
        "sync",
        &["--ttl", "2s", "--grace", "5s"],
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
    assert_eq!(exit_code(&mut run, Duration::from_secs(3)).await, 76);
    let took = revoked.elapsed();
    assert!(
        took <= Duration::from_secs(3),
        "stopped {took:?} after the revoke"
    );
    assert_eq!(wait_file(&dir.join("term")).await.trim(), "term");
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
    println!("revoke to run's exit 76: {took:?} (TTL 2 s)");
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
    let mut b = spawn_run(
        &url,
        "rollup",
        &["--ttl", "2s", "--wait", "15s"],
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
    // Woken, A finds its lease gone: its command is stopped, and it exits 76.
    drop(frozen);
    assert_eq!(exit_code(&mut a, BOUND).await, 76);
    assert_eq!(wait_file(&dir_a.join("term")).await.trim(), "term");
    println!("take-over of a frozen run after {waited:?} (TTL 2 s)");
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
    let out = cli(&url, &["check", "--max-idle-lock", "1h"]).await;
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
    let out = cli(&url, &["check", "--max-idle-lock", "0s", "--json"]).await;
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
        assert_eq!(out.status.code(), Some(69), "{u}: {}", stderr(&out));
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
    let opts = pgwarden::LeaseOptions::new(Duration::from_secs(2));
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
    let reason = within(Duration::from_secs(3), "lost()", lease.lost()).await;
    assert_eq!(reason, pgwarden::LostReason::Taken);
    // And the name is free at once.
    let next = leases.acquire("fenced", &opts, None).await.unwrap();
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
        let out = cli(&url, &["check", "--max-idle-lock", "1s"]).await;
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
    let out = cli(&url, &["check", "--max-idle-lock", "1s"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_command_that_ignores_sigterm_is_killed_after_the_grace() {
    let db = db().await;
    let url = db.url();
    let (_t, dir) = tempdir();
    let d = dir.display();
    let stubborn = vec![
        "sh".to_owned(),
        "-c".to_owned(),
        format!(
            "trap '' TERM; echo $$ > {d}/pid.tmp && mv {d}/pid.tmp {d}/pid
i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done"
        ),
    ];
    let mut run = spawn_run(
        &url,
        "stubborn",
        &["--ttl", "2s", "--grace", "1s"],
        &stubborn,
    );
    let child: i32 = wait_file(&dir.join("pid")).await.trim().parse().unwrap();
    let out = cli(&url, &["revoke", "stubborn", "--yes"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let revoked = Instant::now();
    assert_eq!(exit_code(&mut run, Duration::from_secs(5)).await, 76);
    let took = revoked.elapsed();
    assert!(
        took >= Duration::from_secs(1),
        "the grace was given: {took:?}"
    );
    // SIGKILLed: gone (kill -0 fails once it is reaped by run).
    // SAFETY: kill(2) with signal 0 only checks that the process exists.
    let alive = unsafe { libc::kill(child, 0) } == 0;
    assert!(!alive, "the command {child} was killed");
    let mut err = String::new();
    use tokio::io::AsyncReadExt;
    run.stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .await
        .unwrap();
    assert!(err.contains("SIGKILL"), "{err}");
}
