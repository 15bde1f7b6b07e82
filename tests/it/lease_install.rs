//! Installing the lease table against a real PostgreSQL: idempotent and
//! race-free, the same as sql/leases.sql, and a table of another shape is a
//! typed error that names what differs, at install and at first use.

use crate::support;

use std::time::Duration;

use pgwarden::{Error, LeaseError, LeaseOptions};
use support::backend::{Backend, LeaseSettings, Settings};
use support::{admin, db};
use tokio_postgres::types::Type;

const S: Duration = Duration::from_secs(1);

backends!(install_is_idempotent_race_free_and_matches_the_sql_file);
async fn install_is_idempotent_race_free_and_matches_the_sql_file<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    admin.batch_execute("CREATE SCHEMA app").await.unwrap();
    let pool = B::build(&db, &Settings::new("install", 6));
    // Four instances starting together.
    let app_leases = LeaseSettings::default().table("app.leases");
    let all: Vec<B::Leases> = (0..4)
        .map(|_| B::leases_with(&pool, &app_leases).unwrap())
        .collect();
    let ran = futures_util::future::join_all(all.iter().map(|l| B::install(l))).await;
    let ran: Vec<bool> = ran.into_iter().map(|r| r.expect("install")).collect();
    assert!(ran.contains(&true), "{ran:?}");
    assert!(
        !B::install(&all[0]).await.unwrap(),
        "second install is a no-op"
    );

    // sql/leases.sql, run by hand, makes the same table.
    admin
        .batch_execute(include_str!("../../sql/leases.sql"))
        .await
        .unwrap();
    let columns = |schema: &'static str, table: &'static str| {
        let admin = &admin;
        async move {
            admin
                .query_typed(
                    "SELECT column_name::text, data_type::text, is_nullable::text, coalesce(column_default, '')::text
                       FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2
                      ORDER BY ordinal_position",
                    &[(&schema, Type::TEXT), (&table, Type::TEXT)],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1), r.get::<_, String>(2), r.get::<_, String>(3)))
                .collect::<Vec<_>>()
        }
    };
    let a = columns("app", "leases").await;
    assert_eq!(a.len(), 8, "{a:?}");
    assert_eq!(a, columns("public", "pgwarden_leases").await);
    // Logged (survives failover), sequence owned by the table.
    let r = admin
        .query_typed_one(
            "SELECT c.relpersistence::text, s.seqcache, s.seqtypid::regtype::text
               FROM pg_class c, pg_sequence s
              WHERE c.oid = 'app.leases'::regclass AND s.seqrelid = 'app.leases_token_seq'::regclass",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.get::<_, String>(0), "p");
    assert_eq!(r.get::<_, i64>(1), 1);
    assert_eq!(r.get::<_, String>(2), "bigint");
    // And the schema-qualified table works.
    let lease = B::acquire(&all[1], "x", &LeaseOptions::new(2 * S), None)
        .await
        .unwrap()
        .unwrap();
    B::release(lease).await.unwrap();
}

/// The differences an install check reports, or a panic.
fn differences(e: Error) -> Vec<String> {
    match e {
        Error::Lease(LeaseError::TableMismatch { differences, .. }) => differences,
        other => panic!("expected a shape mismatch, got {other}"),
    }
}

