//! The lost signal under faults, against a real PostgreSQL: for each, the
//! holder's `lost()` fires before the lease expires on the server, that is
//! before any other instance can take it. A hung server (postmaster and
//! backends stopped), the holder's backend stopped or terminated, a slow
//! renewal batch, the renewer's runtime dropped, and the renewer panicking.
//! On every backend, from one source.

use crate::support;

use std::time::{Duration, Instant, SystemTime};

use pgwarden::{LeaseOptions, LostReason};
use pgwarden_testing::{TestDb, TestServer};
use support::backend::{named, Backend, Settings};
use support::leases::{ahead, backends, busy_backends, expiry, lock_rows, row, short};
use support::{admin, db, eventually, within, Stopped};

const S: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

/// Two holders on `db`, as two service instances: A (its backends named
/// `<name>-a-<backend>`, that name) and B, the lease table installed by B.
async fn two_holders<B: Backend>(
    db: &TestDb,
    name: &'static str,
) -> (B::Leases, String, B::Leases) {
    let (pool_a, app_a) = named::<B>(db, &format!("{name}-a"), &Settings::new(name, 2));
    let b = B::leases(&B::build(db, &Settings::new(name, 2)));
    B::install(&b).await.expect("install the lease table");
    (B::leases(&pool_a), app_a, b)
}

backends!(
    lost_fires_before_expiry_when_the_server_hangs,
    flavor = "multi_thread",
    worker_threads = 2
);
async fn lost_fires_before_expiry_when_the_server_hangs<B: Backend>() {
    // A server of its own: every process of it is stopped.
    let server = tokio::task::spawn_blocking(TestServer::start_local)
        .await
        .unwrap()
        .expect("a dedicated throwaway PostgreSQL");
    let db = server.create_database().await.unwrap();
    let admin = admin(&db).await;
    let (pool, app) = named::<B>(&db, "hung", &Settings::new("hung", 3));
    let leases = B::leases(&pool);
    let opts = LeaseOptions::new(2 * S)
        .renew_every(500 * MS)
        .safety_margin(500 * MS);
    let lease = B::acquire(&leases, "job", &opts, None)
        .await
        .unwrap()
        .unwrap();
    // Right after a renewal: the expiry the database holds until it hangs.
    let renewed = B::lease_stats(&leases).renewed;
    eventually(3 * S, "a renewal", || {
        std::future::ready(B::lease_stats(&leases).renewed > renewed)
    })
    .await;
    let expires = expiry(&admin, "job").await;
    let frozen = server.freeze().expect("SIGSTOP to the server's processes");
    let t = Instant::now();

    let reason = within(3 * S, "lost signal", lease.lost()).await;
    // When it fired: at the lease's local deadline (the test's own wake-up
    // comes later on a loaded machine: it once saw the signal 500 ms late).
    let lost_at = SystemTime::now() - lease.deadline().elapsed();
    assert_eq!(reason, LostReason::Deadline);
    assert!(lease.is_lost());
    let margin = ahead(lost_at, expires);
    eprintln!(
        "hung server: lost {:?} after the stop, {margin:.3} s before the lease expired in the database",
        t.elapsed()
    );
    assert!(margin > 0.0, "lost after the expiry: {margin} s");
    // Renewals were tried and bounded, not stuck.
    eventually(3 * S, "a failed renewal", || {
        std::future::ready(B::lease_stats(&leases).renewal_failures >= 1)
    })
    .await;
    drop(frozen);
    // Back: nothing of the holder's is left waiting on the server.
    eventually(5 * S, "no statement of the holder left running", || async {
        busy_backends(&admin, &app).await == (0, 0)
    })
    .await;
}

