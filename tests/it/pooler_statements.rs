//! The statements pgwarden sends itself, on every backend: behind
//! PgBouncer 1.18 in transaction mode (which keeps no named prepared
//! statement to its client: a server connection holds whatever any client
//! named on it) they are all unnamed, sqlx's statement cache on or off;
//! and with sqlx's statement cache off (sqlx 0.8 names a persistent
//! statement even then, and never closes it) they do not pile up on the
//! server.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgwarden::{Error, LeaseOptions, LockError, LockKey, LockMode, PoolerMode};
use pgwarden_testing::PoolMode;
use support::backend::{settled, Backend, Settings};
use support::{db, eventually};

const T: Duration = Duration::from_secs(10);

backends!(checkouts_leases_and_locks_work_behind_a_transaction_pgbouncer);
/// Through PgBouncer in transaction mode with one server connection for
/// every client (a statement one client connection names is there for the
/// next: `42P05 prepared statement "sqlx_s_1" already exists` when two
/// name one), with the pooler configured or detected and sqlx's statement
/// cache on or off: checkouts (three held at once, then twenty more),
/// readiness, the census, a transaction lock, a lease acquired, renewed
/// and released; a session lock is refused with the typed error.
async fn checkouts_leases_and_locks_work_behind_a_transaction_pgbouncer<B: Backend>() {
    let db = db().await;
    let Some(bouncer) = support::pooler::bouncer(&db, 1, PoolMode::Transaction) else {
        return;
    };
    for (mode, cache) in [
        (PoolerMode::Transaction, false),
        (PoolerMode::Transaction, true),
        (PoolerMode::Auto, true),
        (PoolerMode::Auto, false),
    ] {
        let what = format!("{mode:?}, statement cache {cache}");
        let s = Settings::new("behind-bouncer", 4)
            .pooler(mode)
            .statement_cache(cache);
        let pool = B::build_through(&bouncer, &s);
        if mode == PoolerMode::Auto {
            let found = B::detect_pooler(&pool).await;
            assert_eq!(found.unwrap(), PoolerMode::Transaction, "{what}");
        }

        // Three client connections out at once, each named and asked its
        // pid, then twenty checkouts one after another.
        let mut held = Vec::new();
        for _ in 0..3 {
            let mut c = B::get_within(&pool, T)
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            B::run(&mut c, "SELECT 1").await;
            held.push(c);
        }
        drop(held);
        for _ in 0..20 {
            let mut c = B::get_within(&pool, T)
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            B::run(&mut c, "SELECT 1").await;
        }
        settled::<B>(&pool).await;

        B::readiness(&pool, T)
            .await
            .unwrap_or_else(|e| panic!("{what}: readiness: {e}"));
        let census = B::census(&pool)
            .await
            .unwrap_or_else(|e| panic!("{what}: census: {e}"));
        assert_eq!(census.ours().count(), 0, "{what}: {census:?}");

        let ran = Arc::new(AtomicUsize::new(0));
        B::xact_pid(&pool, LockKey::Single(7), T, ran.clone())
            .await
            .unwrap_or_else(|e| panic!("{what}: with_xact_lock: {e}"));
        assert_eq!(ran.load(Ordering::Acquire), 1, "{what}");

        let leases = B::leases(&pool);
        B::install(&leases)
            .await
            .unwrap_or_else(|e| panic!("{what}: install: {e}"));
        // Renewed every 100 ms, trusted for 30 s: two renewals go through
        // the bouncer's one server connection well before anything could
        // expire, however slowly a loaded machine runs them (a 1 s TTL
        // was lost once at load 16).
        let opts =
            LeaseOptions::new(Duration::from_secs(30)).renew_every(Duration::from_millis(100));
        let lease = B::acquire(&leases, "behind-bouncer", &opts, None)
            .await
            .unwrap_or_else(|e| panic!("{what}: acquire: {e}"))
            .expect("free: the last one was released");
        let before = B::lease_stats(&leases).renewed;
        eventually(
            T,
            &format!("{what}: renewals through the bouncer"),
            || async { B::lease_stats(&leases).renewed >= before + 2 },
        )
        .await;
        assert_eq!(B::lease_stats(&leases).renewal_failures, 0, "{what}");
        assert!(!lease.is_lost(), "{what}");
        B::release(lease)
            .await
            .unwrap_or_else(|e| panic!("{what}: release: {e}"));

        let refused = B::session_lock(&pool, LockKey::Single(8), LockMode::Exclusive, None).await;
        assert!(
            matches!(refused, Err(Error::Lock(LockError::BehindPooler { .. }))),
            "{what}: {refused:?}"
        );
        settled::<B>(&pool).await;
        B::close(&pool).await;
    }
}

