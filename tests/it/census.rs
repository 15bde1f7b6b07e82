//! The `pg_locks` census against a real PostgreSQL, on every backend:
//! decoded keys, owners, and leaked locks on idle pooled connections
//! flagged and discarded.

use crate::support;

use std::collections::HashMap;
use std::time::Duration;

use pgwarden::{Lane, LockKey, LockMode, Owner};
use support::backend::{settled, Backend, Settings};
use support::*;

const T: Duration = Duration::from_secs(5);

backends!(census_decodes_keys_and_owners);
async fn census_decodes_keys_and_owners<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("census-decodes", 4));
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
    let lock = B::session_lock(&pool, big, LockMode::Exclusive, Some(T))
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

    let census = B::census(&pool).await.unwrap();
    let ours: Vec<_> = census.ours().collect();
    assert_eq!(ours.len(), 1, "{census:?}");
    assert_eq!(
        (ours[0].key, ours[0].mode, ours[0].granted),
        (big, LockMode::Exclusive, true)
    );
    assert_eq!(ours[0].pid, Some(B::lock_pid(&lock)));
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
    B::unlock(lock).await.unwrap();
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

/// The metric `name` of pool `pool`, with `labels` before the pool's.
fn key(name: &str, labels: &str, pool: &str) -> String {
    format!("pgwarden_{name}{{{labels}pool={pool}}}")
}

backends!(sweep_confirms_a_leak_on_an_idle_connection_and_discards_it);
/// The periodic census confirms a leak on a connection idle in the pool,
/// closes it (deadpool's `retain`, sqlx's close of the idle connection),
/// and counts it once.
async fn sweep_confirms_a_leak_on_an_idle_connection_and_discards_it<B: Backend>() {
    let db = db().await;
    let s = Settings::new("leaky", 3).census(Duration::from_millis(50));
    let (pool, snap) = B::build_recorded(&db, &s);
    let name = s.pool_name::<B>();
    let raw = db.connect().await.unwrap();
    // The bug the census is for: a lock taken with raw SQL, never released.
    let (mut a, b) = (B::get(&pool).await.unwrap(), B::get(&pool).await.unwrap());
    B::run(&mut a, "SELECT pg_advisory_lock(42)").await;
    let leaked_pid = B::pid(&a);
    drop(b);
    drop(a);

    let m = watch(&snap, "the leak counted", |m| {
        get(m, &key("census_leaks_total", "", &name)) >= 1.0
    })
    .await;
    assert_eq!(get(&m, &key("census_advisory_locks", "", &name)), 1.0);
    assert_eq!(get(&m, &key("census_idle_advisory_locks", "", &name)), 1.0);
    // Closed while idle: the session ends with its lock, before any checkout
    // could find it.
    eventually(T, "leaked session closed", || async {
        !alive(&raw, leaked_pid).await
    })
    .await;
    // Three more passes: counted once, and no lock of ours left.
    let mut passes = 0.0;
    let m = watch(&snap, "three more census passes", |m| {
        passes = get(m, &key("census_duration_seconds", "", &name));
        passes >= 3.0
    })
    .await;
    assert_eq!(
        get(&m, &key("census_leaks_total", "", &name)),
        0.0,
        "counted once"
    );
    for _ in 0..2 {
        assert_ne!(B::pid(&B::get(&pool).await.unwrap()), leaked_pid);
    }
    assert!(free(&raw, LockKey::Single(42)).await);
    assert_eq!(B::census(&pool).await.unwrap().ours().count(), 0);
}

