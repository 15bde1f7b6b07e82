//! Hostile probes (stop 40) of the mechanisms built this stop: the
//! release's statement in a transaction of its own at READ COMMITTED, the
//! readiness probe that waits for a set-up kept in the background, sqlx's
//! own connection attempt when its connect is slow (`take_heard`, the
//! server's 53300), and the sqlx drop-in `close()`.
//!
//! The oracle of the soak is `hostile_release3`'s round: after each
//! release, every connection of the pool checked out at once answers its
//! own `SELECT <k>`, no advisory lock is left (`pg_locks`), no session is
//! anything but idle (no transaction id), and the lock's connection went
//! back unless something made closing it the right call.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use pgwarden::{LockKey, LockMode};
use support::backend::{Backend, Settings};
use support::{eventually, raw_locks, within};

use crate::hostile_release::GUARD;
use crate::hostile_release3::{busy, in_step, round, setup, How, Raw, ALL, CASES, POOL};

/// `SELECT pg_sleep(..)` for a plain checkout's statement given up on.
const SLEEPS: &str = "SELECT pg_sleep(0.005)";

/// Ends one idle connection of the pool's database (not `raw`'s) and waits
/// until its backend is gone from `pg_stat_activity` (not with
/// `pg_terminate_backend`'s timeout form: on a busy machine the pid can be
/// another user's process by then, and the server's check of it fails
/// with EPERM): whether there was one.
async fn kill_one_idle(raw: &tokio_postgres::Client) -> bool {
    let row = raw
        .query_opt(
            "SELECT pid FROM pg_stat_activity \
              WHERE datname = current_database() AND pid <> pg_backend_pid() \
                AND backend_type = 'client backend' AND state = 'idle' \
              ORDER BY random() LIMIT 1",
            &[],
        )
        .await
        .unwrap();
    let Some(pid) = row.map(|r| r.get::<_, i32>(0)) else {
        return false;
    };
    raw.execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    eventually(GUARD, "the killed backend gone", || async {
        raw.query_opt("SELECT 1 FROM pg_stat_activity WHERE pid = $1", &[&pid])
            .await
            .unwrap()
            .is_none()
    })
    .await;
    true
}

/// A plain checkout whose statement user code gives up after `polls`
/// polls (0: never polled), then drops.
async fn plain_cut<B: Raw>(pool: &B::Pool, polls: usize) {
    let mut c = within(GUARD, "checkout", B::get(pool)).await.unwrap();
    {
        let mut f = B::try_run(&mut c, SLEEPS);
        for _ in 0..polls {
            if futures_util::poll!(f.as_mut()).is_ready() {
                break;
            }
            tokio::task::yield_now().await;
        }
    }
    drop(c);
}

/// Session defaults user code sets on a plain checkout (they stay on the
/// connection: README): serializable by default, and deferrable.
async fn serializable_session<B: Raw>(pool: &B::Pool) {
    let mut c = within(GUARD, "checkout", B::get(pool)).await.unwrap();
    B::run(
        &mut c,
        "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE, DEFERRABLE",
    )
    .await;
}

