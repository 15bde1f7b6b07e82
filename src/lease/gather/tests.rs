//! The forget-hold half of a gathered release, against a real PostgreSQL:
//! the scheduler's release of a lease whose job never started, or was
//! cancelled (`Lease::release_now`, crate-private), shares a statement with
//! plain releases, and only its own hold goes.

use std::time::Duration;

use futures_util::future::join_all;
use pgwarden_testing::TestServer;
use tokio_postgres::types::Type;

use crate::{Lease, LeaseOptions, Leases, Pool};

const S: Duration = Duration::from_secs(1);

/// A new database, a client of its own, and a pool of `size` named `name`
/// on it, the lease table installed.
async fn installed(
    name: &str,
    size: usize,
) -> (pgwarden_testing::TestDb, tokio_postgres::Client, Pool) {
    let db = TestServer::shared()
        .unwrap()
        .create_database()
        .await
        .unwrap();
    let admin = db.connect().await.unwrap();
    let pool = Pool::builder(db.deadpool(size).unwrap())
        .name(name)
        .build()
        .unwrap();
    Leases::new(&pool).install().await.unwrap();
    (db, admin, pool)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gathered_release_forgets_only_the_holds_it_is_asked_to() {
    let (_db, admin, pool) = installed("gather-forget", 16).await;
    let leases = Leases::new(&pool);
    let held = LeaseOptions::new(30 * S).at_least(60 * S);
    // A call waits at most 100 ms for a batch: on a loaded machine a round
    // may see none, so rounds run until one shows gathering.
    for round in 0..5 {
        let names: Vec<String> = (0..24).map(|i| format!("forget{round}-{i}")).collect();
        let taken: Vec<Lease> = join_all(names.iter().map(|n| leases.acquire(n, &held, None)))
            .await
            .into_iter()
            .map(|r| r.unwrap().expect("a new name is free"))
            .collect();
        let before = leases.stats();
        // Even names forget their hold, odd ones keep it: all at once.
        let released = join_all(taken.into_iter().enumerate().map(|(i, lease)| async move {
            if i % 2 == 0 {
                lease.release_now().await
            } else {
                lease.release().await
            }
        }))
        .await;
        assert!(released.into_iter().all(|r| r.is_ok()));
        let after = leases.stats();
        let rows = admin
            .query_typed(
                "SELECT name, holder, held_until <= now(), held_until > now() + interval '50 s'
                   FROM pgwarden_leases WHERE name = ANY($1)",
                &[(&names, Type::TEXT_ARRAY)],
            )
            .await
            .unwrap();
        assert_eq!(rows.len(), 24);
        for r in &rows {
            let name: String = r.get(0);
            let i: usize = name.rsplit('-').next().unwrap().parse().unwrap();
            assert_eq!(r.get::<_, String>(1), "", "{name} released");
            let (free, kept): (bool, bool) = (r.get(2), r.get(3));
            if i % 2 == 0 {
                assert!(free && !kept, "{name}: its hold forgotten");
            } else {
                assert!(kept && !free, "{name}: its hold kept");
            }
        }
        // What the rows say, as a contender sees it: the forgotten ones are
        // free at once, the others held until their time.
        let other = Leases::new(&pool);
        let again = LeaseOptions::new(30 * S);
        let forgot = other.acquire(&names[0], &again, None).await.unwrap();
        assert!(forgot.is_some(), "{} is free at once", names[0]);
        let kept = other.acquire(&names[1], &again, None).await.unwrap();
        assert!(kept.is_none(), "{} is held until its time", names[1]);
        if let Some(l) = forgot {
            l.release().await.unwrap();
        }
        if after.gathered_statements > before.gathered_statements {
            return;
        }
        eprintln!("round {round}: no release batch (the statements out took over 100 ms)");
    }
    panic!("no round of 5 gathered its releases");
}

/// The release batch's cached generic plan (the one a connection fixes at
/// its sixth call) looks each name up by the primary key at every table
/// size, a never-analysed table of 600 to 1,000 rows included: written as
/// `name = ANY (…)` it was a sequential scan there, kept while the table
/// grew (BENCHMARKS.md, row 4s). Autovacuum is off for the table, so that
/// nothing analyses it between the steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_release_batch_plan_uses_the_primary_key_at_every_size() {
    use crate::lease::table::{Statements, TableName};

    let (db, admin, _pool) = installed("release-batch-plan", 2).await;
    admin
        .batch_execute("ALTER TABLE pgwarden_leases SET (autovacuum_enabled = false)")
        .await
        .unwrap();
    let sql = Statements::new(&TableName::parse("pgwarden_leases").unwrap(), 10 * S);
    let mut rows = 0;
    for (size, analyse) in [
        (100, false),
        (600, false),
        (1_000, false),
        (3_000, false),
        (3_000, true),
        (30_000, true),
    ] {
        admin
            .execute(
                "INSERT INTO pgwarden_leases (name, holder, token, expires_at)
                 SELECT 'plan-' || g, '', g, now() FROM generate_series($1::int4, $2::int4) g",
                &[&(rows + 1), &size],
            )
            .await
            .unwrap();
        rows = size;
        if analyse {
            admin
                .batch_execute("ANALYZE pgwarden_leases")
                .await
                .unwrap();
        }
        // A session of its own: plans are cached per session.
        let c = db.connect().await.unwrap();
        c.batch_execute(&format!(
            "SET plan_cache_mode = force_generic_plan;
             PREPARE rb (text[], text[], text[]) AS {}",
            sql.release_batch
        ))
        .await
        .unwrap();
        let plan: Vec<String> = c
            .simple_query("EXPLAIN EXECUTE rb ('{plan-1,plan-2}', '{a,b}', '{}')")
            .await
            .unwrap()
            .into_iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                _ => None,
            })
            .collect();
        let plan = plan.join("\n");
        let at = format!("{size} rows, analysed: {analyse}");
        assert!(
            plan.contains("pgwarden_leases_pkey"),
            "{at}: no lookup by the primary key:\n{plan}"
        );
        assert!(
            !plan.contains("Seq Scan on pgwarden_leases"),
            "{at}: the table scanned:\n{plan}"
        );
    }
}
