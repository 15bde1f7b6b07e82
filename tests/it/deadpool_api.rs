//! deadpool's `Pool` API on `pgwarden::Pool`: `status()`'s field names,
//! `is_closed`, `timeouts`, `retain`, `manager`, and `resize` (lanes'
//! limits derived again; a resize that would break a reservation refused;
//! under load, never more out than the size in force, every reservation kept).

use crate::support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgwarden::{BuildError, Lane, LimitsError};
use support::{admin, builder, db, eventually, within};
use tokio_postgres::Client;

/// Backends of the test's database, the admin connection's own left out.
async fn backends(admin: &Client) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity \
              WHERE datname = current_database() AND pid <> pg_backend_pid()",
            &[],
        )
        .await
        .expect("pg_stat_activity")
        .get(0)
}

/// The backends of the test's database that stay open: at most `size`,
/// or the count of those still there once any over `size` have had time
/// to exit. A connection the pool closes (a checkout back past a shrink,
/// a probe given up) ends on the client at once, but its backend shows in
/// `pg_stat_activity` until the server gets to run its exit: on a loaded
/// machine, beside the connection opened in its place. A connection the
/// pool really kept over its size does not go away: it is still counted
/// after the wait.
async fn backends_kept(admin: &Client, size: usize) -> i64 {
    let pids =
        |rows: Vec<tokio_postgres::Row>| -> Vec<i32> { rows.iter().map(|r| r.get(0)).collect() };
    let seen = pids(
        admin
            .query(
                "SELECT pid FROM pg_stat_activity \
                  WHERE datname = current_database() AND pid <> pg_backend_pid()",
                &[],
            )
            .await
            .expect("pg_stat_activity"),
    );
    if seen.len() <= size {
        return seen.len() as i64;
    }
    let still = || async {
        admin
            .query(
                "SELECT pid FROM pg_stat_activity WHERE pid = ANY($1)",
                &[&seen],
            )
            .await
            .expect("pg_stat_activity")
            .len()
    };
    // The backends of closed connections exit; 10 s is for a loaded
    // machine, not a rate.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut left = still().await;
    while left > size && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
        left = still().await;
    }
    eprintln!(
        "{} backends seen at size {size}; {left} of them stayed",
        seen.len()
    );
    left as i64
}

#[tokio::test]
async fn status_carries_deadpools_field_names() {
    let db = db().await;
    let pool = builder(&db, 4).build().unwrap();
    let a = pool.get().await.unwrap();
    let b = pool.get().await.unwrap();
    drop(b);
    let s = pool.status();
    assert_eq!((s.max_size, s.max), (4, 4), "{s}");
    assert_eq!(s.size, 2, "{s}");
    assert_eq!((s.available, s.idle), (1, 1), "{s}");
    assert_eq!((s.waiting, s.in_use), (0, 1), "{s}");
    drop(a);
    let s = pool.status();
    assert_eq!((s.size, s.available), (2, 2), "{s}");
}

#[tokio::test]
async fn is_closed_and_timeouts() {
    let db = db().await;
    let pool = builder(&db, 4)
        .wait_timeout(Duration::from_millis(1500))
        .build()
        .unwrap();
    assert!(!pool.is_closed());
    let t = pool.timeouts();
    // `wait` is pgwarden's checkout bound; create and recycle are deadpool's.
    assert_eq!(t.wait, Some(Duration::from_millis(1500)));
    let d = db.deadpool(4).unwrap().timeouts();
    assert_eq!((t.create, t.recycle), (d.create, d.recycle));
    pool.close();
    assert!(pool.is_closed());
    assert!(pool.get().await.is_err());
}

#[tokio::test]
async fn retain_closes_the_idle_connections_it_is_told_to() {
    let db = db().await;
    let admin = admin(&db).await;
    let pool = builder(&db, 4).build().unwrap();
    let (a, b, c) = (
        pool.get().await.unwrap(),
        pool.get().await.unwrap(),
        pool.get().await.unwrap(),
    );
    drop((a, b));
    assert_eq!(backends(&admin).await, 3);
    // Two idle, one out: retain sees the idle ones only.
    let mut seen = 0;
    let closed = pool.retain(|_, metrics| {
        seen += 1;
        metrics.age() > Duration::from_secs(3600)
    });
    assert_eq!((seen, closed), (2, 2));
    let s = pool.status();
    assert_eq!((s.size, s.available, s.in_use), (1, 0, 1), "{s}");
    eventually(
        Duration::from_secs(5),
        "the closed backends gone",
        || async { backends(&admin).await == 1 },
    )
    .await;
    // The budget is untouched: the pool serves its full size again.
    let more: Vec<_> = futures_util::future::try_join_all((0..2).map(|_| pool.get()))
        .await
        .unwrap();
    drop((c, more));
}

