//! A checkout, bounded end to end, and the [`Client`] it hands out:
//! admission, deadpool (which never waits: pgwarden owns its capacity),
//! connecting or recycling, and the backend-pid query of a new connection
//! all fit in one deadline; the `Client` then holds the connection and its
//! admission permit, and gives both back on drop (the connection first).

use std::fmt;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::panic::Location;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::deadline::{bounded, deadline};
use super::shared::{Entry, IdSet, Known, Permit, Pool, Queued, Shared};
use super::source::{Backend, Identified, Refused, Source};
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

/// A new connection's backend: `asked` when naming it asked it already,
/// else what `ask` answers (`Err(None)`: not within the checkout's deadline).
async fn pid_of(
    asked: Option<Backend>,
    ask: impl Future<Output = Option<Result<Backend, Error>>>,
) -> Result<Backend, Option<Error>> {
    match asked {
        Some(b) => Ok(b),
        None => match ask.await {
            Some(r) => r.map_err(Some),
            None => Err(None),
        },
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

    /// [`Pool::checkout`] with its error made into another by `map` (the
    /// error of [`Pool::get`]), without a future around it.
    pub(crate) fn checkout_mapped<E: Send + 'static>(
        &self,
        lane: Lane,
        site: &'static Location<'static>,
        timeout: Duration,
        map: fn(Error) -> E,
    ) -> impl Future<Output = Result<Client, E>> + Send + '_ {
        self.checkout_inner(lane, Priority::Normal, false, site, timeout, map)
    }

    /// A checkout of `lane` at `prio`, all of it within `timeout`.
    pub(crate) fn checkout_with(
        &self,
        lane: Lane,
        prio: Priority,
        site: &'static Location<'static>,
        timeout: Duration,
    ) -> impl Future<Output = Result<Client, Error>> + Send + '_ {
        self.checkout_inner(lane, prio, false, site, timeout, same)
    }

    /// A session-lock checkout that waits for the budget, in FIFO order, up
    /// to `timeout` when other locks hold it now (refused at once only when
    /// it can never be admitted).
    fn checkout_inner<E: Send + 'static>(
        &self,
        lane: Lane,
        prio: Priority,
        patient: bool,
        site: &'static Location<'static>,
        timeout: Duration,
        map: fn(Error) -> E,
    ) -> impl Future<Output = Result<Client, E>> + Send + '_ {
        self.shared
            .checkout_inner(lane, prio, patient, site, timeout, map)
    }
}

