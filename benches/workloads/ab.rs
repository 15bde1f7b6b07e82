//! Interleaved A/B rounds and their statistics.

use std::future::Future;
use std::time::Duration;

/// Runs `rounds` pairs, A B then B A alternately, each closure returning its
/// measurement.
///
/// The count is fixed before the first round: adding pairs until the
/// comparison looked settled would make its confidence interval promise
/// more than it holds.
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

/// A confidence interval for the median of `v`, free of any assumption on
/// the distribution: the order statistics X(k) and X(n+1-k) of the sorted
/// values, with k the largest rank for which the median falls outside
/// them with probability at most 5 % (each value is above or below the
/// median with probability ½: the count below is binomial). Returns the
/// bounds and the interval's confidence: at least 0.95, except with fewer
/// than 6 values, where the interval is their range and its confidence
/// `1 - 2^(1-n)` (0.875 for 4 values, 0.9375 for 5).
pub fn median_ci(v: &[f64]) -> (f64, f64, f64) {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return (f64::NAN, f64::NAN, 0.0);
    }
    // below[j] = P(Binomial(n, 1/2) <= j), summed in log space (no
    // underflow at large n).
    let mut below = Vec::with_capacity(n + 1);
    let (mut log_p, mut sum) = (-(n as f64) * std::f64::consts::LN_2, 0.0);
    for j in 0..=n {
        sum += log_p.exp();
        below.push(sum);
        log_p += ((n - j) as f64 / (j + 1) as f64).ln();
    }
    // The interval [X(k), X(n+1-k)] misses the median with probability
    // 2 * P(Binomial <= k - 1).
    let mut k = 1;
    while k < n / 2 && 2.0 * below[k] <= 0.05 {
        k += 1;
    }
    (v[k - 1], v[n - k], 1.0 - 2.0 * below[k - 1])
}

/// Checks [`median_ci`] against the binomial tables (ranks and confidence
/// worked out independently): every run of the benchmarks, the smoke run
/// in CI included, starts with it, so the verdicts rest on a rule that is
/// itself checked.
pub fn check_median_ci() -> Result<(), String> {
    let cases = [
        (5, 1, 5, 0.9375),
        (6, 1, 6, 0.96875),
        (10, 2, 9, 0.978515625),
        (14, 3, 12, 0.987060546875),
        (20, 6, 15, 0.9586105346679688),
        (28, 9, 20, 0.9643018618226051),
        (112, 46, 67, 0.9532649318060401),
    ];
    for (n, lo, hi, conf) in cases {
        // The values n, n-1, …, 1 (unsorted on purpose): X(k) is k.
        let v: Vec<f64> = (1..=n).rev().map(|i| i as f64).collect();
        let got = median_ci(&v);
        if got.0 != lo as f64 || got.1 != hi as f64 || (got.2 - conf).abs() > 1e-9 {
            return Err(format!(
                "median_ci of {n} values: {got:?}, expected X({lo}) to X({hi}) at {conf}"
            ));
        }
    }
    Ok(())
}

/// B against A over interleaved pairs: the figures a row prints and judges.
#[derive(Debug, Clone, Copy)]
pub struct Compared {
    /// Median of the pairwise ratios b[i] / a[i]: the row's headline.
    pub pairs: f64,
    /// Median of B over median of A. Far from `pairs` when the machine's
    /// speed drifted across the pairs.
    pub medians: f64,
    /// The 95 % confidence interval of `pairs` ([`median_ci`]) and its
    /// confidence (below 0.95 only with fewer than 6 pairs: their range).
    pub ci_lo: f64,
    pub ci_hi: f64,
    pub conf: f64,
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
        let (ci_lo, ci_hi, conf) = median_ci(&r);
        Compared {
            pairs: median(&r),
            medians: median(b) / median(a),
            ci_lo,
            ci_hi,
            conf,
            q1: quantile(&r, 0.25),
            q3: quantile(&r, 0.75),
            lo: quantile(&r, 0.0),
            hi: quantile(&r, 1.0),
            n: r.len(),
        }
    }

    /// "B/A ≥ `target`": yes when the confidence interval of the median
    /// pair ratio and the ratio of the medians are all at or above it, no
    /// when they are all below it, unresolved (`None`) when the interval
    /// straddles it (more pairs narrow the interval; they do not narrow the
    /// spread of the pairs themselves, which is the machine's noise).
    pub fn at_least(&self, target: f64) -> Option<bool> {
        if self.ci_lo >= target && self.medians >= target {
            Some(true)
        } else if self.ci_hi < target && self.medians < target {
            Some(false)
        } else {
            None
        }
    }

    /// "B/A ≤ `target`", judged as [`Compared::at_least`].
    pub fn at_most(&self, target: f64) -> Option<bool> {
        if self.ci_hi <= target && self.medians <= target {
            Some(true)
        } else if self.ci_lo > target && self.medians > target {
            Some(false)
        } else {
            None
        }
    }

    /// The confidence interval of the headline, the ratio of the medians
    /// and the spread of the pair ratios.
    pub fn spread(&self) -> String {
        format!(
            "median's {:.0} % CI {:.3} to {:.3}; ratio of medians {:.3}; pair ratios: quartiles {:.3} to {:.3}, range {:.3} to {:.3} ({} pairs)",
            (self.conf * 100.0).floor(),
            self.ci_lo,
            self.ci_hi,
            self.medians,
            self.q1,
            self.q3,
            self.lo,
            self.hi,
            self.n
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
