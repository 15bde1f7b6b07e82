//! Workloads 4b and 4c: pgwarden's leases against the plain lease SQL, the
//! statements a service writes by hand without fencing:
//!
//! - acquire: `INSERT … ON CONFLICT (name) DO UPDATE … WHERE leases.expires_at < now() RETURNING true`
//! - release: `DELETE FROM leases WHERE name = $1 AND holder = $2`
//!
//! sent the way a user of deadpool would: prepared and cached per connection
//! (`prepare_cached`) on a direct pool, and unnamed (`query_typed`, parsed and
//! planned on every call, what a transaction pooler allows) through a real
//! PgBouncer in transaction mode. pgwarden runs on its shipped defaults on a
//! pool detected direct (its statements prepared once per connection), and on
//! one detected behind the same kind of PgBouncer (unnamed).
//!
//! 4b: acquire + release, a new name per pair. 4c: attempts on names held by
//! another holder (what every instance's scheduler does at each poll).
//! Each side has its own database on the one server, so the CPU time of its
//! backends (`/proc/<pid>/stat`) divided by the statements it sent is the
//! server-side cost per statement. Rounds of all four sides interleave, the
//! order rotating from round to round.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgwarden::{Lane, LeaseOptions, Leases, Pool, PoolerMode};
use pgwarden_testing::{PgBouncer, TestDb, TestServer};
use tokio_postgres::types::Type;

use crate::ab::{median, ratio, throughput, Compared};
use crate::renewal::Cpu;
use crate::{BoxError, Row, Settings};

const TASKS: usize = 16;
const POOL: usize = 16;
const TTL: Duration = Duration::from_secs(60);
/// Names held by another holder, for 4c: 64, or `PGWARDEN_BENCH_HELD`
/// (issue 30's case of many tasks on one held name runs it with 1).
fn held_names() -> usize {
    std::env::var("PGWARDEN_BENCH_HELD")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or(64)
}

pub(crate) const PLAIN_DDL: &str =
    "CREATE TABLE leases (name text PRIMARY KEY, holder text NOT NULL, \
     taken_at timestamptz NOT NULL DEFAULT now(), expires_at timestamptz NOT NULL)";
pub(crate) const PLAIN_ACQUIRE: &str = "INSERT INTO leases (name, holder, taken_at, expires_at) \
     VALUES ($1, $2, now(), now() + make_interval(secs => $3)) ON CONFLICT (name) DO UPDATE \
     SET holder = excluded.holder, taken_at = excluded.taken_at, expires_at = excluded.expires_at \
     WHERE leases.expires_at < now() RETURNING true";
pub(crate) const PLAIN_RELEASE: &str = "DELETE FROM leases WHERE name = $1 AND holder = $2";

pub fn describe(s: Settings) -> String {
    format!(
        "4b, 4c: {TASKS} tasks, pool {POOL} per side, four sides with a database each on one server: \
         the plain lease SQL through deadpool, prepared (`prepare_cached`) on a direct pool and unnamed (`query_typed`) \
         through PgBouncer ({TASKS} server connections, transaction mode), \
         pgwarden on its shipped defaults on a pool detected direct (prepared) and on one detected \
         behind PgBouncer (unnamed), and (not a default, in the notes) with the lease lane raised to {TASKS}; 4b a new name per pair, TTL {TTL:?}; 4c attempts cycling over {} names held \
         by another holder; {} rounds of {:?} per side, the order rotating; server CPU per statement \
         = utime + stime of the side's client backends (`/proc/<pid>/stat`) / statements sent",
        held_names(),
        s.rounds * 4,
        s.round / 2
    )
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Prepared,
    Unnamed,
}

/// The plain lease SQL on a raw deadpool pool.
pub(crate) struct Plain {
    pub(crate) pool: deadpool_postgres::Pool,
    pub(crate) mode: Mode,
}

