//! The blocker `Leases::rows()` names (issue 30, point 2), from the row's
//! `xmax` matched against `pg_locks`: the cases the hostile reader found
//! wrong (a shared lock's MultiXactId, a prepared transaction, a state
//! nobody may see), kept as regressions. On every backend, from one source.

use crate::support;

use std::time::Duration;

use pgwarden_testing::TestServer;
use support::backend::{pool_on, Backend, LeaseSettings, Settings};
use support::leases::insert_expired;
use support::{admin, db};

backends!(a_shared_row_lock_names_no_unrelated_session);
/// Two fenced transactions share the row lock (`FOR KEY SHARE` each): the
/// row's `xmax` is then a MultiXactId, a number of another counter than
/// transaction ids. The listing compares it with `pg_locks.transactionid`
/// as if it were a transaction id: a session that has nothing to do with
/// the lease table, whose transaction id happens to equal the multixact's
/// number, is named as the blocker. Here the two counters are brought
/// level on a private server (multixacts made faster than xids, then xids
/// burnt up to the multixact's number).
async fn a_shared_row_lock_names_no_unrelated_session<B: Backend>() {
    let server = TestServer::start_local().expect("a private server");
    let db = server.create_database().await.unwrap();
    let admin = admin(&db).await;
    let hour = LeaseSettings::default().purge(Duration::from_secs(3600), None);
    let leases = B::leases_with(&B::build(&db, &Settings::new("hostile-list", 2)), &hour).unwrap();
    B::install(&leases).await.unwrap();
    insert_expired(&admin, "shared", "gone").await;

    // Multixacts made faster than transaction ids: one session keeps a
    // KEY SHARE lock on a scratch row; each transaction of the loop locks
    // it in three modes in turn (three multixacts, one xid).
    admin
        .batch_execute("CREATE TABLE scratch (x int); INSERT INTO scratch VALUES (1)")
        .await
        .unwrap();
    let anchor = db.connect().await.unwrap();
    anchor
        .batch_execute("BEGIN; SELECT FROM scratch FOR KEY SHARE")
        .await
        .unwrap();
    loop {
        admin
            .batch_execute(
                "DO $$ BEGIN FOR i IN 1..100 LOOP
                   PERFORM FROM scratch FOR KEY SHARE;
                   PERFORM FROM scratch FOR SHARE;
                   PERFORM FROM scratch FOR NO KEY UPDATE;
                   COMMIT;
                 END LOOP; END $$",
            )
            .await
            .unwrap();
        if multi(&admin).await > xid(&admin).await + 50 {
            break;
        }
    }
    // Two fenced transactions of the lease's row (what `fence` takes).
    let fence_a = db.connect().await.unwrap();
    let fence_b = db.connect().await.unwrap();
    for f in [&fence_a, &fence_b] {
        f.batch_execute("BEGIN; SELECT FROM pgwarden_leases WHERE name = 'shared' FOR KEY SHARE")
            .await
            .unwrap();
    }
    let m: i64 = admin
        .query_one(
            "SELECT xmax::text::int8 FROM pgwarden_leases WHERE name = 'shared'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // Transaction ids burnt up to m - 1; the next one is an unrelated
    // session's, left open (it never touches the lease table).
    while xid(&admin).await < m - 1 {}
    let bystander = db.connect().await.unwrap();
    bystander
        .batch_execute("SET application_name = 'bystander'; BEGIN")
        .await
        .unwrap();
    let bystander_xid = xid(&bystander).await;
    let bystander_pid: i32 = bystander
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        bystander_xid, m,
        "set-up: the bystander's xid is the multixact's number"
    );

    let rows = B::rows(&leases).await.unwrap();
    let row = rows.iter().find(|r| r.name == "shared").unwrap();
    eprintln!(
        "row 'shared': xmax (multixact) {m}; bystander pid {bystander_pid} xid {bystander_xid}; listing says blocker {:?} ({:?}, {:?})",
        row.blocker_pid, row.blocker_application_name, row.blocker_state
    );
    assert_ne!(
        row.blocker_pid,
        Some(bystander_pid),
        "the listing names a session that holds nothing on the lease table"
    );
    drop((fence_a, fence_b, bystander, anchor));
}

backends!(an_unlocked_row_has_no_blocker_fields);
/// A row nobody locks has no blocker: every blocker field is `None`. The
/// listing computes the blocker's time in its state as
/// `greatest(<NULL>, 0)`, which is 0, not NULL.
async fn an_unlocked_row_has_no_blocker_fields<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let leases = B::leases(&B::build(&db, &Settings::new("hostile-list2", 2)));
    B::install(&leases).await.unwrap();
    insert_expired(&admin, "free", "gone").await;
    let rows = B::rows(&leases).await.unwrap();
    eprintln!("{rows:?}");
    assert_eq!(rows[0].blocker_pid, None);
    assert_eq!(
        rows[0].blocker_state_for, None,
        "a row without a blocker says its blocker has been in its state for {:?}",
        rows[0].blocker_state_for
    );
}

