//! The example service on a pool of four under a flood (issue 12.1): 200
//! concurrent clients on `GET /work?hold_ms=50` (each handler holds a request
//! connection 50 ms) behind `pgwarden::http::ShedLayer` with a 250 ms bound,
//! and the readiness probe every 100 ms meanwhile.
//!
//! Clients honour `Retry-After` (with ±50 % jitter, as a load balancer or a
//! well-behaved client does), so the flood offers about 200 requests a
//! second to a lane that serves about 60 (3 request connections × 20 holds
//! a second): it is shed for its whole length.
//!
//! The service is the example as the test build built it (same profile: no
//! build of another profile inside the test). Its answer times depend on
//! that build and on the machine's load (a debug build of hyper and axum
//! spends about ten times the CPU per request): they are printed, not
//! asserted. The flood lasts 4 s, and until 20 probes were answered and 30
//! requests served.
//!
//! What must hold, whatever the machine: every probe answers 200 (the
//! service's readiness answers 503 when its check finds no connection
//! within its own 1 s bound); shed requests get their 503 from the layer
//! without reaching a checkout (no `x-checkout-wait-us`: the handler never
//! ran), with `Retry-After`; every admitted request had the layer's bound
//! as its checkout bound (`x-checkout-bound-us`) and was served or answered
//! 503 by its handler when the pool found no connection within it; the shed
//! counter counts them; nothing is left checked out afterwards. That a shed
//! answer is decided at once, without waiting, is shown in process, on
//! every backend, by `a_shed_answer_is_ready_at_its_first_poll` (no
//! clock). The flood runs the example service, which is written on the
//! deadpool pool (`examples/service`): deadpool only. Answer times and
//! throughput with and without the layer are a benchmark row
//! (`benches/workloads/http.rs`, row 8 of BENCHMARKS.md: 503 p99), not a
//! timed test.

use crate::support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgwarden_testing::TestServer;
use support::backend::{Backend, Settings};
use support::http::{request, sample, KeepAlive, Reply};
use support::service::{Instance, Result};

const CLIENTS: usize = 200;
const HOLD: Duration = Duration::from_millis(50);
const BOUND: Duration = Duration::from_millis(250);
const FLOOD: Duration = Duration::from_secs(4);
/// Readiness probes during the flood: it lasts until this many answered…
const PROBES: usize = 20;
/// …and this many requests were served.
const SERVED: usize = 30;

