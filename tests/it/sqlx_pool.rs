//! `pgwarden::sqlx::Pool` as a drop-in for `sqlx::PgPool`, on sqlx 0.8 and
//! 0.9 from one source (a module per version, made by `dropin!`): code
//! written against `PgPool` (its executor, `acquire`, `begin`, `close`,
//! `size`, `num_idle`, `is_closed`) runs against pgwarden's pool, and
//! sqlx's asynchronous return (the `after_release` hook, then the ping)
//! is counted as in use until it is done: an admitted checkout never waits
//! inside sqlx for it.

#![cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]

macro_rules! dropin {
    ($version:ident, $sqlx:ident, $($pg:ident)::+) => {
        mod $version {
            use crate::support;

            use std::sync::atomic::{AtomicUsize, Ordering};
            use std::sync::Arc;
            use std::time::Duration;

            use $sqlx::postgres::PgPoolOptions;
            use $sqlx::Row as _;
            use futures_util::TryStreamExt as _;
            use pgwarden::{CheckoutError, Error, Lane, Stage};
            use pgwarden_testing::TestDb;
            use support::{db, eventually, within};

            // The adopter's code: written against sqlx's pool, with only
            // this `use` line changed.
            use $($pg)::+::Pool;

            const GUARD: Duration = Duration::from_secs(60);

            fn build(db: &TestDb, opts: PgPoolOptions, name: &str) -> Pool {
                Pool::builder(opts.connect_lazy_with(sqlx_options!($sqlx, db.pg_config())))
                    .name(format!("{name}-{}", stringify!($version)))
                    .wait_timeout(Duration::from_secs(5))
                    .build()
                    .unwrap()
            }

            async fn settled(pool: &Pool) {
                eventually(GUARD, "nothing in use", || {
                    let s = pool.status();
                    std::future::ready(s.in_use == 0 && s.waiting == 0)
                })
                .await
            }

            /// `&pool` is an executor: execute, fetch_one, fetch_optional,
            /// fetch_all, query_as, query_scalar, and a stream dropped
            /// half-read; each on a request-lane checkout that goes back.
            #[tokio::test]
            async fn the_pool_is_an_executor() {
                let db = db().await;
                let pool = build(&db, PgPoolOptions::new().max_connections(3), "exec");
                $sqlx::query("CREATE TABLE items (id int8 PRIMARY KEY, name text NOT NULL)")
                    .execute(&pool)
                    .await
                    .unwrap();
                let done = $sqlx::query("INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, 50) g")
                    .execute(&pool)
                    .await
                    .unwrap();
                assert_eq!(done.rows_affected(), 50);
                let row = $sqlx::query("SELECT name FROM items WHERE id = $1")
                    .bind(7_i64)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                assert_eq!(row.get::<String, _>(0), "item 7");
                let none = $sqlx::query("SELECT 1 FROM items WHERE id = 0")
                    .fetch_optional(&pool)
                    .await
                    .unwrap();
                assert!(none.is_none());
                let all: Vec<(i64, String)> =
                    $sqlx::query_as("SELECT id, name FROM items WHERE id <= 3 ORDER BY id")
                        .fetch_all(&pool)
                        .await
                        .unwrap();
                assert_eq!(all, vec![(1, "item 1".into()), (2, "item 2".into()), (3, "item 3".into())]);
                let n: i64 = $sqlx::query_scalar("SELECT count(*) FROM items")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                assert_eq!(n, 50);
                // A stream read in part, then dropped: its connection goes
                // back. (The returns above finish first: each is counted
                // in use until sqlx has its connection back.)
                settled(&pool).await;
                {
                    let mut rows = $sqlx::query("SELECT id FROM items ORDER BY id").fetch(&pool);
                    let first = rows.try_next().await.unwrap().unwrap();
                    assert_eq!(first.get::<i64, _>(0), 1);
                    assert_eq!(pool.status().lane(Lane::Request).in_use, 1);
                }
                settled(&pool).await;
                // An error comes back as sqlx's, its connection back too.
                let e = $sqlx::query("SELECT * FROM no_such_table")
                    .execute(&pool)
                    .await
                    .unwrap_err();
                assert!(matches!(e, $sqlx::Error::Database(_)), "{e:?}");
                settled(&pool).await;
                // Every statement came through pgwarden's request lane:
                // never more than the sqlx pool's connections.
                assert!(pool.size() <= 3, "{}", pool.size());
            }

            /// `begin`: commit keeps, rollback and drop undo, and the
            /// connection comes back out of its transaction.
            #[tokio::test]
            async fn begin_commit_rollback_and_drop() {
                let db = db().await;
                // One request connection: every step reuses it.
                let pool = build(&db, PgPoolOptions::new().max_connections(2), "tx");
                $sqlx::query("CREATE TABLE t (v int4)").execute(&pool).await.unwrap();
                let mut tx = pool.begin().await.unwrap();
                $sqlx::query("INSERT INTO t VALUES (1)").execute(&mut *tx).await.unwrap();
                tx.commit().await.unwrap();
                let mut tx = pool.begin().await.unwrap();
                $sqlx::query("INSERT INTO t VALUES (2)").execute(&mut *tx).await.unwrap();
                tx.rollback().await.unwrap();
                {
                    let mut tx = pool.begin().await.unwrap();
                    $sqlx::query("INSERT INTO t VALUES (3)").execute(&mut *tx).await.unwrap();
                    // Dropped open.
                }
                settled(&pool).await;
                let vs: Vec<i32> = $sqlx::query_scalar("SELECT v FROM t ORDER BY v")
                    .fetch_all(&pool)
                    .await
                    .unwrap();
                assert_eq!(vs, vec![1]);
                // The connection is out of any transaction.
                let mut c = pool.acquire().await.unwrap();
                let state: String = $sqlx::query_scalar(
                    "SELECT state FROM pg_stat_activity WHERE pid = pg_backend_pid()",
                )
                .fetch_one(&mut *c)
                .await
                .unwrap();
                assert_eq!(state, "active");
                let depth: i64 = $sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
                )
                .fetch_one(&mut *c)
                .await
                .unwrap();
                assert_eq!(depth, 0, "a connection left in a transaction");
            }

            /// `acquire` derefs to `PgConnection`; `close` fails waiters and
            /// new checkouts with `PoolClosed`; `size`, `num_idle`,
            /// `is_closed` are sqlx's.
            #[tokio::test]
            async fn acquire_derefs_and_close_closes() {
                let db = db().await;
                let pool = build(&db, PgPoolOptions::new().max_connections(2), "close");
                let mut c = pool.acquire().await.unwrap();
                let conn: &mut $sqlx::PgConnection = &mut c;
                let one: i32 = $sqlx::query_scalar("SELECT 1").fetch_one(conn).await.unwrap();
                assert_eq!(one, 1);
                assert_eq!(c.lane(), Lane::Request);
                assert_eq!((pool.size(), pool.num_idle()), (1, 0));
                // A waiter (the request lane holds one) fails when the pool closes.
                let waiter = {
                    let pool = pool.clone();
                    tokio::spawn(async move { pool.acquire().await.map(drop) })
                };
                eventually(GUARD, "the waiter queues", || {
                    std::future::ready(pool.status().waiting == 1)
                })
                .await;
                let closing = {
                    let pool = pool.clone();
                    tokio::spawn(async move { pool.close().await })
                };
                let e = within(GUARD, "the waiter's answer", waiter).await.unwrap().unwrap_err();
                assert!(matches!(e, $sqlx::Error::PoolClosed), "{e:?}");
                assert!(pool.is_closed());
                let e = pool.acquire().await.unwrap_err();
                assert!(matches!(e, $sqlx::Error::PoolClosed), "{e:?}");
                // sqlx's close waits for the connection out.
                drop(c);
                within(GUARD, "close, once the connection is back", closing).await.unwrap();
                assert_eq!(pool.size(), 0);
            }

            /// A tiny pool, many tasks: executor calls, acquires, streams
            /// and transactions, each dropped at a point of its own (a
            /// timeout racing it, after one poll, mid-stream), while a
            /// task terminates the pool's backends with
            /// `pg_terminate_backend`. Afterwards nothing is in use or
            /// waiting, sqlx has no more connections than its maximum, the
            /// pids pgwarden reports are the backends', no connection is
            /// left in a transaction, and the pool serves at once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn cancelled_everywhere_with_backends_killed_leaves_no_trace() {
                use futures_util::FutureExt as _;
                const TASKS: u64 = 16;
                const ROUNDS: u64 = 60;
                let db = db().await;
                let pool = build(&db, PgPoolOptions::new().max_connections(3), "hostile");
                $sqlx::query("CREATE TABLE h (v int8)").execute(&pool).await.unwrap();
                let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
                let killer = {
                    let (stop, admin) = (stop.clone(), support::admin(&db).await);
                    tokio::spawn(async move {
                        let mut killed = 0u32;
                        while !stop.load(Ordering::SeqCst) || killed == 0 {
                            killed += admin
                                .query(
                                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                                     WHERE datname = current_database() AND pid <> pg_backend_pid() \
                                     AND application_name = '' LIMIT 1",
                                    &[],
                                )
                                .await
                                .unwrap()
                                .len() as u32;
                            tokio::time::sleep(Duration::from_millis(15)).await;
                        }
                        killed
                    })
                };
                let tasks: Vec<_> = (0..TASKS)
                    .map(|t| {
                        let pool = pool.clone();
                        tokio::spawn(async move {
                            let mut x = t.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                            let mut next = move || {
                                x ^= x << 13;
                                x ^= x >> 7;
                                x ^= x << 17;
                                x
                            };
                            for _ in 0..ROUNDS {
                                let wait = Duration::from_micros(next() % 3_000);
                                // Errors are expected here (a backend killed
                                // under a statement): only hangs and leaks
                                // are not.
                                match next() % 5 {
                                    0 => {
                                        let q = $sqlx::query("INSERT INTO h VALUES (1)").execute(&pool);
                                        let _ = tokio::time::timeout(wait, q).await;
                                    }
                                    1 => {
                                        let mut a = Box::pin(pool.acquire());
                                        if (&mut a).now_or_never().is_none() {
                                            tokio::task::yield_now().await;
                                        }
                                    }
                                    2 => {
                                        let mut rows = $sqlx::query("SELECT generate_series(1, 100)").fetch(&pool);
                                        let _ = tokio::time::timeout(wait, rows.try_next()).await;
                                    }
                                    3 => {
                                        let tx = async {
                                            let mut tx = pool.begin().await?;
                                            $sqlx::query("INSERT INTO h VALUES (2)").execute(&mut *tx).await?;
                                            tokio::task::yield_now().await;
                                            tx.commit().await
                                        };
                                        let _ = tokio::time::timeout(wait, tx).await;
                                    }
                                    _ => {
                                        if let Ok(Ok(mut c)) = tokio::time::timeout(wait, pool.acquire()).await {
                                            let pid: Result<i32, _> = $sqlx::query_scalar("SELECT pg_backend_pid()")
                                                .fetch_one(&mut *c)
                                                .await;
                                            if let Ok(pid) = pid {
                                                assert_eq!(pid, c.pid(), "the pid pgwarden knows");
                                            }
                                        }
                                    }
                                }
                            }
                        })
                    })
                    .collect();
                for t in tasks {
                    within(GUARD, "a task (a checkout hung)", t).await.unwrap();
                }
                stop.store(true, Ordering::SeqCst);
                let killed = within(GUARD, "the killer", killer).await.unwrap();
                assert!(killed > 0, "no backend was terminated: nothing was tried");
                settled(&pool).await;
                assert!(pool.size() <= 3, "sqlx holds {} connections", pool.size());
                // A backend terminated while its connection was idle is
                // found dead at that connection's next use (as with sqlx
                // alone), then closed: use the lane's two connections
                // together until both answer.
                eventually(GUARD, "only live connections left", || async {
                    // A checkout whose new connection was terminated as it
                    // was named fails too (sqlx's error, as its statement's
                    // would have).
                    let (a, b) = (pool.acquire().await, pool.acquire().await);
                    let ok = match (a, b) {
                        (Ok(mut a), Ok(mut b)) => {
                            let a_ok = $sqlx::query("SELECT 1").execute(&mut *a).await.is_ok();
                            a_ok && $sqlx::query("SELECT 1").execute(&mut *b).await.is_ok()
                        }
                        _ => false,
                    };
                    settled(&pool).await;
                    ok
                })
                .await;
                // Every connection the request lane can hold, together, at
                // once: none kept by a checkout given up, none in a
                // transaction, each pid its own backend's.
                let mut held = Vec::new();
                for _ in 0..2 {
                    let mut c = within(Duration::from_secs(10), "a connection", pool.acquire())
                        .await
                        .unwrap();
                    let (pid, in_tx): (i32, bool) = $sqlx::query_as(
                        "SELECT pg_backend_pid(), state LIKE 'idle in transaction%' \
                         FROM pg_stat_activity WHERE pid = pg_backend_pid()",
                    )
                    .fetch_one(&mut *c)
                    .await
                    .unwrap();
                    assert_eq!(pid, c.pid());
                    assert!(!in_tx);
                    held.push(c);
                }
                drop(held);
                settled(&pool).await;
                // Closed mid-checkout: waiters end, nothing hangs.
                let hold = pool.acquire().await.unwrap();
                let hold2 = pool.acquire().await.unwrap();
                let waiters: Vec<_> = (0..4)
                    .map(|_| {
                        let pool = pool.clone();
                        tokio::spawn(async move { pool.acquire().await.map(drop) })
                    })
                    .collect();
                eventually(GUARD, "the waiters queue", || {
                    std::future::ready(pool.status().waiting == 4)
                })
                .await;
                let closing = {
                    let pool = pool.clone();
                    tokio::spawn(async move { pool.close().await })
                };
                for w in waiters {
                    let e = within(GUARD, "a waiter at close", w).await.unwrap().unwrap_err();
                    assert!(matches!(e, $sqlx::Error::PoolClosed), "{e:?}");
                }
                drop((hold, hold2));
                within(GUARD, "close", closing).await.unwrap();
                assert_eq!(pool.size(), 0);
            }

            /// sqlx returns a dropped connection in a task (its
            /// `after_release` hook, a ping). pgwarden counts it in use
            /// until that is done: with the hook held, the next checkout
            /// waits for admission, never inside sqlx, and the hooks the
            /// user set run as before (`before_acquire` too).
            #[tokio::test]
            async fn the_return_is_in_use_until_sqlx_has_it_back() {
                let db = db().await;
                let gate = Arc::new(tokio::sync::Semaphore::new(0));
                let released = Arc::new(AtomicUsize::new(0));
                let acquired = Arc::new(AtomicUsize::new(0));
                let opts = PgPoolOptions::new()
                    .max_connections(2)
                    .after_release({
                        let (gate, released) = (gate.clone(), released.clone());
                        move |_, _| {
                            let (gate, released) = (gate.clone(), released.clone());
                            Box::pin(async move {
                                gate.acquire().await.unwrap().forget();
                                released.fetch_add(1, Ordering::SeqCst);
                                Ok(true)
                            })
                        }
                    })
                    .before_acquire({
                        let acquired = acquired.clone();
                        move |_, _| {
                            acquired.fetch_add(1, Ordering::SeqCst);
                            Box::pin(async { Ok(true) })
                        }
                    });
                let pool = build(&db, opts, "return");
                let a = pool.acquire().await.unwrap();
                let pid = a.pid();
                drop(a);
                // The return waits in the user's hook: still in use.
                let s = pool.status();
                assert_eq!(s.lane(Lane::Request).in_use, 1, "{s}");
                let e = pool
                    .acquire_within(Duration::from_millis(200))
                    .await
                    .unwrap_err();
                match &e {
                    Error::Checkout(CheckoutError::Timeout { stage, .. }) => {
                        assert_eq!(*stage, Stage::Admission, "{e}")
                    }
                    other => panic!("{other:?}"),
                }
                assert_eq!(released.load(Ordering::SeqCst), 0);
                // The hook lets go: the return ends, the connection is idle,
                // and the next checkout gets it (through before_acquire).
                gate.add_permits(1);
                settled(&pool).await;
                assert_eq!(released.load(Ordering::SeqCst), 1);
                let b = within(GUARD, "the next checkout", pool.acquire()).await.unwrap();
                assert_eq!(b.pid(), pid, "the returned connection is reused");
                assert_eq!(acquired.load(Ordering::SeqCst), 1, "before_acquire ran on the idle one");
                drop(b);
                gate.add_permits(1);
                settled(&pool).await;
            }

            /// The leak sweep where sqlx hands out idle connections without
            /// a ping (`test_before_acquire(false)`): the leakers' sessions
            /// are ended on the server, and the dead connection sqlx keeps
            /// idle is discarded by pgwarden's checkout (it was marked),
            /// never handed to the caller: every checkout answers.
            #[tokio::test]
            async fn census_sweep_without_test_before_acquire_hands_out_no_dead_connection() {
                let db = db().await;
                let logs = support::logs();
                let name = format!("census-noping-{}", stringify!($version));
                let opts = PgPoolOptions::new().max_connections(4).test_before_acquire(false);
                let pool = Pool::builder(opts.connect_lazy_with(sqlx_options!($sqlx, db.pg_config())))
                    .name(name.clone())
                    .pooler(pgwarden::PoolerMode::Direct)
                    .census_interval(Some(Duration::from_millis(200)))
                    .build()
                    .unwrap();
                let raw = db.connect().await.unwrap();
                let mut a = pool.acquire().await.unwrap();
                let mut b = pool.acquire().await.unwrap();
                $sqlx::query("SELECT pg_advisory_lock(52)").execute(&mut *a).await.unwrap();
                $sqlx::query("SELECT pg_advisory_lock(53)").execute(&mut *b).await.unwrap();
                let leaked = [a.pid(), b.pid()];
                drop((a, b));
                eventually(GUARD, "both leaking sessions ended", || async {
                    !support::alive(&raw, leaked[0]).await && !support::alive(&raw, leaked[1]).await
                })
                .await;
                // A leaker that was not the census's own connection was
                // ended on the server and marked (when a pass came while
                // the other was still on its way back, each may have been
                // the census's own: closed outright). The census's own
                // checkouts cycle through sqlx's idle queue: the marked
                // dead connection is found and discarded.
                let field = format!("pool={name}");
                let ours = |l: &&str| l.split_whitespace().any(|w| w == field);
                if logs.text().lines().filter(ours).any(|l| l.contains("ended on the server")) {
                    eventually(GUARD, "the marked connection discarded", || {
                        std::future::ready(logs.text().lines().filter(ours).any(|l| {
                            l.contains("discarding a pooled connection that held a leaked")
                        }))
                    })
                    .await;
                } else {
                    eprintln!("{name}: both leakers were the census's own connection");
                }
                let mut held = Vec::new();
                for _ in 0..3 {
                    let mut c = pool.acquire().await.unwrap();
                    assert!(!leaked.contains(&c.pid()));
                    let one: i32 = $sqlx::query_scalar("SELECT 1").fetch_one(&mut *c).await.unwrap();
                    assert_eq!(one, 1);
                    held.push(c);
                }
                drop(held);
                settled(&pool).await;
            }

            /// A server that refuses connections (down, restarting): sqlx
            /// retries until its acquire timeout and answers `PoolTimedOut`.
            /// The drop-in `acquire` says `PoolTimedOut` too, and
            /// `acquire_within` a timeout while connecting; the admission
            /// comes back. Before, both said pgwarden's capacity had been
            /// taken outside it (`DeadpoolMismatch`, "a clone of the wrapped
            /// deadpool pool"), the second after a second acquire timeout.
            #[tokio::test]
            async fn a_server_refusing_connections_is_a_connect_timeout() {
                // A port nothing listens on.
                let port = std::net::TcpListener::bind("127.0.0.1:0")
                    .and_then(|l| l.local_addr())
                    .unwrap()
                    .port();
                let opts = $sqlx::postgres::PgConnectOptions::new_without_pgpass()
                    .host("127.0.0.1")
                    .port(port)
                    .username("postgres");
                let pg = PgPoolOptions::new()
                    .max_connections(4)
                    .acquire_timeout(Duration::from_millis(300))
                    .connect_lazy_with(opts);
                let pool = Pool::builder(pg).build().unwrap();
                let e = within(GUARD, "acquire", pool.acquire()).await.map(drop).unwrap_err();
                assert!(matches!(e, $sqlx::Error::PoolTimedOut), "{e:?}");
                let e = within(GUARD, "acquire_within", pool.acquire_within(GUARD))
                    .await
                    .map(drop)
                    .unwrap_err();
                match &e {
                    Error::Checkout(CheckoutError::Timeout { stage, .. }) => {
                        assert_eq!(*stage, Stage::Connection, "{e}")
                    }
                    other => panic!("{other:?}"),
                }
                assert!(e.is_timeout());
                settled(&pool).await;
            }

            /// A `begin` cut short during its `BEGIN` round trip (a caller's
            /// timeout) leaves no open transaction on a pooled connection:
            /// sqlx 0.8's own `begin` counts the transaction only once the
            /// server has answered, so its rollback guard queues nothing and
            /// the connection went back to the pool inside a transaction
            /// (the next borrower's statements ran in it, never committed).
            #[tokio::test]
            async fn a_begin_cut_short_leaves_no_open_transaction() {
                cut_during_begin("begin-cut", |pool| Box::pin(async move {
                    let _ = pool.begin().await;
                }))
                .await;
            }

            /// The same for `with_xact_lock` (its own `BEGIN`).
            #[tokio::test]
            async fn a_transaction_lock_cut_short_leaves_no_open_transaction() {
                cut_during_begin("xact-cut", |pool| Box::pin(async move {
                    let _ = pool
                        .with_xact_lock(pgwarden::LockKey::Single(7), GUARD, |_tx| {
                            Box::pin(async { Ok::<_, Error>(()) })
                        })
                        .await;
                }))
                .await;
            }

            /// `cut` dropped while its `BEGIN` waits for an answer: the
            /// backend is stopped (`SIGSTOP`) so that the answer cannot come
            /// before the timeout (sqlx's test before acquire off, so that
            /// the checkout itself does not wait on it). Then the next
            /// borrower's write commits on its own, and no session is left
            /// idle in a transaction.
            async fn cut_during_begin(
                name: &str,
                cut: impl for<'p> FnOnce(&'p Pool) -> futures_util::future::BoxFuture<'p, ()>,
            ) {
                let db = db().await;
                let raw = support::admin(&db).await;
                let opts = PgPoolOptions::new().max_connections(4).test_before_acquire(false);
                let pool = build(&db, opts, name);
                let pid = {
                    let mut c = pool.acquire().await.unwrap();
                    $sqlx::query("SELECT 1").execute(&mut *c).await.unwrap();
                    c.pid()
                };
                settled(&pool).await;
                let stopped = support::Stopped::stop([pid]).unwrap();
                let cut = tokio::time::timeout(Duration::from_millis(200), cut(&pool)).await;
                assert!(cut.is_err(), "BEGIN answered by a stopped backend");
                drop(stopped);
                settled(&pool).await;
                let mut c = pool.acquire().await.unwrap();
                $sqlx::query("CREATE TABLE after_cut (x int)").execute(&mut *c).await.unwrap();
                drop(c);
                settled(&pool).await;
                let seen = raw
                    .query_one("SELECT count(*) FROM pg_tables WHERE tablename = 'after_cut'", &[])
                    .await
                    .unwrap()
                    .get::<_, i64>(0);
                let open = raw
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                         AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'",
                        &[],
                    )
                    .await
                    .unwrap()
                    .get::<_, i64>(0);
                assert_eq!((open, seen), (0, 1), "the next borrower ran inside the cut-short transaction");
            }
        }
    };
}

#[cfg(all(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
dropin!(v0_8, sqlx08, pgwarden::sqlx_0_8);
#[cfg(all(feature = "sqlx-0_8", not(feature = "sqlx-0_9")))]
dropin!(v0_8, sqlx08, pgwarden::sqlx);
#[cfg(feature = "sqlx-0_9")]
dropin!(v0_9, sqlx09, pgwarden::sqlx);
