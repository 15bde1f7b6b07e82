//! Leases behind PgBouncer in transaction mode: every lease statement is an
//! unnamed `query_typed` (or a plain transaction), so install, acquisition,
//! batched renewal, fencing, release and take-over all work there, where
//! named prepared statements and session state do not.

mod support;

use std::time::Duration;

use pgwarden::{LeaseOptions, Leases, LostReason};
use pgwarden_testing::{require_tool, PgBouncer, TestServer};
use support::leases::pool_with;
use support::{eventually, within};
use tokio_postgres::types::Type;

const S: Duration = Duration::from_secs(1);

#[tokio::test]
async fn leases_work_through_pgbouncer_in_transaction_mode() {
    if !require_tool("pgbouncer").unwrap() {
        return;
    }
    let server = TestServer::shared().unwrap();
    let db = server.create_database().await.unwrap();
    // Three server connections shared by every client.
    let bouncer = PgBouncer::start_with_pool_size(server, &db, 3).unwrap();
    let pool_a = pool_with(bouncer.pg_config(), 4, "bouncer-a");
    let pool_b = pool_with(bouncer.pg_config(), 4, "bouncer-b");
    let a = Leases::builder(&pool_a)
        .table("public.job_leases")
        .build()
        .unwrap();
    let b = Leases::builder(&pool_b)
        .table("public.job_leases")
        .build()
        .unwrap();
    assert!(a.install().await.unwrap());
    assert!(!b.install().await.unwrap());

    // Acquire, skip, renew in batches.
    let opts = LeaseOptions::new(S);
    let mut held = Vec::new();
    for name in ["cleanup", "alerts", "mail-checks", "uptime@n1"] {
        held.push(a.try_acquire_with(name, &opts).await.unwrap().unwrap());
        assert!(b.try_acquire_with(name, &opts).await.unwrap().is_none());
    }
    let before = a.stats();
    eventually(5 * S, "renewals through the bouncer", || async {
        a.stats().renewed >= before.renewed + 8
    })
    .await;
    assert_eq!(a.stats().renewal_failures, 0);
    assert!(held.iter().all(|l| !l.is_lost()));

    // A fenced write.
    let admin = db.connect().await.unwrap();
    admin
        .batch_execute("CREATE TABLE ledger (token bigint)")
        .await
        .unwrap();
    {
        let mut conn = pool_a.get().await.unwrap();
        let tx = conn.transaction().await.unwrap();
        held[0].fence(&tx).await.unwrap();
        let token = held[0].token();
        tx.query_typed("INSERT INTO ledger VALUES ($1)", &[(&token, Type::INT8)])
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }

    // run_exclusive, and release.
    let ran = b
        .run_exclusive("report", S, |lease| async move { lease.token() })
        .await
        .unwrap();
    assert!(ran.is_some());
    let released = held.pop().unwrap();
    released.release().await.unwrap();
    assert!(b.try_acquire("uptime@n1", S).await.unwrap().is_some());

    // A crashes; B takes its leases over after their TTL, with larger tokens.
    let old = held.remove(0);
    pool_a.close();
    let new = b.acquire_with("cleanup", &opts, 5 * S).await.unwrap();
    assert!(new.token() > old.token());
    assert_eq!(new.took_over_from(), Some(old.holder()));
    assert_eq!(
        within(3 * S, "A's lost signal", old.lost()).await,
        LostReason::Deadline
    );
    new.release().await.unwrap();
}
