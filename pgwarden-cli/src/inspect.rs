//! The read side and the operator's hand: `leases`, `locks`, `check`,
//! `revoke`, `ddl`.

use std::collections::HashMap;
use std::io::{IsTerminal as _, Write as _};
use std::time::{Duration, SystemTime};

use pgwarden::lease::LeaseRow;
use pgwarden::{LockKey, LockMode, Namespace, Pool};
use serde_json::{json, Value};

use crate::format::{human, human_signed, rfc3339, table};
use crate::{CheckArgs, Failure, ListArgs, LocksArgs, RevokeArgs};

/// pgwarden's own namespace of pair keys (`"pgwd"`: 1885828964).
const PGWARDEN: Namespace = Namespace::new(0x7067_7764);
/// The transaction-scoped lock of the lease table's install.
const INSTALL: LockKey = PGWARDEN.named("leases.install");

pub(crate) fn ddl(table: &str) -> Result<String, Failure> {
    // A pool that never connects: the DDL needs only the table name.
    let manager =
        deadpool_postgres::Manager::new(tokio_postgres::Config::new(), tokio_postgres::NoTls);
    let inner = deadpool_postgres::Pool::builder(manager)
        .max_size(2)
        .build()
        .map_err(|e| Failure::usage(format!("building the pool: {e}")))?;
    let pool = Pool::builder(inner)
        .build()
        .map_err(|e| Failure::usage(format!("building the pool: {e}")))?;
    let leases = pgwarden::Leases::builder(&pool).table(table).build()?;
    Ok(leases.ddl())
}

/// One reading of `leases` or `locks`: as JSON, as a table, and its
/// counts for the `--watch` header.
pub(crate) struct Sample {
    pub(crate) json: Value,
    pub(crate) text: String,
    pub(crate) counts: String,
    /// On a hot standby: what it is and how far behind (JSON), else null.
    pub(crate) standby: Value,
}

/// Prints `draw()`'s output once, or every `--watch` interval until SIGINT:
/// redrawn in place on a terminal, one after the other otherwise, one JSON
/// document per line with `--json`. An error is shown (with the time of
/// the last good sample) and the next sample is tried.
async fn show<F, Fut>(args: &ListArgs, what: &str, place: &str, mut draw: F) -> Result<u8, Failure>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Sample, Failure>>,
{
    let Some(every) = args.watch else {
        let s = draw().await?;
        if args.json {
            println!("{}", s.json);
            // The array stays an array: the note goes to stderr.
            if let Some(note) = s.standby.get("note").and_then(Value::as_str) {
                say!("pgwarden: warning: {note}");
            }
        } else {
            print!("{}", s.text);
        }
        return Ok(0);
    };
    let tty = !args.json && std::io::stdout().is_terminal();
    let mut last: Option<(SystemTime, Sample)> = None;
    // Listening from the start: a SIGINT or SIGTERM while a sample is read
    // ends the watch too.
    let listen = |kind| {
        tokio::signal::unix::signal(kind).map_err(|e| Failure {
            code: 1,
            message: format!("cannot listen for signals: {e}"),
        })
    };
    let mut int = listen(tokio::signal::unix::SignalKind::interrupt())?;
    let mut term = listen(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            r = watch_once(args, what, place, every, tty, &mut last, &mut draw) => r?,
            _ = int.recv() => return Ok(0),
            _ = term.recv() => return Ok(0),
        }
    }
}

/// One sample of `--watch`, printed, then the interval's sleep.
async fn watch_once<F, Fut>(
    args: &ListArgs,
    what: &str,
    place: &str,
    every: Duration,
    tty: bool,
    last: &mut Option<(SystemTime, Sample)>,
    draw: &mut F,
) -> Result<(), Failure>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Sample, Failure>>,
{
    {
        let now = SystemTime::now();
        // A database that stops answering is an error sample too.
        let bound = every.max(Duration::from_secs(2));
        let sample = match tokio::time::timeout(bound, draw()).await {
            Ok(s) => s,
            Err(_) => Err(Failure {
                code: 1,
                message: format!("no answer within {}", human(bound)),
            }),
        };
        let header = format!(
            "pgwarden {what}  {}  {place}  every {}",
            rfc3339(now),
            human(every)
        );
        let out = match sample {
            Ok(s) => {
                let out = if args.json {
                    format!(
                        "{}\n",
                        json!({"time": rfc3339(now), "database": place, what: s.json, "standby": s.standby})
                    )
                } else {
                    format!("{header}  {}\n{}", s.counts, s.text)
                };
                *last = Some((now, s));
                out
            }
            Err(e) => {
                let since = last.as_ref().map(|(t, _)| rfc3339(*t));
                if args.json {
                    format!(
                        "{}\n",
                        json!({"time": rfc3339(now), "database": place, "error": e.message, "last_good": since})
                    )
                } else {
                    let mut out = format!(
                        "{header}\nerror: {e} (last good sample: {})\n",
                        since.as_deref().unwrap_or("none yet")
                    );
                    if let (true, Some((_, s))) = (tty, &last) {
                        out.push_str("stale, as of the last good sample:\n");
                        out.push_str(&s.text);
                    }
                    out
                }
            }
        };
        if tty {
            // Home, clear to the end of the screen, then the sample.
            print!("\x1b[H\x1b[2J{out}");
        } else if args.json {
            print!("{out}");
        } else {
            println!("{out}");
        }
        let _ = std::io::stdout().flush();
        tokio::time::sleep(every).await;
    }
    Ok(())
}

