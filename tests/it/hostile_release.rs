//! Hostile probes of the session-lock release (session 37: unlock-all
//! retried once on a database error, the lock-timeout dirty path): user
//! statements on the lock's own connection, cut off or left half-done,
//! then the guard dropped or unlocked. The oracle is the watched pool's
//! hook (`Backend::build_watched`): a connection that comes back (sqlx) or
//! is handed out again (deadpool) holding any advisory lock counts. Probes
//! that found a bug are marked `FINDING`, assert the right behaviour and
//! are ignored until it is fixed.

use crate::support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use pgwarden::{BudgetPolicy, LockKey, LockMode};
use support::backend::{settled, Backend, Settings};
use support::{db, eventually, raw_locks, within};

const GUARD: Duration = Duration::from_secs(60);

/// Takes lock `key`, runs `sqls` on its own connection (user code), then
/// drops the guard (`drop`) or unlocks it; afterwards every connection is
/// checked out once more so that deadpool's hook looks at them all.
async fn leave<B: Backend>(
    name: &'static str,
    key: i64,
    sqls: &[&'static str],
    drop_it: bool,
) -> usize {
    let db = db().await;
    let s = Settings::new(name, 4).budget(1, BudgetPolicy::Refuse);
    let (pool, dirty) = B::build_watched(&db, &s);
    let mut lock = B::session_lock(&pool, LockKey::Single(key), LockMode::Exclusive, None)
        .await
        .unwrap()
        .expect("free");
    for sql in sqls {
        B::lock_sql(&mut lock, sql).await.unwrap();
    }
    if drop_it {
        drop(lock);
    } else {
        // Its answer is not the point: where the connection goes is.
        let _ = B::unlock(lock).await;
    }
    settled::<B>(&pool).await;
    // Deadpool's hook runs when a connection is handed out again.
    let mut all = Vec::new();
    for _ in 0..2 {
        let mut c = within(GUARD, "checkout", B::get(&pool)).await.unwrap();
        B::select_1(&mut c).await;
        all.push(c);
    }
    drop(all);
    settled::<B>(&pool).await;
    dirty.load(Ordering::Acquire)
}

backends!(
    ignore_all = "FINDING: a transaction left open on the lock's connection goes back to the pool with its xact lock",
    an_open_transaction_with_an_xact_lock_on_a_dropped_guard
);
/// FINDING. User code opens a transaction on the lock's connection and
/// takes a transaction-scoped advisory lock there (`BEGIN`;
/// `pg_advisory_xact_lock(9101)`), then the guard is dropped. The release's
/// `pg_advisory_unlock_all()` releases session locks only, succeeds inside
/// the open transaction, and the connection goes back to the pool in that
/// transaction, holding the xact lock. Expected: no connection back in the
/// pool holding an advisory lock (the release ends the transaction, or
/// closes a connection not idle).
async fn an_open_transaction_with_an_xact_lock_on_a_dropped_guard<B: Backend>() {
    let found = leave::<B>(
        "hostile-rel-xact-drop",
        9100,
        &["BEGIN", "SELECT pg_advisory_xact_lock(9101)"],
        true,
    )
    .await;
    assert_eq!(found, 0, "connections back in the pool holding a lock");
}

backends!(unlock_with_a_lock_user_code_took_on_the_connection);
/// Found by the hostile reader (failed on every backend before the fix):
/// user code takes another session lock on the lock's connection
/// (`pg_advisory_lock(9111)`, raw SQL), then `unlock()`. It released the
/// guard's levels one by one (`pg_advisory_unlock`) and returned the
/// connection with 9111 still held, where the drop path
/// (`pg_advisory_unlock_all()`) would not. Now the last level's statement
/// releases the rest once PostgreSQL confirmed the guard's own: no
/// connection back in the pool holding an advisory lock.
async fn unlock_with_a_lock_user_code_took_on_the_connection<B: Backend>() {
    let found = leave::<B>(
        "hostile-rel-extra-unlock",
        9110,
        &["SELECT pg_advisory_lock(9111)"],
        false,
    )
    .await;
    assert_eq!(found, 0, "connections back in the pool holding a lock");
}

backends!(a_lock_user_code_took_goes_with_a_dropped_guard);
/// The same extra lock, the guard dropped: the release's
/// `pg_advisory_unlock_all()` takes it too.
async fn a_lock_user_code_took_goes_with_a_dropped_guard<B: Backend>() {
    let found = leave::<B>(
        "hostile-rel-extra-drop",
        9120,
        &["SELECT pg_advisory_lock(9121)"],
        true,
    )
    .await;
    assert_eq!(found, 0, "connections back in the pool holding a lock");
}

/// Runs `fut` to its end, or cuts it off after a random number of polls
/// (up to 12; its I/O goes on between them). `None`: cut off.
async fn maybe_cut<F: std::future::Future>(fut: F, r: u64) -> Option<F::Output> {
    use std::task::Poll;
    if r % 3 == 0 {
        return Some(fut.await);
    }
    let mut fut = std::pin::pin!(fut);
    for _ in 0..(r >> 4) % 12 {
        if let Poll::Ready(v) = futures_util::poll!(fut.as_mut()) {
            return Some(v);
        }
        tokio::task::yield_now().await;
    }
    None
}

/// User statements for the lock's connection: failing ones (their error
/// is what a cut-off statement leaves for the release on sqlx), slow ones,
/// one that takes another session lock.
const USER_SQL: [&str; 5] = [
    "SELECT 1/0",
    "SELECT pg_sleep(0.002)",
    "SELECT pg_advisory_lock(9131)",
    "SELECT no_such_column",
    "SELECT 1",
];

backends!(
    user_statements_cut_off_on_the_lock_connection_then_dropped,
    flavor = "multi_thread",
    worker_threads = 2
);
/// The retry's property: tasks take a lock, run a random number of user
/// statements on its connection (failing, slow, one taking another lock),
/// each cut off at a random poll or run to its end, then drop the guard
/// (the release's first answer may be a cut-off statement's error). With
/// `HOSTILE_RELEASE_SECS` set, it loops that long. Afterwards: no
/// connection came back holding a lock, none is left in `pg_locks`.
async fn user_statements_cut_off_on_the_lock_connection_then_dropped<B: Backend>() {
    let secs: u64 = std::env::var("HOSTILE_RELEASE_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let db = db().await;
    let raw = db.connect().await.unwrap();
    let s = Settings::new("hostile-rel-cut", 6).budget(4, BudgetPolicy::Refuse);
    let (pool, dirty) = B::build_watched(&db, &s);
    let until = std::time::Instant::now() + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..4u64)
        .map(|t| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let mut x = (t + 11).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                let mut next = move || {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x
                };
                let (mut rounds, mut cut) = (0u64, 0u64);
                loop {
                    rounds += 1;
                    let key = LockKey::Single(9130 - (t as i64));
                    let got = B::session_lock(&pool, key, LockMode::Exclusive, None).await;
                    let Ok(Some(mut lock)) = got else { continue };
                    let mut extra = false;
                    for _ in 0..next() % 4 {
                        let sql = USER_SQL[(next() % USER_SQL.len() as u64) as usize];
                        // 9131 is one key for all tasks: its own task waits.
                        let sql = if sql.contains("9131") && t != 0 {
                            "SELECT 2"
                        } else {
                            sql
                        };
                        extra |= sql.contains("9131");
                        cut += u64::from(
                            maybe_cut(B::lock_sql(&mut lock, sql), next())
                                .await
                                .is_none(),
                        );
                    }
                    // unlock() leaves a lock user code took (probed above).
                    match next() % 3 {
                        0 if !extra => {
                            let _ = maybe_cut(B::unlock(lock), next()).await;
                        }
                        _ => drop(lock),
                    }
                    if rounds >= 60 && std::time::Instant::now() >= until {
                        return (rounds, cut);
                    }
                }
            })
        })
        .collect();
    let (mut rounds, mut cut) = (0, 0);
    for t in tasks {
        let (r, c) = within(GUARD + Duration::from_secs(secs), "a task", t)
            .await
            .unwrap();
        (rounds, cut) = (rounds + r, cut + c);
    }
    println!("{}: {rounds} rounds, {cut} statements cut off", B::NAME);
    assert!(cut > 0, "nothing was cut off");
    settled::<B>(&pool).await;
    let mut all = Vec::new();
    for _ in 0..4 {
        let mut c = within(GUARD, "checkout", B::get(&pool)).await.unwrap();
        B::select_1(&mut c).await;
        all.push(c);
    }
    drop(all);
    settled::<B>(&pool).await;
    assert_eq!(
        dirty.load(Ordering::Acquire),
        0,
        "connections back in the pool holding a lock"
    );
    eventually(GUARD, "no advisory lock left", || async {
        raw_locks(&raw).await.is_empty()
    })
    .await;
}
