//! Lease tests' helpers: pools with a known `application_name` (to find
//! their backends), and two lease holders on one database.

use std::time::Duration;

use pgwarden::{Leases, Pool};
use pgwarden_testing::TestDb;
use tokio_postgres::Client;

/// A pgwarden pool of `size` on `db`, its backends named `app` in
/// `pg_stat_activity.application_name`.
pub fn pool(db: &TestDb, size: usize, app: &str) -> Pool {
    pool_with(db.pg_config(), size, app)
}

/// The same, connecting with `config` (another user, PgBouncer).
pub fn pool_with(mut config: tokio_postgres::Config, size: usize, app: &str) -> Pool {
    config.application_name(app);
    let inner = pgwarden_testing::deadpool(config, size).expect("deadpool");
    Pool::builder(inner)
        .name(app)
        .wait_timeout(Duration::from_secs(5))
        .build()
        .expect("pgwarden pool")
}

/// Backend pids of the connections named `app`.
pub async fn backends(admin: &Client, app: &str) -> Vec<i32> {
    admin
        .query_typed(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1",
            &[(&app, tokio_postgres::types::Type::TEXT)],
        )
        .await
        .expect("pg_stat_activity")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Two lease holders on one fresh database, as two service instances: A on
/// `pool_a` (its backends named `{name}-a`), B on a pool of 2 (`{name}-b`).
pub struct TwoHolders {
    pub db: TestDb,
    /// A plain connection for the test's own queries.
    pub admin: Client,
    /// A's pool: the work under A's leases runs on it; closing it is A crashing.
    pub pool_a: Pool,
    pub a: Leases,
    pub b: Leases,
}

impl TwoHolders {
    /// A on a pool of `size_a`, the lease table not installed yet.
    pub async fn new(name: &str, size_a: usize) -> TwoHolders {
        let db = super::db().await;
        let admin = super::admin(&db).await;
        let pool_a = pool(&db, size_a, &format!("{name}-a"));
        let a = Leases::new(&pool_a);
        let b = Leases::new(&pool(&db, 2, &format!("{name}-b")));
        TwoHolders {
            db,
            admin,
            pool_a,
            a,
            b,
        }
    }

    /// Pools of 2 each, the lease table installed (by B).
    pub async fn installed(name: &str) -> TwoHolders {
        let t = TwoHolders::new(name, 2).await;
        t.b.install().await.expect("install the lease table");
        t
    }
}
