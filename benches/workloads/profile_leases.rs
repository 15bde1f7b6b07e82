//! `--profile-leases raw|pgwarden OPS`: one side of workload 4 (16 tasks,
//! pool 16, a lease acquire + release per operation, a new name each) for a
//! fixed number of operations, for a profiler, as `--profile` does for
//! workload 1. The server runs in its own processes and is not counted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgwarden::{LeaseOptions, Leases, Pool, PoolerMode};
use pgwarden_testing::TestServer;

use crate::leases::{install, Raw};
use crate::BoxError;

const TASKS: usize = 16;
const POOL: usize = 16;

pub fn profile_main(args: &[String]) -> Result<(), BoxError> {
    let (side, ops) = match args {
        [side, ops, ..] => (side.to_owned(), ops.parse::<u64>()?),
        _ => return Err("usage: --profile-leases raw|pgwarden OPS".into()),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let db = TestServer::shared()?.create_database().await?;
        install(&db).await?;
        let raw = Arc::new(Raw::new(&db, POOL)?);
        let warden = Pool::builder(db.deadpool(POOL)?)
            .name("bench-profile")
            .pooler(PoolerMode::Direct)
            .build()?;
        let leases = Leases::new(&warden);
        let left = Arc::new(AtomicU64::new(ops));
        let next = Arc::new(AtomicU64::new(0));
        let tasks: Vec<_> = (0..TASKS)
            .map(|_| {
                let (raw, leases, left, next) =
                    (raw.clone(), leases.clone(), left.clone(), next.clone());
                let side = side.clone();
                tokio::spawn(async move {
                    while left
                        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                        .is_ok()
                    {
                        let name = format!("pp-{}", next.fetch_add(1, Ordering::Relaxed));
                        if side == "raw" {
                            raw.pair(&name).await.expect("raw pair");
                        } else {
                            let lease = leases
                                .acquire(&name, &LeaseOptions::new(Duration::from_secs(60)), None)
                                .await
                                .expect("acquire")
                                .expect("a new name is free");
                            lease.release().await.expect("release");
                        }
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await?;
        }
        eprintln!("{side}: {ops} lease pairs");
        Ok(())
    })
}
