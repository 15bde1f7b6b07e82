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

pub(crate) const GUARD: Duration = Duration::from_secs(60);

/// A user statement that fails (in a transaction: aborts it) with 22012,
/// division by zero, 20 ms into its run: the divisor is computed at run
/// time (`pg_sleep` returns a void that is not null), so its answer never
/// comes at a cut-off probe's first poll. `SELECT 1/0` failed at plan time,
/// and on a quiet machine a probe's 20 tries of a statement cut off before
/// its answer all got the answer at the first poll (sqlx 0.9).
pub(crate) const FAILS: &str = "SELECT 1/(pg_sleep(0.02) IS NULL)::int";

/// Sessions of `raw`'s database in a transaction while idle (open or
/// failed): a connection back in the pool in one. The state is the
/// backend's own, set before it says it is ready for the next query.
///
/// A connection the pool closed (a spoiled checkout) can leave its backend
/// in the list for a moment after the client let go: the server ends it
/// when it reads the closed socket, which on a loaded machine took long
/// enough to be counted (`begin_cut_off_at_every_await`, sqlx 0.8, once).
/// So a count above 0 is asked again until it is 0 or 5 s have passed: a
/// connection kept in the pool idle in a transaction stays so and is
/// counted; a closed one's backend is gone within that.
pub(crate) async fn idle_in_transaction(raw: &tokio_postgres::Client) -> i64 {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let n: i64 = raw
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                  WHERE datname = current_database() AND pid <> pg_backend_pid() \
                    AND state IN ('idle in transaction', 'idle in transaction (aborted)')",
                &[],
            )
            .await
            .expect("pg_stat_activity")
            .get(0);
        if n == 0 || std::time::Instant::now() >= deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What went back to the pool: connections holding an advisory lock (the
/// watched pool's hook; a failed ask counts), and sessions left idle in a
/// transaction.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Left {
    pub(crate) locked: usize,
    pub(crate) in_transaction: i64,
}

pub(crate) const CLEAN: Left = Left {
    locked: 0,
    in_transaction: 0,
};

