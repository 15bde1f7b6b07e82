//! Workload 5: 10,000 leases held by one process.
//!
//! B: pgwarden holds them (one `Leases`, renewal every interval, batched).
//! A: the naive holder renews the same number of rows of the same table one
//! statement per lease per interval: pgwarden's renewal `UPDATE` cut down
//! to one row (`WHERE name = $1 AND holder = $2 AND token = $3`), sent with
//! `query_typed` by 8 tasks on a raw pool of 8.
//!
//! Each side has its own database, so the database CPU of a side is the CPU
//! time (utime + stime from `/proc/<pid>/stat`) of that database's client
//! backends, sampled around the measured window. Rounds interleave: A renews
//! every lease once (one interval's work); B is a window of whole renewal
//! ticks of pgwarden's renewer (from just after one tick to just after
//! another, a few intervals apart), divided by the intervals it spans. The
//! renewer keeps running in A's rounds, in B's database, which A does not
//! count.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{stream, StreamExt, TryStreamExt};
use pgwarden::{LeaseOptions, Leases, Pool};
use pgwarden_testing::TestServer;
use tokio_postgres::types::Type;

use crate::ab::{all, median, Compared};
use crate::{BoxError, Row, Settings};

const POOL: usize = 8;
const NAIVE_TASKS: usize = 8;
/// Targets, pgwarden against one `UPDATE` per lease: renewal statements per
/// interval at most a thousandth (10 for 10,000 leases), the database's CPU
/// per interval at most half.
const TARGET_STATEMENTS: f64 = 0.001;
const TARGET_CPU: f64 = 0.5;

#[derive(Clone, Copy)]
struct Plan {
    leases: usize,
    ttl: Duration,
    renew_every: Duration,
    /// Renewal intervals per B window.
    window: u32,
    rounds: usize,
}

fn plan(s: Settings) -> Plan {
    if s.smoke {
        Plan {
            leases: 1_000,
            ttl: Duration::from_secs(2),
            renew_every: Duration::from_millis(400),
            window: 2,
            rounds: 1,
        }
    } else {
        Plan {
            leases: 10_000,
            ttl: Duration::from_secs(4),
            renew_every: Duration::from_secs(1),
            window: 3,
            rounds: 5,
        }
    }
}

pub fn describe(s: Settings) -> String {
    let p = plan(s);
    format!(
        "5: {} leases, TTL {:?}, renewal every {:?} (pgwarden: `LeaseOptions::renew_every`, one \
         `Leases`, pool {POOL}); naive: one `UPDATE` per lease per interval, {NAIVE_TASKS} tasks \
         on a raw pool of {POOL}; {} interleaved round pairs, a pgwarden window spanning {} \
         renewal ticks; database CPU = utime + stime of the side's client backends \
         (`/proc/<pid>/stat`, {} Hz ticks; autovacuum not counted)",
        p.leases,
        p.ttl,
        p.renew_every,
        p.rounds,
        p.window,
        clock_ticks()
    )
}

/// utime + stime, in clock ticks, of the process whose `stat` file is
/// `path` (`/proc/<pid>/stat`, `/proc/self/stat`); `None` when it cannot be
/// read (the process exited, or not on this machine).
pub fn cpu_ticks(path: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(path).ok()?;
    // Fields after the command name (which may hold spaces): state is
    // field 3, utime 14, stime 15.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// Clock ticks per second (`getconf CLK_TCK`, asked once).
pub fn clock_ticks() -> u64 {
    static TICKS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(ask_clock_ticks)
}

fn ask_clock_ticks() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100)
}

/// CPU time used so far by the client backends of one database, per pid.
pub struct Cpu {
    monitor: tokio_postgres::Client,
    db: String,
    tick: f64,
}

impl Cpu {
    /// A sampler of `db`'s client backends, reading `pg_stat_activity`
    /// through `monitor`.
    pub fn new(monitor: tokio_postgres::Client, db: &str) -> Cpu {
        Cpu {
            monitor,
            db: db.to_owned(),
            tick: 1.0 / clock_ticks() as f64,
        }
    }