/// An application name for humans: `-` when the session set none.
fn app(name: Option<&str>) -> &str {
    name.filter(|n| !n.is_empty()).unwrap_or("-")
}

fn blocked_by(r: &LeaseRow) -> Value {
    match r.blocker_pid {
        None => Value::Null,
        Some(pid) => json!({
            "pid": pid,
            "application_name": r.blocker_application_name,
            "state": r.blocker_state,
            "state_for_s": r.blocker_state_for.map(|d| d.as_secs_f64()),
        }),
    }
}

fn blocked_text(r: &LeaseRow) -> String {
    match r.blocker_pid {
        None => String::new(),
        Some(pid) => format!(
            "pid {pid} {} ({} {})",
            app(r.blocker_application_name.as_deref()),
            r.blocker_state.as_deref().unwrap_or("?"),
            r.blocker_state_for.map(human).unwrap_or_default()
        ),
    }
}

/// A lease row's state: `live` (held), `revoked` (`pgwarden revoke` ended
/// the term, which still runs out: nobody takes the name before), `held`
/// (released within its at-least hold), `released`, or `expired` (its
/// holder neither renewed nor released it).
pub(crate) fn state(r: &LeaseRow) -> &'static str {
    let held = r.held_until.is_some_and(|h| h > SystemTime::now());
    match () {
        _ if r.live => "live",
        // A release ends the term at once; only a revoke keeps the holder's
        // expiry (who revoked it, and when, is not recorded).
        _ if r.holder.is_empty() && r.expires_in_s > 0.0 => "revoked",
        _ if held && r.holder.is_empty() => "held",
        _ if r.holder.is_empty() => "released",
        _ => "expired",
    }
}

/// The EXPIRY column: what the row's expiry means now.
fn expiry_text(r: &LeaseRow) -> String {
    let left = human_signed(r.expires_in_s);
    match state(r) {
        "live" => format!("live, expires {left}"),
        "revoked" => format!("revoked; the term ends {left} (busy until then)"),
        "held" => format!(
            "released, held until {} (at-least hold)",
            r.held_until.map(rfc3339).unwrap_or_default()
        ),
        "released" => format!("released {left}"),
        _ => format!("expired {left}"),
    }
}

/// What `run` says when it did not get lease `name` within `wait`: who
/// holds it, a revoke whose term still runs, a row lock, or that it was
/// busy at the attempt and is free now. `row` is the name's row, read
/// after the attempt.
pub(crate) fn refusal(row: Option<&LeaseRow>, name: &str, wait: Duration) -> String {
    let tried = if wait.is_zero() {
        "at its one attempt (--wait 0s)".to_owned()
    } else {
        format!("within --wait {}", human(wait))
    };
    let not = "not running the command";
    match row {
        Some(r) if r.live => format!(
            "lease {name:?} is held by {} (token {}, expires {}); {not}",
            r.holder,
            r.token,
            human_signed(r.expires_in_s)
        ),
        Some(r) if r.blocker_pid.is_some() => format!(
            "lease {name:?} expired {} but its take-over is blocked by a row lock of pid {} ({}, {}); {not}",
            human_signed(r.expires_in_s),
            r.blocker_pid.unwrap_or_default(),
            r.blocker_application_name.as_deref().unwrap_or("-"),
            r.blocker_state.as_deref().unwrap_or("?"),
        ),
        Some(r) if state(r) == "revoked" => format!(
            "lease {name:?} was revoked (token {}): nobody can take it before its term ends {}, since its holder may run until then; {not} (--wait {} or more waits for it)",
            r.token,
            human_signed(r.expires_in_s),
            human(Duration::from_secs(r.expires_in_s.ceil() as u64 + 1))
        ),
        Some(r) if state(r) == "held" => format!(
            "lease {name:?} was released but is held until {} (its at-least hold); {not}",
            r.held_until.map(rfc3339).unwrap_or_default()
        ),
        Some(r) => format!(
            "lease {name:?} was busy {tried} and is free now (token {} {}); {not}: try again",
            r.token,
            state(r)
        ),
        None => format!("lease {name:?} was busy {tried} and is free now; {not}: try again"),
    }
}

fn lease_json(r: &LeaseRow) -> Value {
    json!({
        "name": r.name,
        "state": state(r),
        "holder": r.holder,
        "token": r.token,
        "taken_at": rfc3339(r.taken_at),
        "expires_in_s": r.expires_in_s,
        "live": r.live,
        "held_until": r.held_until.map(rfc3339),
        "prev_holder": r.prev_holder.as_deref().filter(|p| !p.is_empty()),
        "ttl_s": r.ttl.map(|t| t.as_secs_f64()),
        "blocked_by": blocked_by(r),
    })
}