#[tokio::test]
async fn manager_is_the_wrapped_pools() {
    let db = db().await;
    let pool = builder(&db, 4).build().unwrap();
    let client = pool.get().await.unwrap();
    client.prepare_cached("SELECT 1").await.unwrap();
    assert_eq!(client.statement_cache.size(), 1);
    pool.manager().statement_caches.clear();
    assert_eq!(client.statement_cache.size(), 0);
}

#[tokio::test]
async fn resize_derives_the_lanes_again_and_keeps_the_ones_set() {
    let db = db().await;
    let pool = builder(&db, 4).build().unwrap();
    let lock = pool.status().lane(Lane::SessionLock);
    assert_eq!(lock.max, 1);
    pool.resize(16).unwrap();
    let s = pool.status();
    assert_eq!((s.max, s.max_size), (16, 16), "{s}");
    assert_eq!(s.lane(Lane::SessionLock).max, 4, "16 / 4: {s}");
    assert_eq!(
        s.lane(Lane::Request).max,
        15,
        "what the reservations leave: {s}"
    );
    // The new budget is in force: four session-lock connections now.
    let held: Vec<_> = futures_util::future::try_join_all((0..4).map(|i| {
        pool.session_lock(
            pgwarden::LockKey::Single(9000 + i),
            pgwarden::LockMode::Exclusive,
            None,
        )
    }))
    .await
    .unwrap();
    assert!(held.iter().all(Option::is_some), "four locks granted");
    assert_eq!(pool.status().lane(Lane::SessionLock).in_use, 4);
    for lock in held.into_iter().flatten() {
        lock.unlock().await.unwrap();
    }

    // A lane set explicitly keeps its setting through a resize.
    let pool = builder(&db, 8)
        .lane(Lane::SessionLock, 0, 2)
        .build()
        .unwrap();
    pool.resize(20).unwrap();
    assert_eq!(pool.status().lane(Lane::SessionLock).max, 2);
    pool.resize(4).unwrap();
    assert_eq!(pool.status().lane(Lane::SessionLock).max, 2);
    assert_eq!(pool.status().max_size, 4);
}

