//! A pool pgwarden builds itself names its connections after the pool
//! (`application_name`), unless the settings name them.
//!
//! deadpool only, and not by omission: it exercises deadpool's own API,
//! `Pool::from_url` and `Pool::from_config` (a deadpool-postgres `Config`),
//! where pgwarden builds the wrapped pool and its connector. On sqlx
//! pgwarden never builds the pool: `pgwarden::sqlx::Pool::builder` takes
//! the user's `PgPool`, whose `PgConnectOptions` (`application_name`
//! included) are the user's; there is nothing of pgwarden's to name.

use pgwarden::Pool;
use pgwarden_testing::TestServer;

async fn app_name(pool: &Pool) -> String {
    let client = pool.get().await.expect("a connection");
    client
        .query_one("SELECT current_setting('application_name')", &[])
        .await
        .expect("SHOW")
        .get(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn connections_carry_the_pools_name_unless_the_settings_give_one() {
    let db = TestServer::shared()
        .expect("test server")
        .create_database()
        .await
        .expect("test database");
    let mut config = db.pg_config();
    let url = |c: &tokio_postgres::Config| {
        let host = match &c.get_hosts()[0] {
            tokio_postgres::config::Host::Tcp(h) => h.clone(),
            tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
        };
        format!(
            "host={host} port={} user={} dbname={}",
            c.get_ports()[0],
            c.get_user().unwrap(),
            c.get_dbname().unwrap()
        )
    };
    config.application_name("");
    let plain = url(&config);
    let pool = Pool::from_url(&plain, 2)
        .unwrap()
        .name("billing")
        .build()
        .unwrap();
    assert_eq!(app_name(&pool).await, "billing");
    // Unnamed: the default pool name.
    let pool2 = Pool::from_url(&plain, 2).unwrap().build().unwrap();
    assert_eq!(app_name(&pool2).await, pool2.name());
    // The settings win.
    let named = Pool::from_url(&format!("{plain} application_name=psql"), 2)
        .unwrap()
        .name("billing-2")
        .build()
        .unwrap();
    assert_eq!(app_name(&named).await, "psql");
    // from_config too.
    let mut cfg = deadpool_postgres::Config::new();
    cfg.url = Some(plain.clone());
    let pool3 = Pool::from_config(&cfg)
        .unwrap()
        .name("reports")
        .build()
        .unwrap();
    assert_eq!(app_name(&pool3).await, "reports");
}
