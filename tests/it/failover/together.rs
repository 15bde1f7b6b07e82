//! One cluster for every backend's run of a construction: the runs go at
//! once, each in a database of its own on the same primary/replica pair,
//! and meet at the cluster's steps (pause the streaming, crash the primary,
//! promote the replica), which the last to arrive takes for all.
//!
//! A failover test needs a cluster of its own (the crash and the promotion
//! are the point); a cluster start (`initdb`, two servers, a base backup)
//! is the expensive part, and one per backend and construction made twelve
//! per test run. Sharing it changes nothing a run observes in its database:
//! its leases, token sequence, fenced rows and advisory locks are its own
//! (advisory locks are per database); the crash and the promotion are the
//! same events, seen by each run at the same moment.
//!
//! The first test that asks for a construction's results runs all of its
//! bodies, on a runtime of its own; the other tests wait for that run and
//! report their own body's result. A body that fails (panics) leaves the
//! steps to the others, so they are not held up.

use std::collections::BTreeMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use pgwarden_testing::{within, Cluster, Replication};
use tokio::sync::{watch, RwLock, RwLockReadGuard};

/// How long the cluster may take to start, and a step to be taken once all
/// have arrived (a generous bound for a loaded 2-core machine: the slowest
/// body's way to the step counts too).
const START: Duration = Duration::from_secs(60);
const ARRIVE: Duration = Duration::from_secs(120);
/// The bounds of an immediate stop and of a promotion.
const CRASH: Duration = Duration::from_secs(20);
const PROMOTE: Duration = Duration::from_secs(30);

/// A step of the cluster's, taken once for every body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// [`Cluster::pause_streaming`].
    Pause,
    /// [`Cluster::stop_primary_immediate`].
    Crash,
    /// [`Cluster::promote_replica`].
    Promote,
}

/// When a step was taken: issued at `started`, returned at `finished`.
#[derive(Clone, Copy, Debug)]
pub struct Taken {
    pub started: Instant,
    pub finished: Instant,
}

#[derive(Default)]
struct Gate {
    /// Bodies still running.
    live: usize,
    /// Bodies waiting at the current step.
    waiting: usize,
    /// Whether one of them is taking it.
    leading: bool,
    /// Steps taken so far, with how each went.
    taken: Vec<(Step, Result<Taken, String>)>,
}

/// The shared cluster, as a body sees it.
pub struct Seat {
    cluster: RwLock<Cluster>,
    gate: Mutex<Gate>,
    changed: watch::Sender<u64>,
}

impl Seat {
    /// The cluster, to read (connection settings, nodes). Not to be held
    /// across [`Seat::step`]: the step needs it to itself.
    pub async fn cluster(&self) -> RwLockReadGuard<'_, Cluster> {
        self.cluster.read().await
    }

    /// Waits until every running body has arrived at this step, which the
    /// last to arrive takes; returns when it was taken.
    pub async fn step(&self, step: Step) -> Taken {
        let mut rx = self.changed.subscribe();
        let index = {
            let mut gate = self.gate();
            gate.waiting += 1;
            gate.taken.len()
        };
        let wait = async {
            loop {
                let lead = {
                    let mut gate = self.gate();
                    if let Some((taken, result)) = gate.taken.get(index) {
                        assert_eq!(*taken, step, "the bodies' steps differ");
                        return result.clone();
                    }
                    let lead = !gate.leading && gate.waiting == gate.live;
                    gate.leading |= lead;
                    lead
                };
                if lead {
                    let result = self.take(step).await;
                    let mut gate = self.gate();
                    gate.leading = false;
                    gate.waiting = 0;
                    gate.taken.push((step, result.clone()));
                    self.changed.send_modify(|n| *n += 1);
                    return result;
                }
                rx.changed().await.expect("the seat outlives its bodies");
            }
        };
        within(ARRIVE, "every body at the cluster's step", wait)
            .await
            .unwrap_or_else(|e| panic!("{step:?}: {e}"))
    }

    async fn take(&self, step: Step) -> Result<Taken, String> {
        let mut cluster = self.cluster.write().await;
        let started = Instant::now();
        let done = match step {
            Step::Pause => cluster.pause_streaming().await,
            Step::Crash => tokio::time::timeout(CRASH, cluster.stop_primary_immediate())
                .await
                .map_err(|_| format!("immediate stop: not done within {CRASH:?}"))?,
            Step::Promote => tokio::time::timeout(PROMOTE, cluster.promote_replica())
                .await
                .map_err(|_| format!("promotion: not done within {PROMOTE:?}"))?
                .map(drop),
        };
        done.map_err(|e| e.to_string())?;
        Ok(Taken {
            started,
            finished: Instant::now(),
        })
    }

    fn gate(&self) -> std::sync::MutexGuard<'_, Gate> {
        self.gate.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A body has ended (returned or failed): the steps no longer wait for
    /// it.
    fn leave(&self) {
        self.gate().live -= 1;
        self.changed.send_modify(|n| *n += 1);
    }
}

