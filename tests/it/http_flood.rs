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
//! The service is the release build of the example, as deployed: a debug
//! build of hyper and axum spends about ten times the CPU per request, and
//! on two shared cores the first burst of 200 connections then queues in
//! the accept loop for longer than a shed request may take.
//!
//! What must hold: every probe answers 200 within 1 s; shed requests get
//! their 503 at once (median under 5 ms, every one under 50 ms, a fifth of
//! the bound, as the client measures its round trip); no admitted request waits longer than the
//! bound for its connection (the handler measures its checkout and reports it
//! in `x-checkout-wait-us`); the shed counter counts them; nothing is left
//! checked out afterwards. Throughput with and without the layer is a
//! benchmark row (`benches/workloads/http.rs`), not a timed test.

use crate::support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgwarden_testing::TestServer;
use support::http::{request, sample, KeepAlive, Reply};
use support::service::{Instance, Result};

const CLIENTS: usize = 200;
const HOLD: Duration = Duration::from_millis(50);
const BOUND: Duration = Duration::from_millis(250);
const FLOOD: Duration = Duration::from_secs(4);
/// A checkout that times out at its bound is seen a little after it: the
/// timer's millisecond resolution and the wake-up of the handler's task on
/// a loaded 2-core machine. The bound itself is enforced by the pool.
const TIMER_SLACK: Duration = Duration::from_millis(15);
/// A shed answer's round trip, as the client sees it: the median, and the
/// most any may take (a fifth of the bound: a request that waited for a
/// connection would take the whole bound).
const SHED_MEDIAN: Duration = Duration::from_millis(5);
const SHED_MAX: Duration = Duration::from_millis(50);

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_is_shed_at_once_while_readiness_stays_ready() -> Result {
    let db = TestServer::shared()?.create_database().await?;
    let url = db.url();
    let inst = tokio::task::spawn_blocking(move || {
        Instance::start_binary(
            &support::service::service_binary_release()?,
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
    let path = format!("/work?hold_ms={}", HOLD.as_millis());
    let clients: Vec<_> = conns
        .into_iter()
        .map(|c| {
            let (replies, errors, path) = (replies.clone(), errors.clone(), path.clone());
            tokio::spawn(async move {
                let mut conn = Some(c);
                while Instant::now() < end {
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
    // The readiness probe every 100 ms while the flood lasts.
    let mut probes = Vec::new();
    while Instant::now() < end {
        let tick = tokio::time::sleep(Duration::from_millis(100));
        probes.push(request(addr, "GET", "/health/ready", Duration::from_secs(5)).await);
        tick.await;
    }
    for c in clients {
        c.await?;
    }
    let elapsed = start.elapsed();
    let sent = std::mem::take(&mut *replies.lock().unwrap());
    let replies: Vec<Reply> = sent.iter().map(|(_, r)| r.clone()).collect();
    let errors = std::mem::take(&mut *errors.lock().unwrap());

    // Readiness: 100 % of probes 200 within 1 s.
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
    assert!(probes.len() >= 20, "only {} probes", probes.len());
    assert!(not_ready.is_empty(), "probes not ready: {not_ready:?}");
    assert!(percentile(&mut probe_times, 100.0) < Duration::from_secs(1));

    // Shed: 503 with Retry-After, at once.
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
    // At once: the median shed answer under 5 ms, and none anywhere near
    // the bound (a request that waited for the lane would answer after
    // 250 ms). The times are the client's round trips: the tail is the
    // first burst of 200 connections on two cores shared by the clients,
    // the service and the server (max 8-22 ms in 13 runs), not the layer.
    assert!(
        percentile(&mut shed_times, 50.0) < SHED_MEDIAN,
        "shed answers took a median of {:?}",
        percentile(&mut shed_times, 50.0)
    );
    let slow: Vec<_> = shed.iter().filter(|r| r.took >= SHED_MAX).collect();
    assert!(
        slow.is_empty(),
        "{} of {} shed in {SHED_MAX:?} or more, e.g. {:?}",
        slow.len(),
        shed.len(),
        slow.first()
    );

    // Admitted: the checkout waited at most the bound.
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
    assert!(served >= 30, "only {served} served");
    assert!(
        percentile(&mut waits, 100.0) <= BOUND + TIMER_SLACK,
        "an admitted request waited {:?} for its connection",
        percentile(&mut waits, 100.0)
    );
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
    let in_use = sample(
        &m,
        "pgwarden_lane_in_use",
        "pool=\"service\",lane=\"request\"",
    );
    assert_eq!(
        in_use,
        Some(0.0),
        "request connections left out after the flood"
    );
    drop(inst);
    Ok(())
}
