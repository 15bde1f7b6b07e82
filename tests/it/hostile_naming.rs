//! Hostile probes of how a pool names its connections (sqlx: a cached
//! named `SELECT pg_backend_pid()`, or, unnamed, the pid or a number per
//! checkout; deadpool: its own object ids), on every backend but the cost
//! per checkout (sqlx's statement cache only): the census sweep, pid
//! reuse (forced with `/proc/sys/kernel/ns_last_pid` when the tests run as
//! root), checkouts dropped half-way, PgBouncer in transaction mode. The
//! sqlx findings (a reused pid taken for the pool's idle connection, an
//! unproven `Auto` pool behind PgBouncer reported `Direct`, a checkout
//! failing on a connection the sweep ended) are kept as regression tests.

use crate::support;

use std::future::Future;
use std::time::Duration;

use pgwarden::{LockKey, LockMode, Owner, PoolerMode};
use pgwarden_testing::{PoolMode, TestDb};
use support::backend::{settled, Backend, Settings};
use support::{alive, db, eventually};

const T: Duration = Duration::from_secs(10);

/// A pool's settings here: `name` of `size`, waits of `T`, its pooler
/// configured as `mode`, the census every 100 ms when `census`, sqlx's
/// statement cache on or off (`cache`).
fn settings(
    name: &'static str,
    size: usize,
    mode: PoolerMode,
    census: bool,
    cache: bool,
) -> Settings {
    let s = Settings::new(name, size)
        .wait(T)
        .pooler(mode)
        .statement_cache(cache);
    if census {
        s.census(Duration::from_millis(100))
    } else {
        s
    }
}

/// Log lines of `pool` that contain `what`.
fn logged(pool: &str, what: &str) -> usize {
    support::logs()
        .text()
        .lines()
        .filter(|l| l.contains(what) && l.contains(&format!("pool={pool}")))
        .count()
}

/// Points the kernel's next pid at `pid` (root only): the next process
/// forked gets it if it is free and nothing else forks first.
fn next_pid_is(pid: i32) -> bool {
    std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).is_ok()
}