pub(crate) async fn leases(
    pool: &Pool,
    leases: &pgwarden::Leases,
    args: &ListArgs,
    place: &str,
    server: crate::connect::Server,
) -> Result<u8, Failure> {
    show(args, "leases", place, || async {
        let rows = leases.rows().await?;
        let standby = standby(pool, server).await?;
        let live = rows.iter().filter(|r| r.live).count();
        let cells: Vec<Vec<String>> = rows
            .iter()
            .map(|r| {
                vec![
                    r.name.clone(),
                    match state(r) {
                        "revoked" => "(revoked)".to_owned(),
                        _ if r.holder.is_empty() => "(released)".to_owned(),
                        _ => r.holder.clone(),
                    },
                    r.token.to_string(),
                    rfc3339(r.taken_at),
                    expiry_text(r),
                    r.ttl.map(human).unwrap_or_else(|| "-".to_owned()),
                    r.held_until.map(rfc3339).unwrap_or_default(),
                    r.prev_holder.clone().unwrap_or_default(),
                    blocked_text(r),
                ]
            })
            .collect();
        let mut text = table(
            &[
                "NAME",
                "HOLDER",
                "TOKEN",
                "TAKEN AT",
                "EXPIRY",
                "TTL",
                "HELD UNTIL",
                "PREVIOUS HOLDER",
                "BLOCKED BY",
            ],
            &cells,
        );
        let standby = standby.map(|s| s.json(&s.leases_note()));
        if let Some(note) = standby.as_ref().and_then(|s| s["note"].as_str()) {
            text.push_str(note);
            text.push('\n');
        }
        Ok(Sample {
            json: Value::Array(rows.iter().map(lease_json).collect()),
            text,
            counts: format!("{} leases, {live} live", rows.len()),
            standby: standby.unwrap_or(Value::Null),
        })
    })
    .await
}

/// One advisory lock, from `pg_locks` (every database of the server) and
/// its session from `pg_stat_activity`.
pub(crate) struct Lock {
    database: Option<String>,
    key: LockKey,
    mode: LockMode,
    granted: bool,
    pid: Option<i32>,
    application_name: Option<String>,
    user: Option<String>,
    state: Option<String>,
    client_addr: Option<String>,
    state_for: Option<Duration>,
    /// The session's details are hidden from this role (another role's
    /// session, no `pg_monitor` / `pg_read_all_stats`).
    hidden: bool,
    /// For a held lock: the backends waiting for it.
    waiting_pids: Vec<i32>,
    /// For an awaited lock: the backends it waits for.
    blockers: Vec<i32>,
    /// For an awaited lock: how long it has been awaited.
    waiting_for: Option<Duration>,
}

fn raw(key: LockKey) -> (u32, u32, i16) {
    match key {
        LockKey::Single(k) => ((k as u64 >> 32) as u32, k as u64 as u32, 1),
        LockKey::Pair(a, b) => (a as u32, b as u32, 2),
    }
}

/// `pgwarden:leases.install`, `pgwarden:<objid>` in pgwarden's namespace;
/// else the key as PostgreSQL's functions take it: `1:987` or `42`.
fn key_text(key: LockKey) -> String {
    match key {
        k if k == INSTALL => "pgwarden:leases.install".to_owned(),
        LockKey::Pair(ns, id) if ns == PGWARDEN.id() => format!("pgwarden:{id}"),
        k => k.to_string(),
    }
}

fn secs(s: Option<f64>) -> Option<Duration> {
    s.and_then(|s| Duration::try_from_secs_f64(s.max(0.0)).ok())
}

/// Every advisory lock of the server (`pg_locks` is cluster-wide), with
/// its database, its session, its waiters and blockers, in one statement.
const LOCKS_SQL: &str = "
SELECT d.datname, l.pid, l.classid::int8, l.objid::int8, l.objsubid::int4,
       l.mode, l.granted, a.application_name, a.usename, a.state, host(a.client_addr),
       greatest(extract(epoch FROM clock_timestamp() - a.state_change), 0)::float8,
       coalesce(a.query = '<insufficient privilege>', false),
       CASE WHEN NOT l.granted AND l.pid IS NOT NULL THEN pg_blocking_pids(l.pid) END,
       CASE WHEN NOT l.granted THEN greatest(extract(epoch FROM clock_timestamp() - l.waitstart), 0)::float8 END
  FROM pg_locks l
  LEFT JOIN pg_database d ON d.oid = l.database
  LEFT JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory'
 ORDER BY d.datname, l.pid, l.granted DESC, l.classid, l.objid, l.objsubid";