backends!(lost_fires_before_takeover_when_the_backend_is_stopped);
async fn lost_fires_before_takeover_when_the_backend_is_stopped<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let (a, app_a, b) = two_holders::<B>(&db, "stop").await;
    let lease = B::acquire(&a, "alerts", &short(), None)
        .await
        .unwrap()
        .unwrap();
    let lost = lease.lost();
    let stopped = Stopped::stop(backends(&admin, &app_a).await).expect("SIGSTOP");
    let (taken, ahead_by) = lost_then_taken_over::<B>(b, lost).await;
    eprintln!("SIGSTOP: lost signal {ahead_by:?} before the take-over");
    assert!(taken.term().token > lease.term().token);
    assert_eq!(
        taken.term().took_over_from.as_deref(),
        Some(lease.term().holder.as_str())
    );
    drop(stopped);
}

backends!(lost_fires_before_takeover_when_the_backend_is_terminated);
async fn lost_fires_before_takeover_when_the_backend_is_terminated<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let b = B::leases(&B::build(&db, &Settings::new("term-b", 2)));
    B::install(&b).await.unwrap();
    // A connects as its own role, so that it cannot come back once cut off.
    let role = format!("{}_a", db.name());
    admin
        .batch_execute(&format!(
            "CREATE ROLE \"{role}\" LOGIN;
             GRANT SELECT, INSERT, UPDATE, DELETE ON pgwarden_leases TO \"{role}\";
             GRANT USAGE ON SEQUENCE pgwarden_leases_token_seq TO \"{role}\";"
        ))
        .await
        .unwrap();
    let mut cfg = db.pg_config();
    cfg.user(&role);
    let a = B::leases(&B::build_on(&cfg, &Settings::new("term-a", 2)));
    let lease = B::acquire(&a, "alerts", &short(), None)
        .await
        .unwrap()
        .unwrap();
    let lost = lease.lost();
    admin
        .batch_execute(&format!(
            "ALTER ROLE \"{role}\" NOLOGIN;
             SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}';"
        ))
        .await
        .unwrap();
    let (taken, ahead_by) = lost_then_taken_over::<B>(b, lost).await;
    eprintln!("terminated: lost signal {ahead_by:?} before the take-over");
    // The failed renewals were retried, not given up at the first error.
    let stats = B::lease_stats(&a);
    assert!(stats.renewal_failures >= 2, "{stats:?}");
    // Back in: A's late release leaves B's term alone.
    admin
        .batch_execute(&format!("ALTER ROLE \"{role}\" LOGIN"))
        .await
        .unwrap();
    assert!(B::release(lease).await.unwrap_err().is_lease_lost());
    assert_eq!(
        row(&admin, "alerts").await,
        Some((taken.term().holder.clone(), taken.term().token))
    );
}

