//! Fenced transactions against a real PostgreSQL: a stale holder's writes
//! are rejected (at the fence, and at the commit, which checks the term
//! again), a take-over waits for the fenced transaction, and the fence
//! gives typed lease errors under every isolation level.

use crate::support;

use std::time::{Duration, Instant};

use pgwarden::{Error, LeaseError, LeaseOptions, Leases, LostReason};
use support::leases::{busy_backends, pool, TwoHolders};
use support::{admin, db, eventually, within};
use tokio_postgres::types::Type;
use tokio_postgres::IsolationLevel;

const S: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

#[tokio::test]
async fn fencing_rejects_the_stale_holder() {
    let TwoHolders {
        admin,
        pool_a,
        a,
        b,
        ..
    } = TwoHolders::new("fence", 3).await;
    admin
        .batch_execute("CREATE TABLE ledger (writer text, token bigint)")
        .await
        .unwrap();
    // No renewal within the next 5 s: the steps below expire the term by hand.
    let opts = LeaseOptions::new(10 * S).renew_every(5 * S);
    let old = a.acquire("ledger", &opts, None).await.unwrap().unwrap();

    // A writes under its fence and holds the transaction open.
    let mut conn = pool_a.get().await.unwrap();
    let tx = old.fence(conn.transaction().await.unwrap()).await.unwrap();
    let token = old.term().token;
    tx.query_typed(
        "INSERT INTO ledger VALUES ('a', $1)",
        &[(&token, Type::INT8)],
    )
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
        let got = b.acquire("ledger", &taker_opts, None).await;
        (b, got)
    });
    eventually(5 * S, "B waits on the fenced row", || async {
        busy_backends(&admin, "fence-b").await.0 == 1 || taker.is_finished()
    })
    .await;
    // …A's commit checks the term once more: expired, so nothing lands…
    let err = tx.commit().await.unwrap_err();
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
        None => b.acquire("ledger", &opts, None).await.unwrap().unwrap(),
    };
    assert!(new.term().token > old.term().token);

    // A, stale, tries again: rejected (its lost signal fired at the
    // refused commit, with the reason it saw then), nothing written.
    let err = old
        .fence(conn.transaction().await.unwrap())
        .await
        .unwrap_err();
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
    let keep = a
        .acquire("keep", &LeaseOptions::new(S), None)
        .await
        .unwrap()
        .unwrap();
    let mut conn = pool_a.get().await.unwrap();
    let tx = keep.fence(conn.transaction().await.unwrap()).await.unwrap();
    let renewed = a.stats().renewed;
    eventually(3 * S, "renewals during a fenced transaction", || async {
        a.stats().renewed >= renewed + 3
    })
    .await;
    assert!(!keep.is_lost());
    tx.check().await.unwrap();
    tx.commit().await.unwrap();
}

/// A transaction at `level`.
async fn begin(
    conn: &mut pgwarden::Client,
    level: IsolationLevel,
) -> deadpool_postgres::Transaction<'_> {
    conn.build_transaction()
        .isolation_level(level)
        .start()
        .await
        .expect("BEGIN")
}

/// Under a snapshot isolation level: a renewal by the holder itself after
/// the snapshot leaves the fence passing, even once the snapshot's expiry
/// has passed; a take-over committed after the snapshot fails the fence
/// with `LeaseLost { Taken }`, never with PostgreSQL's serialization failure.
async fn fence_under(level: IsolationLevel, app: &str) {
    let db = db().await;
    let admin = admin(&db).await;
    admin
        .batch_execute("CREATE TABLE ledger (token bigint)")
        .await
        .unwrap();
    let pool_a = pool(&db, 3, app);
    let a = Leases::new(&pool_a);
    let b = Leases::new(&pool(&db, 2, &format!("{app}-b")));

    // 1. Renewed after the snapshot: still ours.
    let opts = LeaseOptions::new(S).renew_every(200 * MS);
    let own = a.acquire("own", &opts, None).await.unwrap().unwrap();
    let mut conn = pool_a.get().await.unwrap();
    let tx = own.fence(begin(&mut conn, level).await).await.unwrap(); // the snapshot is taken here
    let snapshot = Instant::now();
    // Past the snapshot's expiry, renewed meanwhile. The expiry the snapshot
    // holds was set by a renewal before it, so it is at most the TTL (1 s)
    // after this instant: 1.5 s after it is past, with room for the server's
    // clock reading. Waiting out that time is the scenario; the renewals are
    // awaited.
    let renewed = a.stats().renewed;
    eventually(
        10 * S,
        "1.5 s past the snapshot and 4 renewals since",
        || async { snapshot.elapsed() >= 1500 * MS && a.stats().renewed >= renewed + 4 },
    )
    .await;
    tx.check().await.unwrap();
    let token = own.term().token;
    tx.query_typed("INSERT INTO ledger VALUES ($1)", &[(&token, Type::INT8)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(!own.is_lost());

    // 2. Taken over after the snapshot: a typed error.
    let stale_opts = LeaseOptions::new(10 * S).renew_every(5 * S);
    let stale = a
        .acquire("taken", &stale_opts, None)
        .await
        .unwrap()
        .unwrap();
    let tx = begin(&mut conn, level).await;
    tx.batch_execute("SELECT 1").await.unwrap(); // the snapshot
    admin
        .batch_execute(
            "UPDATE pgwarden_leases SET expires_at = now() - interval '1 ms' WHERE name = 'taken'",
        )
        .await
        .unwrap();
    let new = within(5 * S, "take-over", b.acquire("taken", &stale_opts, None))
        .await
        .unwrap()
        .expect("expired: B takes it");
    let err = stale.fence(tx).await.unwrap_err();
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
    let err = stale
        .fence(begin(&mut conn, level).await)
        .await
        .unwrap_err();
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

#[tokio::test]
async fn fencing_under_repeatable_read() {
    fence_under(IsolationLevel::RepeatableRead, "fence-rr").await;
}

#[tokio::test]
async fn fencing_under_serializable() {
    fence_under(IsolationLevel::Serializable, "fence-ser").await;
}