fn percentile(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    if v.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

fn is_shed(r: &Reply) -> bool {
    r.status == 503 && r.body.contains("\"shed\":true")
}

/// Deadpool only: the service is `examples/service`, written on the
/// deadpool pool's own API (see the module's docs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_is_shed_at_once_while_readiness_stays_ready() -> Result {
    let db = TestServer::shared()?.create_database().await?;
    let url = db.url();
    let inst = tokio::task::spawn_blocking(move || {
        Instance::start_binary(
            &support::service::service_binary()?,
            &url,
            "flood",
            "node-a",
            &[("POOL_SIZE", "4"), ("SHED_MAX_WAIT_MS", "250")],
        )
    })
    .await??;
    let addr = inst.addr;
    let r = request(addr, "GET", "/health/ready", Duration::from_secs(2)).await?;
    assert_eq!(r.status, 200, "not ready before the flood: {}", r.body);

    // (when sent, after the flood began; the answer)
    let replies: Arc<Mutex<Vec<(Duration, Reply)>>> = Arc::default();
    let errors: Arc<Mutex<Vec<String>>> = Arc::default();
    // One kept-alive connection per client, as a load balancer keeps them,
    // all open before the flood: each answer's time is the request's own.
    let mut conns = Vec::new();
    for _ in 0..CLIENTS {
        conns.push(KeepAlive::connect(addr).await?);
    }
    let start = Instant::now();
    let end = start + FLOOD;
    let flooding = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let path = format!("/work?hold_ms={}", HOLD.as_millis());
    let clients: Vec<_> = conns
        .into_iter()
        .map(|c| {
            let (replies, errors, path) = (replies.clone(), errors.clone(), path.clone());
            let flooding = flooding.clone();
            tokio::spawn(async move {
                let mut conn = Some(c);
                while flooding.load(std::sync::atomic::Ordering::Relaxed) {
                    if conn.is_none() {
                        match KeepAlive::connect(addr).await {
                            Ok(c) => conn = Some(c),
                            Err(e) => {
                                errors.lock().unwrap().push(e.to_string());
                                tokio::time::sleep(Duration::from_millis(100)).await;
                                continue;
                            }
                        }
                    }
                    let Some(c) = conn.as_mut() else { continue };
                    let r = match c.send("GET", &path, Duration::from_secs(10)).await {
                        Ok(r) => r,
                        Err(e) => {
                            errors.lock().unwrap().push(e.to_string());
                            conn = None;
                            continue;
                        }
                    };
                    let pause = r.header_u64("retry-after").filter(|_| r.status == 503);
                    let sent = (start.elapsed().saturating_sub(r.took), r);
                    replies.lock().unwrap().push(sent);
                    if let Some(secs) = pause {
                        let jitter = 0.5 + rand::random::<f64>();
                        tokio::time::sleep(Duration::from_secs(secs).mul_f64(jitter)).await;
                    }
                }
            })
        })
        .collect();
    // The readiness probe every 100 ms while the flood lasts: 4 s, and
    // until PROBES were answered however slow the machine.
    let mut probes = Vec::new();
    let served_so_far = || {
        replies
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, r)| r.status == 200)
            .count()
    };
    while Instant::now() < end || probes.len() < PROBES || served_so_far() < SERVED {
        // Only against a hang: the assertions below say what was missing.
        if start.elapsed() > Duration::from_secs(300) {
            break;
        }
        let tick = tokio::time::sleep(Duration::from_millis(100));
        probes.push(request(addr, "GET", "/health/ready", Duration::from_secs(30)).await);
        tick.await;
    }
    flooding.store(false, std::sync::atomic::Ordering::Relaxed);
    for c in clients {
        c.await?;
    }
    let elapsed = start.elapsed();
    let sent = std::mem::take(&mut *replies.lock().unwrap());
    let replies: Vec<Reply> = sent.iter().map(|(_, r)| r.clone()).collect();
    let errors = std::mem::take(&mut *errors.lock().unwrap());

    // Readiness: 100 % of probes 200 (within the service's own bound).
    let probes: Vec<Reply> = probes.into_iter().collect::<Result<_>>()?;
    let mut probe_times: Vec<Duration> = probes.iter().map(|p| p.took).collect();
    let not_ready: Vec<_> = probes.iter().filter(|p| p.status != 200).collect();
    say!(
        "readiness during the flood: {}/{} answered 200; p50 {:?}, max {:?}",
        probes.len() - not_ready.len(),
        probes.len(),
        percentile(&mut probe_times, 50.0),
        percentile(&mut probe_times, 100.0)
    );
    assert!(probes.len() >= PROBES, "only {} probes", probes.len());
    assert!(not_ready.is_empty(), "probes not ready: {not_ready:?}");

    // Shed: 503 with Retry-After, from the layer (no checkout).
    let shed: Vec<&Reply> = replies.iter().filter(|r| is_shed(r)).collect();
    let mut shed_times: Vec<Duration> = shed.iter().map(|r| r.took).collect();
    say!(
        "shed: {} requests; 503 after p50 {:?}, p99 {:?}, max {:?}",
        shed.len(),
        percentile(&mut shed_times, 50.0),
        percentile(&mut shed_times, 99.0),
        percentile(&mut shed_times, 100.0)
    );
    assert!(
        shed.len() >= CLIENTS / 2,
        "the flood was hardly shed: {}",
        shed.len()
    );
    assert!(shed
        .iter()
        .all(|r| r.header_u64("retry-after").is_some_and(|s| s >= 1)));
    let reached_a_checkout: Vec<_> = shed
        .iter()
        .filter(|r| r.header("x-checkout-wait-us").is_some())
        .collect();
    assert!(
        reached_a_checkout.is_empty(),
        "shed answers from a handler that waited for a connection: {reached_a_checkout:?}"
    );

    // Admitted: the checkout had the layer's bound (the pool enforces it:
    // `deadline.rs`); the waits are figures.
    let admitted: Vec<&Reply> = replies.iter().filter(|r| !is_shed(r)).collect();
    let served = admitted.iter().filter(|r| r.status == 200).count();
    let mut waits = Vec::new();
    for r in &admitted {
        let wait = r
            .header_u64("x-checkout-wait-us")
            .map(Duration::from_micros)
            .ok_or_else(|| format!("an admitted answer without its checkout wait: {r:?}"))?;
        let bound = r
            .header_u64("x-checkout-bound-us")
            .map(Duration::from_micros);
        assert!(
            bound.is_some_and(|b| b <= BOUND),
            "checkout bound {bound:?} over {BOUND:?}"
        );
        waits.push(wait);
    }
    let timed_out = admitted.iter().filter(|r| r.status == 503).count();
    // Until the request lane has seen holds of 50 ms, its recent hold time
    // is that of the service's start-up statements: the first burst is
    // admitted beyond what the bound can serve (each such request waits the
    // bound, then gets the handler's 503). After it, few are.
    let first_burst = sent
        .iter()
        .filter(|(at, r)| r.status == 503 && !is_shed(r) && *at < HOLD * 2)
        .count();
    say!(
        "admitted: {} ({served} served, {timed_out} found no connection within the bound, \
         {first_burst} of them sent in the first {:?}); \
         checkout wait p50 {:?}, p99 {:?}, max {:?} (bound {BOUND:?}); \
         served {:.1}/s over {elapsed:.1?}; {} client errors",
        admitted.len(),
        HOLD * 2,
        percentile(&mut waits, 50.0),
        percentile(&mut waits, 99.0),
        percentile(&mut waits, 100.0),
        served as f64 / elapsed.as_secs_f64(),
        errors.len()
    );
    assert!(served >= SERVED, "only {served} served");
    assert!(
        admitted.iter().all(|r| r.status == 200 || r.status == 503),
        "admitted requests failed otherwise: {:?}",
        admitted
            .iter()
            .filter(|r| r.status != 200 && r.status != 503)
            .collect::<Vec<_>>()
    );
    assert!(errors.is_empty(), "client errors: {errors:?}");

    // The shed counter counts them; nothing is left checked out.
    let m = request(addr, "GET", "/metrics", Duration::from_secs(5))
        .await?
        .body;
    let counted = sample(
        &m,
        "pgwarden_requests_shed_total",
        "pool=\"service\",reason=\"busy\"",
    );
    assert_eq!(
        counted,
        Some(shed.len() as f64),
        "shed counter vs shed answers"
    );
    let admitted_counted = sample(&m, "pgwarden_requests_admitted_total", "pool=\"service\"");
    assert_eq!(admitted_counted, Some(admitted.len() as f64));
    // Nothing left checked out: a handler's connection goes back as its
    // future ends, which can be a moment after its answer was written
    // (a cold run, stop 43: 1 still out at the first look). A leak stays.
    let settle = Instant::now() + Duration::from_secs(10);
    let mut m = m;
    let in_use = loop {
        let in_use = sample(
            &m,
            "pgwarden_lane_in_use",
            "pool=\"service\",lane=\"request\"",
        );
        if in_use == Some(0.0) || Instant::now() > settle {
            break in_use;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        m = request(addr, "GET", "/metrics", Duration::from_secs(5))
            .await?
            .body;
    };
    assert_eq!(
        in_use,
        Some(0.0),
        "request connections left out after the flood"
    );
    drop(inst);
    Ok(())
}

