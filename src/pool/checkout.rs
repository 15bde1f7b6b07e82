//! A checkout, bounded end to end: admission, deadpool (which never waits:
//! pgwarden owns its capacity), connecting or recycling, and the backend-pid
//! query of a new connection all fit in one deadline.

use std::future::Future;
use std::panic::Location;
use std::pin::pin;
use std::task::Poll;
use std::time::{Duration, Instant};

use deadpool_postgres::{Object, PoolError, TimeoutType};

use super::client::Client;
use super::deadline::{bounded, deadline};
use super::shared::{IdSet, Known, Permit, Pool, Shared};
use crate::admission::{Lane, Priority};
use crate::error::{CheckoutError, Error, Stage};

/// Polls `fut` once in place; only when it is not ready at once does it get
/// a timer (a free connection is handed out without one).
async fn until<F: Future>(deadline: tokio::time::Instant, fut: F) -> Option<F::Output> {
    let mut fut = pin!(fut);
    let first = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await;
    match first {
        Poll::Ready(v) => Some(v),
        Poll::Pending => tokio::time::timeout_at(deadline, fut).await.ok(),
    }
}

impl Pool {
    pub(crate) fn checkout(
        &self,
        lane: Lane,
        site: &'static Location<'static>,
        timeout: Duration,
    ) -> impl Future<Output = Result<Client, Error>> + Send + '_ {
        self.checkout_with(lane, Priority::Normal, site, timeout)
    }

    /// A checkout of `lane` at `prio`, all of it within `timeout`.
    pub(crate) fn checkout_with(
        &self,
        lane: Lane,
        prio: Priority,
        site: &'static Location<'static>,
        timeout: Duration,
    ) -> impl Future<Output = Result<Client, Error>> + Send + '_ {
        self.checkout_inner(lane, prio, false, site, timeout)
    }

    /// A session-lock checkout that waits for the budget, in FIFO order, up
    /// to `timeout` when other locks hold it now (refused at once only when
    /// it can never be admitted).
    pub(crate) fn checkout_waiting_for_budget(
        &self,
        site: &'static Location<'static>,
        timeout: Duration,
    ) -> impl Future<Output = Result<Client, Error>> + Send + '_ {
        self.checkout_inner(Lane::SessionLock, Priority::Normal, true, site, timeout)
    }

    async fn checkout_inner(
        &self,
        lane: Lane,
        prio: Priority,
        patient: bool,
        site: &'static Location<'static>,
        timeout: Duration,
    ) -> Result<Client, Error> {
        let shared = &self.shared;
        shared.supervisor.revive();
        let start = tokio::time::Instant::now();
        // The caller's bound, tightened by the `Deadline` scope it runs in.
        let deadline = bounded(start, deadline(start, timeout));
        let permit = shared
            .admit(lane, prio, patient, site, start, deadline)
            .await?;
        let lm = shared.metrics.lane(lane);
        loop {
            // deadpool is asked not to wait (after admission it always has
            // room) and polled in place: a free connection comes back at
            // once, with no timer and no move of deadpool's future.
            let get = shared.inner.timeout_get(&shared.get_timeouts);
            tokio::pin!(get);
            let got = match std::future::poll_fn(|cx| Poll::Ready(get.as_mut().poll(cx))).await {
                Poll::Ready(r) => Some(r),
                Poll::Pending => tokio::time::timeout_at(deadline, get).await.ok(),
            };
            let got = match got {
                Some(Ok(o)) => Ok(o),
                Some(Err(e)) => shared.no_object(e, &permit, start, deadline).await,
                None => {
                    let status = shared.status();
                    Err(shared.timed_out(lane, Stage::Connection, start, status))
                }
            };
            let obj = match got {
                Ok(o) => o,
                Err(e) => {
                    match &e {
                        Error::Checkout(CheckoutError::Pool(PoolError::Closed)) => {
                            lm.fail_closed.increment(1)
                        }
                        Error::Checkout(CheckoutError::Pool(_)) => lm.fail_backend.increment(1),
                        // Counted where they were found.
                        _ => {}
                    }
                    return Err(e);
                }
            };
            let id = Object::id(&obj);
            enum Seen {
                Tainted,
                Known(i32, Instant),
                New,
            }
            // One lock: discard a tainted connection, or find its pid and,
            // when known, complete the checkout record.
            let seen = {
                let mut st = shared.state.lock();
                if !st.tainted.is_empty() && st.tainted.remove(&id) {
                    st.pids.remove(&id);
                    Seen::Tainted
                } else if let Some(k) = st.pids.get(&id).copied() {
                    Seen::Known(k.pid, st.attach(permit.slot, k.pid, id))
                } else {
                    Seen::New
                }
            };
            let (pid, since) = match seen {
                Seen::Known(pid, since) => (pid, since),
                Seen::Tainted => {
                    tracing::warn!(pool = %shared.name, "discarding a pooled connection that held a leaked advisory lock");
                    drop(Object::take(obj));
                    continue;
                }
                Seen::New => match until(deadline, backend_pid(&obj)).await {
                    Some(Ok(pid)) => {
                        let created = Object::metrics(&obj).created;
                        let mut st = shared.state.lock();
                        // Connections deadpool dropped on its own leave stale
                        // entries: keep the map bounded (idle pids are asked again).
                        if st.pids.len() >= 4 * st.adm.limits().size() {
                            let out: IdSet =
                                st.checkouts.iter().filter_map(|(_, c)| c.object).collect();
                            st.pids.retain(|id, _| out.contains(id));
                        }
                        st.pids.insert(id, Known { pid, created });
                        (pid, st.attach(permit.slot, pid, id))
                    }
                    Some(Err(e)) => {
                        lm.fail_backend.increment(1);
                        drop(Object::take(obj));
                        return Err(e);
                    }
                    None => {
                        drop(Object::take(obj));
                        let status = shared.status();
                        return Err(shared.timed_out(lane, Stage::BackendPid, start, status));
                    }
                },
            };
            lm.acquire.record(
                since
                    .saturating_duration_since(start.into_std())
                    .as_secs_f64(),
            );
            return Ok(Client {
                obj: Some(obj),
                permit,
                pid,
                site,
                since,
                object: id,
            });
        }
    }
}

