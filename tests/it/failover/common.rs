//! What the failover tests share: the service's way to the primary and
//! its pools, the fenced-write table and its writes, a log of the fencing
//! tokens drawn, and a few bounded reads.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgwarden::{Error, LeaseError, LeaseHandle, LostReason};
use pgwarden_testing::{Cluster, Proxy, Upstream};
use tokio_postgres::{Client, Config};

use super::together::Seat;
use crate::support::backend::{Backend, Settings};

/// The bound of every single step of the tests (a statement, a checkout).
pub const STEP: Duration = Duration::from_secs(5);

/// The service's way to the primary. A backend that follows a multi-host
/// connection string ([`Backend::MULTI_HOST`], deadpool) gets the cluster's
/// (`target_session_attrs=read-write`) and finds the promoted server by
/// itself. One that connects to one host (sqlx) gets a fixed address that
/// the operator's tooling moves to the promoted server, as a virtual IP or
/// a DNS name is: a proxy here, moved by [`Front::follow`].
pub struct Front {
    proxy: Proxy,
}

fn at(cluster: &Cluster) -> Upstream {
    let p = cluster.primary();
    Upstream::Tcp(
        format!("{}:{}", p.host(), p.port())
            .parse()
            .expect("address"),
    )
}

impl Front {
    pub fn new(cluster: &Cluster) -> Front {
        let proxy = Proxy::start_to(at(cluster)).expect("proxy");
        Front { proxy }
    }

    /// The connection settings of a service instance on backend `B`.
    pub fn config<B: Backend>(&self, cluster: &Cluster, db: &str) -> Config {
        if B::MULTI_HOST {
            cluster.multi_host_config(db)
        } else {
            self.proxy.retarget(&cluster.primary().pg_config(db))
        }
    }

    /// The fixed address moves to the cluster's primary (after a promotion).
    pub fn follow(&self, cluster: &Cluster) {
        self.proxy.set_upstream(at(cluster));
    }
}

/// A service instance's pool of `size` on backend `B`, its backends named
/// `app`.
pub fn service_pool<B: Backend>(
    front: &Front,
    cluster: &Cluster,
    db: &str,
    app: &'static str,
    size: usize,
) -> B::Pool {
    let mut config = front.config::<B>(cluster, db);
    config.application_name(app);
    B::build_on(&config, &Settings::new(app, size).wait(STEP))
}

/// The fenced writes' table, and a one-row clock that orders them by
/// commit: each fenced transaction increments it and keeps its row lock
/// until commit, so `n` grows in commit order whoever writes.
pub const SCHEMA: &str = "
CREATE TABLE fence_clock (id int PRIMARY KEY, n bigint NOT NULL);
INSERT INTO fence_clock VALUES (1, 0);
CREATE TABLE fenced (
    n      bigint PRIMARY KEY,
    lease  text   NOT NULL,
    token  bigint NOT NULL,
    seq    int    NOT NULL,
    holder text   NOT NULL
);";

/// A fresh database on the shared cluster with [`SCHEMA`], and a client on
/// that database on the primary.
pub async fn database(seat: &Seat) -> (String, Client) {
    let cluster = seat.cluster().await;
    let db = cluster.create_database().await.expect("database");
    let primary = cluster.primary().connect(&db).await.expect("primary");
    primary.batch_execute(SCHEMA).await.expect("schema");
    (db, primary)
}

/// One fenced write: commit order, lease, token, sequence number in its
/// term, holder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub n: i64,
    pub lease: String,
    pub token: i64,
    pub seq: i32,
    pub holder: String,
}

/// Why a fenced write did not commit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WriteError {
    /// `lease.fence` rejected it: the term is over.
    Rejected(LostReason),
    /// Anything else (no server, connection lost, timeout), as text.
    Failed(String),
}

/// A fenced write: the next commit number, and `(lease, token, seq,
/// holder)` under it (the clock's row lock is held until commit).
const WRITE: &str = "WITH c AS (UPDATE fence_clock SET n = n + 1 WHERE id = 1 RETURNING n) \
     INSERT INTO fenced (n, lease, token, seq, holder) \
     SELECT n, $1::text, $2::int8, $3::int4, $4::text FROM c RETURNING n";

