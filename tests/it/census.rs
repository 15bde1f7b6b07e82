//! The `pg_locks` census against a real PostgreSQL: decoded keys, owners,
//! and leaked locks on idle pooled connections flagged and discarded.

use crate::support;

use std::collections::HashMap;
use std::time::Duration;

use pgwarden::{Lane, LockKey, LockMode, Owner};
use support::*;

const T: Duration = Duration::from_secs(5);

#[tokio::test]
async fn census_decodes_keys_and_owners() {
    let db = db().await;
    let pool = builder(&db, 4).build().unwrap();
    let raw = db.connect().await.unwrap();
    raw.batch_execute("SET application_name = 'census-raw'; SELECT pg_advisory_lock_shared(-3, 7)")
        .await
        .unwrap();
    let raw_pid: i32 = raw
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let big = LockKey::Single(0x1_0000_0002);
    let lock = pool
        .session_lock(big, LockMode::Exclusive, Some(T))
        .await
        .unwrap()
        .expect("a wait grants the lock or fails");
    // A third session waits for (-3, 7) exclusively.
    let waiter = db.connect().await.unwrap();
    let waiting = tokio::spawn(async move {
        waiter
            .execute("SELECT pg_advisory_lock(-3, 7)", &[])
            .await
            .map(|_| waiter)
    });
    eventually(T, "the waiter shows", || async {
        raw_locks(&raw).await.iter().any(|l| !l.4)
    })
    .await;

    let census = pool.census().await.unwrap();
    let ours: Vec<_> = census.ours().collect();
    assert_eq!(ours.len(), 1, "{census:?}");
    assert_eq!(
        (ours[0].key, ours[0].mode, ours[0].granted),
        (big, LockMode::Exclusive, true)
    );
    assert_eq!(ours[0].pid, Some(lock.client().pid()));
    match &ours[0].owner {
        Owner::CheckedOut {
            lane, site, note, ..
        } => {
            assert_eq!(*lane, Lane::SessionLock);
            assert!(site.file().ends_with("census.rs"), "{site}");
            assert_eq!(note.as_deref(), Some("session lock 4294967298"));
        }
        o => panic!("expected checked out, got {o:?}"),
    }
    let shared = census
        .locks
        .iter()
        .find(|l| l.pid == Some(raw_pid))
        .expect("the raw lock");
    assert_eq!(
        (shared.key, shared.mode, shared.granted),
        (LockKey::Pair(-3, 7), LockMode::Shared, true)
    );
    assert_eq!(shared.owner, Owner::Other);
    assert_eq!(shared.application_name.as_deref(), Some("census-raw"));
    assert_eq!(shared.state.as_deref(), Some("idle"));
    let waits = census
        .locks
        .iter()
        .find(|l| !l.granted)
        .expect("the waiter");
    assert_eq!(
        (waits.key, waits.mode, waits.state.as_deref()),
        (LockKey::Pair(-3, 7), LockMode::Exclusive, Some("active"))
    );

    raw.batch_execute("SELECT pg_advisory_unlock_all()")
        .await
        .unwrap();
    waiting.await.unwrap().unwrap();
    lock.unlock().await.unwrap();
}

/// [`support::watch`] within [`T`].
async fn watch(
    snap: &metrics_util::debugging::Snapshotter,
    what: &str,
    done: impl FnMut(&HashMap<String, f64>) -> bool,
) -> HashMap<String, f64> {
    support::watch(snap, T, what, done).await
}

use support::metric as get;

/// The periodic census confirms a leak on a connection idle in the pool,
/// closes it (deadpool's `retain`), and counts it once.
#[tokio::test]
async fn sweep_confirms_a_leak_on_an_idle_connection_and_discards_it() {
    let db = db().await;
    let b = builder(&db, 3)
        .name("leaky")
        .census_interval(Some(Duration::from_millis(50)));
    let (pool, snap) = with_recorder(b);
    let raw = db.connect().await.unwrap();
    // The bug the census is for: a lock taken with raw SQL, never released.
    let (a, b) = (pool.get().await.unwrap(), pool.get().await.unwrap());
    a.simple_query("SELECT pg_advisory_lock(42)").await.unwrap();
    let leaked_pid = a.pid();
    drop(b);
    drop(a);

    let m = watch(&snap, "the leak counted", |m| {
        get(m, "pgwarden_census_leaks_total{pool=leaky}") >= 1.0
    })
    .await;
    assert_eq!(get(&m, "pgwarden_census_advisory_locks{pool=leaky}"), 1.0);
    assert_eq!(
        get(&m, "pgwarden_census_idle_advisory_locks{pool=leaky}"),
        1.0
    );
    // Closed while idle: the session ends with its lock, before any checkout
    // could find it.
    eventually(T, "leaked session closed", || async {
        !alive(&raw, leaked_pid).await
    })
    .await;
    // Three more passes: counted once, and no lock of ours left.
    let mut passes = 0.0;
    let m = watch(&snap, "three more census passes", |m| {
        passes = get(m, "pgwarden_census_duration_seconds{pool=leaky}");
        passes >= 3.0
    })
    .await;
    assert_eq!(
        get(&m, "pgwarden_census_leaks_total{pool=leaky}"),
        0.0,
        "counted once"
    );
    for _ in 0..2 {
        assert_ne!(pool.get().await.unwrap().pid(), leaked_pid);
    }
    assert!(free(&raw, LockKey::Single(42)).await);
    assert_eq!(pool.census().await.unwrap().ours().count(), 0);
}