backends!(a_slow_batch_holds_up_no_other_lease);
async fn a_slow_batch_holds_up_no_other_lease<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let (pool_a, app_a) = named::<B>(&db, "slow-a", &Settings::new("slow-a", 5));
    let a = B::leases(&pool_a);
    let b = B::leases(&B::build(&db, &Settings::new("slow-b", 2)));
    B::install(&b).await.unwrap();
    // x: deadline 3 s after each renewal starts, expiry 4 s after.
    let x_opts = LeaseOptions::new(4 * S).renew_every(S).safety_margin(S);
    let x = B::acquire(&a, "x", &x_opts, None).await.unwrap().unwrap();
    // Another session locks x's row: x's renewal batch waits on it.
    let locker = lock_rows(&db, "pgwarden_leases", &["x"], "FOR UPDATE").await;
    let x_expires = expiry(&locker, "x").await;
    eventually(3 * S, "x's renewal waits on the row lock", || async {
        busy_backends(&admin, &app_a).await.0 >= 1
    })
    .await;

    // Registered during the slow batch: y, healthy, and z, whose row gets
    // locked too and whose deadline (1.5 s) comes before x's.
    let y = B::acquire(&a, "y", &short(), None).await.unwrap().unwrap();
    let z_opts = LeaseOptions::new(2 * S)
        .renew_every(500 * MS)
        .safety_margin(500 * MS);
    let z_start = Instant::now();
    let z = B::acquire(&a, "z", &z_opts, None).await.unwrap().unwrap();
    locker
        .batch_execute("SELECT 1 FROM pgwarden_leases WHERE name = 'z' FOR UPDATE")
        .await
        .unwrap();
    let z_expires = expiry(&locker, "z").await;

    // z: lost at its own deadline, not when x's batch gives up. By the
    // order of events, not a clock: z is lost before its expiry in the
    // database (2 s after it was taken) while x, whose batch is stuck, is
    // not lost yet (x's deadline, when its batch gives up, comes later). The
    // bound is only against a hang.
    let (x_lost, z_lost) = (x.lost(), z.lost());
    assert_eq!(within(30 * S, "z lost", z_lost).await, LostReason::Deadline);
    let z_lost_at = SystemTime::now();
    assert!(!x.is_lost(), "x's deadline is later");
    eprintln!(
        "slow batch: z lost {:?} after it was taken, {:.3} s before its expiry",
        z_start.elapsed(),
        ahead(z_lost_at, z_expires)
    );
    assert!(ahead(z_lost_at, z_expires) > 0.0);

    // x: lost at its deadline, before its expiry in the database.
    assert_eq!(within(30 * S, "x lost", x_lost).await, LostReason::Deadline);
    let x_lost_at = SystemTime::now();
    eprintln!(
        "slow batch: x lost {:.3} s before its expiry",
        ahead(x_lost_at, x_expires)
    );
    assert!(ahead(x_lost_at, x_expires) > 0.0);
    // y was renewed all along, by batches of its own.
    assert!(!y.is_lost());
    // The stuck renewals were cancelled on the server: once the lock goes,
    // nothing renews x behind its holder's back, and B takes it over.
    eventually(3 * S, "x's renewal cancelled", || async {
        busy_backends(&admin, &app_a).await.0 == 0
    })
    .await;
    drop(locker);
    let taken = B::acquire(&b, "x", &x_opts, Some(10 * S))
        .await
        .unwrap()
        .expect("taken within the wait");
    assert!(SystemTime::now() > x_lost_at);
    assert_eq!(
        taken.term().took_over_from.as_deref(),
        Some(x.term().holder.as_str())
    );
    assert!(!y.is_lost());
    B::release(y).await.unwrap();
}

/// B waits up to 10 s to take "alerts" over while A's `lost` signal is
/// awaited: `lost` must fire (at A's deadline) before B's take-over. Returns
/// B's lease and how long before the take-over the signal came.
async fn lost_then_taken_over<B: Backend>(
    b: B::Leases,
    lost: impl std::future::Future<Output = LostReason>,
) -> (B::Lease, Duration) {
    let taker = tokio::spawn(async move {
        let l = B::acquire(&b, "alerts", &short(), Some(10 * S)).await;
        (Instant::now(), l)
    });
    let reason = within(5 * S, "lost signal", lost).await;
    let lost_at = Instant::now();
    assert_eq!(reason, LostReason::Deadline);
    let (taken_at, taken) = within(10 * S, "take-over", taker).await.unwrap();
    let taken = taken.unwrap().expect("taken within the wait");
    assert!(
        lost_at < taken_at,
        "lost {:?} before the take-over",
        taken_at - lost_at
    );
    (taken, taken_at - lost_at)
}

/// A database with the lease table, a raw client on it, a proxy to the
/// shared server, a direct pool of 4 (it made the table) and a pool `name`
/// of `size` through the proxy, in `mode`.
async fn proxied<B: Backend>(
    name: &'static str,
    size: usize,
    mode: pgwarden::PoolerMode,
) -> (
    TestDb,
    tokio_postgres::Client,
    pgwarden_testing::Proxy,
    B::Pool,
    B::Pool,
) {
    let server = TestServer::shared().unwrap();
    let db = server.create_database().await.unwrap();
    let admin = db.connect().await.unwrap();
    let proxy = pgwarden_testing::Proxy::start(server).unwrap();
    let direct = B::build(&db, &Settings::new("proxied-direct", 4));
    B::install(&B::leases(&direct)).await.unwrap();
    let pool = B::build_on(
        &proxy.pg_config(&db),
        &Settings::new(name, size).pooler(mode),
    );
    (db, admin, proxy, direct, pool)
}

