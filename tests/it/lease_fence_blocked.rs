//! A fence that meets a row lock on its lease row, on every backend: an
//! outside session holds the row with `SELECT … FOR UPDATE` (a user's or
//! an operator's statement, or a frozen process), which makes the fence's
//! own statement wait for the row's lock. The fence bounds that wait on
//! the server, in the statement itself: it gives up at its term's end + 1
//! s (the documented bound of a fenced transaction) with a typed error,
//! nothing written, or at the transaction's own tighter `lock_timeout`.
//! Before: the fence waited for as long as the outside session held the
//! row (still waiting after 20 s on a 3 s term).

use crate::support;

use std::time::{Duration, Instant};

use pgwarden::{Error, LeaseError, LeaseOptions, LostReason};
use support::backend::{Backend, Settings, LEDGER};
use support::leases::{lock_rows, short};
use support::{admin, db, within};
use tokio_postgres::Client;

const S: Duration = Duration::from_secs(1);
/// The guard against a hang: only a wrong behaviour waits it out.
const GUARD: Duration = Duration::from_secs(60);
/// What the fence's bound allows past the term's end: `FENCE_GRACE`.
const GRACE: Duration = Duration::from_secs(1);
/// Past the term's end + the grace, the time the fence may take to come
/// back. The server ends the wait by itself at that bound (a `lock_timeout`
/// of the statement, by the database clock); what is left is the error's
/// way back to the client and the scheduling of two busy cores (a few
/// milliseconds quiet, up to seconds beside other suites), so 10 s is
/// generous and still far below a wait that only ends when the row does.
const SLACK: Duration = Duration::from_secs(10);

async fn ledger_rows(admin: &Client) -> i64 {
    admin
        .query_one("SELECT count(*) FROM ledger", &[])
        .await
        .expect("ledger")
        .get(0)
}

/// The term's time left by the database clock, read by `c`.
async fn term_left(c: &Client, name: &str) -> Duration {
    let secs: f64 = c
        .query_one(
            "SELECT greatest(extract(epoch FROM expires_at - clock_timestamp()), 0)::float8 \
               FROM pgwarden_leases WHERE name = $1",
            &[&name],
        )
        .await
        .expect("the term's expiry")
        .get(0);
    Duration::from_secs_f64(secs)
}

backends!(a_fence_blocked_by_a_row_lock_gives_up_at_its_terms_end);
/// A 3 s term whose row an outside session holds `FOR UPDATE` from just
/// after the acquisition on (renewals wait behind it too, so the term ends
/// then): the fence returns `Lost` (the local deadline) no later than the
/// term's end + 1 s + [`SLACK`], after the term ended by the database
/// clock, while the outside session still holds the row; its write never
/// lands. Failed before (the fence waited for as long as the row was held:
/// the guard fired).
async fn a_fence_blocked_by_a_row_lock_gives_up_at_its_terms_end<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    admin.batch_execute(LEDGER).await.unwrap();
    let pool = B::build(&db, &Settings::new("fence-blocked", 4));
    let leases = B::leases(&pool);
    B::install(&leases).await.unwrap();
    let lease = B::acquire(&leases, "blocked", &short(), None)
        .await
        .unwrap()
        .expect("a free name");
    let locker = lock_rows(&db, "pgwarden_leases", &["blocked"], "FOR UPDATE").await;
    let left = term_left(&locker, "blocked").await;
    let began = Instant::now();
    let e = within(
        left + GRACE + SLACK,
        "the fence blocked by a row lock, bounded by its term's end + 1 s",
        B::fenced_write(&pool, &lease),
    )
    .await
    .unwrap_err();
    eprintln!(
        "{}: term left {left:?}, fence gave up after {:?}: {e}",
        B::NAME,
        began.elapsed()
    );
    assert!(
        matches!(
            e,
            Error::Lease(LeaseError::Lost {
                reason: LostReason::Deadline,
                ..
            })
        ),
        "{e}"
    );
    assert!(lease.is_lost());
    let over: bool = admin
        .query_one(
            "SELECT expires_at < now() FROM pgwarden_leases WHERE name = 'blocked'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(over, "the fence gave up before its term ended");
    // The outside session still holds the row: the fence's bound ended the
    // wait, not the lock going away.
    locker.query_one("SELECT 1", &[]).await.unwrap();
    assert_eq!(
        ledger_rows(&admin).await,
        0,
        "a blocked fence's write landed"
    );
    locker.batch_execute("ROLLBACK").await.unwrap();
}

backends!(a_fence_blocked_under_a_tighter_lock_timeout_keeps_its_lease);
/// The database's `lock_timeout` is 300 ms (the connections' own, tighter
/// than the term's 60 s): a fence blocked by a row lock gives up at it,
/// typed `FenceBlocked` with the blocking session's pid, the lease still
/// held; once the outside session lets go, the next fenced write lands.
async fn a_fence_blocked_under_a_tighter_lock_timeout_keeps_its_lease<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    admin.batch_execute(LEDGER).await.unwrap();
    admin
        .batch_execute(
            "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET lock_timeout = 300', current_database()); END $$",
        )
        .await
        .unwrap();
    let pool = B::build(&db, &Settings::new("fence-tighter", 4));
    let leases = B::leases(&pool);
    B::install(&leases).await.unwrap();
    let lease = B::acquire(&leases, "tighter", &LeaseOptions::new(60 * S), None)
        .await
        .unwrap()
        .expect("a free name");
    let locker = lock_rows(&db, "pgwarden_leases", &["tighter"], "FOR UPDATE").await;
    let locker_pid: i32 = locker
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let e = within(GUARD, "the blocked fence", B::fenced_write(&pool, &lease))
        .await
        .unwrap_err();
    eprintln!("{}: {e}", B::NAME);
    match &e {
        Error::Lease(LeaseError::FenceBlocked {
            name, blocking_pid, ..
        }) => {
            assert_eq!(name, "tighter");
            assert_eq!(*blocking_pid, Some(locker_pid));
        }
        _ => panic!("not FenceBlocked: {e}"),
    }
    assert!(!lease.is_lost(), "a blocked fence is not a lost lease");
    assert_eq!(ledger_rows(&admin).await, 0);
    locker.batch_execute("ROLLBACK").await.unwrap();
    within(GUARD, "the fenced write", B::fenced_write(&pool, &lease))
        .await
        .unwrap();
    assert_eq!(ledger_rows(&admin).await, 1);
}
