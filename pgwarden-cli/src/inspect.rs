//! The read side and the operator's hand: `leases`, `locks`, `check`,
//! `revoke`, `ddl`.

use std::collections::HashMap;
use std::io::Write as _;
use std::time::Duration;

use pgwarden::lease::LeaseRow;
use pgwarden::{LockKey, LockMode, Namespace, Pool};
use serde_json::{json, Value};

use crate::format::{human, human_signed, rfc3339, table};
use crate::{CheckArgs, Failure, ListArgs, RevokeArgs};

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

/// Prints `draw()`'s output once, or every `watch` (redrawn in place) until
/// SIGINT.
async fn show<F, Fut>(watch: Option<Duration>, mut draw: F) -> Result<u8, Failure>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<String, Failure>>,
{
    let Some(every) = watch else {
        print!("{}", draw().await?);
        return Ok(0);
    };
    loop {
        let text = draw().await?;
        // Home, clear to the end of the screen, then the table.
        print!("\x1b[H\x1b[2J{text}");
        let _ = std::io::stdout().flush();
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = tokio::signal::ctrl_c() => return Ok(0),
        }
    }
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

fn lease_json(r: &LeaseRow) -> Value {
    json!({
        "name": r.name,
        "holder": r.holder,
        "token": r.token,
        "taken_at": rfc3339(r.taken_at),
        "expires_in_s": r.expires_in_s,
        "live": r.live,
        "held_until": r.held_until.map(rfc3339),
        "prev_holder": r.prev_holder,
        "blocked_by": blocked_by(r),
    })
}

pub(crate) async fn leases(leases: &pgwarden::Leases, args: &ListArgs) -> Result<u8, Failure> {
    show(args.watch, || async {
        let rows = leases.rows().await?;
        if args.json {
            let all: Vec<Value> = rows.iter().map(lease_json).collect();
            return Ok(format!("{}\n", Value::Array(all)));
        }
        let cells: Vec<Vec<String>> = rows
            .iter()
            .map(|r| {
                vec![
                    r.name.clone(),
                    if r.holder.is_empty() {
                        "(released)".to_owned()
                    } else {
                        r.holder.clone()
                    },
                    r.token.to_string(),
                    rfc3339(r.taken_at),
                    if r.live {
                        format!("live, expires {}", human_signed(r.expires_in_s))
                    } else {
                        format!("expired {}", human_signed(r.expires_in_s))
                    },
                    r.held_until.map(rfc3339).unwrap_or_default(),
                    blocked_text(r),
                ]
            })
            .collect();
        Ok(table(
            &[
                "NAME",
                "HOLDER",
                "TOKEN",
                "TAKEN AT",
                "EXPIRY",
                "HELD UNTIL",
                "BLOCKED BY",
            ],
            &cells,
        ))
    })
    .await
}

