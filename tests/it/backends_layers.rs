//! The layers above the pool on every backend, from one source (as
//! `backends.rs` does for the pool shell): the census and its leak sweep,
//! pooler detection (straight to PostgreSQL and behind a real PgBouncer in
//! transaction mode), the HTTP readiness service and `ShedLayer`, and the
//! metrics they record, under the same names and the pool's label. Each
//! test is a generic `async fn` over [`Backend`], run by [`backends!`] on
//! the deadpool pool and (features `sqlx-0_8`, `sqlx-0_9`) on pgwarden's
//! sqlx pool over sqlx 0.8 and 0.9.

use crate::support;

use std::collections::HashMap;
use std::time::Duration;

use metrics_util::debugging::{DebuggingRecorder, Snapshotter};
use pgwarden::{Lane, LockKey, LockMode, Owner, PoolerMode};
use pgwarden_testing::{PoolMode, TestServer};
use support::backend::{settled, Backend, Settings};
use support::{alive, db, eventually, free, metric as get, metrics_now};

/// The guard against a hang: only a wrong behaviour waits it out.
const GUARD: Duration = Duration::from_secs(60);

/// [`support::watch`] within [`GUARD`].
async fn watch(
    snap: &Snapshotter,
    what: &str,
    done: impl FnMut(&HashMap<String, f64>) -> bool,
) -> HashMap<String, f64> {
    support::watch(snap, GUARD, what, done).await
}

backends!(census_lists_a_lock_held_on_a_pooled_connection);
/// A session-level lock taken by user SQL on a checked-out connection is
/// listed with that connection's pid, lane and call site; one held by a
/// session outside the pool is another's.
async fn census_lists_a_lock_held_on_a_pooled_connection<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("census-lists", 4));
    let raw = db.connect().await.unwrap();
    raw.batch_execute("SELECT pg_advisory_lock_shared(-3, 7)")
        .await
        .unwrap();
    let line = line!() + 1;
    let mut c = B::get(&pool).await.unwrap();
    B::run(&mut c, "SELECT pg_advisory_lock(7, 11)").await;

    let census = B::census(&pool).await.unwrap();
    let ours: Vec<_> = census.ours().collect();
    assert_eq!(ours.len(), 1, "{census:?}");
    assert_eq!(
        (ours[0].key, ours[0].mode, ours[0].granted),
        (LockKey::Pair(7, 11), LockMode::Exclusive, true)
    );
    assert_eq!(ours[0].pid, Some(B::pid(&c)));
    match &ours[0].owner {
        Owner::CheckedOut { lane, site, .. } => {
            assert_eq!(*lane, Lane::Request);
            assert_eq!((site.file(), site.line()), (file!(), line));
        }
        o => panic!("expected checked out, got {o:?}"),
    }
    let other: Vec<_> = census
        .locks
        .iter()
        .filter(|l| l.owner == Owner::Other)
        .collect();
    assert_eq!(other.len(), 1, "{census:?}");
    assert_eq!(
        (other[0].key, other[0].mode),
        (LockKey::Pair(-3, 7), LockMode::Shared)
    );
    assert_eq!(census.idle().count(), 0);

    B::run(&mut c, "SELECT pg_advisory_unlock_all()").await;
    drop(c);
    settled::<B>(&pool).await;
}