/// A fenced write under `lease`: checks the term in the transaction
/// (`lease.fence`), takes the next commit number, writes `(token, seq)`,
/// commits. Bounded by [`STEP`] in all.
pub async fn fenced_write<B: Backend>(
    pool: &B::Pool,
    lease: &LeaseHandle,
    seq: i32,
) -> Result<Row, WriteError> {
    match tokio::time::timeout(STEP, B::fenced_scalar(pool, lease, WRITE, seq)).await {
        Ok(Ok(n)) => Ok(Row {
            n,
            lease: lease.term().name.clone(),
            token: lease.term().token,
            seq,
            holder: lease.term().holder.clone(),
        }),
        Ok(Err(Error::Lease(LeaseError::Lost { reason, .. }))) => Err(WriteError::Rejected(reason)),
        Ok(Err(e)) => Err(WriteError::Failed(e.to_string())),
        Err(_) => Err(WriteError::Failed(format!("not done within {STEP:?}"))),
    }
}

/// Every fenced row, in commit order.
pub async fn fenced_rows(client: &Client) -> Vec<Row> {
    client
        .query(
            "SELECT n, lease, token, seq, holder FROM fenced ORDER BY n",
            &[],
        )
        .await
        .expect("fenced rows")
        .iter()
        .map(|r| Row {
            n: r.get(0),
            lease: r.get(1),
            token: r.get(2),
            seq: r.get(3),
            holder: r.get(4),
        })
        .collect()
}

/// The lease row of `name`: (holder, token, seconds until it expires, on
/// the server's clock; negative once expired).
pub async fn lease_row(client: &Client, name: &str) -> Option<(String, i64, f64)> {
    client
        .query_opt(
            "SELECT holder, token, extract(epoch FROM expires_at - clock_timestamp())::float8 \
               FROM pgwarden_leases WHERE name = $1",
            &[&name],
        )
        .await
        .expect("lease row")
        .map(|r| (r.get(0), r.get(1), r.get(2)))
}

/// The token sequence as this server sees it: (last_value, log_cnt).
/// On a replica, `last_value` is the last value a replayed WAL record
/// covers (PostgreSQL logs 32 values ahead of what it hands out).
pub async fn sequence(client: &Client) -> (i64, i64) {
    let r = client
        .query_one(
            "SELECT last_value, log_cnt FROM pgwarden_leases_token_seq",
            &[],
        )
        .await
        .expect("token sequence");
    (r.get(0), r.get(1))
}

/// One token as a holder received it: when, the token, which kind of holder.
type Received = (Instant, i64, &'static str);

/// Fencing tokens as the holders received them, with when.
#[derive(Clone, Default)]
pub struct Tokens(Arc<Mutex<Vec<Received>>>);

impl Tokens {
    pub fn record(&self, token: i64, source: &'static str) {
        self.0.lock().unwrap().push((Instant::now(), token, source));
    }

    /// Tokens received before `t`, and those received at or after it.
    pub fn split(&self, t: Instant) -> (Vec<i64>, Vec<i64>) {
        let all = self.0.lock().unwrap();
        let pick = |before: bool| {
            all.iter()
                .filter(|(at, ..)| (*at < t) == before)
                .map(|(_, k, _)| *k)
                .collect()
        };
        (pick(true), pick(false))
    }

    /// How many tokens `source` received.
    pub fn count(&self, source: &str) -> usize {
        let all = self.0.lock().unwrap();
        all.iter().filter(|(_, _, s)| *s == source).count()
    }

    /// How many tokens `source` received at or after `t`.
    pub fn count_since(&self, source: &str, t: Instant) -> usize {
        let all = self.0.lock().unwrap();
        all.iter()
            .filter(|(at, _, s)| *s == source && *at >= t)
            .count()
    }
}

/// Polls `cond` every 10 ms up to `limit`; the instant it first held.
pub async fn until<F, Fut>(limit: Duration, mut cond: F) -> Option<Instant>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if cond().await {
            return Some(Instant::now());
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
