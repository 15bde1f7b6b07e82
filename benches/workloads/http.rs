//! Workload 8: served throughput under an HTTP flood, without (A) and with
//! (B) `pgwarden::http::ShedLayer`.
//!
//! An axum service in this process on a pool of 4 (request lane: 3), one
//! route whose handler takes a request connection, runs `SELECT 1` and
//! holds the connection 50 ms; 200 clients on kept-alive connections, each
//! sending its next request as soon as it has its answer, and after a 503
//! waiting its `Retry-After` (±50 % jitter). Without the layer every request
//! queues for a connection; with it, requests past the 250 ms bound are
//! answered 503 at once. Served throughput: 200 answers completed within
//! the round, per second.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use pgwarden::http::ShedLayer;
use pgwarden::Pool;
use pgwarden_testing::TestServer;

use crate::ab::{interleave, median, percentile, ratio, spread};
use crate::http_client::KeepAlive;
use crate::{BoxError, Row, Settings};

const CLIENTS: usize = 200;
const POOL: usize = 4;
const HOLD: Duration = Duration::from_millis(50);
const BOUND: Duration = Duration::from_millis(250);

fn plan(s: Settings) -> (usize, Duration) {
    if s.smoke {
        (1, Duration::from_millis(500))
    } else {
        (s.rounds, Duration::from_secs(4))
    }
}

pub fn describe(s: Settings) -> String {
    let (rounds, round) = plan(s);
    format!(
        "8: an axum service in the bench process, pool {POOL} (request lane 3), one route: \
         `get` + `SELECT 1` + hold the connection {HOLD:?}; {CLIENTS} clients on kept-alive \
         connections, the next request as soon as the answer is in, after a 503 a pause of its \
         `Retry-After` × U(0.5, 1.5); A: no layer (requests queue for a connection, pool wait \
         timeout 30 s); B: `ShedLayer` with a {BOUND:?} bound; served = 200 answers completed \
         within the round; {rounds} interleaved round pairs of {round:?}, each side draining its \
         requests in flight before the next round"
    )
}

/// One side's round: 200 answers per second, and latencies.
#[derive(Default)]
struct Round {
    served_per_s: f64,
    shed_per_s: f64,
    /// Answer times of served requests, and of shed ones.
    served_ms: Vec<f64>,
    shed_ms: Vec<f64>,
}