backends!(census_sweep_closes_an_idle_connection_holding_a_leaked_lock);
/// The bug the census is for: a lock taken with raw SQL on a plain
/// checkout and never released, here on two connections (the census runs
/// on one idle connection, which it closes itself when it is a leaker: the
/// other is closed the backend's way, deadpool's `retain` or sqlx's mark
/// and `pg_terminate_backend`). The periodic sweep confirms each leak,
/// counts it once, and ends those sessions: the locks are free, and no
/// checkout gets a dead connection.
async fn census_sweep_closes_an_idle_connection_holding_a_leaked_lock<B: Backend>() {
    let db = db().await;
    let s = Settings::new("census-sweep", 4).census(Duration::from_millis(200));
    let name = s.pool_name::<B>();
    let logs = support::logs();
    let (pool, snap) = B::build_recorded(&db, &s);
    let raw = db.connect().await.unwrap();
    let mut a = B::get(&pool).await.unwrap();
    let mut b = B::get(&pool).await.unwrap();
    B::run(&mut a, "SELECT pg_advisory_lock(42)").await;
    B::run(&mut b, "SELECT pg_advisory_lock(43)").await;
    let leaked = [B::pid(&a), B::pid(&b)];
    drop((a, b));

    let leaks = format!("pgwarden_census_leaks_total{{pool={name}}}");
    let m = watch(&snap, "the leaks counted", |m| get(m, &leaks) >= 2.0).await;
    assert_eq!(get(&m, &leaks), 2.0);
    // Both in one pass, unless a pass came while one was still on its way
    // back into the pool (sqlx returns in a task of its own): then it was
    // checked out, not a leak yet, and the next pass found it.
    let idle = format!("pgwarden_census_idle_advisory_locks{{pool={name}}}");
    let one_pass = get(&m, &idle) == 2.0;
    assert!(get(&m, &idle) >= 1.0);
    eventually(GUARD, "the leaking sessions ended", || async {
        !alive(&raw, leaked[0]).await && !alive(&raw, leaked[1]).await
    })
    .await;
    for key in [42, 43] {
        assert!(free(&raw, LockKey::Single(key)).await, "lock {key}");
    }
    // Each closed in the pass that confirmed it: none left for a later
    // checkout to find. Found in one pass, at least one was not the
    // census's own connection (sqlx: it was ended on the server).
    let text = logs.text();
    let lines: Vec<_> = text
        .lines()
        .filter(|l| l.contains(&format!("pool={name} ")) && l.contains("idle in the pool"))
        .collect();
    assert_eq!(lines.len(), 2, "{lines:#?}");
    assert!(
        lines.iter().all(|l| !l.contains("next checkout")),
        "{lines:#?}"
    );
    if one_pass && B::NAME.starts_with("sqlx") {
        assert!(
            lines.iter().any(|l| l.contains("ended on the server")),
            "{lines:#?}"
        );
    }

    // Three more passes: counted once.
    let passes = format!("pgwarden_census_duration_seconds{{pool={name}}}");
    let m = watch(&snap, "three more census passes", |m| {
        get(m, &passes) >= 3.0
    })
    .await;
    assert_eq!(get(&m, &leaks), 0.0, "counted once");
    // Every connection the request lane can hold at once: none is the
    // dead one, each answers.
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut c = B::get(&pool).await.unwrap();
        assert!(!leaked.contains(&B::pid(&c)));
        B::select_1(&mut c).await;
        held.push(c);
    }
    drop(held);
    settled::<B>(&pool).await;
    assert_eq!(B::census(&pool).await.unwrap().ours().count(), 0);
}

backends!(pooler_detection_direct_and_behind_pgbouncer);
/// Straight to PostgreSQL: direct. Through PgBouncer in transaction mode:
/// a transaction pooler, and the census then matches no lock to the pool.
async fn pooler_detection_direct_and_behind_pgbouncer<B: Backend>() {
    let db = db().await;
    let s = Settings::new("pooler-detect", 4).pooler(PoolerMode::Auto);
    let pool = B::build(&db, &s);
    assert_eq!(B::detect_pooler(&pool).await.unwrap(), PoolerMode::Direct);
    assert_eq!(B::detect_pooler(&pool).await.unwrap(), PoolerMode::Direct);
    settled::<B>(&pool).await;

    let Some(bouncer) = support::pooler::bouncer(&db, 10, PoolMode::Transaction) else {
        return;
    };
    let pool = B::build_through(&bouncer, &s);
    assert_eq!(
        B::detect_pooler(&pool).await.unwrap(),
        PoolerMode::Transaction
    );
    let mut c = B::get(&pool).await.unwrap();
    B::run(&mut c, "SELECT pg_advisory_xact_lock(5)").await;
    drop(c);
    settled::<B>(&pool).await;
    let census = B::census(&pool).await.unwrap();
    assert_eq!(census.ours().count(), 0, "{census:?}");
    settled::<B>(&pool).await;
}

backends!(http_readiness_answers_200_then_503_when_the_probe_cannot_connect);
/// The readiness service: 200 while request traffic holds every request
/// connection (the probe has its reserve); 503 with the reason once the
/// database takes no connection; 200 again once it does.
async fn http_readiness_answers_200_then_503_when_the_probe_cannot_connect<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("http-ready", 3));
    let app = B::app(&pool, Duration::ZERO, Duration::from_secs(5));
    let (a, b) = (B::get(&pool).await.unwrap(), B::get(&pool).await.unwrap());
    assert_eq!(B::status(&pool).lane(Lane::Request).in_use, 2);
    let (status, body) = support::backend::call(&app, "/ready").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"ready\":true"), "{body}");
    assert!(
        body.contains("\"request\":{\"in_use\":2"),
        "the lanes reported: {body}"
    );
    drop((a, b));
    settled::<B>(&pool).await;

    // The database takes no connection, and the pool's are ended (from
    // the maintenance database: a database cannot close itself).
    let (raw, conn) = TestServer::shared()
        .unwrap()
        .pg_config()
        .connect(tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let name = db.name().replace('"', "\"\"");
    raw.batch_execute(&format!(
        "ALTER DATABASE \"{name}\" ALLOW_CONNECTIONS false"
    ))
    .await
    .unwrap();
    raw.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
        &[&db.name()],
    )
    .await
    .unwrap();
    eventually(GUARD, "the pool's sessions gone", || async {
        let n: i64 = raw
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1",
                &[&db.name()],
            )
            .await
            .unwrap()
            .get(0);
        n == 0
    })
    .await;
    let (status, body) = support::backend::call(&app, "/ready").await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("\"ready\":false") && body.contains("\"reason\""),
        "{body}"
    );

    raw.batch_execute(&format!("ALTER DATABASE \"{name}\" ALLOW_CONNECTIONS true"))
        .await
        .unwrap();
    eventually(GUARD, "ready again", || async {
        support::backend::call(&app, "/ready").await.0 == 200
    })
    .await;
    settled::<B>(&pool).await;
}

