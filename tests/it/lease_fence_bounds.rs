//! The fence's server-side bound and its commit, against a real PostgreSQL
//! 15 (no `transaction_timeout`): the transaction is bounded as a whole, not
//! per statement (a blocked take-over ends the session of a fenced
//! transaction left open past its term, and nothing else); the role's
//! tighter timeouts are kept; a fenced commit that says `Ok` has landed.

use crate::support;

use std::time::Duration;

use pgwarden::{Error, LeaseError, LeaseOptions, Leases};
use support::leases::{insert_expired, lock_rows, pool, TwoHolders};
use support::{admin, alive, db, eventually, within};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;

const S: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

/// The transaction's `statement_timeout` and
/// `idle_in_transaction_session_timeout`.
async fn show(tx: &tokio_postgres::Transaction<'_>) -> (String, String) {
    let get = |row: tokio_postgres::Row| row.get::<_, String>(0);
    let st = get(tx.query_one("SHOW statement_timeout", &[]).await.unwrap());
    let it = get(tx
        .query_one("SHOW idle_in_transaction_session_timeout", &[])
        .await
        .unwrap());
    (st, it)
}

async fn ledger_rows(admin: &tokio_postgres::Client) -> i64 {
    admin
        .query_one("SELECT count(*) FROM ledger", &[])
        .await
        .unwrap()
        .get(0)
}

/// A holder whose fenced transaction keeps running short statements past
/// its term's end (each statement and each idle spell far shorter than the
/// per-statement bounds, 11 s here) is ended by the take-over 1 s past the
/// term's end: the take-over comes within a wait of 8 s, and the holder's
/// writes never land. Before: the take-over was blocked for as long as the
/// holder kept going.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_transaction_is_bounded_as_a_whole_not_per_statement() {
    let logs = support::Logs::default();
    let _guard = tracing::subscriber::set_default(logs.subscriber());
    let TwoHolders {
        admin,
        pool_a,
        a,
        b,
        ..
    } = TwoHolders::new("whole", 3).await;
    admin
        .batch_execute("CREATE TABLE ledger (token bigint)")
        .await
        .unwrap();
    // No renewal within the next 5 s: the term is expired by hand below.
    let opts = LeaseOptions::new(10 * S).renew_every(5 * S);
    let lease = a.acquire("whole", &opts, None).await.unwrap().unwrap();
    let handle = pgwarden::LeaseHandle::clone(&lease);
    let (fenced_tx, fenced) = tokio::sync::oneshot::channel();
    let worker = tokio::spawn(async move {
        let mut conn = pool_a.get().await.unwrap();
        let pid: i32 = conn
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        let tx = handle.fence(conn.transaction().await.unwrap()).await?;
        let token = handle.term().token;
        tx.execute("INSERT INTO ledger VALUES ($1)", &[&token])
            .await?;
        let _ = fenced_tx.send(pid);
        // Busy, never idle for long, never one long statement.
        loop {
            tx.execute("SELECT 1", &[]).await?;
            tokio::time::sleep(100 * MS).await;
        }
        #[allow(unreachable_code)]
        tx.commit().await
    });
    let pid = within(5 * S, "the fence", fenced).await.unwrap();
    // The term ends in the database (its holder stopped renewing it).
    admin
        .batch_execute(
            "UPDATE pgwarden_leases SET expires_at = now() - interval '1 ms' WHERE name = 'whole'",
        )
        .await
        .unwrap();
    let taken = within(
        10 * S,
        "the take-over",
        b.acquire("whole", &opts, Some(8 * S)),
    )
    .await
    .unwrap()
    .expect("taken over while the stale holder kept its transaction busy");
    assert!(taken.term().token > lease.term().token);
    let err = within(5 * S, "the holder's session ends", worker)
        .await
        .unwrap()
        .unwrap_err();
    eprintln!("the stale holder's next statement: {err}");
    assert!(!alive(&admin, pid).await);
    assert_eq!(ledger_rows(&admin).await, 0, "a stale write landed");
    assert!(
        logs.text()
            .contains("ended the session of a fenced transaction"),
        "{}",
        logs.text()
    );
}

