//! The seam between the pool shell and the pool it wraps: [`Source`], what
//! a backend (deadpool-postgres here; sqlx in `crate::sqlx`) supplies, and
//! its deadpool implementation.
//!
//! Everything the shell does (admission, the checkout records, the pids,
//! long holds, deadlines, housekeeping, metrics, the readiness probe) is
//! written once over this trait and compiled for each backend (static
//! dispatch: the deadpool checkout is the same machine code it was before
//! the seam). A backend only takes a connection (never waiting for
//! capacity: pgwarden owns it), names it, learns its backend pid once per
//! physical connection, gives it back or closes it, and reports and
//! resizes its pool.

use std::fmt;
use std::future::Future;
use std::hash::Hash;
use std::time::{Duration, Instant};

use deadpool_postgres::{Object, PoolError, TimeoutType};

use super::ext::Extensions;
use crate::admission::Lane;
use crate::error::{CheckoutError, Error};
use crate::stmt::{Conn, Row};

/// The wrapped pool's own view, for [`Status`](crate::Status) and the
/// checks at build and in housekeeping.
#[allow(unreachable_pub)]
#[derive(Copy, Clone, Debug)]
pub struct SourceStatus {
    /// Its maximum size now.
    pub max: usize,
    /// Connections open.
    pub size: usize,
    /// Open connections idle in it.
    pub idle: usize,
    /// Callers waiting inside it (pgwarden's never do).
    pub waiting: usize,
}

/// The connection's backend pid and its session's start (µs since the
/// epoch), as a simple query (one message: a transaction pooler cannot
/// move the connection half-way): together they name one session for good
/// (the server gives a pid again once its session ends), so that the
/// census never takes another session that got a closed connection's pid
/// for the pool's idle connection. `pg_backend_pid()` is called once.
pub(crate) const ASK: &str = "SELECT a.pid, (extract(epoch FROM a.backend_start) * 1000000)::int8 \
                     FROM pg_catalog.pg_stat_get_activity(pg_backend_pid()) a";

/// A server session as the server names it: its backend pid, and, when
/// known, when it started (`pg_stat_activity.backend_start`, in
/// microseconds since the Unix epoch). A pid is given again once its
/// session ends; the two together name one session for good. Public only
/// because [`Source`] names it; not reachable from outside the crate.
#[allow(unreachable_pub)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Backend {
    pub pid: i32,
    pub started: Option<i64>,
}

/// What [`Source::identify`] found: the connection's name, what keeps it
/// its own, and its backend pid when that was asked on the way (then
/// [`Source::backend_pid`] is not). Public only because [`Source`] names
/// it; not reachable from outside the crate.
#[allow(unreachable_pub)]
pub struct Identified<B: Source> {
    pub id: B::Id,
    pub anchor: B::Anchor,
    pub pid: Option<Backend>,
}

impl<B: Source> fmt::Debug for Identified<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Identified")
            .field("id", &self.id)
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

/// What a backend's own error says to the shell.
#[allow(unreachable_pub)]
#[derive(Debug)]
pub enum Refused {
    /// It had no room at once (a return still under way, or capacity taken
    /// outside pgwarden): the shell decides whether to wait for it.
    NoRoom,
    /// Anything else, as pgwarden's error.
    Failed(Error),
}

