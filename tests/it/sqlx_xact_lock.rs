//! `pgwarden::sqlx::xact_lock`: a transaction-scoped advisory lock on the
//! caller's own sqlx transaction (pgwarden's `pool.begin()`, or sqlx's own
//! `begin` on a checked-out connection), on sqlx 0.8 and 0.9 from one
//! source (a module per version, made by `xact!`). The deadpool side's
//! `pgwarden::xact_lock` is tested in `xact.rs`; both run the same
//! statement.

#![cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]

macro_rules! xact {
    ($version:ident, $sqlx:ident, $backend:ident, $($pg:ident)::+) => {
        mod $version {
            use crate::support;

            use std::time::Duration;

            use pgwarden::{Error, InvalidInput, LockError, LockKey, LockMode, PoolerMode};
            use pgwarden_testing::PoolMode;
            use support::backend::{Backend, Settings};
            use support::{db, free};

            use $($pg)::+::xact_lock;

            type B = support::backend::$backend;

            const T: Duration = Duration::from_secs(10);

            /// `SELECT 1` in the transaction: whether it is still usable
            /// (not aborted).
            async fn usable(c: &mut $sqlx::PgConnection) -> Result<(), $sqlx::Error> {
                $sqlx::query("SELECT 1").execute(c).await.map(drop)
            }

            /// Granted in pgwarden's own transaction (`pool.begin()`),
            /// tried once and waited for: held while the transaction is
            /// open (another session cannot take it), released at COMMIT.
            #[tokio::test]
            async fn granted_and_released_at_commit() {
                let db = db().await;
                let raw = db.connect().await.unwrap();
                let pool = B::build(&db, &Settings::new("sqlx-xact-commit", 4));
                let (a, b) = (LockKey::Pair(31, 1), LockKey::Single(3102));
                let mut tx = pool.begin().await.unwrap();
                assert!(xact_lock(&mut tx, a, LockMode::Exclusive, None).await.unwrap());
                assert!(xact_lock(&mut tx, b, LockMode::Shared, Some(T)).await.unwrap());
                assert!(!free(&raw, a).await, "held while the transaction is open");
                assert!(!free(&raw, b).await, "held while the transaction is open");
                tx.commit().await.unwrap();
                assert!(free(&raw, a).await, "released at commit");
                assert!(free(&raw, b).await, "released at commit");
            }

            /// On sqlx's own transaction on a checked-out connection
            /// (`sqlx::Connection::begin`): released at ROLLBACK.
            #[tokio::test]
            async fn on_sqlx_own_transaction_released_at_rollback() {
                let db = db().await;
                let raw = db.connect().await.unwrap();
                let pool = B::build(&db, &Settings::new("sqlx-xact-rollback", 4));
                let key = LockKey::Single(3103);
                let mut conn = pool.acquire().await.unwrap();
                let mut tx = $sqlx::Connection::begin(&mut *conn).await.unwrap();
                assert!(xact_lock(&mut tx, key, LockMode::Exclusive, Some(T)).await.unwrap());
                assert!(!free(&raw, key).await, "held while the transaction is open");
                tx.rollback().await.unwrap();
                assert!(free(&raw, key).await, "released at rollback");
            }

            /// Held by another session: a single try answers false at
            /// once and leaves the transaction usable; a wait that runs
            /// out is `LockError::Timeout` and PostgreSQL has aborted the
            /// transaction.
            #[tokio::test]
            async fn refused_on_a_try_and_timed_out_on_a_wait() {
                let db = db().await;
                let raw = db.connect().await.unwrap();
                let key = LockKey::Pair(31, 4);
                raw.execute("SELECT pg_advisory_lock(31, 4)", &[]).await.unwrap();
                let pool = B::build(&db, &Settings::new("sqlx-xact-refused", 4));

                let mut tx = pool.begin().await.unwrap();
                let got = xact_lock(&mut tx, key, LockMode::Exclusive, None).await.unwrap();
                assert!(!got, "held by another session");
                usable(&mut tx).await.expect("a refused try does not abort the transaction");

                let wait = Duration::from_millis(100);
                let e = xact_lock(&mut tx, key, LockMode::Exclusive, Some(wait))
                    .await
                    .unwrap_err();
                assert!(
                    matches!(e, Error::Lock(LockError::Timeout { key: k, timeout }) if k == key && timeout == wait),
                    "{e}"
                );
                let aborted = usable(&mut tx).await.unwrap_err();
                let code = aborted.as_database_error().and_then(|d| d.code().map(|c| c.into_owned()));
                assert_eq!(code.as_deref(), Some("25P02"), "{aborted}");
                drop(tx);
            }

            /// Outside a transaction a transaction-scoped lock would be
            /// released with its own statement: refused before anything
            /// is sent, with the error that says so.
            #[tokio::test]
            async fn refused_outside_a_transaction() {
                let db = db().await;
                let raw = db.connect().await.unwrap();
                let pool = B::build(&db, &Settings::new("sqlx-xact-outside", 4));
                let key = LockKey::Single(3105);
                let mut conn = pool.acquire().await.unwrap();
                let e = xact_lock(&mut conn, key, LockMode::Exclusive, None)
                    .await
                    .unwrap_err();
                assert!(
                    matches!(e, Error::Invalid(InvalidInput::NoTransaction { .. })),
                    "{e}"
                );
                assert!(free(&raw, key).await);
            }

            /// Through PgBouncer in transaction mode (one server
            /// connection for every client, statements unnamed): granted,
            /// held while the transaction is open, released at COMMIT.
            #[tokio::test]
            async fn works_behind_a_transaction_pgbouncer() {
                let db = db().await;
                let Some(bouncer) = support::pooler::bouncer(&db, 1, PoolMode::Transaction) else {
                    return;
                };
                let raw = db.connect().await.unwrap();
                let s = Settings::new("sqlx-xact-bouncer", 4).pooler(PoolerMode::Transaction);
                let pool = B::build_through(&bouncer, &s);
                let key = LockKey::Pair(31, 6);
                let mut tx = pool.begin().await.unwrap();
                assert!(xact_lock(&mut tx, key, LockMode::Exclusive, None).await.unwrap());
                assert!(!free(&raw, key).await, "held while the transaction is open");
                assert!(
                    xact_lock(&mut tx, key, LockMode::Exclusive, Some(T)).await.unwrap(),
                    "taken again by its own transaction"
                );
                tx.commit().await.unwrap();
                assert!(free(&raw, key).await, "released at commit");
            }
        }
    };
}

#[cfg(all(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
xact!(v0_8, sqlx08, Sqlx08, pgwarden::sqlx_0_8);
#[cfg(all(feature = "sqlx-0_8", not(feature = "sqlx-0_9")))]
xact!(v0_8, sqlx08, Sqlx08, pgwarden::sqlx);
#[cfg(feature = "sqlx-0_9")]
xact!(v0_9, sqlx09, Sqlx09, pgwarden::sqlx);
