//! `--profile raw|pgwarden OPS`: one side of workload 1 (64 tasks, pool 16,
//! `get` + `SELECT 1`) for a fixed number of operations, for a profiler:
//!
//! ```sh
//! cargo bench --bench workloads --no-run   # prints the binary's path
//! valgrind --tool=callgrind target/release/deps/workloads-… --profile pgwarden 20000
//! ```
//!
//! `--profile checkout raw|pgwarden OPS` runs benchmark 2's loop instead;
//! `--profile checkout-ab ROUNDS OPS` runs it on both sides in interleaved
//! rounds (A B, B A, …) and prints the nanoseconds per checkout of each
//! side and the median of the pair ratios: a quick check between criterion
//! runs.
//!
//! `--profile sqlx raw|pgwarden|pgwarden-16 OPS` runs row 1s's loop (64
//! tasks, pool 16, `acquire` + `SELECT 1` on sqlx 0.8; feature `sqlx-0_8`).
//!
//! The instructions of the pgwarden run minus those of the raw run, divided
//! by the operations, is what pgwarden adds per checkout (the server runs in
//! its own processes and is not counted).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use pgwarden_testing::TestServer;

use crate::BoxError;

const TASKS: usize = 64;
const POOL: usize = 16;

pub fn profile_main(args: &[String]) -> Result<(), BoxError> {
    if let [mode, side, ops, ..] = args {
        if mode == "checkout" {
            return checkout(side, ops.parse()?);
        }
        if mode == "checkout-ab" {
            return checkout_ab(side.parse()?, ops.parse()?);
        }
        #[cfg(feature = "sqlx-0_8")]
        if mode == "sqlx" {
            return sqlx_get_select_1(side, ops.parse()?);
        }
    }
    let (side, ops) = match args {
        [side, ops, ..] => (side.as_str(), ops.parse::<u64>()?),
        _ => return Err("usage: --profile raw|pgwarden OPS".into()),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let db = TestServer::shared()?.create_database().await?;
        let raw = db.deadpool(POOL)?;
        let warden = pgwarden::Pool::builder(db.deadpool(POOL)?)
            .name("bench-profile")
            .build()?;
        let raw_side = side == "raw";
        spread(ops, move || {
            let (raw, warden) = (raw.clone(), warden.clone());
            async move {
                if raw_side {
                    let c = raw.get().await.expect("raw checkout");
                    let st = c.prepare_cached("SELECT 1").await.expect("prepare");
                    c.query_one(&st, &[]).await.expect("SELECT 1");
                } else {
                    let c = warden.get().await.expect("pgwarden checkout");
                    let st = c.prepare_cached("SELECT 1").await.expect("prepare");
                    c.query_one(&st, &[]).await.expect("SELECT 1");
                }
            }
        })
        .await?;
        eprintln!("{side}: {ops} operations");
        Ok(())
    })
}

/// Benchmark 2's set-up: a current-thread runtime, a raw pool and a
/// pgwarden pool of 16 on a new database, a connection already open in
/// each; runs `body` on them.
fn with_checkout_pools(
    body: impl AsyncFnOnce(&deadpool_postgres::Pool, &pgwarden::Pool) -> Result<(), BoxError>,
) -> Result<(), BoxError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let db = TestServer::shared()?.create_database().await?;
        let raw = db.deadpool(POOL)?;
        let warden = pgwarden::Pool::builder(db.deadpool(POOL)?)
            .name("bench-profile")
            .build()?;
        drop(raw.get().await?);
        drop(warden.get().await?);
        body(&raw, &warden).await
    })
}

/// `--profile checkout raw|pgwarden OPS`: benchmark 2's loop (one task on a
/// current-thread runtime, pool 16, a connection already open: `get` then
/// drop), for a profiler. Subtract the run with OPS = 0 to leave set-up out.
fn checkout(side: &str, ops: u64) -> Result<(), BoxError> {
    with_checkout_pools(async |raw, warden| {
        for _ in 0..ops {
            if side == "raw" {
                drop(raw.get().await?);
            } else {
                drop(warden.get().await?);
            }
        }
        eprintln!("checkout {side}: {ops} operations");
        Ok(())
    })
}

