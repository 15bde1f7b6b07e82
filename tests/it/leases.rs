//! Table leases against a real PostgreSQL: four jobs on a pool of two, one holder,
//! take-over, late release, the lost signal, fencing, batched renewal,
//! Leases::run, holds, bad input. Every test runs on every backend from one
//! source, but for the session-lock version's (raw deadpool's own
//! `pg_try_advisory_lock` on a pooled connection: the incident itself,
//! not pgwarden's API).

use crate::support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgwarden::{LeaseOptions, LostReason};
use support::backend::{named, settled, Backend, LeaseSettings, Settings};
use support::leases::{backends, row, short};
use support::{admin, db, eventually, within, Stopped};
use tokio_postgres::types::Type;

const S: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

// ---- leases hold no connection; the session-lock version starves the pool ----

const JOBS: [&str; 4] = ["cleanup", "alerts", "mail-checks", "uptime@node-a"];

backends!(leases_hold_no_connection);
async fn leases_hold_no_connection<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    admin
        .batch_execute(
            "CREATE TABLE readiness (id serial PRIMARY KEY, at timestamptz DEFAULT now())",
        )
        .await
        .unwrap();
    // The smallest pool pgwarden allows: the probe reserve + 1 shared
    // connection. Known direct before counting connections (configured:
    // detection takes two connections outside the probe reserve, more than
    // a pool of 2 has).
    let pool = B::build(&db, &Settings::new("four-jobs", 2));
    let leases = B::leases(&pool);
    let mut held = Vec::new();
    for job in JOBS {
        let lease = B::acquire(&leases, job, &LeaseOptions::default(), None)
            .await
            .unwrap();
        held.push(lease.unwrap_or_else(|| panic!("{job} is free")));
    }
    settled::<B>(&pool).await;
    let status = B::status(&pool);
    assert_eq!(status.in_use, 0, "four leases hold no connection: {status}");

    // The readiness-style write commits, and the probe passes. A pool
    // starved by the leases would never answer (see
    // `old_try_exclusive_never_gets_there`): the bounds only stop a hang,
    // and are generous for a loaded machine, where opening the probe's
    // connection alone once took more than 1 s.
    let start = Instant::now();
    within(30 * S, "readiness write", async {
        let mut conn = B::get(&pool).await.unwrap();
        B::run(&mut conn, "INSERT INTO readiness DEFAULT VALUES").await;
    })
    .await;
    B::readiness(&pool, 10 * S).await.expect("readiness probe");
    eprintln!("readiness write with 4 leases held: {:?}", start.elapsed());

    // Every lease is a row of its own term; none is lost.
    for lease in &held {
        let (holder, token) = row(&admin, lease.term().name.as_str()).await.unwrap();
        assert_eq!(
            (holder.as_str(), token),
            (lease.term().holder.as_str(), lease.term().token)
        );
        assert!(!lease.is_lost());
    }
    for lease in held {
        B::release(lease).await.unwrap();
    }
    settled::<B>(&pool).await;
}

/// "Run on one instance only" with a session advisory lock: a pooled connection holding a session
/// advisory lock for as long as the job runs.
async fn old_try_exclusive(
    pool: &deadpool_postgres::Pool,
    name: &str,
) -> Option<deadpool_postgres::Object> {
    let conn = pool.get().await.unwrap();
    let ok: bool = conn
        .query_typed_one(
            "SELECT pg_try_advisory_lock(hashtext($1))",
            &[(&name, Type::TEXT)],
        )
        .await
        .unwrap()
        .get(0);
    ok.then_some(conn)
}

#[tokio::test]
async fn old_try_exclusive_never_gets_there() {
    let db = db().await;
    let admin = admin(&db).await;
    admin
        .batch_execute("CREATE TABLE readiness (id serial PRIMARY KEY)")
        .await
        .unwrap();
    let raw = db.deadpool(2).unwrap();
    let reached = AtomicBool::new(false);
    let scenario = async {
        let mut held = Vec::new();
        for job in JOBS {
            held.push(old_try_exclusive(&raw, job).await);
        }
        let conn = raw.get().await.unwrap();
        conn.query_typed("INSERT INTO readiness DEFAULT VALUES", &[])
            .await
            .unwrap();
        reached.store(true, Ordering::SeqCst);
    };
    // The third lock waits for a connection the first two hold: it never gets
    // to the readiness write.
    assert!(tokio::time::timeout(3 * S, scenario).await.is_err());
    assert!(!reached.load(Ordering::SeqCst));
    // The two locks went back to the pool with their connections, still held.
    let n: i64 = admin
        .query_typed_one(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
              WHERE l.locktype = 'advisory' AND a.datname = current_database()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 2);
}

