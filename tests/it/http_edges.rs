//! `pgwarden::http` in process, on a real PostgreSQL and a real HTTP server
//! (axum on a local port, a plain HTTP/1.1 client): the readiness and
//! liveness answers, and the edges of issue 12.1: a bound of zero, a pool
//! closed during requests, a probe whose client goes away. Each gets a clear
//! answer and leaves nothing checked out.

use crate::support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::Query;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Extension, Router};
use pgwarden::http::{Liveness, Readiness, ShedLayer};
use pgwarden::{Deadline, Lane, Pool};
use support::http::request;
use support::{builder, db, eventually, within};

/// Request timeouts and waits: only against a hang (the right behaviour
/// ends well within it on any machine; the wrong one waits an hour).
const LIMIT: Duration = Duration::from_secs(60);
/// The pool's and the layer's bounds where a wrong behaviour would wait
/// them out.
const HOUR: Duration = Duration::from_secs(3600);

/// The app under test: `/up`, `/health/ready`, and `GET /work?hold_ms=M`
/// behind `shed` (a request connection held M ms; 503 when none comes).
fn app(pool: &Pool, readiness: Readiness, shed: ShedLayer) -> Router {
    let p = pool.clone();
    let work = Router::new()
        .route(
            "/work",
            get(
                move |Query(q): Query<HashMap<String, String>>,
                      Extension(d): Extension<Deadline>| {
                    let p = p.clone();
                    async move {
                        let ms: u64 = q.get("hold_ms").and_then(|v| v.parse().ok()).unwrap_or(0);
                        let bound = d.checkout_bound();
                        match p.get().await {
                            Ok(c) => {
                                tokio::time::sleep(Duration::from_millis(ms)).await;
                                drop(c);
                                (StatusCode::OK, format!("ok, bound {bound:?}\n"))
                            }
                            Err(e) => (
                                StatusCode::SERVICE_UNAVAILABLE,
                                format!("no connection: {e}\n"),
                            ),
                        }
                    }
                },
            ),
        )
        .layer(shed);
    Router::new()
        .route_service("/up", Liveness)
        .route_service("/health/ready", readiness)
        .merge(work)
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

async fn nothing_out(pool: &Pool) {
    eventually(Duration::from_secs(5), "nothing checked out", || async {
        let s = pool.status();
        s.in_use == 0 && s.waiting == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_answers_json_with_the_lanes_head_and_liveness() {
    let db = db().await;
    let pool = builder(&db, 4).build().unwrap();
    // A bound of a minute, not the default second: this test is about the
    // answer's form, and a probe (a first connection of the probe lane) on
    // a loaded machine can take over a second. Bounds at work: the tests
    // below and tests/it/slow_link.rs.
    let addr = serve(app(
        &pool,
        Readiness::new(pool.clone()).bound(LIMIT),
        ShedLayer::new(&pool),
    ))
    .await;
    let held = (pool.get().await.unwrap(), pool.get().await.unwrap());

    let r = request(addr, "GET", "/health/ready", LIMIT).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("application/json"));
    let v: serde_json::Value = serde_json::from_str(&r.body).expect(&r.body);
    assert_eq!(v["ready"], true);
    assert!(
        v["probe_ms"]
            .as_f64()
            .is_some_and(|ms| ms > 0.0 && ms < 60_000.0),
        "{v}"
    );
    assert_eq!(v["bound_ms"], 60_000.0);
    assert_eq!(
        v["lanes"]["request"],
        serde_json::json!({"in_use": 2, "pending": 0, "max": 3})
    );
    assert_eq!(v["lanes"]["probe"]["max"], 1);
    assert!(v.get("reason").is_none());

    let h = request(addr, "HEAD", "/health/ready", LIMIT).await.unwrap();
    assert_eq!((h.status, h.body.as_str()), (200, ""));
    assert_eq!(h.header("content-type"), Some("application/json"));
    let p = request(addr, "POST", "/health/ready", LIMIT).await.unwrap();
    assert_eq!((p.status, p.header("allow")), (405, Some("GET, HEAD")));

    let up = request(addr, "GET", "/up", LIMIT).await.unwrap();
    assert_eq!((up.status, up.body.as_str()), (200, "up\n"));
    let up = request(addr, "HEAD", "/up", LIMIT).await.unwrap();
    assert_eq!((up.status, up.body.as_str()), (200, ""));
    drop(held);
    nothing_out(&pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bound_of_zero_answers_at_once_and_checks_nothing_out() {
    let db = db().await;
    let pool = builder(&db, 4).build().unwrap();
    let shed = ShedLayer::new(&pool).max_wait(Duration::ZERO);
    let readiness = Readiness::new(pool.clone()).bound(Duration::ZERO);
    let addr = serve(app(&pool, readiness, shed)).await;
    let warm = pool.get().await.unwrap();
    drop(warm);
    let open = pool.status().size;

    // Readiness with no time to answer: a 503 that says so, no probe run.
    let r = request(addr, "GET", "/health/ready", LIMIT).await.unwrap();
    assert_eq!(r.status, 503);
    assert!(
        r.body.contains("\"ready\":false") && r.body.contains("bound is 0 s"),
        "{}",
        r.body
    );
    assert_eq!(pool.status().lane(Lane::Probe).in_use, 0);
    assert_eq!(
        pool.status().size,
        open,
        "a connection was opened or closed"
    );

    // Shedding with a zero bound: through while a connection is free…
    let ok = request(addr, "GET", "/work", LIMIT).await.unwrap();
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert!(ok.body.contains("bound 0ns"), "{}", ok.body);
    // …503 at once when none is.
    let held = [
        pool.get().await.unwrap(),
        pool.get().await.unwrap(),
        pool.get().await.unwrap(),
    ];
    let shed = request(addr, "GET", "/work", LIMIT).await.unwrap();
    assert_eq!(shed.status, 503, "{}", shed.body);
    assert!(shed.body.contains("\"reason\":\"busy\""), "{}", shed.body);
    assert_eq!(shed.header("retry-after"), Some("1"));
    // At once: no waiter queued (a request that waited for the pool, whose
    // bound is an hour here, would have run into the client's timeout).
    assert_eq!(
        pool.status().lane(Lane::Request).waiting,
        0,
        "a shed request queued"
    );

    // A deadline with nothing left: a free connection at once, else no wait.
    let e = within(
        LIMIT,
        "no wait with nothing left (the pool's own bound is an hour)",
        Deadline::after(Duration::ZERO).scope(pool.get()),
    )
    .await
    .unwrap_err();
    assert!(matches!(e, deadpool_postgres::PoolError::Timeout(_)), "{e}");
    drop(held);
    let c = Deadline::after(Duration::ZERO)
        .scope(pool.get())
        .await
        .unwrap();
    drop(c);
    nothing_out(&pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_closed_during_requests_answers_503_and_leaves_nothing_checked_out() {
    let db = db().await;
    let pool = builder(&db, 4).wait_timeout(HOUR).build().unwrap();
    let shed = ShedLayer::new(&pool).max_wait(HOUR);
    let addr = serve(app(&pool, Readiness::new(pool.clone()), shed)).await;

    // Three requests hold the request lane, two more wait for it.
    let send =
        |path: &'static str| tokio::spawn(async move { request(addr, "GET", path, LIMIT).await });
    let holders: Vec<_> = (0..3).map(|_| send("/work?hold_ms=500")).collect();
    eventually(LIMIT, "three holders", || async {
        pool.status().lane(Lane::Request).in_use == 3
    })
    .await;
    let waiters: Vec<_> = (0..2).map(|_| send("/work?hold_ms=500")).collect();
    eventually(LIMIT, "two waiters", || async {
        pool.status().lane(Lane::Request).waiting == 2
    })
    .await;

    pool.close();
    // The waiters hear when the pool closes, not at their bound (an hour:
    // a waiter the close did not wake would run into the client's timeout).
    for w in waiters {
        let r = w.await.unwrap().unwrap();
        assert_eq!(r.status, 503, "{}", r.body);
        assert!(r.body.contains("closed"), "{}", r.body);
    }
    // The holders had their connections: their work completes.
    for h in holders {
        let r = h.await.unwrap().unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // After the close: shed at once as closed (no Retry-After: it will not
    // come back), not ready with the reason, and still alive.
    let r = request(addr, "GET", "/work", LIMIT).await.unwrap();
    assert_eq!(r.status, 503);
    assert!(r.body.contains("\"reason\":\"closed\""), "{}", r.body);
    assert_eq!(r.header("retry-after"), None);
    let r = request(addr, "GET", "/health/ready", LIMIT).await.unwrap();
    assert_eq!(r.status, 503);
    assert!(
        r.body.contains("\"ready\":false") && r.body.contains("closed"),
        "{}",
        r.body
    );
    let r = request(addr, "GET", "/up", LIMIT).await.unwrap();
    assert_eq!(r.status, 200, "liveness does not depend on the pool");
    nothing_out(&pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_whose_client_goes_away_leaves_nothing_checked_out() {
    let db = db().await;
    let pool = builder(&db, 4).build().unwrap();
    let bound = Duration::from_secs(2);
    let addr = serve(app(
        &pool,
        Readiness::new(pool.clone()).bound(bound),
        ShedLayer::new(&pool),
    ))
    .await;
    // One open connection, whose backend stops answering: the probe takes
    // it and hangs in its `SELECT 1`.
    let c = pool.get().await.unwrap();
    let pid = c.pid();
    drop(c);
    assert_eq!(pool.status().size, 1);
    let stopped = support::Stopped::stop([pid]).unwrap();

    let mut s = support::http::connect(addr).await.unwrap();
    use tokio::io::AsyncWriteExt;
    s.write_all(b"GET /health/ready HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    eventually(LIMIT, "the probe in flight", || async {
        pool.status().lane(Lane::Probe).in_use == 1
    })
    .await;
    drop(s); // the client gives up mid-probe

    // The probe runs to its bound in its own task, then gives its
    // connection up: closed, since its server never answered (and never
    // will while it is stopped: a probe that did not end at its bound
    // would hang past the limit).
    eventually(LIMIT, "the probe's connection back", || async {
        pool.status().in_use == 0
    })
    .await;
    assert_eq!(
        pool.status().size,
        0,
        "the hung connection went back to the pool"
    );
    drop(stopped);

    // The next probes, on a new connection: ready. (The first may not be
    // when connecting takes longer than the 2 s bound on a loaded machine;
    // its connect goes on past the bound, and a later probe uses it.)
    let mut last = String::new();
    let ready = within(LIMIT, "a probe on a new connection to be ready", async {
        loop {
            let r = request(addr, "GET", "/health/ready", LIMIT).await.unwrap();
            if r.status == 200 {
                break r;
            }
            last = r.body;
        }
    })
    .await;
    assert!(
        ready.body.contains("\"ready\":true"),
        "{} (before: {last})",
        ready.body
    );

    // A probe future dropped while the probe runs (a server cancelling the
    // request): the same.
    use tower_service::Service as _;
    let mut svc = Readiness::new(pool.clone());
    let req = axum::http::Request::get("/health/ready").body(()).unwrap();
    let fut = svc.call(req);
    let _ = tokio::time::timeout(Duration::from_micros(1), fut).await;
    nothing_out(&pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wait_the_queue_implies_decides_what_is_shed() {
    let db = db().await;
    let pool = builder(&db, 4).build().unwrap();
    let bound = Duration::from_secs(2);
    let addr = serve(app(
        &pool,
        Readiness::new(pool.clone()),
        ShedLayer::new(&pool).max_wait(bound),
    ))
    .await;
    // Recent holds of about 500 ms on the request lane.
    let hold = Duration::from_millis(500);
    let holds: Vec<_> = (0..3)
        .map(|_| {
            let p = pool.clone();
            tokio::spawn(async move {
                let c = p.get().await.unwrap();
                tokio::time::sleep(hold).await;
                drop(c);
            })
        })
        .collect();
    for h in holds {
        h.await.unwrap();
    }
    // The lane full again, then requests one by one: each is admitted while
    // (waiting + 1) × ~500 ms / 3 connections fits in 2 s (up to 11
    // waiting), then shed.
    let held = [
        pool.get().await.unwrap(),
        pool.get().await.unwrap(),
        pool.get().await.unwrap(),
    ];
    let mut admitted = Vec::new();
    let shed = loop {
        let waiting = pool.status().lane(Lane::Request).waiting;
        assert!(waiting <= 12, "{waiting} waiting and nothing shed");
        let mut s = support::http::connect(addr).await.unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(b"GET /work HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        // Queued (one more waiting: nothing else on this lane moves while
        // the three are held) or shed (an answer at once, the connection
        // closed): whichever happens, however long a loaded machine takes.
        let mut raw = String::new();
        let queued = within(LIMIT, "the request queued or shed", async {
            tokio::select! {
                _ = async {
                    while pool.status().lane(Lane::Request).waiting == waiting {
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                } => true,
                r = s.read_to_string(&mut raw) => {
                    r.unwrap();
                    false
                }
            }
        })
        .await;
        if queued {
            admitted.push(s);
            continue;
        }
        break (waiting, raw);
    };
    let (waiting, raw) = shed;
    assert!(raw.starts_with("HTTP/1.1 503"), "{raw}");
    assert!(raw.contains("\"reason\":\"busy\""), "{raw}");
    assert!((9..=12).contains(&waiting), "shed with {waiting} waiting");
    drop(held);
    for s in admitted {
        drop(s);
    }
    nothing_out(&pool).await;
}
