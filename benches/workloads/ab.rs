//! Interleaved A/B rounds and their statistics.

use std::future::Future;
use std::time::Duration;

/// Runs `rounds` pairs, A B then B A alternately, each closure returning its
/// measurement.
pub async fn interleave<A, FA, B, FB>(rounds: usize, a: A, b: B) -> (Vec<f64>, Vec<f64>)
where
    A: FnMut() -> FA,
    FA: Future<Output = f64>,
    B: FnMut() -> FB,
    FB: Future<Output = f64>,
{
    interleave_until(rounds, rounds, |_| true, a, b).await
}

/// Runs `min` pairs, A B then B A alternately, then more pairs, two at a
/// time, while `resolved` says the comparison so far does not settle its
/// target, up to `max` pairs in all.
pub async fn interleave_until<A, FA, B, FB>(
    min: usize,
    max: usize,
    resolved: impl Fn(&Compared) -> bool,
    mut a: A,
    mut b: B,
) -> (Vec<f64>, Vec<f64>)
where
    A: FnMut() -> FA,
    FA: Future<Output = f64>,
    B: FnMut() -> FB,
    FB: Future<Output = f64>,
{
    let mut xs = Vec::with_capacity(max);
    let mut ys = Vec::with_capacity(max);
    // Pairs alternate which side goes first (A B, B A, A B, …), so a drift
    // in the machine's state within a pair does not favour one side.
    let mut i = 0;
    while i < min || (i < max && !resolved(&Compared::new(&xs, &ys))) {
        for _ in 0..if i < min { 1 } else { 2 } {
            if i % 2 == 0 {
                xs.push(a().await);
                ys.push(b().await);
            } else {
                ys.push(b().await);
                xs.push(a().await);
            }
            i += 1;
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

/// The `q`-quantile (0–1) with linear interpolation between the closest
/// ranks.
pub fn quantile(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    let pos = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

/// B against A over interleaved pairs: the figures a row prints and judges.
#[derive(Debug, Clone, Copy)]
pub struct Compared {
    /// Median of the pairwise ratios b[i] / a[i]: the row's headline.
    pub pairs: f64,
    /// Median of B over median of A. Far from `pairs` when the machine's
    /// speed drifted across the pairs.
    pub medians: f64,
    /// Quartiles and range of the pairwise ratios.
    pub q1: f64,
    pub q3: f64,
    pub lo: f64,
    pub hi: f64,
    pub n: usize,
}

impl Compared {
    pub fn new(a: &[f64], b: &[f64]) -> Compared {
        let r: Vec<f64> = a.iter().zip(b).map(|(x, y)| y / x).collect();
        Compared {
            pairs: median(&r),
            medians: median(b) / median(a),
            q1: quantile(&r, 0.25),
            q3: quantile(&r, 0.75),
            lo: quantile(&r, 0.0),
            hi: quantile(&r, 1.0),
            n: r.len(),
        }
    }

    /// "B/A ≥ `target`": yes when the lower quartile of the pair ratios and
    /// the ratio of the medians are both at or above it, no when the upper
    /// quartile and the ratio of the medians are both below it, unresolved
    /// (`None`) when the spread straddles it.
    pub fn at_least(&self, target: f64) -> Option<bool> {
        if self.q1 >= target && self.medians >= target {
            Some(true)
        } else if self.q3 < target && self.medians < target {
            Some(false)
        } else {
            None
        }
    }

    /// "B/A ≤ `target`", judged as [`Compared::at_least`].
    pub fn at_most(&self, target: f64) -> Option<bool> {
        if self.q3 <= target && self.medians <= target {
            Some(true)
        } else if self.q1 > target && self.medians > target {
            Some(false)
        } else {
            None
        }
    }

    /// The ratio of the medians and the spread of the pair ratios.
    pub fn spread(&self) -> String {
        format!(
            "ratio of medians {:.3}; pair ratios: quartiles {:.3} to {:.3}, range {:.3} to {:.3} ({} pairs)",
            self.medians, self.q1, self.q3, self.lo, self.hi, self.n
        )
    }
}

/// Several verdicts at once: no when any is no, yes when all are yes,
/// unresolved otherwise.
pub fn all(verdicts: &[Option<bool>]) -> Option<bool> {
    if verdicts.contains(&Some(false)) {
        Some(false)
    } else if verdicts.iter().all(|v| *v == Some(true)) {
        Some(true)
    } else {
        None
    }
}
