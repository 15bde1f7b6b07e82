//! 1,000 session-lock acquisitions cancelled at random points, dropped at
//! random, unlocked half-way: afterwards no lock is left on the pool's
//! backends and the pool is back to full strength. On every backend.

use std::time::{Duration, Instant};

use futures_util::FutureExt;
use pgwarden::{Error, Lane, LockError, LockKey, LockMode};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::support::backend::{Backend, Settings};
use super::support::*;

const WORKERS: u64 = 4;
const PER_WORKER: usize = 250;
/// Held by a raw session throughout: acquisitions of it wait, and are
/// cancelled while waiting on the server.
const CONTENDED: LockKey = LockKey::Single(99);

#[derive(Debug, Default)]
struct Tally {
    granted: usize,
    not_granted: usize,
    refused: usize,
    cancelled: usize,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.granted += o.granted;
        self.not_granted += o.not_granted;
        self.refused += o.refused;
        self.cancelled += o.cancelled;
    }
}

fn key(rng: &mut StdRng) -> LockKey {
    match rng.gen_range(0..8) {
        n if n % 2 == 0 => LockKey::Single(i64::from(n / 2)),
        n => LockKey::Pair(1, n / 2),
    }
}

/// Polls `fut` up to `polls` times, yielding between polls so that the
/// connection task makes progress; `None` when it was not ready (dropped).
async fn poll_then_drop<F: std::future::Future>(fut: F, polls: usize) -> Option<F::Output> {
    let mut fut = std::pin::pin!(fut);
    for _ in 0..polls {
        if let Some(v) = fut.as_mut().now_or_never() {
            return Some(v);
        }
        tokio::task::yield_now().await;
    }
    None
}

/// What happens to a granted lock: unlocked, re-entered, dropped, or its
/// unlock cancelled mid-flight.
async fn finish<B: Backend>(mut lock: B::Lock, rng: &mut StdRng) {
    match rng.gen_range(0..6) {
        0 | 1 => B::unlock(lock).await.unwrap(),
        2 => {
            B::lock_again(&mut lock).await.unwrap();
            if rng.gen_bool(0.5) {
                B::unlock_one(&mut lock).await.unwrap();
            }
            B::unlock(lock).await.unwrap();
        }
        3 => drop(lock),
        4 => {
            let polls = rng.gen_range(0..4);
            drop(poll_then_drop(B::unlock(lock), polls).await);
        }
        _ => {
            let polls = rng.gen_range(0..4);
            drop(poll_then_drop(B::lock_again(&mut lock), polls).await);
            if rng.gen_bool(0.5) {
                drop(lock);
            } else {
                B::unlock(lock).await.unwrap();
            }
        }
    }
}

/// One acquisition, cancelled or not at a random point.
async fn attempt<B: Backend>(pool: &B::Pool, rng: &mut StdRng) -> Option<Result<B::Lock, Error>> {
    let key = key(rng);
    let wait = Duration::from_millis(rng.gen_range(20..200));
    match rng.gen_range(0..20) {
        // Waiting on the server (the raw session holds it) when cancelled,
        // with a wait (2 s) longer than the unlock timeout: closed.
        0 => {
            let within = Duration::from_micros(rng.gen_range(0..3000));
            tokio::time::timeout(
                within,
                wait_lock::<B>(pool, CONTENDED, LockMode::Exclusive, Duration::from_secs(2)),
            )
            .await
            .ok()
        }
        // Cancelled by a tiny timeout, at whatever point it reached.
        1..=8 => {
            let within = Duration::from_micros(rng.gen_range(0..1500));
            let fut = if rng.gen_bool(0.25) {
                wait_lock::<B>(pool, key, LockMode::Shared, wait).boxed()
            } else {
                wait_lock::<B>(pool, key, LockMode::Exclusive, wait).boxed()
            };
            tokio::time::timeout(within, fut).await.ok()
        }
        // Polled a few times, then dropped.
        9..=12 => {
            poll_then_drop(
                wait_lock::<B>(pool, key, LockMode::Exclusive, wait),
                rng.gen_range(1..6),
            )
            .await
        }
        13..=15 => Some(
            match B::session_lock(pool, key, LockMode::Exclusive, None).await {
                Ok(Some(l)) => Ok(l),
                Ok(None) => Err(Error::Lock(LockError::Timeout {
                    key,
                    timeout: Duration::ZERO,
                })),
                Err(e) => Err(e),
            },
        ),
        _ => Some(wait_lock::<B>(pool, key, LockMode::Exclusive, wait).await),
    }
}

