//! Workload 8: an HTTP service without (A) and with (B)
//! `pgwarden::http::ShedLayer`, at two loads.
//!
//! An axum service in this process on a pool of 4 (request lane: 3), one
//! route whose handler takes a request connection, runs `SELECT 1` and
//! holds the connection 50 ms: the lane serves at most 60 requests/s.
//!
//! - Flood: 200 clients on kept-alive connections, each sending its next
//!   request as soon as it has its answer, and after a 503 waiting its
//!   `Retry-After` (±50 %). Without the layer every request queues for a
//!   connection and both sides serve what the lane serves; the layer changes
//!   when clients hear back. Measured: the share of answers (served or shed)
//!   past the client's patience (1 s), and the p99 of all answers.
//! - Under capacity: requests arriving at random (Poisson, 40/s, two
//!   thirds of what the lane serves; the same arrival times for both sides
//!   of a pair), each on its own connection. The layer must cost nothing
//!   here: served throughput, pgwarden with the layer against without.

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

use crate::ab::{all, interleave, median, percentile, Compared};
use crate::http_client::KeepAlive;
use crate::{BoxError, Row, Settings};

const CLIENTS: usize = 200;
const POOL: usize = 4;
const HOLD: Duration = Duration::from_millis(50);
const BOUND: Duration = Duration::from_millis(250);
/// How long a client waits for an answer before it counts as too late.
const PATIENCE: Duration = Duration::from_secs(1);
/// Arrivals per second under capacity (the lane serves 3 / 50 ms = 60/s).
const STEADY_RATE: f64 = 40.0;
/// Targets, with the layer against without: answers past the client's
/// patience at most a tenth, the p99 of all answers at most half, served
/// throughput under capacity at least 0.95 times.
const LATE_TARGET: f64 = 0.1;
const P99_TARGET: f64 = 0.5;
const STEADY_TARGET: f64 = 0.95;

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
        "8: an axum service in the bench process, pool {POOL} (request lane 3, at most 60 \
         requests/s), one route: `get` + `SELECT 1` + hold the connection {HOLD:?}; A: no layer \
         (requests queue for a connection, the default pool wait timeout of 30 s); B: `ShedLayer` \
         with a {BOUND:?} bound; flood: {CLIENTS} clients on kept-alive connections, the next \
         request as soon as the answer is in, after a 503 a pause of its `Retry-After` × U(0.5, \
         1.5), answers of requests sent within the round (drained after it) timed from the \
         request, late = past {PATIENCE:?}; under capacity: Poisson arrivals at {STEADY_RATE}/s, \
         the same times for both sides of a pair, one connection per request, served = 200 \
         answers of requests that arrived within the round; {rounds} interleaved round pairs of \
         {round:?} at each load, each side draining its requests in flight before the next round"
    )
}

/// One side's flood round.
#[derive(Default)]
struct Round {
    served_per_s: f64,
    shed_per_s: f64,
    /// Answer times of served requests, and of shed ones.
    served_ms: Vec<f64>,
    shed_ms: Vec<f64>,
}

impl Round {
    fn answers(&self) -> impl Iterator<Item = f64> + '_ {
        self.served_ms.iter().chain(&self.shed_ms).copied()
    }

    /// The share of answers, served or shed, past the client's patience.
    fn late_share(&self) -> f64 {
        let patience = PATIENCE.as_secs_f64() * 1e3;
        let n = self.served_ms.len() + self.shed_ms.len();
        self.answers().filter(|ms| *ms > patience).count() as f64 / n.max(1) as f64
    }

    fn p99_ms(&self) -> f64 {
        percentile(&self.answers().collect::<Vec<_>>(), 99.0)
    }

    /// Served requests answered within the client's patience, per second.
    fn good_per_s(&self, secs: f64) -> f64 {
        let patience = PATIENCE.as_secs_f64() * 1e3;
        self.served_ms.iter().filter(|ms| **ms <= patience).count() as f64 / secs
    }
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
                    // Every request here was sent within the round; the
                    // answer may come after it (drained).
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

/// One side's round under capacity: requests at the arrival times of
/// `seed`, each on its own connection. Served per second, and every answer
/// time (ms, from the arrival).
async fn steady(addr: SocketAddr, round: Duration, seed: u64) -> (f64, Vec<f64>) {
    // xorshift64*: the same arrival times for both sides of a pair.
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut uniform = move || {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    };
    let start = tokio::time::Instant::now();
    let mut at = Duration::ZERO;
    let mut tasks = Vec::new();
    loop {
        // Exponential gaps: a Poisson process at STEADY_RATE.
        at += Duration::from_secs_f64(-(1.0 - uniform()).ln() / STEADY_RATE);
        if at >= round {
            break;
        }
        tokio::time::sleep_until(start + at).await;
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let r =
                crate::http_client::request(addr, "GET", "/work", Duration::from_secs(60)).await;
            (
                r.map(|r| r.status).unwrap_or(0),
                t.elapsed().as_secs_f64() * 1e3,
            )
        }));
    }
    let mut served = 0;
    let mut ms = Vec::new();
    for t in tasks {
        if let Ok((status, took)) = t.await {
            served += usize::from(status == 200);
            ms.push(took);
        }
    }
    (served as f64 / round.as_secs_f64(), ms)
}