/// Randomised rounds for `secs` (at least 20): before each, at random,
/// session defaults set to serializable on a connection, a plain
/// checkout's statement given up on at a random poll, an idle connection
/// of the pool killed on the server (long runs only); then a session lock, one of
/// [`CASES`] left on its connection by user code, its release by
/// `unlock()`, by drop, or `unlock()` dropped at a random poll, sometimes
/// with a `pg_cancel_backend` on the lock's backend at a random instant.
/// After each: `hostile_release3`'s oracle (see the module's docs). A
/// connection closed after a round without a cancel, whose case leaves
/// nothing out of step, is a healthy connection closed without need.
async fn soak<B: Raw>(secs: u64) {
    let (_db, raw, pool) = setup::<B>("hostile-s40-soak", POOL).await;
    let kills_on = std::env::var("HOSTILE_S40_SECS").is_ok();
    let raw = Arc::new(raw);
    let until = Instant::now() + Duration::from_secs(secs);
    let started = Instant::now();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ u64::from(std::process::id());
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let (mut rounds, mut closed, mut kills, mut cuts, mut cancels, mut serial) =
        (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
    let mut needless = Vec::new();
    while Instant::now() < until || rounds < 20 {
        let r = next();
        if r % 4 == 0 {
            serializable_session::<B>(&pool).await;
            serial += 1;
        }
        if (r >> 3) % 4 == 0 {
            plain_cut::<B>(&pool, ((r >> 5) % 4) as usize).await;
            cuts += 1;
        }
        // Kills in the long runs only: once in two 130 s runs on deadpool
        // (about 2,200 rounds each) the next checkout's first statement
        // answered "connection closed" after one (likely deadpool's Fast
        // recycling handing out a connection whose end the client had not
        // read yet; not shown): reported, kept out of the short CI run.
        if kills_on && (r >> 7) % 6 == 0 && kill_one_idle(&raw).await {
            kills += 1;
        }
        let case = CASES[((r >> 10) % CASES.len() as u64) as usize];
        let how = match (r >> 14) % 10 {
            0 => How::Unlock,
            1 => How::Drop,
            n => How::UnlockCut((n - 2) as usize),
        };
        let cancel = ((r >> 18) % 5 == 0).then(|| Duration::from_micros((r >> 21) % 4000));
        cancels += u64::from(cancel.is_some());
        let (back, said) = round::<B>(&pool, &raw, case, how, cancel.map(|d| (&raw, d))).await;
        rounds += 1;
        if !back {
            closed += 1;
            if !case.may_close::<B>() && cancel.is_none() {
                needless.push(format!("{case:?} {how:?} ({said:?})"));
            }
        }
        if let (How::Unlock, None, Some(said)) = (how, cancel, &said) {
            assert!(
                said.is_ok() || case.may_close::<B>(),
                "{case:?}: unlock said {said:?}"
            );
        }
    }
    println!(
        "{}: {rounds} rounds in {:?}: {closed} lock connections closed, {kills} idle \
         connections killed, {cuts} plain statements cut, {cancels} cancels, {serial} \
         sessions set serializable; closed without need: {needless:?}",
        B::NAME,
        started.elapsed()
    );
    assert!(
        needless.is_empty(),
        "healthy connections closed: {needless:?}"
    );
}

/// The soak's length: `HOSTILE_S40_SECS` (a few seconds by default, for
/// CI; the stop-40 runs used 130 s per backend).
fn soak_secs() -> u64 {
    std::env::var("HOSTILE_S40_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
}

backends!(
    random_faults_soak,
    flavor = "multi_thread",
    worker_threads = 2
);
async fn random_faults_soak<B: Raw>() {
    soak::<B>(soak_secs()).await
}

/// One release after user code ran `setting` on the lock's connection:
/// what `unlock()` said; then no advisory lock within 10 s (the unlock is
/// one statement, not a wait), every connection in step and idle, and
/// whether the lock's connection went back.
async fn release_after<B: Raw>(
    pool: &B::Pool,
    raw: &tokio_postgres::Client,
    setting: &'static str,
) -> (Result<(), pgwarden::Error>, bool) {
    let mut lock = within(
        GUARD,
        "lock",
        B::session_lock(pool, LockKey::Single(9400), LockMode::Exclusive, None),
    )
    .await
    .unwrap()
    .expect("free");
    let pid = B::lock_pid(&lock);
    B::lock_sql(&mut lock, setting).await.unwrap();
    let said = within(GUARD, "unlock", B::unlock(lock)).await;
    let gone = tokio::time::timeout(Duration::from_secs(10), async {
        while !raw_locks(raw).await.is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let left = raw_locks(raw).await;
    let pids = in_step::<B>(pool, ALL, setting).await;
    assert!(
        gone.is_ok(),
        "{setting}: unlock said {said:?}; advisory locks left 10 s later: {left:?} (the lock's \
         pid {pid}, in the pool: {})",
        pids.contains(&pid)
    );
    assert_eq!(busy(raw).await, vec![], "{setting}");
    (said, pids.contains(&pid))
}

/// Polls `f` at most `polls` times (yielding in between), then drops it:
/// whether it finished, and its output then.
async fn cut<F: std::future::Future + Unpin>(mut f: F, polls: u64) -> Option<F::Output> {
    for _ in 0..polls {
        if let std::task::Poll::Ready(r) = futures_util::poll!(&mut f) {
            return Some(r);
        }
        tokio::task::yield_now().await;
    }
    None
}

/// One task of the concurrent soak: `ops` operations at random (`seed`),
/// each a checkout dropped at a random poll, a checkout whose own
/// `SELECT '<k>'` must answer `k` (then a statement given up on at a
/// random poll, or not), or a session lock dropped while being taken, or
/// taken and its `unlock()` dropped at a random poll.
async fn task<B: Raw>(pool: &B::Pool, seed: u64, ops: u64) -> u64 {
    static K: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(1 << 40);
    let mut x = seed | 1;
    let mut checked = 0;
    for _ in 0..ops {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let polls = (x >> 8) % 6;
        match x % 4 {
            0 => drop(cut(B::get(pool), polls).await),
            1 => {
                let key = LockKey::Single(9410 + (x >> 16) as i64 % 2);
                let mode = LockMode::Exclusive;
                if (x >> 12) % 2 == 0 {
                    drop(cut(B::session_lock(pool, key, mode, None), polls).await);
                } else if let Ok(Some(lock)) = B::session_lock(pool, key, mode, None).await {
                    drop(cut(B::unlock(lock), polls).await);
                }
            }
            _ => {
                let Ok(mut c) = within(GUARD, "checkout", B::get(pool)).await else {
                    panic!("a checkout failed")
                };
                let k = K.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let sql: &'static str = Box::leak(format!("SELECT '{k}'::text").into_boxed_str());
                assert_eq!(B::simple_scalar(&mut c, sql).await, Ok(k), "out of step");
                checked += 1;
                if x % 4 == 3 {
                    drop(cut(B::try_run(&mut c, SLEEPS), polls).await);
                }
            }
        }
    }
    checked
}

backends!(
    concurrent_cut_offs_soak,
    flavor = "multi_thread",
    worker_threads = 2
);
/// Six tasks on a pool of four at once, for `HOSTILE_S40_SECS`, in phases
/// of 25 operations each ([`task`]); between phases, with nothing in use,
/// `hostile_release3`'s oracle (every connection answers its own
/// statement, no advisory lock, every session idle with no transaction
/// id), then (in long runs, `HOSTILE_S40_SECS` set) one idle connection
/// killed on the server.
async fn concurrent_cut_offs_soak<B: Raw>() {
    let (_db, raw, pool) = setup::<B>("hostile-s40-concurrent", POOL).await;
    let until = Instant::now() + Duration::from_secs(soak_secs());
    let started = Instant::now();
    let (mut phases, mut checked, mut kills) = (0u64, 0u64, 0u64);
    while Instant::now() < until || phases < 4 {
        let seeds = (0..6u64).map(|t| (phases << 8 | t).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let done = futures_util::future::join_all(seeds.map(|s| task::<B>(&pool, s, 25))).await;
        checked += done.iter().sum::<u64>();
        phases += 1;
        let what = format!("after phase {phases}");
        in_step::<B>(&pool, ALL, &what).await;
        eventually(GUARD, "no advisory lock left", || async {
            raw_locks(&raw).await.is_empty()
        })
        .await;
        assert_eq!(busy(&raw).await, vec![], "{what}");
        // Only in long runs, as in the random soak: once in about six
        // loaded full runs deadpool handed out a connection killed just
        // before, its end not yet read ("connection closed"; the hostile
        // reader's unconfirmed finding 4, stop 40), which would make CI flaky.
        if std::env::var("HOSTILE_S40_SECS").is_ok() {
            kills += u64::from(kill_one_idle(&raw).await);
        }
    }
    println!(
        "{}: {phases} phases in {:?}: {checked} statements answered their own, {kills} idle \
         connections killed",
        B::NAME,
        started.elapsed()
    );
}

backends!(session_settings_user_code_left_do_not_stop_the_release);
/// Session settings user code may leave on a lock's connection, each
/// meeting the release's own transaction at READ COMMITTED (stop 40):
/// read only by default, repeatable read by default, an idle-in-transaction
/// timeout of 1 ms (the release's statements are pipelined: a gap between
/// them would end the session), serializable, read only and deferrable.
/// The unlock says `Ok`, nothing is left, the connection goes back.
async fn session_settings_user_code_left_do_not_stop_the_release<B: Raw>() {
    let (_db, raw, pool) = setup::<B>("hostile-s40-settings", POOL).await;
    for setting in [
        "SET default_transaction_read_only = on",
        "SET default_transaction_isolation = 'repeatable read'",
        "SET idle_in_transaction_session_timeout = '1ms'",
        "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE, READ ONLY, DEFERRABLE",
    ] {
        let (said, back) = release_after::<B>(&pool, &raw, setting).await;
        assert!(said.is_ok(), "{setting}: unlock said {said:?}");
        assert!(back, "{setting}: a healthy connection was closed");
    }
}

// FINDING (stop 40, fixed: pgwarden's advisory-lock functions, and the
// release's pid checks, are written `pg_catalog.`): the release's
// functions were not schema-qualified, and a search path user code left
// (`evil, pg_catalog, public`, do-nothing functions of those names in
// `evil`) made `unlock()` say `MovedByPooler { held_on: P, ran_on: P }` with
// the lock still held; sqlx's pool never settled, deadpool's test hung.
backends!(a_search_path_user_code_left_cannot_shadow_the_unlock);
/// User code sets a search path that puts a schema of its own before
/// `pg_catalog`, in which functions named `pg_advisory_unlock` and
/// `pg_advisory_unlock_all` do nothing: the release must still release
/// (its functions qualified with `pg_catalog`). Failed on all three
/// backends before: see the comment above.
async fn a_search_path_user_code_left_cannot_shadow_the_unlock<B: Raw>() {
    let (_db, raw, pool) = setup::<B>("hostile-s40-shadow", POOL).await;
    raw.batch_execute(
        "CREATE SCHEMA evil; \
         CREATE FUNCTION evil.pg_advisory_unlock(bigint) RETURNS boolean LANGUAGE sql AS 'SELECT true'; \
         CREATE FUNCTION evil.pg_advisory_unlock(int, int) RETURNS boolean LANGUAGE sql AS 'SELECT true'; \
         CREATE FUNCTION evil.pg_advisory_unlock_all() RETURNS void LANGUAGE sql AS ''",
    )
    .await
    .unwrap();
    let (said, back) =
        release_after::<B>(&pool, &raw, "SET search_path = evil, pg_catalog, public").await;
    assert!(said.is_ok() && back, "unlock said {said:?}, back {back}");
}

backends!(a_frozen_server_fails_every_waiting_probe_within_its_bound);
/// A pool with no connection yet, its server frozen (`SIGSTOP`): a probe
/// keeps its set-up going in the background, a second probe started while
/// it runs waits for it (`setup_answered`), a third starts after both gave
/// up. Each answers with an error within its own bound (here 500 ms; the
/// assertion allows 5 s, half the 10 s set-up bound a probe that waited for
/// the background set-up's end would take). Thawed, the pool is ready.
async fn a_frozen_server_fails_every_waiting_probe_within_its_bound<B: Backend>() {
    let server = tokio::task::spawn_blocking(pgwarden_testing::TestServer::start_local)
        .await
        .unwrap()
        .expect("a throwaway server to freeze");
    let db = server.create_database().await.unwrap();
    let pool = B::build(&db, &Settings::new("hostile-s40-frozen", 4));
    let bound = Duration::from_millis(500);
    let limit = Duration::from_secs(5);
    let frozen = server.freeze().expect("freeze");
    let timed = |pool| async move {
        let t = Instant::now();
        let r = B::readiness(pool, bound).await;
        (r, t.elapsed())
    };
    let (first, second) = futures_util::future::join(timed(&pool), async {
        tokio::task::yield_now().await;
        timed(&pool).await
    })
    .await;
    let third = timed(&pool).await;
    for (what, (r, took)) in [("first", first), ("second", second), ("third", third)] {
        println!("{}: {what} probe: {r:?} in {took:?}", B::NAME);
        assert!(r.is_err(), "{what}: ready on a frozen server: {r:?}");
        assert!(
            took < limit,
            "{what}: answered in {took:?}, bound {bound:?}"
        );
    }
    drop(frozen);
    eventually(GUARD, "ready once thawed", || async {
        B::readiness(&pool, Duration::from_secs(5)).await.is_ok()
    })
    .await;
    B::close(&pool).await;
}

/// sqlx only: `take_heard` (a connection attempt of pgwarden's own next to
/// sqlx's slow connect) and the drop-in `close()`.
#[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
macro_rules! sqlx_probes {
    ($version:ident, $sqlx:ident, $($pg:ident)::+) => {
        mod $version {
            use crate::support;

            use std::time::Duration;

            use $sqlx::postgres::PgPoolOptions;
            use pgwarden_testing::{Proxy, TestServer};
            use support::{eventually, within};

            use $($pg)::+::Pool;

            use super::GUARD;

            /// An adopter's pool options: 2 connections, an `after_connect`
            /// hook of one statement (a search path).
            fn hooked() -> PgPoolOptions {
                PgPoolOptions::new().max_connections(2).after_connect(|c, _| {
                    Box::pin(async move {
                        $sqlx::Executor::execute(c, "SET search_path = public").await?;
                        Ok(())
                    })
                })
            }

            /// Client backends connected now.
            async fn clients(c: &tokio_postgres::Client) -> i64 {
                c.query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'",
                    &[],
                )
                .await
                .unwrap()
                .get(0)
            }

            // FINDING (stop 40, fixed by taking `take_heard` out): a server with exactly one free
            // connection slot, a link of 60 ms each way, and an adopter's
            // `after_connect` hook (one statement: a search path). sqlx's
            // connect takes the slot at its startup and is still in its
            // hook when pgwarden's own attempt, started after 50 ms, is
            // refused (`53300 sorry, too many clients already`, from
            // `InitProcess`): the checkout answers that error, and sqlx's
            // connection, about to be handed out, is dropped with its
            // acquire. The control (sqlx alone, same options, same free
            // slot) gets its connection. The right answer is the
            // connection: the server had room for it.
            #[tokio::test]
            async fn one_free_slot_is_enough_for_a_slow_connect() {
                let server = tokio::task::spawn_blocking(|| {
                    TestServer::start_local_with(
                        &[("max_connections", "4"), ("superuser_reserved_connections", "0")],
                        &[],
                    )
                })
                .await
                .unwrap()
                .expect("a throwaway server with max_connections=4");
                let db = server.create_database().await.unwrap();
                let admin = db.connect().await.unwrap();
                let proxy = Proxy::start(&server).expect("proxy");
                proxy.set_latency(Duration::from_millis(60));
                let raw = hooked().connect_lazy_with(sqlx_options!($sqlx, proxy.pg_config(&db)));
                let pool = Pool::builder(raw)
                    .name(concat!("hostile-s40-slot-", stringify!($version)))
                    .build()
                    .unwrap();
                // Another application takes every slot but one.
                let mut others = Vec::new();
                while clients(&admin).await < 3 {
                    others.push(db.connect().await.unwrap());
                }
                // The control: sqlx alone, same options, gets the slot.
                let alone = hooked().connect_lazy_with(sqlx_options!($sqlx, proxy.pg_config(&db)));
                let got = within(GUARD, "raw acquire", alone.acquire()).await;
                assert!(got.is_ok(), "sqlx alone: {:?}", got.err());
                drop(got);
                alone.close().await;
                eventually(GUARD, "the slot free again", || async {
                    clients(&admin).await == 3
                })
                .await;
                let got = within(GUARD, "acquire", pool.acquire()).await;
                let after = clients(&admin).await;
                assert!(
                    got.is_ok(),
                    "one slot was free: {:?} (client backends now {after})",
                    got.err()
                );
                drop(got);
                pool.close().await;
                drop(others);
            }

            /// A fresh pool through a link of 60 ms each way (a connect
            /// then takes more than `take_heard`'s 50 ms patience): the
            /// connections the proxy accepted for `n` checkouts held at
            /// once, and for the same on sqlx alone.
            async fn connects_for(n: usize) -> (u64, u64) {
                let server = pgwarden_testing::TestServer::shared().expect("server");
                let db = server.create_database().await.unwrap();
                let proxy = Proxy::start(server).expect("proxy");
                proxy.set_latency(Duration::from_millis(60));
                let opts = || {
                    PgPoolOptions::new()
                        .max_connections(4)
                        .connect_lazy_with(sqlx_options!($sqlx, proxy.pg_config(&db)))
                };
                let alone = opts();
                let mut held = Vec::new();
                for _ in 0..n {
                    held.push(within(GUARD, "raw acquire", alone.acquire()).await.unwrap());
                }
                drop(held);
                alone.close().await;
                let by_sqlx = proxy.accepted();
                let pool = Pool::builder(opts())
                    .name(concat!("hostile-s40-connects-", stringify!($version)))
                    .build()
                    .unwrap();
                let mut held = Vec::new();
                for _ in 0..n {
                    held.push(within(GUARD, "acquire", pool.acquire()).await.unwrap());
                }
                drop(held);
                pool.close().await;
                (proxy.accepted() - by_sqlx, by_sqlx)
            }

            // FINDING (stop 40, fixed by taking `take_heard` out): whenever sqlx's connect
            // takes longer than twice the last one (at least 50 ms: the
            // first connect of every pool on a link slower than that, a
            // server that slowed down),
            // pgwarden opens a second full connection beside it, then
            // closes whichever is not handed out: a healthy connection
            // closed without need, and twice the set-ups (and their
            // authentication) asked of a server that is slow already.
            #[tokio::test]
            async fn a_slow_connect_is_made_once() {
                let (by_pgwarden, by_sqlx) = connects_for(3).await;
                println!("connections for 3 checkouts: pgwarden {by_pgwarden}, sqlx alone {by_sqlx}");
                assert_eq!(by_pgwarden, by_sqlx, "connections made for 3 checkouts");
            }

            /// Checkouts given up on (dropped) at random instants while
            /// sqlx's connect and pgwarden's own attempt are both under
            /// way on a slow link: no server session is left behind, and
            /// the pool still hands out a connection that answers.
            #[tokio::test]
            async fn checkouts_given_up_mid_connect_leave_no_session() {
                let db = support::db().await;
                let admin = db.connect().await.unwrap();
                let server = pgwarden_testing::TestServer::shared().expect("server");
                let proxy = Proxy::start(server).expect("proxy");
                proxy.set_latency(Duration::from_millis(60));
                let pool = Pool::builder(
                    hooked().connect_lazy_with(sqlx_options!($sqlx, proxy.pg_config(&db))),
                )
                .name(concat!("hostile-s40-cut-connect-", stringify!($version)))
                .build()
                .unwrap();
                let mut cut = 0;
                for i in 0..12u64 {
                    let t = Duration::from_millis(20 + (i * 37) % 400);
                    if tokio::time::timeout(t, pool.acquire()).await.is_err() {
                        cut += 1;
                    }
                }
                let sessions = || async {
                    admin
                        .query_one(
                            "SELECT count(*) FROM pg_stat_activity \
                              WHERE datname = current_database() AND pid <> pg_backend_pid()",
                            &[],
                        )
                        .await
                        .unwrap()
                        .get::<_, i64>(0)
                };
                eventually(GUARD, "at most the pool's 2 sessions", || async {
                    sessions().await <= 2
                })
                .await;
                let mut c = within(GUARD, "acquire", pool.acquire()).await.unwrap();
                let one: i64 = $sqlx::query_scalar("SELECT 1::int8")
                    .fetch_one(&mut *c)
                    .await
                    .unwrap();
                assert_eq!(one, 1);
                println!("{cut} of 12 checkouts given up mid-connect; sessions left: {}", sessions().await);
                drop(c);
                pool.close().await;
            }

            // sqlx's `close()` marks the pool closed as it is called
            // ("Upon calling this method, any currently waiting or
            // subsequent calls to `Pool::acquire` and the like will
            // immediately return `Error::PoolClosed` … Waiting for
            // connections to be gracefully closed is optional"). The
            // drop-in `close()` calls sqlx's inside its future since stop
            // 40 (a second close after every return); a close not awaited
            // must still close the adopter's own `PgPool` handle. (Held:
            // pgwarden's close closes the wrapped pool at the call.)
            #[tokio::test]
            async fn close_not_awaited_closes_sqlx_pool() {
                let db = support::db().await;
                let raw = PgPoolOptions::new()
                    .max_connections(2)
                    .connect_lazy_with(sqlx_options!($sqlx, db.pg_config()));
                let pool = Pool::builder(raw.clone())
                    .name(concat!("hostile-s40-close-", stringify!($version)))
                    .build()
                    .unwrap();
                $sqlx::query("SELECT 1").execute(&pool).await.unwrap();
                drop(pool.close());
                assert!(pool.is_closed(), "pgwarden's pool");
                let again = within(GUARD, "raw acquire", raw.acquire()).await;
                assert!(
                    matches!(again, Err($sqlx::Error::PoolClosed)),
                    "sqlx's pool after close(): {:?}",
                    again.map(|_| "a connection")
                );
                raw.close().await;
                eventually(GUARD, "closed", || std::future::ready(raw.is_closed())).await;
            }
        }
    };
}
#[cfg(all(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
sqlx_probes!(sqlx_0_8, sqlx08, pgwarden::sqlx_0_8);
#[cfg(all(feature = "sqlx-0_8", not(feature = "sqlx-0_9")))]
sqlx_probes!(sqlx_0_8, sqlx08, pgwarden::sqlx);
#[cfg(feature = "sqlx-0_9")]
sqlx_probes!(sqlx_0_9, sqlx09, pgwarden::sqlx);
