//! Workloads 1 and 2: what pgwarden costs against raw deadpool.

use pgwarden_testing::TestServer;

use crate::ab::{interleave, median, throughput, Compared};
use crate::{BoxError, Row, Settings};

const TASKS: usize = 64;
const POOL: usize = 16;
/// Row 1's round pairs (of 1 s per side in a full run): enough for the
/// median pair ratio's 95 % confidence interval to be about ±0.02 wide at
/// the spread these pairs have on this machine (quartiles about ±0.05),
/// so a ratio 0.02 clear of the target resolves. Fixed in advance: a
/// count that grew until the interval cleared the target would not keep
/// the interval's confidence.
pub const PAIRS_1: usize = 96;
/// Row 1: pgwarden's throughput against raw deadpool's, at least.
const TARGET: f64 = 0.97;
/// Row 2: pgwarden's checkout + return time against raw deadpool's, at most.
const CHECKOUT_TARGET: f64 = 1.3;

/// 1: 64 tasks, pool 16, `get` + `SELECT 1`: throughput, pgwarden / raw.
pub async fn get_select_1(server: &TestServer, s: Settings) -> Result<Row, BoxError> {
    let db = server.create_database().await?;
    let raw = db.deadpool(POOL)?;
    let warden = pgwarden::Pool::builder(db.deadpool(POOL)?)
        .name("bench")
        .build()?;
    let dur = s.round / 2;
    let (a, b) = interleave(
        if s.smoke { s.rounds * 2 } else { PAIRS_1 },
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
    let c = Compared::new(&a, &b);
    Ok(Row {
        id: "1",
        workload: format!("`get` + `SELECT 1`, {TASKS} tasks, pool {POOL}"),
        a: format!("raw deadpool {:.0} ops/s", median(&a)),
        b: format!("pgwarden {:.0} ops/s", median(&b)),
        ratio: format!("{:.3}", c.pairs),
        target: "≥ 0.97",
        met: (!s.smoke).then(|| c.at_least(TARGET)).flatten(),
        notes: c.spread(),
    })
}

/// 2: read criterion's estimates for checkout + return with no query.
/// `benches/run.sh` runs criterion several times, the side measured first
/// alternating, and keeps each run's estimates in
/// `target/criterion-rounds/K/`: the row compares the runs' means as pairs
/// (the ratio per run; its median, its confidence interval, quartiles and
/// range), judged as the other rows are. Without rounds (a plain `cargo
/// bench --bench checkout`, or `--smoke`) it reads criterion's last run
/// alone, judged with the 95 % confidence intervals of its two means.
pub fn checkout_from_criterion(s: Settings) -> Row {
    from_criterion(s, &DEADPOOL)
}

/// One backend's checkout row: its id, criterion group and the raw side's
/// name (the pgwarden side is `pgwarden` in every group).
pub struct Side {
    pub id: &'static str,
    pub group: &'static str,
    pub raw: &'static str,
    pub label: &'static str,
}

/// Row 2: deadpool.
pub const DEADPOOL: Side = Side {
    id: "2",
    group: "checkout_return",
    raw: "raw_deadpool",
    label: "raw deadpool",
};

/// The checkout row of `side` from criterion's estimates (see
/// [`checkout_from_criterion`]).
pub fn from_criterion(s: Settings, side: &Side) -> Row {
    let read = |path: String| -> Option<[f64; 3]> {
        let text = std::fs::read_to_string(path).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        let mean = &v["mean"];
        let ci = &mean["confidence_interval"];
        Some([
            mean["point_estimate"].as_f64()?,
            ci["lower_bound"].as_f64()?,
            ci["upper_bound"].as_f64()?,
        ])
    };
    let mut rounds = Vec::new();
    for k in 1.. {
        let est = |name: &str| {
            read(format!(
                "target/criterion-rounds/{k}/{}/{name}.json",
                side.group
            ))
        };
        match (est(side.raw), est("pgwarden")) {
            (Some([a, ..]), Some([b, ..])) => rounds.push((a, b)),
            _ => break,
        }
    }
    if rounds.len() >= 2 {
        let a: Vec<f64> = rounds.iter().map(|r| r.0).collect();
        let b: Vec<f64> = rounds.iter().map(|r| r.1).collect();
        let c = Compared::new(&a, &b);
        let runs: Vec<String> = rounds
            .iter()
            .map(|(a, b)| format!("{a:.0}/{b:.0}"))
            .collect();
        return Row {
            id: side.id,
            workload: format!(
                "checkout + return, no query (criterion, 1 task), {}",
                side.label
            ),
            a: format!(
                "{} {:.0} ns (median of {} runs)",
                side.label,
                median(&a),
                a.len()
            ),
            b: format!("pgwarden {:.0} ns", median(&b)),
            ratio: format!("{:.2} (time, median of the runs' ratios of means)", c.pairs),
            target: "≤ 1.3",
            met: (!s.smoke).then(|| c.at_most(CHECKOUT_TARGET)).flatten(),
            notes: format!(
                "{}; means per run, {}/pgwarden ns (the side first alternating): {}; \
                 pgwarden adds {:.0} ns per checkout (medians)",
                c.spread().replace("pairs)", "runs)"),
                side.label,
                runs.join(", "),
                median(&b) - median(&a)
            ),
        };
    }
    let last = |name: &str| {
        read(format!(
            "target/criterion/{}/{name}/new/estimates.json",
            side.group
        ))
    };
    match (last(side.raw), last("pgwarden")) {
        (Some([a, a_lo, a_hi]), Some([b, b_lo, b_hi])) => {
            let (r, r_lo, r_hi) = (b / a, b_lo / a_hi, b_hi / a_lo);
            let verdict = if r_hi <= CHECKOUT_TARGET {
                Some(true)
            } else if r_lo > CHECKOUT_TARGET {
                Some(false)
            } else {
                None
            };
            Row {
                id: side.id,
                workload: format!(
                    "checkout + return, no query (criterion, 1 task), {}",
                    side.label
                ),
                a: format!("{} {a:.0} ns (95 % CI {a_lo:.0} to {a_hi:.0})", side.label),
                b: format!("pgwarden {b:.0} ns (95 % CI {b_lo:.0} to {b_hi:.0})"),
                ratio: format!("{r:.2} (time, ratio of means)"),
                target: "≤ 1.3",
                met: (!s.smoke).then_some(verdict).flatten(),
                notes: format!(
                    "ratio bounds from the confidence intervals {r_lo:.2} to {r_hi:.2}; \
                     pgwarden adds {:.0} ns per checkout; the two sides run one after the other \
                     (criterion), not interleaved; one run (`benches/run.sh` runs several)",
                    b - a
                ),
            }
        }
        _ => Row {
            id: side.id,
            workload: format!("checkout + return, no query (criterion), {}", side.label),
            a: "-".into(),
            b: "-".into(),
            ratio: "-".into(),
            target: "≤ 1.3",
            met: None,
            notes: "not measured: run `cargo bench --bench checkout` first (benches/run.sh does)"
                .into(),
        },
    }
}

/// Row 2s: sqlx 0.8 (`benches/checkout.rs`, group `checkout_return_sqlx`).
#[cfg(feature = "sqlx-0_8")]
pub const SQLX: Side = Side {
    id: "2s",
    group: "checkout_return_sqlx",
    raw: "raw_sqlx",
    label: "raw sqlx 0.8",
};

/// 1s: row 1 on sqlx 0.8: 64 tasks, pool 16, `acquire` + `SELECT 1` (sqlx's
/// `query`, prepared and cached per connection, as a sqlx user writes it),
/// raw `sqlx::PgPool` against `pgwarden::sqlx::Pool` over another one.
#[cfg(feature = "sqlx-0_8")]
pub async fn sqlx_get_select_1(server: &TestServer, s: Settings) -> Result<Row, BoxError> {
    use sqlx08::postgres::PgPoolOptions;
    let db = server.create_database().await?;
    let pool = || {
        PgPoolOptions::new()
            .max_connections(POOL as u32)
            .connect_lazy_with(crate::sqlx_options(&db))
    };
    let raw = pool();
    let warden = crate::warden_sqlx::Pool::builder(pool())
        .name("bench-sqlx")
        .build()?;
    let dur = s.round / 2;
    let (a, b) = interleave(
        if s.smoke { s.rounds * 2 } else { PAIRS_1 },
        || {
            let raw = raw.clone();
            async move {
                throughput(TASKS, dur, move || {
                    let raw = raw.clone();
                    async move {
                        let mut c = raw.acquire().await.expect("raw sqlx acquire");
                        sqlx08::query("SELECT 1")
                            .fetch_one(&mut *c)
                            .await
                            .expect("SELECT 1");
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
                        let mut c = warden.acquire().await.expect("pgwarden sqlx acquire");
                        sqlx08::query("SELECT 1")
                            .fetch_one(&mut *c)
                            .await
                            .expect("SELECT 1");
                    }
                })
                .await
            }
        },
    )
    .await;
    let c = Compared::new(&a, &b);
    Ok(Row {
        id: "1s",
        workload: format!("`acquire` + `SELECT 1` on sqlx 0.8, {TASKS} tasks, pool {POOL}"),
        a: format!("raw sqlx {:.0} ops/s", median(&a)),
        b: format!("pgwarden {:.0} ops/s", median(&b)),
        ratio: format!("{:.3}", c.pairs),
        target: "≥ 0.97",
        met: (!s.smoke).then(|| c.at_least(TARGET)).flatten(),
        notes: c.spread(),
    })
}
