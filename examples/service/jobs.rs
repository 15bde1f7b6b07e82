//! Four background jobs (three cluster-wide, one per node), on table leases through pgwarden's
//! scheduler: no connection is held between statements, whatever the
//! number of jobs.
//!
//! | job | period | runs on |
//! |---|---|---|
//! | `cleanup` | 1 h | one instance of the cluster |
//! | `alerts` | 30 s | one instance of the cluster |
//! | `mail-checks` | 15 min | one instance of the cluster |
//! | `uptime` | 10 s | one instance per node |
//!
//! Periods are multiplied by `PGWARDEN_TIME_SCALE` (and clamped to the
//! scheduler's minimum, 1 s). Every run is recorded in
//! `job_runs` inside a transaction fenced by the run's lease, so a holder
//! whose lease was taken over can never record (or do) a run. A run belongs
//! to the period its lease was taken in (`taken_at`, the term's start on the
//! database clock); `ran_at`, when it was recorded, can fall in a later
//! period when the run is slow.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pgwarden::{Job, LeaseHandle, LeaseOptions, Leases, Pool, Scheduler};
use tokio_postgres::types::Type;

use crate::config::Config;
use crate::BoxError;

/// The lease TTL, two minutes, scaled like the periods (at least 1 s).
const TTL: Duration = Duration::from_secs(120);
/// The shortest period the scheduler accepts, and the shortest lease TTL.
const MIN_PERIOD: Duration = Duration::from_secs(1);
const MIN_TTL: Duration = Duration::from_secs(1);

#[derive(Clone)]
struct Ctx {
    pool: Pool,
    node: Arc<str>,
    instance: Arc<str>,
    scale: f64,
}