impl<B: Source> Shared<B> {
    /// A session-lock checkout that waits for the budget, in FIFO order, up
    /// to `timeout` when other locks hold it now (refused at once only when
    /// it can never be admitted).
    pub(crate) fn checkout_waiting_for_budget(
        self: &Arc<Self>,
        site: &'static Location<'static>,
        timeout: Duration,
    ) -> impl Future<Output = Result<Client<B>, Error>> + Send + '_ {
        self.checkout_inner(
            Lane::SessionLock,
            Priority::Normal,
            true,
            site,
            timeout,
            same,
        )
    }

    /// A checkout of `lane` at `prio`, all of it within `timeout`.
    pub(crate) fn checkout_with(
        self: &Arc<Self>,
        lane: Lane,
        prio: Priority,
        site: &'static Location<'static>,
        timeout: Duration,
    ) -> impl Future<Output = Result<Client<B>, Error>> + Send + '_ {
        self.checkout_inner(lane, prio, false, site, timeout, same)
    }

    /// A checkout of `lane`, all of it within `timeout`.
    pub(crate) fn checkout(
        self: &Arc<Self>,
        lane: Lane,
        site: &'static Location<'static>,
        timeout: Duration,
    ) -> impl Future<Output = Result<Client<B>, Error>> + Send + '_ {
        self.checkout_inner(lane, Priority::Normal, false, site, timeout, same)
    }

    /// A checkout's future: [`Getting`], polled by hand (see there). Errors
    /// go out through `map`.
    #[inline(always)]
    pub(crate) fn checkout_inner<E: Send + 'static>(
        self: &Arc<Self>,
        lane: Lane,
        prio: Priority,
        patient: bool,
        site: &'static Location<'static>,
        timeout: Duration,
        map: fn(Error) -> E,
    ) -> impl Future<Output = Result<Client<B>, E>> + Send + '_ {
        Getting {
            // Not polled before admission: an async fn's future does nothing
            // until then (it only holds its arguments).
            get: self.inner.take(&self.cfg, lane),
            timer: Timer::Off,
            state: State::Start,
            shared: self,
            lane,
            prio,
            patient,
            site,
            timeout,
            map,
        }
    }

    /// The rest of a checkout whose connection was not handed out at
    /// once: the wrapped pool's answer `got` (`None`: it timed out; the
    /// outer `None`: not asked yet) was an error, a tainted connection
    /// (discarded, and another asked for), one whose name takes a
    /// statement (sqlx), or a new one (its backend pid asked). `start`:
    /// when the checkout began.
    async fn checkout_rest(
        self: Arc<Self>,
        site: &'static Location<'static>,
        start: tokio::time::Instant,
        deadline: tokio::time::Instant,
        mut permit: Permit<B>,
        got: Option<Option<Result<B::Object, B::Raw>>>,
    ) -> Result<Client<B>, Error> {
        let shared = &self;
        let lane = permit.lane;
        let lm = shared.metrics.lane(lane);
        let mut first = got;
        // Connections that failed pgwarden's own statement (their name, their
        // pid) and were discarded: each is taken for dead (a session the
        // sweep ended, a server restarted) and another is taken, up to the
        // pool's size: past that the failure is not the connection's.
        let mut dead = 0;
        loop {
            let got = match first.take() {
                Some(got) => got,
                None => until(deadline, shared.inner.take(&shared.cfg, lane)).await,
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
                        Error::Checkout(CheckoutError::Pool(
                            deadpool_postgres::PoolError::Closed,
                        )) => lm.fail_closed.increment(1),
                        Error::Checkout(CheckoutError::Pool(_) | CheckoutError::Backend(_)) => {
                            lm.fail_backend.increment(1)
                        }
                        // Counted where they were found.
                        _ => {}
                    }
                    return Err(e);
                }
            };
            // From here the connection and the admission are held
            // together: a checkout dropped while it names the connection or
            // asks its pid gives the connection back first, the admission
            // after the wrapped pool has it (as a `Client` does).
            let mut held = Taken(Some((obj, permit)));
            let (id, anchor, asked) = match B::quick_id(held.obj()) {
                Some(id) => (id, None, None),
                None => match until(deadline, B::identify(held.obj(), &shared.cfg)).await {
                    Some(Ok(Identified { id, anchor, pid })) => (id, Some(anchor), pid),
                    r => {
                        let (obj, p) = held.parts();
                        match shared.dead_conn(obj, p, start, r.and_then(Result::err), &mut dead) {
                            Ok(p) => {
                                permit = p;
                                continue;
                            }
                            Err(e) => return Err(e),
                        }
                    }
                },
            };
            enum Seen {
                Tainted,
                Orphaned,
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
                } else {
                    let found = st.pids.get(&id);
                    match found.map(|k| (k.pid, B::DIES_WITH_ITS_RUNTIME && k.orphaned())) {
                        Some((_, true)) => {
                            st.pids.remove(&id);
                            Seen::Orphaned
                        }
                        Some((pid, false)) => {
                            let now = B::handed_out(held.obj());
                            Seen::Known(pid, st.attach(held.slot(), pid, id, now))
                        }
                        None => Seen::New,
                    }
                }
            };
            // Whether the server answered a round trip on the connection
            // during this checkout: the readiness probe then asks nothing
            // more (`probe.rs`). The probe's own take pings nothing
            // ([`Source::take`]).
            let answered = match seen {
                Seen::Known(..) => {
                    asked.is_some() || (lane != Lane::Probe && shared.inner.pings_idle())
                }
                Seen::Tainted | Seen::Orphaned | Seen::New => true,
            };
            let (pid, since) = match seen {
                Seen::Known(pid, since) => (pid, since),
                Seen::Tainted => {
                    tracing::warn!(pool = %shared.name, "discarding a pooled connection that held a leaked advisory lock");
                    let (obj, p) = held.parts();
                    finish(B::discard(obj), None::<Permit<B>>, Duration::ZERO);
                    permit = p;
                    continue;
                }
                Seen::Orphaned => {
                    tracing::debug!(pool = %shared.name, "a pooled connection made on a runtime that is gone: let go, another taken");
                    let (obj, p) = held.parts();
                    B::forget(obj);
                    permit = p;
                    continue;
                }
                Seen::New => match pid_of(asked, until(deadline, B::backend_pid(held.obj()))).await
                {
                    Ok(backend) => {
                        let anchor = match anchor {
                            Some(a) => Ok(a),
                            None => B::identify(held.obj(), &shared.cfg).await.map(|i| i.anchor),
                        };
                        let anchor = match anchor {
                            Ok(a) => a,
                            Err(e) => {
                                let (obj, p) = held.parts();
                                permit = shared.dead_conn(obj, p, start, Some(e), &mut dead)?;
                                continue;
                            }
                        };
                        let created = B::created(held.obj());
                        let mut st = shared.state.lock();
                        // Connections the wrapped pool dropped on its own
                        // leave stale entries (and sqlx's per-checkout
                        // names one per checkout): keep the map bounded
                        // (idle pids are asked again).
                        if st.pids.len() >= 4 * st.adm.limits().size() {
                            let out: IdSet<B::Id> =
                                st.checkouts.iter().filter_map(|(_, c)| c.object).collect();
                            st.pids.retain(|id, _| out.contains(id));
                        }
                        let pid = backend.pid;
                        st.pids.insert(
                            id,
                            Known {
                                pid,
                                started: backend.started,
                                created,
                                _anchor: anchor,
                                made_on: if B::DIES_WITH_ITS_RUNTIME && B::stable(&id) {
                                    super::shared::MadeOn::here()
                                } else {
                                    None
                                },
                            },
                        );
                        (pid, st.attach(held.slot(), pid, id, Instant::now()))
                    }
                    Err(None) => {
                        let (obj, permit) = held.parts();
                        return Err(shared.conn_failed(obj, permit, start, None));
                    }
                    Err(e) => {
                        let (obj, p) = held.parts();
                        permit = shared.dead_conn(obj, p, start, e, &mut dead)?;
                        continue;
                    }
                },
            };
            let (obj, permit) = held.parts();
            return Ok(hand_out(
                obj,
                permit,
                pid,
                id,
                site,
                (since, answered),
                start,
            ));
        }
    }
}