pub(crate) async fn read_locks(pool: &Pool) -> Result<Vec<Lock>, Failure> {
    let client = pool.get().await.map_err(pgwarden::Error::from)?;
    let rows = client
        .query(LOCKS_SQL, &[])
        .await
        .map_err(pgwarden::Error::from)?;
    let mut locks = Vec::with_capacity(rows.len());
    for r in &rows {
        let get = || -> Result<Lock, tokio_postgres::Error> {
            let (classid, objid, sub): (i64, i64, i32) =
                (r.try_get(2)?, r.try_get(3)?, r.try_get(4)?);
            let key = if sub == 1 {
                LockKey::Single(((classid as u64) << 32 | objid as u64) as i64)
            } else {
                LockKey::Pair(classid as u32 as i32, objid as u32 as i32)
            };
            let mode: String = r.try_get(5)?;
            Ok(Lock {
                database: r.try_get(0)?,
                pid: r.try_get(1)?,
                key,
                mode: if mode == "ShareLock" {
                    LockMode::Shared
                } else {
                    LockMode::Exclusive
                },
                granted: r.try_get(6)?,
                application_name: r.try_get(7)?,
                user: r.try_get(8)?,
                state: r.try_get(9)?,
                client_addr: r.try_get(10)?,
                state_for: secs(r.try_get(11)?),
                hidden: r.try_get(12)?,
                blockers: r.try_get::<_, Option<Vec<i32>>>(13)?.unwrap_or_default(),
                waiting_for: secs(r.try_get(14)?),
                waiting_pids: Vec::new(),
            })
        };
        locks.push(get().map_err(pgwarden::Error::from)?);
    }
    // A held lock's waiters: the sessions waiting for its key that it
    // blocks.
    let waits: Vec<(Option<String>, LockKey, i32, Vec<i32>)> = locks
        .iter()
        .filter(|l| !l.granted)
        .filter_map(|l| Some((l.database.clone(), l.key, l.pid?, l.blockers.clone())))
        .collect();
    for l in locks.iter_mut().filter(|l| l.granted) {
        let Some(pid) = l.pid else { continue };
        let mut w: Vec<i32> = waits
            .iter()
            .filter(|(db, k, _, b)| *db == l.database && *k == l.key && b.contains(&pid))
            .map(|(_, _, waiter, _)| *waiter)
            .collect();
        w.sort_unstable();
        w.dedup();
        l.waiting_pids = w;
    }
    Ok(locks)
}

fn lock_json(l: &Lock) -> Value {
    let (classid, objid, objsubid) = raw(l.key);
    json!({
        "database": l.database,
        "key": key_text(l.key),
        "classid": classid,
        "objid": objid,
        "objsubid": objsubid,
        "mode": l.mode.to_string(),
        "granted": l.granted,
        "pid": l.pid,
        "application_name": l.application_name,
        "user": l.user,
        "client_addr": l.client_addr,
        "state": l.state,
        "state_for_s": l.state_for.map(|d| d.as_secs_f64()),
        "hidden": l.hidden,
        "waiting_pids": l.waiting_pids,
        "blocked_by": l.blockers,
        "waiting_for_s": l.waiting_for.map(|d| d.as_secs_f64()),
    })
}

fn state_text(state: Option<&str>, age: Option<Duration>) -> String {
    match (state, age) {
        (Some(s), Some(a)) => format!("{s} {}", human(a)),
        (Some(s), None) => s.to_owned(),
        _ => String::new(),
    }
}

/// Where a session connects from: its address, `local` for a Unix socket,
/// `hidden` when this role may not see it.
fn client_text(l: &Lock) -> String {
    match &l.client_addr {
        Some(a) => a.clone(),
        None if l.hidden => "hidden".to_owned(),
        None => "local".to_owned(),
    }
}