/// One advisory lock, with what the census does not carry.
struct Lock {
    key: LockKey,
    mode: LockMode,
    granted: bool,
    pid: Option<i32>,
    application_name: Option<String>,
    state: Option<String>,
    client_addr: Option<String>,
    state_for: Option<Duration>,
    /// For a held lock: the backends waiting for it.
    waiting_pids: Vec<i32>,
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

/// The census, and for its sessions the client address and state age, and
/// for each lock its waiters (`pg_blocking_pids`), read in the same breath.
async fn read_locks(pool: &Pool) -> Result<Vec<Lock>, Failure> {
    let census = pool.census().await?;
    let client = pool.get().await.map_err(pgwarden::Error::from)?;
    let pids: Vec<i32> = census.locks.iter().filter_map(|l| l.pid).collect();
    let sessions: HashMap<i32, (Option<String>, Option<f64>)> = client
        .query(
            "SELECT pid, host(client_addr),
                    greatest(extract(epoch FROM clock_timestamp() - state_change), 0)::float8
               FROM pg_stat_activity WHERE pid = ANY($1)",
            &[&pids],
        )
        .await
        .map_err(pgwarden::Error::from)?
        .iter()
        .map(|r| Ok((r.try_get(0)?, (r.try_get(1)?, r.try_get(2)?))))
        .collect::<Result<_, tokio_postgres::Error>>()
        .map_err(pgwarden::Error::from)?;
    // Waiters: (key, waiter pid) → (its blockers, how long it has waited).
    let mut waiters: HashMap<(LockKey, i32), (Vec<i32>, Option<f64>)> = HashMap::new();
    for r in client
        .query(
            "SELECT pid, classid::int8, objid::int8, objsubid::int4, pg_blocking_pids(pid),
                    greatest(extract(epoch FROM clock_timestamp() - waitstart), 0)::float8
               FROM pg_locks
              WHERE locktype = 'advisory' AND NOT granted AND pid IS NOT NULL
                AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            &[],
        )
        .await
        .map_err(pgwarden::Error::from)?
    {
        let get = || -> Result<_, tokio_postgres::Error> {
            let (classid, objid, sub): (i64, i64, i32) =
                (r.try_get(1)?, r.try_get(2)?, r.try_get(3)?);
            let key = if sub == 1 {
                LockKey::Single(((classid as u64) << 32 | objid as u64) as i64)
            } else {
                LockKey::Pair(classid as u32 as i32, objid as u32 as i32)
            };
            Ok((
                key,
                r.try_get::<_, i32>(0)?,
                r.try_get::<_, Vec<i32>>(4)?,
                r.try_get::<_, Option<f64>>(5)?,
            ))
        };
        let (key, pid, blockers, waited) = get().map_err(pgwarden::Error::from)?;
        waiters.insert((key, pid), (blockers, waited));
    }
    Ok(census
        .locks
        .into_iter()
        .map(|l| {
            let (client_addr, state_for) = l
                .pid
                .and_then(|p| sessions.get(&p).cloned())
                .unwrap_or_default();
            let waiting_pids = match (l.granted, l.pid) {
                (true, Some(pid)) => {
                    let mut w: Vec<i32> = waiters
                        .iter()
                        .filter(|((k, _), (blockers, _))| *k == l.key && blockers.contains(&pid))
                        .map(|((_, waiter), _)| *waiter)
                        .collect();
                    w.sort_unstable();
                    w
                }
                _ => Vec::new(),
            };
            let waiting_for = match (l.granted, l.pid) {
                (false, Some(pid)) => waiters.get(&(l.key, pid)).and_then(|(_, s)| secs(*s)),
                _ => None,
            };
            Lock {
                key: l.key,
                mode: l.mode,
                granted: l.granted,
                pid: l.pid,
                application_name: l.application_name,
                state: l.state,
                client_addr,
                state_for: secs(state_for),
                waiting_pids,
                waiting_for,
            }
        })
        .collect())
}

fn lock_json(l: &Lock) -> Value {
    let (classid, objid, objsubid) = raw(l.key);
    json!({
        "key": key_text(l.key),
        "classid": classid,
        "objid": objid,
        "objsubid": objsubid,
        "mode": l.mode.to_string(),
        "granted": l.granted,
        "pid": l.pid,
        "application_name": l.application_name,
        "client_addr": l.client_addr,
        "state": l.state,
        "state_for_s": l.state_for.map(|d| d.as_secs_f64()),
        "waiting_pids": l.waiting_pids,
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

pub(crate) async fn locks(pool: &Pool, args: &ListArgs) -> Result<u8, Failure> {
    show(args.watch, || async {
        let locks = read_locks(pool).await?;
        if args.json {
            let all: Vec<Value> = locks.iter().map(lock_json).collect();
            return Ok(format!("{}\n", Value::Array(all)));
        }
        let cells: Vec<Vec<String>> = locks
            .iter()
            .map(|l| {
                vec![
                    key_text(l.key),
                    l.mode.to_string(),
                    match l.waiting_for {
                        _ if l.granted => "held".to_owned(),
                        Some(w) => format!("waiting {}", human(w)),
                        None => "waiting".to_owned(),
                    },
                    l.pid.map(|p| p.to_string()).unwrap_or_default(),
                    app(l.application_name.as_deref()).to_owned(),
                    l.client_addr.clone().unwrap_or_else(|| "local".to_owned()),
                    state_text(l.state.as_deref(), l.state_for),
                    l.waiting_pids
                        .iter()
                        .map(|p| p.to_string())
                        .collect::<Vec<_>>()
                        .join(","),
                ]
            })
            .collect();
        Ok(table(
            &[
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
        ))
    })
    .await
}

/// One finding of `check`.
struct Finding {
    kind: &'static str,
    message: String,
    subject: Value,
}

pub(crate) async fn check(
    pool: &Pool,
    leases: &pgwarden::Leases,
    args: &CheckArgs,
) -> Result<u8, Failure> {
    let max = args.max_idle_lock;
    let mut findings = Vec::new();
    for l in read_locks(pool).await? {
        let idle = l.state.as_deref().is_some_and(|s| s.starts_with("idle"));
        let pid = l.pid.map(|p| p.to_string()).unwrap_or_else(|| "?".into());
        let who = format!(
            "pid {pid} ({}, {})",
            app(l.application_name.as_deref()),
            l.client_addr.as_deref().unwrap_or("local")
        );
        if l.granted && idle && l.state_for.is_some_and(|d| d >= max) {
            findings.push(Finding {
                kind: "idle_lock",
                message: format!(
                    "advisory lock {} ({}) held by {who}, {}",
                    key_text(l.key),
                    l.mode,
                    state_text(l.state.as_deref(), l.state_for)
                ),
                subject: lock_json(&l),
            });
        }
        if let Some(w) = l.waiting_for.filter(|w| !l.granted && *w >= max) {
            findings.push(Finding {
                kind: "lock_waiter",
                message: format!(
                    "{who} has waited {} for advisory lock {} ({})",
                    human(w),
                    key_text(l.key),
                    l.mode
                ),
                subject: lock_json(&l),
            });
        }
    }
    let rows = match leases.rows().await {
        Ok(rows) => rows,
        // No lease table: no lease to find anything about.
        Err(pgwarden::Error::Db(e))
            if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) =>
        {
            Vec::new()
        }
        Err(e) => return Err(e.into()),
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
        // it over: expired for longer than its TTL (taken_at to expires_at
        // when it was never renewed), at most --max-idle-lock.
        let held = r
            .held_until
            .is_some_and(|h| h > std::time::SystemTime::now());
        let ttl = r
            .taken_at
            .elapsed()
            .ok()
            .map(|since| since.as_secs_f64() + r.expires_in_s)
            .unwrap_or(0.0)
            .max(0.0);
        let ttl = Duration::try_from_secs_f64(ttl)
            .unwrap_or_default()
            .min(max);
        if !r.live && !r.holder.is_empty() && !held && -r.expires_in_s > ttl.as_secs_f64() {
            findings.push(Finding {
                kind: "unclaimed_lease",
                message: format!(
                    "lease {:?} expired {} and nobody took it over (last holder {}, token {})",
                    r.name,
                    human_signed(r.expires_in_s),
                    r.holder,
                    r.token
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
        println!("ok: no findings");
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
            None => Err(Failure {
                code: 1,
                message: format!("lease {:?} has no holder: nothing to revoke", args.name),
            }),
        };
    }
    match leases.revoke(&args.name).await? {
        Some(r) => {
            println!(
                "revoked lease {:?}: holder {}, token {}; its fence is refused from now on, and it learns of the loss at its next renewal",
                r.name, r.holder, r.token
            );
            Ok(0)
        }
        None => Err(Failure {
            code: 1,
            message: format!("lease {:?} has no holder: nothing to revoke", args.name),
        }),
    }
}