/// A session that holds an expired term's row without the fence mark (any
/// `SELECT … FOR UPDATE`) is never ended: the take-over answers busy, as
/// before, however long past the term's end.
#[tokio::test]
async fn a_row_locker_without_the_mark_is_left_alone() {
    let db = db().await;
    let admin = admin(&db).await;
    let b = Leases::new(&pool(&db, 2, "nomark-b"));
    b.install().await.unwrap();
    insert_expired(&admin, "held-by-hand", "old-holder").await;
    let locker = lock_rows(&db, "pgwarden_leases", &["held-by-hand"], "FOR UPDATE").await;
    let pid: i32 = locker
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    eventually(5 * S, "the term ended over 1.5 s ago", || async {
        admin
            .query_one(
                "SELECT expires_at < now() - interval '1.5 s' FROM pgwarden_leases WHERE name = 'held-by-hand'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, bool>(0)
    })
    .await;
    let got = b
        .acquire("held-by-hand", &LeaseOptions::new(10 * S), None)
        .await
        .unwrap();
    assert!(got.is_none(), "the row is locked: busy");
    assert!(b.stats().takeovers_blocked >= 1);
    assert!(
        alive(&admin, pid).await,
        "a locker without the mark was ended"
    );
    locker.batch_execute("ROLLBACK").await.unwrap();
}

/// The role's (here the database's) own `statement_timeout` (200 ms) and
/// `idle_in_transaction_session_timeout` (300 ms) are tighter than the
/// fence's bound (the term's 60 s): the fenced transaction keeps them, and
/// a statement of 1 s is cancelled. Before: the fence set both to about
/// 61 s and the sleep completed. A statement the server cancelled without
/// the caller seeing it (its future dropped by a client timeout) fails the
/// fenced commit: nothing landed, and the commit says so.
#[tokio::test]
async fn fence_keeps_tighter_timeouts_and_its_commit_reports_a_failed_transaction() {
    let db = db().await;
    let admin = admin(&db).await;
    admin
        .batch_execute(&format!(
            "CREATE TABLE ledger (token bigint);
             ALTER DATABASE \"{0}\" SET statement_timeout = '200ms';
             ALTER DATABASE \"{0}\" SET idle_in_transaction_session_timeout = '300ms';",
            db.name()
        ))
        .await
        .unwrap();
    let pool_a = pool(&db, 3, "tight-a");
    let a = Leases::new(&pool_a);
    let lease = a
        .acquire("tight", &LeaseOptions::new(60 * S), None)
        .await
        .unwrap()
        .unwrap();
    let mut conn = pool_a.get().await.unwrap();
    let tx = lease
        .fence(conn.transaction().await.unwrap())
        .await
        .unwrap();
    assert_eq!(show(&tx).await, ("200ms".into(), "300ms".into()));
    // A second check keeps them too (it may extend its own bound, never
    // loosen the caller's).
    tx.check().await.unwrap();
    assert_eq!(show(&tx).await, ("200ms".into(), "300ms".into()));
    let err = tx.batch_execute("SELECT pg_sleep(1)").await.unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::QUERY_CANCELED), "{err}");
    drop(tx);

    // The caller gives up on a statement (a client timeout drops its
    // future); the server's bound cancels it; the commit must not say Ok.
    let tx = lease
        .fence(conn.transaction().await.unwrap())
        .await
        .unwrap();
    let token = lease.term().token;
    tx.query_typed("INSERT INTO ledger VALUES ($1)", &[(&token, Type::INT8)])
        .await
        .unwrap();
    let gave_up = tokio::time::timeout(50 * MS, tx.batch_execute("SELECT pg_sleep(5)")).await;
    assert!(gave_up.is_err(), "the client timeout came first");
    let err = tx.commit().await.unwrap_err();
    assert!(
        matches!(err, Error::Lease(LeaseError::Aborted { .. })),
        "{err}"
    );
    assert_eq!(ledger_rows(&admin).await, 0);
    assert!(!lease.is_lost());
    drop(conn);
    lease.release().await.unwrap();
}

/// A statement whose error the caller ignored leaves the transaction
/// failed: PostgreSQL answers its `COMMIT` with `ROLLBACK`. The fenced
/// commit reports it (`LeaseError::Aborted`); before, it said `Ok` and
/// nothing had landed.
#[tokio::test]
async fn a_fenced_commit_of_a_failed_transaction_is_an_error() {
    let TwoHolders {
        admin, pool_a, a, ..
    } = TwoHolders::new("aborted", 2).await;
    admin
        .batch_execute("CREATE TABLE ledger (token bigint)")
        .await
        .unwrap();
    let lease = a
        .acquire("aborted", &LeaseOptions::new(30 * S), None)
        .await
        .unwrap()
        .unwrap();
    let mut conn = pool_a.get().await.unwrap();
    let tx = lease
        .fence(conn.transaction().await.unwrap())
        .await
        .unwrap();
    let token = lease.term().token;
    tx.execute("INSERT INTO ledger VALUES ($1)", &[&token])
        .await
        .unwrap();
    let _ = tx.execute("SELECT 1 / 0", &[]).await; // its error not looked at
    let err = tx.commit().await.unwrap_err();
    assert!(
        matches!(err, Error::Lease(LeaseError::Aborted { .. })),
        "{err}"
    );
    assert_eq!(ledger_rows(&admin).await, 0);
    // A fenced commit that says Ok has landed.
    let tx = lease
        .fence(conn.transaction().await.unwrap())
        .await
        .unwrap();
    tx.execute("INSERT INTO ledger VALUES ($1)", &[&token])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(ledger_rows(&admin).await, 1);
    drop(conn);
    lease.release().await.unwrap();
}
