//! [`Readiness`] (`/health/ready`) and [`Liveness`] (`/up`).

use std::convert::Infallible;
use std::fmt::Write as _;
use std::panic::Location;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::future::BoxFuture;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};

use super::body::{json_ms, json_str, Body};
use crate::admission::Lane;
use crate::pool::{AnyPool, Shared, Source};

/// The readiness service for `/health/ready`: `SELECT 1` on the pool's probe
/// lane (whose reserve no other lane may take), answered within a bound.
///
/// * `200 OK` when the probe answered within the bound; `503 Service
///   Unavailable` with the reason otherwise (the probe timed out, the
///   database refused or failed, the pool is closed, a bound of zero).
/// * The body is small JSON: whether ready, the probe's latency, the
///   bound, the reason when not ready, and per lane what is in use, waiting,
///   and the lane's maximum:
///   `{"ready":true,"probe_ms":0.412,"bound_ms":1000.000,"lanes":{"request":{"in_use":3,"pending":12,"max":3},…}}`.
/// * `HEAD` gets the same status and headers, without the body; other
///   methods get `405` with `Allow: GET, HEAD`.
///
/// Readiness reflects the database, not the request load: the probe never
/// queues behind request, lock or lease traffic, so a flood that the
/// [`ShedLayer`](super::ShedLayer) sheds leaves the instance ready. The probe runs in a task of
/// its own: a client that gives up (a kubelet's `timeoutSeconds`) does not
/// cut it short; a connection that did not answer in time is closed (a
/// server that did not answer leaves it in an unknown state), and one still
/// being made when the bound runs out is made in the background and kept for
/// the next probe (see [`Pool::readiness`](crate::Pool::readiness)). The 503
/// reason of a connection the server refused carries its SQLSTATE and
/// message (`… database error 53300: sorry, too many clients already`).
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> std::io::Result<()> {
/// use pgwarden::http::{Liveness, Readiness};
///
/// let app = axum::Router::new()
///     .route_service("/up", Liveness)
///     .route_service("/health/ready", Readiness::new(pool));
/// let listener = tokio::net::TcpListener::bind("0.0.0.0:8080").await?;
/// axum::serve(listener, app).await
/// # }
/// ```
///
/// The same for a `pgwarden::sqlx::Pool` (`B` is the pool it wraps:
/// deadpool's unless said otherwise):
///
/// ```no_run
/// # async fn demo(pool: pgwarden::sqlx::Pool) {
/// let app: axum::Router = axum::Router::new()
///     .route_service("/health/ready", pgwarden::http::Readiness::new(pool));
/// # }
/// ```
pub struct Readiness<B: Source = deadpool_postgres::Pool> {
    pool: Arc<Shared<B>>,
    bound: Duration,
}

impl<B: Source> Clone for Readiness<B> {
    fn clone(&self) -> Self {
        Readiness {
            pool: self.pool.clone(),
            bound: self.bound,
        }
    }
}

impl<B: Source> std::fmt::Debug for Readiness<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Readiness")
            .field("pool", &self.pool)
            .field("bound", &self.bound)
            .finish()
    }
}

impl Readiness {
    /// The default bound: 1 s (for every backend).
    pub const DEFAULT_BOUND: Duration = Duration::from_secs(1);
}

impl<B: Source> Readiness<B> {
    /// Readiness of `pool` (a `pgwarden::Pool` or a `pgwarden::sqlx::Pool`),
    /// answered within [`Readiness::DEFAULT_BOUND`].
    #[allow(private_bounds)]
    pub fn new(pool: impl AnyPool<Source = B>) -> Readiness<B> {
        Readiness {
            pool: pool.shared().clone(),
            bound: Readiness::DEFAULT_BOUND,
        }
    }

    /// The bound within which it answers (the probe's checkout included).
    /// Keep the orchestrator's probe timeout above it (Kubernetes:
    /// `timeoutSeconds` ≥ bound + 1 s), so that it reads the reason instead
    /// of timing out. A bound of zero makes every answer a 503 that says so,
    /// without touching the database. Default: 1 s.
    #[must_use]
    pub fn bound(mut self, bound: Duration) -> Readiness<B> {
        self.bound = bound;
        self
    }

