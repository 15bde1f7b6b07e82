//! Contenders against a real PostgreSQL: a contender never waits on a live
//! holder (not even one inside a fenced transaction), a take-over never
//! waits long on a locked row, and a statement that times out is cancelled
//! on the server, whether it waits on a lock or on a stopped backend.

use crate::support;

use std::time::{Duration, Instant};

use pgwarden::{LeaseHandle, LeaseOptions, Leases, PoolerMode};
use support::leases::{
    acquire_times_out, backends, busy_backends, insert_expired, lock_rows, pool, pool_behind,
};
use support::{admin, db, eventually, within, Stopped};

const S: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

#[tokio::test]
async fn a_contender_skips_at_once_while_the_holder_sits_in_a_fenced_transaction() {
    let db = db().await;
    let admin = admin(&db).await;
    let pool_a = pool(&db, 3, "fenced-a");
    let a = Leases::new(&pool_a);
    let b = Leases::new(&pool(&db, 2, "skip-b"));
    let lease = a
        .acquire("ledger", &LeaseOptions::new(30 * S), None)
        .await
        .unwrap()
        .unwrap();

    // The holder fences a transaction and stays in it for 10 s.
    let handle = LeaseHandle::clone(&lease);
    let holder = tokio::spawn(async move {
        let mut conn = pool_a.get().await.unwrap();
        let tx = handle
            .fence(conn.transaction().await.unwrap())
            .await
            .unwrap();
        // Cancelled by the test once it has seen enough.
        let _ = tx.batch_execute("SELECT pg_sleep(10)").await;
    });
    eventually(5 * S, "the holder sleeps in its fenced transaction", || async {
        admin
            .query_typed_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'fenced-a' AND wait_event = 'PgSleep'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 1
    })
    .await;

    for _ in 0..3 {
        let t = Instant::now();
        // A skip that waited on the holder would wait for its 10 s sleep:
        // half of it is the bound.
        let got = within(
            5 * S,
            "a skip",
            b.acquire("ledger", &LeaseOptions::new(30 * S), None),
        )
        .await
        .unwrap();
        assert!(got.is_none(), "held by a live term");
        eprintln!("skip while the holder is fenced: {:?}", t.elapsed());
    }
    // Nothing of B's waits on the server.
    assert_eq!(busy_backends(&admin, "skip-b").await, (0, 0));

    // Let the holder go.
    admin
        .batch_execute(
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE application_name = 'fenced-a' AND wait_event = 'PgSleep'",
        )
        .await
        .unwrap();
    within(5 * S, "holder done", holder).await.unwrap();
    assert!(!lease.is_lost());
    lease.release().await.unwrap();
}

/// An expired term whose row another session locks (a stale holder inside
/// a fenced transaction): the take-over does not wait for it. It answers
/// busy within its row-lock bound, leaves nothing waiting on the server, and
/// takes the lease as soon as the lock goes.
#[tokio::test]
async fn a_blocked_takeover_answers_busy_at_once_and_takes_over_once_the_lock_goes() {
    let db = db().await;
    let admin = admin(&db).await;
    let b = Leases::new(&pool(&db, 2, "blocked-b"));
    b.install().await.unwrap();
    insert_expired(&admin, "stale", "old-holder").await;
    let locker = lock_rows(&db, "pgwarden_leases", &["stale"], "FOR KEY SHARE").await;

    for _ in 0..3 {
        let t = Instant::now();
        let got = b
            .acquire("stale", &LeaseOptions::new(30 * S), None)
            .await
            .unwrap();
        assert!(got.is_none(), "a locked row is busy");
        // The take-over bound is 20 ms; the rest is the round trip on a
        // loaded machine. A take-over that waited on the lock instead would
        // wait until the statement timeout (10 s, then an error): half of
        // it is the bound.
        assert!(t.elapsed() < 5 * S, "{:?}", t.elapsed());
        // Nothing of B waits on a lock (pooler detection may be running).
        assert_eq!(busy_backends(&admin, "blocked-b").await.0, 0);
    }
    // Still the stale term: the blocked take-over did not happen.
    let holder: String = admin
        .query_typed_one(
            "SELECT holder FROM pgwarden_leases WHERE name = 'stale'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(holder, "old-holder");

    // A waiting caller gets it once the lock goes.
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move {
            b.acquire("stale", &LeaseOptions::new(30 * S), Some(10 * S))
                .await
        })
    };
    eventually(3 * S, "the waiter has tried", || async {
        b.stats().statements >= 8
    })
    .await;
    drop(locker);
    let lease = within(5 * S, "take-over after the lock", waiter)
        .await
        .unwrap()
        .unwrap()
        .expect("taken over");
    assert_eq!(lease.term().took_over_from.as_deref(), Some("old-holder"));
    lease.release().await.unwrap();
}