impl Plain {
    pub(crate) async fn acquire(&self, name: &str, holder: &str) -> Result<bool, BoxError> {
        let conn = self.pool.get().await?;
        let ttl = TTL.as_secs_f64();
        let row = match self.mode {
            Mode::Prepared => {
                let stmt = conn.prepare_cached(PLAIN_ACQUIRE).await?;
                conn.query_opt(&stmt, &[&name, &holder, &ttl]).await?
            }
            Mode::Unnamed => {
                conn.query_typed_opt(
                    PLAIN_ACQUIRE,
                    &[
                        (&name, Type::TEXT),
                        (&holder, Type::TEXT),
                        (&ttl, Type::FLOAT8),
                    ],
                )
                .await?
            }
        };
        Ok(row.is_some())
    }

    pub(crate) async fn release(&self, name: &str, holder: &str) -> Result<bool, BoxError> {
        let conn = self.pool.get().await?;
        let n = match self.mode {
            Mode::Prepared => {
                let stmt = conn.prepare_cached(PLAIN_RELEASE).await?;
                conn.execute(&stmt, &[&name, &holder]).await?
            }
            Mode::Unnamed => {
                conn.execute_typed(PLAIN_RELEASE, &[(&name, Type::TEXT), (&holder, Type::TEXT)])
                    .await?
            }
        };
        Ok(n == 1)
    }
}

pub(crate) fn holder() -> String {
    format!(
        "bench:{}:{:016x}",
        std::process::id(),
        rand::random::<u64>()
    )
}

type Op = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// One side: its operation, its database's CPU sampler, and a count of the
/// statements it sent.
struct Side {
    label: &'static str,
    op: Op,
    cpu: Cpu,
    statements: Box<dyn Fn() -> u64 + Send + Sync>,
}

struct Measured {
    rates: Vec<f64>,
    /// Server CPU per statement, µs.
    cpu_us: f64,
    /// This process's CPU (user + system) per operation while the side ran, µs.
    client_us: f64,
    per_op: f64,
}

/// Rounds of every side, the order rotating; each side's rates, and its
/// server CPU per statement over all its rounds.
async fn measure(sides: &[Side], s: Settings) -> Result<Vec<Measured>, BoxError> {
    let warm = Duration::from_millis(300);
    for side in sides {
        let op = side.op.clone();
        throughput(TASKS, warm, move || op()).await;
    }
    let mut before = Vec::new();
    for side in sides {
        before.push((side.cpu.sample().await?, (side.statements)()));
    }
    // Four times the rounds at half the length: more pairs for the median,
    // on a machine whose load changes from second to second. 28 pairs give
    // a 96 % confidence interval of the median pair ratio from the 9th to
    // the 20th ratio; 14 gave one from the 3rd to the 12th (98.7 %, the
    // next narrower being under 95 %), wider than the pairs' quartiles.
    let (rounds, round) = (s.rounds * 4, s.round / 2);
    let mut rates = vec![Vec::new(); sides.len()];
    let mut client = vec![0.0; sides.len()];
    for n in 0..rounds {
        for k in 0..sides.len() {
            let i = (n + k) % sides.len();
            let op = sides[i].op.clone();
            let c0 = own_cpu();
            rates[i].push(throughput(TASKS, round, move || op()).await);
            client[i] += own_cpu() - c0;
        }
    }
    let mut out = Vec::new();
    for (((side, (cpu0, st0)), rates), client) in sides.iter().zip(before).zip(rates).zip(client) {
        let cpu = Cpu::delta(&cpu0, &side.cpu.sample().await?);
        let statements = (side.statements)() - st0;
        let ops: f64 = rates.iter().sum::<f64>() * round.as_secs_f64();
        out.push(Measured {
            cpu_us: cpu * 1e6 / statements.max(1) as f64,
            per_op: statements as f64 / ops.max(1.0),
            client_us: client * 1e6 / ops.max(1.0),
            rates,
        });
        let _ = side.label;
    }
    Ok(out)
}

/// CPU seconds (user + system) this process has used: the client side of
/// the side that runs alone in a round.
pub(crate) fn own_cpu() -> f64 {
    crate::renewal::cpu_ticks("/proc/self/stat").unwrap_or(0) as f64
        / crate::renewal::clock_ticks() as f64
}

