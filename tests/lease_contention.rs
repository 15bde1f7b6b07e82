//! Contenders against a real PostgreSQL: a contender never waits on a live
//! holder (not even one inside a fenced transaction), and a statement that
//! times out is cancelled on the server, whether it waits on a lock or on a
//! stopped backend.

mod support;

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
        let tx = conn.transaction().await.unwrap();
        handle.fence(&tx).await.unwrap();
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
        let got = within(
            S,
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

#[tokio::test]
async fn a_timed_out_statement_is_cancelled_on_the_server() {
    let db = db().await;
    let admin = admin(&db).await;
    let b = Leases::builder(&pool(&db, 2, "cancel-b"))
        .statement_timeout(500 * MS)
        .build()
        .unwrap();
    b.install().await.unwrap();
    // An expired term whose stale holder sits in a fenced transaction: the
    // take-over must wait for it, longer than B's statement timeout.
    insert_expired(&admin, "stale", "old-holder").await;
    let locker = lock_rows(&db, "pgwarden_leases", &["stale"], "FOR KEY SHARE").await;

    let took = acquire_times_out(&b, "stale").await;
    assert!(took < 1500 * MS, "{took:?}");
    // Cancelled on the server: B's backend does not go on waiting for the
    // row lock (it is gone: its connection was closed after the cancel).
    eventually(3 * S, "no backend of B waits", || async {
        busy_backends(&admin, "cancel-b").await == (0, 0)
    })
    .await;
    eprintln!("timed out after {took:?}; no backend of B left waiting");

    // Once the stale holder's transaction ends, the row is still its term:
    // the cancelled take-over did not happen behind B's back.
    // Ended here, not by a drop: once ROLLBACK returns the row lock is gone,
    // and no statement of B is left on the server to take the row after it
    // (checked above), so the row read next is final.
    within(
        5 * S,
        "the stale holder's ROLLBACK",
        locker.batch_execute("ROLLBACK"),
    )
    .await
    .unwrap();
    let holder: String = admin
        .query_typed_one(
            "SELECT holder FROM pgwarden_leases WHERE name = 'stale'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(holder, "old-holder");
    // And B takes it now, at once.
    let lease = within(
        2 * S,
        "take-over",
        b.acquire("stale", &LeaseOptions::new(30 * S), None),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(lease.term().took_over_from.as_deref(), Some("old-holder"));
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
