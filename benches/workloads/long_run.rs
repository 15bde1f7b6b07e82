//! Workload 4d: the lease table over a long run of new names (a lease per
//! order, tenant or file, a new name every time), on pgwarden's shipped
//! defaults (the purge included: a round every 5 s, released rows gone
//! in the round after the one that marked them).
//!
//! Each run: 16 tasks, pool 16, acquire + release of a new name, without a
//! pause, for [`RUN`] (10 minutes); every [`SAMPLE`] (10 s) the pairs made
//! and the table's row count. A run's verdict: the rate of its last minute
//! is at least 90 % of its first's, and the table held at most what the
//! purge promises (the live leases plus what was released within two
//! intervals: rate x 10 s, with 25 % of slack). Every run is reported; the
//! row is met when every run is.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgwarden::{LeaseOptions, Leases, Pool, PoolerMode};
use pgwarden_testing::TestServer;

use crate::{BoxError, Row, Settings};

const TASKS: usize = 16;
const POOL: usize = 16;
/// One run's length (full run).
const RUN: Duration = Duration::from_secs(600);
/// How often the rate and the row count are sampled.
const SAMPLE: Duration = Duration::from_secs(10);
/// Runs in a full run.
const RUNS: usize = 5;
/// The purge's promise at the shipped defaults: a released row goes in the
/// round after the one that marked it, so it stays about two 5 s intervals
/// (an expired one, a holder that stopped renewing, stays 60 s more; this
/// workload releases every lease).
const PROMISED: Duration = Duration::from_secs(10);

