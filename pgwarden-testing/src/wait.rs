//! Bounded waits for tests: every wait has a limit, and a test that hits it
//! fails saying what it waited for.

use std::future::Future;
use std::time::{Duration, Instant};

/// How often [`eventually`] checks its condition.
const POLL: Duration = Duration::from_millis(10);

/// Checks `cond` every 10 ms until it holds.
///
/// # Panics
///
/// When `cond` still does not hold after `limit`: the test fails with
/// `what` and the limit.
///
/// ```no_run
/// # async fn t(pool: deadpool_postgres::Pool) {
/// use std::time::Duration;
/// pgwarden_testing::eventually(Duration::from_secs(5), "all connections back", || async {
///     pool.status().available == pool.status().size
/// })
/// .await;
/// # }
/// ```
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !cond().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?}: {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// Awaits `fut` for at most `limit` and returns its output.
///
/// # Panics
///
/// When `fut` is not done after `limit` (it is dropped): the test fails
/// with `what` and the limit.
///
/// ```no_run
/// # async fn t(client: tokio_postgres::Client) {
/// use std::time::Duration;
/// let row = pgwarden_testing::within(Duration::from_secs(5), "SELECT 1", client.query_one("SELECT 1", &[]))
///     .await
///     .unwrap();
/// # let _ = row; }
/// ```
pub async fn within<T>(limit: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: not done within {limit:?}"),
    }
}