    /// The answer to a request with this `method`: what the service
    /// returns, for use inside a handler of your own.
    pub(crate) async fn respond(&self, method: &Method) -> Response<Body> {
        let head = match *method {
            Method::GET => false,
            Method::HEAD => true,
            _ => return not_allowed(),
        };
        let (probe, result) = if self.bound.is_zero() {
            (
                Duration::ZERO,
                Err("the readiness bound is 0 s: no probe answers in no time; \
                     give it at least the database's round trip (default 1 s)"
                    .to_owned()),
            )
        } else {
            self.probe().await
        };
        let status = self.pool.status();
        let mut json = String::with_capacity(400);
        let _ = write!(
            json,
            "{{\"ready\":{},\"probe_ms\":{},\"bound_ms\":{}",
            result.is_ok(),
            json_ms(probe),
            json_ms(self.bound)
        );
        if let Err(reason) = &result {
            let _ = write!(json, ",\"reason\":{}", json_str(reason));
        }
        json.push_str(",\"lanes\":{");
        for (i, lane) in Lane::ALL.iter().enumerate() {
            let l = status.lane(*lane);
            let _ = write!(
                json,
                "{}\"{}\":{{\"in_use\":{},\"pending\":{},\"max\":{}}}",
                if i > 0 { "," } else { "" },
                lane.as_str(),
                l.in_use,
                l.waiting,
                l.max
            );
        }
        json.push_str("}}\n");
        let code = if result.is_ok() {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        respond(code, "application/json", head, json)
    }

    /// Runs the probe in a task of its own (when there is a runtime), so
    /// that a caller that gives up does not cut it short: its latency, or
    /// why not ready.
    async fn probe(&self) -> (Duration, Result<(), String>) {
        let start = tokio::time::Instant::now();
        let pool = self.pool.clone();
        let bound = self.bound;
        let result = match tokio::runtime::Handle::try_current() {
            Ok(rt) => match rt
                .spawn(async move { pool.probe(bound, Location::caller()).await })
                .await
            {
                Ok(r) => r.map_err(|e| e.to_string()),
                Err(e) => Err(format!("the readiness probe task failed: {e}")),
            },
            Err(_) => pool
                .probe(bound, Location::caller())
                .await
                .map_err(|e| e.to_string()),
        };
        match result {
            Ok(took) => (took, Ok(())),
            Err(reason) => (start.elapsed(), Err(reason)),
        }
    }
}

impl<B: Source, R> tower_service::Service<Request<R>> for Readiness<B> {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<R>) -> Self::Future {
        let this = self.clone();
        let method = req.method().clone();
        Box::pin(async move { Ok(this.respond(&method).await) })
    }
}

/// The liveness service for `/up`: `200 up`, whatever the database does.
///
/// It never touches the database: a liveness probe that did would have the
/// orchestrator restart every instance during a database outage, which
/// cures nothing and adds a reconnect storm. `HEAD` gets the status only;
/// other methods get `405`.
///
/// ```no_run
/// # async fn demo() -> std::io::Result<()> {
/// let app = axum::Router::new().route_service("/up", pgwarden::http::Liveness);
/// let listener = tokio::net::TcpListener::bind("0.0.0.0:8080").await?;
/// axum::serve(listener, app).await
/// # }
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct Liveness;

impl Liveness {
    /// The answer to a request with this `method`.
    pub(crate) fn respond(&self, method: &Method) -> Response<Body> {
        match *method {
            Method::GET => respond(StatusCode::OK, "text/plain", false, "up\n".into()),
            Method::HEAD => respond(StatusCode::OK, "text/plain", true, "up\n".into()),
            _ => not_allowed(),
        }
    }
}

impl<B> tower_service::Service<Request<B>> for Liveness {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        std::future::ready(Ok(self.respond(req.method())))
    }
}

fn respond(
    code: StatusCode,
    content_type: &'static str,
    head: bool,
    body: String,
) -> Response<Body> {
    let len = body.len();
    let mut r = Response::new(if head { Body::empty() } else { body.into() });
    *r.status_mut() = code;
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    r
}

fn not_allowed() -> Response<Body> {
    let mut r = respond(
        StatusCode::METHOD_NOT_ALLOWED,
        "text/plain",
        false,
        "method not allowed: use GET or HEAD\n".to_owned(),
    );
    r.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
    r
}