fn run_length(s: Settings) -> Duration {
    if s.smoke {
        return Duration::from_secs(3);
    }
    std::env::var("PGWARDEN_BENCH_LONG_RUN_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(RUN, Duration::from_secs)
}

fn runs(s: Settings) -> usize {
    if s.smoke {
        return 1;
    }
    std::env::var("PGWARDEN_BENCH_LONG_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(RUNS)
}

pub fn describe(s: Settings) -> String {
    format!(
        "4d: {} run(s) of {:?}, each on a fresh database: {TASKS} tasks, pool {POOL}, pgwarden on its shipped defaults \
         (a purge round every 5 s; released rows go in the round after the one that marked them) on a direct pool, \
         acquire + release of a new name without a pause; every {SAMPLE:?} the pairs made and `count(*)` of the lease \
         table; a run is met when its last minute's rate is at least 0.9 of its first's and the table never held more \
         than 1.25 x the rate x {PROMISED:?} (live leases + released within two intervals); `PGWARDEN_BENCH_LONG_RUNS` and `PGWARDEN_BENCH_LONG_RUN_S` change the count and the length",
        runs(s),
        run_length(s)
    )
}

/// One sample: seconds since the start, pairs made since the last sample,
/// rows in the table.
struct Sample {
    at: f64,
    pairs: u64,
    rows: i64,
}

struct Run {
    samples: Vec<Sample>,
    first: f64,
    last: f64,
    max_rows: i64,
    bound: f64,
}

impl Run {
    fn ratio(&self) -> f64 {
        self.last / self.first
    }
    fn met(&self) -> bool {
        self.ratio() >= 0.9 && (self.max_rows as f64) <= self.bound
    }
}

/// The mean rate over the samples that end within `from..=to` seconds
/// (half a second of slack: a sample is taken a moment after its time).
/// Each sample counts the pairs made since the one before it, so the
/// window's time starts at the sample before its first, not at `from`
/// (counting from `from` gave a window a whole sample's pairs for the few
/// milliseconds that sample came after `from`: the last minute's rate came
/// out a sixth too high).
fn rate(samples: &[Sample], from: f64, to: f64) -> f64 {
    let mut prev = samples
        .iter()
        .rev()
        .find(|s| s.at <= from + 0.5)
        .map_or(0.0, |s| s.at);
    let (mut pairs, mut secs) = (0u64, 0.0);
    for s in samples
        .iter()
        .filter(|s| s.at > from + 0.5 && s.at <= to + 0.5)
    {
        pairs += s.pairs;
        secs += s.at - prev;
        prev = s.at;
    }
    pairs as f64 / secs.max(1e-9)
}

async fn one_run(server: &TestServer, length: Duration) -> Result<Run, BoxError> {
    let db = server.create_database().await?;
    let monitor = db.connect().await?;
    let inner = db.deadpool(POOL)?;
    let pool = Pool::builder(inner)
        .name("long-run")
        .pooler(PoolerMode::Direct)
        .build()?;
    let leases = Leases::new(&pool);
    leases.install().await?;
    let stop = Arc::new(AtomicBool::new(false));
    let pairs = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (leases, stop, pairs) = (leases.clone(), stop.clone(), pairs.clone());
            tokio::spawn(async move {
                let opts = LeaseOptions::new(Duration::from_secs(60));
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let name = format!("order-{t}-{i}");
                    i += 1;
                    match leases.acquire(&name, &opts, None).await {
                        Ok(Some(lease)) => {
                            if lease.release().await.is_ok() {
                                pairs.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Ok(None) => eprintln!("4d: a new name was busy: {name}"),
                        Err(e) => eprintln!("4d: {e}"),
                    }
                }
            })
        })
        .collect();
    let start = Instant::now();
    let mut samples = Vec::new();
    let mut seen = 0;
    let mut next = start + SAMPLE.min(length);
    while start.elapsed() < length {
        tokio::time::sleep_until(next.into()).await;
        next += SAMPLE;
        let now = pairs.load(Ordering::Relaxed);
        let rows: i64 = monitor
            .query_one("SELECT count(*) FROM pgwarden_leases", &[])
            .await?
            .get(0);
        samples.push(Sample {
            at: start.elapsed().as_secs_f64(),
            pairs: now - seen,
            rows,
        });
        // The purge's own account: rows deleted, its statements, and the
        // rounds whose mark was still open (a stall shows here first).
        let st = leases.stats();
        eprintln!(
            "4d: {:>5.0} s  {:>8.0} pairs/s  {:>9} rows  purged {} in {} statements, {} rounds waited",
            start.elapsed().as_secs_f64(),
            (now - seen) as f64 / SAMPLE.as_secs_f64(),
            rows,
            st.purged,
            st.purge_statements,
            st.purges_waited
        );
        seen = now;
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await?;
    }
    let total = length.as_secs_f64();
    let minute = 60f64.min(total / 3.0);
    let first = rate(&samples, 0.0, minute);
    let last = rate(&samples, total - minute, total);
    let whole = rate(&samples, 0.0, total);
    let max_rows = samples.iter().map(|s| s.rows).max().unwrap_or(0);
    let bound = 1.25 * whole * PROMISED.as_secs_f64() + TASKS as f64;
    pool.close();
    drop(monitor);
    db.destroy().await?;
    Ok(Run {
        samples,
        first,
        last,
        max_rows,
        bound,
    })
}

pub async fn long_run(server: &TestServer, s: Settings) -> Result<Row, BoxError> {
    let length = run_length(s);
    // The library's own account in the run's log: a purge round that
    // failed (a warning; its statements then stop climbing in the samples)
    // or whose mark stays open past the statement timeout (with the pids).
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("pgwarden=info"))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    let mut results = Vec::new();
    for k in 0..runs(s) {
        eprintln!("4d: run {} of {}", k + 1, runs(s));
        results.push(one_run(server, length).await?);
    }
    let mut notes = String::new();
    for (k, r) in results.iter().enumerate() {
        let _ = write!(
            notes,
            "run {}: first minute {:.0} pairs/s, last {:.0} ({:.3}), rows at most {} (bound {:.0}); ",
            k + 1,
            r.first,
            r.last,
            r.ratio(),
            r.max_rows,
            r.bound
        );
    }
    if let Some(r) = results.first() {
        let rows: Vec<String> = r.samples.iter().map(|s| s.rows.to_string()).collect();
        let _ = write!(
            notes,
            "run 1's row counts every {SAMPLE:?}: {}",
            rows.join(", ")
        );
    }
    let worst = results.iter().map(Run::ratio).fold(f64::INFINITY, f64::min);
    Ok(Row {
        id: "4d",
        workload: format!("leases over {length:?}: new names, shipped defaults (purge included)"),
        a: "first minute".to_owned(),
        b: "last minute".to_owned(),
        ratio: format!("{worst:.3} (worst run)"),
        target: "every run ≥ 0.9, rows bounded",
        met: (!s.smoke).then(|| results.iter().all(Run::met)),
        notes,
    })
}
