//! A service backend in small: an HTTP service on a pgwarden pool of four,
//! with four background jobs (three cluster-wide, one per node) on table leases.
//!
//! ```sh
//! cargo run --example service                      # a throwaway PostgreSQL
//! DATABASE_URL=postgres://app@localhost/app cargo run --example service
//! # a second instance on the same database, another node, jobs 100× faster:
//! DATABASE_URL=… LISTEN_ADDR=127.0.0.1:8081 NODE_NAME=node-b \
//!   PGWARDEN_TIME_SCALE=0.01 cargo run --example service
//! ```
//!
//! Routes: `GET /up` (liveness, no database: `pgwarden::http::Liveness`),
//! `GET /health/ready` (`pgwarden::http::Readiness`: 200, or 503 with the
//! reason when the probe on the pool's probe reserve fails within 1 s; small
//! JSON), `GET /metrics` (Prometheus), and the request work behind
//! `pgwarden::http::ShedLayer` (503 with `Retry-After` at once when the
//! request lane cannot admit within 250 ms): `POST /items?name=…`,
//! `GET /items?limit=…&slow_ms=…`, and `GET /work?hold_ms=…` (holds a
//! connection, reports its checkout wait in `x-checkout-wait-us`). Demo routes for lock and lease pressure:
//! `POST /debug/hold-lock?key=…&ms=…` (a session advisory lock, 409 when the
//! session-lock budget refuses it) and `POST /debug/hold-lease?name=…&ms=…&ttl_ms=…`
//! (a table lease, 409 when held elsewhere).
//!
//! Jobs (`jobs.rs`), on table leases through `pgwarden::Scheduler`: cleanup
//! hourly, alert evaluation every 30 s, mail checks every 15 min (each on
//! one instance of the cluster per period), uptime checks every 10 s once
//! per node. Every run is recorded in `job_runs(job, node, instance, ran_at,
//! taken_at, period_ms, token)`.
//!
//! Environment: `DATABASE_URL` (unset: a throwaway PostgreSQL from
//! `pgwarden_testing`, whose URL is printed so that a second instance can
//! join), `LISTEN_ADDR` (default `127.0.0.1:8080`, port 0 for any),
//! `NODE_NAME` (default: host name), `INSTANCE_ID` (default
//! `<node>-<pid>`), `POOL_SIZE` (default 4), `POOL_NAME`
//! (default `service`: the metrics' `pool` label), `PGWARDEN_TIME_SCALE`
//! (default 1: multiplies the job periods, the lease TTL and the census
//! interval; periods stay at least 1 s), `SHED_MAX_WAIT_MS` (default 250,
//! `off`: no shedding), `READINESS_BOUND_MS` (default 1000), `RUST_LOG`
//! (default `info`).
//!
//! On start it prints `listening on http://<addr>` on stdout. SIGTERM or
//! Ctrl-C: stops taking requests, lets running jobs finish, releases its
//! leases, closes the pool, exits 0.

mod config;
mod jobs;
mod routes;
mod schema;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use pgwarden::Pool;
use pgwarden_testing::TestServer;

use config::Config;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("service: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), BoxError> {
    let cfg = Config::from_env()?;
    // Before the pool is built: its metric handles register with this recorder.
    let metrics = pgwarden::metrics::prometheus_builder()?.install_recorder()?;
    let upkeep = {
        let m = metrics.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                m.run_upkeep();
            }
        })
    };

    // Kept alive (and stopped on return) when we started it.
    let mut _server = None;
    let url = match &cfg.database_url {
        Some(url) => url.clone(),
        None => {
            let server = tokio::task::spawn_blocking(TestServer::start_local).await??;
            let db = server.create_database().await?;
            println!(
                "no DATABASE_URL: started a throwaway PostgreSQL; a second instance joins with\n  \
                 DATABASE_URL='{}' LISTEN_ADDR=127.0.0.1:8081 cargo run --example service",
                db.url()
            );
            _server = Some(server);
            db.url()
        }
    };
    let pool = Pool::from_url(&url, cfg.pool_size)?
        .name(&cfg.pool_name)
        // The census of pg_locks, on the scaled clock like the jobs.
        .census_interval(Some(
            cfg.scaled(Duration::from_secs(60))
                .max(Duration::from_secs(1)),
        ))
        .build()?;
    let pooler = pool.detect_pooler().await?;
    tracing::info!(?pooler, "pool ready");
    let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
    let addr = listener.local_addr()?;
    schema::install(&pool, &cfg.instance, &addr.to_string()).await?;
    // One lease table per process: the jobs and the demo route share it.
    let leases = pgwarden::Leases::new(&pool);
    let scheduler = jobs::start(&pool, &leases, &cfg)?;
    let periods: Vec<String> = jobs::periods(&cfg)
        .iter()
        .map(|(job, p)| format!("{job} every {p:?}"))
        .collect();
    tracing::info!(node = %cfg.node, "jobs: {}", periods.join(", "));

    let (shutdown_tx, shutdown) = tokio::sync::watch::channel(false);
    let state = routes::AppState {
        pool: pool.clone(),
        leases: leases.clone(),
        metrics,
        instance: Arc::from(cfg.instance.as_str()),
        shutdown,
    };
    println!(
        "instance {} (node {}, pool {} of {}) listening on http://{addr}",
        cfg.instance, cfg.node, cfg.pool_name, cfg.pool_size
    );
    let http = routes::HttpConfig {
        readiness_bound: cfg.readiness_bound,
        shed_max_wait: cfg.shed_max_wait,
    };
    axum::serve(listener, routes::router(state, http))
        .with_graceful_shutdown(async move {
            shutdown_signal().await;
            // In-flight demo requests stop holding, so the server can drain.
            let _ = shutdown_tx.send(true);
        })
        .await?;

    println!("instance {}: shutting down", cfg.instance);
    // Running jobs finish (within a grace period); their leases are released.
    scheduler.shutdown(Duration::from_secs(10)).await;
    // Whatever else this process holds (the demo route's leases release
    // themselves when told to stop; this is the safety net).
    let left = leases.release_all().await?;
    println!(
        "instance {}: leases released ({left} left at shutdown)",
        cfg.instance
    );
    pool.close();
    upkeep.abort();
    println!("instance {}: stopped", cfg.instance);
    Ok(())
}

/// SIGTERM or Ctrl-C (SIGINT).
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