/// `--profile checkout-ab ROUNDS OPS`: benchmark 2's loop, both sides in
/// one process, `ROUNDS` interleaved round pairs of `OPS` checkouts each
/// (the side that goes first alternates); prints each side's median
/// nanoseconds per checkout and the median and range of the pair ratios.
fn checkout_ab(rounds: usize, ops: u64) -> Result<(), BoxError> {
    if rounds == 0 || ops == 0 {
        return Err("usage: --profile checkout-ab ROUNDS OPS (both above 0)".into());
    }
    with_checkout_pools(async |raw, warden| {
        let mut a = Vec::new();
        let mut b = Vec::new();
        for r in 0..rounds {
            for side in if r % 2 == 0 { [0, 1] } else { [1, 0] } {
                let t = std::time::Instant::now();
                for _ in 0..ops {
                    if side == 0 {
                        drop(raw.get().await?);
                    } else {
                        drop(warden.get().await?);
                    }
                }
                let ns = t.elapsed().as_nanos() as f64 / ops as f64;
                if side == 0 {
                    a.push(ns)
                } else {
                    b.push(ns)
                }
            }
        }
        let mut ratios: Vec<f64> = a.iter().zip(&b).map(|(a, b)| b / a).collect();
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (ma, mb) = (med(&mut a), med(&mut b));
        let mr = med(&mut ratios);
        // Sorted by `med`: the fastest round of each side, the least
        // disturbed by the rest of the machine.
        let (fa, fb) = (a[0], b[0]);
        eprintln!(
            "checkout-ab: raw {ma:.0} ns, pgwarden {mb:.0} ns, ratio (median of pairs) {mr:.3}, pair ratios {:.3} to {:.3}; fastest rounds {fa:.0} and {fb:.0} ns ({:.3})",
            ratios[0],
            ratios[ratios.len() - 1],
            fb / fa
        );
        Ok(())
    })
}

/// `--profile sqlx raw|pgwarden OPS`: one side of row 1s (64 tasks, pool
/// 16, `acquire` + `SELECT 1` on sqlx 0.8) for a fixed number of
/// operations, for a profiler (`valgrind --tool=callgrind`: subtract the
/// run with OPS = 0 to leave set-up out; BENCHMARKS.md, row 1s). Side
/// `pgwarden-16`: pgwarden over a pool of 17, its request lane as wide as
/// raw's pool (the default lanes keep one connection for the probe).
#[cfg(feature = "sqlx-0_8")]
fn sqlx_get_select_1(side: &str, ops: u64) -> Result<(), BoxError> {
    use sqlx08::postgres::PgPoolOptions;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let db = TestServer::shared()?.create_database().await?;
        let pool = |size: u32| {
            PgPoolOptions::new()
                .max_connections(size)
                .connect_lazy_with(crate::sqlx_options(&db))
        };
        let raw = pool(POOL as u32);
        // `pgwarden-16`: a pool one larger, its request lane (size - 1) as
        // wide as raw's pool.
        let wide = side == "pgwarden-16";
        let warden = crate::warden_sqlx::Pool::builder(pool(POOL as u32 + u32::from(wide)))
            .name("bench-profile")
            .build()?;
        let raw_side = side == "raw";
        spread(ops, move || {
            let (raw, warden) = (raw.clone(), warden.clone());
            async move {
                if raw_side {
                    let mut c = raw.acquire().await.expect("raw acquire");
                    select_1(&mut c).await.expect("SELECT 1");
                } else {
                    let mut c = warden.acquire().await.expect("pgwarden acquire");
                    select_1(&mut c).await.expect("SELECT 1");
                }
            }
        })
        .await?;
        eprintln!("sqlx {side}: {ops} operations");
        Ok(())
    })
}

/// Row 1s's statement, on either side's connection.
#[cfg(feature = "sqlx-0_8")]
async fn select_1(c: &mut sqlx08::PgConnection) -> Result<sqlx08::postgres::PgRow, sqlx08::Error> {
    sqlx08::query("SELECT 1").fetch_one(c).await
}

/// Runs `op` `ops` times in all, from [`TASKS`] tasks at once.
async fn spread<F, Fut>(ops: u64, op: F) -> Result<(), BoxError>
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let left = Arc::new(AtomicU64::new(ops));
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
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
    Ok(())
}
