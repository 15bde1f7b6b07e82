//! The fence's server-side bound and its commit, against a real PostgreSQL
//! 15 (no `transaction_timeout`): the transaction is bounded as a whole, not
//! per statement (a blocked take-over ends the session of a fenced
//! transaction left open past its term, and nothing else); the role's
//! tighter timeouts are kept; a fenced commit that says `Ok` has landed.
//! On every backend, from one source.

use crate::support;

use std::time::Duration;

use pgwarden::{Error, LeaseError, LeaseOptions};
use pgwarden_testing::TestDb;
use support::backend::{named, Backend, Settings};
use support::leases::{insert_expired, lock_rows};
use support::{admin, alive, db, eventually, within};

const S: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

/// The transaction's `statement_timeout` and
/// `idle_in_transaction_session_timeout`.
async fn show<B: Backend>(tx: &mut B::Fenced<'_>) -> (String, String) {
    let st = B::fx_text(tx, "SHOW statement_timeout").await.unwrap();
    let it = B::fx_text(tx, "SHOW idle_in_transaction_session_timeout")
        .await
        .unwrap();
    (st, it)
}

async fn ledger_rows(admin: &tokio_postgres::Client) -> i64 {
    admin
        .query_one("SELECT count(*) FROM ledger", &[])
        .await
        .unwrap()
        .get(0)
}

backends!(
    a_fenced_transaction_is_bounded_as_a_whole_not_per_statement,
    flavor = "multi_thread",
    worker_threads = 2
);
/// A holder whose fenced transaction keeps running short statements past
/// its term's end (each statement and each idle spell far shorter than the
/// per-statement bounds, 11 s here) is ended by the take-over 1 s past the
/// term's end: the take-over comes within a wait of 8 s, and the holder's
/// writes never land. Before: the take-over was blocked for as long as the
/// holder kept going.
async fn a_fenced_transaction_is_bounded_as_a_whole_not_per_statement<B: Backend>() {
    let logs = support::Logs::default();
    let _guard = tracing::subscriber::set_default(logs.subscriber());
    let db = db().await;
    let admin = admin(&db).await;
    let (pool_a, _) = named::<B>(&db, "whole-a", &Settings::new("whole-a", 3));
    let a = B::leases(&pool_a);
    let b = B::leases(&B::build(&db, &Settings::new("whole-b", 2)));
    admin
        .batch_execute("CREATE TABLE ledger (token bigint)")
        .await
        .unwrap();
    // No renewal within the next 5 s: the term is expired by hand below.
    let opts = LeaseOptions::new(10 * S).renew_every(5 * S);
    let lease = B::acquire(&a, "whole", &opts, None).await.unwrap().unwrap();
    let handle = pgwarden::LeaseHandle::clone(&lease);
    let (fenced_tx, fenced) = tokio::sync::oneshot::channel();
    let worker = tokio::spawn(async move {
        let mut conn = B::tx_source(&pool_a).await;
        let tx = B::begin(&mut conn, None).await;
        let mut tx = B::fence(&handle, tx).await?;
        let pid: i32 = B::fx_text(&mut tx, "SELECT pg_backend_pid()::text")
            .await?
            .parse()
            .unwrap();
        let token = handle.term().token;
        B::fx_run(&mut tx, "INSERT INTO ledger VALUES ($1)", Some(token)).await?;
        let _ = fenced_tx.send(pid);
        // Busy, never idle for long, never one long statement.
        loop {
            B::fx_run(&mut tx, "SELECT 1", None).await?;
            tokio::time::sleep(100 * MS).await;
        }
        #[allow(unreachable_code)]
        B::fx_commit(tx).await
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
        B::acquire(&b, "whole", &opts, Some(8 * S)),
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

backends!(a_row_locker_without_the_mark_is_left_alone);
/// A session that holds an expired term's row without the fence mark (any
/// `SELECT … FOR UPDATE`) is never ended: the take-over answers busy, as
/// before, however long past the term's end.
async fn a_row_locker_without_the_mark_is_left_alone<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let b = B::leases(&B::build(&db, &Settings::new("nomark-b", 2)));
    B::install(&b).await.unwrap();
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
    let got = B::acquire(&b, "held-by-hand", &LeaseOptions::new(10 * S), None)
        .await
        .unwrap();
    assert!(got.is_none(), "the row is locked: busy");
    assert!(B::lease_stats(&b).takeovers_blocked >= 1);
    assert!(
        alive(&admin, pid).await,
        "a locker without the mark was ended"
    );
    locker.batch_execute("ROLLBACK").await.unwrap();
}

/// A database whose own `statement_timeout` (200 ms) and
/// `idle_in_transaction_session_timeout` (300 ms) are tighter than the
/// fence's bound (a term of 60 s), with table `ledger`: a pool on it and
/// a lease of that term.
async fn tight<B: Backend>(db: &TestDb, admin: &tokio_postgres::Client) -> (B::Pool, B::Lease) {
    admin
        .batch_execute(&format!(
            "CREATE TABLE ledger (token bigint);
             ALTER DATABASE \"{0}\" SET statement_timeout = '200ms';
             ALTER DATABASE \"{0}\" SET idle_in_transaction_session_timeout = '300ms';",
            db.name()
        ))
        .await
        .unwrap();
    let pool_a = B::build(db, &Settings::new("tight-a", 3));
    let a = B::leases(&pool_a);
    let lease = B::acquire(&a, "tight", &LeaseOptions::new(60 * S), None)
        .await
        .unwrap()
        .unwrap();
    (pool_a, lease)
}

backends!(fence_keeps_tighter_timeouts);
/// The role's (here the database's) own `statement_timeout` and
/// `idle_in_transaction_session_timeout` are tighter than the fence's
/// bound: the fenced transaction keeps them, and a statement of 1 s is
/// cancelled. Before: the fence set both to about 61 s and the sleep
/// completed.
async fn fence_keeps_tighter_timeouts<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let (pool_a, lease) = tight::<B>(&db, &admin).await;
    let mut conn = B::tx_source(&pool_a).await;
    let tx = B::begin(&mut conn, None).await;
    let mut tx = B::fence(&lease, tx).await.unwrap();
    assert_eq!(show::<B>(&mut tx).await, ("200ms".into(), "300ms".into()));
    // A second check keeps them too (it may extend its own bound, never
    // loosen the caller's).
    B::fx_check(&mut tx).await.unwrap();
    assert_eq!(show::<B>(&mut tx).await, ("200ms".into(), "300ms".into()));
    let err = B::fx_run(&mut tx, "SELECT pg_sleep(1)", None)
        .await
        .unwrap_err();
    assert_eq!(B::code(&err).as_deref(), Some("57014"), "{err}");
    drop(tx);
    drop(conn);
    assert!(!lease.is_lost());
    B::release(lease).await.unwrap();
}

backends!(a_statement_given_up_on_fails_the_fenced_commit);
/// A statement the server cancelled without the caller seeing it (its
/// future dropped by a client timeout; the database's 200 ms bound then
/// cancels it) fails the fenced commit: nothing landed, and the commit
/// says so (`LeaseError::Aborted`).
async fn a_statement_given_up_on_fails_the_fenced_commit<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let (pool_a, lease) = tight::<B>(&db, &admin).await;
    let mut conn = B::tx_source(&pool_a).await;
    let tx = B::begin(&mut conn, None).await;
    let mut tx = B::fence(&lease, tx).await.unwrap();
    let token = lease.term().token;
    B::fx_run(&mut tx, "INSERT INTO ledger VALUES ($1)", Some(token))
        .await
        .unwrap();
    let gave_up =
        tokio::time::timeout(50 * MS, B::fx_run(&mut tx, "SELECT pg_sleep(5)", None)).await;
    assert!(gave_up.is_err(), "the client timeout came first");
    let err = B::fx_commit(tx).await.unwrap_err();
    assert_eq!(ledger_rows(&admin).await, 0);
    assert!(
        matches!(err, Error::Lease(LeaseError::Aborted { .. })),
        "{err}"
    );
    assert!(!lease.is_lost());
    drop(conn);
    B::release(lease).await.unwrap();
}

