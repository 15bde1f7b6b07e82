//! Connection failures say what the server said (issue 16, point 10): a
//! `max_connections` filled by another application, or a role the server
//! refuses, shows the server's SQLSTATE and message in the error's text and
//! in the readiness 503 reason, not only "db error" deep in the source chain.
//! On every backend.

use crate::support;

use std::time::Duration;

use pgwarden::PoolerMode;
use pgwarden_testing::{TestDb, TestServer};
use support::backend::{call, Backend, Settings};
use support::{db, eventually};
use tokio_postgres::error::SqlState;

const T: Duration = Duration::from_secs(10);
const BOUND: Duration = Duration::from_secs(2);

/// A pool of 2 on `db` as `user`, nothing started in the background.
fn pool_as<B: Backend>(db: &TestDb, user: &str) -> B::Pool {
    let mut cfg = db.pg_config();
    cfg.user(user);
    let name: &'static str = Box::leak(format!("as-{user}").into_boxed_str());
    B::build_on(&cfg, &Settings::new(name, 2).pooler(PoolerMode::Direct))
}

/// The readiness service's answer: (status, the reason in its body).
async fn ready<B: Backend>(pool: &B::Pool) -> (u16, String) {
    let (status, body) = call(&B::app(pool, BOUND, BOUND), "/ready").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let reason = v["reason"].as_str().unwrap_or_default().to_owned();
    (status, reason)
}

/// What pgwarden's error and the readiness 503 say when the server refuses
/// a new connection with `code`: both name the SQLSTATE and carry `message`.
async fn refused_with<B: Backend>(pool: &B::Pool, code: &SqlState, message: &str) {
    let e = B::readiness(pool, BOUND).await.unwrap_err();
    let text = e.to_string();
    eprintln!("refused: {text}");
    assert!(
        text.contains(&format!("database error {}: ", code.code())) && text.contains(message),
        "error text: {text}"
    );
    // (deadpool says more: "could not open a connection: "; sqlx's error
    // does not tell its connect's failures from its other ones.)
    assert!(text.starts_with("pool error: "), "{text}");
    let (status, reason) = ready::<B>(pool).await;
    assert_eq!(status, 503);
    assert!(
        reason.contains(code.code()) && reason.contains(message),
        "readiness reason: {reason}"
    );
    // The drop-in checkout's own error (deadpool's `get`, sqlx's
    // `acquire`) keeps the server's error as its source.
    match B::get(pool).await {
        Err(e) => assert_eq!(B::drop_in_code(&e).as_deref(), Some(code.code()), "{e:?}"),
        Ok(c) => panic!("a connection the server refuses: {c:?}"),
    }
    // The typed parts are still there: the server's error in the chain.
    assert_eq!(B::source_code(&e).as_deref(), Some(code.code()), "{e:?}");
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

// FINDING (session 39; a fix tried in stop 40 and reverted): on sqlx a
// server with no slot left answers every probe with a timeout ("readiness
// probe did not answer within 2s"), not the server's 53300: sqlx takes
// "too many connections" for a transient failure of its connect phase and
// retries it until its acquire timeout, so what the server said never
// reaches pgwarden. Stop 40 made pgwarden's sqlx checkout try one
// connection of its own when sqlx's connect took longer than usual; the
// hostile reader showed that attempt refused with 53300 while sqlx's own
// connect held the one free slot (a checkout failed on a server with room:
// `hostile_s40::sqlx_0_*::one_free_slot_is_enough_for_a_slow_connect`) and
// doubling every pool's first slow connect, so it was taken out. (The
// app's connection still open after `close()` on sqlx 0.8 is fixed: the
// drop-in `close` closes what sqlx 0.8's close left.)
backends!(
    ignore_sqlx = "FINDING: on sqlx a full server (53300) reads as a probe timeout: sqlx retries its connect until its own timeout (stop 40's own connect attempt was reverted: it failed checkouts on a server with a free slot)",
    a_server_filled_by_another_application_says_so
);
async fn a_server_filled_by_another_application_says_so<B: Backend>() {
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
    let app = pool_as::<B>(&db, "app");
    let postgres = pool_as::<B>(&db, "postgres");
    assert!(B::readiness(&app, BOUND).await.is_ok());
    // The app's connection is idle in its pool: close it, so only the
    // other application fills the server.
    B::close(&app).await;
    let app = pool_as::<B>(&db, "app");
    eventually(T, "only the admin connection left", || async {
        clients(&admin).await == 1
    })
    .await;

    // Another application takes every slot a non-superuser may use.
    let mut others = Vec::new();
    while clients(&admin).await < 4 {
        others.push(db.connect().await.unwrap());
    }
    refused_with::<B>(
        &app,
        &SqlState::TOO_MANY_CONNECTIONS,
        "remaining connection slots are reserved",
    )
    .await;

    // And then every slot.
    while clients(&admin).await < 6 {
        others.push(db.connect().await.unwrap());
    }
    refused_with::<B>(
        &postgres,
        &SqlState::TOO_MANY_CONNECTIONS,
        "sorry, too many clients already",
    )
    .await;

    drop(others);
    eventually(T, "ready once the other application left", || async {
        B::readiness(&postgres, BOUND).await.is_ok()
    })
    .await;
}

backends!(a_role_the_server_refuses_says_why);
/// (Failed on sqlx before `CheckoutError::Backend` showed the SQLSTATE:
/// "pool error: error returned from database: role … is not permitted to
/// log in", no code.)
async fn a_role_the_server_refuses_says_why<B: Backend>() {
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

    refused_with::<B>(
        &pool_as::<B>(&db, &nologin),
        &SqlState::INVALID_AUTHORIZATION_SPECIFICATION,
        &format!("role \"{nologin}\" is not permitted to log in"),
    )
    .await;
    refused_with::<B>(
        &pool_as::<B>(&db, &noconnect),
        &SqlState::INSUFFICIENT_PRIVILEGE,
        &format!("permission denied for database \"{}\"", db.name()),
    )
    .await;
    let missing = format!("{}_missing", db.name());
    refused_with::<B>(
        &pool_as::<B>(&db, &missing),
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
