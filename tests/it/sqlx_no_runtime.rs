//! pgwarden's sqlx pool (sqlx 0.8 and 0.9) after its runtime is gone: a
//! session-lock guard and a connection dropped outside any runtime, from a
//! pool that keeps `min_connections` (sqlx's drop then spawns a task, and
//! panics without a runtime). No panic: the guard's connection is closed
//! (its lock gone from `pg_locks`) and the admissions come back. Both
//! drops panicked and the lock stayed held before pgwarden gave sqlx a
//! throwaway runtime to spawn on.

#![cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]

macro_rules! no_runtime {
    ($version:ident, $sqlx:ident, $($pg:ident)::+) => {
        mod $version {
            use crate::support;

            use std::time::Duration;

            use $sqlx::postgres::{PgConnectOptions, PgPoolOptions};
            use pgwarden::{LockKey, LockMode, PoolerMode};

            fn current_thread() -> tokio::runtime::Runtime {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap()
            }

            #[test]
            fn a_guard_and_a_connection_dropped_outside_a_runtime_close_without_panicking() {
                // The test's own runtime (the database, the checks) outlives
                // the pool's.
                let rt = current_thread();
                let db = rt.block_on(support::db());
                let raw = rt.block_on(db.connect()).unwrap();
                let (host, socket, port, user, dbname) = support::backend::sqlx_target(&db.pg_config());
                let mut opts = PgConnectOptions::new_without_pgpass()
                    .port(port)
                    .username(&user)
                    .database(&dbname);
                if let Some(h) = host {
                    opts = opts.host(&h);
                }
                if let Some(s) = socket {
                    opts = opts.socket(s);
                }
                let key = LockKey::Single(9101);
                let pools = current_thread();
                let (pool, lock, conn) = pools.block_on(async {
                    let pg = PgPoolOptions::new()
                        .max_connections(4)
                        .min_connections(1)
                        .connect_lazy_with(opts);
                    let pool = $($pg)::+::Pool::builder(pg)
                        .pooler(PoolerMode::Direct)
                        .build()
                        .unwrap();
                    let lock = pool.session_lock(key, LockMode::Exclusive, None).await;
                    let lock = lock.unwrap().expect("a free key");
                    let conn = pool.acquire().await.unwrap();
                    (pool, lock, conn)
                });
                let pid = lock.client().pid();
                drop(pools);
                assert!(tokio::runtime::Handle::try_current().is_err());
                drop(lock);
                drop(conn);
                assert_eq!(pool.status().in_use, 0, "{:?}", pool.status());
                drop(pool);
                rt.block_on(async {
                    support::eventually(Duration::from_secs(30), "the lock's session ended", || {
                        let raw = &raw;
                        async move { !support::alive(raw, pid).await }
                    })
                    .await;
                    assert!(support::raw_locks(&raw).await.is_empty());
                });
            }
        }
    };
}

#[cfg(all(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
no_runtime!(v0_8, sqlx08, pgwarden::sqlx_0_8);
#[cfg(all(feature = "sqlx-0_8", not(feature = "sqlx-0_9")))]
no_runtime!(v0_8, sqlx08, pgwarden::sqlx);
#[cfg(feature = "sqlx-0_9")]
no_runtime!(v0_9, sqlx09, pgwarden::sqlx);