/// A statement that waits longer than its timeout (a release behind a row
/// lock another session holds `FOR UPDATE`) fails with the lease timeout
/// and is cancelled on the server: nothing of B goes on waiting.
#[tokio::test]
async fn a_timed_out_statement_is_cancelled_on_the_server() {
    let db = db().await;
    let admin = admin(&db).await;
    let b = Leases::builder(&pool(&db, 2, "cancel-b"))
        .statement_timeout(500 * MS)
        .build()
        .unwrap();
    let lease = b
        .acquire("held", &LeaseOptions::new(30 * S), None)
        .await
        .unwrap()
        .unwrap();
    let mine = lease.term().holder.clone();
    let locker = lock_rows(&db, "pgwarden_leases", &["held"], "FOR UPDATE").await;
    let t = Instant::now();
    // The release waits on the row lock, held until the end of the test:
    // it ends at its 500 ms timeout or never. The bound is only against a
    // hang; the error says which timeout ended it.
    let err = within(30 * S, "the release to time out", lease.release())
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            pgwarden::Error::Lease(pgwarden::LeaseError::Timeout { .. })
        ),
        "{err}"
    );
    let took = t.elapsed();
    eventually(3 * S, "no backend of B waits", || async {
        busy_backends(&admin, "cancel-b").await == (0, 0)
    })
    .await;
    eprintln!("timed out after {took:?}; no backend of B left waiting");
    // The cancelled release did not happen behind B's back.
    drop(locker);
    let holder: String = admin
        .query_typed_one(
            "SELECT holder FROM pgwarden_leases WHERE name = 'held'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(holder, mine);
    assert!(backends(&admin, "cancel-b").await.len() <= 2);
}

/// The statement reaches a backend that is stopped: the client gives up,
/// sends a cancel request, and releases by holder in case the statement
/// took the lease after all. Once the backend runs again, the lease is free.
#[tokio::test]
async fn an_acquisition_abandoned_on_a_stopped_backend_leaves_no_lease() {
    let db = db().await;
    let admin = admin(&db).await;
    // Known direct: cancel requests go out. (Configured: detection takes
    // two connections outside the probe reserve, more than a pool of 2 has.)
    let pool_b = pool_behind(db.pg_config(), 2, "stopped-b", PoolerMode::Direct);
    let b = Leases::builder(&pool_b)
        .statement_timeout(500 * MS)
        .build()
        .unwrap();
    b.install().await.unwrap();
    let stopped = Stopped::stop(backends(&admin, "stopped-b").await).expect("SIGSTOP");
    acquire_times_out(&b, "job").await;
    drop(stopped);
    // Cancelled, or taken and released again: never left held.
    eventually(
        5 * S,
        "the abandoned acquisition leaves no holder",
        || async {
            let held: i64 = admin
                .query_typed_one(
                    "SELECT count(*) FROM pgwarden_leases WHERE name = 'job' AND holder <> ''",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            held == 0 && busy_backends(&admin, "stopped-b").await.1 == 0
        },
    )
    .await;
    let c = Leases::new(&pool(&db, 2, "stopped-c"));
    assert!(c
        .acquire("job", &LeaseOptions::new(30 * S), None)
        .await
        .unwrap()
        .is_some());
}

/// A lock wait on the way to a new row says nothing about the name: an
/// acquisition of a free name waits for a same-named insert in flight in
/// another session (or for the table's extension lock under a burst of
/// inserts) as any insert does, bounded by the statement timeout, not by
/// the 20 ms take-over bound. Held 300 ms, then rolled back: the name is
/// still free, and the acquisition takes it.
#[tokio::test]
async fn a_new_row_waits_for_an_insert_in_flight_instead_of_answering_busy() {
    let db = db().await;
    let leases = Leases::new(&pool(&db, 2, "new-row"));
    leases.install().await.unwrap();
    let mut other = admin(&db).await;
    let admin = admin(&db).await;
    let tx = other.transaction().await.unwrap();
    tx.execute(
        "INSERT INTO pgwarden_leases (name, holder, token, expires_at)
         VALUES ('report', 'in-flight', nextval('pgwarden_leases_token_seq'), now() + interval '1 min')",
        &[],
    )
    .await
    .unwrap();
    let started = Instant::now();
    let attempt = tokio::spawn({
        let leases = leases.clone();
        async move {
            leases
                .acquire("report", &LeaseOptions::new(30 * S), None)
                .await
        }
    });
    eventually(
        10 * S,
        "the acquisition waits on the insert in flight",
        || async { busy_backends(&admin, "new-row").await.0 == 1 },
    )
    .await;
    // Past the take-over bound many times over, still waiting.
    tokio::time::sleep(300 * MS).await;
    assert!(
        !attempt.is_finished(),
        "the acquisition answered while the insert was in flight"
    );
    tx.rollback().await.unwrap();
    let lease = within(10 * S, "the acquisition", attempt)
        .await
        .unwrap()
        .unwrap();
    let lease = lease.expect("the name is free once the insert rolled back");
    assert!(started.elapsed() >= 300 * MS);
    assert_eq!(leases.stats().takeovers_blocked, 0);
    lease.release().await.unwrap();
}