backends!(an_acquisition_whose_answer_is_lost_leaves_no_lease_taken);
/// The connection of an acquisition is reset after the server committed
/// its statement and before its answer arrived (a proxy 500 ms each way: the look at the table has that long):
/// the caller gets the connection's error, and the lease its statement took
/// is released by holder, not left held for its TTL (an error without a
/// SQLSTATE returned at once and left it held: on sqlx, a connection made on
/// a dropped runtime did the same, the hostile reader's F3 of stop 47).
async fn an_acquisition_whose_answer_is_lost_leaves_no_lease_taken<B: Backend>() {
    let (_db, admin, proxy, _direct, pool) =
        proxied::<B>("lost-answer", 4, pgwarden::PoolerMode::Direct).await;
    // Its release comes once the statement's server-side bound (the
    // statement timeout, and a second) has passed: 3 s here.
    let leases = B::leases_bounded(&pool, 2 * S);
    // A first acquisition and release: the connection is made, named.
    let warm = B::acquire(&leases, "warm", &LeaseOptions::new(60 * S), None)
        .await
        .unwrap()
        .expect("free");
    B::release(warm).await.unwrap();
    proxy.set_latency(500 * MS);
    let acquire = tokio::spawn({
        let leases = leases.clone();
        async move { B::acquire(&leases, "job", &LeaseOptions::new(60 * S), None).await }
    });
    // Committed on the server, its answer on the way back: reset.
    eventually(10 * S, "the term committed", || async {
        row(&admin, "job").await.is_some()
    })
    .await;
    proxy.reset_all();
    let answer = within(10 * S, "the acquisition's answer", acquire)
        .await
        .unwrap();
    assert!(answer.is_err(), "the answer was lost: {answer:?}");
    proxy.set_latency(Duration::ZERO);
    eventually(10 * S, "the lost term released by holder", || async {
        row(&admin, "job").await.is_none()
    })
    .await;
}

/// Another session's uncommitted insert of `name` (an acquisition of it
/// waits on the server until that session ends or the statement's bound).
async fn insert_uncommitted(db: &TestDb, name: &str) -> tokio_postgres::Client {
    let blocker = db.connect().await.unwrap();
    blocker.batch_execute("BEGIN").await.unwrap();
    blocker
        .execute(
            "INSERT INTO pgwarden_leases (name, holder, token, taken_at, expires_at) \
             VALUES ($1, 'ghost', -1, now(), now())",
            &[&name],
        )
        .await
        .unwrap();
    blocker
}

/// Waits until a statement of `db` whose text matches `like` waits on a lock.
async fn waits_on_a_lock(admin: &tokio_postgres::Client, like: &str) {
    eventually(10 * S, "a lease statement waits on a lock", || async {
        let n: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                 AND query LIKE $1 AND datname = current_database()",
                &[&like],
            )
            .await
            .unwrap()
            .get(0);
        n > 0
    })
    .await;
}

