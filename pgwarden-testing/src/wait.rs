//! Bounded waits for tests: every wait has a limit, and a test that hits it
//! fails saying what it waited for.

use std::future::Future;
use std::time::{Duration, Instant};

/// How often [`eventually`] checks its condition, at the longest.
const POLL: Duration = Duration::from_millis(10);

/// The wait after the first failed check: doubled after each failed check
/// up to [`POLL`] (1, 2, 4, 8, 10, 10… ms). Most conditions hold a few
/// milliseconds after the first check (a connection's return, a release
/// finishing in a task): a flat 10 ms made each such wait 10 ms, and the
/// tests that wait so after each of a thousand operations spent most of
/// their time sleeping (`hostile_release2`'s thousand releases: 5 s of
/// sleeps per backend). At most four checks more than a flat 10 ms poll.
const FIRST_POLL: Duration = Duration::from_millis(1);

/// Checks `cond` until it holds: at once, then after 1, 2, 4 and 8 ms, then
/// every 10 ms.
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
    let mut wait = FIRST_POLL;
    while !cond().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?}: {what}"
        );
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(POLL);
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