/// A connection taken for a checkout not handed out yet, with its
/// admission: dropped (the checkout dropped), the connection goes back and
/// then the admission, as a `Client`'s drop does.
struct Taken<B: Source>(Option<(B::Object, Permit<B>)>);

impl<B: Source> Taken<B> {
    fn obj(&mut self) -> &mut B::Object {
        // infallible: taken apart only by `parts`, which consumes it.
        &mut self.0.as_mut().expect("held until taken apart").0 // infallible
    }

    fn slot(&self) -> usize {
        // infallible: as above.
        self.0.as_ref().expect("held until taken apart").1.slot() // infallible
    }

    fn parts(mut self) -> (B::Object, Permit<B>) {
        // infallible: as above.
        self.0.take().expect("held until taken apart") // infallible
    }
}

impl<B: Source> Drop for Taken<B> {
    fn drop(&mut self) {
        if let Some((obj, permit)) = self.0.take() {
            match B::give_back(&mut Some(obj)) {
                None => drop(permit),
                back => {
                    permit.shared().mark_releasing(permit.slot());
                    finish(back, Some(permit), Duration::ZERO)
                }
            }
        }
    }
}

/// Runs the wrapped pool's return or close `work` to its end in a task of
/// its own, then releases `permit` (its connection held for `held`): the
/// capacity is the pool's again only then. Outside a runtime, `work` is
/// dropped (the connection closed with it) and the permit released at once.
#[cold]
fn finish<B: Source>(
    work: Option<impl Future<Output = ()> + Send + 'static>,
    permit: Option<Permit<B>>,
    held: Duration,
) {
    let Some(work) = work else {
        drop(permit);
        return;
    };
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => {
            rt.spawn(async move {
                work.await;
                if let Some(mut p) = permit {
                    p.release(held);
                }
            });
        }
        Err(_) => drop((work, permit)),
    }
}

/// No change: the error of the checkouts that keep pgwarden's.
fn same(e: Error) -> Error {
    e
}

pin_project_lite::pin_project! {
    /// A checkout in progress, written as a future by hand so that the
    /// common case (admitted at once, the wrapped pool ready with a known
    /// connection) runs in one poll, holds nothing across it, and builds
    /// its `Client` where the caller receives it: an `async fn` kept
    /// deadpool's answer in its state and moved the connection (232 bytes)
    /// three times more on the way out. Everything else (a wait in the
    /// queue, a wait or error of the wrapped pool, a tainted or new
    /// connection, a connection whose name takes a statement) runs in
    /// functions entered only then. A wait in the queue allocates nothing:
    /// the checkout's answer and waker are kept in its entry in the
    /// waiters' table, and its timer in the future itself.
    ///
    /// `get` is the wrapped pool's checkout ([`Source::take`]), made with
    /// the future and polled only after admission (pgwarden owns the
    /// capacity: the pool is asked not to wait). It is declared first so
    /// that it drops before the permit `state` may hold: a connection goes
    /// back before its admission does.
    struct Getting<'a, B: Source, F, E> {
        #[pin]
        get: F,
        // The checkout's bound, armed once something makes it wait (in the
        // queue, or for the wrapped pool; the same deadline for both).
        #[pin]
        timer: Timer,
        state: State<'a, B>,
        shared: &'a Arc<Shared<B>>,
        lane: Lane,
        prio: Priority,
        patient: bool,
        site: &'static Location<'static>,
        timeout: Duration,
        map: fn(Error) -> E,
    }
}

