//! `--profile raw|pgwarden OPS`: one side of workload 1 (64 tasks, pool 16,
//! `get` + `SELECT 1`) for a fixed number of operations, for a profiler:
//!
//! ```sh
//! cargo bench --bench workloads --no-run   # prints the binary's path
//! valgrind --tool=callgrind target/release/deps/workloads-… --profile pgwarden 20000
//! ```
//!
//! `--profile checkout raw|pgwarden OPS` runs benchmark 2's loop instead.
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
        let left = Arc::new(AtomicU64::new(ops));
        let tasks: Vec<_> = (0..TASKS)
            .map(|_| {
                let (raw, warden, left) = (raw.clone(), warden.clone(), left.clone());
                let side = side.to_owned();
                tokio::spawn(async move {
                    while left
                        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                        .is_ok()
                    {
                        if side == "raw" {
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
            })
            .collect();
        for t in tasks {
            t.await?;
        }
        eprintln!("{side}: {ops} operations");
        Ok(())
    })
}

/// `--profile checkout raw|pgwarden OPS`: benchmark 2's loop (one task on a
/// current-thread runtime, pool 16, a connection already open: `get` then
/// drop), for a profiler. Subtract the run with OPS = 0 to leave set-up out.
fn checkout(side: &str, ops: u64) -> Result<(), BoxError> {
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