pub async fn shedding(server: &TestServer, s: Settings) -> Result<Row, BoxError> {
    let (rounds, round) = plan(s);
    let secs = round.as_secs_f64();
    let db = server.create_database().await?;
    let pool = |name: &str| -> Result<Pool, BoxError> {
        Ok(Pool::builder(db.deadpool(POOL)?).name(name).build()?)
    };
    let (plain, shedding) = (pool("bench-http-plain")?, pool("bench-http-shed")?);
    let a_addr = serve(&plain, false).await?;
    let b_addr = serve(&shedding, true).await?;

    // Flood.
    let rounds_a: Arc<Mutex<Vec<Round>>> = Arc::default();
    let rounds_b: Arc<Mutex<Vec<Round>>> = Arc::default();
    let keep = |addr: SocketAddr, out: Arc<Mutex<Vec<Round>>>| async move {
        let r = flood(addr, round).await;
        let v = r.served_per_s;
        out.lock().unwrap().push(r);
        v
    };
    let (a_served, b_served) = interleave(
        rounds,
        || keep(a_addr, rounds_a.clone()),
        || keep(b_addr, rounds_b.clone()),
    )
    .await;
    let ra = std::mem::take(&mut *rounds_a.lock().unwrap());
    let rb = std::mem::take(&mut *rounds_b.lock().unwrap());
    let per = |rs: &[Round], f: &dyn Fn(&Round) -> f64| rs.iter().map(f).collect::<Vec<f64>>();
    let late = Compared::new(&per(&ra, &Round::late_share), &per(&rb, &Round::late_share));
    let p99 = Compared::new(&per(&ra, &Round::p99_ms), &per(&rb, &Round::p99_ms));
    let pooled = |rs: &[Round]| {
        let all: Vec<f64> = rs.iter().flat_map(Round::answers).collect();
        let n = all.len().max(1) as f64;
        let late = all
            .iter()
            .filter(|ms| **ms > PATIENCE.as_secs_f64() * 1e3)
            .count() as f64;
        (100.0 * late / n, percentile(&all, 99.0))
    };
    let ((a_late, a_p99), (b_late, b_p99)) = (pooled(&ra), pooled(&rb));
    let a_good = median(&per(&ra, &|r| r.good_per_s(secs)));
    let b_good = median(&per(&rb, &|r| r.good_per_s(secs)));
    let b_shed = median(&per(&rb, &|r| r.shed_per_s));
    let b_shed_ms: Vec<f64> = rb.iter().flat_map(|r| r.shed_ms.iter().copied()).collect();

    // Under capacity: both sides of pair n get the arrival times of seed n
    // (each side's n-th round).
    let calls = [AtomicU64::new(0), AtomicU64::new(0)];
    let steady_ms: Arc<Mutex<(Vec<f64>, Vec<f64>)>> = Arc::default();
    let (sa, sb) = interleave(
        rounds,
        || {
            let seed = calls[0].fetch_add(1, Ordering::Relaxed);
            let ms = steady_ms.clone();
            async move {
                let (v, t) = steady(a_addr, round, seed).await;
                ms.lock().unwrap().0.extend(t);
                v
            }
        },
        || {
            let seed = calls[1].fetch_add(1, Ordering::Relaxed);
            let ms = steady_ms.clone();
            async move {
                let (v, t) = steady(b_addr, round, seed).await;
                ms.lock().unwrap().1.extend(t);
                v
            }
        },
    )
    .await;
    let steady_c = Compared::new(&sa, &sb);
    let (sa_ms, sb_ms) = std::mem::take(&mut *steady_ms.lock().unwrap());

    let verdict = all(&[
        late.at_most(LATE_TARGET),
        p99.at_most(P99_TARGET),
        steady_c.at_least(STEADY_TARGET),
    ]);
    let (pa, pb) = (plain.status(), shedding.status());
    Ok(Row {
        id: "8",
        workload: format!(
            "HTTP service, handlers hold a connection {HOLD:?}, pool {POOL}: a flood of {CLIENTS} \
             clients, and {STEADY_RATE} requests/s under capacity"
        ),
        a: format!(
            "no layer: flood: {a_late:.1} % of answers past {PATIENCE:?}, p99 of answers {a_p99:.0} ms, \
             {:.1} served/s, {a_good:.1}/s served within {PATIENCE:?} (drained answers included); under capacity: {:.1} served/s, p99 {:.0} ms",
            median(&a_served),
            median(&sa),
            percentile(&sa_ms, 99.0)
        ),
        b: format!(
            "`ShedLayer` ({BOUND:?}): flood: {b_late:.1} % of answers past {PATIENCE:?}, p99 of \
             answers {b_p99:.0} ms, {:.1} served/s, {b_good:.1}/s served within {PATIENCE:?}, {b_shed:.0} \
             shed/s (503 p99 {:.1} ms); under capacity: {:.1} served/s, p99 {:.0} ms",
            median(&b_served),
            percentile(&b_shed_ms, 99.0),
            median(&sb),
            percentile(&sb_ms, 99.0)
        ),
        ratio: format!(
            "late answers {:.3}; p99 {:.3}; served under capacity {:.3}",
            late.pairs, p99.pairs, steady_c.pairs
        ),
        target: "late answers ≤ 0.1; p99 ≤ 0.5; served under capacity ≥ 0.95",
        met: (!s.smoke).then_some(verdict).flatten(),
        notes: format!(
            "late answers: {}; p99: {}; served under capacity: {}; flood served/s {:.3} (the \
             lane's cap on both sides: context, not a target); in use after the rounds: {} and {}",
            late.spread(),
            p99.spread(),
            steady_c.spread(),
            crate::ab::ratio(&a_served, &b_served),
            pa.in_use,
            pb.in_use
        ),
    })
}