impl Shared {
    /// deadpool answered an admitted checkout with `e`. A wait timeout
    /// means it had no room: after admission that happens only while a
    /// return is on its way (resolved at once), or when deadpool's capacity
    /// was changed or taken outside pgwarden (reported by `deadline`).
    async fn no_object(
        &self,
        e: PoolError,
        permit: &Permit,
        start: tokio::time::Instant,
        deadline: tokio::time::Instant,
    ) -> Result<Object, Error> {
        let lane = permit.lane;
        if !matches!(e, PoolError::Timeout(TimeoutType::Wait)) {
            return Err(Error::Checkout(CheckoutError::Pool(e)));
        }
        let size = self.state.lock().adm.limits().size();
        let deadpool_max = self.inner.status().max_size;
        let wait = deadpool_postgres::Timeouts {
            wait: None,
            ..self.get_timeouts
        };
        if deadpool_max == size {
            if let Some(r) = until(deadline, self.inner.timeout_get(&wait)).await {
                return r.map_err(Error::from);
            }
        }
        let in_use = self.state.lock().adm.total();
        let err = Error::Checkout(CheckoutError::DeadpoolMismatch {
            lane,
            size,
            deadpool_max: self.inner.status().max_size,
            in_use,
        });
        self.metrics.lane(lane).fail_backend.increment(1);
        tracing::warn!(pool = %self.name, %lane, waited = ?start.elapsed(), error = %err, "checkout failed");
        Err(err)
    }
}

async fn backend_pid(obj: &deadpool_postgres::Client) -> Result<i32, Error> {
    let msgs = obj.simple_query("SELECT pg_backend_pid()").await?;
    msgs.iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).and_then(|v| v.parse().ok()),
            _ => None,
        })
        .ok_or(Error::Checkout(CheckoutError::NoBackendPid))
}