pin_project_lite::pin_project! {
    /// A checkout's timer: off until something makes it wait.
    #[project = TimerProj]
    enum Timer {
        Off,
        On {
            #[pin]
            sleep: tokio::time::Sleep,
        },
    }
}

impl Timer {
    /// Arms it for `deadline`, unless it is armed already (a checkout's
    /// bound does not change once worked out).
    fn arm(mut self: Pin<&mut Self>, deadline: impl FnOnce() -> tokio::time::Instant) {
        if matches!(*self, Timer::Off) {
            self.set(Timer::On {
                sleep: tokio::time::sleep_until(deadline()),
            });
        }
    }

    /// Whether its deadline has come (registering the task's waker if
    /// not). Never fires while off.
    fn poll_fired(self: Pin<&mut Self>, cx: &mut Context<'_>) -> bool {
        match self.project() {
            TimerProj::On { sleep } => sleep.poll(cx).is_ready(),
            TimerProj::Off => {
                debug_assert!(false, "a checkout waits with its timer off");
                false
            }
        }
    }

    /// The deadline it is armed for.
    fn deadline(&self) -> Option<tokio::time::Instant> {
        match self {
            Timer::On { sleep } => Some(sleep.deadline()),
            Timer::Off => None,
        }
    }
}

type Boxed<'a, T> = Pin<Box<dyn Future<Output = Result<T, Error>> + Send + 'a>>;

/// Where a [`Getting`] is.
enum State<'a, B: Source> {
    /// Not polled yet.
    Start,
    /// In the admission queue, until its answer or its timer.
    Queued(Queued<'a, B>),
    /// Admitted, waiting for the wrapped pool (connecting, or a return
    /// under way) since `start`, until its timer fires at `deadline`.
    Waiting {
        permit: Permit<B>,
        start: tokio::time::Instant,
        deadline: tokio::time::Instant,
    },
    /// Admitted, its connection not handed out at once: see
    /// [`Shared::checkout_rest`].
    Rest(Boxed<'static, Client<B>>),
    /// Finished (or its state taken for the length of a poll).
    Done,
}

impl<B: Source, F, E> Future for Getting<'_, B, F, E>
where
    F: Future<Output = Result<B::Object, B::Raw>>,
{
    type Output = Result<Client<B>, E>;

    /// The common case runs here, straight through; the rest in functions
    /// of their own (keeping them out keeps this frame small; the rarest,
    /// `Shared::checkout_rest`, is a boxed future).
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let shared: &Arc<Shared<B>> = this.shared;
        let (lane, site, timeout, map) = (*this.lane, *this.site, *this.timeout, *this.map);
        loop {
            // Admitted, with when the checkout began (a queued one), or
            // `None`: one admitted at once on a known connection reads no
            // clock (deadpool read it as it recycled the connection, in
            // this poll); it reads one only when something makes it wait,
            // and its record ages from then.
            let (permit, start) = match this.state {
                State::Start => {
                    shared.supervisor.revive();
                    let waker = cx.waker();
                    match shared.admit_now(lane, *this.prio, *this.patient, site, waker) {
                        Ok(Entry::Admitted(permit)) => (permit, None),
                        Ok(Entry::Queued(q)) => {
                            if queued(q, timeout, this.timer.as_mut(), this.state, cx) {
                                return Poll::Pending;
                            }
                            continue;
                        }
                        Err(e) => {
                            *this.state = State::Done;
                            return Poll::Ready(Err(map(e)));
                        }
                    }
                }
                _ => match shared.poll_slow(
                    this.get.as_mut(),
                    this.timer.as_mut(),
                    this.state,
                    lane,
                    site,
                    cx,
                ) {
                    Slow::Pending => return Poll::Pending,
                    Slow::Done(r) => return Poll::Ready(r.map_err(map)),
                    Slow::Admitted(permit, start) => (permit, Some(start)),
                },
            };
            // Admitted: the wrapped pool polled in place (after admission
            // it always has room); a free connection comes back at once,
            // with no timer.
            let polled = this.get.as_mut().poll(cx);
            if let Poll::Ready(Ok(obj)) = &polled {
                if let Some(id) = B::quick_id(obj) {
                    let since = B::handed_out(obj);
                    if let Some(pid) = shared.attach_known(permit.slot(), id, since) {
                        let acquire = start.map_or(0.0, |s: tokio::time::Instant| {
                            since.saturating_duration_since(s.into_std()).as_secs_f64()
                        });
                        shared.metrics.lane(lane).acquire.record(acquire);
                        *this.state = State::Done;
                        let Poll::Ready(Ok(obj)) = polled else {
                            unreachable!("matched just above")
                        };
                        return Poll::Ready(Ok(Client {
                            spoiled: false,
                            answered: false,
                            obj: Some(obj),
                            permit,
                            pid,
                            site,
                            since,
                            object: id,
                        }));
                    }
                }
            }
            *this.state =
                shared.not_at_once(site, timeout, this.timer.as_mut(), permit, start, polled);
        }
    }
}