backends!(http_shed_layer_sheds_when_the_request_lane_is_full);
/// `ShedLayer` with no wait allowed: a request goes through while a request
/// connection is free, is shed (503, `Retry-After`, counted under the
/// pool's label) while the lane is full, and goes through again after.
async fn http_shed_layer_sheds_when_the_request_lane_is_full<B: Backend>() {
    let db = db().await;
    let s = Settings::new("http-shed", 3);
    let name = s.pool_name::<B>();
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let (pool, app) = metrics::with_local_recorder(&recorder, || {
        let pool = B::build(&db, &s);
        let app = B::app(&pool, Duration::ZERO, Duration::from_secs(5));
        (pool, app)
    });
    assert_eq!(
        support::backend::call(&app, "/work").await,
        (200, "done".into())
    );
    let (a, b) = (B::get(&pool).await.unwrap(), B::get(&pool).await.unwrap());
    let (status, body) = support::backend::call(&app, "/work").await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("\"shed\":true") && body.contains("\"reason\":\"busy\""),
        "{body}"
    );
    assert!(body.contains(&format!("pool {name}")), "{body}");
    // Readiness is not behind the layer: the probe has its reserve.
    assert_eq!(support::backend::call(&app, "/ready").await.0, 200);
    drop(a);
    settled_to::<B>(&pool, 1).await;
    assert_eq!(
        support::backend::call(&app, "/work").await,
        (200, "done".into())
    );
    drop(b);
    settled::<B>(&pool).await;

    let m = metrics_now(&snap);
    assert_eq!(
        get(
            &m,
            &format!("pgwarden_requests_shed_total{{pool={name},reason=busy}}")
        ),
        1.0
    );
    assert_eq!(
        get(
            &m,
            &format!("pgwarden_requests_admitted_total{{pool={name}}}")
        ),
        2.0
    );
}

/// Waits (on the pool's state) until `n` request connections are in use.
async fn settled_to<B: Backend>(pool: &B::Pool, n: usize) {
    eventually(GUARD, "the return done", || {
        std::future::ready(B::status(pool).lane(Lane::Request).in_use == n)
    })
    .await
}

backends!(metrics_carry_the_same_names_and_the_pool_label);
/// The pool's gauges and counters, by name and label, on every backend:
/// checkouts timed, holds timed, the lanes and connections republished by
/// housekeeping, the readiness probe timed.
async fn metrics_carry_the_same_names_and_the_pool_label<B: Backend>() {
    let db = db().await;
    let s = Settings::new("metrics-names", 4)
        .long_hold(Duration::from_secs(30), Duration::from_millis(20));
    let name = s.pool_name::<B>();
    let (pool, snap) = B::build_recorded(&db, &s);
    let mut c = B::get(&pool).await.unwrap();
    B::select_1(&mut c).await;
    B::readiness(&pool, GUARD).await.unwrap();
    let keys = [
        format!("pgwarden_acquire_duration_seconds{{lane=request,pool={name}}}"),
        format!("pgwarden_readiness_duration_seconds{{pool={name}}}"),
        format!("pgwarden_lane_in_use{{lane=request,pool={name}}}"),
        format!("pgwarden_lane_max{{lane=request,pool={name}}}"),
        format!("pgwarden_connections_max{{pool={name}}}"),
    ];
    let m = watch(&snap, "the pool's metrics", |m| {
        keys.iter().all(|k| get(m, k) > 0.0)
    })
    .await;
    assert_eq!(get(&m, &keys[2]), 1.0, "one request connection out");
    assert_eq!(get(&m, &keys[3]), 3.0, "request max of a pool of 4");
    assert_eq!(get(&m, &keys[4]), 4.0);
    drop(c);
    settled::<B>(&pool).await;
    let hold = format!("pgwarden_hold_duration_seconds{{lane=request,pool={name}}}");
    watch(&snap, "the hold timed", |m| get(m, &hold) >= 1.0).await;
}