backends!(pgwardens_statements_do_not_pile_up_with_the_statement_cache_off);
/// sqlx's statement cache off, straight to PostgreSQL: after 200
/// checkouts and 50 lease pairs, the one connection that served them
/// (a pool of 2: the probe's reserve and one shared connection) holds
/// at most the prepared statements bounded below, counted on the server.
async fn pgwardens_statements_do_not_pile_up_with_the_statement_cache_off<B: Backend>() {
    let db = db().await;
    let s = Settings::new("cache-off", 2).statement_cache(false);
    let pool = B::build(&db, &s);
    for _ in 0..200 {
        let mut c = B::get_within(&pool, T).await.unwrap();
        B::run(&mut c, "SELECT 1").await;
    }
    let leases = B::leases(&pool);
    B::install(&leases).await.unwrap();
    let opts = LeaseOptions::new(Duration::from_secs(30));
    for _ in 0..50 {
        let lease = B::acquire(&leases, "cache-off", &opts, None)
            .await
            .unwrap()
            .expect("free: the last one was released");
        B::release(lease).await.unwrap();
    }
    settled::<B>(&pool).await;
    assert_eq!(B::status(&pool).size, 1, "one connection served them all");
    let mut c = B::get_within(&pool, T).await.unwrap();
    let prepared = B::count(&mut c, "SELECT count(*) FROM pg_prepared_statements").await;
    // sqlx: at most the statement that names a connection, sent once
    // before the pool learned its cache is off (sqlx 0.8 names it; 0.9
    // does not). Deadpool keeps pgwarden's lease statements in its own
    // statement cache, one each: a fixed set (2 here).
    let bound = if B::NAME == "deadpool" { 16 } else { 1 };
    assert!(
        prepared <= bound,
        "{prepared} prepared statements on the connection (at most {bound})"
    );
    drop(c);
    settled::<B>(&pool).await;
}

backends!(over_tcp_a_pool_straight_to_postgres_is_proven_direct_and_one_through_pgbouncer_is_not);
/// Over TCP, on `PoolerMode::Auto`, a pool straight to PostgreSQL is
/// proven direct on every backend, and names its lease statements; through
/// PgBouncer in session mode (itself on TCP to the server) it is not, and
/// names none. On deadpool the pid the server announced proves it; on
/// sqlx, which keeps that pid to itself, the server's view of the
/// connection's two ends, found among this process's own sockets (before
/// stop 50 a sqlx pool was never proven direct: no lease statement named,
/// each parsed and planned at every call, row 4s).
async fn over_tcp_a_pool_straight_to_postgres_is_proven_direct_and_one_through_pgbouncer_is_not<
    B: Backend,
>() {
    let server = tokio::task::spawn_blocking(|| {
        pgwarden_testing::TestServer::start_local_with(&[("listen_addresses", "127.0.0.1")], &[])
    })
    .await
    .unwrap()
    .expect("a server on TCP");
    let db = server
        .create_database()
        .await
        .expect("fresh database")
        .over_tcp("127.0.0.1");
    let direct = Settings::new("tcp-direct", 4).pooler(PoolerMode::Auto);
    lease_statements_named::<B>("straight over TCP", &B::build(&db, &direct), 2).await;
    if !pgwarden_testing::require_tool("pgbouncer").expect("pgbouncer is required on CI") {
        return;
    }
    let bouncer = pgwarden_testing::PgBouncer::start_with_mode(&server, &db, 8, PoolMode::Session)
        .expect("pgbouncer");
    let s = Settings::new("tcp-session", 4)
        .pooler(PoolerMode::Auto)
        .statement_cache(true);
    lease_statements_named::<B>(
        "session PgBouncer over TCP",
        &B::build_through(&bouncer, &s),
        0,
    )
    .await;
}

