//! Workloads 6a and 6b: the cost of one lease statement where gathering
//! cannot help (issue 30, point 6). Each instance runs one task that
//! acquires and releases a new name, so no two of its statements are ever
//! out at once: every acquisition and every release is a statement of its
//! own, pgwarden's against the seed's SQL (the plain lease SQL of rows 4b
//! and 4c, `INSERT … ON CONFLICT … DO UPDATE … WHERE expires_at < now()` /
//! `DELETE`), prepared and cached per connection.
//!
//! - 6a: one instance, one task.
//! - 6b: 16 instances, one task each (a fleet of processes: each its own
//!   pool, and for pgwarden its own `Leases`), all on one table.
//!
//! Each side has its own database on the one server; rounds of the two
//! sides interleave (A B, B A, …). Server CPU per statement is the CPU
//! time of the side's client backends (`/proc/<pid>/stat`) over the
//! statements it sent; client CPU per pair is this process's CPU while the
//! side ran, over its pairs.
//!
//! `--profile-single plain|pgwarden PAIRS [INSTANCES]` runs one side (one
//! instance, or as many as asked, a task each) for a fixed number of pairs
//! (for `perf stat` or callgrind) and prints the server's WAL bytes per
//! pair.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgwarden::{LeaseOptions, Leases, Pool, PoolerMode};
use pgwarden_testing::{TestDb, TestServer};

use crate::ab::{median, Compared};
use crate::plain::{holder, own_cpu, Mode, Plain, PLAIN_DDL};
use crate::renewal::Cpu;
use crate::{BoxError, Row, Settings};

/// Instances of row 6b.
const FLEET: usize = 16;
/// Each instance's pool (a small service's).
const POOL: usize = 4;
const TTL: Duration = Duration::from_secs(60);
/// pgwarden's pairs per second against the seed's SQL prepared, at least.
const TARGET: f64 = 0.9;

pub fn describe(s: Settings) -> String {
    format!(
        "6a, 6b: one task per instance acquiring and releasing a new name (TTL {TTL:?}), so that no \
         statement is ever gathered: 6a one instance, 6b {FLEET} instances on one table, each its own \
         pool of {POOL} (pgwarden: its own `Leases`, shipped defaults, the pool detected direct; the \
         seed's SQL through deadpool, prepared with `prepare_cached`); a database per side on one \
         server; {} rounds of {:?} per side, interleaved (A B, B A, …); server CPU per statement = \
         utime + stime of the side's client backends (`/proc/<pid>/stat`; those that connect during \
         the rounds too) / statements sent; client CPU per pair = this process's CPU while the side ran / its pairs",
        s.rounds * 4,
        s.round / 2
    )
}

type Op = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// One side: an operation per instance, the sampler of its database's
/// backends, and its count of statements sent.
struct Side {
    ops: Vec<Op>,
    cpu: Cpu,
    statements: Box<dyn Fn() -> u64 + Send + Sync>,
    _db: TestDb,
}

/// The seed's SQL, prepared, on `instances` deadpool pools of one database.
async fn plain_side(server: &TestServer, instances: usize) -> Result<Side, BoxError> {
    let db = server.create_database().await?;
    db.connect().await?.batch_execute(PLAIN_DDL).await?;
    let sent = Arc::new(AtomicU64::new(0));
    let next = Arc::new(AtomicU64::new(0));
    let mut ops: Vec<Op> = Vec::new();
    for _ in 0..instances {
        let plain = Arc::new(Plain {
            pool: db.deadpool(POOL)?,
            mode: Mode::Prepared,
        });
        let (sent, next) = (sent.clone(), next.clone());
        ops.push(Arc::new(move || {
            let (plain, sent, next) = (plain.clone(), sent.clone(), next.clone());
            Box::pin(async move {
                let n = next.fetch_add(1, Ordering::Relaxed);
                let (name, holder) = (format!("s-{n}"), holder());
                assert!(plain.acquire(&name, &holder).await.expect("plain acquire"));
                assert!(plain.release(&name, &holder).await.expect("plain release"));
                sent.fetch_add(2, Ordering::Relaxed);
            })
        }));
    }
    let cpu = Cpu::new(server.create_database().await?.connect().await?, db.name());
    Ok(Side {
        ops,
        cpu,
        statements: Box::new(move || sent.load(Ordering::Relaxed)),
        _db: db,
    })
}