#[tokio::test]
async fn a_resize_that_would_break_a_reservation_is_refused_with_nothing_changed() {
    let db = db().await;
    // Reservations: request 1 (default), control 1, probe 1 = 3.
    let pool = builder(&db, 8)
        .lane(Lane::Control, 1, 1)
        .lane(Lane::SessionLock, 0, 3)
        .build()
        .unwrap();
    let before = pool.status();
    match pool.resize(3).unwrap_err() {
        BuildError::Limits(LimitsError::ReservationsExceedSize {
            size: 3,
            request: 1,
            control: 1,
            probe: 1,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    // The session-lock maximum set explicitly no longer leaves the work
    // under those locks a connection at 5 (5 - 3 reserved = 2 < 3).
    let e = pool.resize(5).unwrap_err();
    assert!(
        matches!(
            e,
            BuildError::Limits(LimitsError::SessionLockMaxStarvesWork {
                max: 3,
                size: 5,
                ..
            })
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("session_lock maximum 3"), "{e}");
    assert!(matches!(
        pool.resize(1).unwrap_err(),
        BuildError::Limits(LimitsError::TooSmall { size: 1 })
    ));
    let after = pool.status();
    assert_eq!(after, before);
    // deadpool's own size was not touched either.
    let c = pool.get().await.unwrap();
    drop(c);
    pool.close();
    assert!(matches!(
        pool.resize(8).unwrap_err(),
        BuildError::DeadpoolClosed
    ));
}

/// What a sampler saw: checkouts counted by pgwarden, connections held by
/// the workers, and backends on the server, each against the size in force.
#[derive(Default)]
struct Worst {
    in_use: usize,
    out: usize,
    backends: i64,
    samples: usize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn resize_under_load_never_has_more_out_than_the_size_in_force() {
    let db = db().await;
    let admin = admin(&db).await;
    // Reservations: request 1, control 1, probe 1.
    let pool = builder(&db, 8)
        .lane(Lane::Control, 1, 1)
        .wait_timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let out = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..16)
        .map(|i| {
            let (pool, out, stop, served) =
                (pool.clone(), out.clone(), stop.clone(), served.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let c = pool.get().await.expect("request checkout under load");
                    out.fetch_add(1, Ordering::SeqCst);
                    c.simple_query("SELECT 1").await.expect("query");
                    tokio::time::sleep(Duration::from_millis(1 + i % 3)).await;
                    out.fetch_sub(1, Ordering::SeqCst);
                    drop(c);
                    served.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    eventually(
        Duration::from_secs(10),
        "the load running at size 8",
        || async { pool.status().in_use >= 6 },
    )
    .await;

    for (size, refused) in [(4, None), (3, Some(3)), (6, None), (3, Some(3)), (4, None)] {
        if let Some(bad) = refused {
            let before = pool.status().max_size;
            let e = pool.resize(bad).unwrap_err();
            assert!(
                matches!(
                    e,
                    BuildError::Limits(LimitsError::ReservationsExceedSize { .. })
                ),
                "{e:?}"
            );
            assert_eq!(pool.status().max_size, before);
            continue;
        }
        pool.resize(size).unwrap();
        assert_eq!(pool.status().max_size, size);
        // Checkouts out before a shrink stay out until they come back;
        // deadpool closes the connections that come back past the size.
        eventually(
            Duration::from_secs(10),
            "the pool settled at its new size",
            || async {
                let s = pool.status();
                let request = s.lane(Lane::Request);
                // Every lane back within its new limit (the request lane's
                // checkouts from before a shrink come back first).
                s.in_use <= size
                    && request.in_use <= request.max
                    && out.load(Ordering::SeqCst) <= request.max
                    && backends(&admin).await <= size as i64
            },
        )
        .await;
        // From then on: sample pgwarden's count, the workers' own count and
        // the server's backends, with the readiness probe (its reserve)
        // answering throughout.
        let mut worst = Worst::default();
        let start_served = served.load(Ordering::Relaxed);
        // 600 ms of samples, and at least 10 however long they take: on a
        // loaded machine each sample (a query, a readiness probe) can take
        // 100 ms, and 600 ms alone once gave 6.
        let phase = tokio::time::Instant::now() + Duration::from_millis(600);
        while tokio::time::Instant::now() < phase || worst.samples < 10 {
            let s = pool.status();
            worst.in_use = worst.in_use.max(s.in_use);
            worst.out = worst.out.max(out.load(Ordering::SeqCst));
            worst.backends = worst.backends.max(backends_kept(&admin, size).await);
            worst.samples += 1;
            // Bounds that only stop a hang, generous for a loaded machine:
            // the probe's latency there is not what is tested.
            within(
                Duration::from_secs(15),
                "readiness under load",
                pool.readiness(Duration::from_secs(10)),
            )
            .await
            .expect("the probe reserve is kept at every size");
        }
        // The load kept the request lane full: the bound was tested.
        let request_max = pool.status().lane(Lane::Request).max;
        assert_eq!(
            worst.out, request_max,
            "the load reached the request lane's maximum"
        );
        assert!(
            worst.in_use <= size,
            "pgwarden counted {} out at size {size}",
            worst.in_use
        );
        assert!(
            worst.out <= size,
            "workers held {} at size {size}",
            worst.out
        );
        assert!(
            worst.backends <= size as i64,
            "{} backends at size {size}",
            worst.backends
        );
        assert!(
            served.load(Ordering::Relaxed) > start_served,
            "the load kept being served at size {size}"
        );
        eprintln!(
            "size {size}: {} samples, at most {} counted out, {} held, {} backends",
            worst.samples, worst.in_use, worst.out, worst.backends
        );
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        within(Duration::from_secs(15), "a worker to stop", w)
            .await
            .expect("no worker failed a checkout");
    }
}
