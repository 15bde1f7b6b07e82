//! sqlx 0.8's connect options for a test database (the checkout bench and
//! the workloads both include this file).

/// `db`'s settings as sqlx 0.8 options (no `.pgpass`: the harness has none).
pub fn sqlx_options(db: &pgwarden_testing::TestDb) -> sqlx08::postgres::PgConnectOptions {
    let cfg = db.pg_config();
    let mut o = sqlx08::postgres::PgConnectOptions::new_without_pgpass()
        .port(cfg.get_ports().first().copied().unwrap_or(5432))
        .username(cfg.get_user().unwrap_or("postgres"))
        .database(cfg.get_dbname().unwrap_or("postgres"));
    match cfg.get_hosts().first() {
        Some(tokio_postgres::config::Host::Unix(p)) => o = o.socket(p),
        Some(tokio_postgres::config::Host::Tcp(h)) => o = o.host(h),
        None => {}
    }
    o
}