// ---- one holder ----

backends!(one_holder_under_16_concurrent_contenders);
async fn one_holder_under_16_concurrent_contenders<B: Backend>() {
    let db = db().await;
    // Four instances, four contenders each.
    let instances: Vec<B::Leases> = (0..4)
        .map(|_| B::leases(&B::build(&db, &Settings::new("contenders", 5))))
        .collect();
    B::install(&instances[0]).await.unwrap();

    // All at once: exactly one wins, each round.
    for round in 0..5 {
        let name = format!("round-{round}");
        let barrier = Arc::new(tokio::sync::Barrier::new(16));
        let tasks: Vec<_> = (0..16)
            .map(|i| {
                let leases = instances[i % 4].clone();
                let (barrier, name) = (barrier.clone(), name.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    B::acquire(&leases, &name, &LeaseOptions::new(2 * S), None)
                        .await
                        .unwrap()
                })
            })
            .collect();
        let won: Vec<_> = futures_util::future::join_all(tasks)
            .await
            .into_iter()
            .filter_map(|r| r.unwrap())
            .collect();
        assert_eq!(won.len(), 1, "round {round}");
    }

    // Taken and released over and over for a second: never two inside.
    let inside = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let stop = Instant::now() + S;
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let leases = instances[i % 4].clone();
            let (inside, tokens) = (inside.clone(), tokens.clone());
            tokio::spawn(async move {
                let opts = LeaseOptions::new(2 * S);
                while Instant::now() < stop {
                    if let Some(lease) = B::acquire(&leases, "mutex", &opts, None).await.unwrap() {
                        assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                        tokens.lock().push(lease.term().token);
                        tokio::time::sleep(2 * MS).await;
                        inside.fetch_sub(1, Ordering::SeqCst);
                        B::release(lease).await.unwrap();
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let tokens = tokens.lock().clone();
    assert!(tokens.len() > 5, "{} holds", tokens.len());
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens grow: {tokens:?}"
    );
    eprintln!(
        "16 contenders on {}: {} successive holds, tokens increasing",
        B::NAME,
        tokens.len()
    );
}

// ---- take-over ----

backends!(unrenewed_lease_is_taken_over_and_a_renewed_one_is_not);
async fn unrenewed_lease_is_taken_over_and_a_renewed_one_is_not<B: Backend>() {
    let db = db().await;
    let pool_a = B::build(&db, &Settings::new("renew-a", 2));
    let a = B::leases(&pool_a);
    let b = B::leases(&B::build(&db, &Settings::new("renew-b", 2)));

    // Renewed: B waits 2.5 TTLs and never gets it.
    let held = B::acquire(&a, "renewed", &LeaseOptions::new(S), None)
        .await
        .unwrap()
        .unwrap();
    let got = B::acquire(&b, "renewed", &LeaseOptions::new(S), Some(2500 * MS))
        .await
        .unwrap();
    assert!(got.is_none(), "B took a renewed lease");
    assert!(!held.is_lost());
    assert!(B::lease_stats(&a).renewed >= 5, "{:?}", B::lease_stats(&a));
    B::release(held).await.unwrap();

    // Not renewed: A crashes (its pool closes), B takes it over after the TTL.
    let crashed = B::acquire(&a, "crashed", &LeaseOptions::new(S), None)
        .await
        .unwrap()
        .unwrap();
    assert!(B::acquire(&b, "crashed", &LeaseOptions::new(S), None)
        .await
        .unwrap()
        .is_none());
    B::close(&pool_a).await;
    let taken = B::acquire(&b, "crashed", &LeaseOptions::new(S), Some(5 * S))
        .await
        .unwrap()
        .expect("taken within the wait");
    assert_eq!(
        taken.term().took_over_from.as_deref(),
        Some(crashed.term().holder.as_str())
    );
    assert!(taken.term().token > crashed.term().token);
    assert_eq!(
        within(3 * S, "A's lost signal", crashed.lost()).await,
        LostReason::Deadline
    );
    B::release(taken).await.unwrap();
}

backends!(late_release_never_deletes_a_lease_taken_since);
async fn late_release_never_deletes_a_lease_taken_since<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    // A's backends named, to stop them; B installs the table.
    let (pool_a, app) = named::<B>(&db, "late-a", &Settings::new("late-a", 2));
    let a = B::leases(&pool_a);
    let b = B::leases(&B::build(&db, &Settings::new("late-b", 2)));
    B::install(&b).await.unwrap();
    let old = B::acquire(&a, "report", &short(), None)
        .await
        .unwrap()
        .unwrap();
    // A's backend stops: its renewals hang, B takes the lease after its TTL.
    let stopped = Stopped::stop(backends(&admin, &app).await).expect("SIGSTOP");
    let new = B::acquire(&b, "report", &short(), Some(10 * S))
        .await
        .unwrap()
        .expect("taken within the wait");
    drop(stopped);
    // A, late, releases its old term: nothing of B's is touched.
    let err = B::release(old).await.unwrap_err();
    assert!(err.is_lease_lost(), "{err}");
    assert_eq!(
        row(&admin, "report").await,
        Some((new.term().holder.clone(), new.term().token))
    );
    // B still renews and releases it.
    let renewed = B::lease_stats(&b).renewed;
    eventually(3 * S, "B renews", || {
        std::future::ready(B::lease_stats(&b).renewed > renewed)
    })
    .await;
    assert!(!new.is_lost());
    B::release(new).await.unwrap();
    assert_eq!(row(&admin, "report").await, None);
}

// ---- batched renewal ----

backends!(one_statement_renews_a_thousand_leases);
async fn one_statement_renews_a_thousand_leases<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    // The purge on demand only: its round (every 5 s) could otherwise be
    // in flight at a snapshot, its statement counted in `statements` and
    // not yet in `purge_statements` (4 against 3, twice in runs of 12
    // threads).
    let leases = B::leases_with(
        &B::build(&db, &Settings::new("batch", 4)),
        &LeaseSettings::default().purge(Duration::from_secs(60), None),
    )
    .unwrap();
    B::install(&leases).await.unwrap();
    let opts = LeaseOptions::new(4 * S).renew_every(S);
    let start = Instant::now();
    let mut held = Vec::with_capacity(1000);
    for i in 0..1000 {
        let name = format!("job-{i:04}");
        held.push(
            B::acquire(&leases, &name, &opts, None)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    eprintln!("1,000 acquisitions on {}: {:?}", B::NAME, start.elapsed());
    // Batches fold together within one round; then one statement a tick.
    eventually(10 * S, "a full batch", || {
        std::future::ready(B::lease_stats(&leases).last_batch == 1000)
    })
    .await;
    let before = B::lease_stats(&leases);
    eventually(10 * S, "three more renewal ticks", || {
        std::future::ready(
            B::lease_stats(&leases).renewal_statements >= before.renewal_statements + 3,
        )
    })
    .await;
    let after = B::lease_stats(&leases);
    let statements = after.statements - before.statements;
    let renewal_statements = after.renewal_statements - before.renewal_statements;
    let renewed = after.renewed - before.renewed;
    eprintln!(
        "batched renewal: {renewal_statements} statements renewed {renewed} leases \
         ({} per statement, the last in {:?}); {statements} statements in all",
        renewed / renewal_statements,
        after.last_renewal
    );
    assert_eq!(after.purge_statements, 0, "the purge ran on its own");
    assert_eq!(statements, renewal_statements, "nothing but renewals");
    assert_eq!(
        renewed,
        1000 * renewal_statements,
        "each statement renews all 1,000"
    );
    assert_eq!(after.held, 1000);
    // In the database: every lease runs at least 2 s more.
    let fresh: i64 = admin
        .query_typed_one(
            "SELECT count(*) FROM pgwarden_leases WHERE expires_at > now() + interval '2 s'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(fresh, 1000);
    assert!(held.iter().all(|l| !l.is_lost()));
    assert_eq!(B::release_all(&leases).await.unwrap(), 1000);
    assert!(held
        .iter()
        .all(|l| futures_util::FutureExt::now_or_never(l.lost()) == Some(LostReason::Released)));
    drop(held);
}
