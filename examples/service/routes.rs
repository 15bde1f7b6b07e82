//! The HTTP routes: liveness, readiness, metrics, request work behind the
//! load-shedding layer, and demo routes that create lock and lease pressure.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use pgwarden::http::{Liveness, Readiness, ShedLayer};
use pgwarden::{Deadline, LeaseOptions, Leases, LockKey, Pool};
use tokio::sync::watch;

/// What every handler sees.
#[derive(Clone)]
pub struct AppState {
    pub pool: Pool,
    /// The process's lease table (shared with the scheduler).
    pub leases: Leases,
    pub metrics: PrometheusHandle,
    pub instance: Arc<str>,
    /// Becomes true at SIGTERM/Ctrl-C: the demo routes stop holding.
    pub shutdown: watch::Receiver<bool>,
}

/// Sleeps `d`, or less when shutdown begins; false when cut short.
async fn hold_for(d: Duration, shutdown: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = shutdown.wait_for(|s| *s) => false,
    }
}

/// How the HTTP side uses pgwarden.
#[derive(Clone, Copy, Debug)]
pub struct HttpConfig {
    /// The readiness bound.
    pub readiness_bound: Duration,
    /// The shedding bound on the request routes; `None`: no shedding (the
    /// handlers queue for connections up to the pool's wait timeout).
    pub shed_max_wait: Option<Duration>,
}

pub fn router(state: AppState, http: HttpConfig) -> Router {
    // The routes whose handlers take a request connection: shed at once
    // when the request lane cannot admit within the bound.
    let mut work = Router::new()
        .route("/items", get(list_items).post(add_item))
        .route("/work", get(work));
    if let Some(max_wait) = http.shed_max_wait {
        work = work.layer(ShedLayer::new(&state.pool).max_wait(max_wait));
    }
    Router::new()
        // Liveness never touches the database; readiness runs on the
        // pool's probe reserve, so neither queues behind the request flood.
        .route_service("/up", Liveness)
        .route_service(
            "/health/ready",
            Readiness::new(state.pool.clone()).bound(http.readiness_bound),
        )
        .route("/metrics", get(render_metrics))
        .route("/debug/hold-lock", post(hold_lock))
        .route("/debug/hold-lease", post(hold_lease))
        .merge(work)
        .with_state(state)
}

type Reply = (StatusCode, String);

async fn render_metrics(State(s): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

fn param<T: std::str::FromStr>(
    q: &HashMap<String, String>,
    name: &str,
    default: T,
) -> Result<T, Reply> {
    match q.get(name) {
        None => Ok(default),
        Some(v) => v
            .parse()
            .map_err(|_| (StatusCode::BAD_REQUEST, format!("bad `{name}`: {v:?}\n"))),
    }
}

fn pool_error(e: deadpool_postgres::PoolError) -> Reply {
    match e {
        deadpool_postgres::PoolError::Timeout(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "no database connection in time\n".to_owned(),
        ),
        deadpool_postgres::PoolError::Closed => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the pool is closed\n".to_owned(),
        ),
        e => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
    }
}