/// A pool pgwarden wraps. Public only so that [`Client`](crate::Client)
/// can name it; it is not reachable from outside the crate (sealed), and
/// its implementations are deadpool's `Pool` and (features `sqlx-0_8`,
/// `sqlx-0_9`) sqlx's `PgPool`.
///
/// Its [`Source::Exec`] is bound by the crate's statement layer
/// (`crate::stmt::Conn`): the trait is sealed, so nothing outside the crate
/// names that bound.
#[allow(unreachable_pub, private_bounds, private_interfaces)]
pub trait Source: Send + Sync + Sized + 'static {
    /// A checked-out connection.
    type Object: Send + 'static;
    /// What a checked-out [`Client`](crate::Client) derefs to.
    type Conn;
    /// A physical connection's name, stable while it lives.
    type Id: Copy + Eq + Hash + fmt::Debug + Send + Sync + 'static;
    /// Kept with a known connection's pid for as long as the pool keeps
    /// the pid: what keeps its [`Source::Id`] from naming another
    /// connection meanwhile.
    type Anchor: Send + Sync + 'static;
    /// Its own error when it hands out no connection.
    type Raw: Send + 'static;
    /// Settings its checkouts use, worked out once at build (and what a
    /// backend learns about the pool as it goes: sqlx's statement naming).
    type Cfg: Send + Sync + 'static;

    /// The settings of [`Source::take`] and [`Source::identify`], worked
    /// out at build for the pool `name`; `ext` is its extension slot, where
    /// the layers above keep what they learn of it (the pooler mode).
    fn cfg(&self, name: &str, ext: &Extensions) -> Self::Cfg;
    /// A connection for a checkout of `lane`, without waiting for capacity
    /// (pgwarden admitted the checkout: the capacity is there). Not polled
    /// before admission. For [`Lane::Probe`] an idle connection is handed
    /// out as it is, without a check of the wrapped pool's own that may
    /// wait on the server (sqlx's ping): the probe's `SELECT 1` is that
    /// check, under the probe's own bound (`probe.rs`).
    fn take<'a>(
        &'a self,
        cfg: &'a Self::Cfg,
        lane: Lane,
    ) -> impl Future<Output = Result<Self::Object, Self::Raw>> + Send + 'a;
    /// A connection, waiting inside the wrapped pool for a return under
    /// way (after [`Refused::NoRoom`]; the shell bounds it).
    fn take_waiting<'a>(
        &'a self,
        cfg: &'a Self::Cfg,
    ) -> impl Future<Output = Result<Self::Object, Self::Raw>> + Send + 'a;
    /// What its error says.
    fn refused(e: Self::Raw) -> Refused;

    /// The connection's name when the backend knows it at once (the
    /// checkout's fast path); `None`: ask [`Source::identify`].
    fn quick_id(obj: &Self::Object) -> Option<Self::Id>;
    /// The connection's name, what keeps it, and its backend pid when
    /// finding the name asked it (may talk to the server).
    fn identify<'a>(
        obj: &'a mut Self::Object,
        cfg: &'a Self::Cfg,
    ) -> impl Future<Output = Result<Identified<Self>, Error>> + Send + 'a;
    /// Asks the server for the connection's backend pid, and its start
    /// where the backend keys its connections by it (once per physical
    /// connection).
    fn backend_pid(
        obj: &mut Self::Object,
    ) -> impl Future<Output = Result<Backend, Error>> + Send + '_;
    /// Whether `id` names the same physical connection at every checkout
    /// (sqlx's per-checkout numbers do not): the census matches only such
    /// ids to idle connections, and the sweep acts only on them.
    fn stable(id: &Self::Id) -> bool;
    /// When it was handed out (deadpool read the clock as it recycled it).
    fn handed_out(obj: &Self::Object) -> Instant;
    /// When the physical connection was made (or first seen).
    fn created(obj: &Self::Object) -> Instant;
    /// Made for this checkout, never used before.
    fn is_new(obj: &Self::Object) -> bool;
    /// Its connection is known closed.
    fn is_broken(obj: &Self::Object) -> bool;
    /// Its connections die with the runtime they were made on, unseen by
    /// the wrapped pool (sqlx: the socket is that runtime's; deadpool's
    /// connection task dies with it, and its recycle sees the client
    /// closed): the checkout watches that runtime and forgets a connection
    /// made on one that is gone ([`Source::forget`]).
    const DIES_WITH_ITS_RUNTIME: bool;
    /// Lets go of a connection without a word on it (its socket is dead:
    /// a close would write to it); the wrapped pool gets its capacity back.
    fn forget(obj: Self::Object);
    /// The connection inside.
    fn conn(obj: &Self::Object) -> &Self::Conn;
    /// The connection inside, mutably.
    fn conn_mut(obj: &mut Self::Object) -> &mut Self::Conn;
    /// The statement layer's view of a connection: how the layers above
    /// (locks, leases, the census) run their statements on any backend
    /// ([`Client::exec`](crate::Client) calls it). Deadpool: the
    /// `ClientWrapper` itself (its statement cache); sqlx: the connection
    /// behind an async mutex (`stmt::sqlx08::On`, `stmt::sqlx09::On`).
    type Exec<'c>: Conn<Row = Self::Row> + 'c
    where
        Self: 'c;
    /// The rows of [`Source::Exec`], whatever the borrow (so a row outlives
    /// the statement's borrow of the connection).
    type Row: Row + 'static;
    /// [`Source::Exec`] of `conn`, on a pool whose settings are `cfg`.
    /// `spoiled`, set by a statement cut short where the connection may be
    /// left inside a transaction nothing will end (sqlx 0.8: a `BEGIN`
    /// pgwarden sent to pin a statement behind a transaction pooler, see
    /// `stmt::sqlx`), makes the checkout close the connection instead of
    /// giving it back.
    fn exec<'c>(
        conn: &'c mut Self::Conn,
        cfg: &'c Self::Cfg,
        spoiled: &'c mut bool,
    ) -> Self::Exec<'c>;
    /// Cancels what runs on the connection now without using it, when the
    /// backend can (deadpool: a cancel request with the connection's
    /// cancel token, plain TCP or socket); `None`: it cannot (sqlx), the
    /// caller cancels with `pg_cancel_backend` on another connection.
    fn cancel(conn: &Self::Conn) -> Option<impl Future<Output = ()> + Send + 'static>;

    /// Gives the connection back: `None` when the wrapped pool has it back
    /// at once (deadpool), or the return to run to its end, after which
    /// the pool has its capacity again (sqlx: its `after_release` hook and
    /// ping). The shell gives the checkout's admission back after it.
    /// (`obj` is taken out of its slot: deadpool's is dropped in place.)
    fn give_back(
        obj: &mut Option<Self::Object>,
    ) -> Option<impl Future<Output = ()> + Send + 'static>;
    /// Closes the physical connection instead: `None` when done at once,
    /// or the close to run to its end (the capacity is held until then).
    fn discard(obj: Self::Object) -> Option<impl Future<Output = ()> + Send + 'static>;

    /// Closes the connection `id`, made at `created`, if it is idle in the
    /// wrapped pool (the census's leak sweep, for a connection found
    /// holding a leaked advisory lock): `Some(true)` closed; `Some(false)`
    /// not idle there (checked out in the meantime); `None` when the
    /// backend cannot reach its idle connections (sqlx): the sweep then
    /// marks the connection never to be handed out again and ends its
    /// session on the server (`crate::census`).
    fn close_idle(&self, id: Self::Id, created: Instant) -> Option<bool>;

    /// Whether the wrapped pool has the server answer a round trip on an
    /// idle connection before it hands it out (sqlx's
    /// `test_before_acquire` ping, the adopter's setting): a readiness
    /// probe on a connection seen before then asks nothing more. Deadpool
    /// (its fast recycling asks nothing): no.
    fn pings_idle(&self) -> bool {
        false
    }

    /// `SELECT 1` on the connection (the readiness probe's statement).
    fn select_1(conn: &mut Self::Conn) -> impl Future<Output = Result<(), Error>> + Send + '_;

    /// The pool's own view.
    fn status(&self) -> SourceStatus;
    /// The bound its own configuration puts on a checkout, if any.
    fn wait_bound(&self) -> Option<Duration>;
    /// Resizes the wrapped pool (only the deadpool pool can).
    fn resize(&self, size: usize);
    /// Closes the wrapped pool: no connection handed out from now on.
    fn close(&self);
    /// Whether it is closed.
    fn is_closed(&self) -> bool;
}

