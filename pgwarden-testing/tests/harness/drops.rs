//! A `TestDb` drops its database once its last clone and its clients are
//! gone, on a thread of the harness; a frozen server or a stopped backend
//! holds up the drops on that server only.

use std::time::Duration;

use pgwarden_testing::{eventually, TestServer};
use tokio_postgres::{Client, Config, NoTls};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A guard against a hang: a drop takes milliseconds.
const BOUND: Duration = Duration::from_secs(20);

async fn admin(config: &Config) -> Result<Client> {
    let (client, conn) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

async fn exists(admin: &Client, name: &str) -> bool {
    admin
        .query_one(
            "SELECT count(*) FROM pg_database WHERE datname = $1",
            &[&name],
        )
        .await
        .map(|r| r.get::<_, i64>(0) == 1)
        .unwrap_or(true)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_goes_with_its_last_test_db_and_client() -> Result {
    let server = TestServer::shared()?;
    let admin = admin(&server.pg_config()).await?;
    let db = server.create_database().await?;
    let name = db.name().to_owned();
    let copy = db.clone();
    let client = db.connect().await?;
    drop(db);
    drop(copy);
    // The client keeps it: no drop was queued.
    let one: i32 = client.query_one("SELECT 1", &[]).await?.get(0);
    assert_eq!(one, 1);
    assert!(exists(&admin, &name).await, "dropped under its client");
    drop(client);
    eventually(BOUND, "the database dropped after its client", || {
        let (admin, name) = (&admin, &name);
        async move { !exists(admin, name).await }
    })
    .await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_server_holds_up_no_other_servers_drops() -> Result {
    let own = tokio::task::spawn_blocking(TestServer::start_local).await??;
    let shared = TestServer::shared()?;
    let admin = admin(&shared.pg_config()).await?;
    // Its drop cannot even connect while the server is frozen (the socket
    // accepts, the start-up is never answered).
    let stuck = own.create_database().await?;
    let frozen = own.freeze()?;
    drop(stuck);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let db = shared.create_database().await?;
    let name = db.name().to_owned();
    drop(db);
    // Before stop 45's fix the one dropper thread waited on the frozen
    // server first: nothing of the shared server's was dropped until the
    // freeze ended.
    eventually(BOUND, "the shared server's database dropped", || {
        let (admin, name) = (&admin, &name);
        async move { !exists(admin, name).await }
    })
    .await;
    drop(frozen);
    Ok(())
}
