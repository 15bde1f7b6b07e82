//! `--profile raw|pgwarden OPS`: one side of workload 1 (64 tasks, pool 16,
//! `get` + `SELECT 1`) for a fixed number of operations, for a profiler:
//!
//! ```sh
//! cargo bench --bench workloads --no-run   # prints the binary's path
//! valgrind --tool=callgrind target/release/deps/workloads-… --profile pgwarden 20000
//! ```
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