backends!(a_table_of_another_shape_is_a_typed_error);
async fn a_table_of_another_shape_is_a_typed_error<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let pool = B::build(&db, &Settings::new("shape", 3));
    let table_of = |table: &str| B::leases_with(&pool, &LeaseSettings::default().table(table));
    let cases: [(&str, &str, &[&str]); 4] = [
        (
            "wrong_types",
            "CREATE TABLE wrong_types (name varchar(64) PRIMARY KEY, holder text NOT NULL,
               token integer NOT NULL, taken_at timestamptz NOT NULL, expires_at timestamp NOT NULL,
               held_until timestamptz NOT NULL, prev_holder text);
             CREATE SEQUENCE wrong_types_token_seq AS bigint OWNED BY wrong_types.token",
            &[
                "column name is character varying(64), expected text",
                "column token is integer, expected bigint",
                "column expires_at is timestamp without time zone, expected timestamp with time zone",
            ],
        ),
        (
            "no_key",
            "CREATE TABLE no_key (name text NOT NULL, holder text NOT NULL, token bigint NOT NULL,
               taken_at timestamptz NOT NULL, expires_at timestamptz NOT NULL,
               held_until timestamptz NOT NULL, prev_holder text);
             CREATE SEQUENCE no_key_token_seq AS bigint OWNED BY no_key.token",
            &["there is no primary key (expected PRIMARY KEY (name))"],
        ),
        (
            "missing",
            "CREATE TABLE missing (name text PRIMARY KEY, holder text NOT NULL, expires_at timestamptz NOT NULL);
             CREATE SEQUENCE missing_token_seq AS integer",
            &[
                "column token (bigint) is missing",
                "column taken_at (timestamp with time zone) is missing",
                "column held_until (timestamp with time zone) is missing",
                "column prev_holder (text) is missing",
                "the token sequence \"public\".\"missing_token_seq\" is integer, expected bigint",
            ],
        ),
        (
            "other_key",
            "CREATE TABLE other_key (name text, holder text NOT NULL, token bigint NOT NULL,
               taken_at timestamptz NOT NULL, expires_at timestamptz NOT NULL,
               held_until timestamptz NOT NULL, prev_holder text NOT NULL, PRIMARY KEY (name, holder));
             CREATE SEQUENCE other_key_token_seq AS bigint OWNED BY other_key.token",
            &[
                "the primary key is (name, holder), expected (name)",
                "column prev_holder is NOT NULL, it must allow NULL",
            ],
        ),
    ];
    for (table, ddl, expected) in cases {
        admin.batch_execute(ddl).await.unwrap();
        let leases = table_of(table).unwrap();
        let err = B::install(&leases).await.unwrap_err();
        assert!(
            matches!(
                err,
                pgwarden::Error::Lease(pgwarden::LeaseError::TableMismatch { .. })
            ),
            "{err}"
        );
        let text = err.to_string();
        assert!(text.contains(table), "{text}");
        let found = differences(err);
        for want in expected {
            assert!(
                found.iter().any(|d| d == want),
                "{table}: {want:?} not in {found:?}"
            );
        }
        assert_eq!(found.len(), expected.len(), "{table}: {found:?}");
        // At first use too (auto_install is on by default), before any
        // acquisition statement.
        let fresh = table_of(table).unwrap();
        let err = B::acquire(&fresh, "x", &LeaseOptions::new(S), None)
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                pgwarden::Error::Lease(pgwarden::LeaseError::TableMismatch { .. })
            ),
            "{err}"
        );
        eprintln!("{table}: {err}");
    }
    // A table without its sequence: install creates the sequence, and the
    // table then fits.
    admin
        .batch_execute(&B::lease_ddl(&table_of("seqless").unwrap()))
        .await
        .unwrap();
    admin
        .batch_execute("DROP SEQUENCE seqless_token_seq CASCADE")
        .await
        .unwrap();
    let leases = table_of("seqless").unwrap();
    assert!(B::install(&leases).await.unwrap(), "the DDL ran");
    let lease = B::acquire(&leases, "x", &LeaseOptions::new(S), None)
        .await
        .unwrap()
        .unwrap();
    B::release(lease).await.unwrap();
}

/// The name's collation, as the catalog says (`C`, or the database's
/// default: `default`).
async fn name_collation(admin: &tokio_postgres::Client, table: &str) -> String {
    admin
        .query_one(
            "SELECT c.collname::text FROM pg_attribute a JOIN pg_collation c ON c.oid = a.attcollation
              WHERE a.attrelid = $1::text::regclass AND a.attname = 'name'",
            &[&table],
        )
        .await
        .unwrap()
        .get(0)
}

backends!(names_compare_bytewise_and_a_table_made_without_it_still_works);
async fn names_compare_bytewise_and_a_table_made_without_it_still_works<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    admin.batch_execute("CREATE SCHEMA old").await.unwrap();
    // Made by install() and by the shipped file: COLLATE "C".
    let pool = B::build(&db, &Settings::new("collation", 3));
    let leases = B::leases(&pool);
    assert!(B::install(&leases).await.unwrap());
    assert_eq!(name_collation(&admin, "public.pgwarden_leases").await, "C");
    let file = include_str!("../../sql/leases.sql")
        .replace("\"public\".\"pgwarden_leases", "\"app\".\"f_leases");
    admin.batch_execute("CREATE SCHEMA app").await.unwrap();
    admin.batch_execute(&file).await.unwrap();
    assert_eq!(name_collation(&admin, "app.f_leases").await, "C");

    // A table made before (the database's collation): the shape fits, and
    // names that sort differently under the two collations lease and
    // release as before.
    let before = include_str!("../../sql/leases.sql")
        .replace("COLLATE \"C\" ", "")
        .replace("\"public\".\"pgwarden_leases", "\"old\".\"leases");
    admin.batch_execute(&before).await.unwrap();
    assert_eq!(name_collation(&admin, "old.leases").await, "default");
    let old = B::leases_with(&pool, &LeaseSettings::default().table("old.leases")).unwrap();
    assert!(
        !B::install(&old).await.unwrap(),
        "the table exists: nothing to run"
    );
    for name in ["b", "B", "é", "e"] {
        for l in [&leases, &old] {
            let lease = B::acquire(l, name, &LeaseOptions::new(S * 30), None)
                .await
                .unwrap()
                .expect("a new name is free");
            assert!(
                B::acquire(l, name, &LeaseOptions::new(S * 30), None)
                    .await
                    .unwrap()
                    .is_none(),
                "{name} is held"
            );
            B::release(lease).await.unwrap();
        }
    }
}