/// What [`Shared::poll_slow`] came to. Returned once per poll of a slow
/// checkout, never stored: its size costs nothing a box would not.
#[allow(clippy::large_enum_variant)]
enum Slow<B: Source> {
    Pending,
    Done(Result<Client<B>, Error>),
    /// Admitted after a wait in the queue that began at the instant given.
    Admitted(Permit<B>, tokio::time::Instant),
}

/// The caller's bound from `start`, tightened by the `Deadline` scope it
/// runs in: worked out only when something has to wait.
fn bound(start: tokio::time::Instant, timeout: Duration) -> tokio::time::Instant {
    bounded(start, deadline(start, timeout))
}

/// A checkout just queued for admission (its waker in its entry already:
/// an answer from now on wakes it): its timer armed and polled. Returns
/// whether it waits (its deadline not come). (Out of line, not cold: under
/// saturation most checkouts queue.)
#[inline(never)]
fn queued<'a, B: Source>(
    q: Queued<'a, B>,
    timeout: Duration,
    mut timer: Pin<&mut Timer>,
    state: &mut State<'a, B>,
    cx: &mut Context<'_>,
) -> bool {
    let start = q.start;
    *state = State::Queued(q);
    timer.as_mut().arm(|| bound(start, timeout));
    !timer.poll_fired(cx)
}

impl<B: Source> Shared<B> {
    /// An admitted checkout whose connection the wrapped pool did not hand
    /// out at once as a known one (`polled`): it waits for the pool with a
    /// timer, or goes on in [`Shared::checkout_rest`].
    #[cold]
    #[inline(never)]
    fn not_at_once<'a>(
        self: &Arc<Self>,
        site: &'static Location<'static>,
        timeout: Duration,
        mut timer: Pin<&mut Timer>,
        permit: Permit<B>,
        start: Option<tokio::time::Instant>,
        polled: Poll<Result<B::Object, B::Raw>>,
    ) -> State<'a, B> {
        let start = self.started(permit.slot(), start);
        // Armed already when it queued (the same bound: the same start).
        let deadline = timer.deadline().unwrap_or_else(|| bound(start, timeout));
        match polled {
            Poll::Pending => {
                timer.as_mut().arm(|| deadline);
                State::Waiting {
                    permit,
                    start,
                    deadline,
                }
            }
            Poll::Ready(got) => State::Rest(Box::pin(self.clone().checkout_rest(
                site,
                start,
                deadline,
                permit,
                Some(Some(got)),
            ))),
        }
    }

    /// Polls a checkout past its start: queued, waiting for the wrapped
    /// pool, or in [`Shared::checkout_rest`]. Out of line, not cold (under
    /// saturation most checkouts queue).
    #[inline(never)]
    fn poll_slow<'a, F>(
        self: &'a Arc<Self>,
        mut get: Pin<&mut F>,
        mut timer: Pin<&mut Timer>,
        state: &mut State<'a, B>,
        lane: Lane,
        site: &'static Location<'static>,
        cx: &mut Context<'_>,
    ) -> Slow<B>
    where
        F: Future<Output = Result<B::Object, B::Raw>>,
    {
        loop {
            match std::mem::replace(state, State::Done) {
                State::Queued(mut q) => {
                    let start = q.start;
                    return match q.poll_admitted(cx) {
                        Poll::Ready(Ok(permit)) => Slow::Admitted(permit, start),
                        Poll::Ready(Err(e)) => Slow::Done(Err(e)),
                        Poll::Pending if timer.as_mut().poll_fired(cx) => {
                            // The status as this waiter saw it, itself
                            // still counted; then it leaves the queue.
                            let status = self.status();
                            drop(q);
                            Slow::Done(Err(self.timed_out(lane, Stage::Admission, start, status)))
                        }
                        Poll::Pending => {
                            *state = State::Queued(q);
                            Slow::Pending
                        }
                    };
                }
                State::Waiting {
                    permit,
                    start,
                    deadline,
                } => {
                    let got = match get.as_mut().poll(cx) {
                        Poll::Ready(r) => Some(r),
                        Poll::Pending if timer.as_mut().poll_fired(cx) => None,
                        Poll::Pending => {
                            *state = State::Waiting {
                                permit,
                                start,
                                deadline,
                            };
                            return Slow::Pending;
                        }
                    };
                    *state = State::Rest(Box::pin(self.clone().checkout_rest(
                        site,
                        start,
                        deadline,
                        permit,
                        Some(got),
                    )));
                }
                State::Rest(mut rest) => {
                    return match rest.as_mut().poll(cx) {
                        Poll::Ready(r) => Slow::Done(r),
                        Poll::Pending => {
                            *state = State::Rest(rest);
                            Slow::Pending
                        }
                    };
                }
                // As an `async fn`'s future does: a caller's bug, not a
                // condition of the pool.
                State::Start | State::Done => {
                    panic!("a pgwarden checkout polled after it completed")
                }
            }
        }
    }
}

