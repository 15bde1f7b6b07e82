//! The HTTP side (feature `http`): a readiness service, a liveness service
//! and a load-shedding layer, as [`tower`](https://docs.rs/tower) services
//! over [`http`] types, so that axum, hyper and tonic take them as they are.
//!
//! * [`Readiness`] for `/health/ready`: `SELECT 1` on the pool's probe lane,
//!   whose reserve no other lane takes, answered within a bound (1 s by
//!   default): `200`, or `503` with the reason; small JSON with the probe's
//!   latency and each lane's in use and waiting; `HEAD` supported.
//! * [`Liveness`] for `/up`: `200` as long as the process serves HTTP; it
//!   never touches the database.
//! * [`ShedLayer`] for the routes that use the database: a request the
//!   request lane cannot admit within a bound gets `503` with `Retry-After`
//!   at once instead of queueing until the pool's wait timeout; a request let
//!   through runs under a [`crate::Deadline`] that every checkout in its
//!   handler honours.
//!
//! ```no_run
//! # async fn demo(pool: pgwarden::Pool) -> std::io::Result<()> {
//! use axum::{routing::get, Router};
//! use pgwarden::http::{Liveness, Readiness, ShedLayer};
//!
//! let db = pool.clone();
//! let api = Router::new()
//!     .route("/items", get(move || async move {
//!         let conn = db.get().await.map_err(|_| "busy")?;
//!         conn.simple_query("SELECT 1").await.map_err(|_| "error")?;
//!         Ok::<_, &'static str>("ok")
//!     }))
//!     .layer(ShedLayer::new(&pool));
//! let app = Router::new()
//!     .route_service("/up", Liveness)
//!     .route_service("/health/ready", Readiness::new(pool))
//!     .merge(api);
//! let listener = tokio::net::TcpListener::bind("0.0.0.0:8080").await?;
//! axum::serve(listener, app).await
//! # }
//! ```
//!
//! # Kubernetes probes
//!
//! ```yaml
//! readinessProbe:            # in or out of rotation: is the database reachable?
//!   httpGet: { path: /health/ready, port: 8080 }
//!   periodSeconds: 5
//!   timeoutSeconds: 2        # above the readiness bound (1 s): the kubelet reads the 503 and its reason
//!   failureThreshold: 3      # out after ~15 s of failures: one slow probe is not an outage
//!   successThreshold: 1
//! livenessProbe:             # restart only a process that no longer serves HTTP
//!   httpGet: { path: /up, port: 8080 }
//!   periodSeconds: 10
//!   timeoutSeconds: 2
//!   failureThreshold: 3
//! ```
//!
//! * **Readiness vs liveness.** Readiness takes an instance out of the
//!   Service's endpoints while its database path fails, and puts it back when
//!   it heals. Liveness restarts the container: point it at `/up`, never at
//!   readiness, or a database outage restarts every instance at once (which
//!   cures nothing and adds a reconnect storm).
//! * **`timeoutSeconds` vs the bound.** The service answers within its bound
//!   whatever the database does; keep `timeoutSeconds` at least 1 s above it,
//!   so that a failure reaches the kubelet as a 503 with its reason rather
//!   than as a timeout. A probe the kubelet gives up on still runs to its
//!   bound in its own task, and closes its connection if the server never
//!   answered; with `periodSeconds` ≥ the bound probes do not pile up.
//! * **Load.** Probes run on the probe lane: a request flood (shed or not),
//!   held session locks and lease traffic do not make the instance unready.
//!   Shedding answers the flood; readiness answers for the database.
//! * **`failureThreshold` × `periodSeconds`** is how long an outage lasts
//!   before the instance leaves rotation; `startupProbe` on `/health/ready`
//!   (say `failureThreshold: 30`, `periodSeconds: 2`) covers a slow first
//!   connection without loosening readiness.

mod body;
mod readiness;
mod shed;
mod verdict;

pub use body::Body;
pub use readiness::{Liveness, Readiness};
pub use shed::{Shed, ShedLayer};