#[tokio::test]
async fn a_leak_on_the_census_own_connection_is_closed_at_once() {
    let db = db().await;
    // The first periodic pass comes a second after the build: the census
    // read below runs well before it.
    let b = builder(&db, 3)
        .name("own")
        .census_interval(Some(Duration::from_secs(1)));
    let (pool, snap) = with_recorder(b);
    let raw = db.connect().await.unwrap();
    let c = pool.get().await.unwrap();
    c.simple_query("SELECT pg_advisory_lock_shared(44)")
        .await
        .unwrap();
    let leaked_pid = c.pid();
    drop(c); // the only idle connection: the census gets it

    let census = pool.census().await.unwrap();
    let idle: Vec<_> = census.idle().collect();
    assert_eq!(idle.len(), 1, "{census:?}");
    assert_eq!(
        (idle[0].pid, idle[0].key),
        (Some(leaked_pid), LockKey::Single(44))
    );
    let m = watch(&snap, "the leak counted", |m| {
        get(m, "pgwarden_census_leaks_total{pool=own}") >= 1.0
    })
    .await;
    assert_eq!(
        get(&m, "pgwarden_census_idle_advisory_locks{pool=own}"),
        1.0
    );
    eventually(T, "leaked session closed", || async {
        !alive(&raw, leaked_pid).await
    })
    .await;
    assert_eq!(pool.status().in_use, 0);
    assert!(raw_locks(&raw).await.is_empty());
}

#[tokio::test]
async fn held_guards_are_not_leaks() {
    let db = db().await;
    let b = builder(&db, 4)
        .name("guarded")
        .census_interval(Some(Duration::from_millis(50)));
    let (pool, snap) = with_recorder(b);
    let lock = pool
        .session_lock(LockKey::Pair(8, 8), LockMode::Exclusive, Some(T))
        .await
        .unwrap()
        .expect("a wait grants the lock or fails");
    let mut passes = 0.0;
    let m = watch(&snap, "three census passes", |m| {
        passes = get(m, "pgwarden_census_duration_seconds{pool=guarded}");
        passes >= 3.0
    })
    .await;
    assert_eq!(get(&m, "pgwarden_census_advisory_locks{pool=guarded}"), 1.0);
    assert_eq!(
        get(&m, "pgwarden_census_idle_advisory_locks{pool=guarded}"),
        0.0
    );
    assert_eq!(get(&m, "pgwarden_census_leaks_total{pool=guarded}"), 0.0);
    lock.unlock().await.unwrap();
}

#[tokio::test]
async fn periodic_census_runs_in_housekeeping() {
    let db = db().await;
    let b = builder(&db, 3)
        .name("periodic")
        .housekeeping_interval(Duration::from_millis(20))
        .census_interval(Some(Duration::from_millis(100)));
    let (pool, snap) = with_recorder(b);
    let c = pool.get().await.unwrap();
    c.simple_query("SELECT pg_advisory_lock(43)").await.unwrap();
    drop(c);
    let mut leaks = 0.0;
    eventually(T, "the periodic census counts the leak", || {
        leaks += metrics_now(&snap)
            .get("pgwarden_census_leaks_total{pool=periodic}")
            .copied()
            .unwrap_or(0.0);
        std::future::ready(leaks >= 1.0)
    })
    .await;
    assert_eq!(leaks, 1.0);
}

#[tokio::test]
async fn an_unbounded_wait_timeout_keeps_housekeeping_and_the_census_alive() {
    let db = db().await;
    let b = builder(&db, 3)
        .name("unbounded")
        .wait_timeout(Duration::MAX)
        .housekeeping_interval(Duration::from_millis(20))
        .census_interval(Some(Duration::from_millis(50)));
    let (pool, snap) = with_recorder(b);
    let held = pool.get().await.unwrap();
    for round in 0..3 {
        metrics_now(&snap); // a reading resets the gauges: only a pass sets them again
                            // Each round sees a housekeeping pass (the oldest hold, set again)
                            // and a census pass (a duration sample) after the reset.
        let now = watch(
            &snap,
            &format!("round {round}: housekeeping and census passes"),
            |m| {
                get(
                    m,
                    "pgwarden_oldest_hold_seconds{lane=request,pool=unbounded}",
                ) > 0.0
                    && get(m, "pgwarden_census_duration_seconds{pool=unbounded}") >= 1.0
            },
        )
        .await;
        assert_eq!(
            now.get("pgwarden_housekeeping_panics_total{pool=unbounded}"),
            Some(&0.0)
        );
    }
    drop(held);
}
