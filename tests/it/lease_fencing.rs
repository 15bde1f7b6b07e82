//! Fenced transactions against a real PostgreSQL: a stale holder's writes
//! are rejected (at the fence, and at the commit, which checks the term
//! again), a take-over waits for the fenced transaction, and the fence
//! gives typed lease errors under every isolation level. On every backend,
//! from one source.

use crate::support;

use std::time::{Duration, Instant};

use pgwarden::{Error, LeaseError, LeaseOptions, LostReason};
use pgwarden_testing::TestDb;
use support::backend::{named, Backend, Settings};
use support::leases::busy_backends;
use support::{admin, db, eventually, within};
use tokio_postgres::IsolationLevel;

const S: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

/// Holder A on a pool of `size_a` (backends named `<app>-a-<backend>`) and
/// holder B on a pool of 2: A's pool, A, B and B's backends' name.
fn two<B: Backend>(
    db: &TestDb,
    app: &'static str,
    size_a: usize,
) -> (B::Pool, B::Leases, B::Leases, String) {
    let (pool_a, _) = named::<B>(db, &format!("{app}-a"), &Settings::new(app, size_a));
    let (pool_b, app_b) = named::<B>(db, &format!("{app}-b"), &Settings::new(app, 2));
    (
        pool_a.clone(),
        B::leases(&pool_a),
        B::leases(&pool_b),
        app_b,
    )
}

backends!(fencing_rejects_the_stale_holder);
async fn fencing_rejects_the_stale_holder<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let (pool_a, a, b, app_b) = two::<B>(&db, "fence", 3);
    admin
        .batch_execute("CREATE TABLE ledger (writer text, token bigint)")
        .await
        .unwrap();
    // No renewal while the steps below run: they expire the term by hand,
    // and a renewal landing after that (a renewal needs only its holder
    // and token) would give A's term back. 5 s was not enough on a busy
    // machine (stop 43: B's second acquisition found A renewed).
    let opts = LeaseOptions::new(60 * S).renew_every(50 * S);
    let old = B::acquire(&a, "ledger", &opts, None)
        .await
        .unwrap()
        .unwrap();

    // A writes under its fence and holds the transaction open.
    let mut conn = B::tx_source(&pool_a).await;
    let tx = B::begin(&mut conn, None).await;
    let mut tx = B::fence(&old, tx).await.unwrap();
    let token = old.term().token;
    B::fx_run(&mut tx, "INSERT INTO ledger VALUES ('a', $1)", Some(token))
        .await
        .unwrap();
    // A is cut off: its term expires in the database (time passes).
    admin
        .batch_execute(
            "UPDATE pgwarden_leases SET expires_at = now() - interval '1 ms' WHERE name = 'ledger'",
        )
        .await
        .unwrap();
    // B's take-over waits for A's fenced transaction…
    let taker_opts = opts.clone();
    let taker = tokio::spawn(async move {
        let got = B::acquire(&b, "ledger", &taker_opts, None).await;
        (b, got)
    });
    eventually(5 * S, "B waits on the fenced row", || async {
        busy_backends(&admin, &app_b).await.0 == 1 || taker.is_finished()
    })
    .await;
    // …A's commit checks the term once more: expired, so nothing lands…
    let err = B::fx_commit(tx).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::Lease(LeaseError::Lost {
                reason: LostReason::Expired,
                ..
            })
        ),
        "{err}"
    );
    // …and B takes it (at once, or at its next attempt if its first one
    // answered busy while A's transaction was open).
    let (b, got) = within(5 * S, "take-over", taker).await.unwrap();
    let new = match got.unwrap() {
        Some(lease) => lease,
        None => B::acquire(&b, "ledger", &opts, None)
            .await
            .unwrap()
            .unwrap(),
    };
    assert!(new.term().token > old.term().token);

    // A, stale, tries again: rejected (its lost signal fired at the
    // refused commit, with the reason it saw then), nothing written.
    let tx = B::begin(&mut conn, None).await;
    let err = B::fence(&old, tx).await.unwrap_err();
    assert!(err.is_lease_lost(), "{err}");
    let rows: Vec<(String, i64)> = admin
        .query_typed("SELECT writer, token FROM ledger", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(rows, []);
    drop(conn);

    // A fenced transaction does not hold up its own lease's renewals.
    let keep = B::acquire(&a, "keep", &LeaseOptions::new(S), None)
        .await
        .unwrap()
        .unwrap();
    let mut conn = B::tx_source(&pool_a).await;
    let tx = B::begin(&mut conn, None).await;
    let mut tx = B::fence(&keep, tx).await.unwrap();
    let renewed = B::lease_stats(&a).renewed;
    eventually(3 * S, "renewals during a fenced transaction", || {
        std::future::ready(B::lease_stats(&a).renewed >= renewed + 3)
    })
    .await;
    assert!(!keep.is_lost());
    B::fx_check(&mut tx).await.unwrap();
    B::fx_commit(tx).await.unwrap();
}