/// pgwarden on its shipped defaults: `instances` pools, each with its own
/// `Leases`, on one database (one lease table).
async fn warden_side(server: &TestServer, instances: usize) -> Result<Side, BoxError> {
    let db = server.create_database().await?;
    let next = Arc::new(AtomicU64::new(0));
    let mut ops: Vec<Op> = Vec::new();
    let mut all = Vec::new();
    for i in 0..instances {
        let pool = Pool::builder(db.deadpool(POOL)?)
            .name(format!("bench-single-{i}"))
            .build()?;
        let found = pool.detect_pooler().await?;
        if found != PoolerMode::Direct {
            return Err(format!("pooler detected {found:?}, expected Direct").into());
        }
        // `PGWARDEN_BENCH_NO_PURGE=1` (profiling only, not a row): no
        // purge, so that no pool opens a second connection.
        let leases = if std::env::var_os("PGWARDEN_BENCH_NO_PURGE").is_some() {
            Leases::builder(&pool)
                .purge(Duration::from_secs(3600), None)
                .build()?
        } else {
            Leases::new(&pool)
        };
        leases.install().await?;
        all.push(leases.clone());
        let next = next.clone();
        ops.push(Arc::new(move || {
            let (leases, next) = (leases.clone(), next.clone());
            Box::pin(async move {
                let n = next.fetch_add(1, Ordering::Relaxed);
                let lease = leases
                    .acquire(&format!("s-{n}"), &LeaseOptions::new(TTL), None)
                    .await
                    .expect("pgwarden acquire")
                    .expect("a new name is free");
                lease.release().await.expect("pgwarden release");
            })
        }));
    }
    let cpu = Cpu::new(server.create_database().await?.connect().await?, db.name());
    Ok(Side {
        ops,
        cpu,
        statements: Box::new(move || all.iter().map(|l| l.stats().statements).sum()),
        _db: db,
    })
}

/// Runs each of `ops` in a task of its own for `dur`: operations per second.
async fn each(ops: &[Op], dur: Duration) -> f64 {
    let start = tokio::time::Instant::now();
    let deadline = start + dur;
    let tasks: Vec<_> = ops
        .iter()
        .map(|op| {
            let op = op.clone();
            tokio::spawn(async move {
                let mut n = 0u64;
                while tokio::time::Instant::now() < deadline {
                    op().await;
                    n += 1;
                }
                n
            })
        })
        .collect();
    let mut total = 0;
    for t in tasks {
        total += t
            .await
            .expect("a benchmark task failed: its operation panicked");
    }
    total as f64 / start.elapsed().as_secs_f64()
}

struct Measured {
    rates: Vec<f64>,
    /// Server CPU per statement, µs.
    server_us: f64,
    /// This process's CPU per pair, µs.
    client_us: f64,
    per_pair: f64,
}

/// CPU seconds spent between two samples by a side's backends, those
/// that connected in between included (from zero: each side has a
/// database of its own). `Cpu::delta` counts only backends in both
/// samples, which left out half of pgwarden's statements here: its purge
/// (every 10 s) checks out a second connection of each instance's pool,
/// and deadpool then hands out the two in turn.
fn spent(a: &HashMap<i32, f64>, b: &HashMap<i32, f64>) -> f64 {
    b.iter()
        .map(|(pid, t)| t - a.get(pid).copied().unwrap_or(0.0))
        .sum()
}

