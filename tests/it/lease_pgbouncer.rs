//! Leases behind PgBouncer in transaction mode: lease statements go unnamed
//! there (detected, configured, or after the server refused a prepared one),
//! so install, acquisition, batched renewal, fencing, release, take-over,
//! purge and the cancel of a timed-out statement all work there, where named
//! prepared statements and session state do not.

use crate::support;

use std::time::Duration;

use pgwarden::{LeaseOptions, Leases, LostReason, PoolerMode};
use pgwarden_testing::{require_tool, PgBouncer, TestServer};
use support::leases::{insert_expired, pool_behind, pool_with};
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
        held.push(a.acquire(name, &opts, None).await.unwrap().unwrap());
        assert!(b.acquire(name, &opts, None).await.unwrap().is_none());
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
        let tx = held[0]
            .fence(conn.transaction().await.unwrap())
            .await
            .unwrap();
        let token = held[0].term().token;
        tx.query_typed("INSERT INTO ledger VALUES ($1)", &[(&token, Type::INT8)])
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }

    // run, and release.
    let ran = b
        .run("report", &LeaseOptions::new(S), |lease| async move {
            lease.term().token
        })
        .await
        .unwrap();
    assert!(ran.is_some());
    let released = held.pop().unwrap();
    released.release().await.unwrap();
    assert!(b
        .acquire("uptime@n1", &LeaseOptions::new(S), None)
        .await
        .unwrap()
        .is_some());

    // A crashes; B takes its leases over after their TTL, with larger tokens.
    let old = held.remove(0);
    pool_a.close();
    let new = b
        .acquire("cleanup", &opts, Some(5 * S))
        .await
        .unwrap()
        .expect("taken within the wait");
    assert!(new.term().token > old.term().token);
    assert_eq!(
        new.term().took_over_from.as_deref(),
        Some(old.term().holder.as_str())
    );
    assert_eq!(
        within(3 * S, "A's lost signal", old.lost()).await,
        LostReason::Deadline
    );
    new.release().await.unwrap();
}

/// A pool through `bouncer`, its pooler configured as `pooler`.
fn bounced(bouncer: &PgBouncer, size: usize, app: &str, pooler: PoolerMode) -> pgwarden::Pool {
    pool_behind(bouncer.pg_config(), size, app, pooler)
}

