//! Readiness on a slow link (issue 16, point 9): with a 350 ms round trip
//! (a TCP proxy adds 175 ms each way) and no idle connection, making a
//! connection and asking it `SELECT 1` takes longer than a 1 s probe; the
//! probe's work goes on in the background past its bound, so a later probe
//! of `readiness(1 s)` succeeds (the 2nd or 3rd on a quiet machine; how
//! many is printed, not asserted: it depends on the machine's load). A probe
//! whose work was dropped at its bound would never succeed: the runs are
//! bounded only against that hang. Then a probe of the idle connection
//! answers within the bound (one round trip). On every backend.

use std::time::{Duration, Instant};

use crate::support;

use pgwarden::PoolerMode;
use pgwarden_testing::{Proxy, TestServer};
use support::backend::{Backend, Settings};

const BOUND: Duration = Duration::from_secs(1);
const RUNS: usize = 5;
/// Only against a hang: the probes of one run end well within it.
const GUARD: Duration = Duration::from_secs(60);

// On sqlx this was a FINDING (session 39): a probe of an idle connection
// took three round trips (1.06 s here against deadpool's 0.35 s: waiting
// for the previous checkout's return, whose sqlx ping is a round trip,
// sqlx's `test_before_acquire` ping, then `SELECT 1`), and never came in
// within 1 s. The probe now asks nothing more of a connection the server
// answered during its checkout (sqlx's ping of an idle one, pgwarden's
// naming or pid statement): one round trip.
backends!(
    readiness_becomes_ready_within_three_probes_on_a_350_ms_link,
    flavor = "multi_thread",
    worker_threads = 2
);
async fn readiness_becomes_ready_within_three_probes_on_a_350_ms_link<B: Backend>() {
    let server = TestServer::shared().expect("throwaway PostgreSQL");
    let db = server.create_database().await.unwrap();
    let proxy = Proxy::start(server).expect("proxy");
    proxy.set_latency(Duration::from_millis(175));

    // The premise: from scratch, connecting and two statements (the pool's
    // backend-pid query, the probe's SELECT 1) take longer than the bound.
    let t = Instant::now();
    let raw = proxy.connect(&db).await.unwrap();
    raw.simple_query("SELECT pg_backend_pid()").await.unwrap();
    raw.simple_query("SELECT 1").await.unwrap();
    let from_scratch = t.elapsed();
    drop(raw);
    assert!(
        from_scratch > BOUND,
        "set-up and SELECT 1 took {from_scratch:?}"
    );

    // The runs are independent (a pool of their own each, through the one
    // proxy): all at once, not one after another (2 s each).
    let run = |run: usize| {
        let (proxy, db) = (&proxy, &db);
        async move {
            let s = Settings::new("slow-link", 4).pooler(PoolerMode::Direct);
            let pool = B::build_on(&proxy.pg_config(db), &s);
            assert_eq!(B::status(&pool).size, 0, "no idle connection to start with");
            let mut ready = None;
            let mut answers = Vec::new();
            let started = Instant::now();
            for probe in 1.. {
                if started.elapsed() > GUARD {
                    break;
                }
                let t = Instant::now();
                let r = B::readiness(&pool, BOUND).await;
                let took = t.elapsed();
                answers.push(format!(
                    "{took:.0?} {}",
                    if r.is_ok() { "ok" } else { "timeout" }
                ));
                match r {
                    Ok(latency) => {
                        // Answered within its bound, as pgwarden measured it.
                        assert!(latency <= BOUND, "probe {probe}: ready after {latency:?}");
                        ready = Some((probe, latency));
                        break;
                    }
                    Err(e) => assert!(e.is_timeout(), "probe {probe}: {e}"),
                }
            }
            let Some((n, latency)) = ready else {
                panic!("run {run}: not ready within {GUARD:?}: {answers:?}");
            };
            // Then a probe of the idle connection (once its return is done):
            // within the bound (three round trips, as sqlx took before, are
            // 1.05 s); one round trip, printed.
            support::eventually(GUARD, "the connection idle again", || async {
                let st = B::status(&pool);
                st.size >= 1 && st.idle == st.size
            })
            .await;
            let idle = B::readiness(&pool, BOUND).await;
            let idle =
                idle.unwrap_or_else(|e| panic!("run {run}: a probe of the idle connection: {e}"));
            eprintln!(
                "{}: run {run}: ready at probe {n} ({latency:.0?}); probes: {answers:?}; \
                 then one of the idle connection: {idle:.0?}",
                B::NAME
            );
            n
        }
    };
    let probes_until_ready = futures_util::future::join_all((0..RUNS).map(run)).await;
    eprintln!(
        "{}: 350 ms round trip, set-up and SELECT 1 from scratch {} ms: probes until ready over {RUNS} runs: {probes_until_ready:?}",
        B::NAME,
        from_scratch.as_millis()
    );
}

backends!(
    a_probe_and_a_checkout_cut_at_every_poll_while_connecting_leave_nothing_behind,
    flavor = "multi_thread",
    worker_threads = 2
);
/// The paths of stop 40 dropped at every await: a probe (waiting for the
/// set-up another probe left in the background) and a drop-in
/// checkout (on sqlx: its acquire racing pgwarden's own connection
/// attempt, which a 30 ms link makes slower than its first 50 ms of
/// patience), each cut after 0, 1, 2, … polls until one finishes uncut.
/// Whatever the cut, no connection is left open past the pool's size (the
/// proxy counts them, the attempt's own included), and the pool then
/// answers a probe and a checkout.
async fn a_probe_and_a_checkout_cut_at_every_poll_while_connecting_leave_nothing_behind<
    B: Backend,