backends!(a_blocker_of_another_role_is_not_said_to_be_fresh);
/// A reader of another role, without `pg_read_all_stats` (an on-call role):
/// the blocker's state is hidden from it (`pg_stat_activity` shows NULL),
/// so its time in that state is unknown too, not zero.
async fn a_blocker_of_another_role_is_not_said_to_be_fresh<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let leases = B::leases(&B::build(&db, &Settings::new("hostile-list3", 2)));
    B::install(&leases).await.unwrap();
    insert_expired(&admin, "stuck", "frozen").await;
    let locker = db.connect().await.unwrap();
    locker
        .batch_execute("BEGIN; SELECT FROM pgwarden_leases WHERE name = 'stuck' FOR KEY SHARE")
        .await
        .unwrap();
    let role = format!("oncall_{}", db.name());
    admin
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; GRANT SELECT ON pgwarden_leases TO {role};"
        ))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut config = db.pg_config();
    config.user(&role);
    let manual = LeaseSettings::default().auto_install(false);
    let reader = B::leases_with(&pool_on::<B>(&config, "hostile-oncall", 2).0, &manual).unwrap();
    let rows = B::rows(&reader).await.unwrap();
    let row = &rows[0];
    eprintln!("{row:?}");
    assert!(row.blocker_pid.is_some(), "the blocker's pid is shown");
    if row.blocker_state.is_none() {
        assert_eq!(
            row.blocker_state_for, None,
            "state hidden, yet 'in its state for {:?}' (it has been idle in transaction 1.5 s)",
            row.blocker_state_for
        );
    }
    drop(locker);
}

async fn xid(c: &tokio_postgres::Client) -> i64 {
    c.query_one("SELECT txid_current()", &[])
        .await
        .unwrap()
        .get::<_, i64>(0)
}

async fn multi(c: &tokio_postgres::Client) -> i64 {
    c.query_one("SELECT xmax::text::int8 FROM scratch", &[])
        .await
        .unwrap()
        .get::<_, i64>(0)
}

backends!(a_row_locked_by_a_prepared_transaction_shows_a_blocker);
/// A fenced transaction prepared for two-phase commit (an XA coordinator's
/// participant) keeps its `FOR KEY SHARE` lock after its session is gone:
/// take-overs of the expired term stay blocked until someone commits or
/// rolls it back. The listing should name something (a prepared
/// transaction has no pid, but `pg_locks` shows its lock), not say "not
/// locked": its join keeps only rows with `pid <> pg_backend_pid()`, which
/// is NULL for a prepared transaction.
async fn a_row_locked_by_a_prepared_transaction_shows_a_blocker<B: Backend>() {
    let server = TestServer::start_local_with(&[("max_prepared_transactions", "4")], &[])
        .expect("a private server with 2PC");
    let db = server.create_database().await.unwrap();
    let admin = admin(&db).await;
    let leases = B::leases(&B::build(&db, &Settings::new("hostile-2pc", 2)));
    B::install(&leases).await.unwrap();
    insert_expired(&admin, "stuck", "gone").await;
    let p = db.connect().await.unwrap();
    p.batch_execute(
        "BEGIN; SELECT FROM pgwarden_leases WHERE name = 'stuck' FOR KEY SHARE; PREPARE TRANSACTION 'fenced-1'",
    )
    .await
    .unwrap();
    drop(p);
    let other = B::leases(&B::build(&db, &Settings::new("hostile-2pc-other", 2)));
    let opts = pgwarden::LeaseOptions::new(Duration::from_secs(5));
    let taken = B::acquire(&other, "stuck", &opts, None).await.unwrap();
    let rows = B::rows(&leases).await.unwrap();
    let locks: Vec<(Option<i32>, String, String)> = admin
        .query(
            "SELECT pid, locktype, virtualtransaction FROM pg_locks WHERE locktype = 'transactionid'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    eprintln!(
        "take-over of the expired row: {:?}; listing: blocker {:?}; pg_locks: {locks:?}",
        taken.as_ref().map(|l| l.term().token),
        rows[0].blocker_pid
    );
    admin
        .batch_execute("ROLLBACK PREPARED 'fenced-1'")
        .await
        .unwrap();
    assert!(taken.is_none(), "set-up: the take-over is blocked");
    assert!(
        rows[0].blocker_pid.is_some() || rows[0].blocker_state.is_some(),
        "a row locked by a prepared transaction is listed as not locked"
    );
}