/// Takes lock `key`, runs `sqls` on its own connection (user code; only
/// [`FAILS`] fails), then drops the guard (`drop`) or unlocks it;
/// afterwards, what went back to the pool: the sessions in a transaction
/// once the release is done, then every connection is checked out once
/// more so that deadpool's hook looks at them all.
async fn leave<B: Backend>(
    name: &'static str,
    key: i64,
    sqls: &[&'static str],
    drop_it: bool,
) -> Left {
    let db = db().await;
    let raw = db.connect().await.unwrap();
    let s = Settings::new(name, 4).budget(1, BudgetPolicy::Refuse);
    let (pool, dirty) = B::build_watched(&db, &s);
    let mut lock = B::session_lock(&pool, LockKey::Single(key), LockMode::Exclusive, None)
        .await
        .unwrap()
        .expect("free");
    for sql in sqls {
        let ran = B::lock_sql(&mut lock, sql).await;
        assert_eq!(ran.is_ok(), *sql != FAILS, "{sql}: {ran:?}");
    }
    if drop_it {
        drop(lock);
    } else {
        // Its answer is not the point: where the connection goes is.
        let _ = B::unlock(lock).await;
    }
    settled::<B>(&pool).await;
    let in_transaction = idle_in_transaction(&raw).await;
    // Deadpool's hook runs when a connection is handed out again.
    let mut all = Vec::new();
    for _ in 0..2 {
        let mut c = within(GUARD, "checkout", B::get(&pool)).await.unwrap();
        B::select_1(&mut c).await;
        all.push(c);
    }
    drop(all);
    settled::<B>(&pool).await;
    Left {
        locked: dirty.load(Ordering::Acquire),
        in_transaction,
    }
}

backends!(an_open_transaction_with_an_xact_lock_on_a_dropped_guard);
/// Found by the hostile reader (failed on every backend before the fix:
/// the hook saw the xact lock, the session was idle in transaction).
/// User code opens a transaction on the lock's connection and takes a
/// transaction-scoped advisory lock there (`BEGIN`;
/// `pg_advisory_xact_lock(9101)`), then the guard is dropped. The
/// release's `pg_advisory_unlock_all()` releases session locks only and
/// succeeded inside the open transaction: the connection went back to the
/// pool in it, holding the xact lock. Now the release ends the transaction
/// in the same round trip (`BEGIN; ROLLBACK`, then the unlock).
async fn an_open_transaction_with_an_xact_lock_on_a_dropped_guard<B: Backend>() {
    let left = leave::<B>(
        "hostile-rel-xact-drop",
        9100,
        &["BEGIN", "SELECT pg_advisory_xact_lock(9101)"],
        true,
    )
    .await;
    assert_eq!(left, CLEAN, "what went back to the pool");
}

backends!(an_open_transaction_with_an_xact_lock_then_unlock);
/// The same open transaction, then `unlock()`: its last level's statement
/// ends the transaction too (failed on every backend before the fix).
async fn an_open_transaction_with_an_xact_lock_then_unlock<B: Backend>() {
    let left = leave::<B>(
        "hostile-rel-xact-unlock",
        9102,
        &["BEGIN", "SELECT pg_advisory_xact_lock(9103)"],
        false,
    )
    .await;
    assert_eq!(left, CLEAN, "what went back to the pool");
}

backends!(an_aborted_transaction_on_a_dropped_guard);
/// User code's transaction failed (`BEGIN`; `SELECT 1/0`) and was left
/// so: every statement but its end is refused there. The release ends it
/// and unlocks (before the fix the unlock failed twice with 25P02 and the
/// connection was closed: nothing leaked, at the cost of a connection).
async fn an_aborted_transaction_on_a_dropped_guard<B: Backend>() {
    let left = leave::<B>(
        "hostile-rel-aborted-drop",
        9104,
        &["BEGIN", "SELECT pg_advisory_xact_lock(9105)", FAILS],
        true,
    )
    .await;
    assert_eq!(left, CLEAN, "what went back to the pool");
}

backends!(an_aborted_transaction_then_unlock);
/// The same failed transaction, then `unlock()`.
async fn an_aborted_transaction_then_unlock<B: Backend>() {
    let left = leave::<B>(
        "hostile-rel-aborted-unlock",
        9106,
        &["BEGIN", "SELECT pg_advisory_xact_lock(9107)", FAILS],
        false,
    )
    .await;
    assert_eq!(left, CLEAN, "what went back to the pool");
}

backends!(a_session_lock_taken_inside_an_open_transaction_on_a_dropped_guard);
/// User code takes a session lock inside its open transaction (`BEGIN`;
/// `pg_advisory_lock(9109)`): a session lock outlives the transaction's
/// rollback, so the release must end the transaction and still release
/// it.
async fn a_session_lock_taken_inside_an_open_transaction_on_a_dropped_guard<B: Backend>() {
    let left = leave::<B>(
        "hostile-rel-session-in-tx-drop",
        9108,
        &["BEGIN", "SELECT pg_advisory_lock(9109)"],
        true,
    )
    .await;
    assert_eq!(left, CLEAN, "what went back to the pool");
}

backends!(a_session_lock_taken_inside_an_open_transaction_then_unlock);
/// The same, then `unlock()`.
async fn a_session_lock_taken_inside_an_open_transaction_then_unlock<B: Backend>() {
    let left = leave::<B>(
        "hostile-rel-session-in-tx-unlock",
        9118,
        &["BEGIN", "SELECT pg_advisory_lock(9119)"],
        false,
    )
    .await;
    assert_eq!(left, CLEAN, "what went back to the pool");
}

/// A statement that runs long enough to be seen running (the release
/// waits for it, well within the 5 s unlock timeout).
const SLOW: &str = "SELECT pg_sleep(1)";

backends!(a_statement_in_an_open_transaction_cut_off_then_dropped);
/// User code opens a transaction with an xact lock on the lock's
/// connection, sends a slow statement ([`SLOW`]) and gives up on
/// it (its future dropped once it is pending, the statement still running
/// on the server), then drops the guard: the release's statements follow
/// the slow one, end the transaction and unlock, within the unlock
/// timeout.
async fn a_statement_in_an_open_transaction_cut_off_then_dropped<B: Backend>() {
    let db = db().await;
    let raw = db.connect().await.unwrap();
    let s = Settings::new("hostile-rel-cut-in-tx", 4).budget(1, BudgetPolicy::Refuse);
    let (pool, dirty) = B::build_watched(&db, &s);
    let mut lock = B::session_lock(&pool, LockKey::Single(9160), LockMode::Exclusive, None)
        .await
        .unwrap()
        .expect("free");
    for sql in ["BEGIN", "SELECT pg_advisory_xact_lock(9161)"] {
        B::lock_sql(&mut lock, sql).await.unwrap();
    }
    {
        let mut slow = std::pin::pin!(B::lock_sql(&mut lock, SLOW));
        // Polled until the server runs it (it shows in pg_stat_activity),
        // then given up on.
        let running = async {
            loop {
                let ended = futures_util::poll!(slow.as_mut()).is_ready();
                assert!(!ended, "the slow statement ended before it was seen");
                let seen: i64 = raw
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity \
                          WHERE datname = current_database() AND query = $1 \
                            AND state = 'active'",
                        &[&SLOW],
                    )
                    .await
                    .unwrap()
                    .get(0);
                if seen == 1 {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        within(GUARD, "the slow statement running", running).await;
    }
    drop(lock);
    settled::<B>(&pool).await;
    assert_eq!(idle_in_transaction(&raw).await, 0, "idle in transaction");
    let mut all = Vec::new();
    for _ in 0..2 {
        let mut c = within(GUARD, "checkout", B::get(&pool)).await.unwrap();
        B::select_1(&mut c).await;
        all.push(c);
    }
    drop(all);
    settled::<B>(&pool).await;
    assert_eq!(dirty.load(Ordering::Acquire), 0, "back holding a lock");
    assert!(raw_locks(&raw).await.is_empty(), "advisory locks left");
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
    let left = leave::<B>(
        "hostile-rel-extra-unlock",
        9110,
        &["SELECT pg_advisory_lock(9111)"],
        false,
    )
    .await;
    assert_eq!(left, CLEAN, "what went back to the pool");
}

backends!(a_lock_user_code_took_goes_with_a_dropped_guard);
/// The same extra lock, the guard dropped: the release's
/// `pg_advisory_unlock_all()` takes it too.
async fn a_lock_user_code_took_goes_with_a_dropped_guard<B: Backend>() {
    let left = leave::<B>(
        "hostile-rel-extra-drop",
        9120,
        &["SELECT pg_advisory_lock(9121)"],
        true,
    )
    .await;
    assert_eq!(left, CLEAN, "what went back to the pool");
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
/// is what a cut-off statement leaves for the release on sqlx; in a
/// transaction they abort it), slow ones, one that takes another session
/// lock, one that opens a transaction and one that takes a transaction
/// lock (held to the transaction's end when one is open).
const USER_SQL: [&str; 7] = [
    "SELECT 1/0",
    "SELECT pg_sleep(0.002)",
    "SELECT pg_advisory_lock(9131)",
    "SELECT no_such_column",
    "SELECT 1",
    "BEGIN",
    "SELECT pg_advisory_xact_lock(9131)",
];

backends!(
    user_statements_cut_off_on_the_lock_connection_then_dropped,
    flavor = "multi_thread",
    worker_threads = 2
);
/// The retry's property: tasks take a lock, run a random number of user
/// statements on its connection (failing, slow, one taking another lock),
/// each cut off at a random poll or run to its end (a transaction left
/// open, failed, or holding a transaction lock), then drop the guard
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
                    for _ in 0..next() % 4 {
                        let sql = USER_SQL[(next() % USER_SQL.len() as u64) as usize];
                        // 9131 is one key for all tasks: its own task waits.
                        // (Its xact lock conflicts with its session lock held
                        // by another connection of the same task: never, the
                        // task's earlier guards released theirs.)
                        let sql = if sql.contains("9131") && t != 0 {
                            "SELECT 2"
                        } else {
                            sql
                        };
                        cut += u64::from(
                            maybe_cut(B::lock_sql(&mut lock, sql), next())
                                .await
                                .is_none(),
                        );
                    }
                    match next() % 3 {
                        0 => {
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
    assert_eq!(idle_in_transaction(&raw).await, 0, "idle in transaction");
    eventually(GUARD, "no advisory lock left", || async {
        raw_locks(&raw).await.is_empty()
    })
    .await;
}
