//! The load the failover scenario runs under: request tasks, fenced writers
//! contending for one lease, and a scheduled job that writes fenced rows.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgwarden::{Job, LeaseHandle, LeaseOptions, Scheduler};
use tokio::task::JoinHandle;

use super::common::{fenced_write, Row, Tokens, WriteError, STEP};
use crate::support::backend::Backend;

/// What one request saw: when it ended, and the port of the server that
/// answered (or the error).
pub type Request = (Instant, Result<u16, String>);

/// Request traffic: `tasks` tasks, each checking out a request connection,
/// asking which server answers, and going again (10 ms after a success,
/// 25 ms after a failure) until `stop`.
pub fn requests<B: Backend>(
    pool: &B::Pool,
    tasks: usize,
    stop: &Arc<AtomicBool>,
    log: &Arc<Mutex<Vec<Request>>>,
) -> Vec<JoinHandle<()>> {
    (0..tasks)
        .map(|_| {
            let (pool, stop, log) = (pool.clone(), stop.clone(), log.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let r = tokio::time::timeout(STEP, async {
                        let mut c = B::get(&pool).await.map_err(|e| e.to_string())?;
                        let sql = "SELECT inet_server_port()::int8 WHERE NOT pg_is_in_recovery()";
                        let port = B::scalar(&mut c, sql).await?;
                        u16::try_from(port).map_err(|e| e.to_string())
                    })
                    .await
                    .unwrap_or_else(|_| Err(format!("not done within {STEP:?}")));
                    let pause = if r.is_ok() { 10 } else { 25 };
                    log.lock().unwrap().push((Instant::now(), r));
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                }
            })
        })
        .collect()
}

/// Acknowledged fenced writes, with when they were acknowledged.
pub type Acked = Arc<Mutex<Vec<(Instant, Row)>>>;

/// The lease the writers contend for.
pub const WRITER_LEASE: &str = "writer";

/// A fenced writer: takes the `writer` lease when free (TTL 3 s), writes up
/// to 5 fenced rows under it, releases it, and goes again until `stop`.
/// While the database is away it retries under the same term, until the
/// term is lost.
pub fn writer<B: Backend>(
    leases: B::Leases,
    pool: B::Pool,
    stop: Arc<AtomicBool>,
    tokens: Tokens,
    acked: Acked,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let opts = LeaseOptions::new(Duration::from_secs(3));
        while !stop.load(Ordering::Relaxed) {
            let lease = match B::acquire(&leases, WRITER_LEASE, &opts, None).await {
                Ok(Some(lease)) => lease,
                Ok(None) => {
                    tokio::time::sleep(Duration::from_millis(15)).await;
                    continue;
                }
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            tokens.record(lease.term().token, "writer");
            let handle = LeaseHandle::clone(&*lease);
            let mut seq = 0;
            while seq < 5 && !handle.is_lost() && !stop.load(Ordering::Relaxed) {
                match fenced_write::<B>(&pool, &handle, seq).await {
                    Ok(row) => {
                        acked.lock().unwrap().push((Instant::now(), row));
                        seq += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    Err(WriteError::Rejected(_)) => break,
                    Err(WriteError::Failed(_)) => {
                        tokio::time::sleep(Duration::from_millis(50)).await
                    }
                }
            }
            // Taken over, expired or lost: an error here is expected.
            let _ = tokio::time::timeout(STEP, B::release(lease)).await;
            let pause = rand::random::<u64>() % 20;
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
    })
}

/// The scheduled job: every second on exactly one of the schedulers, a
/// fenced row under the job's lease (TTL 3 s).
pub const JOB: &str = "tick";

/// A scheduler on `leases` running [`JOB`] on `pool`.
pub fn scheduler<B: Backend>(
    leases: &B::Leases,
    pool: &B::Pool,
    tokens: &Tokens,
    acked: &Acked,
) -> Scheduler {
    let (pool, tokens, acked) = (pool.clone(), tokens.clone(), acked.clone());
    let job = Job::every(JOB, Duration::from_secs(1), move |lease| {
        let (pool, tokens, acked) = (pool.clone(), tokens.clone(), acked.clone());
        async move {
            tokens.record(lease.term().token, "job");
            let row = fenced_write::<B>(&pool, &lease, 0)
                .await
                .map_err(|e| format!("{e:?}"))?;
            acked.lock().unwrap().push((Instant::now(), row));
            Ok::<(), String>(())
        }
    })
    .options(LeaseOptions::new(Duration::from_secs(3)));
    B::schedule(leases, vec![job]).expect("scheduler")
}