/// What a side keeps alive while it runs: its database, and the PgBouncer
/// in front of it when it has one.
type Kept = (TestDb, Option<PgBouncer>);

/// A PgBouncer in transaction mode in front of `db`, with a server
/// connection for each task.
fn bouncer(server: &TestServer, db: &TestDb) -> Result<PgBouncer, BoxError> {
    Ok(PgBouncer::start_with_pool_size(server, db, TASKS)?)
}

/// The plain lease SQL: prepared on a direct pool, or unnamed through
/// PgBouncer (transaction mode), what a user behind a pooler sends.
async fn plain_side(
    server: &TestServer,
    mode: Mode,
    label: &'static str,
    held: bool,
) -> Result<(Side, Kept), BoxError> {
    let db = server.create_database().await?;
    let bouncer = match mode {
        Mode::Prepared => None,
        Mode::Unnamed => Some(bouncer(server, &db)?),
    };
    let pool = match &bouncer {
        None => db.deadpool(POOL)?,
        Some(b) => b.deadpool(POOL)?,
    };
    let conn = db.connect().await?;
    conn.batch_execute(PLAIN_DDL).await?;
    if held {
        conn.execute(
            "INSERT INTO leases (name, holder, expires_at)
             SELECT 'held-' || i, 'another-holder', now() + interval '1 hour' FROM generate_series(0, $1 - 1) i",
            &[&(held_names() as i32)],
        )
        .await?;
    }
    drop(conn);
    let plain = Arc::new(Plain { pool, mode });
    let sent = Arc::new(AtomicU64::new(0));
    let next = Arc::new(AtomicU64::new(0));
    let op: Op = {
        let (plain, sent) = (plain.clone(), sent.clone());
        Arc::new(move || {
            let (plain, sent, next) = (plain.clone(), sent.clone(), next.clone());
            Box::pin(async move {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if held {
                    let name = format!("held-{}", n % held_names() as u64);
                    let took = plain
                        .acquire(&name, &holder())
                        .await
                        .expect("plain attempt");
                    assert!(!took, "a held name is busy");
                    sent.fetch_add(1, Ordering::Relaxed);
                } else {
                    let (name, holder) = (format!("p-{n}"), holder());
                    assert!(plain.acquire(&name, &holder).await.expect("plain acquire"));
                    assert!(plain.release(&name, &holder).await.expect("plain release"));
                    sent.fetch_add(2, Ordering::Relaxed);
                }
            })
        })
    };
    let cpu = Cpu::new(server.create_database().await?.connect().await?, db.name());
    let side = Side {
        label,
        op,
        cpu,
        statements: Box::new(move || sent.load(Ordering::Relaxed)),
    };
    Ok((side, (db, bouncer)))
}

/// pgwarden on its shipped defaults, its pooler detected: direct, or
/// through PgBouncer (transaction mode) when `behind_bouncer`.
async fn warden_side(
    server: &TestServer,
    behind_bouncer: bool,
    lease_lane: Option<usize>,
    label: &'static str,
    held: bool,
) -> Result<(Side, Kept), BoxError> {
    let db = server.create_database().await?;
    let bouncer = if behind_bouncer {
        Some(bouncer(server, &db)?)
    } else {
        None
    };
    let inner = match &bouncer {
        None => db.deadpool(POOL)?,
        Some(b) => b.deadpool(POOL)?,
    };
    // The shipped defaults (a pool of 16: at most 8 lease statements out at
    // once), unless `lease_lane` says otherwise; a side that changes it says
    // so in its label.
    let mut builder = Pool::builder(inner).name(label);
    if let Some(max) = lease_lane {
        builder = builder.lane(Lane::Lease, 0, max);
    }
    let pool = builder.build()?;
    let want = if behind_bouncer {
        PoolerMode::Transaction
    } else {
        PoolerMode::Direct
    };
    let found = pool.detect_pooler().await?;
    if found != want {
        return Err(format!("side {label}: pooler detected {found:?}, expected {want:?}").into());
    }
    let leases = Leases::new(&pool);
    leases.install().await?;
    if held {
        db.connect()
            .await?
            .execute(
                "INSERT INTO pgwarden_leases (name, holder, token, expires_at)
                 SELECT 'held-' || i, 'another-holder', nextval('pgwarden_leases_token_seq'), now() + interval '1 hour'
                   FROM generate_series(0, $1 - 1) i",
                &[&(held_names() as i32)],
            )
            .await?;
    }
    let next = Arc::new(AtomicU64::new(0));
    let op: Op = {
        let leases = leases.clone();
        Arc::new(move || {
            let (leases, next) = (leases.clone(), next.clone());
            Box::pin(async move {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if held {
                    let name = format!("held-{}", n % held_names() as u64);
                    let got = leases
                        .acquire(&name, &LeaseOptions::new(TTL), None)
                        .await
                        .expect("pgwarden attempt");
                    assert!(got.is_none(), "a held name is busy");
                } else {
                    let lease = leases
                        .acquire(&format!("p-{n}"), &LeaseOptions::new(TTL), None)
                        .await
                        .expect("pgwarden acquire")
                        .expect("a new name is free");
                    lease.release().await.expect("pgwarden release");
                }
            })
        })
    };
    let cpu = Cpu::new(server.create_database().await?.connect().await?, db.name());
    let side = Side {
        label,
        op,
        cpu,
        statements: Box::new(move || leases.stats().statements),
    };
    Ok((side, (db, bouncer)))
}