    pub async fn sample(&self) -> Result<HashMap<i32, f64>, BoxError> {
        let rows = self
            .monitor
            .query(
                "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND backend_type = 'client backend'",
                &[&self.db],
            )
            .await?;
        let mut out = HashMap::new();
        for r in rows {
            let pid: i32 = r.get(0);
            let Some(ticks) = cpu_ticks(&format!("/proc/{pid}/stat")) else {
                continue; // exited meanwhile, or not on this machine
            };
            out.insert(pid, ticks as f64 * self.tick);
        }
        Ok(out)
    }

    /// CPU seconds spent between two samples by backends in both.
    pub fn delta(a: &HashMap<i32, f64>, b: &HashMap<i32, f64>) -> f64 {
        b.iter()
            .filter_map(|(pid, t)| a.get(pid).map(|t0| t - t0))
            .sum()
    }
}

pub async fn renewal(server: &TestServer, s: Settings) -> Result<Row, BoxError> {
    let p = plan(s);
    let local = !server.is_external();
    let (db_a, db_b) = (
        server.create_database().await?,
        server.create_database().await?,
    );
    let tick = 1.0 / clock_ticks() as f64;
    let cpu_a = Cpu {
        monitor: server.create_database().await?.connect().await?,
        db: db_a.name().to_owned(),
        tick,
    };
    let cpu_b = Cpu {
        monitor: server.create_database().await?.connect().await?,
        db: db_b.name().to_owned(),
        tick,
    };

    // B: pgwarden takes its leases.
    let warden = Pool::builder(db_b.deadpool(POOL)?)
        .name("bench-renewal")
        .build()?;
    let leases = Leases::new(&warden);
    leases.install().await?;
    let opts = LeaseOptions::new(p.ttl).renew_every(p.renew_every);
    let began = Instant::now();
    let held: Vec<_> = stream::iter(0..p.leases)
        .map(|i| {
            let (leases, opts) = (&leases, &opts);
            async move {
                leases
                    .acquire(&format!("w5-{i}"), opts, None)
                    .await?
                    .ok_or_else(|| BoxError::from("a new name is free"))
            }
        })
        .buffer_unordered(POOL)
        .try_collect()
        .await?;
    let took_acquire = began.elapsed();

    // A: the naive holder's rows, in its own database.
    let raw = db_a.deadpool(POOL)?;
    {
        let tmp = Pool::builder(db_a.deadpool(2)?)
            .name("bench-install")
            .build()?;
        Leases::new(&tmp).install().await?;
        tmp.close();
    }
    raw.get()
        .await?
        .execute(
            "INSERT INTO pgwarden_leases (name, holder, token, expires_at)
             SELECT 'w5-' || i, 'naive', i, now() + make_interval(secs => $2)
               FROM generate_series(0, $1 - 1) AS i",
            &[&(p.leases as i32), &p.ttl.as_secs_f64()],
        )
        .await?;
    let renew_one = "UPDATE pgwarden_leases AS l SET expires_at = now() + make_interval(secs => $4)
 WHERE l.name = $1 AND l.holder = $2 AND l.token = $3
RETURNING l.name, l.token";
    // Open the raw pool's connections before measuring.
    let warm: Vec<_> = futures_util::future::try_join_all((0..POOL).map(|_| raw.get())).await?;
    drop(warm);

    // Let the renewer fold every lease into one tick before measuring.
    tokio::time::sleep(p.renew_every * 3).await;

    let naive_statements = Arc::new(AtomicU64::new(0));
    let naive_round = || {
        let (raw, n) = (raw.clone(), naive_statements.clone());
        async move {
            let tasks: Vec<_> = (0..NAIVE_TASKS)
                .map(|t| {
                    let (raw, n) = (raw.clone(), n.clone());
                    let total = p.leases;
                    let ttl = p.ttl.as_secs_f64();
                    tokio::spawn(async move {
                        let c = raw.get().await?;
                        for i in (t..total).step_by(NAIVE_TASKS) {
                            let name = format!("w5-{i}");
                            let token = i as i64;
                            let row = c
                                .query_typed_opt(
                                    renew_one,
                                    &[
                                        (&name, Type::TEXT),
                                        (&"naive", Type::TEXT),
                                        (&token, Type::INT8),
                                        (&ttl, Type::FLOAT8),
                                    ],
                                )
                                .await?;
                            n.fetch_add(1, Ordering::Relaxed);
                            row.ok_or("naive renewal: row not ours")?;
                        }
                        Ok::<_, BoxError>(())
                    })
                })
                .collect();
            for t in tasks {
                t.await??;
            }
            Ok::<_, BoxError>(())
        }
    };

    // Waits until a renewal tick of pgwarden has completed: the statement
    // count moved, then stayed put for a while.
    let after_tick = |leases: &Leases| {
        let leases = leases.clone();
        async move {
            let start = leases.stats().renewal_statements;
            let deadline = Instant::now() + p.renew_every * 3;
            while leases.stats().renewal_statements == start && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let mut last = leases.stats().renewal_statements;
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let now = leases.stats().renewal_statements;
                if now == last {
                    return (Instant::now(), leases.stats());
                }
                last = now;
            }
        }
    };

    let mut a_cpu = Vec::new();
    let mut a_secs = Vec::new();
    let mut b_cpu = Vec::new();
    let mut b_statements = Vec::new();
    for _ in 0..p.rounds {
        let n0 = naive_statements.load(Ordering::Relaxed);
        let c0 = cpu_a.sample().await?;
        let t0 = Instant::now();
        naive_round().await?;
        a_secs.push(t0.elapsed().as_secs_f64());
        let c1 = cpu_a.sample().await?;
        a_cpu.push(Cpu::delta(&c0, &c1) * 1e3);
        debug_assert_eq!(
            naive_statements.load(Ordering::Relaxed) - n0,
            p.leases as u64
        );

        let (t0, s0) = after_tick(&leases).await;
        let c0 = cpu_b.sample().await?;
        tokio::time::sleep((p.renew_every * p.window).saturating_sub(p.renew_every / 2)).await;
        let (t1, s1) = after_tick(&leases).await;
        let c1 = cpu_b.sample().await?;
        let intervals = (t1 - t0).as_secs_f64() / p.renew_every.as_secs_f64();
        b_cpu.push(Cpu::delta(&c0, &c1) * 1e3 / intervals);
        b_statements.push((s1.renewal_statements - s0.renewal_statements) as f64 / intervals);
    }
    let stats = leases.stats();
    let lost = held.iter().filter(|l| l.is_lost()).count();
    let began = Instant::now();
    let released = leases.release_all().await?;
    let took_release = began.elapsed();
    drop(held);
    warden.close();
    raw.close();

    let stmts_b = median(&b_statements);
    let a_statements = p.leases as f64;
    let cpu = |v: &[f64]| {
        if local {
            format!("{:.0} ms DB CPU/interval", median(v))
        } else {
            "DB CPU n/a (external server)".to_owned()
        }
    };
    let cpu_c = Compared::new(&a_cpu, &b_cpu);
    Ok(Row {
        id: "5",
        workload: format!(
            "{} leases held by one process, renewal every {:?}",
            p.leases, p.renew_every
        ),
        a: format!(
            "naive: {a_statements:.0} statements/interval; {} (round took {:.2} s)",
            cpu(&a_cpu),
            median(&a_secs)
        ),
        b: format!(
            "pgwarden: {stmts_b:.2} statements/interval; {}",
            cpu(&b_cpu)
        ),
        ratio: if local {
            format!(
                "{:.4} (DB CPU); {:.5} (statements)",
                cpu_c.pairs,
                stmts_b / a_statements
            )
        } else {
            format!("{:.5} (statements)", stmts_b / a_statements)
        },
        target: "DB CPU ≤ 0.5; statements ≤ 0.001",
        met: (!s.smoke)
            .then(|| {
                let statements = Some(stmts_b / a_statements <= TARGET_STATEMENTS);
                if local {
                    all(&[cpu_c.at_most(TARGET_CPU), statements])
                } else {
                    statements
                }
            })
            .flatten(),
        notes: format!(
            "{}pgwarden: {} held at the end, {lost} lost, {} renewal failures, last batch {} \
             (5,000 per statement at most); acquiring them took {:.2} s, `release_all` {:.2} s ({released} released)",
            if local {
                format!("DB CPU: {}; ", cpu_c.spread())
            } else {
                String::new()
            },
            stats.held,
            stats.renewal_failures,
            stats.last_batch,
            took_acquire.as_secs_f64(),
            took_release.as_secs_f64(),
        ),
    })
}
