//! Contenders against a real PostgreSQL, on every backend: a contender
//! never waits on a live holder (not even one inside a fenced transaction),
//! a take-over never waits long on a locked row, and a statement that
//! times out is cancelled on the server, whether it waits on a lock or on
//! a stopped backend.

use crate::support;

use std::time::{Duration, Instant};

use pgwarden::{LeaseHandle, LeaseOptions};
use support::backend::{named, Backend, Settings};
use support::leases::{backends, busy_backends, insert_expired, lock_rows};
use support::{admin, db, eventually, within, Stopped};

const S: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

/// A fenced statement that sleeps 10 s (the fenced statement's parameters
/// used, none needed).
const SLEEP_10: &str =
    "SELECT count(*) FROM (SELECT pg_sleep(10), $1::text, $2::int8, $3::int4, $4::text) s";

/// Whether the lease error is the lease statement's timeout.
fn is_lease_timeout(e: &pgwarden::Error) -> bool {
    matches!(
        e,
        pgwarden::Error::Lease(pgwarden::LeaseError::Timeout { .. })
    )
}

backends!(a_contender_skips_at_once_while_the_holder_sits_in_a_fenced_transaction);
async fn a_contender_skips_at_once_while_the_holder_sits_in_a_fenced_transaction<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let (pool_a, app_a) = named::<B>(&db, "fenced-a", &Settings::new("fenced-a", 3));
    let a = B::leases(&pool_a);
    let (pool_b, app_b) = named::<B>(&db, "skip-b", &Settings::new("skip-b", 2));
    let b = B::leases(&pool_b);
    let lease = B::acquire(&a, "ledger", &LeaseOptions::new(30 * S), None)
        .await
        .unwrap()
        .unwrap();

    // The holder fences a transaction and stays in it for 10 s.
    let handle = LeaseHandle::clone(&lease);
    let holder = tokio::spawn(async move {
        // Cancelled by the test once it has seen enough.
        let _ = B::fenced_scalar(&pool_a, &handle, SLEEP_10, 0).await;
    });
    let sleeping = "SELECT count(*) FROM pg_stat_activity \
                     WHERE application_name = $1 AND wait_event = 'PgSleep'";
    eventually(
        5 * S,
        "the holder sleeps in its fenced transaction",
        || async {
            let row = admin.query_one(sleeping, &[&app_a]).await.unwrap();
            row.get::<_, i64>(0) == 1
        },
    )
    .await;

    for _ in 0..3 {
        let t = Instant::now();
        // A skip that waited on the holder would wait for its 10 s sleep:
        // half of it is the bound.
        let got = within(
            5 * S,
            "a skip",
            B::acquire(&b, "ledger", &LeaseOptions::new(30 * S), None),
        )
        .await
        .unwrap();
        assert!(got.is_none(), "held by a live term");
        eprintln!("skip while the holder is fenced: {:?}", t.elapsed());
    }
    // Nothing of B's waits on the server.
    assert_eq!(busy_backends(&admin, &app_b).await, (0, 0));

    // Let the holder go.
    admin
        .execute(
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity \
              WHERE application_name = $1 AND wait_event = 'PgSleep'",
            &[&app_a],
        )
        .await
        .unwrap();
    within(5 * S, "holder done", holder).await.unwrap();
    assert!(!lease.is_lost());
    B::release(lease).await.unwrap();
}

backends!(a_blocked_takeover_answers_busy_at_once_and_takes_over_once_the_lock_goes);
/// An expired term whose row another session locks (a stale holder inside
/// a fenced transaction): the take-over does not wait for it. It answers
/// busy within its row-lock bound, leaves nothing waiting on the server, and
/// takes the lease as soon as the lock goes.
async fn a_blocked_takeover_answers_busy_at_once_and_takes_over_once_the_lock_goes<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let (pool_b, app_b) = named::<B>(&db, "blocked-b", &Settings::new("blocked-b", 2));
    let b = B::leases(&pool_b);
    B::install(&b).await.unwrap();
    insert_expired(&admin, "stale", "old-holder").await;
    let locker = lock_rows(&db, "pgwarden_leases", &["stale"], "FOR KEY SHARE").await;

    for _ in 0..3 {
        let t = Instant::now();
        let got = B::acquire(&b, "stale", &LeaseOptions::new(30 * S), None)
            .await
            .unwrap();
        assert!(got.is_none(), "a locked row is busy");
        // The take-over bound is 20 ms; the rest is the round trip on a
        // loaded machine. A take-over that waited on the lock instead would
        // wait until the statement timeout (10 s, then an error): half of
        // it is the bound.
        assert!(t.elapsed() < 5 * S, "{:?}", t.elapsed());
        // Nothing of B waits on a lock.
        assert_eq!(busy_backends(&admin, &app_b).await.0, 0);
    }
    // Still the stale term: the blocked take-over did not happen.
    let holder: String = admin
        .query_one(
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
            B::acquire(&b, "stale", &LeaseOptions::new(30 * S), Some(10 * S)).await
        })
    };
    eventually(3 * S, "the waiter has tried", || {
        std::future::ready(B::lease_stats(&b).statements >= 8)
    })
    .await;
    drop(locker);
    let lease = within(5 * S, "take-over after the lock", waiter)
        .await
        .unwrap()
        .unwrap()
        .expect("taken over");
    assert_eq!(lease.term().took_over_from.as_deref(), Some("old-holder"));
    B::release(lease).await.unwrap();
}