/// The periods in force: (job, period).
pub fn periods(cfg: &Config) -> [(&'static str, Duration); 4] {
    let p = |secs: u64| cfg.scaled(Duration::from_secs(secs)).max(MIN_PERIOD);
    [
        ("cleanup", p(3600)),
        ("alerts", p(30)),
        ("mail-checks", p(15 * 60)),
        ("uptime", p(10)),
    ]
}

/// Starts the scheduler with the four jobs.
pub fn start(pool: &Pool, leases: &Leases, cfg: &Config) -> Result<Scheduler, BoxError> {
    let ctx = Ctx {
        pool: pool.clone(),
        node: Arc::from(cfg.node.as_str()),
        instance: Arc::from(cfg.instance.as_str()),
        scale: cfg.time_scale,
    };
    let opts = LeaseOptions::new(cfg.scaled(TTL).clamp(MIN_TTL, TTL));
    let [cleanup_p, alerts_p, mail_p, uptime_p] = periods(cfg);
    let job = |(name, period): (&'static str, Duration), per_node: bool| {
        let ctx = ctx.clone();
        let run = move |lease: LeaseHandle| {
            let ctx = ctx.clone();
            async move {
                let r = run(&ctx, name, period, &lease).await;
                if let Err(e) = &r {
                    tracing::warn!(job = name, error = %e, "job failed");
                }
                r
            }
        };
        let j = if per_node {
            Job::per_node(name, period, run)
        } else {
            Job::every(name, period, run)
        };
        j.options(opts.clone())
    };
    let scheduler = Scheduler::builder(leases)
        .node(cfg.node.clone())
        .job(job(cleanup_p, false))
        .job(job(alerts_p, false))
        .job(job(mail_p, false))
        .job(job(uptime_p, true))
        .start()?;
    Ok(scheduler)
}

/// One run: the job's work and its record, in one transaction fenced by
/// the lease.
async fn run(
    ctx: &Ctx,
    name: &'static str,
    period: Duration,
    lease: &LeaseHandle,
) -> Result<(), BoxError> {
    // The uptime probes are network I/O: done before the transaction.
    let probes = if name == "uptime" {
        probe_monitors(ctx).await?
    } else {
        Vec::new()
    };
    let mut conn = ctx.pool.get().await?;
    let tx = lease.fence(conn.transaction().await?).await?;
    let done = match name {
        "cleanup" => cleanup(&tx).await?,
        "alerts" => alerts(&tx).await?,
        "mail-checks" => mail_checks(&tx, ctx.scale).await?,
        _ => uptime(&tx, &ctx.node, &probes).await?,
    };
    let period_ms = i64::try_from(period.as_millis()).unwrap_or(i64::MAX);
    tx.execute_typed(
        "INSERT INTO job_runs (job, node, instance, taken_at, period_ms, token) \
         VALUES ($1, $2, $3, $4, $5, $6)",
        &[
            (&name, Type::TEXT),
            (&&*ctx.node, Type::TEXT),
            (&&*ctx.instance, Type::TEXT),
            (&lease.term().taken_at, Type::TIMESTAMPTZ),
            (&period_ms, Type::INT8),
            (&lease.term().token, Type::INT8),
        ],
    )
    .await?;
    tx.commit().await?;
    tracing::debug!(job = name, token = lease.term().token, done, "job ran");
    Ok(())
}

/// Deletes expired passkey challenges and single-sign-on requests.
async fn cleanup(tx: &tokio_postgres::Transaction<'_>) -> Result<u64, BoxError> {
    let a = tx
        .execute(
            "DELETE FROM passkey_challenges WHERE expires_at < now()",
            &[],
        )
        .await?;
    let b = tx
        .execute("DELETE FROM sso_requests WHERE expires_at < now()", &[])
        .await?;
    Ok(a + b)
}

/// Compares each monitor's latest check with its recorded alert state, and
/// records the changes (a second run finds nothing to change).
async fn alerts(tx: &tokio_postgres::Transaction<'_>) -> Result<u64, BoxError> {
    let changed = tx
        .query(
            "UPDATE monitors m SET alerting = s.failing, changed_at = now()
             FROM (SELECT id, coalesce((SELECT NOT c.ok FROM uptime_checks c
                                        WHERE c.monitor_id = m2.id
                                        ORDER BY c.checked_at DESC LIMIT 1), false) AS failing
                   FROM monitors m2) s
             WHERE m.id = s.id AND m.alerting IS DISTINCT FROM s.failing
             RETURNING m.name, m.alerting",
            &[],
        )
        .await?;
    for r in &changed {
        let (name, alerting): (&str, bool) = (r.get(0), r.get(1));
        tracing::info!(monitor = name, alerting, "monitor alert state changed");
    }
    Ok(changed.len() as u64)
}

/// Marks the unverified mail domains not checked in the last 23 hours
/// (scaled) as checked. The DNS lookups (SPF, DKIM, DMARC) a real service
/// would make are out of this example's scope.
async fn mail_checks(tx: &tokio_postgres::Transaction<'_>, scale: f64) -> Result<u64, BoxError> {
    let window = 23.0 * 3600.0 * scale;
    let n = tx
        .execute(
            "UPDATE mail_domains SET last_checked_at = now()
             WHERE NOT verified
               AND (last_checked_at IS NULL
                    OR last_checked_at < now() - make_interval(secs => $1))",
            &[&window],
        )
        .await?;
    Ok(n)
}

/// A TCP connect to each monitor's target (every instance registers its own
/// address): (monitor id, ok, latency in ms).
async fn probe_monitors(ctx: &Ctx) -> Result<Vec<(i64, bool, f64)>, BoxError> {
    let monitors = {
        let conn = ctx.pool.get().await?;
        conn.query("SELECT id, target FROM monitors ORDER BY id", &[])
            .await?
    };
    let mut out = Vec::with_capacity(monitors.len());
    for m in monitors {
        let (id, target): (i64, String) = (m.get(0), m.get(1));
        let start = Instant::now();
        let ok = matches!(
            tokio::time::timeout(
                Duration::from_secs(1),
                tokio::net::TcpStream::connect(&target)
            )
            .await,
            Ok(Ok(_))
        );
        out.push((id, ok, start.elapsed().as_secs_f64() * 1000.0));
    }
    Ok(out)
}

/// Records this node's checks.
async fn uptime(
    tx: &tokio_postgres::Transaction<'_>,
    node: &str,
    probes: &[(i64, bool, f64)],
) -> Result<u64, BoxError> {
    for (id, ok, ms) in probes {
        tx.execute(
            "INSERT INTO uptime_checks (monitor_id, node, ok, latency_ms) VALUES ($1, $2, $3, $4)",
            &[id, &node, ok, ms],
        )
        .await?;
    }
    Ok(probes.len() as u64)
}