backends!(an_acquisition_reset_while_it_waits_behind_a_pooler_leaves_no_lease_held);
/// An acquisition waits on the server (behind another session's insert of
/// its name) on a pool configured behind a transaction pooler, where no
/// cancel can reach it; its connection is reset; the other session then
/// rolls back, and the abandoned statement takes the lease. It is released
/// by holder once the statement's bound has passed (it was released at
/// once, found nothing, and the lease stayed held for its TTL: the hostile
/// reader's F2 of stop 47b, 3 of 3).
async fn an_acquisition_reset_while_it_waits_behind_a_pooler_leaves_no_lease_held<B: Backend>() {
    let (db, admin, proxy, _direct, pool) =
        proxied::<B>("reset-waiting", 4, pgwarden::PoolerMode::Transaction).await;
    // Its release comes 5 s after the reset (the bound and a second).
    let leases = B::leases_bounded(&pool, 4 * S);
    let blocker = insert_uncommitted(&db, "job").await;
    let acquire = tokio::spawn({
        let leases = leases.clone();
        async move { B::acquire(&leases, "job", &LeaseOptions::new(60 * S), None).await }
    });
    waits_on_a_lock(&admin, "INSERT INTO%pgwarden_leases%").await;
    proxy.reset_all();
    let answer = within(10 * S, "the acquisition's answer", acquire)
        .await
        .unwrap();
    assert!(answer.is_err(), "its answer was lost: {answer:?}");
    // Well inside its bound, the abandoned statement takes the lease.
    tokio::time::sleep(1500 * MS).await;
    blocker.batch_execute("ROLLBACK").await.unwrap();
    eventually(
        10 * S,
        "the abandoned statement's term released by holder",
        || async { row(&admin, "job").await.is_none() },
    )
    .await;
}

backends!(
    a_batch_whose_answer_is_lost_gives_no_term_to_two_holders,
    flavor = "multi_thread",
    worker_threads = 2
);
/// Sixteen acquisitions at once, most of them gathered into one statement
/// that waits on the server (one of its names is another session's
/// uncommitted insert); its connection is reset. No caller holds a term the
/// database gives another instance: a batch whose answer was lost sent its
/// callers alone under their holder ids while its release by those ids
/// ran, and undid the terms they took (two holders: the hostile reader's
/// F1 of stop 47b, 26 of 45 terms).
async fn a_batch_whose_answer_is_lost_gives_no_term_to_two_holders<B: Backend>() {
    let (db, admin, proxy, direct, pool) =
        proxied::<B>("reset-batch", 8, pgwarden::PoolerMode::Direct).await;
    let other = B::leases(&direct);
    let leases = B::leases_bounded(&pool, 2 * S);
    let opts = LeaseOptions::new(60 * S);
    for i in 0..3 {
        let warm = B::acquire(&leases, &format!("warm{i}"), &opts, None)
            .await
            .unwrap()
            .expect("free");
        B::release(warm).await.unwrap();
    }
    proxy.set_latency(30 * MS);
    let blocker = insert_uncommitted(&db, "n-zz").await;
    let mut names: Vec<String> = (0..15).map(|i| format!("n-{i:02}")).collect();
    names.push("n-zz".to_owned());
    let tasks: Vec<_> = names
        .iter()
        .map(|name| {
            let (leases, opts, name) = (leases.clone(), opts.clone(), name.clone());
            tokio::spawn(async move {
                let r = B::acquire(&leases, &name, &opts, None).await;
                (name, r)
            })
        })
        .collect();
    // The batch (on deadpool; sqlx sent the names alone here) or the
    // blocked name's own statement waits on the insert: reset.
    waits_on_a_lock(&admin, "%pgwarden_leases%").await;
    proxy.reset_all();
    proxy.set_latency(Duration::ZERO);
    let mut held = Vec::new();
    for t in tasks {
        if let (name, Ok(Some(lease))) = within(30 * S, "an answer", t).await.unwrap() {
            held.push((name, lease));
        }
    }
    blocker.batch_execute("ROLLBACK").await.unwrap();
    // Past the abandoned statements' bound (3 s) and their releases.
    tokio::time::sleep(4 * S).await;
    for (name, lease) in held {
        assert_eq!(
            row(&admin, &name).await,
            Some((lease.term().holder.clone(), lease.term().token)),
            "{name}: a caller holds a term the table does not"
        );
        assert!(
            B::acquire(&other, &name, &opts, None)
                .await
                .unwrap()
                .is_none(),
            "{name}: another instance took a term its caller holds"
        );
        B::release(lease).await.unwrap();
    }
    // Nothing is held by a holder nobody has.
    eventually(10 * S, "no lease left held", || async {
        admin
            .query_one(
                "SELECT count(*) FROM pgwarden_leases WHERE holder <> ''",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 0
    })
    .await;
}