backends!(a_timed_out_statement_is_cancelled_on_the_server);
/// A statement that waits longer than its timeout (a release behind a row
/// lock another session holds `FOR UPDATE`) fails with the lease timeout
/// and is cancelled on the server: nothing of B goes on waiting.
async fn a_timed_out_statement_is_cancelled_on_the_server<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let (pool_b, app_b) = named::<B>(&db, "cancel-b", &Settings::new("cancel-b", 2));
    let b = B::leases_bounded(&pool_b, 500 * MS);
    let lease = B::acquire(&b, "held", &LeaseOptions::new(30 * S), None)
        .await
        .unwrap()
        .unwrap();
    let mine = lease.term().holder.clone();
    let locker = lock_rows(&db, "pgwarden_leases", &["held"], "FOR UPDATE").await;
    let t = Instant::now();
    // The release waits on the row lock, held until the end of the test:
    // it ends at its 500 ms timeout or never. The bound is only against a
    // hang; the error says which timeout ended it.
    let err = within(30 * S, "the release to time out", B::release(lease))
        .await
        .unwrap_err();
    assert!(is_lease_timeout(&err), "{err}");
    let took = t.elapsed();
    eventually(3 * S, "no backend of B waits", || async {
        busy_backends(&admin, &app_b).await == (0, 0)
    })
    .await;
    eprintln!("timed out after {took:?}; no backend of B left waiting");
    // The cancelled release did not happen behind B's back.
    drop(locker);
    let holder: String = admin
        .query_one(
            "SELECT holder FROM pgwarden_leases WHERE name = 'held'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(holder, mine);
    assert!(backends(&admin, &app_b).await.len() <= 2);
}

backends!(an_acquisition_abandoned_on_a_stopped_backend_leaves_no_lease);
/// The statement reaches a backend that is stopped: the client gives up,
/// cancels it (deadpool: a cancel request; sqlx: `pg_cancel_backend` from
/// another connection), and releases by holder in case the statement took
/// the lease after all. Once the backend runs again, the lease is free.
async fn an_acquisition_abandoned_on_a_stopped_backend_leaves_no_lease<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    // Known direct (the default of `Settings`): cancels go out.
    let (pool_b, app_b) = named::<B>(&db, "stopped-b", &Settings::new("stopped-b", 2));
    let b = B::leases_bounded(&pool_b, 500 * MS);
    B::install(&b).await.unwrap();
    let stopped = Stopped::stop(backends(&admin, &app_b).await).expect("SIGSTOP");
    let err = B::acquire(&b, "job", &LeaseOptions::new(30 * S), None)
        .await
        .unwrap_err();
    assert!(is_lease_timeout(&err), "{err}");
    drop(stopped);
    // Cancelled, or taken and released again: never left held.
    eventually(
        5 * S,
        "the abandoned acquisition leaves no holder",
        || async {
            let held: i64 = admin
                .query_one(
                    "SELECT count(*) FROM pgwarden_leases WHERE name = 'job' AND holder <> ''",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            held == 0 && busy_backends(&admin, &app_b).await.1 == 0
        },
    )
    .await;
    let c = B::leases(&B::build(&db, &Settings::new("stopped-c", 2)));
    assert!(B::acquire(&c, "job", &LeaseOptions::new(30 * S), None)
        .await
        .unwrap()
        .is_some());
}

backends!(a_new_row_waits_for_an_insert_in_flight_instead_of_answering_busy);
/// A lock wait on the way to a new row says nothing about the name: an
/// acquisition of a free name waits for a same-named insert in flight in
/// another session (or for the table's extension lock under a burst of
/// inserts) as any insert does, bounded by the statement timeout, not by
/// the 20 ms take-over bound. Held 300 ms, then rolled back: the name is
/// still free, and the acquisition takes it.
async fn a_new_row_waits_for_an_insert_in_flight_instead_of_answering_busy<B: Backend>() {
    let db = db().await;
    let (pool, app) = named::<B>(&db, "new-row", &Settings::new("new-row", 2));
    let leases = B::leases(&pool);
    B::install(&leases).await.unwrap();
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
        async move { B::acquire(&leases, "report", &LeaseOptions::new(30 * S), None).await }
    });
    eventually(
        10 * S,
        "the acquisition waits on the insert in flight",
        || async { busy_backends(&admin, &app).await.0 == 1 },
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
    assert_eq!(B::lease_stats(&leases).takeovers_blocked, 0);
    B::release(lease).await.unwrap();
}
