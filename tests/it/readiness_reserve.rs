//! The readiness reserve nothing else can take, against a real PostgreSQL:
//! a lease holder of another instance paused inside its fenced transaction
//! for 5 s (two and a half TTLs of this instance's own leases), three
//! contenders on this instance polling its lease (each
//! acquisition blocks on the holder's row lock), request traffic filling the
//! request lane. The probe answers every time, and this instance's own
//! leases are renewed, not lost. On every backend: the scenario is the
//! benchmark's (`benches/workloads/paused_holder.rs`), generic over
//! [`Backend`].

#[path = "../../benches/workloads/paused_holder.rs"]
#[allow(dead_code)]
mod paused_holder;

use std::time::{Duration, Instant};

use crate::support;
use crate::support::backend::{settled, Backend, Settings};
use pgwarden::Lane;
use pgwarden_testing::TestServer;

backends!(
    readiness_and_renewals_hold_while_acquisitions_block_on_a_paused_holder,
    flavor = "multi_thread",
    worker_threads = 2
);
async fn readiness_and_renewals_hold_while_acquisitions_block_on_a_paused_holder<B: Backend>() {
    let db = TestServer::shared()
        .expect("throwaway PostgreSQL")
        .create_database()
        .await
        .expect("fresh database");
    // The benchmark's 10 s hold, halved: 5 s still outlasts the own leases'
    // TTL (2 s) twice over, so a renewal held up by the blocked
    // acquisitions would lose them.
    let s = paused_holder::Setup {
        hold: std::time::Duration::from_secs(5),
        ..paused_holder::Setup::default()
    };
    let o = paused_holder::run::<B>(&db, s).await.unwrap();
    eprintln!(
        "{}: probes {}/{} ok, p50 {:?}, p99 {:?}, max {:?}; own leases lost {}, renewed {} \
         ({} failed statements); acquisitions {} ({} errors); requests {}",
        B::NAME,
        o.probes_ok,
        o.probes.len(),
        o.probe_percentile(50.0),
        o.probe_percentile(99.0),
        o.probe_percentile(100.0),
        o.own_lost,
        o.renewed,
        o.renewal_failures,
        o.attempts,
        o.attempt_errors,
        o.requests,
    );
    // One probe every 100 ms for 5 s (fewer when a probe runs long).
    assert!(o.probes.len() >= 25, "{} probes", o.probes.len());
    assert_eq!(o.probes_ok, o.probes.len(), "every probe answered");
    assert!(o.probe_percentile(100.0) < s.probe_bound);
    assert_eq!(o.own_lost, 0, "own leases lost");
    // Three leases renewed every 500 ms for 5 s: about 30 renewals.
    assert!(o.renewed >= 15, "{} renewals", o.renewed);
    // The scenario did what it says: acquisitions were attempted and the
    // request lane was busy.
    assert!(o.attempts >= 1 && o.requests >= 100, "{o:?}");
}

/// How many probes of `bound` it takes until one is ready (at most `max`;
/// the errors of those that were not, for the message).
async fn probes_until_ready<B: Backend>(
    pool: &B::Pool,
    bound: Duration,
    max: usize,
) -> Result<usize, Vec<String>> {
    let mut errors = Vec::new();
    for n in 1..=max {
        match B::readiness(pool, bound).await {
            Ok(_) => return Ok(n),
            Err(e) => errors.push(e.to_string()),
        }
    }
    Err(errors)
}

backends!(
    a_hung_idle_connection_costs_readiness_one_probe,
    flavor = "multi_thread",
    worker_threads = 2
);
/// An idle connection whose backend stopped answering (SIGSTOP): the
/// probe that takes it times out at its own bound and closes it; the next
/// one makes a new connection. On sqlx the probe once went through sqlx's
/// ping of the idle connection, inside the checkout, which the probe
/// allowed a set-up's 10 s: probes of 2 s kept timing out for 10 s (ready
/// at the sixth). Counted in probes, not timed: a probe whose new
/// connection outlasts its bound on a loaded machine leaves it to the
/// next, so three are allowed.
async fn a_hung_idle_connection_costs_readiness_one_probe<B: Backend>() {
    let db = support::db().await;
    let pool = B::build(&db, &Settings::new("hung-idle", 4));
    let pids = idle::<B>(&pool, 1).await;
    assert_eq!(B::status(&pool).size, 1, "one idle connection");
    let stopped = support::Stopped::stop(pids).unwrap();
    let n = probes_until_ready::<B>(&pool, Duration::from_secs(2), 3).await;
    drop(stopped);
    let n = n.unwrap_or_else(|e| panic!("{}: not ready within 3 probes: {e:?}", B::NAME));
    assert!(n >= 2, "{}: the hung connection answered a probe", B::NAME);
}

