//! The fault proxy: forwarding, latency, a partition that closes nothing,
//! resets; against a real throwaway PostgreSQL.

use std::time::{Duration, Instant};

use pgwarden_testing::{eventually, within, Proxy, TestDb, TestServer};
use tokio::io::AsyncReadExt;
use tokio_postgres::Client;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// How long a statement through a partition is given to (not) answer: far
/// above a `SELECT 1` on a loaded 2-core machine (a few ms).
const HANG: Duration = Duration::from_millis(500);
/// Bound on anything that must happen once the fault is over.
const RECOVER: Duration = Duration::from_secs(5);

async fn setup() -> Result<(TestDb, Proxy)> {
    let server = TestServer::shared()?;
    let db = server.create_database().await?;
    let proxy = Proxy::start(server)?;
    Ok((db, proxy))
}

async fn backend_pid(c: &Client) -> Result<i32> {
    Ok(c.query_one("SELECT pg_backend_pid()", &[]).await?.get(0))
}

/// The backend's `state` in `pg_stat_activity`, asked on a direct connection.
async fn backend_state(direct: &Client, pid: i32) -> Result<Option<String>> {
    Ok(direct
        .query_opt("SELECT state FROM pg_stat_activity WHERE pid = $1", &[&pid])
        .await?
        .map(|r| r.get(0)))
}

#[tokio::test]
async fn statements_go_through_and_connections_are_counted() -> Result {
    let (db, proxy) = setup().await?;
    let client = within(RECOVER, "connect through the proxy", proxy.connect(&db)).await?;
    let row = client.query_one("SELECT current_database()", &[]).await?;
    assert_eq!(row.get::<_, String>(0), db.name());
    assert_eq!((proxy.accepted(), proxy.connections()), (1, 1));

    let pool = proxy.deadpool(&db, 2)?;
    let pooled = pool.get().await?;
    assert_eq!(
        pooled
            .query_one("SELECT 1 + 1", &[])
            .await?
            .get::<_, i32>(0),
        2
    );
    assert_eq!((proxy.accepted(), proxy.connections()), (2, 2));
    assert!(proxy
        .url(&db)
        .contains(&format!("port={}", proxy.addr().port())));

    drop(client);
    eventually(
        RECOVER,
        "the closed client's connection uncounted",
        || async { proxy.connections() == 1 },
    )
    .await;
    Ok(())
}

/// The latency of `latency_is_added_each_way`: long enough that the
/// machine's own delays (a loaded 2-core machine stalls a task for tens of
/// milliseconds, rarely hundreds) stay well under one more latency, which
/// is what the upper bounds tell apart.
const L: Duration = Duration::from_millis(500);

#[tokio::test]
async fn latency_is_added_each_way() -> Result {
    let (db, proxy) = setup().await?;
    let client = proxy.connect(&db).await?;
    client.simple_query("SELECT 1").await?;
    let t = Instant::now();
    client.simple_query("SELECT 1").await?;
    let direct = t.elapsed();

    proxy.set_latency(L);
    assert_eq!(proxy.latency(), L);
    let t = Instant::now();
    client.simple_query("SELECT 1").await?;
    let slow = t.elapsed();
    eprintln!("SELECT 1 round trip: {direct:?} without latency, {slow:?} with {L:?} each way");
    // Once each way: 2 L, and not a third time (a margin of L).
    assert!(slow >= 2 * L, "{slow:?}");
    assert!(slow < 3 * L, "{slow:?}");

    // A new connection: the handshake's round trip, then the startup's.
    let t = Instant::now();
    let second = proxy.connect(&db).await?;
    let connect = t.elapsed();
    eprintln!("connect with {L:?} each way: {connect:?}");
    assert!(connect >= 4 * L, "{connect:?}");
    assert!(connect < 6 * L, "{connect:?}");

    // Back to none: applies to the open connections at once (a round trip
    // still delayed would take 2 L).
    proxy.set_latency(Duration::ZERO);
    let t = Instant::now();
    second.simple_query("SELECT 1").await?;
    assert!(t.elapsed() < L, "{:?}", t.elapsed());
    Ok(())
}