/// Under a snapshot isolation level: a renewal by the holder itself after
/// the snapshot leaves the fence passing, even once the snapshot's expiry
/// has passed; a take-over committed after the snapshot fails the fence
/// with `LeaseLost { Taken }`, never with PostgreSQL's serialization failure.
async fn fence_under<B: Backend>(level: IsolationLevel, app: &'static str) {
    let db = db().await;
    let admin = admin(&db).await;
    admin
        .batch_execute("CREATE TABLE ledger (token bigint)")
        .await
        .unwrap();
    let (pool_a, a, b, _) = two::<B>(&db, app, 3);

    // 1. Renewed after the snapshot: still ours.
    let opts = LeaseOptions::new(S).renew_every(200 * MS);
    let own = B::acquire(&a, "own", &opts, None).await.unwrap().unwrap();
    let mut conn = B::tx_source(&pool_a).await;
    let tx = B::begin(&mut conn, Some(level)).await;
    let mut tx = B::fence(&own, tx).await.unwrap(); // the snapshot is taken here
    let snapshot = Instant::now();
    // Past the snapshot's expiry, renewed meanwhile. The expiry the snapshot
    // holds was set by a renewal before it, so it is at most the TTL (1 s)
    // after this instant: 1.5 s after it is past, with room for the server's
    // clock reading. Waiting out that time is the scenario; the renewals are
    // awaited.
    let renewed = B::lease_stats(&a).renewed;
    eventually(
        10 * S,
        "1.5 s past the snapshot and 4 renewals since",
        || {
            std::future::ready(
                snapshot.elapsed() >= 1500 * MS && B::lease_stats(&a).renewed >= renewed + 4,
            )
        },
    )
    .await;
    B::fx_check(&mut tx).await.unwrap();
    let token = own.term().token;
    B::fx_run(&mut tx, "INSERT INTO ledger VALUES ($1)", Some(token))
        .await
        .unwrap();
    B::fx_commit(tx).await.unwrap();
    assert!(!own.is_lost());

    // 2. Taken over after the snapshot: a typed error.
    // No renewal within the steps (see above).
    let stale_opts = LeaseOptions::new(60 * S).renew_every(50 * S);
    let stale = B::acquire(&a, "taken", &stale_opts, None)
        .await
        .unwrap()
        .unwrap();
    let mut tx = B::begin(&mut conn, Some(level)).await;
    B::tx_run(&mut tx, "SELECT 1").await.unwrap(); // the snapshot
    admin
        .batch_execute(
            "UPDATE pgwarden_leases SET expires_at = now() - interval '1 ms' WHERE name = 'taken'",
        )
        .await
        .unwrap();
    let new = within(
        5 * S,
        "take-over",
        B::acquire(&b, "taken", &stale_opts, None),
    )
    .await
    .unwrap()
    .expect("expired: B takes it");
    let err = B::fence(&stale, tx).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::Lease(LeaseError::Lost {
                reason: LostReason::Taken,
                ..
            })
        ),
        "{err}"
    );
    // 3. Taken over before the snapshot: the same.
    let tx = B::begin(&mut conn, Some(level)).await;
    let err = B::fence(&stale, tx).await.unwrap_err();
    assert!(err.is_lease_lost(), "{err}");
    drop(conn);
    let rows: Vec<i64> = admin
        .query_typed("SELECT token FROM ledger", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(rows, [own.term().token]);
    assert!(new.term().token > stale.term().token);
}

backends!(fencing_under_repeatable_read);
async fn fencing_under_repeatable_read<B: Backend>() {
    fence_under::<B>(IsolationLevel::RepeatableRead, "fence-rr").await;
}

backends!(fencing_under_serializable);
async fn fencing_under_serializable<B: Backend>() {
    fence_under::<B>(IsolationLevel::Serializable, "fence-ser").await;
}