/// The `Client` of a checkout that began at `start`, handed out at
/// `since`, its wait recorded.
fn hand_out<B: Source>(
    obj: B::Object,
    permit: Permit<B>,
    pid: i32,
    object: B::Id,
    site: &'static Location<'static>,
    (since, answered): (Instant, bool),
    start: tokio::time::Instant,
) -> Client<B> {
    let acquire = since
        .saturating_duration_since(start.into_std())
        .as_secs_f64();
    let shared = permit.shared();
    shared.metrics.lane(permit.lane).acquire.record(acquire);
    Client {
        spoiled: false,
        answered,
        obj: Some(obj),
        permit,
        pid,
        site,
        since,
        object,
    }
}

impl<B: Source> Shared<B> {
    /// An admitted checkout (record `slot`) has to wait for the wrapped
    /// pool or its connection: it began at `start` (a queued one), or now
    /// (one admitted at once), and its record ages from then.
    fn started(&self, slot: usize, start: Option<tokio::time::Instant>) -> tokio::time::Instant {
        let start = start.unwrap_or_else(tokio::time::Instant::now);
        self.waiting_since(slot, start.into_std());
        start
    }

    /// A statement on a checkout's connection (its name, its pid) failed
    /// with `e`, or ran out of the checkout's bound (`None`): the
    /// connection is closed, the admission given back after it; the error.
    fn conn_failed(
        &self,
        obj: B::Object,
        permit: Permit<B>,
        start: tokio::time::Instant,
        e: Option<Error>,
    ) -> Error {
        let lane = permit.lane;
        finish(B::discard(obj), Some(permit), Duration::ZERO);
        match e {
            Some(e) => {
                self.metrics.lane(lane).fail_backend.increment(1);
                e
            }
            None => self.timed_out(lane, Stage::BackendPid, start, self.status()),
        }
    }

    /// pgwarden's own statement on a checkout's connection (its name, its
    /// pid) failed with `e` (`None`: ran out of the checkout's bound): a
    /// failure on a connection used before means a dead one (a session the
    /// leak sweep ended, a server restarted): it is discarded and the
    /// admission handed back (`Ok`) for the checkout to take another, up to
    /// the pool's size of them (`dead` counts them); past that, or out of
    /// time, the connection is closed and the error returned.
    fn dead_conn(
        &self,
        obj: B::Object,
        permit: Permit<B>,
        start: tokio::time::Instant,
        e: Option<Error>,
        dead: &mut usize,
    ) -> Result<Permit<B>, Error> {
        match e {
            Some(e) if *dead < self.inner.status().max => {
                *dead += 1;
                tracing::debug!(pool = %self.name, error = %e, "a pooled connection failed pgwarden's own statement: discarded, taking another");
                finish(B::discard(obj), None::<Permit<B>>, Duration::ZERO);
                Ok(permit)
            }
            e => Err(self.conn_failed(obj, permit, start, e)),
        }
    }