/// Rows 6a (`fleet` false) and 6b.
pub async fn single(server: &TestServer, s: Settings, fleet: bool) -> Result<Row, BoxError> {
    let instances = if fleet { FLEET } else { 1 };
    let sides = [
        plain_side(server, instances).await?,
        warden_side(server, instances).await?,
    ];
    for side in &sides {
        each(&side.ops, Duration::from_millis(300)).await;
    }
    let mut before = Vec::new();
    for side in &sides {
        before.push((side.cpu.sample().await?, (side.statements)()));
    }
    let (rounds, round) = (s.rounds * 4, s.round / 2);
    let mut rates = [Vec::new(), Vec::new()];
    let mut client = [0.0; 2];
    for n in 0..rounds {
        for k in 0..2 {
            let i = (n + k) % 2;
            let c0 = own_cpu();
            rates[i].push(each(&sides[i].ops, round).await);
            client[i] += own_cpu() - c0;
        }
    }
    let mut m = Vec::new();
    for (i, (side, (cpu0, st0))) in sides.iter().zip(before).enumerate() {
        let cpu = spent(&cpu0, &side.cpu.sample().await?);
        let statements = (side.statements)() - st0;
        let pairs: f64 = rates[i].iter().sum::<f64>() * round.as_secs_f64();
        m.push(Measured {
            rates: rates[i].clone(),
            server_us: cpu * 1e6 / statements.max(1) as f64,
            client_us: client[i] * 1e6 / pairs.max(1.0),
            per_pair: statements as f64 / pairs.max(1.0),
        });
    }
    let (p, w) = (&m[0], &m[1]);
    let c = Compared::new(&p.rates, &w.rates);
    let side = |x: &Measured| {
        format!(
            "{:.0} pairs/s, {:.0} µs server CPU/statement, {:.0} µs server CPU/pair, {:.0} µs client CPU/pair, {:.2} statements/pair",
            median(&x.rates),
            x.server_us,
            x.server_us * x.per_pair,
            x.client_us,
            x.per_pair
        )
    };
    Ok(Row {
        id: if fleet { "6b" } else { "6a" },
        workload: if fleet {
            format!("lease acquire + release of a new name, {FLEET} instances (each its own pool of {POOL}) with one task each: pgwarden vs the seed's SQL prepared")
        } else {
            format!("lease acquire + release of a new name, one instance (pool {POOL}), one task: pgwarden vs the seed's SQL prepared")
        },
        a: format!("seed's SQL prepared: {}", side(p)),
        b: format!("pgwarden, shipped defaults, direct: {}", side(w)),
        ratio: format!("{:.3}", c.pairs),
        target: "≥ 0.9",
        met: (!s.smoke).then(|| c.at_least(TARGET)).flatten(),
        notes: format!(
            "{}; every pair ratio: {}",
            c.spread(),
            p.rates
                .iter()
                .zip(&w.rates)
                .map(|(a, b)| format!("{:.3}", b / a))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    })
}

/// `--profile-single plain|pgwarden PAIRS [INSTANCES]`: one side, a
/// fixed number of pairs; prints the WAL bytes per pair (the server's
/// `pg_current_wal_lsn()` before and after).
pub fn profile_main(args: &[String]) -> Result<(), BoxError> {
    let usage = "usage: --profile-single plain|pgwarden PAIRS [INSTANCES]";
    let (which, pairs, instances) = match args {
        [which, pairs, rest @ ..] => (
            which.to_owned(),
            pairs.parse::<u64>()?,
            rest.first().map_or(Ok(1), |n| n.parse::<usize>())?,
        ),
        _ => return Err(usage.into()),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let server = TestServer::shared()?;
        let side = match which.as_str() {
            "plain" => plain_side(server, instances).await?,
            "pgwarden" => warden_side(server, instances).await?,
            _ => return Err(usage.into()),
        };
        let monitor = server.create_database().await?.connect().await?;
        let wal0 = wal_bytes(&monitor).await?;
        let t0 = std::time::Instant::now();
        // Each instance's task on the runtime's workers, as in rows 6a and
        // 6b; `pairs` in all.
        let left = Arc::new(AtomicU64::new(pairs));
        let tasks: Vec<_> = side
            .ops
            .iter()
            .map(|op| {
                let (op, left) = (op.clone(), left.clone());
                tokio::spawn(async move {
                    while left
                        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                        .is_ok()
                    {
                        op().await;
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await?;
        }
        let took = t0.elapsed();
        let wal = wal_bytes(&monitor).await? - wal0;
        eprintln!(
            "{which}: {pairs} pairs in {took:?} ({:.1} µs/pair), {:.0} WAL bytes/pair",
            took.as_secs_f64() * 1e6 / pairs as f64,
            wal as f64 / pairs as f64
        );
        Ok(())
    })
}

/// The server's WAL position in bytes.
async fn wal_bytes(monitor: &tokio_postgres::Client) -> Result<i64, BoxError> {
    let r = monitor
        .query_one("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8", &[])
        .await?;
    Ok(r.get(0))
}