fn pids_text(pids: &[i32]) -> String {
    pids.iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

impl LocksArgs {
    fn keep(&self, l: &Lock) -> bool {
        self.pid.is_none_or(|p| l.pid == Some(p))
            && self
                .app
                .as_deref()
                .is_none_or(|a| l.application_name.as_deref() == Some(a))
            && self
                .key
                .as_deref()
                .is_none_or(|k| key_text(l.key) == k || l.key.to_string() == k)
            && self
                .database
                .as_deref()
                .is_none_or(|d| l.database.as_deref() == Some(d))
    }
}

/// The counts of a set of locks: `12 advisory locks (10 held, 2 waiting),
/// 3 sessions, 2 databases`.
fn summary(locks: &[&Lock]) -> String {
    let held = locks.iter().filter(|l| l.granted).count();
    let mut sessions: Vec<i32> = locks.iter().filter_map(|l| l.pid).collect();
    sessions.sort_unstable();
    sessions.dedup();
    let mut dbs: Vec<&str> = locks.iter().filter_map(|l| l.database.as_deref()).collect();
    dbs.sort_unstable();
    dbs.dedup();
    let hidden = locks.iter().filter(|l| l.hidden).filter_map(|l| l.pid);
    let mut hidden: Vec<i32> = hidden.collect();
    hidden.sort_unstable();
    hidden.dedup();
    let mut s = format!(
        "{} advisory lock{} ({held} held, {} waiting), {} session{}, {} database{}",
        locks.len(),
        if locks.len() == 1 { "" } else { "s" },
        locks.len() - held,
        sessions.len(),
        if sessions.len() == 1 { "" } else { "s" },
        dbs.len(),
        if dbs.len() == 1 { "" } else { "s" },
    );
    if !hidden.is_empty() {
        s.push_str(&format!(
            "; the state and client of {} session{} are hidden from this role (grant it pg_monitor)",
            hidden.len(),
            if hidden.len() == 1 { "" } else { "s" }
        ));
    }
    s
}

/// The human table: the locks of one session in one mode and state are one
/// row (`3 keys: 1, 2, 3`).
fn locks_table(locks: &[&Lock]) -> String {
    let mut cells: Vec<Vec<String>> = Vec::new();
    let mut i = 0;
    while i < locks.len() {
        let l = locks[i];
        let mut j = i + 1;
        while j < locks.len() {
            let m = locks[j];
            if m.pid.is_none()
                || m.pid != l.pid
                || m.database != l.database
                || m.mode != l.mode
                || m.granted != l.granted
            {
                break;
            }
            j += 1;
        }
        let group = &locks[i..j];
        let key = if group.len() == 1 {
            key_text(l.key)
        } else {
            let first: Vec<String> = group.iter().take(3).map(|g| key_text(g.key)).collect();
            format!(
                "{} keys: {}{}",
                group.len(),
                first.join(", "),
                if group.len() > 3 { ", …" } else { "" }
            )
        };
        let mut waiters: Vec<i32> = group
            .iter()
            .flat_map(|g| g.waiting_pids.iter().copied())
            .collect();
        waiters.sort_unstable();
        waiters.dedup();
        cells.push(vec![
            l.database.clone().unwrap_or_default(),
            key,
            l.mode.to_string(),
            match l.waiting_for {
                _ if l.granted => "held".to_owned(),
                Some(w) => format!("waiting {}", human(w)),
                None => "waiting".to_owned(),
            },
            l.pid.map(|p| p.to_string()).unwrap_or_default(),
            app(l.application_name.as_deref()).to_owned(),
            client_text(l),
            if l.hidden {
                "hidden".to_owned()
            } else {
                state_text(l.state.as_deref(), l.state_for)
            },
            if l.granted {
                pids_text(&waiters)
            } else {
                format!("blocked by {}", pids_text(&l.blockers))
            },
        ]);
        i = j;
    }
    let mut out = table(
        &[
            "DATABASE",
            "KEY",
            "MODE",
            "GRANTED",
            "PID",
            "APPLICATION",
            "CLIENT",
            "STATE",
            "WAITERS",
        ],
        &cells,
    );
    out.push_str(&summary(locks));
    out.push('\n');
    out
}

/// What `locks` and `check` say on a hot standby.
const STANDBY: &str = "this server is a hot standby: it shows only the advisory locks of its own sessions; the applications' locks live on the primary (point pgwarden at the primary)";

/// A hot standby's replay, as far as any role can see it.
pub(crate) struct Standby {
    /// The primary's commit time of the last transaction replayed.
    last_replay: Option<SystemTime>,
    /// How long ago that was (by this server's clock).
    age: Option<Duration>,
    paused: bool,
    /// WAL received but not replayed yet, in bytes (none: not streaming).
    behind_bytes: Option<i64>,
}

const STANDBY_SQL: &str = "
SELECT pg_is_wal_replay_paused(),
       extract(epoch FROM pg_last_xact_replay_timestamp())::float8,
       greatest(extract(epoch FROM clock_timestamp() - pg_last_xact_replay_timestamp()), 0)::float8,
       pg_wal_lsn_diff(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn())::int8
 WHERE pg_is_in_recovery()";

/// The server's replay state, when it is a hot standby (asked again at
/// each sample: replay moves, or is paused).
pub(crate) async fn standby(
    pool: &Pool,
    server: crate::connect::Server,
) -> Result<Option<Standby>, Failure> {
    if !server.standby {
        return Ok(None);
    }
    let client = pool.get().await.map_err(pgwarden::Error::from)?;
    let row = client
        .query_opt(STANDBY_SQL, &[])
        .await
        .map_err(pgwarden::Error::from)?;
    let Some(r) = row else { return Ok(None) };
    let get = || -> Result<Standby, tokio_postgres::Error> {
        let at: Option<f64> = r.try_get(1)?;
        Ok(Standby {
            paused: r.try_get(0)?,
            last_replay: at.and_then(|s| {
                std::time::UNIX_EPOCH.checked_add(Duration::try_from_secs_f64(s).ok()?)
            }),
            age: secs(r.try_get(2)?),
            behind_bytes: r.try_get(3)?,
        })
    };
    Ok(Some(get().map_err(pgwarden::Error::from)?))
}

impl Standby {
    /// `replay paused; last transaction replayed 8s ago (committed on the
    /// primary at …)`.
    fn lag_text(&self) -> String {
        let mut s = if self.paused {
            "replay paused (pg_wal_replay_resume() resumes it)".to_owned()
        } else {
            "replay running".to_owned()
        };
        match (self.last_replay, self.age) {
            (Some(at), Some(age)) => s.push_str(&format!(
                "; the last transaction it replayed committed on the primary {} ago, at {} (an idle primary commits nothing either)",
                human(age),
                rfc3339(at)
            )),
            _ => s.push_str("; it has replayed no transaction since it started"),
        }
        if let Some(b) = self.behind_bytes.filter(|b| *b > 0) {
            s.push_str(&format!("; {b} bytes of WAL received and not yet replayed"));
        }
        s
    }

    fn leases_note(&self) -> String {
        format!(
            "this server is a hot standby ({}): these lease rows are its replayed copy of the primary's, and a lease taken, renewed or released since is not shown; leases live on the primary (point pgwarden at the primary for the current holders)",
            self.lag_text()
        )
    }

    fn locks_note(&self) -> String {
        format!("{STANDBY}; {}", self.lag_text())
    }

    fn json(&self, note: &str) -> Value {
        json!({
            "standby": true,
            "replay_paused": self.paused,
            "last_replay": self.last_replay.map(rfc3339),
            "last_replay_age_s": self.age.map(|d| d.as_secs_f64()),
            "unreplayed_bytes": self.behind_bytes,
            "note": note,
        })
    }
}

/// Why `--database NAME` names no database of the server, with the names
/// close to it; `None` when it exists.
async fn unknown_database(pool: &Pool, name: &str) -> Result<Option<String>, Failure> {
    let client = pool.get().await.map_err(pgwarden::Error::from)?;
    let rows = client
        .query(
            "SELECT datname FROM pg_database WHERE datallowconn OR datname = $1 ORDER BY datname",
            &[&name],
        )
        .await
        .map_err(pgwarden::Error::from)?;
    let names: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    if names.iter().any(|n| n == name) {
        return Ok(None);
    }
    // Close: the same but for case, `_` and `-`, or one containing the other.
    let fold = |s: &str| s.to_lowercase().replace(['_', '-'], "");
    let close: Vec<&String> = names
        .iter()
        .filter(|n| {
            let (a, b) = (fold(n), fold(name));
            a == b || (!b.is_empty() && (a.contains(&b) || b.contains(&a)))
        })
        .collect();
    let hint = match close.as_slice() {
        [] => format!(
            "its databases: {}",
            names
                .iter()
                .take(20)
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        ),
        c => format!(
            "did you mean {}?",
            c.iter()
                .map(|n| format!("{n:?}"))
                .collect::<Vec<_>>()
                .join(" or ")
        ),
    };
    Ok(Some(format!(
        "no database {name:?} on this server (names are case-sensitive); {hint}"
    )))
}

pub(crate) async fn locks(
    pool: &Pool,
    args: &LocksArgs,
    place: &str,
    server: crate::connect::Server,
) -> Result<u8, Failure> {
    if let Some(db) = &args.database {
        if let Some(why) = unknown_database(pool, db).await? {
            return Err(Failure {
                code: 1,
                message: format!("--database: {why}"),
            });
        }
    }
    show(&args.list, "locks", place, || async {
        let all = read_locks(pool).await?;
        let locks: Vec<&Lock> = all.iter().filter(|l| args.keep(l)).collect();
        let mut text = locks_table(&locks);
        let standby = standby(pool, server)
            .await?
            .map(|s| s.json(&s.locks_note()));
        if let Some(note) = standby.as_ref().and_then(|s| s["note"].as_str()) {
            text.push_str(note);
            text.push('\n');
        }
        Ok(Sample {
            json: Value::Array(locks.iter().map(|l| lock_json(l)).collect()),
            text,
            counts: summary(&locks),
            standby: standby.unwrap_or(Value::Null),
        })
    })
    .await
}

/// One finding of `check`.
struct Finding {
    kind: &'static str,
    message: String,
    subject: Value,
}

/// `pid 123 (app, 10.0.0.1)` in database `db`.
fn who(l: &Lock) -> String {
    format!(
        "pid {} ({}, {}) in database {}",
        l.pid.map(|p| p.to_string()).unwrap_or_else(|| "?".into()),
        app(l.application_name.as_deref()),
        client_text(l),
        l.database.as_deref().unwrap_or("?")
    )
}

/// The lock findings: idle sessions holding locks (one finding per
/// session, however many keys), long waiters (naming their blockers), and
/// sessions this role cannot see.
fn lock_findings(locks: &[Lock], max: Duration) -> Vec<Finding> {
    let mut findings = Vec::new();
    let by_pid: HashMap<i32, &Lock> = locks.iter().filter_map(|l| Some((l.pid?, l))).collect();
    // Idle holders, grouped by session.
    let mut idle: Vec<(i32, Vec<&Lock>)> = Vec::new();
    for l in locks {
        let is_idle = l.state.as_deref().is_some_and(|s| s.starts_with("idle"));
        if !(l.granted && is_idle && l.state_for.is_some_and(|d| d >= max)) {
            continue;
        }
        let Some(pid) = l.pid else { continue };
        match idle.iter_mut().find(|(p, _)| *p == pid) {
            Some((_, v)) => v.push(l),
            None => idle.push((pid, vec![l])),
        }
    }
    for (_, group) in &idle {
        let l = group[0];
        let keys: Vec<String> = group.iter().take(3).map(|g| key_text(g.key)).collect();
        let what = if group.len() == 1 {
            format!("advisory lock {} ({})", keys[0], l.mode)
        } else {
            format!(
                "{} advisory locks ({}{})",
                group.len(),
                keys.join(", "),
                if group.len() > 3 { ", …" } else { "" }
            )
        };
        findings.push(Finding {
            kind: "idle_lock",
            message: format!(
                "{what} held by {}, {}",
                who(l),
                state_text(l.state.as_deref(), l.state_for)
            ),
            subject: json!({
                "pid": l.pid,
                "database": l.database,
                "count": group.len(),
                "locks": group.iter().take(100).map(|g| lock_json(g)).collect::<Vec<_>>(),
            }),
        });
    }
    for l in locks {
        let Some(w) = l.waiting_for.filter(|w| !l.granted && *w >= max) else {
            continue;
        };
        let blockers: Vec<String> = l
            .blockers
            .iter()
            .map(|b| match by_pid.get(b) {
                Some(bl) => format!(
                    "pid {b} ({}, {})",
                    app(bl.application_name.as_deref()),
                    if bl.hidden {
                        "state hidden".to_owned()
                    } else {
                        state_text(bl.state.as_deref(), bl.state_for)
                    }
                ),
                None => format!("pid {b}"),
            })
            .collect();
        findings.push(Finding {
            kind: "lock_waiter",
            message: format!(
                "{} has waited {} for advisory lock {} ({}){}",
                who(l),
                human(w),
                key_text(l.key),
                l.mode,
                if blockers.is_empty() {
                    String::new()
                } else {
                    format!(", blocked by {}", blockers.join(", "))
                }
            ),
            subject: lock_json(l),
        });
    }
    let mut hidden: Vec<i32> = locks
        .iter()
        .filter(|l| l.hidden && l.granted)
        .filter_map(|l| l.pid)
        .collect();
    hidden.sort_unstable();
    hidden.dedup();
    if !hidden.is_empty() {
        let n = locks.iter().filter(|l| l.hidden && l.granted).count();
        findings.push(Finding {
            kind: "hidden_sessions",
            message: format!(
                "cannot tell whether {} session{} holding {n} advisory lock{} ({}{}) are idle: this role may not see their state (grant it pg_monitor)",
                hidden.len(),
                if hidden.len() == 1 { "" } else { "s" },
                if n == 1 { "" } else { "s" },
                hidden.iter().take(10).map(|p| format!("pid {p}")).collect::<Vec<_>>().join(", "),
                if hidden.len() > 10 { ", …" } else { "" }
            ),
            subject: json!({"pids": hidden, "locks": n}),
        });
    }
    findings
}

/// What `check` says when the lease table cannot be read: missing (the
/// table or its schema: a mistyped `--table`), or not readable by this
/// role (the lock findings stand either way). `None` for other errors.
fn lease_table_finding(e: &tokio_postgres::Error, table: &str, user: &str) -> Option<Finding> {
    use tokio_postgres::error::SqlState;
    let db = e.as_db_error()?;
    let code = db.code();
    let subject = json!({"table": table, "sqlstate": code.code(), "error": db.message()});
    if *code == SqlState::UNDEFINED_TABLE || *code == SqlState::INVALID_SCHEMA_NAME {
        let what = if *code == SqlState::INVALID_SCHEMA_NAME {
            format!("no lease table {table} in this database ({})", db.message())
        } else {
            format!("no lease table {table} in this database")
        };
        return Some(Finding {
            kind: "no_lease_table",
            message: format!(
                "{what}: is --table right? (unquoted names are folded to lower case, as psql does: \"Name\" keeps its case; --no-leases checks locks only)"
            ),
            subject,
        });
    }
    if *code == SqlState::INSUFFICIENT_PRIVILEGE {
        let role = crate::quote_ident(user);
        let (schema, _) = table.split_once('.').unwrap_or(("public", table));
        let fix = if db.message().contains("schema") {
            format!(
                "GRANT USAGE ON SCHEMA {} TO {role}; GRANT SELECT ON {} TO {role}",
                crate::quote_ident(schema),
                crate::quoted_table(table)
            )
        } else {
            format!("GRANT SELECT ON {} TO {role}", crate::quoted_table(table))
        };
        return Some(Finding {
            kind: "lease_table_unreadable",
            message: format!(
                "cannot read lease table {table}: {} ({}); the leases were not checked: {fix} (or --no-leases to check locks only)",
                db.message(),
                code.code()
            ),
            subject,
        });
    }
    None
}

/// A term's TTL, and whether it is guessed: the stored one
/// ([`LeaseRow::ttl`]), else taken_at to expires_at (right for a term never
/// renewed, too long for one renewed many times).
fn term_ttl(r: &LeaseRow) -> (Duration, bool) {
    if let Some(ttl) = r.ttl {
        return (ttl, false);
    }
    let guess = r
        .taken_at
        .elapsed()
        .ok()
        .map(|since| since.as_secs_f64() + r.expires_in_s)
        .unwrap_or(0.0)
        .max(0.0);
    (Duration::try_from_secs_f64(guess).unwrap_or_default(), true)
}

pub(crate) async fn check(
    pool: &Pool,
    leases: &pgwarden::Leases,
    args: &CheckArgs,
    table_name: &str,
    user: &str,
    server: crate::connect::Server,
) -> Result<u8, Failure> {
    let max = args.max_idle_lock;
    let mut locks = read_locks(pool).await?;
    let mut unknown = None;
    if let Some(db) = &args.database {
        locks.retain(|l| l.database.as_deref() == Some(db.as_str()));
        unknown = unknown_database(pool, db).await?.map(|why| Finding {
            kind: "unknown_database",
            message: format!("--database: {why}; its advisory locks were not checked"),
            subject: json!({"database": db}),
        });
    }
    let mut findings = lock_findings(&locks, max);
    findings.extend(unknown);
    if let Some(s) = standby(pool, server).await? {
        let note = s.locks_note();
        findings.push(Finding {
            kind: "standby",
            subject: s.json(&note),
            message: note,
        });
    }
    let rows = if args.no_leases {
        Vec::new()
    } else {
        match leases.rows().await {
            Ok(rows) => rows,
            Err(pgwarden::Error::Db(e)) => match lease_table_finding(&e, table_name, user) {
                Some(f) => {
                    findings.push(f);
                    Vec::new()
                }
                None => return Err(pgwarden::Error::Db(e).into()),
            },
            Err(e) => return Err(e.into()),
        }
    };
    for r in &rows {
        if !r.live && r.blocker_pid.is_some() {
            findings.push(Finding {
                kind: "blocked_lease",
                message: format!(
                    "lease {:?}: take-over blocked by a row lock of {} (expired {}, holder {})",
                    r.name,
                    blocked_text(r),
                    human_signed(r.expires_in_s),
                    if r.holder.is_empty() {
                        "released"
                    } else {
                        &r.holder
                    }
                ),
                subject: lease_json(r),
            });
        }
        // A holder that neither released nor renewed it, and nobody took
        // it over: expired for longer than its TTL, at most
        // --max-idle-lock.
        let held = r
            .held_until
            .is_some_and(|h| h > std::time::SystemTime::now());
        let (ttl, guessed) = term_ttl(r);
        if !r.live && !r.holder.is_empty() && !held && -r.expires_in_s > ttl.min(max).as_secs_f64()
        {
            findings.push(Finding {
                kind: "unclaimed_lease",
                message: format!(
                    "lease {:?} expired {} and nobody took it over (last holder {}, token {}){}",
                    r.name,
                    human_signed(r.expires_in_s),
                    r.holder,
                    r.token,
                    if guessed {
                        format!(
                            "; its TTL is not stored (a table or a holder of a pgwarden before renewed_at): guessed as {}",
                            human(ttl)
                        )
                    } else {
                        String::new()
                    }
                ),
                subject: lease_json(r),
            });
        }
    }
    if args.json {
        let all: Vec<Value> = findings
            .iter()
            .map(|f| json!({"kind": f.kind, "message": f.message, "subject": f.subject}))
            .collect();
        println!("{}", Value::Array(all));
    } else if findings.is_empty() {
        if !args.quiet {
            println!("ok: no findings");
        }
    } else {
        for f in &findings {
            println!("{}: {}", f.kind, f.message);
        }
    }
    Ok(if findings.is_empty() { 0 } else { 1 })
}

pub(crate) async fn revoke(leases: &pgwarden::Leases, args: &RevokeArgs) -> Result<u8, Failure> {
    if !args.yes {
        let row = leases
            .rows()
            .await?
            .into_iter()
            .find(|r| r.name == args.name && !r.holder.is_empty());
        return match row {
            Some(r) => {
                println!(
                    "would revoke lease {:?}: holder {}, token {} ({}); run again with --yes",
                    r.name,
                    r.holder,
                    r.token,
                    if r.live {
                        format!("live, expires {}", human_signed(r.expires_in_s))
                    } else {
                        format!("expired {}", human_signed(r.expires_in_s))
                    }
                );
                Ok(0)
            }
            None => Err(nothing_to_revoke(leases, &args.name).await),
        };
    }
    let outcome = leases.revoke(&args.name).await?;
    if outcome.is_none() {
        return Err(nothing_to_revoke(leases, &args.name).await);
    }
    match outcome {
        Some(r) => {
            println!(
                "revoked lease {:?}: holder {}, token {}; its fence is refused from now on, it learns of the loss at its next renewal, and the name is free once the term expires",
                r.name, r.holder, r.token
            );
            Ok(0)
        }
        None => Ok(1), // returned above
    }
}

/// Why there is nothing to revoke: no such lease, one revoked already (its
/// term still running out), or one released.
async fn nothing_to_revoke(leases: &pgwarden::Leases, name: &str) -> Failure {
    let row = match leases.rows().await {
        Ok(rows) => rows.into_iter().find(|r| r.name == name),
        Err(_) => None,
    };
    let message = match row {
        None => format!("no lease {name:?} in the table: nothing to revoke"),
        Some(r) => format!(
            "lease {name:?} has no holder: nothing to revoke (token {}: {})",
            r.token,
            expiry_text(&r)
        ),
    };
    Failure { code: 1, message }
}
