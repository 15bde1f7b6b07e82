//! Asynchronous replication can lose the last take-over: what fencing
//! guarantees then, on a lost tail built on purpose, and what synchronous
//! replication changes.
//!
//! The construction: holder A takes a lease (TTL 2 s) and writes under it;
//! the replica replays that, then WAL shipping stops. A is cut off (its pool
//! closes), its lost signal fires at its deadline and its term expires.
//! Other take-overs use up the token values the replica's copy of the
//! sequence covers, so that the next take-over draws a value the replica has
//! no record of. B takes the lease over and writes under it; the primary
//! acknowledges both. The primary crashes and the stale replica is promoted.

use std::time::Duration;

use pgwarden::{Lease, LeaseHandle, LeaseOptions, Leases, LostReason, Pool};
use pgwarden_testing::{within, Cluster, Replication};
use tokio_postgres::Client;

use super::common::{
    cluster, fenced_rows, fenced_write, lease_row, sequence, service_pool, until, WriteError, STEP,
};

const LEASE: &str = "stale";

fn opts() -> LeaseOptions {
    LeaseOptions::new(Duration::from_secs(2))
}

/// Until A's term has expired on `server`'s clock.
async fn expired(server: &Client) {
    let gone = until(STEP, || async {
        lease_row(server, LEASE)
            .await
            .is_some_and(|(_, _, left)| left < 0.0)
    })
    .await;
    assert!(gone.is_some(), "A's term did not expire");
}

