//! Lease statements behave the same at every default isolation level of
//! the database (`ALTER DATABASE … SET default_transaction_isolation`): a
//! lost race is busy (`Ok(None)`), never a serialization failure (40001),
//! and `acquire(…, Some(wait))` keeps waiting through it.

use crate::support;

use std::time::Duration;

use futures_util::future::join_all;
use pgwarden::{LeaseOptions, Leases};
use support::leases::pool;
use support::{admin, db, within};

const S: Duration = Duration::from_secs(1);

async fn races_are_busy_at(level: &str) {
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
    let instances: Vec<Leases> = (0..6)
        .map(|i| Leases::new(&pool(&db, 2, &format!("iso-{i}"))))
        .collect();
    instances[0].install().await.unwrap();
    let opts = LeaseOptions::new(30 * S);
    for round in 0..20 {
        // A new name, then the same name released: the insert race and the
        // take-over race.
        let name = format!("race{round}");
        for step in ["insert", "take-over"] {
            let got = join_all(instances.iter().map(|l| l.acquire(&name, &opts, None))).await;
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
                lease.release().await.unwrap();
            }
        }
    }
    // Waiting callers keep waiting through lost races: each takes the name
    // in turn and gives it back.
    let waiters = instances.iter().map(|l| {
        let opts = opts.clone();
        async move {
            let lease = l
                .acquire("queue", &opts, Some(20 * S))
                .await
                .unwrap_or_else(|e| panic!("{level}: a waiting caller gave up: {e}"))
                .expect("taken within the wait");
            lease.release().await.unwrap();
        }
    });
    within(30 * S, "every waiter in turn", join_all(waiters)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn races_are_busy_at_read_committed() {
    races_are_busy_at("read committed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn races_are_busy_at_repeatable_read() {
    races_are_busy_at("repeatable read").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn races_are_busy_at_serializable() {
    races_are_busy_at("serializable").await;
}
