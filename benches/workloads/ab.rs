//! Interleaved A/B rounds and their statistics.

use std::future::Future;
use std::time::Duration;

/// Runs `rounds` pairs, A B then B A alternately, each closure returning its
/// measurement.
pub async fn interleave<A, FA, B, FB>(rounds: usize, mut a: A, mut b: B) -> (Vec<f64>, Vec<f64>)
where
    A: FnMut() -> FA,
    FA: Future<Output = f64>,
    B: FnMut() -> FB,
    FB: Future<Output = f64>,
{
    let mut xs = Vec::with_capacity(rounds);
    let mut ys = Vec::with_capacity(rounds);
    // Pairs alternate which side goes first (A B, B A, A B, …), so a drift
    // in the machine's state within a pair does not favour one side.
    for i in 0..rounds {
        if i % 2 == 0 {
            xs.push(a().await);
            ys.push(b().await);
        } else {
            ys.push(b().await);
            xs.push(a().await);
        }
    }
    (xs, ys)
}

pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Median of the pairwise ratios b[i] / a[i].
pub fn ratio(a: &[f64], b: &[f64]) -> f64 {
    let r: Vec<f64> = a.iter().zip(b).map(|(x, y)| y / x).collect();
    median(&r)
}

/// Runs `tasks` tasks for `dur`, each looping `op`, and returns ops/s.
pub async fn throughput<F, Fut>(tasks: usize, dur: Duration, op: F) -> f64
where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let start = tokio::time::Instant::now();
    let deadline = start + dur;
    let handles: Vec<_> = (0..tasks)
        .map(|_| {
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
    for h in handles {
        total += h
            .await
            .expect("a benchmark task failed: its operation panicked");
    }
    total as f64 / start.elapsed().as_secs_f64()
}

/// The `p`-th percentile (0–100) by nearest rank: the smallest value with at
/// least `p` % of the values at or below it.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// The smallest and largest pairwise ratio b[i] / a[i], for the notes.
pub fn spread(a: &[f64], b: &[f64]) -> String {
    let r: Vec<f64> = a.iter().zip(b).map(|(x, y)| y / x).collect();
    let lo = r.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = r.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("pair ratios {lo:.3} to {hi:.3}")
}