async fn serve(pool: &Pool, shed: bool) -> Result<SocketAddr, BoxError> {
    let p = pool.clone();
    let mut app = Router::new().route(
        "/work",
        get(move || {
            let p = p.clone();
            async move {
                let Ok(c) = p.get().await else {
                    return StatusCode::SERVICE_UNAVAILABLE;
                };
                if c.simple_query("SELECT 1").await.is_err() {
                    return StatusCode::INTERNAL_SERVER_ERROR;
                }
                tokio::time::sleep(HOLD).await;
                StatusCode::OK
            }
        }),
    );
    if shed {
        app = app.layer(ShedLayer::new(pool).max_wait(BOUND));
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

async fn flood(addr: SocketAddr, round: Duration) -> Round {
    let mut conns = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        match KeepAlive::connect(addr).await {
            Ok(c) => conns.push(c),
            Err(e) => eprintln!("workload 8: connect: {e}"),
        }
    }
    let start = Instant::now();
    let end = start + round;
    let served = Arc::new(AtomicU64::new(0));
    let shed = Arc::new(AtomicU64::new(0));
    let times: Arc<Mutex<(Vec<f64>, Vec<f64>)>> = Arc::default();
    let tasks: Vec<_> = conns
        .into_iter()
        .map(|mut c| {
            let (served, shed, times) = (served.clone(), shed.clone(), times.clone());
            tokio::spawn(async move {
                while Instant::now() < end {
                    let Ok(r) = c.send("GET", "/work", Duration::from_secs(60)).await else {
                        return;
                    };
                    let ms = r.took.as_secs_f64() * 1000.0;
                    let in_round = Instant::now() <= end;
                    if r.status == 200 {
                        if in_round {
                            served.fetch_add(1, Ordering::Relaxed);
                        }
                        times.lock().unwrap().0.push(ms);
                    } else if let Some(secs) = r.header_u64("retry-after") {
                        if in_round {
                            shed.fetch_add(1, Ordering::Relaxed);
                        }
                        times.lock().unwrap().1.push(ms);
                        let jitter = 0.5 + rand::random::<f64>();
                        tokio::time::sleep(Duration::from_secs(secs).mul_f64(jitter)).await;
                    }
                }
            })
        })
        .collect();
    // Every request in flight is answered (drained) before the next round.
    for t in tasks {
        let _ = t.await;
    }
    let secs = round.as_secs_f64();
    let (served_ms, shed_ms) = std::mem::take(&mut *times.lock().unwrap());
    Round {
        served_per_s: served.load(Ordering::Relaxed) as f64 / secs,
        shed_per_s: shed.load(Ordering::Relaxed) as f64 / secs,
        served_ms,
        shed_ms,
    }
}

pub async fn shedding(server: &TestServer, s: Settings) -> Result<Row, BoxError> {
    let (rounds, round) = plan(s);
    let db = server.create_database().await?;
    let pool = |name: &str| -> Result<Pool, BoxError> {
        Ok(Pool::builder(db.deadpool(POOL)?).name(name).build()?)
    };
    let (plain, shedding) = (pool("bench-http-plain")?, pool("bench-http-shed")?);
    let a_addr = serve(&plain, false).await?;
    let b_addr = serve(&shedding, true).await?;
    let rounds_a: Arc<Mutex<Vec<Round>>> = Arc::default();
    let rounds_b: Arc<Mutex<Vec<Round>>> = Arc::default();
    let (a, b) = interleave(
        rounds,
        || {
            let out = rounds_a.clone();
            async move {
                let r = flood(a_addr, round).await;
                let v = r.served_per_s;
                out.lock().unwrap().push(r);
                v
            }
        },
        || {
            let out = rounds_b.clone();
            async move {
                let r = flood(b_addr, round).await;
                let v = r.served_per_s;
                out.lock().unwrap().push(r);
                v
            }
        },
    )
    .await;
    let ra = std::mem::take(&mut *rounds_a.lock().unwrap());
    let rb = std::mem::take(&mut *rounds_b.lock().unwrap());
    let all = |rs: &[Round], f: fn(&Round) -> &Vec<f64>| -> Vec<f64> {
        rs.iter().flat_map(|r| f(r).iter().copied()).collect()
    };
    let a_ms = all(&ra, |r| &r.served_ms);
    let b_ms = all(&rb, |r| &r.served_ms);
    let b_shed_ms = all(&rb, |r| &r.shed_ms);
    let b_shed: Vec<f64> = rb.iter().map(|r| r.shed_per_s).collect();
    let r = ratio(&a, &b);
    let (pa, pb) = (plain.status(), shedding.status());
    Ok(Row {
        id: "8",
        workload: format!(
            "HTTP flood: {CLIENTS} clients, handlers hold a connection {HOLD:?}, pool {POOL}: served throughput"
        ),
        a: format!(
            "no layer: {:.1} served/s; answer p50 {:.0} ms, p99 {:.0} ms",
            median(&a),
            percentile(&a_ms, 50.0),
            percentile(&a_ms, 99.0)
        ),
        b: format!(
            "`ShedLayer` ({BOUND:?}): {:.1} served/s; answer p50 {:.0} ms, p99 {:.0} ms; {:.0} shed/s, 503 p99 {:.1} ms, max {:.1} ms",
            median(&b),
            percentile(&b_ms, 50.0),
            percentile(&b_ms, 99.0),
            median(&b_shed),
            percentile(&b_shed_ms, 99.0),
            percentile(&b_shed_ms, 100.0)
        ),
        ratio: format!("{r:.3}"),
        target: "≥ 0.95",
        met: (!s.smoke).then_some(r >= 0.95),
        notes: format!(
            "{}; in use after the rounds: {} and {}",
            spread(&a, &b),
            pa.in_use,
            pb.in_use
        ),
    })
}
