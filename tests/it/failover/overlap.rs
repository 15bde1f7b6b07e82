//! Asynchronous replication can lose renewals too: the promoted standby's
//! copy of a term then expires earlier than the holder's own reckoning, and
//! another holder can take the lease over before the old holder's local
//! deadline warns it. The fence still rejects the old holder's writes.
//!
//! The construction: holder A (TTL 4 s, renewed every 250 ms, so its local
//! deadline falls 3.5 s after its last renewal) reaches the first server
//! only. WAL shipping stops; A keeps renewing on the primary until the
//! standby's copy of its term has expired. The primary crashes, the standby
//! is promoted, and C takes the lease over there at once: A's deadline is
//! still more than 3 s away.

use std::time::{Duration, Instant};

use pgwarden::{LeaseHandle, LeaseOptions, LostReason};
use pgwarden_testing::within;

use super::common::{
    database, fenced_write, lease_row, service_pool, until, Front, WriteError, STEP,
};
use super::stale::{asynchronous, fail_over};
use super::together::{Seat, Step};
use crate::support::backend::{Backend, Settings};

const LEASE: &str = "overlap";

backends!(
    sync,
    an_unshipped_renewal_lets_a_takeover_in_before_the_deadline
);
fn an_unshipped_renewal_lets_a_takeover_in_before_the_deadline<B: Backend>() {
    asynchronous(&format!("overlap::{}", B::NAME));
}

/// The construction on backend `B`, in a database of its own on the
/// asynchronous cluster it shares with `stale.rs`'s lost take-over.
pub async fn unshipped_renewal<B: Backend>(seat: &Seat) {
    let (db, old) = database(seat).await;
    let cluster = seat.cluster().await;
    let front = Front::new(&cluster);
    // A knows the first server only: it cannot follow the failover.
    let first = cluster.primary().pg_config(&db);
    drop(cluster);
    let pool_a = B::build_on(&first, &Settings::new("holder-a", 3).wait(STEP));
    let la = B::leases(&pool_a);
    B::install(&la).await.unwrap();
    let opts = LeaseOptions::new(Duration::from_secs(4)).renew_every(Duration::from_millis(250));
    let a = B::acquire(&la, LEASE, &opts, None)
        .await
        .unwrap()
        .expect("A takes the lease");
    let a_handle = LeaseHandle::clone(&a);
    seat.cluster().await.wait_replayed().await.unwrap();

    // The standby stops receiving A's renewals, and its copy of A's term
    // runs out while A keeps renewing on the primary.
    seat.step(Step::Pause).await;
    let replica = seat.cluster().await.replica().connect(&db).await.unwrap();
    let ran_out = until(STEP * 2, || async {
        lease_row(&replica, LEASE)
            .await
            .is_some_and(|(_, _, left)| left < 0.0)
    })
    .await;
    assert!(
        ran_out.is_some(),
        "the standby's copy of A's term did not expire"
    );
    let (_, _, left_on_primary) = lease_row(&old, LEASE).await.unwrap();
    assert!(
        left_on_primary > 3.0,
        "A renews on the primary: {left_on_primary} s left"
    );
    assert!(!a.is_lost());

    fail_over(seat, &front, &db).await;

    // C takes the lease over on the new primary while A still trusts it.
    let pool_c = service_pool::<B>(&front, &*seat.cluster().await, &db, "holder-c", 3);
    let c_opts = LeaseOptions::new(Duration::from_secs(4));
    let c = B::acquire(&B::leases(&pool_c), LEASE, &c_opts, Some(STEP))
        .await
        .expect("C's attempt")
        .expect("C takes over on the new primary");
    let c_took_over = Instant::now();
    assert_eq!(
        c.term().took_over_from.as_deref(),
        Some(a.term().holder.as_str())
    );
    assert!(c.term().token > a.term().token);
    assert!(!a.is_lost(), "A's deadline has not warned it yet");
    // C holds the lease well before A's local deadline: the renewals that
    // would have kept A's term never reached the new primary. Measured: A
    // still trusts its term 500 ms after C took it (a duration measured,
    // not a synchronisation).
    tokio::time::sleep_until((c_took_over + Duration::from_millis(500)).into()).await;
    assert!(
        !a.is_lost(),
        "A stopped trusting its term within 500 ms of C's take-over"
    );
    eprintln!("async lost renewals: A still trusted its term 500 ms after C took it");

    // The database is not fooled: A's fenced writes are rejected there, and
    // the rejected fence fires A's lost signal at once (before its deadline).
    let a_write = fenced_write::<B>(&pool_c, &a_handle, 0).await;
    assert_eq!(a_write, Err(WriteError::Rejected(LostReason::Taken)));
    // Taken, not Deadline: learnt from the fence, before the deadline.
    let reason = within(STEP, "A's lost signal", a.lost()).await;
    assert_eq!(reason, LostReason::Taken);
    fenced_write::<B>(&pool_c, &c, 0).await.expect("C writes");
}