// --- deadpool-postgres ------------------------------------------------------

impl Source for deadpool_postgres::Pool {
    type Object = Object;
    type Conn = deadpool_postgres::Client;
    type Id = deadpool_postgres::ObjectId;
    type Anchor = ();
    type Raw = PoolError;
    /// deadpool's timeouts with a zero wait: an admitted checkout never
    /// waits inside deadpool, it finds out at once that it would.
    type Cfg = deadpool_postgres::Timeouts;

    fn cfg(&self, _: &str, _: &Extensions) -> deadpool_postgres::Timeouts {
        deadpool_postgres::Timeouts {
            wait: Some(Duration::ZERO),
            ..self.timeouts()
        }
    }

    #[inline(always)]
    /// The same on every lane: deadpool's `Fast` recycle (what pgwarden
    /// builds) hands an idle connection out without a round trip.
    fn take<'a>(
        &'a self,
        cfg: &'a deadpool_postgres::Timeouts,
        _: Lane,
    ) -> impl Future<Output = Result<Object, PoolError>> + Send + 'a {
        self.timeout_get(cfg)
    }

    async fn take_waiting(&self, cfg: &deadpool_postgres::Timeouts) -> Result<Object, PoolError> {
        let wait = deadpool_postgres::Timeouts { wait: None, ..*cfg };
        self.timeout_get(&wait).await
    }

    fn refused(e: PoolError) -> Refused {
        match e {
            PoolError::Timeout(TimeoutType::Wait) => Refused::NoRoom,
            e => Refused::Failed(Error::Checkout(CheckoutError::Pool(e))),
        }
    }

    #[inline(always)]
    fn quick_id(obj: &Object) -> Option<deadpool_postgres::ObjectId> {
        Some(Object::id(obj))
    }

    fn identify<'a>(
        obj: &'a mut Object,
        _: &'a deadpool_postgres::Timeouts,
    ) -> impl Future<Output = Result<Identified<Self>, Error>> + Send + 'a {
        std::future::ready(Ok(Identified {
            id: Object::id(obj),
            anchor: (),
            pid: None,
        }))
    }

    /// The pid and the session's start ([`ASK`]): deadpool names its
    /// connections itself, and its sweep closes them by their creation
    /// instant, but a connection deadpool dropped on its own (a failed
    /// recycle) leaves its pid in the pool's books, and the start tells
    /// the session that gets that pid next from it.
    async fn backend_pid(obj: &mut Object) -> Result<Backend, Error> {
        let msgs = obj.simple_query(ASK).await?;
        msgs.iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => {
                    let pid = r.get(0)?.parse().ok()?;
                    let started = r.get(1).and_then(|v| v.parse().ok());
                    Some(Backend { pid, started })
                }
                _ => None,
            })
            .ok_or(Error::Checkout(CheckoutError::NoBackendPid))
    }

    #[inline(always)]
    fn stable(_: &deadpool_postgres::ObjectId) -> bool {
        true
    }

    /// deadpool reads the clock as it recycles a connection, in the call
    /// that hands it out (a new one: as it creates it).
    #[inline(always)]
    fn handed_out(obj: &Object) -> Instant {
        let m = Object::metrics(obj);
        m.recycled.unwrap_or(m.created)
    }

    fn created(obj: &Object) -> Instant {
        Object::metrics(obj).created
    }

    fn is_new(obj: &Object) -> bool {
        Object::metrics(obj).recycle_count == 0
    }

    #[inline(always)]
    fn is_broken(obj: &Object) -> bool {
        obj.is_closed()
    }

    #[inline(always)]
    fn conn(obj: &Object) -> &deadpool_postgres::Client {
        obj
    }

    #[inline(always)]
    fn conn_mut(obj: &mut Object) -> &mut deadpool_postgres::Client {
        obj
    }

    type Exec<'c> = &'c mut deadpool_postgres::ClientWrapper;
    type Row = tokio_postgres::Row;

    /// tokio-postgres sends each statement in one sync (`query_typed`):
    /// nothing to pin, nothing spoils.
    #[inline(always)]
    fn exec<'c>(
        conn: &'c mut deadpool_postgres::Client,
        _: &'c deadpool_postgres::Timeouts,
        _: &'c mut bool,
    ) -> &'c mut deadpool_postgres::ClientWrapper {
        conn
    }

    /// A cancel request (no TLS: best effort), with the connection's key.
    fn cancel(
        conn: &deadpool_postgres::Client,
    ) -> Option<impl Future<Output = ()> + Send + 'static> {
        let token = conn.cancel_token();
        Some(async move {
            let _ = token.cancel_query(tokio_postgres::NoTls).await;
        })
    }

    /// Dropped in place: deadpool has it back at once.
    #[inline(always)]
    fn give_back(obj: &mut Option<Object>) -> Option<impl Future<Output = ()> + Send + 'static> {
        *obj = None;
        None::<std::future::Ready<()>>
    }

    const DIES_WITH_ITS_RUNTIME: bool = false;

    fn forget(obj: Object) {
        drop(Object::take(obj));
    }

    fn discard(obj: Object) -> Option<impl Future<Output = ()> + Send + 'static> {
        drop(Object::take(obj));
        None::<std::future::Ready<()>>
    }

    /// deadpool's `retain`, which sees each idle connection's creation
    /// instant (the identity pgwarden kept with its pid).
    fn close_idle(&self, _: deadpool_postgres::ObjectId, created: Instant) -> Option<bool> {
        Some(!self.retain(|_, m| m.created != created).removed.is_empty())
    }

    async fn select_1(conn: &mut deadpool_postgres::Client) -> Result<(), Error> {
        conn.simple_query("SELECT 1").await?;
        Ok(())
    }

    fn status(&self) -> SourceStatus {
        let d = deadpool_postgres::Pool::status(self);
        SourceStatus {
            max: d.max_size,
            size: d.size,
            idle: d.available,
            waiting: d.waiting,
        }
    }

    fn wait_bound(&self) -> Option<Duration> {
        self.timeouts().wait
    }

    fn resize(&self, size: usize) {
        deadpool_postgres::Pool::resize(self, size)
    }

    fn close(&self) {
        deadpool_postgres::Pool::close(self)
    }

    fn is_closed(&self) -> bool {
        deadpool_postgres::Pool::is_closed(self)
    }
}
