//! The fence against a client whose term end is later than the database's,
//! on every backend and at every isolation level: what a host suspended
//! and resumed does (`Instant` is `CLOCK_MONOTONIC` on Linux, which stops
//! while suspended, so the local deadline trails the database's clock by
//! the suspension), forced here by moving the row's `expires_at` by hand
//! while the holder's 600 s term stays untouched locally (no renewal comes
//! within the test: one every 500 s).
//!
//! The database decides: a term it ended is refused (`Lost { Expired }`),
//! and a live one's transaction is bounded from the database's expiry + 1
//! s, never from the client's term end. Before (session 37's fence):
//! under `REPEATABLE READ` and `SERIALIZABLE` the ended term was fenced
//! with a 601 s bound, and at every level a live term's transaction got
//! 601 s where the database's term had 30 s left.

use crate::support;

use std::time::Duration;

use pgwarden::{Error, LeaseError, LeaseOptions, LostReason};
use support::backend::{Backend, Settings};
use support::{admin, db, within};

const S: Duration = Duration::from_secs(1);
const GUARD: Duration = Duration::from_secs(60);

backends!(a_term_the_database_ended_is_refused_at_every_level);
backends!(a_live_term_is_bounded_from_the_databases_expiry_at_every_level);

/// The levels, with a pool name for each (a pool per level: the database's
/// default level is read by each new connection).
const LEVELS: [(&str, &str); 3] = [
    ("read committed", "fdc-rc"),
    ("repeatable read", "fdc-rr"),
    ("serializable", "fdc-ser"),
];

/// The fenced transaction's `statement_timeout`, in ms (the bound the
/// fence set), and the four parameters `fenced_scalar` binds, used.
const BOUND: &str = "SELECT (extract(epoch FROM current_setting('statement_timeout')::interval) * 1000)::int8
  WHERE $1::text IS NOT NULL AND $2::int8 IS NOT NULL AND $3::int4 IS NOT NULL AND $4::text IS NOT NULL";

/// A lease of `name` on a new pool of backend `B` whose transactions run at
/// `level` by default: a 600 s term, renewed every 500 s.
async fn held<B: Backend>(
    db: &pgwarden_testing::TestDb,
    admin: &tokio_postgres::Client,
    level: &str,
    app: &'static str,
    name: &str,
) -> (B::Pool, B::Lease) {
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{}\" SET default_transaction_isolation = '{level}'",
            db.name()
        ))
        .await
        .unwrap();
    let p = B::build(db, &Settings::new(app, 3));
    let leases = B::leases(&p);
    B::install(&leases).await.unwrap();
    let opts = LeaseOptions::new(600 * S).renew_every(500 * S);
    let lease = B::acquire(&leases, name, &opts, None)
        .await
        .unwrap()
        .unwrap();
    (p, lease)
}

/// The term ended in the database 2 s ago, the holder's local deadline
/// about 525 s away: the fence refuses with `Lost { Expired }`, at every
/// level. Before: passed under REPEATABLE READ and SERIALIZABLE (the row
/// read under a snapshot was taken to be older than the term, and the
/// local deadline decided).
async fn a_term_the_database_ended_is_refused_at_every_level<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    for (i, (level, app)) in LEVELS.into_iter().enumerate() {
        let name = format!("ended{i}");
        let (p, lease) = held::<B>(&db, &admin, level, app, &name).await;
        admin
            .execute(
                "UPDATE pgwarden_leases SET expires_at = now() - interval '2 s' WHERE name = $1",
                &[&name],
            )
            .await
            .unwrap();
        let r = within(GUARD, "the fence", B::fenced_scalar(&p, &lease, BOUND, 0)).await;
        eprintln!("{} {level}: {r:?}", B::NAME);
        assert!(
            matches!(
                r,
                Err(Error::Lease(LeaseError::Lost {
                    reason: LostReason::Expired,
                    ..
                }))
            ),
            "{level}: a term the database ended was fenced: {r:?}"
        );
    }
}

/// The database's term ends in 30 s, the holder's local one in about
/// 600 s: the fence passes, and the transaction's bound is at most the
/// database's 30 s + the 1 s grace (the bound counts down from when the
/// fence reads the row, so it can only be less), at every level. Before:
/// 601 s at every level.
async fn a_live_term_is_bounded_from_the_databases_expiry_at_every_level<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    for (i, (level, app)) in LEVELS.into_iter().enumerate() {
        let name = format!("live{i}");
        let (p, lease) = held::<B>(&db, &admin, level, app, &name).await;
        admin
            .execute(
                "UPDATE pgwarden_leases SET expires_at = now() + interval '30 s' WHERE name = $1",
                &[&name],
            )
            .await
            .unwrap();
        let ms = within(GUARD, "the fence", B::fenced_scalar(&p, &lease, BOUND, 0))
            .await
            .unwrap();
        eprintln!(
            "{} {level}: the fenced transaction's bound {ms} ms",
            B::NAME
        );
        assert!(
            (1_000..=31_000).contains(&ms),
            "{level}: a term with 30 s left in the database got a {ms} ms bound"
        );
        assert!(!lease.is_lost());
    }
}
