//! Metrics under a local debugging recorder: pools built under it, and
//! snapshots keyed `name{label=value,...}` (labels sorted).
//!
//! A debugging snapshot resets what it read (counters and gauges to zero,
//! histograms drained): take one per checkpoint.

use std::collections::HashMap;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use pgwarden::{Pool, PoolBuilder};

/// Builds with a local debugging recorder; returns its snapshotter.
pub fn with_recorder(b: PoolBuilder) -> (Pool, Snapshotter) {
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let pool = metrics::with_local_recorder(&recorder, || b.build().expect("pool"));
    (pool, snap)
}

/// `name{label=value,...}`, labels sorted: how every helper here keys a metric.
pub fn key_of(key: &metrics::Key) -> String {
    let mut labels: Vec<String> = key
        .labels()
        .map(|l| format!("{}={}", l.key(), l.value()))
        .collect();
    labels.sort();
    format!("{}{{{}}}", key.name(), labels.join(","))
}

/// Every metric recorded since the last snapshot, by [`key_of`].
pub fn snapshot(s: &Snapshotter) -> HashMap<String, DebugValue> {
    s.snapshot()
        .into_vec()
        .into_iter()
        .map(|(ck, _, _, v)| (key_of(ck.key()), v))
        .collect()
}

/// Every metric now, by [`key_of`]: a counter's or gauge's value, a
/// histogram's sample count.
pub fn metrics_now(s: &Snapshotter) -> HashMap<String, f64> {
    snapshot(s)
        .into_iter()
        .map(|(k, v)| {
            let v = match v {
                DebugValue::Counter(n) => n as f64,
                DebugValue::Gauge(g) => g.into_inner(),
                DebugValue::Histogram(h) => h.len() as f64,
            };
            (k, v)
        })
        .collect()
}

/// Adds up what the readings of `snap` show (a reading resets what it
/// reads) until `done` holds, within `limit`: counters and duration
/// histograms' counts add up, gauges keep their largest value.
pub async fn watch(
    snap: &Snapshotter,
    limit: std::time::Duration,
    what: &str,
    mut done: impl FnMut(&HashMap<String, f64>) -> bool,
) -> HashMap<String, f64> {
    let mut seen: HashMap<String, f64> = HashMap::new();
    pgwarden_testing::eventually(limit, what, || {
        for (k, v) in metrics_now(snap) {
            let e = seen.entry(k.clone()).or_insert(0.0);
            if k.contains("_total") || k.contains("_seconds{") && k.contains("duration") {
                *e += v;
            } else {
                *e = e.max(v);
            }
        }
        std::future::ready(done(&seen))
    })
    .await;
    seen
}

/// The value of `k` in a [`watch`] or [`metrics_now`] reading (0 if absent).
pub fn metric(m: &HashMap<String, f64>, k: &str) -> f64 {
    m.get(k).copied().unwrap_or(0.0)
}

/// The counter `k` of a [`snapshot`]; panics when it is missing or not a counter.
pub fn counter(s: &HashMap<String, DebugValue>, k: &str) -> u64 {
    match s.get(k) {
        Some(DebugValue::Counter(n)) => *n,
        other => panic!("{k}: expected a counter, got {other:?}"),
    }
}

/// The gauge `k` of a [`snapshot`]; panics when it is missing or not a gauge.
pub fn gauge(s: &HashMap<String, DebugValue>, k: &str) -> f64 {
    match s.get(k) {
        Some(DebugValue::Gauge(g)) => g.into_inner(),
        other => panic!("{k}: expected a gauge, got {other:?}"),
    }
}

/// The samples of histogram `k` of a [`snapshot`]; panics when it is
/// missing or not a histogram.
pub fn histogram(s: &HashMap<String, DebugValue>, k: &str) -> Vec<f64> {
    match s.get(k) {
        Some(DebugValue::Histogram(v)) => v.iter().map(|x| x.into_inner()).collect(),
        other => panic!("{k}: expected a histogram, got {other:?}"),
    }
}