/// C, a third instance, takes the lease over on the new primary.
async fn take_over(cluster: &Cluster, db: &str) -> (Pool, Lease) {
    let pool_c = service_pool(cluster, db, "holder-c", 3);
    let c = Leases::new(&pool_c)
        .acquire(LEASE, &opts(), None)
        .await
        .unwrap()
        .expect("C takes over on the new primary");
    (pool_c, c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_takeover_cannot_write_on_the_new_primary() {
    let (mut cluster, db, old) = cluster(Replication::Asynchronous).await;
    let pool_a = service_pool(&cluster, &db, "holder-a", 3);
    let pool_b = service_pool(&cluster, &db, "holder-b", 3);
    let (la, lb) = (Leases::new(&pool_a), Leases::new(&pool_b));
    la.install().await.unwrap();

    // A's term and write reach the replica.
    let a = la
        .acquire(LEASE, &opts(), None)
        .await
        .unwrap()
        .expect("A takes the lease");
    let a_handle = LeaseHandle::clone(&a);
    let row_a = fenced_write(&pool_a, &a_handle, 0).await.expect("A writes");
    cluster.wait_replayed().await.unwrap();

    // From here on, nothing reaches the replica.
    cluster.pause_streaming().await.unwrap();
    pool_a.close();
    let reason = within(STEP, "A's lost signal", a.lost()).await;
    assert_eq!(reason, LostReason::Deadline);
    expired(&old).await;
    let replica = cluster.replica().connect(&db).await.unwrap();
    let (covered, _) = sequence(&replica).await;
    for i in 0.. {
        let (last, _) = sequence(&old).await;
        if last >= covered {
            assert_eq!(last, covered, "the burn drew past what the replica covers");
            break;
        }
        assert!(i < 100, "the sequence does not reach {covered}");
        let burn = lb
            .acquire(
                &format!("burn-{i}"),
                &LeaseOptions::new(Duration::from_secs(60)),
                None,
            )
            .await
            .unwrap();
        burn.expect("a fresh lease").release().await.unwrap();
    }

    // B's take-over and write: acknowledged by the primary, never shipped.
    // B's deadline outlives the outage (TTL 10 s), so what it learns after
    // the promotion comes from the new primary, not from its clock.
    let b_opts = LeaseOptions::new(Duration::from_secs(10)).renew_every(Duration::from_millis(250));
    let b = lb
        .acquire(LEASE, &b_opts, None)
        .await
        .unwrap()
        .expect("B takes over");
    let b_handle = LeaseHandle::clone(&b);
    assert_eq!(
        b.term().took_over_from.as_deref(),
        Some(a.term().holder.as_str())
    );
    let row_b = fenced_write(&pool_b, &b_handle, 0).await.expect("B writes");
    assert!(b.term().token > covered);

    // The crash, and the stale replica promoted.
    cluster.stop_primary_immediate().await.unwrap();
    cluster.promote_replica().await.unwrap();
    let new = cluster.primary().connect(&db).await.unwrap();

    // Not guaranteed without synchronous replication: B's take-over and its
    // acknowledged write are gone; the row shows A's (expired) term.
    let (holder, token, left) = lease_row(&new, LEASE).await.expect("lease row");
    assert_eq!(
        (holder.as_str(), token),
        (a.term().holder.as_str(), a.term().token)
    );
    assert!(left < 0.0, "A's term is expired on the new primary");
    let rows = fenced_rows(&new).await;
    assert!(rows.contains(&row_a));
    assert!(!rows.contains(&row_b), "B's write was never shipped");

    // Guaranteed: B learns it lost the lease at its next renewal...
    let reason = within(STEP * 2, "B's lost signal", b.lost()).await;
    assert_eq!(reason, LostReason::Taken);
    // ...and neither stale term can write on the new primary: B's term is
    // unknown there; A's is expired there, and A had stopped trusting it at
    // its own deadline already (the fence reports the lease's first reason).
    let b_write = fenced_write(&pool_b, &b_handle, 1).await;
    assert_eq!(b_write, Err(WriteError::Rejected(LostReason::Taken)));
    let a_write = fenced_write(&pool_b, &a_handle, 1).await;
    assert_eq!(a_write, Err(WriteError::Rejected(LostReason::Deadline)));

    // A new take-over: its token is above every token the new primary knows,
    // but it is B's token again (the sequence's WAL for it was lost too):
    // tokens are unique only among terms that reached the replica.
    let (pool_c, c) = take_over(&cluster, &db).await;
    eprintln!(
        "async lost tail: A's token {}, the replica's sequence covered up to {covered}, B's \
         token {} (lost), C's token on the new primary {}",
        a.term().token,
        b.term().token,
        c.term().token
    );
    assert_eq!(
        c.term().took_over_from.as_deref(),
        Some(a.term().holder.as_str())
    );
    assert!(c.term().token > a.term().token);
    // Above every token the new primary knows: its sequence came from the
    // replica, which covered A's token and no more than `covered`.
    assert!(a.term().token <= covered, "{} vs {covered}", a.term().token);
    assert!(c.term().token > covered, "{} vs {covered}", c.term().token);
    assert_eq!(
        c.term().token,
        b.term().token,
        "the lost term's token is drawn again"
    );
    fenced_write(&pool_c, &c, 0).await.expect("C writes");
    // Same token, other holder: the fence checks both, B is still rejected.
    let b_write = fenced_write(&pool_b, &b_handle, 2).await;
    assert_eq!(b_write, Err(WriteError::Rejected(LostReason::Taken)));
    let stale: Vec<(i64, String)> = fenced_rows(&new)
        .await
        .into_iter()
        .filter(|r| r.lease == LEASE)
        .map(|r| (r.token, r.holder))
        .collect();
    assert_eq!(
        stale,
        [
            (a.term().token, a.term().holder.clone()),
            (c.term().token, c.term().holder.clone())
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synchronous_replication_never_acknowledges_an_unshipped_takeover() {
    let (mut cluster, db, old) = cluster(Replication::Synchronous).await;
    let pool_a = service_pool(&cluster, &db, "holder-a", 3);
    let pool_b = service_pool(&cluster, &db, "holder-b", 3);
    let la = Leases::new(&pool_a);
    la.install().await.unwrap();
    let lb = Leases::builder(&pool_b)
        .statement_timeout(Duration::from_secs(1))
        .build()
        .unwrap();

    let a = la
        .acquire(LEASE, &opts(), None)
        .await
        .unwrap()
        .expect("A takes the lease");
    cluster.pause_streaming().await.unwrap();
    pool_a.close();
    assert_eq!(
        within(STEP, "A's lost signal", a.lost()).await,
        LostReason::Deadline
    );
    expired(&old).await;

    // The take-over cannot commit without the standby: B is never told it
    // holds the lease, and gets no token.
    let b = lb.acquire(LEASE, &opts(), None).await;
    assert!(
        matches!(
            &b,
            Err(pgwarden::Error::Lease(pgwarden::LeaseError::Timeout { .. }))
        ),
        "a take-over returned without the standby: {b:?}"
    );

    cluster.stop_primary_immediate().await.unwrap();
    cluster.promote_replica().await.unwrap();
    let new = cluster.primary().connect(&db).await.unwrap();
    let (holder, token, _) = lease_row(&new, LEASE).await.expect("lease row");
    assert_eq!(
        (holder.as_str(), token),
        (a.term().holder.as_str(), a.term().token)
    );
    let (_pool_c, c) = take_over(&cluster, &db).await;
    assert_eq!(
        c.term().took_over_from.as_deref(),
        Some(a.term().holder.as_str())
    );
    assert!(c.term().token > a.term().token);
}
