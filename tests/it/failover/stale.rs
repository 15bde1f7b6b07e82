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

use std::sync::OnceLock;

use pgwarden::{LeaseHandle, LeaseOptions, LostReason};
use pgwarden_testing::{within, Replication};
use tokio_postgres::Client;

use super::common::{
    database, fenced_rows, fenced_write, lease_row, sequence, service_pool, until, Front,
    WriteError, STEP,
};
use super::together::{self, every_backend, Results, Seat, Step};
use crate::support::backend::Backend;

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

/// The asynchronous constructions, every backend's run of each at once on
/// one asynchronous cluster (`together.rs`): this file's lost take-over
/// and `overlap.rs`'s lost renewals. Panics with why the run `key` failed.
pub fn asynchronous(key: &str) {
    static RUNS: OnceLock<Results<()>> = OnceLock::new();
    let all = together::results(&RUNS, Replication::Asynchronous, || {
        let mut bodies = every_backend!("stale", lost_takeover);
        bodies.extend(every_backend!("overlap", super::overlap::unshipped_renewal));
        bodies
    });
    together::result(all, key);
}

/// The synchronous counterpart, every backend's run at once on one
/// synchronous cluster.
fn synchronous(key: &str) {
    static RUNS: OnceLock<Results<()>> = OnceLock::new();
    let all = together::results(&RUNS, Replication::Synchronous, || {
        every_backend!("sync", unshipped_takeover)
    });
    together::result(all, key);
}

/// The cluster's two steps of a failover: the crash, the promotion; then
/// the fixed address follows the new primary, and a client on `db` there.
pub async fn fail_over(seat: &Seat, front: &Front, db: &str) -> Client {
    seat.step(Step::Crash).await;
    seat.step(Step::Promote).await;
    let cluster = seat.cluster().await;
    front.follow(&cluster);
    cluster.primary().connect(db).await.unwrap()
}

/// C, a third instance, takes the lease over on the new primary.
async fn take_over<B: Backend>(front: &Front, seat: &Seat, db: &str) -> (B::Pool, B::Lease) {
    let pool_c = service_pool::<B>(front, &*seat.cluster().await, db, "holder-c", 3);
    let c = B::acquire(&B::leases(&pool_c), LEASE, &opts(), None)
        .await
        .unwrap()
        .expect("C takes over on the new primary");
    (pool_c, c)
}

backends!(sync, a_lost_takeover_cannot_write_on_the_new_primary);
fn a_lost_takeover_cannot_write_on_the_new_primary<B: Backend>() {
    asynchronous(&format!("stale::{}", B::NAME));
}