backends!(
    a_probe_passes_over_idle_connections_whose_sessions_ended,
    flavor = "multi_thread",
    worker_threads = 2
);
/// Every idle connection's session ended on the server (terminated: a
/// restart, a network blip, a failover look the same to the pool): the
/// first probe is ready, on a new connection. sqlx's probe takes an idle
/// connection without its ping (see above): its `SELECT 1` fails on each
/// dead one, which is closed and the next one taken.
async fn a_probe_passes_over_idle_connections_whose_sessions_ended<B: Backend>() {
    let db = support::db().await;
    let pool = B::build(&db, &Settings::new("ended-idle", 4));
    // Three: the request lane's share of four (one is the probe's).
    let pids = idle::<B>(&pool, 3).await;
    assert_eq!(B::status(&pool).size, 3, "three idle connections");
    let admin = support::admin(&db).await;
    admin
        .execute(
            "SELECT pg_terminate_backend(p) FROM unnest($1::int[]) p",
            &[&pids],
        )
        .await
        .unwrap();
    support::eventually(Duration::from_secs(60), "the sessions gone", || async {
        for &pid in &pids {
            if support::alive(&admin, pid).await {
                return false;
            }
        }
        true
    })
    .await;
    let r = B::readiness(&pool, Duration::from_secs(30)).await;
    assert!(r.is_ok(), "{}: the first probe: {r:?}", B::NAME);
}

/// `n` idle connections on `pool`, their pids.
async fn idle<B: Backend>(pool: &B::Pool, n: usize) -> Vec<i32> {
    let mut held = Vec::new();
    for _ in 0..n {
        held.push(B::get(pool).await.unwrap());
    }
    let pids: Vec<i32> = held.iter().map(B::pid).collect();
    drop(held);
    settled::<B>(pool).await;
    pids
}

backends!(
    dropped_caller_probe_on_hung_idle,
    flavor = "multi_thread",
    worker_threads = 2
);
/// A probe run in the caller's task (another one runs in the background)
/// whose caller drops it while its `SELECT 1` waits on a hung idle
/// connection: the connection is closed, never handed back. (sqlx pings a
/// connection it takes back, with no bound: handed back, it held the
/// probe lane until the backend came back: not ready within 12 probes of
/// 2 s on sqlx, the hostile reader's probe F1 of stop 44.)
async fn dropped_caller_probe_on_hung_idle<B: Backend>() {
    let db = support::db().await;
    let pool = B::build(&db, &Settings::new("drop-hung", 4));
    let pids = idle::<B>(&pool, 2).await;
    assert_eq!(B::status(&pool).size, 2, "two idle connections");
    let stopped = support::Stopped::stop(pids.clone()).unwrap();
    let p1 = {
        let pool = pool.clone();
        tokio::spawn(async move { B::readiness(&pool, Duration::from_secs(1)).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let p2 = tokio::time::timeout(
        Duration::from_millis(1600),
        B::readiness(&pool, Duration::from_secs(3)),
    )
    .await;
    let r1 = p1.await.unwrap();
    eprintln!(
        "{}: p1 {r1:?}; p2 (dropped at 1.6 s) {p2:?}; status {}",
        B::NAME,
        B::status(&pool)
    );
    let t = Instant::now();
    let n = probes_until_ready::<B>(&pool, Duration::from_secs(2), 12).await;
    let st = B::status(&pool);
    eprintln!(
        "{}: after: {n:?} in {:?}; probe lane in_use {}; status {st}",
        B::NAME,
        t.elapsed(),
        st.lane(Lane::Probe).in_use
    );
    drop(stopped);
    settled::<B>(&pool).await;
    let n = n.unwrap_or_else(|e| {
        panic!(
            "{}: not ready within 12 probes of 2 s (24 s) while a hung idle connection's return \
             was under way (probe lane in_use {}): {e:?}",
            B::NAME,
            st.lane(Lane::Probe).in_use
        )
    });
    assert!(n <= 3, "{}: ready only at probe {n}", B::NAME);
}

backends!(
    overlapping_probes_over_hung_idle,
    flavor = "multi_thread",
    worker_threads = 2
);
/// Probes whose bounds overlap over hung idle connections, nothing
/// cancelled: a background probe that waited on the probe lane past its
/// bound and then got a hung connection asks it all the same (within a
/// probe's bound) and closes it, never hands it back unasked (F1 of stop
/// 44: not ready within 12 probes on sqlx).
async fn overlapping_probes_over_hung_idle<B: Backend>() {
    let db = support::db().await;
    let pool = B::build(&db, &Settings::new("overlap-hung", 4));
    let pids = idle::<B>(&pool, 3).await;
    assert_eq!(B::status(&pool).size, 3, "three idle connections");
    let stopped = support::Stopped::stop(pids.clone()).unwrap();
    let spawn = |t: Duration| {
        let pool = pool.clone();
        tokio::spawn(async move { B::readiness(&pool, t).await })
    };
    let p1 = spawn(Duration::from_secs(1));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let p2 = spawn(Duration::from_secs(3));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let p3 = spawn(Duration::from_secs(1));
    let (r1, r2, r3) = (p1.await.unwrap(), p2.await.unwrap(), p3.await.unwrap());
    tokio::time::sleep(Duration::from_millis(2500)).await;
    eprintln!(
        "{}: p1 {r1:?} p2 {r2:?} p3 {r3:?}; status {}",
        B::NAME,
        B::status(&pool)
    );
    let t = Instant::now();
    let n = probes_until_ready::<B>(&pool, Duration::from_secs(2), 12).await;
    let st = B::status(&pool);
    eprintln!("{}: after {n:?} in {:?}; status {st}", B::NAME, t.elapsed());
    drop(stopped);
    settled::<B>(&pool).await;
    n.unwrap_or_else(|e| {
        panic!(
            "{}: not ready within 12 probes of 2 s (24 s) (probe lane in_use {}): {e:?}",
            B::NAME,
            st.lane(Lane::Probe).in_use
        )
    });
}
