//! The lost signal under faults, against a real PostgreSQL: for each, the
//! holder's `lost()` fires before the lease expires on the server, that is
//! before any other instance can take it. A hung server (postmaster and
//! backends stopped), the holder's backend stopped or terminated, a slow
//! renewal batch, the renewer's runtime dropped, and the renewer panicking.

use crate::support;

use std::time::{Duration, Instant, SystemTime};

use pgwarden::{LeaseOptions, Leases, LostReason};
use pgwarden_testing::TestServer;
use support::leases::{
    ahead, backends, busy_backends, expiry, lock_rows, pool, pool_with, row, short, TwoHolders,
};
use support::{admin, db, eventually, within, Stopped};

const S: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_fires_before_expiry_when_the_server_hangs() {
    // A server of its own: every process of it is stopped.
    let server = tokio::task::spawn_blocking(TestServer::start_local)
        .await
        .unwrap()
        .expect("a dedicated throwaway PostgreSQL");
    let db = server.create_database().await.unwrap();
    let admin = admin(&db).await;
    let leases = Leases::new(&pool(&db, 3, "hung"));
    let opts = LeaseOptions::new(2 * S)
        .renew_every(500 * MS)
        .safety_margin(500 * MS);
    let lease = leases.acquire("job", &opts, None).await.unwrap().unwrap();
    // Right after a renewal: the expiry the database holds until it hangs.
    let renewed = leases.stats().renewed;
    eventually(3 * S, "a renewal", || async {
        leases.stats().renewed > renewed
    })
    .await;
    let expires = expiry(&admin, "job").await;
    let frozen = server.freeze().expect("SIGSTOP to the server's processes");
    let t = Instant::now();

    let reason = within(3 * S, "lost signal", lease.lost()).await;
    let lost_at = SystemTime::now();
    assert_eq!(reason, LostReason::Deadline);
    assert!(lease.is_lost());
    let margin = ahead(lost_at, expires);
    eprintln!(
        "hung server: lost {:?} after the stop, {margin:.3} s before the lease expired in the database",
        t.elapsed()
    );
    assert!(margin > 0.0, "lost after the expiry: {margin} s");
    // Renewals were tried and bounded, not stuck.
    eventually(3 * S, "a failed renewal", || async {
        leases.stats().renewal_failures >= 1
    })
    .await;
    drop(frozen);
    // Back: nothing of the holder's is left waiting on the server.
    eventually(5 * S, "no statement of the holder left running", || async {
        busy_backends(&admin, "hung").await == (0, 0)
    })
    .await;
}

#[tokio::test]
async fn lost_fires_before_takeover_when_the_backend_is_stopped() {
    let TwoHolders { admin, a, b, .. } = TwoHolders::installed("stop").await;
    let lease = a.acquire("alerts", &short(), None).await.unwrap().unwrap();
    let lost = lease.lost();
    let stopped = Stopped::stop(backends(&admin, "stop-a").await).expect("SIGSTOP");
    let (taken, ahead_by) = lost_then_taken_over(b, lost).await;
    eprintln!("SIGSTOP: lost signal {ahead_by:?} before the take-over");
    assert!(taken.term().token > lease.term().token);
    assert_eq!(
        taken.term().took_over_from.as_deref(),
        Some(lease.term().holder.as_str())
    );
    drop(stopped);
}

#[tokio::test]
async fn lost_fires_before_takeover_when_the_backend_is_terminated() {
    let db = db().await;
    let admin = admin(&db).await;
    let b = Leases::new(&pool(&db, 2, "term-b"));
    b.install().await.unwrap();
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
    let a = Leases::new(&pool_with(cfg, 2, "term-a"));
    let lease = a.acquire("alerts", &short(), None).await.unwrap().unwrap();
    let lost = lease.lost();
    admin
        .batch_execute(&format!(
            "ALTER ROLE \"{role}\" NOLOGIN;
             SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}';"
        ))
        .await
        .unwrap();
    let (taken, ahead_by) = lost_then_taken_over(b, lost).await;
    eprintln!("terminated: lost signal {ahead_by:?} before the take-over");
    // The failed renewals were retried, not given up at the first error.
    assert!(a.stats().renewal_failures >= 2, "{:?}", a.stats());
    // Back in: A's late release leaves B's term alone.
    admin
        .batch_execute(&format!("ALTER ROLE \"{role}\" LOGIN"))
        .await
        .unwrap();
    assert!(lease.release().await.unwrap_err().is_lease_lost());
    assert_eq!(
        row(&admin, "alerts").await,
        Some((taken.term().holder.clone(), taken.term().token))
    );
}

#[tokio::test]
async fn a_slow_batch_holds_up_no_other_lease() {
    let db = db().await;
    let admin = admin(&db).await;
    let a = Leases::new(&pool(&db, 5, "slow-a"));
    let b = Leases::new(&pool(&db, 2, "slow-b"));
    b.install().await.unwrap();
    // x: deadline 3 s after each renewal starts, expiry 4 s after.
    let x_opts = LeaseOptions::new(4 * S).renew_every(S).safety_margin(S);
    let x = a.acquire("x", &x_opts, None).await.unwrap().unwrap();
    // Another session locks x's row: x's renewal batch waits on it.
    let locker = lock_rows(&db, "pgwarden_leases", &["x"], "FOR UPDATE").await;
    let x_expires = expiry(&locker, "x").await;
    eventually(3 * S, "x's renewal waits on the row lock", || async {
        busy_backends(&admin, "slow-a").await.0 >= 1
    })
    .await;

    // Registered during the slow batch: y, healthy, and z, whose row gets
    // locked too and whose deadline (1.5 s) comes before x's.
    let y = a.acquire("y", &short(), None).await.unwrap().unwrap();
    let z_opts = LeaseOptions::new(2 * S)
        .renew_every(500 * MS)
        .safety_margin(500 * MS);
    let z_start = Instant::now();
    let z = a.acquire("z", &z_opts, None).await.unwrap().unwrap();
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
        busy_backends(&admin, "slow-a").await.0 == 0
    })
    .await;
    drop(locker);
    let taken = b
        .acquire("x", &x_opts, Some(10 * S))
        .await
        .unwrap()
        .expect("taken within the wait");
    assert!(SystemTime::now() > x_lost_at);
    assert_eq!(
        taken.term().took_over_from.as_deref(),
        Some(x.term().holder.as_str())
    );
    assert!(!y.is_lost());
    y.release().await.unwrap();
}

/// B waits up to 10 s to take "alerts" over while A's `lost` signal is
/// awaited: `lost` must fire (at A's deadline) before B's take-over. Returns
/// B's lease and how long before the take-over the signal came.
async fn lost_then_taken_over(
    b: Leases,
    lost: impl std::future::Future<Output = LostReason>,
) -> (pgwarden::Lease, Duration) {
    let taker = tokio::spawn(async move {
        let l = b.acquire("alerts", &short(), Some(10 * S)).await;
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