/// A body's run on the shared cluster: its future, boxed.
pub type Run<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;
/// A body: a test's code on one backend.
pub type Body<T> = for<'a> fn(&'a Seat) -> Run<'a, T>;

/// Ends a body's part in the steps when it returns or unwinds.
struct Leaves<'a>(&'a Seat);

impl Drop for Leaves<'_> {
    fn drop(&mut self) {
        self.0.leave();
    }
}

/// What each body ended with, by its key, or why it failed.
pub type Results<T> = BTreeMap<String, Result<T, String>>;

/// Starts one cluster replicating as `replication` and runs every body on
/// it at once, on a runtime of its own; what each ended with.
pub fn run_all<T: Send + 'static>(
    replication: Replication,
    bodies: Vec<(String, Body<T>)>,
) -> Results<T> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let cluster = within(START, "cluster start", Cluster::start_with(replication))
                .await
                .expect("cluster");
            let seat = Seat {
                cluster: RwLock::new(cluster),
                gate: Mutex::new(Gate {
                    live: bodies.len(),
                    ..Gate::default()
                }),
                changed: watch::channel(0).0,
            };
            let runs = bodies.into_iter().map(|(key, body)| {
                let seat = &seat;
                async move {
                    let leaves = Leaves(seat);
                    let result = AssertUnwindSafe(body(seat)).catch_unwind().await;
                    drop(leaves);
                    (key, result.map_err(|panic| message(&*panic)))
                }
            });
            futures_util::future::join_all(runs)
                .await
                .into_iter()
                .collect()
        })
    })
    .join()
    .unwrap_or_else(|panic| panic!("the shared cluster failed: {}", message(&*panic)))
}

/// A panic's message.
fn message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "panicked".to_owned())
}

/// The results of a construction, run once per test binary by the first
/// test that asks (the others wait for it).
pub fn results<T: Send + 'static>(
    once: &'static OnceLock<Results<T>>,
    replication: Replication,
    bodies: fn() -> Vec<(String, Body<T>)>,
) -> &'static Results<T> {
    once.get_or_init(|| run_all(replication, bodies()))
}

/// The result of the body `key`: its value, or a panic with why it failed.
pub fn result<'a, T>(results: &'a Results<T>, key: &str) -> &'a T {
    match results.get(key) {
        Some(Ok(value)) => value,
        Some(Err(e)) => panic!("{key} failed on the shared cluster: {e}"),
        None => panic!("no body {key} on the shared cluster"),
    }
}

/// `(key, body)` for every backend built in: `body::<B>` keyed
/// `"<$prefix>::<B::NAME>"`.
macro_rules! every_backend {
    ($prefix:literal, $($body:ident)::+) => {{
        use crate::support::backend::Backend as _;
        let mut v: Vec<(String, $crate::failover::together::Body<_>)> = Vec::new();
        v.push((
            format!("{}::{}", $prefix, crate::support::backend::Deadpool::NAME),
            |seat| Box::pin($($body)::+::<crate::support::backend::Deadpool>(seat)),
        ));
        #[cfg(feature = "sqlx-0_8")]
        v.push((
            format!("{}::{}", $prefix, crate::support::backend::Sqlx08::NAME),
            |seat| Box::pin($($body)::+::<crate::support::backend::Sqlx08>(seat)),
        ));
        #[cfg(feature = "sqlx-0_9")]
        v.push((
            format!("{}::{}", $prefix, crate::support::backend::Sqlx09::NAME),
            |seat| Box::pin($($body)::+::<crate::support::backend::Sqlx09>(seat)),
        ));
        v
    }};
}
pub(crate) use every_backend;
