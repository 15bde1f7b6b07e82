//! Workloads 1 and 2: what pgwarden costs against raw deadpool.

use pgwarden_testing::TestServer;

use crate::ab::{interleave, median, ratio, spread, throughput};
use crate::{BoxError, Row, Settings};

const TASKS: usize = 64;
const POOL: usize = 16;

/// 1: 64 tasks, pool 16, `get` + `SELECT 1`: throughput, pgwarden / raw.
pub async fn get_select_1(server: &TestServer, s: Settings) -> Result<Row, BoxError> {
    let db = server.create_database().await?;
    let raw = db.deadpool(POOL)?;
    let warden = pgwarden::Pool::builder(db.deadpool(POOL)?)
        .name("bench")
        .build()?;
    // Short rounds, twice as many: the same 28 s in all, and a median of
    // pairwise ratios that the machine's noise moves less.
    let dur = s.round / 2;
    let (a, b) = interleave(
        s.rounds * 2,
        || {
            let raw = raw.clone();
            async move {
                throughput(TASKS, dur, move || {
                    let raw = raw.clone();
                    async move {
                        let c = raw.get().await.expect("raw checkout");
                        let st = c.prepare_cached("SELECT 1").await.expect("prepare");
                        c.query_one(&st, &[]).await.expect("SELECT 1");
                    }
                })
                .await
            }
        },
        || {
            let warden = warden.clone();
            async move {
                throughput(TASKS, dur, move || {
                    let warden = warden.clone();
                    async move {
                        let c = warden.get().await.expect("pgwarden checkout");
                        let st = c.prepare_cached("SELECT 1").await.expect("prepare");
                        c.query_one(&st, &[]).await.expect("SELECT 1");
                    }
                })
                .await
            }
        },
    )
    .await;
    let r = ratio(&a, &b);
    Ok(Row {
        id: "1",
        workload: format!("`get` + `SELECT 1`, {TASKS} tasks, pool {POOL}"),
        a: format!("raw deadpool {:.0} ops/s", median(&a)),
        b: format!("pgwarden {:.0} ops/s", median(&b)),
        ratio: format!("{r:.3}"),
        target: "≥ 0.97",
        met: (!s.smoke).then_some(r >= 0.97),
        notes: spread(&a, &b),
    })
}

/// 2: read criterion's estimates for checkout + return with no query.
pub fn checkout_from_criterion() -> Row {
    let read = |name: &str| -> Option<f64> {
        let p = format!("target/criterion/checkout_return/{name}/new/estimates.json");
        let text = std::fs::read_to_string(p).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        v["mean"]["point_estimate"].as_f64()
    };
    match (read("raw_deadpool"), read("pgwarden")) {
        (Some(a), Some(b)) => Row {
            id: "2",
            workload: "checkout + return, no query (criterion, 1 task)".into(),
            a: format!("raw deadpool {a:.0} ns"),
            b: format!("pgwarden {b:.0} ns"),
            ratio: format!("{:.2}", b / a),
            target: "report; remove what costs > a few hundred ns",
            met: Some(b - a <= 500.0),
            notes: format!("pgwarden adds {:.0} ns per checkout", b - a),
        },
        _ => Row {
            id: "2",
            workload: "checkout + return, no query (criterion)".into(),
            a: "-".into(),
            b: "-".into(),
            ratio: "-".into(),
            target: "report",
            met: None,
            notes: "run `cargo bench --bench checkout` first (benches/run.sh does)".into(),
        },
    }
}
