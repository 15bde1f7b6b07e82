//! Row 4s (issue 32): table leases on sqlx 0.8. pgwarden's `Leases` over
//! `pgwarden::sqlx::Pool` (B) against the seed's SQL sent through a raw
//! `sqlx::PgPool` (A): the plain lease SQL of rows 4b and 6a
//! (`INSERT … ON CONFLICT … DO UPDATE … WHERE expires_at < now()` /
//! `DELETE`), written as a sqlx user writes it, `sqlx::query(…)` on `&pool`:
//! prepared and cached per connection by sqlx, each statement on its own
//! checkout (a lease holds no connection between them).
//!
//! Every pair uses a new name; each side has its own database on the one
//! server; rounds interleave (A B, B A, …).
//!
//! Row 4s connects over the harness server's Unix socket; row 4st runs the
//! same over TCP (a server of its own listening on 127.0.0.1), where
//! pgwarden proves a sqlx pool direct by its own socket and names its
//! statements (over a Unix socket it cannot, and they go unnamed).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgwarden::{LeaseOptions, Leases, PoolerMode};
use pgwarden_testing::TestServer;
use sqlx08::postgres::PgPoolOptions;

use crate::ab::{interleave, median, throughput, Compared};
use crate::plain::{holder, PLAIN_ACQUIRE, PLAIN_DDL, PLAIN_RELEASE};
use crate::{BoxError, Row, Settings};

const TASKS: usize = 16;
const POOL: u32 = 16;
const TTL: Duration = Duration::from_secs(60);
/// pgwarden's pairs per second against the seed's SQL prepared, at least:
/// row 4b's target on deadpool.
const TARGET: f64 = 1.0;

pub fn describe(s: Settings) -> String {
    format!(
        "4s, 4st (feature `sqlx-0_8`; 4s over the server's Unix socket, 4st over TCP to \
         127.0.0.1, a server of its own with the same settings): {TASKS} tasks, sqlx 0.8 pools of {POOL} (`max_connections`, sqlx's \
         defaults otherwise) on each side; a pair is `acquire(new name, {TTL:?}, None)` + `release()` \
         through `pgwarden::Leases` over `pgwarden::sqlx::Pool` on the shipped defaults (B, the pool \
         detected direct), or the seed's SQL (`INSERT … ON CONFLICT … DO UPDATE … WHERE expires_at < \
         now()` / `DELETE`) as `sqlx::query(…).bind(…).fetch_optional(&pool)` / `execute(&pool)` on a \
         raw `sqlx::PgPool`, prepared and cached per connection by sqlx (A); a database per side on \
         one server; {} interleaved round pairs of {:?}",
        s.rounds * 2,
        s.round / 2
    )
}

/// Row 4s on `server`; row 4st (`tcp`) on a server of its own over TCP.
pub async fn leases(server: &TestServer, s: Settings, tcp: bool) -> Result<Row, BoxError> {
    let own;
    let (server, host) = if tcp {
        own = tokio::task::spawn_blocking(|| {
            TestServer::start_local_with(&[("listen_addresses", "127.0.0.1")], &[])
        })
        .await??;
        (&own, Some("127.0.0.1"))
    } else {
        (server, None)
    };
    let create = || async {
        let db = server.create_database().await?;
        Ok::<_, BoxError>(match host {
            Some(h) => db.over_tcp(h),
            None => db,
        })
    };
    let pool = |db: &pgwarden_testing::TestDb| {
        PgPoolOptions::new()
            .max_connections(POOL)
            .connect_lazy_with(crate::sqlx_options(db))
    };
    // A: the seed's SQL on a raw sqlx pool.
    let plain_db = create().await?;
    plain_db.connect().await?.batch_execute(PLAIN_DDL).await?;
    let raw = pool(&plain_db);
    // B: pgwarden on its shipped defaults.
    let warden_db = create().await?;
    let warden = crate::warden_sqlx::Pool::builder(pool(&warden_db))
        .name("bench-sqlx-leases")
        .build()?;
    let found = warden.detect_pooler().await?;
    if found != PoolerMode::Direct {
        return Err(format!("pooler detected {found:?}, expected Direct").into());
    }
    let leases = Leases::new(&warden);
    leases.install().await?;
    let next = Arc::new(AtomicU64::new(0));
    let dur = s.round / 2;
    let (a, b) = interleave(
        s.rounds * 2,
        || {
            let (raw, next) = (raw.clone(), next.clone());
            async move {
                throughput(TASKS, dur, move || {
                    let (raw, next) = (raw.clone(), next.clone());
                    async move {
                        let name = format!("s-{}", next.fetch_add(1, Ordering::Relaxed));
                        let holder = holder();
                        let won = sqlx08::query(PLAIN_ACQUIRE)
                            .bind(&name)
                            .bind(&holder)
                            .bind(TTL.as_secs_f64())
                            .fetch_optional(&raw)
                            .await
                            .expect("seed's SQL acquire");
                        assert!(won.is_some(), "a new name is free");
                        let gone = sqlx08::query(PLAIN_RELEASE)
                            .bind(&name)
                            .bind(&holder)
                            .execute(&raw)
                            .await
                            .expect("seed's SQL release");
                        assert_eq!(gone.rows_affected(), 1, "released");
                    }
                })
                .await
            }
        },
        || {
            let (leases, next) = (leases.clone(), next.clone());
            async move {
                throughput(TASKS, dur, move || {
                    let (leases, next) = (leases.clone(), next.clone());
                    async move {
                        let name = format!("s-{}", next.fetch_add(1, Ordering::Relaxed));
                        let lease = leases
                            .acquire(&name, &LeaseOptions::new(TTL), None)
                            .await
                            .expect("pgwarden acquire")
                            .expect("a new name is free");
                        lease.release().await.expect("pgwarden release");
                    }
                })
                .await
            }
        },
    )
    .await;
    let c = Compared::new(&a, &b);
    Ok(Row {
        id: if tcp { "4st" } else { "4s" },
        workload: format!(
            "lease acquire + release on sqlx 0.8 over {}, new name per pair, {TASKS} tasks, pool \
             {POOL}: pgwarden vs the seed's SQL through sqlx (prepared)",
            if tcp { "TCP" } else { "a Unix socket" }
        ),
        a: format!("seed's SQL through raw sqlx: {:.0} pairs/s", median(&a)),
        b: format!(
            "pgwarden sqlx, shipped defaults: {:.0} pairs/s; {:.2} statements/pair (`Leases::stats`)",
            median(&b),
            leases.stats().statements as f64 / (b.iter().sum::<f64>() * dur.as_secs_f64()).max(1.0)
        ),
        ratio: format!("{:.3}", c.pairs),
        target: "≥ 1.0 (prepared vs prepared)",
        met: (!s.smoke).then(|| c.at_least(TARGET)).flatten(),
        notes: c.spread(),
    })
}
