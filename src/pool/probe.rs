//! The readiness probe's work: `SELECT 1` on the probe lane, bounded.

use std::panic::Location;
use std::time::Duration;

use super::shared::Pool;
use crate::admission::Lane;
use crate::error::{CheckoutError, Error};

impl Pool {
    /// `SELECT 1` on the probe lane within `timeout`, checkout included; its
    /// latency ([`Pool::readiness`]).
    pub(crate) async fn probe(
        &self,
        timeout: Duration,
        site: &'static Location<'static>,
    ) -> Result<Duration, Error> {
        let start = tokio::time::Instant::now();
        let m = &self.shared.metrics;
        if timeout.is_zero() {
            // No probe can answer within nothing: say so at once, without
            // checking out (and then closing) a healthy connection.
            m.readiness_timeout.increment(1);
            return Err(Error::Checkout(CheckoutError::ReadinessTimeout(timeout)));
        }
        let result = match self.checkout(Lane::Probe, site, timeout).await {
            Ok(c) => {
                let left = timeout.saturating_sub(start.elapsed());
                match tokio::time::timeout(left, c.simple_query("SELECT 1")).await {
                    Ok(r) => r.map(drop).map_err(Error::from),
                    Err(_) => {
                        // The server did not answer: this connection is
                        // in an unknown state, never reuse it.
                        c.discard();
                        Err(Error::Checkout(CheckoutError::ReadinessTimeout(timeout)))
                    }
                }
            }
            Err(e) if e.is_timeout() => {
                Err(Error::Checkout(CheckoutError::ReadinessTimeout(timeout)))
            }
            Err(e) => Err(e),
        };
        match result {
            Ok(()) => {
                let took = start.elapsed();
                m.readiness.record(took.as_secs_f64());
                Ok(took)
            }
            Err(e) => {
                if e.is_timeout() {
                    m.readiness_timeout.increment(1);
                } else {
                    m.readiness_error.increment(1);
                }
                Err(e)
            }
        }
    }
}