fn db_error(e: tokio_postgres::Error) -> Reply {
    (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n"))
}

/// `POST /items?name=…`: inserts an item, answers its id.
async fn add_item(State(s): State<AppState>, Query(q): Query<HashMap<String, String>>) -> Reply {
    let name = q.get("name").cloned().unwrap_or_else(|| "item".to_owned());
    let conn = match s.pool.get().await {
        Ok(c) => c,
        Err(e) => return pool_error(e),
    };
    match conn
        .query_one(
            "INSERT INTO items (name, instance) VALUES ($1, $2) RETURNING id",
            &[&name, &&*s.instance],
        )
        .await
    {
        Ok(row) => (StatusCode::CREATED, format!("{}\n", row.get::<_, i64>(0))),
        Err(e) => db_error(e),
    }
}

/// `GET /items?limit=N&slow_ms=M`: the count and the last N names; `slow_ms`
/// adds a slow query (`pg_sleep`) on the same connection, to load the pool.
async fn list_items(State(s): State<AppState>, Query(q): Query<HashMap<String, String>>) -> Reply {
    let (limit, slow_ms) = match (param(&q, "limit", 10_i64), param(&q, "slow_ms", 0_u64)) {
        (Ok(l), Ok(m)) => (l.clamp(0, 1000), m.min(10_000)),
        (Err(r), _) | (_, Err(r)) => return r,
    };
    let conn = match s.pool.get().await {
        Ok(c) => c,
        Err(e) => return pool_error(e),
    };
    if slow_ms > 0 {
        let secs = slow_ms as f64 / 1000.0;
        if let Err(e) = conn.execute("SELECT pg_sleep($1)", &[&secs]).await {
            return db_error(e);
        }
    }
    let rows = match conn
        .query(
            "SELECT name, count(*) OVER () FROM items ORDER BY id DESC LIMIT $1",
            &[&limit],
        )
        .await
    {
        Ok(r) => r,
        Err(e) => return db_error(e),
    };
    let total: i64 = rows.first().map(|r| r.get(1)).unwrap_or(0);
    let mut out = format!("{total} items\n");
    for r in &rows {
        out.push_str(r.get::<_, &str>(0));
        out.push('\n');
    }
    (StatusCode::OK, out)
}

/// `GET /work?hold_ms=M`: takes a request connection, runs `SELECT 1`, and
/// holds the connection M ms (default 50, at most 10 s). The header
/// `x-checkout-wait-us` says how long the checkout waited (microseconds),
/// `x-checkout-bound-us` the bound it had (the shedding layer's deadline);
/// 503 when no connection came within the bound.
async fn work(
    State(s): State<AppState>,
    deadline: Option<Extension<Deadline>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let hold = match param(&q, "hold_ms", 50_u64) {
        Ok(ms) => Duration::from_millis(ms.min(10_000)),
        Err(r) => return r.into_response(),
    };
    let bound = deadline.map(|Extension(d)| d.checkout_bound());
    let start = std::time::Instant::now();
    let got = s.pool.get().await;
    let waited = start.elapsed();
    let mut resp = match got {
        Ok(conn) => match conn.simple_query("SELECT 1").await {
            Ok(_) => {
                tokio::time::sleep(hold).await;
                drop(conn);
                (StatusCode::OK, format!("held a connection for {hold:?}\n")).into_response()
            }
            Err(e) => db_error(e).into_response(),
        },
        Err(e) => pool_error(e).into_response(),
    };
    let h = resp.headers_mut();
    h.insert(
        "x-checkout-wait-us",
        HeaderValue::from(waited.as_micros() as u64),
    );
    if let Some(b) = bound {
        h.insert(
            "x-checkout-bound-us",
            HeaderValue::from(b.as_micros() as u64),
        );
    }
    resp
}

/// `POST /debug/hold-lock?key=N&ms=M`: takes the session advisory lock N
/// (as a hand-written "try exclusive" helper would), does a little work under it on a request
/// connection, holds it M ms, and unlocks. 409 when another session holds
/// the key, or when the pool's session-lock budget refuses the checkout (the
/// error text names the budget and suggests a lease): this is how the demo
/// and the end-to-end test create lock pressure.
async fn hold_lock(State(s): State<AppState>, Query(q): Query<HashMap<String, String>>) -> Reply {
    let (key, ms) = match (param(&q, "key", 1_i64), param(&q, "ms", 1000_u64)) {
        (Ok(k), Ok(m)) => (k, m.min(60_000)),
        (Err(r), _) | (_, Err(r)) => return r,
    };
    let lock = match s
        .pool
        .session_lock(LockKey::Single(key), pgwarden::LockMode::Exclusive, None)
        .await
    {
        Ok(Some(lock)) => lock,
        Ok(None) => {
            return (
                StatusCode::CONFLICT,
                format!("lock {key} is held by another session\n"),
            )
        }
        Err(e) if e.is_budget_exhausted() => return (StatusCode::CONFLICT, format!("{e}\n")),
        Err(e) => return (StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")),
    };
    // The work under the lock takes a request connection: with raw deadpool
    // and enough locks this is the self-deadlock of the incident; pgwarden keeps one.
    let work = async {
        let conn = s.pool.get().await.map_err(pool_error)?;
        conn.execute("SELECT count(*) FROM items", &[])
            .await
            .map_err(db_error)?;
        Ok::<(), Reply>(())
    };
    let worked = work.await;
    let mut shutdown = s.shutdown.clone();
    hold_for(Duration::from_millis(ms), &mut shutdown).await;
    if let Err(e) = lock.unlock().await {
        // The guard has cleaned the connection up, or closed it (as on drop).
        tracing::warn!(key, error = %e, "unlock not confirmed");
    }
    match worked {
        Ok(()) => (StatusCode::OK, format!("held lock {key} for {ms} ms\n")),
        Err(r) => r,
    }
}

/// `POST /debug/hold-lease?name=…&ms=M&ttl_ms=T`: takes the table lease
/// `name` (TTL T, default 10 s; renewed every T/4 in the background, holding
/// no connection) and holds it M ms; 409 when another holder has it. Answers
/// `lost: <reason>` if the lease is lost meanwhile (e.g. this process was
/// frozen past the TTL and another instance took it over).
async fn hold_lease(State(s): State<AppState>, Query(q): Query<HashMap<String, String>>) -> Reply {
    let name = q
        .get("name")
        .cloned()
        .unwrap_or_else(|| "report".to_owned());
    let (ms, ttl_ms) = match (param(&q, "ms", 1000_u64), param(&q, "ttl_ms", 10_000_u64)) {
        (Ok(m), Ok(t)) => (m.min(120_000), t),
        (Err(r), _) | (_, Err(r)) => return r,
    };
    let lease = match s
        .leases
        .acquire(
            &name,
            &LeaseOptions::new(Duration::from_millis(ttl_ms)),
            None,
        )
        .await
    {
        Ok(Some(lease)) => lease,
        Ok(None) => {
            return (
                StatusCode::CONFLICT,
                format!("lease {name} is held elsewhere\n"),
            )
        }
        Err(e) => return (StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")),
    };
    let token = lease.term().token;
    let mut shutdown = s.shutdown.clone();
    let lost = lease.lost();
    let held = tokio::select! {
        _ = tokio::time::sleep(Duration::from_millis(ms)) => "held",
        _ = shutdown.wait_for(|s| *s) => "held until shutdown",
        reason = lost => {
            return (StatusCode::OK, format!("lease {name} (token {token}) lost: {reason}\n"));
        }
    };
    match lease.release().await {
        Ok(()) => (
            StatusCode::OK,
            format!("lease {name} (token {token}) {held} and released\n"),
        ),
        Err(e) => (
            StatusCode::OK,
            format!("lease {name} (token {token}) lost: {e}\n"),
        ),
    }
}