/// Whether no process or thread has `pid` now.
fn pid_free(pid: i32) -> bool {
    !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Tries to get `pid` for the next process PostgreSQL forks: while a
/// process or thread of the busy machine holds it, waits for it to be free
/// (at most 100 ms a try), then points the kernel's next pid at it; false
/// when that cannot be done (not root).
async fn aim_at(pid: i32) -> bool {
    for _ in 0..10 {
        if pid_free(pid) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    next_pid_is(pid)
}

/// How many times a forced pid is tried: other processes fork too, more so
/// on a loaded machine (about 100 pids a second at load 15, against one
/// connection's start).
const PID_TRIES: usize = 300;

/// A raw session on backend `pid`, forced with `ns_last_pid` (many tries:
/// other processes fork too); `None` when it cannot be.
async fn session_on_pid(db: &TestDb, pid: i32) -> Option<tokio_postgres::Client> {
    for _ in 0..PID_TRIES {
        if !aim_at(pid).await {
            return None;
        }
        let c = db.connect().await.ok()?;
        let got: i32 = c
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .ok()?
            .get(0);
        if got == pid {
            return Some(c);
        }
    }
    None
}

// --- pid reuse and the sweep -------------------------------------------------

backends!(a_reused_pid_is_not_the_pools_connection);
/// Configured direct, sqlx's statement cache off: a connection is named by
/// its pid. One connection (pid P) is closed by the wrapped pool itself
/// (`Backend::build_closing`): pgwarden keeps its pid. An outside
/// session is then made on pid P (`ns_last_pid`) and holds an advisory
/// lock, idle: the census must call it another's, and the sweep must leave
/// it alone and mark nothing of the pool. Then that session ends and a new
/// connection of the pool gets pid P: it is healthy and must be handed out.
///
/// FINDING (deadpool, fixed in session 40): deadpool's connections were
/// known by their pid alone, and a connection deadpool dropped on its own
/// (a failed recycle) left its pid in the pool's books: the census called
/// the outsider's lock the pool's idle connection's (`Owner::Idle`) and the
/// sweep warned of a leak ("outsider's lock owner Some(Idle); sweep warned
/// true"). Now deadpool asks the session's start with the pid, as sqlx.
async fn a_reused_pid_is_not_the_pools_connection<B: Backend>() {
    use std::sync::atomic::Ordering;
    support::logs();
    let db = db().await;
    let s = settings("hostile-reused-pid", 3, PoolerMode::Direct, true, false);
    let name = &s.pool_name::<B>();
    // Under a recorder of its own: its census passes are counted.
    let (pool, passes, close) = B::build_closing(&db, &s);
    let raw = db.connect().await.unwrap();

    close.store(true, Ordering::Release);
    let mut c = B::get(&pool).await.unwrap();
    B::try_run(&mut c, "SELECT 1").await.unwrap();
    let p = B::pid(&c);
    drop(c);
    settled::<B>(&pool).await;
    // sqlx closed it as it came back; deadpool closes it as it recycles
    // it for the next checkout.
    let mut c = B::get(&pool).await.unwrap();
    B::try_run(&mut c, "SELECT 1").await.unwrap();
    drop(c);
    settled::<B>(&pool).await;
    eventually(T, "the wrapped pool closed it", || async {
        !alive(&raw, p).await
    })
    .await;
    close.store(false, Ordering::Release);

    let Some(outsider) = session_on_pid(&db, p).await else {
        eprintln!("cannot force pid {p} (not root?): skipped");
        return;
    };
    outsider
        .batch_execute("SELECT pg_advisory_lock(5150)")
        .await
        .unwrap();
    // Census passes are counted from here (a reading drains what it read).
    support::recorder::metrics_now(&passes);
    let census = B::census(&pool).await.unwrap();
    let owner = census
        .locks
        .iter()
        .find(|l| l.key == LockKey::Single(5150))
        .map(|l| l.owner.clone());
    let mislabelled = owner != Some(Owner::Other);
    // The sweep looks twice (the second look confirms): wait for the
    // warning, or for three census passes to end since the lock was taken
    // (the first may have read `pg_locks` before it), however slowly a
    // loaded machine runs them.
    let key = format!("pgwarden_census_duration_seconds{{pool={name}}}");
    let mut ended = 0.0;
    eventually(T, "three census passes, or the warning", || {
        ended += support::recorder::metrics_now(&passes)
            .get(&key)
            .copied()
            .unwrap_or(0.0);
        std::future::ready(
            ended >= 3.0 || logged(name, "advisory locks held by a connection idle") > 0,
        )
    })
    .await;
    let warned = logged(name, "advisory locks held by a connection idle") > 0;
    assert!(alive(&raw, p).await, "the outside session was ended");
    drop(outsider);
    eventually(T, "the outsider gone", || async { !alive(&raw, p).await }).await;

    // A new pool connection on pid P (every connection closed on return,
    // so each checkout makes one).
    close.store(true, Ordering::Release);
    let before = logged(name, "discarding a pooled connection");
    let mut got_p = false;
    for _ in 0..PID_TRIES {
        aim_at(p).await;
        let c = B::get(&pool).await.unwrap();
        if B::pid(&c) == p {
            got_p = true;
            break;
        }
        if logged(name, "discarding a pooled connection") > before {
            break;
        }
    }
    let discarded = logged(name, "discarding a pooled connection") > before;
    settled::<B>(&pool).await;
    if !got_p && !discarded {
        // As when the outsider could not be put on P: the machine's other
        // processes took the pid every time. The checks above stand.
        eprintln!("cannot force pid {p} for a pool connection in {PID_TRIES} tries: not checked");
    }
    assert!(
        !mislabelled && !warned && !discarded,
        "outsider's lock owner {owner:?}; sweep warned {warned}; healthy connection on the \
         reused pid discarded {discarded} (handed out {got_p})"
    );
}

backends!(a_checkout_after_the_sweep_ended_a_leaker_succeeds);
/// The sweep ends the session of an idle connection holding a leaked lock
/// (deadpool: closes it in the wrapped pool); with sqlx's
/// `test_before_acquire(false)` the dead connection is handed to
/// pgwarden's next checkout. Named by its cached statement (cache on),
/// pgwarden finds it marked before any round trip and discards it; named
/// by its pid and session start (cache off), the statement that asks them
/// fails on the dead connection, which is discarded and another taken: the
/// next checkout must not fail either. (A sqlx pool at `Auto` is never
/// proven direct: its census matches nothing and its sweep ends nothing.)
async fn a_checkout_after_the_sweep_ended_a_leaker_succeeds<B: Backend>() {
    support::logs();
    let db = db().await;
    let raw = db.connect().await.unwrap();
    let mut failures = Vec::new();
    for (mode, cache) in [(PoolerMode::Direct, true), (PoolerMode::Direct, false)] {
        let what = format!("{mode:?}, cache {cache}");
        let s = settings("hostile-sweep-then-checkout", 3, mode, true, cache).unchecked();
        let pool = B::build(&db, &s);
        let mut c = B::get(&pool).await.unwrap();
        B::try_run(&mut c, "SELECT pg_advisory_lock(901)")
            .await
            .unwrap();
        let p = B::pid(&c);
        drop(c);
        eventually(T, "the sweep ended the leaker", || async {
            !alive(&raw, p).await
        })
        .await;
        for i in 0..4 {
            let r = match B::get(&pool).await {
                Ok(mut c) => B::try_run(&mut c, "SELECT 1").await,
                Err(e) => Err(format!("checkout: {e}")),
            };
            if let Err(e) = r {
                failures.push(format!("{what}: checkout {i}: {e}"));
            }
        }
        settled::<B>(&pool).await;
        B::close(&pool).await;
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

backends!(the_sweep_never_ends_a_connection_in_a_users_hands);
/// The sweep never ends a connection in a user's hands. Configured
/// direct, the cache off (named by pid and session start): the user takes
/// the advisory lock again on every checkout and leaves it (each
/// connection a leaker once idle), while the sweep runs every 100 ms. A
/// leaker checked out between the sweep's census and its decision is
/// only marked (discarded at its next checkout); one ended while idle is
/// found dead by the next checkout's own statement and replaced. Until
/// the sweep has dealt with 3 leakers, no statement run while holding a
/// connection fails.
async fn the_sweep_never_ends_a_connection_in_a_users_hands<B: Backend>() {
    support::logs();
    let db = db().await;
    let s = settings("hostile-sweep-held", 2, PoolerMode::Direct, true, false).unchecked();
    let name = &s.pool_name::<B>();
    let pool = B::build(&db, &s);
    let mut failures = Vec::new();
    let mut rounds = 0;
    while logged(name, "advisory locks held by a connection idle") < 3 && rounds < 2000 {
        rounds += 1;
        let mut c = match B::get(&pool).await {
            Ok(c) => c,
            Err(e) => {
                failures.push(format!("round {rounds}: checkout: {e}"));
                continue;
            }
        };
        for sql in ["SELECT pg_advisory_lock(808)", "SELECT 1", "SELECT 2"] {
            if let Err(e) = B::try_run(&mut c, sql).await {
                failures.push(format!("round {rounds}: {sql}: {e}"));
            }
            tokio::task::yield_now().await;
        }
        drop(c);
        // Idle a little between checkouts, so that a sweep can confirm the
        // leak (load shaping, not a wait for a result).
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let dealt = logged(name, "advisory locks held by a connection idle");
    eprintln!("{}: {rounds} rounds, {dealt} leakers dealt with", B::NAME);
    settled::<B>(&pool).await;
    B::close(&pool).await;
    assert!(
        dealt >= 3,
        "the sweep dealt with {dealt} leakers in {rounds} rounds"
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

backends!(the_sweep_leaves_a_pgbouncer_server_connection_alone);
/// Behind PgBouncer (transaction mode, one server connection), a pool
/// of 2 left at `Auto` (sqlx: its statement cache off): its detection cannot run the motion probe (one
/// connection outside the probe reserve) and stays unproven: it answers
/// `Auto`, not `Direct`. Another client of the same PgBouncer holds a
/// session advisory lock on the one server connection. The pool's census
/// must not call that lock its own idle connection's (the sweep would end
/// the server connection, another application's lock with it: what the
/// sweep did in 3 s is reported, not asserted on a clock).
async fn the_sweep_leaves_a_pgbouncer_server_connection_alone<B: Backend>() {
    let db = db().await;
    let Some(bouncer) = support::pooler::bouncer(&db, 1, PoolMode::Transaction) else {
        return;
    };
    let raw = db.connect().await.unwrap();
    let other = bouncer.connect().await.unwrap();
    other
        .batch_execute("SELECT pg_advisory_lock(4242)")
        .await
        .unwrap();
    let server: i32 = other
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let s = settings("hostile-bouncer-sweep", 2, PoolerMode::Auto, true, false);
    let pool = B::build_through(&bouncer, &s);
    let mut c = B::get(&pool).await.unwrap();
    B::run(&mut c, "SELECT 1").await;
    drop(c);
    settled::<B>(&pool).await;
    let mode = B::detect_pooler(&pool).await.unwrap();
    let census = B::census(&pool).await.unwrap();
    let owner = census
        .locks
        .iter()
        .find(|l| l.key == LockKey::Single(4242))
        .map(|l| l.owner.clone());
    eprintln!(
        "{}: detected {mode:?}; owner of the other client's lock: {owner:?}",
        B::NAME
    );
    // What the sweep (every 100 ms) does with it: an observation for the
    // message, not the assertion (which is the census's attribution).
    let mut ended = false;
    for _ in 0..30 {
        if !alive(&raw, server).await {
            ended = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("PgBouncer's server connection {server} ended by the sweep: {ended}");
    assert!(
        mode != PoolerMode::Direct && owner == Some(Owner::Other),
        "detected {mode:?}, the other client's lock owned by {owner:?}, server connection ended {ended}"
    );
    B::close(&pool).await;
}

// --- cost per checkout (sqlx) ------------------------------------------------

/// sqlx only, and not by omission: its subject is sqlx's own statement
/// cache (`statement_cache_capacity`, which the naming statement shares
/// with the user's); deadpool names no statement and asks a connection's
/// pid once, when it is made.
#[cfg(feature = "sqlx-0_9")]
mod statement_cache {
    use super::*;
    use pgwarden::sqlx::Pool;
    use sqlx09 as sqlx;
    use sqlx09::postgres::{PgConnectOptions, PgPoolOptions};

    fn opts(cfg: &tokio_postgres::Config) -> PgConnectOptions {
        sqlx_options!(sqlx09, cfg.clone()).ssl_mode(sqlx::postgres::PgSslMode::Disable)
    }

    /// A pgwarden sqlx pool over `pg`, no census.
    fn wrap(pg: sqlx::PgPool, name: &str, mode: PoolerMode) -> Pool {
        Pool::builder(pg)
            .name(name)
            .pooler(mode)
            .wait_timeout(T)
            .census_interval(None)
            .build()
            .expect("pool")
    }

    async fn settled(pool: &Pool) {
        super::settled::<support::backend::Sqlx09>(pool).await
    }

    /// `pg_backend_pid()` counted: a function of that name in `public`, first
    /// on the database's search path, counts its calls in a sequence.
    async fn count_pid_calls(db: &TestDb) -> tokio_postgres::Client {
        let admin = db.connect().await.unwrap();
        admin
            .batch_execute(&format!(
                "CREATE SEQUENCE public.pid_calls; \
                 CREATE FUNCTION public.pg_backend_pid() RETURNS int LANGUAGE sql VOLATILE \
                   AS $$ SELECT (nextval('public.pid_calls') * 0)::int + pg_catalog.pg_backend_pid() $$; \
                 ALTER DATABASE \"{}\" SET search_path = public, pg_catalog",
                db.name()
            ))
            .await
            .unwrap();
        admin
    }

    async fn calls(admin: &tokio_postgres::Client) -> i64 {
        admin
            .query_one(
                "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM public.pid_calls",
                &[],
            )
            .await
            .unwrap()
            .get(0)
    }

    /// Straight to PostgreSQL, configured direct: after a warm-up, the
    /// `pg_backend_pid()` runs per checkout, with the user running 1 to 3
    /// persistent statements per checkout. The cache on (100): none; the cache
    /// off: one; a small cache (1, 2, 3) that the user's statements fill: the
    /// naming statement is evicted and named again, a new name each time;
    /// still at most one per checkout, and the pool does not flip to "cache
    /// off" wrongly (no log line).
    #[tokio::test]
    async fn pid_asks_per_checkout() {
        support::logs();
        let mut report = Vec::new();
        let mut bad = Vec::new();
        for (capacity, user_stmts) in [(100, 3), (0, 1), (1, 1), (2, 2), (3, 3), (3, 1)] {
            let db = db().await;
            let admin = count_pid_calls(&db).await;
            let pg = PgPoolOptions::new()
                .max_connections(2)
                .connect_lazy_with(opts(&db.pg_config()).statement_cache_capacity(capacity));
            let name = format!("hostile-cost-{capacity}-{user_stmts}");
            let pool = wrap(pg, &name, PoolerMode::Direct);
            const USER: [&str; 3] = ["SELECT 1::int4", "SELECT 2::int4", "SELECT 3::int4"];
            let checkout = |pool: &Pool| {
                let pool = pool.clone();
                async move {
                    let mut c = pool.acquire().await.unwrap();
                    for sql in USER.iter().take(user_stmts).copied() {
                        sqlx::query(sqlx::AssertSqlSafe(sql))
                            .execute(&mut *c)
                            .await
                            .unwrap();
                    }
                }
            };
            for _ in 0..3 {
                checkout(&pool).await;
            }
            settled(&pool).await;
            let before = calls(&admin).await;
            for _ in 0..20 {
                checkout(&pool).await;
            }
            settled(&pool).await;
            let asked = calls(&admin).await - before;
            let flipped = logged(&name, "go unnamed on this sqlx pool") > 0;
            let mut c = pool.acquire().await.unwrap();
            let prepared: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_prepared_statements")
                .persistent(false)
                .fetch_one(&mut *c)
                .await
                .unwrap();
            drop(c);
            report.push(format!(
                "capacity {capacity}, {user_stmts} user statements: {asked} pid asks in 20 \
                 checkouts, flipped to unnamed {flipped}, {prepared} prepared on the connection"
            ));
            let want = match capacity {
                0 => 20,
                c if c > user_stmts => 0,
                _ => 20,
            };
            if asked > want || (capacity > 0 && flipped) {
                bad.push(report.last().unwrap().clone());
            }
            settled(&pool).await;
            pool.close().await;
        }
        eprintln!("{report:#?}");
        assert!(bad.is_empty(), "{bad:#?}");
    }
}

// --- checkouts dropped half-way ----------------------------------------------

/// Polls `fut` `n` times, letting the runtime run in between, then drops it.
async fn poll_then_drop<F: Future>(fut: F, n: usize) {
    let mut fut = std::pin::pin!(fut);
    for i in 0..n {
        if futures_util::poll!(fut.as_mut()).is_ready() {
            return;
        }
        if i % 2 == 0 {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(Duration::from_micros(300)).await;
        }
    }
}

backends!(
    checkouts_dropped_at_every_await_settle,
    flavor = "multi_thread",
    worker_threads = 2
);
/// In each naming mode (direct cache on, direct cache off, `Auto` cache
/// off, through PgBouncer configured and `Auto`), checkouts and session
/// locks dropped after 0 to 40 polls: the pool settles (nothing in use),
/// every connection can be checked out again at once, and no advisory lock
/// is left in the database.
async fn checkouts_dropped_at_every_await_settle<B: Backend>() {
    let db = db().await;
    let bouncer = support::pooler::bouncer(&db, 2, PoolMode::Transaction);
    let raw = db.connect().await.unwrap();
    let mut cases: Vec<(String, B::Pool, bool)> = Vec::new();
    for (mode, cache) in [
        (PoolerMode::Direct, true),
        (PoolerMode::Direct, false),
        (PoolerMode::Auto, false),
    ] {
        // deadpool has no statement cache: its one case per mode.
        if !B::STATEMENT_CACHE && !cache && mode == PoolerMode::Direct {
            continue;
        }
        let s = settings("hostile-drop", 4, mode, false, cache);
        let name = format!("direct {mode:?} cache {cache}");
        cases.push((name, B::build(&db, &s), true));
    }
    if let Some(b) = &bouncer {
        for (mode, cache) in [(PoolerMode::Transaction, false), (PoolerMode::Auto, true)] {
            let s = settings("hostile-drop-b", 4, mode, false, cache);
            let name = format!("bouncer {mode:?} cache {cache}");
            cases.push((name, B::build_through(b, &s), false));
        }
    }
    let mut failures = Vec::new();
    for (what, pool, direct) in &cases {
        for n in 0..40 {
            poll_then_drop(B::get(pool), n).await;
            let begin = async {
                let mut src = B::tx_source(pool).await;
                drop(B::begin(&mut src, None).await);
            };
            poll_then_drop(begin, n).await;
            if *direct {
                let lock = B::session_lock(pool, LockKey::Single(77), LockMode::Exclusive, None);
                poll_then_drop(lock, n).await;
            }
        }
        settled::<B>(pool).await;
        let mut held = Vec::new();
        for _ in 0..3 {
            match tokio::time::timeout(T, B::get(pool)).await {
                Ok(Ok(mut c)) => match B::try_run(&mut c, "SELECT 1").await {
                    Ok(()) => held.push(c),
                    Err(e) => failures.push(format!("{what}: a connection is broken: {e}")),
                },
                Ok(Err(e)) => failures.push(format!("{what}: checkout failed: {e}")),
                Err(_) => failures.push(format!("{what}: no connection within {T:?}")),
            }
        }
        drop(held);
        settled::<B>(pool).await;
        let locks: i64 = raw
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
                   AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if locks != 0 {
            failures.push(format!("{what}: {locks} advisory locks left"));
        }
        let s = B::status(pool);
        eprintln!(
            "{}: {what}: size {} idle {} in_use {}",
            B::NAME,
            s.size,
            s.idle,
            s.in_use
        );
        B::close(pool).await;
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

// --- Auto behind PgBouncer, the cache on --------------------------------------

backends!(the_first_refusal_behind_pgbouncer_fails_no_checkout);
/// `Auto` behind PgBouncer (one server connection) with sqlx's cache on:
/// three connections made at once each name `SELECT pg_backend_pid()` on
/// the one server connection; the second is refused (`42P05`). No checkout
/// fails for it (the refusal is taken in and the pool goes unnamed, once;
/// deadpool names nothing, so has nothing to learn), and the session lock
/// asked before detection is refused with the typed error.
async fn the_first_refusal_behind_pgbouncer_fails_no_checkout<B: Backend>() {
    support::logs();
    let db = db().await;
    let Some(bouncer) = support::pooler::bouncer(&db, 1, PoolMode::Transaction) else {
        return;
    };
    let s = settings("hostile-first-refusal", 5, PoolerMode::Auto, false, true);
    let name = &s.pool_name::<B>();
    let pool = B::build_through(&bouncer, &s);
    let mut held = Vec::new();
    for i in 0..3 {
        let mut c = B::get(&pool)
            .await
            .unwrap_or_else(|e| panic!("checkout {i}: {e}"));
        B::run(&mut c, "SELECT 1").await;
        held.push(c);
    }
    let mut c = held.pop().unwrap();
    let left = B::count(&mut c, "SELECT count(*) FROM pg_prepared_statements").await;
    let learned = logged(name, "go unnamed on this sqlx pool");
    eprintln!(
        "{}: named statements left on the shared server connection: {left}; learned: {learned}",
        B::NAME
    );
    assert_eq!(learned, usize::from(B::STATEMENT_CACHE));
    drop((c, held));
    settled::<B>(&pool).await;
    let lock = B::session_lock(&pool, LockKey::Single(3), LockMode::Exclusive, None).await;
    assert!(
        matches!(
            lock,
            Err(pgwarden::Error::Lock(
                pgwarden::LockError::BehindPooler { .. }
            ))
        ),
        "{lock:?}"
    );
    settled::<B>(&pool).await;
    B::close(&pool).await;
}
