//! The service's settings, from the environment.

use std::net::SocketAddr;
use std::time::Duration;

use crate::BoxError;

/// Settings read once at start-up.
#[derive(Clone, Debug)]
pub struct Config {
    /// `DATABASE_URL`; `None`: a throwaway PostgreSQL from `pgwarden_testing`.
    pub database_url: Option<String>,
    /// `LISTEN_ADDR` (default `127.0.0.1:8080`; port 0 picks a free one).
    pub listen: SocketAddr,
    /// `NODE_NAME` (default: the host name): per-node jobs run once per node.
    pub node: String,
    /// `INSTANCE_ID` (default `<node>-<pid>`): recorded with every job run.
    pub instance: String,
    /// `POOL_SIZE` (default 4).
    pub pool_size: usize,
    /// `POOL_NAME` (default `service`): the `pool` label of every metric.
    pub pool_name: String,
    /// `PGWARDEN_TIME_SCALE` (default 1): multiplies every job period, so
    /// that `0.01` runs the 10 s uptime check every 100 ms (periods are
    /// clamped to the scheduler's 1 s minimum).
    pub time_scale: f64,
    /// `SHED_MAX_WAIT_MS` (default 250): the load-shedding bound on the
    /// request routes; `off`: no shedding.
    pub shed_max_wait: Option<Duration>,
    /// `READINESS_BOUND_MS` (default 1000): the readiness bound.
    pub readiness_bound: Duration,
}

impl Config {
    /// Reads the environment; a malformed value is an error naming it.
    pub fn from_env() -> Result<Config, BoxError> {
        let var = |name: &str| {
            std::env::var(name)
                .ok()
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        let listen = match var("LISTEN_ADDR") {
            Some(v) => v
                .parse()
                .map_err(|e| format!("LISTEN_ADDR={v:?} is not ip:port: {e}"))?,
            None => SocketAddr::from(([127, 0, 0, 1], 8080)),
        };
        let node = var("NODE_NAME").unwrap_or_else(hostname);
        let instance =
            var("INSTANCE_ID").unwrap_or_else(|| format!("{node}-{}", std::process::id()));
        let pool_size = match var("POOL_SIZE") {
            Some(v) => v
                .parse()
                .map_err(|e| format!("POOL_SIZE={v:?} is not a number: {e}"))?,
            None => 4,
        };
        let time_scale = match var("PGWARDEN_TIME_SCALE") {
            Some(v) => {
                let s: f64 = v
                    .parse()
                    .map_err(|e| format!("PGWARDEN_TIME_SCALE={v:?} is not a number: {e}"))?;
                if !(s.is_finite() && s > 0.0 && s <= 1000.0) {
                    return Err(format!("PGWARDEN_TIME_SCALE={v:?} must be in (0, 1000]").into());
                }
                s
            }
            None => 1.0,
        };
        let ms = |name: &str, v: &str| -> Result<Duration, BoxError> {
            let n: u64 = v
                .parse()
                .map_err(|e| format!("{name}={v:?} is not a number of milliseconds: {e}"))?;
            Ok(Duration::from_millis(n))
        };
        let shed_max_wait = match var("SHED_MAX_WAIT_MS") {
            Some(v) if v == "off" => None,
            Some(v) => Some(ms("SHED_MAX_WAIT_MS", &v)?),
            None => Some(pgwarden::http::ShedLayer::DEFAULT_MAX_WAIT),
        };
        let readiness_bound = match var("READINESS_BOUND_MS") {
            Some(v) => ms("READINESS_BOUND_MS", &v)?,
            None => pgwarden::http::Readiness::DEFAULT_BOUND,
        };
        Ok(Config {
            shed_max_wait,
            readiness_bound,
            database_url: var("DATABASE_URL"),
            listen,
            node,
            instance,
            pool_size,
            pool_name: var("POOL_NAME").unwrap_or_else(|| "service".to_owned()),
            time_scale,
        })
    }

    /// A production period scaled by [`Config::time_scale`].
    pub fn scaled(&self, d: Duration) -> Duration {
        d.mul_f64(self.time_scale)
    }
}

/// The kernel's host name, else `localhost`.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}
