//! `migrate_once` (issue 16, point 11): a name that could not be recorded
//! is refused before anything runs, and a migration that ran but could not
//! be recorded says so (`LockError::MigrationNotRecorded`), with whether its
//! transaction was rolled back.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgwarden::{Error, InvalidInput, LockError, Migrated, NameRule, Pool, PoolerMode};
use support::*;

const T: Duration = Duration::from_secs(10);

/// Runs `migrate_once(name)` with a closure that counts its calls and
/// creates table `made`; returns what it said.
async fn migrate(pool: &Pool, name: &str, calls: &Arc<AtomicUsize>) -> Result<Migrated<()>, Error> {
    let calls = calls.clone();
    pool.migrate_once(name, T, move |tx| {
        Box::pin(async move {
            calls.fetch_add(1, Ordering::AcqRel);
            tx.batch_execute("CREATE TABLE IF NOT EXISTS made (id int)")
                .await?;
            Ok::<_, Error>(())
        })
    })
    .await
}

async fn exists(c: &tokio_postgres::Client, table: &str) -> bool {
    c.query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn a_name_that_cannot_be_recorded_is_refused_before_anything_runs() {
    let db = db().await;
    let pool = builder(&db, 2).build().unwrap();
    let raw = admin(&db).await;
    let calls = Arc::new(AtomicUsize::new(0));

    let long = "x".repeat(10_000);
    let e = migrate(&pool, &long, &calls).await.unwrap_err();
    match &e {
        Error::Invalid(InvalidInput::Name {
            what: "migrate_once name",
            rule:
                NameRule::TooLong {
                    len: 10_000,
                    max: 1024,
                },
            ..
        }) => {}
        _ => panic!("{e:?}"),
    }
    let e = migrate(&pool, "x\0y", &calls).await.unwrap_err();
    assert!(
        matches!(
            &e,
            Error::Invalid(InvalidInput::Name {
                rule: NameRule::Character { found: '\0', .. },
                ..
            })
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("no NUL byte"), "{e}");
    let e = migrate(&pool, "", &calls).await.unwrap_err();
    assert!(
        matches!(
            &e,
            Error::Invalid(InvalidInput::Name {
                rule: NameRule::Empty,
                ..
            })
        ),
        "{e:?}"
    );
    // Nothing ran: not the closure, not even the ledger's creation.
    assert_eq!(calls.load(Ordering::Acquire), 0);
    assert!(!exists(&raw, "made").await);
    assert!(!exists(&raw, "pgwarden_run_once").await);

    // The longest name allowed runs, is recorded, and is skipped next time.
    let longest = "y".repeat(1024);
    assert_eq!(
        migrate(&pool, &longest, &calls).await.unwrap(),
        Migrated::Ran(())
    );
    assert!(matches!(
        migrate(&pool, &longest, &calls).await.unwrap(),
        Migrated::Skipped { .. }
    ));
    assert_eq!(calls.load(Ordering::Acquire), 1);
}

/// A role that may read the ledger but not write it: the work runs, the
/// record fails, the error says the work ran and its transaction was rolled
/// back, and the next call runs it again.
#[tokio::test]
async fn a_migration_that_ran_but_was_not_recorded_says_so() {
    let db = db().await;
    let raw = admin(&db).await;
    let role = format!("{}_migrator", db.name());
    // The ledger exists (made by the owner's own pool); the role may read it
    // and create tables, not insert.
    let owner = builder(&db, 2).build().unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    assert_eq!(
        migrate(&owner, "owner/0001", &calls).await.unwrap(),
        Migrated::Ran(())
    );
    raw.batch_execute(&format!(
        "DROP TABLE made; \
         CREATE ROLE \"{role}\" LOGIN; \
         GRANT CREATE, USAGE ON SCHEMA public TO \"{role}\"; \
         GRANT SELECT ON pgwarden_run_once TO \"{role}\""
    ))
    .await
    .unwrap();
    let mut cfg = db.pg_config();
    cfg.user(&role);
    let pool = Pool::builder(pgwarden_testing::deadpool(cfg, 2).unwrap())
        .pooler(PoolerMode::Direct)
        .census_interval(None)
        .build()
        .unwrap();

    let calls = Arc::new(AtomicUsize::new(0));
    for run in 1..=2 {
        let e = migrate(&pool, "app/0002", &calls).await.unwrap_err();
        let Error::Lock(LockError::MigrationNotRecorded {
            name,
            rolled_back,
            source,
        }) = &e
        else {
            panic!("{e:?}")
        };
        assert_eq!(name, "app/0002");
        assert!(rolled_back);
        let Error::Db(source) = &**source else {
            panic!("{source:?}")
        };
        assert_eq!(
            source.code(),
            Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE)
        );
        let msg = e.to_string();
        assert!(
            msg.contains("ran its work but could not record it")
                && msg.contains("42501")
                && msg.contains("the next call runs it again"),
            "{msg}"
        );
        // It ran (every time), and its writes were undone with the record.
        assert_eq!(calls.load(Ordering::Acquire), run);
        assert!(!exists(&raw, "made").await);
    }

    // A commit the server refuses (a deferred check on the ledger): the
    // same error, its transaction rolled back.
    raw.batch_execute(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS \
           $$ BEGIN RAISE EXCEPTION 'ledger closed for maintenance'; END $$; \
         CREATE CONSTRAINT TRIGGER refuse AFTER INSERT ON pgwarden_run_once \
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse()",
    )
    .await
    .unwrap();
    let e = migrate(&owner, "owner/0003", &calls).await.unwrap_err();
    let Error::Lock(LockError::MigrationNotRecorded {
        rolled_back: true, ..
    }) = &e
    else {
        panic!("{e:?}")
    };
    assert!(
        e.to_string().contains("ledger closed for maintenance"),
        "{e}"
    );
    assert_eq!(calls.load(Ordering::Acquire), 3);
    assert!(!exists(&raw, "made").await);

    pool.close();
    // Best effort: the server is a throwaway one.
    let _ = raw
        .batch_execute(&format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""))
        .await;
}