/// Rows 4b (`held` false) and 4c (`held` true).
pub async fn against_plain(server: &TestServer, s: Settings, held: bool) -> Result<Row, BoxError> {
    let (prepared, _d1) = plain_side(server, Mode::Prepared, "plain prepared", held).await?;
    let (unnamed, _d2) = plain_side(server, Mode::Unnamed, "plain unnamed", held).await?;
    let (warden, _d3) = warden_side(server, false, None, "bench-direct", held).await?;
    let (warden_unnamed, _d4) = warden_side(server, true, None, "bench-pgbouncer", held).await?;
    let (warden_lane, _d5) =
        warden_side(server, false, Some(TASKS), "bench-lease-lane-16", held).await?;
    let m = measure(&[prepared, unnamed, warden, warden_unnamed, warden_lane], s).await?;
    let (p, u, w, wu, wl) = (&m[0], &m[1], &m[2], &m[3], &m[4]);
    let c = Compared::new(&p.rates, &w.rates);
    let unit = if held { "attempts/s" } else { "pairs/s" };
    let side = |x: &Measured| {
        format!(
            "{:.0} {unit}, {:.0} µs server CPU/statement, {:.0} µs client CPU/op, {:.2} statements/op",
            median(&x.rates),
            x.cpu_us,
            x.client_us,
            x.per_op
        )
    };
    Ok(Row {
        id: if held { "4c" } else { "4b" },
        workload: if held {
            format!("attempts on names held by another holder, {TASKS} tasks, pool {POOL}: pgwarden vs the plain lease SQL (INSERT … ON CONFLICT … DO UPDATE … WHERE expires_at < now())")
        } else {
            format!("lease acquire + release, new name per pair, {TASKS} tasks, pool {POOL}: pgwarden vs the plain lease SQL (INSERT … ON CONFLICT … / DELETE)")
        },
        a: format!("plain SQL prepared: {}; unnamed through PgBouncer: {}", side(p), side(u)),
        b: format!(
            "pgwarden, shipped defaults, direct (prepared): {}; through PgBouncer (unnamed): {}",
            side(w),
            side(wu)
        ),
        ratio: format!("{:.3}", c.pairs),
        target: "≥ 1.0 (prepared vs prepared)",
        met: (!s.smoke).then(|| c.at_least(1.0)).flatten(),
        notes: format!(
            "{}; through PgBouncer, unnamed vs unnamed {:.3}; pgwarden prepared vs plain unnamed {:.3}; \
             not a default, the lease lane raised to {TASKS}: {} ({:.3} vs plain prepared)",
            c.spread(),
            ratio(&u.rates, &wu.rates),
            ratio(&u.rates, &w.rates),
            side(wl),
            ratio(&p.rates, &wl.rates)
        ),
    })
}