backends!(lease_statements_are_prepared_only_where_sessions_are_proven_kept);
/// Lease statements are named prepared statements only on a pool proven
/// to keep its server sessions, and unnamed behind a proxy whose mode
/// detection could not prove: left at `PoolerMode::Auto`, after 20 lease
/// pairs, the pool's connections hold the acquisition and the release as
/// named statements straight to PostgreSQL on deadpool (the pid the
/// server announced proves it direct), none on sqlx over the harness's
/// Unix socket (sqlx hides that pid, and a Unix socket shows the server no
/// ends to match: configure `PoolerMode::Direct` there; over TCP see the
/// test above), and none through PgBouncer in session mode on either.
///
/// Stop 48 named them wherever detection found no transaction pooler (on
/// sqlx they were all parsed and planned at every call: row 4s); its
/// hostile reader broke that: a verdict gone stale (PgBouncer switched to
/// transaction mode) let a named release bind another client's statement
/// of the same name and two text parameters, which ran in its place (an
/// `INSERT` into a canary table, 6 of 6 releases said `Ok`, the leases
/// stayed held), and acquisitions failed with `08P01`. Reverted.
async fn lease_statements_are_prepared_only_where_sessions_are_proven_kept<B: Backend>() {
    let db = db().await;
    let bouncer = support::pooler::bouncer(&db, 8, PoolMode::Session);
    let direct = Settings::new("named-direct", 4).pooler(PoolerMode::Auto);
    let want_direct = if B::NAME == "deadpool" { 2 } else { 0 };
    let mut cases = vec![("direct", B::build(&db, &direct), want_direct)];
    if let Some(b) = &bouncer {
        // sqlx's statement cache on (the harness turns it off behind
        // PgBouncer, as a sqlx user does behind one in transaction mode).
        let s = Settings::new("named-session", 4)
            .pooler(PoolerMode::Auto)
            .statement_cache(true);
        cases.push(("session PgBouncer", B::build_through(b, &s), 0));
    }
    for (what, pool, want) in cases {
        lease_statements_named::<B>(what, &pool, want).await;
    }
}

/// Detects `pool`'s pooler (found `Direct`: straight, or a session pooler),
/// runs 20 lease pairs, then counts the lease statements named on all of
/// its connections: none when `want` is 0, else at least `want`.
async fn lease_statements_named<B: Backend>(what: &str, pool: &B::Pool, want: i64) {
    let found = B::detect_pooler(pool).await.unwrap();
    assert_eq!(found, PoolerMode::Direct, "{what}");
    let leases = B::leases(pool);
    B::install(&leases).await.unwrap();
    let opts = LeaseOptions::new(Duration::from_secs(30));
    for i in 0..20 {
        let lease = B::acquire(&leases, &format!("named-{i}"), &opts, None)
            .await
            .unwrap()
            .expect("a new name is free");
        B::release(lease).await.unwrap();
    }
    settled::<B>(pool).await;
    // Every connection of the pool at once: the statements are on
    // whichever served them.
    let size = B::status(pool).size;
    let mut held = Vec::new();
    let mut named = 0;
    for _ in 0..size {
        let mut c = B::get_within(pool, T).await.unwrap();
        named += B::count(
            &mut c,
            "SELECT count(*) FROM pg_prepared_statements \
              WHERE statement LIKE '%pgwarden_leases%' \
                AND (statement LIKE 'INSERT%' OR statement LIKE 'UPDATE%')",
        )
        .await;
        held.push(c);
    }
    drop(held);
    if want == 0 {
        assert_eq!(
            named, 0,
            "{what}: lease statements prepared on a pool not proven direct"
        );
    } else {
        assert!(
            named >= want,
            "{what}: {named} lease statements prepared on the pool's {size} connections (the acquisition and the release, at least)"
        );
    }
    settled::<B>(pool).await;
    B::close(pool).await;
}
