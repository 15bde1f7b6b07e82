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

            /// `db`'s connect options, without `.pgpass`.
            fn options(db: &pgwarden_testing::TestDb) -> PgConnectOptions {
                sqlx_options!($sqlx, db.pg_config())
            }

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
                let opts = options(&db);
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

            #[test]
            fn connections_made_on_a_dropped_runtime_are_let_go_at_their_next_checkout() {
                // sqlx's socket is its runtime's: once that runtime is
                // gone, a statement on the connection fails with tokio's
                // `being shutdown` error, or never ends. sqlx's ping
                // before a hand-out caught it now and then; with it off
                // every such connection was handed out (the hostile
                // reader's F3 and a flaky renewal test, stop 47).
                let rt = current_thread();
                let db = rt.block_on(support::db());
                let opts = options(&db);
                let pool = {
                    let _in_rt = rt.enter();
                    let pg = PgPoolOptions::new()
                        .max_connections(4)
                        .test_before_acquire(false)
                        .connect_lazy_with(opts);
                    $($pg)::+::Pool::builder(pg)
                        .pooler(PoolerMode::Direct)
                        .build()
                        .unwrap()
                };
                // Three connections made on a runtime that is then dropped.
                let gone = current_thread();
                let pids = gone.block_on(async {
                    let mut held = Vec::new();
                    for _ in 0..3 {
                        held.push(pool.acquire().await.unwrap());
                    }
                    let mut pids = Vec::new();
                    for c in &mut held {
                        pids.push(
                            $sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
                                .fetch_one(&mut **c)
                                .await
                                .unwrap(),
                        );
                    }
                    drop(held);
                    // Back in sqlx's pool, idle (a sqlx return is a task).
                    support::eventually(Duration::from_secs(10), "three idle connections", || {
                        std::future::ready(pool.num_idle() == 3)
                    })
                    .await;
                    pids
                });
                drop(gone);
                // On another runtime, every checkout's statement runs, on
                // connections made here.
                rt.block_on(async {
                    for _ in 0..6 {
                        let mut c = tokio::time::timeout(Duration::from_secs(10), pool.acquire())
                            .await
                            .expect("a checkout within 10 s")
                            .unwrap();
                        let pid = tokio::time::timeout(
                            Duration::from_secs(10),
                            $sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()").fetch_one(&mut *c),
                        )
                        .await
                        .expect("an answer within 10 s")
                        .unwrap();
                        assert!(!pids.contains(&pid), "a connection of the dropped runtime was handed out");
                    }
                    pool.close().await;
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