    /// The wrapped pool answered an admitted checkout with `e`. No room
    /// means: after admission that happens only while a return is on its
    /// way (resolved at once), or when its capacity was changed or taken
    /// outside pgwarden (reported by `deadline`).
    async fn no_object(
        &self,
        e: B::Raw,
        permit: &Permit<B>,
        start: tokio::time::Instant,
        deadline: tokio::time::Instant,
    ) -> Result<B::Object, Error> {
        let lane = permit.lane;
        if let Refused::Failed(e) = B::refused(e) {
            return Err(e);
        }
        let size = self.state.lock().adm.limits().size();
        let inner = self.inner.status();
        if inner.size < inner.max {
            // It had room to open one: it could not connect in time (sqlx
            // answers a server that refuses connections, or an
            // `after_connect` hook that fails, with `PoolTimedOut` once its
            // acquire timeout passes), not a capacity taken outside pgwarden.
            return Err(self.timed_out(lane, Stage::Connection, start, self.status()));
        }
        let max = inner.max;
        if max == size {
            if let Some(r) = until(deadline, self.inner.take_waiting(&self.cfg)).await {
                return r.map_err(|e| match B::refused(e) {
                    Refused::Failed(e) => e,
                    Refused::NoRoom => Error::Checkout(CheckoutError::Backend(
                        "the wrapped pool had no connection for an admitted checkout".into(),
                    )),
                });
            }
        }
        let in_use = self.state.lock().adm.total();
        let err = Error::Checkout(CheckoutError::DeadpoolMismatch {
            lane,
            size,
            deadpool_max: self.inner.status().max,
            in_use,
        });
        self.metrics.lane(lane).fail_backend.increment(1);
        tracing::warn!(pool = %self.name, %lane, waited = ?start.elapsed(), error = %err, "checkout failed");
        Err(err)
    }
}

// --- the Client -------------------------------------------------------------

/// A checked-out connection. Derefs to [`deadpool_postgres::Client`], so code
/// written against deadpool runs unchanged; returns to the pool on drop.
/// (`B` is the pool it came from: deadpool's unless said otherwise; the
/// sqlx pool's connection is `pgwarden::sqlx::PoolConnection`, which
/// derefs to sqlx's `PgConnection`.)
///
/// Knows its lane, its backend pid, where it was checked out and since when.
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), Box<dyn std::error::Error>> {
/// use pgwarden::{Client, Pool};
///
/// async fn count(client: &Client) -> Result<i64, tokio_postgres::Error> {
///     Ok(client.query_one("SELECT count(*) FROM jobs", &[]).await?.get(0))
/// }
/// let client = pool.get().await?;
/// println!("{} jobs, pid {}, lane {}", count(&client).await?, client.pid(), client.lane());
/// # Ok(()) }
/// ```
#[repr(C)]
pub struct Client<B: Source = deadpool_postgres::Pool> {
    // `Drop` gives the connection back to the wrapped pool before the
    // permit to the budget (sqlx: once its return is done), so an admitted
    // checkout never waits inside the pool. In this order (`repr(C)`) the
    // small fields are built in place as a checkout hands its `Client`
    // out, the connection after them.
    pub(super) permit: Permit<B>,
    pub(super) since: Instant,
    pub(super) site: &'static Location<'static>,
    pub(super) object: B::Id,
    pub(super) pid: i32,
    /// A statement cut short may have left the connection inside a
    /// transaction nothing will end ([`Source::exec`]): closed on drop,
    /// not given back.
    pub(super) spoiled: bool,
    /// The server answered a round trip on the connection during the
    /// checkout (the wrapped pool's ping of an idle connection,
    /// [`Source::pings_idle`], or pgwarden's naming or pid statement).
    pub(super) answered: bool,
    pub(super) obj: Option<B::Object>,
}

impl<B: Source> Client<B> {
    /// The lane it was checked out on.
    pub fn lane(&self) -> Lane {
        self.permit.lane
    }

    /// The backend pid of its PostgreSQL session (behind a transaction
    /// pooler: the pid seen at first checkout, which may change).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Where it was checked out.
    pub fn site(&self) -> &'static Location<'static> {
        self.site
    }

    /// When it was checked out.
    pub fn since(&self) -> Instant {
        self.since
    }

    /// Closes the physical connection instead of returning it to the pool:
    /// PostgreSQL ends the session, and every session lock with it.
    pub fn discard(mut self) {
        self.close_in_place();
    }

    /// [`Client::discard`] through `&mut`: the connection is closed now,
    /// the permit released as the client drops.
    pub(crate) fn close_in_place(&mut self) {
        if let Some(obj) = self.obj.take() {
            self.permit.shared().state.lock().pids.remove(&self.object);
            if let Some(close) = B::discard(obj) {
                self.mark_releasing();
                finish(Some(close), Some(self.permit.take()), Duration::ZERO);
            }
        }
    }

    /// A connection made for this checkout (never used before).
    pub(super) fn is_new(&self) -> bool {
        self.obj.as_ref().is_some_and(B::is_new)
    }

    /// Its owner let go and its return is under way (a dropped session-lock
    /// guard whose unlock is in flight): a checkout of its lane refused only
    /// because of it waits for it instead.
    pub(crate) fn mark_releasing(&self) {
        self.permit.shared().mark_releasing(self.permit.slot());
    }

    /// The statement layer's view of the connection: how the layers above
    /// the pool run statements on a checkout of any backend.
    pub(crate) fn exec(&mut self) -> B::Exec<'_> {
        // infallible: `obj` is Some until drop or `discard`, which consume self.
        let obj = self.obj.as_mut().expect("connection present until drop"); // infallible
        B::exec(
            B::conn_mut(obj),
            &self.permit.shared().cfg,
            &mut self.spoiled,
        )
    }

    /// The pool it was checked out of.
    pub(crate) fn pool(&self) -> &Arc<Shared<B>> {
        self.permit.shared()
    }

    /// Sets what the checkout is for, shown in long-hold warnings.
    pub(crate) fn set_note(&self, note: Option<String>) {
        if let Some(c) = self
            .permit
            .shared()
            .state
            .lock()
            .checkouts
            .get_mut(self.permit.slot())
        {
            c.note = note;
        }
    }

    fn object(&self) -> &B::Object {
        // infallible: `obj` is Some until drop or `discard`, which consume self.
        self.obj.as_ref().expect("connection present until drop") // infallible
    }
}

