//! `pgwarden::Deadline`: a scope that bounds every checkout inside it, on a
//! real PostgreSQL. The request lane of a pool of four is held (3 of 3), so
//! any checkout of it waits; the scope decides how long.

use crate::support;

use std::time::{Duration, Instant};

use pgwarden::{Deadline, Lane};
use support::{builder, db, eventually, within};

const LIMIT: Duration = Duration::from_secs(10);
/// The bounds a wrong behaviour would wait out (the pool's own, an outer
/// scope's, `get_within`'s)…
const HOUR: Duration = Duration::from_secs(3600);
/// …and the guard against that hang: the scoped checkouts end well within
/// it on any machine. The tests assert no upper bound on the machine's
/// speed, only that nothing ends before its bound.
const GUARD: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkouts_in_a_scope_wait_no_longer_than_it_allows() {
    let db = db().await;
    let pool = builder(&db, 4).wait_timeout(HOUR).build().unwrap();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(pool.get().await.unwrap());
    }

    // The per-checkout maximum: `get()` (an hour of its own, in a scope of
    // an hour) gives up at 100 ms.
    let t = Instant::now();
    let d = Deadline::after(HOUR).max_wait(Duration::from_millis(100));
    let e = within(GUARD, "get in scope", d.scope(pool.get()))
        .await
        .unwrap_err();
    let waited = t.elapsed();
    assert!(matches!(e, deadpool_postgres::PoolError::Timeout(_)), "{e}");
    assert!(waited >= Duration::from_millis(100), "{waited:?}");

    // The deadline itself: an hour's `get_within` bound ends at the 150 ms
    // left.
    let t = Instant::now();
    let d = Deadline::after(Duration::from_millis(150));
    let e = within(
        GUARD,
        "get_within with a bound, in scope",
        d.scope(pool.get_within(HOUR)),
    )
    .await
    .unwrap_err();
    let waited = t.elapsed();
    assert!(e.is_timeout(), "{e}");
    assert!(waited >= Duration::from_millis(150), "{waited:?}");

    // Scopes nest and never extend: an inner scope of an hour inside a
    // 120 ms one.
    let t = Instant::now();
    let outer = Deadline::after(Duration::from_millis(120));
    let r = within(
        GUARD,
        "the inner scope ends with the outer one",
        outer.scope(async {
            Deadline::after(HOUR)
                .scope(async {
                    assert_eq!(Deadline::current(), Some(outer));
                    pool.get().await
                })
                .await
        }),
    )
    .await;
    assert!(r.is_err(), "{:?}", t.elapsed());
    assert!(
        t.elapsed() >= Duration::from_millis(120),
        "{:?}",
        t.elapsed()
    );

    // Outside any scope the pool's own bound (an hour) applies: still
    // waiting at 300 ms (a lower bound: a slow machine only waits longer).
    assert!(Deadline::current().is_none());
    let outside = tokio::time::timeout(Duration::from_millis(300), pool.get()).await;
    assert!(
        outside.is_err(),
        "a checkout outside the scope gave up early"
    );

    // A connection coming back within the bound is handed out.
    let d = Deadline::after(Duration::from_secs(2)).max_wait(Duration::from_secs(1));
    let back = held.pop().unwrap();
    let got = tokio::join!(d.scope(pool.get()), async {
        // Returned once the scoped checkout is queued for it.
        eventually(LIMIT, "the scoped checkout queues", || async {
            pool.status().waiting == 1
        })
        .await;
        drop(back);
    })
    .0
    .unwrap();
    assert_eq!(got.lane(), Lane::Request);
    drop(got);
    drop(held);
    eventually(LIMIT, "nothing checked out", || async {
        let s = pool.status();
        s.in_use == 0 && s.waiting == 0
    })
    .await;
}
