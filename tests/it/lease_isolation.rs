//! Lease statements behave the same at every default isolation level of
//! the database (`ALTER DATABASE … SET default_transaction_isolation`): a
//! lost race is busy (`Ok(None)`), never a serialization failure (40001),
//! and `acquire(…, Some(wait))` keeps waiting through it. On every
//! backend: 10 rounds of each race per variant (20 when only deadpool ran
//! them).

use crate::support;

use std::time::Duration;

use futures_util::future::join_all;
use pgwarden::LeaseOptions;
use support::backend::{Backend, Settings};
use support::{admin, db, within};

const S: Duration = Duration::from_secs(1);

async fn races_are_busy_at<B: Backend>(level: &str) {
    let db = db().await;
    let admin = admin(&db).await;
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{}\" SET default_transaction_isolation = '{level}'",
            db.name()
        ))
        .await
        .unwrap();
    // Instances of their own (one pool each): no gathering between them,
    // every attempt is its own statement, as across processes.
    let instances: Vec<B::Leases> = (0..6)
        .map(|_| B::leases(&B::build(&db, &Settings::new("iso", 2))))
        .collect();
    B::install(&instances[0]).await.unwrap();
    let opts = LeaseOptions::new(30 * S);
    for round in 0..10 {
        // A new name, then the same name released: the insert race and the
        // take-over race.
        let name = format!("race{round}");
        for step in ["insert", "take-over"] {
            let got = join_all(instances.iter().map(|l| B::acquire(l, &name, &opts, None))).await;
            let mut won = Vec::new();
            for r in got {
                match r {
                    Ok(Some(lease)) => won.push(lease),
                    Ok(None) => {}
                    Err(e) => panic!("{level}, round {round}, {step}: {e}"),
                }
            }
            assert_eq!(won.len(), 1, "{level}, round {round}, {step}: one winner");
            for lease in won {
                B::release(lease).await.unwrap();
            }
        }
    }
    // Waiting callers keep waiting through lost races: each takes the name
    // in turn and gives it back.
    let waiters = instances.iter().map(|l| {
        let opts = opts.clone();
        async move {
            let lease = B::acquire(l, "queue", &opts, Some(20 * S))
                .await
                .unwrap_or_else(|e| panic!("{level}: a waiting caller gave up: {e}"))
                .expect("taken within the wait");
            B::release(lease).await.unwrap();
        }
    });
    within(30 * S, "every waiter in turn", join_all(waiters)).await;
}

backends!(
    races_are_busy_at_read_committed,
    flavor = "multi_thread",
    worker_threads = 2
);
async fn races_are_busy_at_read_committed<B: Backend>() {
    races_are_busy_at::<B>("read committed").await;
}

backends!(
    races_are_busy_at_repeatable_read,
    flavor = "multi_thread",
    worker_threads = 2
);
async fn races_are_busy_at_repeatable_read<B: Backend>() {
    races_are_busy_at::<B>("repeatable read").await;
}

backends!(
    races_are_busy_at_serializable,
    flavor = "multi_thread",
    worker_threads = 2
);
async fn races_are_busy_at_serializable<B: Backend>() {
    races_are_busy_at::<B>("serializable").await;
}
