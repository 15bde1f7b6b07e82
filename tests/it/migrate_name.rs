//! `migrate_once` (issue 16, point 11): a name that could not be recorded
//! is refused before anything runs, and a migration that ran but could not
//! be recorded says so (`LockError::MigrationNotRecorded`), with whether its
//! transaction was rolled back. On every backend.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgwarden::{Error, InvalidInput, LockError, NameRule, PoolerMode};
use support::backend::{Backend, Settings};
use support::*;

const T: Duration = Duration::from_secs(10);

/// Runs `migrate_once(name)` with a closure that counts its calls and
/// creates table `made` ([`Backend::migrate`]): whether it ran.
async fn migrate<B: Backend>(
    pool: &B::Pool,
    name: &str,
    calls: &Arc<AtomicUsize>,
) -> Result<bool, Error> {
    let name: &'static str = Box::leak(name.to_owned().into_boxed_str());
    B::migrate(pool, name, T, calls.clone()).await
}

async fn exists(c: &tokio_postgres::Client, table: &str) -> bool {
    c.query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
        .await
        .unwrap()
        .get(0)
}

backends!(a_name_that_cannot_be_recorded_is_refused_before_anything_runs);
async fn a_name_that_cannot_be_recorded_is_refused_before_anything_runs<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("migrate-names", 2));
    let raw = admin(&db).await;
    let calls = Arc::new(AtomicUsize::new(0));

    let long = "x".repeat(10_000);
    let e = migrate::<B>(&pool, &long, &calls).await.unwrap_err();
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
    let e = migrate::<B>(&pool, "x\0y", &calls).await.unwrap_err();
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
    let e = migrate::<B>(&pool, "", &calls).await.unwrap_err();
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
    assert!(migrate::<B>(&pool, &longest, &calls).await.unwrap(), "ran");
    assert!(
        !migrate::<B>(&pool, &longest, &calls).await.unwrap(),
        "skipped"
    );
    assert_eq!(calls.load(Ordering::Acquire), 1);
}

backends!(a_migration_that_ran_but_was_not_recorded_says_so);
/// A role that may read the ledger but not write it: the work runs, the
/// record fails, the error says the work ran and its transaction was rolled
/// back, and the next call runs it again.
async fn a_migration_that_ran_but_was_not_recorded_says_so<B: Backend>() {
    let db = db().await;
    let raw = admin(&db).await;
    let role = format!("{}_migrator", db.name());
    // The ledger exists (made by the owner's own pool); the role may read it
    // and create tables, not insert.
    let owner = B::build(&db, &Settings::new("migrate-owner", 2));
    let calls = Arc::new(AtomicUsize::new(0));
    assert!(migrate::<B>(&owner, "owner/0001", &calls).await.unwrap());
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
    let pool = B::build_on(
        &cfg,
        &Settings::new("migrator", 2).pooler(PoolerMode::Direct),
    );

    let calls = Arc::new(AtomicUsize::new(0));
    for run in 1..=2 {
        let e = migrate::<B>(&pool, "app/0002", &calls).await.unwrap_err();
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
        assert_eq!(B::code(source).as_deref(), Some("42501"), "{source:?}");
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
    let e = migrate::<B>(&owner, "owner/0003", &calls)
        .await
        .unwrap_err();
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

    B::close(&pool).await;
    // Best effort: the server is a throwaway one.
    let _ = raw
        .batch_execute(&format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""))
        .await;
}