async fn worker<B: Backend>(pool: B::Pool, seed: u64) -> Tally {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = Tally::default();
    let mut done = 0;
    while done < PER_WORKER {
        match attempt::<B>(&pool, &mut rng).await {
            None => t.cancelled += 1,
            Some(Ok(lock)) => {
                t.granted += 1;
                assert_eq!(B::lock_lane(&lock), Lane::SessionLock);
                finish::<B>(lock, &mut rng).await;
            }
            Some(Err(e)) if e.is_lock_timeout() => t.not_granted += 1,
            Some(Err(e)) if e.is_budget_exhausted() || e.is_timeout() => {
                // The budget at work (guards being released hold their
                // connection until it is confirmed; a checkout waits for
                // them within its bound): wait for a slot, retry.
                t.refused += 1;
                let full = || B::status(&pool).lane(Lane::SessionLock).in_use >= 4;
                eventually(Duration::from_secs(5), "a session-lock slot", || async {
                    !full()
                })
                .await;
                continue;
            }
            Some(Err(e)) => panic!("unexpected error: {e}"),
        }
        done += 1;
    }
    t
}

backends!(thousand_cancelled_and_dropped_acquisitions_leave_no_lock);
async fn thousand_cancelled_and_dropped_acquisitions_leave_no_lock<B: Backend>() {
    let logs = Logs::default();
    let _log = tracing::subscriber::set_default(logs.subscriber());
    let db = db().await;
    let raw = db.connect().await.unwrap();
    raw.execute("SELECT pg_advisory_lock(99)", &[])
        .await
        .unwrap();
    let raw_pid: i32 = raw
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let s = Settings::new("thousand", 6)
        .budget(4, pgwarden::BudgetPolicy::Refuse)
        .unlock_timeout(Duration::from_millis(300));
    let pool = B::build(&db, &s);

    let seed: u64 = std::env::var("PGWARDEN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let start = Instant::now();
    let tasks: Vec<_> = (0..WORKERS)
        .map(|w| tokio::spawn(worker::<B>(pool.clone(), seed + w)))
        .collect();
    let mut t = Tally::default();
    for task in tasks {
        t.add(&task.await.unwrap());
    }
    let ran = start.elapsed();
    assert_eq!(t.granted + t.not_granted + t.cancelled, 1000);

    eventually(Duration::from_secs(10), "every connection back", || async {
        B::status(&pool).in_use == 0
    })
    .await;
    let census = B::census(&pool).await.unwrap();
    let ours: Vec<_> = census.ours().collect();
    assert!(
        ours.is_empty(),
        "locks left on the pool's backends: {ours:?}"
    );
    // Closed backends that were still waiting end once their wait does:
    // then only the raw session's lock is left in the database.
    eventually(
        Duration::from_secs(10),
        "only the raw session holds locks",
        || async { raw_locks(&raw).await.iter().all(|l| l.0 == raw_pid) },
    )
    .await;

    // Full strength: every request connection, and the probe reserve
    // answering while they are all out.
    let mut held = Vec::new();
    for _ in 0..5 {
        held.push(B::get_within(&pool, Duration::from_secs(2)).await.unwrap());
    }
    B::readiness(&pool, Duration::from_secs(60)).await.unwrap();
    for c in &mut held {
        B::select_1(c).await;
    }
    drop(held);
    super::support::backend::settled::<B>(&pool).await;

    let text = logs.text();
    let unlocked = text.matches("released after its guard was dropped").count();
    let closed = text
        .matches("not confirmed in time: closing its connection")
        .count();
    let failed = text
        .matches("release failed: closing its connection")
        .count();
    eprintln!(
        "{}: seed {seed}: {t:?} in {ran:.2?}; drop path: {unlocked} unlocked and returned, {closed} closed; \
         total with checks {:.2?}",
        B::NAME,
        start.elapsed(),
    );
    assert!(unlocked > 0, "the drop path ran");
    assert!(
        closed > 0,
        "cancelled waits outlasting the unlock timeout were closed"
    );
    assert_eq!(failed, 0, "no release statement failed");
}

/// A waiting session lock: granted, or an error (a wait never answers
/// `None`: a wait that runs out is a `LockTimeout`).
async fn wait_lock<B: Backend>(
    pool: &B::Pool,
    key: LockKey,
    mode: LockMode,
    wait: Duration,
) -> Result<B::Lock, Error> {
    B::session_lock(pool, key, mode, Some(wait))
        .await?
        .ok_or(Error::Lock(LockError::Timeout { key, timeout: wait }))
}