backends!(a_shed_answer_is_ready_at_its_first_poll);
/// A shed answer is decided when the request arrives, not after a wait:
/// with every request connection held and a bound of zero, the layer's
/// future is ready at its first poll (no clock: a layer that waited for
/// the lane would be pending there). On every backend. The flood above
/// shows the same layer at scale, in a real process.
async fn a_shed_answer_is_ready_at_its_first_poll<B: Backend>() {
    use futures_util::FutureExt;
    use tower_service::Service;

    let db = support::db().await;
    let pool = B::build(&db, &Settings::new("flood-first-poll", 4));
    let max = B::status(&pool).lane(pgwarden::Lane::Request).max;
    let mut held = Vec::new();
    for _ in 0..max {
        held.push(B::get(&pool).await.unwrap());
    }
    let work = axum::Router::new().route(
        "/work",
        axum::routing::get(|| async {
            panic!("a shed request reached its handler");
            #[allow(unreachable_code)]
            "served"
        }),
    );
    let mut app = B::shed(&pool, Some(Duration::ZERO), work);
    let req = axum::http::Request::get("/work")
        .body(axum::body::Body::empty())
        .unwrap();
    let reply = app
        .call(req)
        .now_or_never()
        .expect("the shed answer is ready at its first poll")
        .unwrap();
    assert_eq!(reply.status(), 503);
    assert!(reply.headers().contains_key("retry-after"));
    assert_eq!(B::status(&pool).lane(pgwarden::Lane::Request).waiting, 0);
    drop(held);
    support::backend::settled::<B>(&pool).await;
}
