//! Connection failures say what the server said (issue 16, point 10): a
//! `max_connections` filled by another application, or a role the server
//! refuses, shows the server's SQLSTATE and message in the error's text and
//! in the readiness 503 reason, not only "db error" deep in the source chain.

use crate::support;

use std::time::Duration;

use deadpool_postgres::PoolError;
use pgwarden::http::Readiness;
use pgwarden::{Error, Pool, PoolerMode};
use pgwarden_testing::{TestDb, TestServer};
use support::{db, eventually};
use tokio_postgres::error::SqlState;
use tower_service::Service as _;

const T: Duration = Duration::from_secs(10);
const BOUND: Duration = Duration::from_secs(2);

/// A pool of 2 on `db` as `user`, nothing started in the background.
fn pool_as(db: &TestDb, user: &str) -> Pool {
    let mut cfg = db.pg_config();
    cfg.user(user);
    Pool::builder(pgwarden_testing::deadpool(cfg, 2).unwrap())
        .name(format!("as-{user}"))
        .pooler(PoolerMode::Direct)
        .census_interval(None)
        .build()
        .unwrap()
}

/// The readiness service's answer: (status, the reason in its body).
async fn ready(pool: &Pool) -> (u16, String) {
    let mut svc = Readiness::new(pool.clone()).bound(BOUND);
    let req = axum::http::Request::get("/health/ready").body(()).unwrap();
    let resp = svc.call(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = axum::body::to_bytes(axum::body::Body::new(resp.into_body()), usize::MAX)
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let reason = v["reason"].as_str().unwrap_or_default().to_owned();
    (status, reason)
}

/// What pgwarden's error and the readiness 503 say when the server refuses
/// a new connection with `code`: both name the SQLSTATE and carry `message`.
async fn refused_with(pool: &Pool, code: &SqlState, message: &str) {
    let e = pool.readiness(BOUND).await.unwrap_err();
    let text = e.to_string();
    eprintln!("refused: {text}");
    assert!(
        text.contains(&format!("database error {}: ", code.code())) && text.contains(message),
        "error text: {text}"
    );
    assert!(
        text.starts_with("pool error: could not open a connection: "),
        "{text}"
    );
    let (status, reason) = ready(pool).await;
    assert_eq!(status, 503);
    assert!(
        reason.contains(code.code()) && reason.contains(message),
        "readiness reason: {reason}"
    );
    // deadpool's own error (`get`) keeps the server's error as its source.
    match pool.get().await {
        Err(PoolError::Backend(e)) => assert_eq!(e.code(), Some(code), "{e:?}"),
        other => panic!("expected a backend error, got {other:?}"),
    }
    // The typed parts are still there.
    let Error::Checkout(pgwarden::CheckoutError::Pool(PoolError::Backend(e))) = &e else {
        panic!("{e:?}")
    };
    assert_eq!(e.code(), Some(code));
}

/// Client backends connected now.
async fn clients(c: &tokio_postgres::Client) -> i64 {
    c.query_one(
        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

#[tokio::test]
async fn a_server_filled_by_another_application_says_so() {
    // 6 connections, 2 of them for superusers only.
    let server = tokio::task::spawn_blocking(|| {
        TestServer::start_local_with(
            &[
                ("max_connections", "6"),
                ("superuser_reserved_connections", "2"),
            ],
            &[],
        )
    })
    .await
    .unwrap()
    .expect("throwaway PostgreSQL with max_connections=6");
    let db = server.create_database().await.unwrap();
    let admin = db.connect().await.unwrap();
    admin
        .batch_execute(&format!(
            "CREATE ROLE app LOGIN; GRANT ALL ON DATABASE \"{}\" TO app",
            db.name()
        ))
        .await
        .unwrap();
    let app = pool_as(&db, "app");
    let postgres = pool_as(&db, "postgres");
    assert!(app.readiness(BOUND).await.is_ok());
    // The app's connection is idle in its pool: close it, so only the
    // other application fills the server.
    app.close();
    let app = pool_as(&db, "app");
    eventually(T, "only the admin connection left", || async {
        clients(&admin).await == 1
    })
    .await;

    // Another application takes every slot a non-superuser may use.
    let mut others = Vec::new();
    while clients(&admin).await < 4 {
        others.push(db.connect().await.unwrap());
    }
    refused_with(
        &app,
        &SqlState::TOO_MANY_CONNECTIONS,
        "remaining connection slots are reserved",
    )
    .await;

    // And then every slot.
    while clients(&admin).await < 6 {
        others.push(db.connect().await.unwrap());
    }
    refused_with(
        &postgres,
        &SqlState::TOO_MANY_CONNECTIONS,
        "sorry, too many clients already",
    )
    .await;

    drop(others);
    eventually(T, "ready once the other application left", || async {
        postgres.readiness(BOUND).await.is_ok()
    })
    .await;
}

#[tokio::test]
async fn a_role_the_server_refuses_says_why() {
    let db = db().await;
    let admin = db.connect().await.unwrap();
    // Roles are per server: named after the database.
    let nologin = format!("{}_nologin", db.name());
    let noconnect = format!("{}_noconnect", db.name());
    admin
        .batch_execute(&format!(
            "CREATE ROLE \"{nologin}\" NOLOGIN; \
             CREATE ROLE \"{noconnect}\" LOGIN; \
             REVOKE CONNECT ON DATABASE \"{db}\" FROM PUBLIC",
            db = db.name()
        ))
        .await
        .unwrap();

    refused_with(
        &pool_as(&db, &nologin),
        &SqlState::INVALID_AUTHORIZATION_SPECIFICATION,
        &format!("role \"{nologin}\" is not permitted to log in"),
    )
    .await;
    refused_with(
        &pool_as(&db, &noconnect),
        &SqlState::INSUFFICIENT_PRIVILEGE,
        &format!("permission denied for database \"{}\"", db.name()),
    )
    .await;
    let missing = format!("{}_missing", db.name());
    refused_with(
        &pool_as(&db, &missing),
        &SqlState::INVALID_AUTHORIZATION_SPECIFICATION,
        &format!("role \"{missing}\" does not exist"),
    )
    .await;

    admin
        .batch_execute(&format!(
            "DROP ROLE \"{nologin}\"; DROP ROLE \"{noconnect}\""
        ))
        .await
        .unwrap();
}
