//! The term's TTL is stored (issue 31, point 2): every acquisition and
//! renewal stamps the row's `renewed_at` with the `now()` it sets the
//! expiry from, so `Leases::rows` (and `pgwarden check`) know the TTL
//! exactly. A table made by pgwarden 0.1 gets the column at install when
//! the role may add it; when it may not, or before any install, leases
//! work without it and readers get `ttl: None`. Rows an older pgwarden
//! writes (a mixed fleet) read as `ttl: None` too, never as a stale TTL.

use crate::support;

use std::time::Duration;

use pgwarden::{LeaseOptions, Leases};
use pgwarden_testing::{within, LEASES_DDL_0_1};
use support::leases::{expiry, insert_expired, pool, pool_with, row};
use support::{admin, db, logs};
use tokio_postgres::Client;

const S: Duration = Duration::from_secs(1);

async fn has_column(admin: &Client) -> bool {
    admin
        .query_one(
            "SELECT count(*) FROM pg_attribute
              WHERE attrelid = 'pgwarden_leases'::regclass AND attname = 'renewed_at' AND NOT attisdropped",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
        == 1
}

/// The TTL `rows()` reads for `name`.
async fn ttl_of(leases: &Leases, name: &str) -> Option<Duration> {
    let rows = leases.rows().await.expect("rows");
    rows.iter()
        .find(|r| r.name == name)
        .unwrap_or_else(|| panic!("no row {name}: {rows:?}"))
        .ttl
}

/// Waits until `name`'s expiry has moved (a renewal).
async fn renewed(admin: &Client, name: &str) {
    let before = expiry(admin, name).await;
    within(10 * S, "a renewal", async {
        while expiry(admin, name).await <= before {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

#[tokio::test]
async fn a_new_table_stores_each_terms_ttl_exactly() {
    let db = db().await;
    let pool = pool(&db, 3, "ttl-new");
    let leases = Leases::new(&pool);
    let lease = leases
        .acquire("job", &LeaseOptions::new(3 * S), None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ttl_of(&leases, "job").await, Some(3 * S));
    // A renewal keeps it exact (the stamp moves with the expiry).
    let admin = admin(&db).await;
    renewed(&admin, "job").await;
    assert_eq!(ttl_of(&leases, "job").await, Some(3 * S));
    // The revoke returns it; a released term has none.
    let revoked = leases.revoke("job").await.unwrap().expect("revoked");
    assert_eq!(revoked.ttl, Some(3 * S));
    assert_eq!(ttl_of(&leases, "job").await, None);
    drop(lease);
}

/// A table made by pgwarden 0.1, holding a term an 0.1 instance wrote, and
/// four instances starting together on it while a fifth (never installed,
/// `auto_install(false)`) holds and renews a lease: the column is added
/// once, nothing fails, the held lease is never lost, and the old term
/// reads `ttl: None`.
#[tokio::test(flavor = "multi_thread")]
async fn a_table_made_by_the_previous_version_is_migrated_under_concurrent_instances() {
    let db = db().await;
    let admin = admin(&db).await;
    admin.batch_execute(LEASES_DDL_0_1).await.unwrap();
    insert_expired(&admin, "crashed-0.1", "old-host:1:aa").await;
    let pool = pool(&db, 12, "ttl-migrate");
    // Holds a lease on the old table before anyone installs: its first
    // statement meets the missing column and goes on without it.
    let holder = Leases::builder(&pool).auto_install(false).build().unwrap();
    let held = holder
        .acquire("held", &LeaseOptions::new(S), None)
        .await
        .unwrap()
        .expect("acquired on a 0.1 table");
    assert!(!has_column(&admin).await);
    let all: Vec<Leases> = (0..4).map(|_| Leases::new(&pool)).collect();
    let ran = futures_util::future::join_all(all.iter().map(|l| l.install())).await;
    for r in ran {
        assert!(!r.expect("install on a 0.1 table"), "no DDL to run");
    }
    assert!(has_column(&admin).await);
    // The holder renewed across the ALTER (its statements, prepared or
    // not, still run) and still holds.
    renewed(&admin, "held").await;
    renewed(&admin, "held").await;
    assert!(!held.is_lost());
    // It writes without the column (it learnt so), and readers say None
    // for its term rather than a wrong value.
    assert_eq!(ttl_of(&all[0], "held").await, None);
    assert_eq!(ttl_of(&all[0], "crashed-0.1").await, None);
    // A new term on the migrated table has it.
    let lease = all[1]
        .acquire("crashed-0.1", &LeaseOptions::new(2 * S), None)
        .await
        .unwrap()
        .expect("the expired 0.1 term is taken over");
    assert_eq!(ttl_of(&all[0], "crashed-0.1").await, Some(2 * S));
    lease.release().await.unwrap();
    held.release().await.unwrap();
}

/// A role that may use the table but not alter it (not its owner): the
/// install says so and succeeds, leases work (acquire, renew, release),
/// readers get `ttl: None`.
#[tokio::test(flavor = "multi_thread")]
async fn a_role_that_may_not_alter_the_table_works_without_the_column() {
    let db = db().await;
    let admin = admin(&db).await;
    admin.batch_execute(LEASES_DDL_0_1).await.unwrap();
    let role = format!("noalter_{}", db.name());
    admin
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN;
             GRANT SELECT, INSERT, UPDATE, DELETE ON pgwarden_leases TO {role};
             GRANT USAGE ON SEQUENCE pgwarden_leases_token_seq TO {role};"
        ))
        .await
        .unwrap();
    let logs = logs();
    let mut config = db.pg_config();
    config.user(&role);
    let app = format!("ttl-noalter-{}", db.name());
    let pool = pool_with(config, 3, &app);
    let leases = Leases::new(&pool);
    assert!(!leases
        .install()
        .await
        .expect("install without ALTER rights"));
    assert!(!has_column(&admin).await);
    let said = logs.text();
    let line = said
        .lines()
        .find(|l| l.contains(&format!("pool={app}")) && l.contains("renewed_at"))
        .unwrap_or_else(|| panic!("no warning for pool {app}:\n{said}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("must be owner"), "{line}");
    assert!(line.contains("ALTER TABLE"), "{line}");
    let lease = leases
        .acquire("job", &LeaseOptions::new(S), None)
        .await
        .unwrap()
        .expect("acquired");
    renewed(&admin, "job").await;
    assert!(!lease.is_lost());
    assert_eq!(ttl_of(&leases, "job").await, None);
    lease.release().await.unwrap();
    assert_eq!(row(&admin, "job").await, None, "released");
}

/// Rows a reader must not trust: a term taken over by a 0.1 instance
/// (the previous term's stamp left in place), a row with no stamp, and
/// rows edited by hand with odd stamps. None of them reads as a TTL, and
/// none fails the listing.
#[tokio::test]
async fn rows_from_an_older_pgwarden_or_edited_by_hand_read_as_no_ttl() {
    let db = db().await;
    let admin = admin(&db).await;
    let pool = pool(&db, 3, "ttl-mixed");
    let leases = Leases::new(&pool);
    let lease = leases
        .acquire("shared", &LeaseOptions::new(S), None)
        .await
        .unwrap()
        .unwrap();
    drop(lease.release().await);
    // A 0.1 instance takes the name over: its statement (the 0.1 text)
    // sets the term's columns, not renewed_at.
    admin
        .batch_execute(
            "UPDATE pgwarden_leases SET holder = 'old-host:2:bb', token = nextval('pgwarden_leases_token_seq'),
                    taken_at = now(), expires_at = now() + interval '30 s', prev_holder = holder
              WHERE name = 'shared'",
        )
        .await
        .unwrap();
    assert_eq!(ttl_of(&leases, "shared").await, None);
    let odd = [
        ("null-stamp", "NULL"),
        ("future-stamp", "now() + interval '1 hour'"),
        ("infinite-stamp", "'infinity'"),
        ("minus-infinite-stamp", "'-infinity'"),
    ];
    for (name, stamp) in odd {
        admin
            .batch_execute(&format!(
                "INSERT INTO pgwarden_leases (name, holder, token, taken_at, expires_at, renewed_at)
                 VALUES ('{name}', 'h:1:cc', nextval('pgwarden_leases_token_seq'), now(), now() + interval '10 s', {stamp})"
            ))
            .await
            .unwrap();
    }
    admin
        .batch_execute(
            "INSERT INTO pgwarden_leases (name, holder, token, taken_at, expires_at, renewed_at)
             VALUES ('infinite-expiry', 'h:1:dd', nextval('pgwarden_leases_token_seq'), now(), 'infinity', now())",
        )
        .await
        .unwrap();
    let rows = leases.rows().await.expect("the listing survives odd rows");
    for (name, _) in odd {
        let r = rows.iter().find(|r| r.name == name).unwrap();
        assert_eq!(r.ttl, None, "{name}: {r:?}");
    }
    let r = rows.iter().find(|r| r.name == "infinite-expiry").unwrap();
    assert_eq!(r.ttl, None, "{r:?}");
}

/// Hostile: installs on a 0.1 table dropped at random points (before,
/// during and after the `ALTER TABLE`), while another instance takes and
/// releases leases and reads the rows. Afterwards no session of the pool is
/// left in a transaction or holding the install lock, the column is there
/// once, and leases work.
#[tokio::test(flavor = "multi_thread")]
async fn installs_dropped_mid_migration_leave_nothing_behind() {
    let db = db().await;
    let admin = admin(&db).await;
    admin.batch_execute(LEASES_DDL_0_1).await.unwrap();
    let app = "ttl-dropped";
    let pool = pool(&db, 8, app);
    let worker = Leases::builder(&pool).auto_install(false).build().unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (worker, stop) = (worker.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let name = format!("w{}", n % 7);
                if let Some(l) = worker
                    .acquire(&name, &LeaseOptions::new(S), None)
                    .await
                    .unwrap()
                {
                    l.release().await.unwrap();
                }
                worker.rows().await.unwrap();
                n += 1;
            }
            n
        })
    };
    for i in 0..40u64 {
        let l = Leases::new(&pool);
        // Dropped after 0 to ~8 ms: at any await point of the install.
        let cut = Duration::from_micros((i * 7919) % 8000);
        let _ = tokio::time::timeout(cut, l.install()).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(load.await.unwrap() > 0);
    within(10 * S, "no session left in a transaction or on the install lock", async {
        loop {
            let left: i64 = admin
                .query_one(
                    "SELECT (SELECT count(*) FROM pg_stat_activity
                              WHERE application_name = $1 AND state LIKE 'idle in transaction%')
                          + (SELECT count(*) FROM pg_locks
                              WHERE locktype = 'advisory' AND classid = 1885828964 AND objid = 594100531)",
                    &[&app],
                )
                .await
                .unwrap()
                .get(0);
            if left == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let l = Leases::new(&pool);
    assert!(!l.install().await.expect("install after the dropped ones"));
    assert!(has_column(&admin).await);
    let lease = l
        .acquire("after", &LeaseOptions::new(2 * S), None)
        .await
        .unwrap()
        .expect("acquired");
    assert_eq!(ttl_of(&l, "after").await, Some(2 * S));
    lease.release().await.unwrap();
}