/// Backends of `db` waiting on a lock (behind PgBouncer the application
/// name is the bouncer's, so count by database, the locker excluded).
async fn lock_waiters(admin: &tokio_postgres::Client, db: &str) -> i64 {
    admin
        .query_typed_one(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = $1 AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()",
            &[(&db, Type::TEXT)],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn through_pgbouncer_a_contender_skips_and_a_timed_out_statement_is_cancelled() {
    if !require_tool("pgbouncer").unwrap() {
        return;
    }
    let server = TestServer::shared().unwrap();
    let db = server.create_database().await.unwrap();
    let admin = db.connect().await.unwrap();
    let bouncer = PgBouncer::start_with_pool_size(server, &db, 4).unwrap();
    let pool_a = bounced(&bouncer, 3, "pgb-a", PoolerMode::Auto);
    let a = Leases::new(&pool_a);
    let b = Leases::builder(&bounced(&bouncer, 3, "pgb-b", PoolerMode::Transaction))
        .statement_timeout(Duration::from_millis(500))
        .build()
        .unwrap();

    // The holder in a fenced transaction (it pins a server connection):
    // the contender skips at once.
    let lease = a
        .acquire("ledger", &LeaseOptions::new(30 * S), None)
        .await
        .unwrap()
        .unwrap();
    let mut conn = pool_a.get().await.unwrap();
    let tx = lease
        .fence(conn.transaction().await.unwrap())
        .await
        .unwrap();
    for _ in 0..3 {
        let got = within(
            S,
            "a skip",
            b.acquire("ledger", &LeaseOptions::new(30 * S), None),
        )
        .await
        .unwrap();
        assert!(got.is_none());
    }
    tx.commit().await.unwrap();
    drop(conn);

    // A take-over blocked by a row lock answers busy at once: its
    // lock_timeout ends the wait on the server, through PgBouncer too.
    insert_expired(&admin, "stale", "old").await;
    admin
        .batch_execute("BEGIN; SELECT 1 FROM pgwarden_leases WHERE name = 'stale' FOR KEY SHARE")
        .await
        .unwrap();
    let got = within(
        3 * S,
        "a blocked take-over",
        b.acquire("stale", &LeaseOptions::new(30 * S), None),
    )
    .await
    .unwrap();
    assert!(got.is_none(), "blocked: busy");
    // A statement that times out behind a row lock: the statement's
    // timeout, and nothing left waiting on the server (the connection is
    // closed; behind PgBouncer no cancel request is sent).
    admin.batch_execute("COMMIT").await.unwrap();
    let old: String = admin
        .query_typed_one(
            "SELECT holder FROM pgwarden_leases WHERE name = 'stale'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(old, "old", "the blocked take-over did not happen");
    let taken = within(
        3 * S,
        "the take-over once the lock is gone",
        b.acquire("stale", &LeaseOptions::new(30 * S), None),
    )
    .await
    .unwrap()
    .expect("taken over");
    assert_eq!(taken.term().took_over_from.as_deref(), Some("old"));
    admin
        .batch_execute("BEGIN; SELECT 1 FROM pgwarden_leases WHERE name = 'stale' FOR UPDATE")
        .await
        .unwrap();
    let err = taken.release().await.unwrap_err();
    assert!(
        matches!(
            err,
            pgwarden::Error::Lease(pgwarden::LeaseError::Timeout { .. })
        ),
        "{err}"
    );
    admin.batch_execute("COMMIT").await.unwrap();
    eventually(5 * S, "nothing of B waits on the server", || async {
        let other = db.connect().await.unwrap();
        lock_waiters(&other, db.name()).await == 0
    })
    .await;
    if let Err(e) = lease.release().await {
        panic!("{e}\n{}", bouncer.log_tail(30));
    }
}

#[tokio::test]
async fn through_pgbouncer_purge_works_and_a_misconfigured_direct_pool_falls_back() {
    if !require_tool("pgbouncer").unwrap() {
        return;
    }
    let server = TestServer::shared().unwrap();
    let db = server.create_database().await.unwrap();
    let bouncer = PgBouncer::start_with_pool_size(server, &db, 2).unwrap();
    // Told it is direct: its first prepared statements are refused by
    // PgBouncer's server connections, and it goes on unnamed.
    let wrong = Leases::builder(&bounced(&bouncer, 6, "pgb-direct", PoolerMode::Direct))
        .purge(Duration::ZERO, Some(Duration::from_millis(20)))
        .build()
        .unwrap();
    let opts = LeaseOptions::new(10 * S).at_least(Duration::from_millis(1));
    let tasks: Vec<_> = (0..6)
        .map(|t| {
            let (wrong, opts) = (wrong.clone(), opts.clone());
            tokio::spawn(async move {
                for i in 0..40 {
                    let lease = wrong
                        .acquire(&format!("n{t}-{i}"), &opts, None)
                        .await
                        .unwrap()
                        .expect("a new name is free");
                    lease.release().await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    // Released rows kept by their hold: purged through PgBouncer, by the
    // renewer's own purge statements.
    eventually(5 * S, "240 rows purged through PgBouncer", || async {
        wrong.stats().purged >= 240
    })
    .await;
    assert_eq!(wrong.stats().purged, 240, "{:?}", wrong.stats());
}

#[tokio::test]
async fn through_pgbouncer_overlapping_acquisitions_and_releases_share_statements() {
    if !require_tool("pgbouncer").unwrap() {
        return;
    }
    let server = TestServer::shared().unwrap();
    let db = server.create_database().await.unwrap();
    let bouncer = PgBouncer::start_with_pool_size(server, &db, 3).unwrap();
    let pool = pool_behind(
        bouncer.pg_config(),
        8,
        "bouncer-gather",
        PoolerMode::Transaction,
    );
    let leases = Leases::new(&pool);
    leases.install().await.unwrap();
    let admin = db.connect().await.unwrap();
    let opts = LeaseOptions::new(30 * S);
    // A call waits at most 100 ms for a batch: on a loaded machine a round
    // may see none; each round asserts its answers, one must gather.
    let mut gathered_both = false;
    for round in 0..5 {
        let before = leases.stats();
        let names: Vec<String> = (0..24).map(|i| format!("b{round}-{i}")).collect();
        let got =
            futures_util::future::join_all(names.iter().map(|n| leases.acquire(n, &opts, None)))
                .await;
        let taken: Vec<_> = got
            .into_iter()
            .map(|r| r.unwrap().expect("a new name is free"))
            .collect();
        let mut tokens: Vec<i64> = taken.iter().map(|l| l.term().token).collect();
        tokens.sort_unstable();
        tokens.dedup();
        assert_eq!(tokens.len(), 24, "each term its own token");
        let mid = leases.stats();
        let released = futures_util::future::join_all(taken.into_iter().map(|l| l.release())).await;
        assert!(released.into_iter().all(|r| r.is_ok()));
        let after = leases.stats();
        let left: i64 = admin
            .query_typed_one(
                "SELECT count(*) FROM pgwarden_leases WHERE name LIKE $1 AND holder <> ''",
                &[(&format!("b{round}-%"), Type::TEXT)],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(left, 0, "every term released");
        if mid.gathered_statements > before.gathered_statements
            && after.gathered_statements > mid.gathered_statements
        {
            gathered_both = true;
            break;
        }
    }
    assert!(
        gathered_both,
        "no round of 5 gathered both its acquisitions and its releases"
    );
}