async fn lost_takeover<B: Backend>(seat: &Seat) {
    let (db, old) = database(seat).await;
    let cluster = seat.cluster().await;
    let front = Front::new(&cluster);
    let pool_a = service_pool::<B>(&front, &cluster, &db, "holder-a", 3);
    let pool_b = service_pool::<B>(&front, &cluster, &db, "holder-b", 3);
    drop(cluster);
    let (la, lb) = (B::leases(&pool_a), B::leases(&pool_b));
    B::install(&la).await.unwrap();

    // A's term and write reach the replica.
    let a = B::acquire(&la, LEASE, &opts(), None)
        .await
        .unwrap()
        .expect("A takes the lease");
    let a_handle = LeaseHandle::clone(&a);
    let row_a = fenced_write::<B>(&pool_a, &a_handle, 0)
        .await
        .expect("A writes");
    seat.cluster().await.wait_replayed().await.unwrap();

    // From here on, nothing reaches the replica.
    seat.step(Step::Pause).await;
    B::close(&pool_a).await;
    let reason = within(STEP, "A's lost signal", a.lost()).await;
    assert_eq!(reason, LostReason::Deadline);
    expired(&old).await;
    let replica = seat.cluster().await.replica().connect(&db).await.unwrap();
    let (covered, _) = sequence(&replica).await;
    for i in 0.. {
        let (last, _) = sequence(&old).await;
        if last >= covered {
            assert_eq!(last, covered, "the burn drew past what the replica covers");
            break;
        }
        assert!(i < 100, "the sequence does not reach {covered}");
        let burn_opts = LeaseOptions::new(Duration::from_secs(60));
        let burn = B::acquire(&lb, &format!("burn-{i}"), &burn_opts, None)
            .await
            .unwrap();
        B::release(burn.expect("a fresh lease")).await.unwrap();
    }

    // B's take-over and write: acknowledged by the primary, never shipped.
    // B's deadline outlives the outage (TTL 10 s), so what it learns after
    // the promotion comes from the new primary, not from its clock.
    let b_opts = LeaseOptions::new(Duration::from_secs(10)).renew_every(Duration::from_millis(250));
    let b = B::acquire(&lb, LEASE, &b_opts, None)
        .await
        .unwrap()
        .expect("B takes over");
    let b_handle = LeaseHandle::clone(&b);
    assert_eq!(
        b.term().took_over_from.as_deref(),
        Some(a.term().holder.as_str())
    );
    let row_b = fenced_write::<B>(&pool_b, &b_handle, 0)
        .await
        .expect("B writes");
    assert!(b.term().token > covered);

    // The crash, and the stale replica promoted.
    let new = fail_over(seat, &front, &db).await;

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
    let b_write = fenced_write::<B>(&pool_b, &b_handle, 1).await;
    assert_eq!(b_write, Err(WriteError::Rejected(LostReason::Taken)));
    let a_write = fenced_write::<B>(&pool_b, &a_handle, 1).await;
    assert_eq!(a_write, Err(WriteError::Rejected(LostReason::Deadline)));

    // A new take-over: its token is above every token the new primary knows,
    // but it is B's token again (the sequence's WAL for it was lost too):
    // tokens are unique only among terms that reached the replica.
    let (pool_c, c) = take_over::<B>(&front, seat, &db).await;
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
    fenced_write::<B>(&pool_c, &c, 0).await.expect("C writes");
    // Same token, other holder: the fence checks both, B is still rejected.
    let b_write = fenced_write::<B>(&pool_b, &b_handle, 2).await;
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

backends!(
    sync,
    synchronous_replication_never_acknowledges_an_unshipped_takeover
);
fn synchronous_replication_never_acknowledges_an_unshipped_takeover<B: Backend>() {
    synchronous(&format!("sync::{}", B::NAME));
}

async fn unshipped_takeover<B: Backend>(seat: &Seat) {
    let (db, old) = database(seat).await;
    let cluster = seat.cluster().await;
    let front = Front::new(&cluster);
    let pool_a = service_pool::<B>(&front, &cluster, &db, "holder-a", 3);
    let pool_b = service_pool::<B>(&front, &cluster, &db, "holder-b", 3);
    drop(cluster);
    let la = B::leases(&pool_a);
    B::install(&la).await.unwrap();
    let lb = B::leases_bounded(&pool_b, Duration::from_secs(1));

    let a = B::acquire(&la, LEASE, &opts(), None)
        .await
        .unwrap()
        .expect("A takes the lease");
    seat.step(Step::Pause).await;
    B::close(&pool_a).await;
    assert_eq!(
        within(STEP, "A's lost signal", a.lost()).await,
        LostReason::Deadline
    );
    expired(&old).await;

    // The take-over cannot commit without the standby: B is never told it
    // holds the lease, and gets no token. Its statement times out waiting
    // for the standby; or it answers busy (`Ok(None)`, seen once in a run
    // on 12 threads): the row is still locked by a transaction of A's that
    // waits for the standby itself (a renewal sent as the stream paused:
    // a backend waiting for synchronous replication keeps its row locks,
    // and closing A's pool does not end its wait). Either way no term.
    let b = B::acquire(&lb, LEASE, &opts(), None).await;
    assert!(
        matches!(
            &b,
            Err(pgwarden::Error::Lease(pgwarden::LeaseError::Timeout { .. })) | Ok(None)
        ),
        "a take-over returned without the standby: {b:?}"
    );

    let new = fail_over(seat, &front, &db).await;
    let (holder, token, _) = lease_row(&new, LEASE).await.expect("lease row");
    assert_eq!(
        (holder.as_str(), token),
        (a.term().holder.as_str(), a.term().token)
    );
    let (_pool_c, c) = take_over::<B>(&front, seat, &db).await;
    assert_eq!(
        c.term().took_over_from.as_deref(),
        Some(a.term().holder.as_str())
    );
    assert!(c.term().token > a.term().token);
}