backends!(a_fenced_commit_of_a_failed_transaction_is_an_error);
/// A statement whose error the caller ignored leaves the transaction
/// failed: PostgreSQL answers its `COMMIT` with `ROLLBACK`. The fenced
/// commit reports it (`LeaseError::Aborted`); before, it said `Ok` and
/// nothing had landed.
async fn a_fenced_commit_of_a_failed_transaction_is_an_error<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let pool_a = B::build(&db, &Settings::new("aborted-a", 2));
    let a = B::leases(&pool_a);
    admin
        .batch_execute("CREATE TABLE ledger (token bigint)")
        .await
        .unwrap();
    let lease = B::acquire(&a, "aborted", &LeaseOptions::new(30 * S), None)
        .await
        .unwrap()
        .unwrap();
    let mut conn = B::tx_source(&pool_a).await;
    let tx = B::begin(&mut conn, None).await;
    let mut tx = B::fence(&lease, tx).await.unwrap();
    let token = lease.term().token;
    B::fx_run(&mut tx, "INSERT INTO ledger VALUES ($1)", Some(token))
        .await
        .unwrap();
    let _ = B::fx_run(&mut tx, "SELECT 1 / 0", None).await; // its error not looked at
    let err = B::fx_commit(tx).await.unwrap_err();
    assert!(
        matches!(err, Error::Lease(LeaseError::Aborted { .. })),
        "{err}"
    );
    assert_eq!(ledger_rows(&admin).await, 0);
    // A fenced commit that says Ok has landed.
    let tx = B::begin(&mut conn, None).await;
    let mut tx = B::fence(&lease, tx).await.unwrap();
    B::fx_run(&mut tx, "INSERT INTO ledger VALUES ($1)", Some(token))
        .await
        .unwrap();
    B::fx_commit(tx).await.unwrap();
    assert_eq!(ledger_rows(&admin).await, 1);
    drop(conn);
    B::release(lease).await.unwrap();
}
