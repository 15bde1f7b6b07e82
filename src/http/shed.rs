//! [`ShedLayer`]: answer 503 at once when the request lane cannot admit
//! within the bound, instead of queueing; give the requests it lets through
//! a [`Deadline`] their checkouts honour.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::future::BoxFuture;
use http::{header, HeaderValue, Request, Response, StatusCode};
use metrics::Counter;

use super::body::{json_ms, json_str};
use super::verdict::{decide, retry_after, ShedReason, Verdict};
use crate::admission::Lane;
use crate::pool::{AnyPool, Deadline, LaneLoad, Shared, Source};

/// A [`tower_layer::Layer`] that sheds requests the pool's request lane
/// cannot serve within a bound, before the inner service runs.
///
/// For every request it reads the request lane: a checkout admitted at
/// once lets the request through; otherwise the longest wait the queue
/// implies (the rounds of holds before its turn: the waiters ahead of it,
/// plus itself, over the connections the lane cycles through, rounded up,
/// times the lane's recent hold time) is compared with the bound: within
/// it, the request goes through; past it (or with the pool closed), it
/// gets `503 Service Unavailable` at once, with `Retry-After`
/// (whole seconds, that wait rounded up, 1 to 60) and a small JSON body
/// saying why, and is counted in `pgwarden_requests_shed_total{pool,
/// reason}` (`busy`, `closed`); requests let through are counted in
/// `pgwarden_requests_admitted_total{pool}`.
///
/// A request let through runs inside a [`Deadline`] scope: every checkout
/// its handler makes waits at most the bound ([`ShedLayer::max_wait`]) and
/// ends by the request's deadline ([`ShedLayer::timeout`], tightened by a
/// [`Deadline`] an outer layer put in the request's extensions, or by the
/// scope the service runs in). The handler reads it from the request's
/// extensions (axum: `Extension<Deadline>`) or with [`Deadline::current`].
///
/// Put it on the routes whose handlers take a request connection, not on
/// `/health/ready`, `/up` or `/metrics`: readiness has its own reserve, and
/// must say the instance is ready while it sheds a flood. The decision reads
/// the queue as it is: a handler that awaits something else before its
/// checkout is not in the queue yet when the next request is decided. The
/// recent hold time is an average kept as connections return (it follows
/// longer holds within a few returns, shorter ones more slowly): until the
/// lane has seen holds like the ones a burst brings, more of that first
/// burst may be let through than can be served within the bound, and those
/// requests' checkouts fail at the bound (the handler's own error, typically
/// a 503 too).
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> std::io::Result<()> {
/// use std::time::Duration;
/// use axum::{routing::get, Extension, Router};
/// use pgwarden::http::{Liveness, Readiness, ShedLayer};
/// use pgwarden::Deadline;
///
/// let db = pool.clone();
/// let api = Router::new()
///     .route("/items", get(move |Extension(deadline): Extension<Deadline>| async move {
///         // Waits at most 250 ms for its connection: the shedding bound.
///         let Ok(conn) = db.get().await else { return "busy".to_owned() };
///         let _ = conn.simple_query("SELECT 1").await;
///         format!("{:?} left", deadline.checkout_bound())
///     }))
///     .layer(ShedLayer::new(&pool).max_wait(Duration::from_millis(250)));
/// let app = Router::new()
///     .route_service("/up", Liveness)
///     .route_service("/health/ready", Readiness::new(pool))
///     .merge(api);
/// let listener = tokio::net::TcpListener::bind("0.0.0.0:8080").await?;
/// axum::serve(listener, app).await
/// # }
/// ```
///
/// The same for a `pgwarden::sqlx::Pool` (`B` is the pool it wraps:
/// deadpool's unless said otherwise):
///
/// ```no_run
/// # fn demo(pool: pgwarden::sqlx::Pool) {
/// let app: axum::Router = axum::Router::new()
///     .route("/work", axum::routing::get(|| async { "done" }))
///     .layer(pgwarden::http::ShedLayer::new(&pool));
/// # }
/// ```
pub struct ShedLayer<B: Source = deadpool_postgres::Pool> {
    config: Arc<Config<B>>,
}

impl<B: Source> Clone for ShedLayer<B> {
    fn clone(&self) -> Self {
        ShedLayer {
            config: self.config.clone(),
        }
    }
}

impl<B: Source> std::fmt::Debug for ShedLayer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShedLayer")
            .field("config", &self.config)
            .finish()
    }
}

struct Config<B: Source> {
    pool: Arc<Shared<B>>,
    max_wait: Duration,
    timeout: Duration,
    shed_busy: Counter,
    shed_closed: Counter,
    admitted: Counter,
}

impl<B: Source> Clone for Config<B> {
    fn clone(&self) -> Self {
        Config {
            pool: self.pool.clone(),
            max_wait: self.max_wait,
            timeout: self.timeout,
            shed_busy: self.shed_busy.clone(),
            shed_closed: self.shed_closed.clone(),
            admitted: self.admitted.clone(),
        }
    }
}

impl<B: Source> std::fmt::Debug for Config<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("pool", &self.pool.name)
            .field("max_wait", &self.max_wait)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl ShedLayer {
    /// The default bound on a request's wait for a connection: 250 ms (for
    /// every backend).
    pub const DEFAULT_MAX_WAIT: Duration = Duration::from_millis(250);
    /// The default request deadline: 30 s (the pool's default wait
    /// timeout; for every backend).
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
}

