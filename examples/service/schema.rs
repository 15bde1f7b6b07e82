//! The service's tables, created once per database at start-up.

use std::time::Duration;

use pgwarden::Pool;

use crate::BoxError;

/// A service backend in miniature: items for the request routes; passkey
/// challenges and SSO requests for the clean-up; monitors, their checks and
/// alert state for the uptime and alert jobs; mail domains for the mail
/// checks; and `job_runs`, where every job run is recorded.
pub const DDL: &str = "
CREATE TABLE IF NOT EXISTS items (
    id         bigserial   PRIMARY KEY,
    name       text        NOT NULL,
    instance   text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS passkey_challenges (
    id         bigserial   PRIMARY KEY,
    expires_at timestamptz NOT NULL
);
CREATE TABLE IF NOT EXISTS sso_requests (
    id         bigserial   PRIMARY KEY,
    expires_at timestamptz NOT NULL
);
CREATE TABLE IF NOT EXISTS monitors (
    id         bigserial   PRIMARY KEY,
    name       text        NOT NULL UNIQUE,
    target     text        NOT NULL,
    alerting   boolean     NOT NULL DEFAULT false,
    changed_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS uptime_checks (
    id         bigserial   PRIMARY KEY,
    monitor_id bigint      NOT NULL REFERENCES monitors(id),
    node       text        NOT NULL,
    ok         boolean     NOT NULL,
    latency_ms double precision NOT NULL,
    checked_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS uptime_checks_recent ON uptime_checks (monitor_id, checked_at DESC);
CREATE TABLE IF NOT EXISTS mail_domains (
    domain          text        PRIMARY KEY,
    verified        boolean     NOT NULL DEFAULT false,
    last_checked_at timestamptz
);
CREATE TABLE IF NOT EXISTS job_runs (
    id        bigserial   PRIMARY KEY,
    job       text        NOT NULL,
    node      text        NOT NULL,
    instance  text        NOT NULL,
    ran_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    taken_at  timestamptz NOT NULL,
    period_ms bigint      NOT NULL,
    token     bigint      NOT NULL
);
";

/// Some expired rows for the clean-up, and unverified mail domains.
const SAMPLE_DATA: &str = "
INSERT INTO passkey_challenges (expires_at)
    SELECT now() - interval '1 hour' FROM generate_series(1, 20);
INSERT INTO sso_requests (expires_at)
    SELECT now() + interval '1 hour' FROM generate_series(1, 5);
INSERT INTO mail_domains (domain)
    SELECT 'example-' || i || '.test' FROM generate_series(1, 8) AS i
    ON CONFLICT DO NOTHING;
";

/// Creates the tables once per database, whatever the number of instances
/// starting together (`CREATE … IF NOT EXISTS` races with itself across
/// sessions), then registers this instance as a monitor.
pub async fn install(pool: &Pool, instance: &str, target: &str) -> Result<(), BoxError> {
    let ran = pool
        .migrate_once("service/0001_schema", Duration::from_secs(30), |tx| {
            Box::pin(async move {
                tx.batch_execute(DDL).await?;
                tx.batch_execute(SAMPLE_DATA).await?;
                Ok::<_, pgwarden::Error>(())
            })
        })
        .await?;
    if matches!(ran, pgwarden::Migrated::Ran(_)) {
        tracing::info!("schema created");
    }
    let conn = pool.get().await?;
    conn.execute(
        "INSERT INTO monitors (name, target) VALUES ($1, $2)
         ON CONFLICT (name) DO UPDATE SET target = excluded.target",
        &[&instance, &target],
    )
    .await?;
    Ok(())
}