/// A checkout whose transaction is being begun: dropped before
/// [`Beginning::begun`] (its caller's future dropped during the `BEGIN`,
/// or the `BEGIN` failed), the connection is closed, not returned.
///
/// sqlx 0.8's `begin` counts the transaction only once the server has
/// answered, so its rollback guard queues nothing when cut short: returned
/// to the pool, the connection would still be inside the transaction, and
/// the next borrower's statements would run in it, never committed.
/// Closing it ends the transaction on the server, on every backend.
pub(crate) struct Beginning<'c, B: Source> {
    client: &'c mut Client<B>,
    begun: std::sync::atomic::AtomicBool,
}

impl<'c, B: Source> Beginning<'c, B> {
    /// Guards `client` until its transaction has begun.
    pub(crate) fn new(client: &'c mut Client<B>) -> Self {
        Beginning {
            client,
            begun: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The client, and the flag to set (with [`Beginning::begun`]) once
    /// the `BEGIN` is done: borrowed apart, so that the flag is set while
    /// the transaction still borrows the client.
    pub(crate) fn parts(&mut self) -> (&mut Client<B>, &std::sync::atomic::AtomicBool) {
        (self.client, &self.begun)
    }

    /// Marks `flag` (of [`Beginning::parts`]): the transaction has begun.
    pub(crate) fn begun(flag: &std::sync::atomic::AtomicBool) {
        flag.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

impl<B: Source> Drop for Beginning<'_, B> {
    fn drop(&mut self) {
        if !self.begun.load(std::sync::atomic::Ordering::Relaxed) {
            self.client.close_in_place();
        }
    }
}

impl<B: Source> Deref for Client<B> {
    type Target = B::Conn;
    fn deref(&self) -> &B::Conn {
        B::conn(self.object())
    }
}

impl<B: Source> DerefMut for Client<B> {
    fn deref_mut(&mut self) -> &mut B::Conn {
        // infallible: `obj` is Some until drop or `discard`, which consume self.
        B::conn_mut(self.obj.as_mut().expect("connection present until drop")) // infallible
    }
}

impl AsRef<deadpool_postgres::Client> for Client {
    fn as_ref(&self) -> &deadpool_postgres::Client {
        self
    }
}

impl<B: Source> Drop for Client<B> {
    fn drop(&mut self) {
        if self.spoiled {
            self.close_in_place();
        }
        if let Some(obj) = &self.obj {
            let held = self.since.elapsed();
            let shared = self.permit.shared();
            shared
                .metrics
                .lane(self.permit.lane)
                .hold
                .record(held.as_secs_f64());
            if B::is_broken(obj) {
                shared.state.lock().pids.remove(&self.object);
            }
            // The connection goes back to the wrapped pool (deadpool's
            // dropped in place), then the permit to the budget: at once, or
            // once the pool's return is done (sqlx's), meanwhile marked
            // releasing: a session lock asked for meanwhile waits for that
            // return instead of being refused because of it.
            match B::give_back(&mut self.obj) {
                None => self.permit.release(held),
                back => {
                    self.mark_releasing();
                    finish(back, Some(self.permit.take()), held)
                }
            }
        }
        // After `discard`, the permit is released as it drops.
    }
}

impl<B: Source> fmt::Debug for Client<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("lane", &self.permit.lane)
            .field("pid", &self.pid)
            .field("site", &format_args!("{}", self.site))
            .field("age", &self.since.elapsed())
            .finish()
    }
}