impl<B: Source> ShedLayer<B> {
    /// Sheds by `pool`'s request lane (a `pgwarden::Pool` or a
    /// `pgwarden::sqlx::Pool`), with the default bound and deadline.
    /// Registers its counters under the pool's name.
    #[allow(private_bounds)]
    pub fn new(pool: &impl AnyPool<Source = B>) -> ShedLayer<B> {
        crate::metrics::describe();
        let pool = pool.shared();
        let p = pool.name.to_string();
        let shed = |reason: ShedReason| metrics::counter!(crate::metrics::REQUESTS_SHED, "pool" => p.clone(), "reason" => reason.as_str());
        ShedLayer {
            config: Arc::new(Config {
                pool: pool.clone(),
                max_wait: ShedLayer::DEFAULT_MAX_WAIT,
                timeout: ShedLayer::DEFAULT_TIMEOUT,
                shed_busy: shed(ShedReason::Busy),
                shed_closed: shed(ShedReason::Closed),
                admitted: metrics::counter!(crate::metrics::REQUESTS_ADMITTED, "pool" => p.clone()),
            }),
        }
    }

    /// The bound: the longest a request may be expected to wait for a
    /// connection (or else it is shed), and the longest any checkout of a
    /// request let through waits. Zero: only requests for which a
    /// connection is free at once go through. Default: 250 ms.
    #[must_use]
    pub fn max_wait(self, max_wait: Duration) -> ShedLayer<B> {
        self.with(|c| c.max_wait = max_wait)
    }

    /// The request's deadline, from its arrival: checkouts in its handler
    /// end by then, and a request whose deadline leaves less than the
    /// expected wait is shed. Default: 30 s.
    #[must_use]
    pub fn timeout(self, timeout: Duration) -> ShedLayer<B> {
        self.with(|c| c.timeout = timeout)
    }

    fn with(self, f: impl FnOnce(&mut Config<B>)) -> ShedLayer<B> {
        let mut config = Arc::unwrap_or_clone(self.config);
        f(&mut config);
        ShedLayer {
            config: Arc::new(config),
        }
    }
}

impl<S, B: Source> tower_layer::Layer<S> for ShedLayer<B> {
    type Service = Shed<S, B>;

    fn layer(&self, inner: S) -> Shed<S, B> {
        Shed {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service [`ShedLayer`] wraps around an inner one.
///
/// ```no_run
/// # fn demo(pool: pgwarden::Pool) {
/// use pgwarden::http::ShedLayer;
/// // `layer` wraps the routes in a `Shed` service.
/// let app: axum::Router = axum::Router::new()
///     .route("/work", axum::routing::get(|| async { "done" }))
///     .layer(ShedLayer::new(&pool));
/// # }
/// ```
pub struct Shed<S, B: Source = deadpool_postgres::Pool> {
    inner: S,
    config: Arc<Config<B>>,
}

impl<S: Clone, B: Source> Clone for Shed<S, B> {
    fn clone(&self) -> Self {
        Shed {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: std::fmt::Debug, B: Source> std::fmt::Debug for Shed<S, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shed")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish()
    }
}

impl<S, B: Source, ReqBody, ResBody> tower_service::Service<Request<ReqBody>> for Shed<S, B>
where
    S: tower_service::Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: From<String> + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Response<ResBody>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        let c = &*self.config;
        let mut deadline = Deadline::after(c.timeout).max_wait(c.max_wait);
        if let Some(outer) = req.extensions().get::<Deadline>() {
            deadline = outer.min(deadline);
        }
        if let Some(scope) = Deadline::current() {
            deadline = scope.min(deadline);
        }
        let bound = deadline.checkout_bound();
        let load = c.pool.lane_load(Lane::Request);
        match decide(&load, bound) {
            Verdict::Admit { .. } => {
                c.admitted.increment(1);
                req.extensions_mut().insert(deadline);
                let fut = deadline.sync_scope(|| self.inner.call(req));
                Box::pin(deadline.scope(fut))
            }
            Verdict::Shed { reason, expected } => {
                match reason {
                    ShedReason::Busy => c.shed_busy.increment(1),
                    ShedReason::Closed => c.shed_closed.increment(1),
                }
                let resp = shed_response(&c.pool.name, reason, expected, bound, &load);
                Box::pin(std::future::ready(Ok(resp)))
            }
        }
    }
}

fn shed_response<B: From<String>>(
    pool: &str,
    reason: ShedReason,
    expected: Duration,
    bound: Duration,
    load: &LaneLoad,
) -> Response<B> {
    let why = match reason {
        ShedReason::Busy => format!(
            "the request lane of pool {} cannot admit within {:?}: {} waiting, {} in use",
            pool, bound, load.pending, load.in_use
        ),
        ShedReason::Closed => format!("pool {pool} is closed"),
    };
    let body = format!(
        "{{\"shed\":true,\"reason\":{},\"message\":{},\"lane\":\"request\",\"in_use\":{},\"pending\":{},\"expected_wait_ms\":{},\"bound_ms\":{}}}\n",
        json_str(reason.as_str()),
        json_str(&why),
        load.in_use,
        load.pending,
        json_ms(expected),
        json_ms(bound)
    );
    let mut r = Response::new(B::from(body));
    *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if reason == ShedReason::Busy {
        h.insert(
            header::RETRY_AFTER,
            HeaderValue::from(retry_after(expected)),
        );
    }
    r
}