>() {
    let server = TestServer::shared().expect("throwaway PostgreSQL");
    let db = server.create_database().await.unwrap();
    let proxy = Proxy::start(server).expect("proxy");
    proxy.set_latency(Duration::from_millis(15));
    const SIZE: usize = 4;
    let (mut cut_probes, mut cut_gets) = (0, 0);
    for get in [false, true] {
        for polls in 0usize.. {
            // A pool of its own each time: no idle connection, so sqlx
            // connects (and pgwarden's patience starts from nothing).
            let s = Settings::new("slow-link-cut", SIZE).pooler(PoolerMode::Direct);
            let pool = B::build_on(&proxy.pg_config(&db), &s);
            if !get {
                // A probe given up at once: its set-up goes on in the
                // background, and the probe cut below waits for it.
                let gave_up = B::readiness(&pool, Duration::from_millis(1)).await;
                assert!(gave_up.is_err_and(|e| e.is_timeout()));
            }
            let mut left = polls;
            let mut fut: futures_util::future::BoxFuture<'_, bool> = if get {
                Box::pin(async { B::get(&pool).await.is_ok() })
            } else {
                Box::pin(async { B::readiness(&pool, GUARD).await.is_ok() })
            };
            let out = std::future::poll_fn(|cx| match left.checked_sub(1) {
                None => std::task::Poll::Ready(None),
                Some(l) => {
                    left = l;
                    fut.as_mut().poll(cx).map(Some)
                }
            })
            .await;
            drop(fut);
            support::eventually(
                GUARD,
                "no more connections than the pool's size",
                || async { proxy.connections() <= SIZE },
            )
            .await;
            let probe = support::within(GUARD, "a probe after the cut", B::readiness(&pool, GUARD));
            probe.await.expect("ready after the cut");
            support::within(GUARD, "a checkout after the cut", B::get(&pool))
                .await
                .unwrap_or_else(|e| panic!("a checkout after the cut: {e:?}"));
            B::close(&pool).await;
            match out {
                Some(ok) => {
                    assert!(ok, "uncut after {polls} polls");
                    break;
                }
                None if get => cut_gets += 1,
                None => cut_probes += 1,
            }
        }
    }
    eventually_closed(&proxy).await;
    eprintln!(
        "{}: probes cut {cut_probes} times, checkouts {cut_gets}",
        B::NAME
    );
    assert!(cut_probes > 0 && cut_gets > 0);
}

/// Every pool closed: nothing open through the proxy.
async fn eventually_closed(proxy: &Proxy) {
    support::eventually(GUARD, "every connection closed", || async {
        proxy.connections() == 0
    })
    .await;
}

// Stop 43: a probe that bounded its checkout by its own bound whenever a
// connection was idle (so that a hung idle connection would not hold the
// probe lane for the set-up bound on sqlx) was tried and reverted: when
// every idle connection is dead, sqlx's ping of each fails at once and it
// makes a new connection inside the same checkout, which that bound cut.
// Readiness came back one probe per dead idle connection (probe 8 to 9
// with 6 dead, against 2), found by the hostile reader.
backends!(
    readiness_comes_back_after_every_idle_connection_died_on_a_slow_link,
    flavor = "multi_thread",
    worker_threads = 2
);
/// A 350 ms link, the pool's `DEAD` idle connections all cut at once (a
/// network blip, a failover, a restarted pooler), then `readiness(1 s)`
/// back to back: ready before one probe per dead connection has been
/// spent. Asserted with room for a loaded machine: the probe's work goes
/// on in the background for up to 10 s, so only a set-up slower than
/// `DEAD` probes (8 s) fails it, while a probe that spent one probe per
/// dead idle connection could not be ready before probe `DEAD + 1`.
async fn readiness_comes_back_after_every_idle_connection_died_on_a_slow_link<B: Backend>() {
    const DEAD: usize = 8;
    let server = TestServer::shared().expect("throwaway PostgreSQL");
    let db = server.create_database().await.unwrap();
    let proxy = Proxy::start(server).expect("proxy");
    proxy.set_latency(Duration::from_millis(175));
    let s = Settings::new("slow-link-dead", DEAD + 1).pooler(PoolerMode::Direct);
    let pool = B::build_on(&proxy.pg_config(&db), &s);
    // DEAD idle connections: all checked out at once, then given back.
    let conns =
        futures_util::future::join_all((0..DEAD).map(|_| B::get_within(&pool, GUARD))).await;
    let conns: Vec<_> = conns.into_iter().map(|c| c.unwrap()).collect();
    drop(conns);
    support::eventually(GUARD, "all idle", || async {
        let st = B::status(&pool);
        st.size == DEAD && st.idle == DEAD && st.in_use == 0
    })
    .await;
    assert_eq!(proxy.reset_all(), DEAD);

    let started = Instant::now();
    let mut answers = Vec::new();
    let ready_at = loop {
        assert!(started.elapsed() < GUARD, "never ready: {answers:?}");
        let r = B::readiness(&pool, BOUND).await;
        answers.push(match &r {
            Ok(took) => format!("ok {took:.0?}"),
            Err(e) => e.to_string(),
        });
        if r.is_ok() {
            break answers.len();
        }
    };
    eprintln!(
        "{}: {DEAD} dead idle connections on a 350 ms link, ready at probe {ready_at}: {answers:?}",
        B::NAME
    );
    assert!(
        ready_at <= DEAD,
        "{}: one probe per dead idle connection: ready at probe {ready_at}: {answers:?}",
        B::NAME
    );
    // Nothing left checked out, nothing past the pool's size.
    support::eventually(GUARD, "nothing checked out", || async {
        B::status(&pool).in_use == 0 && proxy.connections() <= DEAD + 1
    })
    .await;
    B::close(&pool).await;
}