#[tokio::test]
async fn blackhole_hangs_without_closing_and_heal_delivers() -> Result {
    let (db, proxy) = setup().await?;
    let direct = db.connect().await?;
    let client = proxy.connect(&db).await?;
    let pid = backend_pid(&client).await?;
    client.batch_execute("BEGIN").await?;

    proxy.blackhole();
    assert!(proxy.is_blackholed());
    let mut query = Box::pin(client.query_one("SELECT 41 + 1", &[]));
    assert!(
        tokio::time::timeout(HANG, &mut query).await.is_err(),
        "a statement went through the partition"
    );
    // The server keeps the session, waiting for a client that never answers.
    assert_eq!(
        backend_state(&direct, pid).await?.as_deref(),
        Some("idle in transaction")
    );
    // A new connection is accepted and gets nothing.
    let mut late = Box::pin(proxy.connect(&db));
    assert!(tokio::time::timeout(HANG, &mut late).await.is_err());
    eventually(RECOVER, "the held connection accepted", || async {
        proxy.connections() == 2
    })
    .await;

    proxy.heal();
    let row = within(RECOVER, "the held statement after heal", query).await?;
    assert_eq!(row.get::<_, i32>(0), 42);
    let late = within(RECOVER, "the held connection after heal", late).await?;
    late.simple_query("SELECT 1").await?;
    client.batch_execute("COMMIT").await?;
    Ok(())
}

#[tokio::test]
async fn a_session_ended_during_the_partition_reaches_the_client_after_heal() -> Result {
    let (db, proxy) = setup().await?;
    let direct = db.connect().await?;
    let client = proxy.connect(&db).await?;
    let pid = backend_pid(&client).await?;

    proxy.blackhole();
    let terminated: bool = direct
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .await?
        .get(0);
    assert!(terminated);
    eventually(RECOVER, "the backend gone", || async {
        matches!(backend_state(&direct, pid).await, Ok(None))
    })
    .await;
    // Neither the server's error nor its close crossed the partition: a
    // statement hangs instead of failing at once.
    let mut query = Box::pin(client.simple_query("SELECT 1"));
    assert!(
        tokio::time::timeout(HANG, &mut query).await.is_err(),
        "the close crossed the partition"
    );
    assert!(!client.is_closed());

    proxy.heal();
    let err = within(RECOVER, "the statement after heal", query)
        .await
        .expect_err("a statement on a terminated backend succeeded");
    eprintln!("after heal: {err}");
    assert!(client.is_closed());
    Ok(())
}

#[tokio::test]
async fn reset_all_fails_the_client_and_ends_the_backend() -> Result {
    let (db, proxy) = setup().await?;
    let direct = db.connect().await?;
    let client = proxy.connect(&db).await?;
    let pid = backend_pid(&client).await?;
    client.batch_execute("BEGIN").await?;

    // A raw socket shows how the proxy closes: RST, not FIN.
    let mut raw = tokio::net::TcpStream::connect(proxy.addr()).await?;
    eventually(RECOVER, "both connections open", || async {
        proxy.connections() == 2
    })
    .await;

    assert_eq!(proxy.reset_all(), 2);
    assert_eq!(proxy.connections(), 0);
    let mut buf = [0u8; 16];
    let read = within(RECOVER, "reading the reset socket", raw.read(&mut buf)).await;
    assert_eq!(
        read.map_err(|e| e.kind()),
        Err(std::io::ErrorKind::ConnectionReset),
        "not an RST"
    );
    let t = Instant::now();
    let err = within(
        RECOVER,
        "the next statement after a reset",
        client.simple_query("SELECT 1"),
    )
    .await
    .expect_err("a statement went through a reset connection");
    eprintln!("after reset_all: {err} in {:?}", t.elapsed());
    assert!(client.is_closed(), "{err}");
    eventually(
        RECOVER,
        "the backend of the reset connection gone",
        || async { matches!(backend_state(&direct, pid).await, Ok(None)) },
    )
    .await;

    // The proxy still takes new connections.
    let again = proxy.connect(&db).await?;
    again.simple_query("SELECT 1").await?;
    assert_eq!((proxy.accepted(), proxy.connections()), (3, 1));
    Ok(())
}