backends!(a_leak_on_the_census_own_connection_is_closed_at_once);
async fn a_leak_on_the_census_own_connection_is_closed_at_once<B: Backend>() {
    let db = db().await;
    // The first periodic pass comes a second after the build: the census
    // read below runs well before it.
    let s = Settings::new("own", 3).census(Duration::from_secs(1));
    let (pool, snap) = B::build_recorded(&db, &s);
    let name = s.pool_name::<B>();
    let raw = db.connect().await.unwrap();
    let mut c = B::get(&pool).await.unwrap();
    B::run(&mut c, "SELECT pg_advisory_lock_shared(44)").await;
    let leaked_pid = B::pid(&c);
    drop(c); // the only idle connection: the census gets it
    settled::<B>(&pool).await; // (sqlx returns it in a task of its own)

    let census = B::census(&pool).await.unwrap();
    let idle: Vec<_> = census.idle().collect();
    assert_eq!(idle.len(), 1, "{census:?}");
    assert_eq!(
        (idle[0].pid, idle[0].key),
        (Some(leaked_pid), LockKey::Single(44))
    );
    let m = watch(&snap, "the leak counted", |m| {
        get(m, &key("census_leaks_total", "", &name)) >= 1.0
    })
    .await;
    assert_eq!(get(&m, &key("census_idle_advisory_locks", "", &name)), 1.0);
    eventually(T, "leaked session closed", || async {
        !alive(&raw, leaked_pid).await
    })
    .await;
    assert_eq!(B::status(&pool).in_use, 0);
    assert!(raw_locks(&raw).await.is_empty());
}

backends!(held_guards_are_not_leaks);
async fn held_guards_are_not_leaks<B: Backend>() {
    let db = db().await;
    let s = Settings::new("guarded", 4).census(Duration::from_millis(50));
    let (pool, snap) = B::build_recorded(&db, &s);
    let name = s.pool_name::<B>();
    let lock = B::session_lock(&pool, LockKey::Pair(8, 8), LockMode::Exclusive, Some(T))
        .await
        .unwrap()
        .expect("a wait grants the lock or fails");
    let mut passes = 0.0;
    let m = watch(&snap, "three census passes", |m| {
        passes = get(m, &key("census_duration_seconds", "", &name));
        passes >= 3.0
    })
    .await;
    assert_eq!(get(&m, &key("census_advisory_locks", "", &name)), 1.0);
    assert_eq!(get(&m, &key("census_idle_advisory_locks", "", &name)), 0.0);
    assert_eq!(get(&m, &key("census_leaks_total", "", &name)), 0.0);
    B::unlock(lock).await.unwrap();
}

backends!(periodic_census_runs_in_housekeeping);
async fn periodic_census_runs_in_housekeeping<B: Backend>() {
    let db = db().await;
    let s = Settings::new("periodic", 3)
        .long_hold(Duration::from_secs(30), Duration::from_millis(20))
        .census(Duration::from_millis(100));
    let (pool, snap) = B::build_recorded(&db, &s);
    let leaks_key = key("census_leaks_total", "", &s.pool_name::<B>());
    let mut c = B::get(&pool).await.unwrap();
    B::run(&mut c, "SELECT pg_advisory_lock(43)").await;
    drop(c);
    let mut leaks = 0.0;
    eventually(T, "the periodic census counts the leak", || {
        leaks += metrics_now(&snap).get(&leaks_key).copied().unwrap_or(0.0);
        std::future::ready(leaks >= 1.0)
    })
    .await;
    assert_eq!(leaks, 1.0);
}

backends!(an_unbounded_wait_timeout_keeps_housekeeping_and_the_census_alive);
async fn an_unbounded_wait_timeout_keeps_housekeeping_and_the_census_alive<B: Backend>() {
    let db = db().await;
    let s = Settings::new("unbounded", 3)
        .wait(Duration::MAX)
        .long_hold(Duration::from_secs(30), Duration::from_millis(20))
        .census(Duration::from_millis(50));
    let (pool, snap) = B::build_recorded(&db, &s);
    let name = s.pool_name::<B>();
    let held = B::get(&pool).await.unwrap();
    for round in 0..3 {
        metrics_now(&snap); // a reading resets the gauges: only a pass sets them again
                            // Each round sees a housekeeping pass (the oldest hold, set again)
                            // and a census pass (a duration sample) after the reset.
        let now = watch(
            &snap,
            &format!("round {round}: housekeeping and census passes"),
            |m| {
                get(m, &key("oldest_hold_seconds", "lane=request,", &name)) > 0.0
                    && get(m, &key("census_duration_seconds", "", &name)) >= 1.0
            },
        )
        .await;
        assert_eq!(
            now.get(&key("housekeeping_panics_total", "", &name)),
            Some(&0.0)
        );
    }
    drop(held);
}
