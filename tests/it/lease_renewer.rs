//! The renewer is supervised, against a real PostgreSQL: when its runtime
//! is dropped, the lease still reports itself lost at its deadline (before
//! another instance takes it) and the next acquisition starts a renewer
//! again; a panic inside it (here, the metrics recorder's) is caught and
//! counted, and renewal goes on. On every backend, from one source.

use crate::support;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use pgwarden::{LeaseOptions, LostReason};
use pgwarden_testing::TestDb;
use support::backend::{Backend, LeaseSettings, Settings};
use support::leases::{ahead, expiry};
use support::{admin, db, eventually, within};

const S: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

backends!(
    sync,
    lost_fires_on_time_when_the_renewers_runtime_is_dropped
);
/// The lease is taken in a runtime that is then dropped, with its renewer:
/// the lease still reports itself lost at its deadline, before another
/// instance takes it; the next acquisition starts a renewer again.
fn lost_fires_on_time_when_the_renewers_runtime_is_dropped<B: Backend>() {
    // Renewed every 500 ms, lost 500 ms before the database could let
    // anyone in: the events come 1 s (lost) and 1.5 s (expiry) after the
    // acquisition, and the signal is the deadline's own timer.
    let quick = LeaseOptions::new(1500 * MS)
        .renew_every(500 * MS)
        .safety_margin(500 * MS);
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (db, a, b) = main.block_on(async {
        let db = db().await;
        let pool_a = B::build(&db, &Settings::new("rt-a", 3));
        // The pool's connections live in this runtime.
        drop(B::get(&pool_a).await.unwrap());
        let a = B::leases(&pool_a);
        let b = B::leases(&B::build(&db, &Settings::new("rt-b", 2)));
        B::install(&b).await.unwrap();
        (db, a, b)
    });
    // Taken in a runtime of its own, which starts the renewer there...
    let other = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let lease = other
        .block_on(B::acquire(&a, "job", &quick, None))
        .unwrap()
        .unwrap();
    // ...and is dropped, with the renewer.
    drop(other);
    let renewals = B::lease_stats(&a).renewal_statements;
    main.block_on(async {
        let admin = admin(&db).await;
        let expires = expiry(&admin, "job").await;
        let taker_opts = quick.clone();
        let taker = tokio::spawn(async move {
            let l = B::acquire(&b, "job", &taker_opts, Some(10 * S)).await;
            (SystemTime::now(), l)
        });
        let reason = within(5 * S, "lost signal", lease.lost()).await;
        let lost_at = SystemTime::now();
        assert_eq!(reason, LostReason::Deadline);
        assert_eq!(
            B::lease_stats(&a).renewal_statements,
            renewals,
            "nothing renewed it"
        );
        let (taken_at, taken) = within(10 * S, "take-over", taker).await.unwrap();
        let taken = taken.unwrap().expect("taken within the wait");
        eprintln!(
            "runtime dropped: lost {:.3} s before the expiry, {:.3} s before the take-over",
            ahead(lost_at, expires),
            ahead(lost_at, taken_at)
        );
        assert!(ahead(lost_at, expires) > 0.0);
        assert!(lost_at < taken_at);
        assert_eq!(
            taken.term().took_over_from.as_deref(),
            Some(lease.term().holder.as_str())
        );

        // The next acquisition starts a renewer in this runtime. A TTL of
        // 30 s, renewed every 500 ms: its first renewal may make a
        // connection (those made on the dropped runtime are gone) and
        // take its time on a loaded machine; with `quick`'s, a renewal
        // had 500 ms before the lease counted as lost, and in loaded CI
        // runs one took longer (three runs in about ten).
        let steady = LeaseOptions::new(30 * S).renew_every(500 * MS);
        let fresh = B::acquire(&a, "again", &steady, None)
            .await
            .unwrap()
            .unwrap();
        let before = B::lease_stats(&a);
        let renewed = || B::lease_stats(&a).renewed >= before.renewed + 2;
        // On a timeout, what the renewer did (it failed once in a loaded
        // CI run, cause not yet known): its statements, failures, batches.
        if tokio::time::timeout(4 * S, async {
            while !renewed() {
                tokio::time::sleep(20 * MS).await;
            }
        })
        .await
        .is_err()
        {
            panic!(
                "no 2 renewals in 4 s: stats before {before:?}, now {:?}, the fresh lease lost: {:?}",
                B::lease_stats(&a),
                fresh.is_lost()
            );
        }
        assert!(!fresh.is_lost());
        B::release(fresh).await.unwrap();
        B::release(taken).await.unwrap();
    });
}

/// A metrics recorder that panics: the renewal histogram on its first 3
/// records (inside renewal batches), the renew-interval gauge on its first
/// 5 sets (inside the renewer's tick). It counts the renewer's panics.
#[derive(Default)]
struct Panicky {
    histogram: Arc<AtomicUsize>,
    gauge: Arc<AtomicUsize>,
    renewer_panics: Arc<AtomicU64>,
}

struct Fails(Arc<AtomicUsize>, usize);
struct Counts(Arc<AtomicU64>);

impl metrics::HistogramFn for Fails {
    fn record(&self, _: f64) {
        if self.0.fetch_add(1, Ordering::SeqCst) < self.1 {
            panic!("recorder failure (histogram)");
        }
    }
}

impl metrics::GaugeFn for Fails {
    fn increment(&self, _: f64) {}
    fn decrement(&self, _: f64) {}
    fn set(&self, _: f64) {
        if self.0.fetch_add(1, Ordering::SeqCst) < self.1 {
            panic!("recorder failure (gauge)");
        }
    }
}

impl metrics::CounterFn for Counts {
    fn increment(&self, n: u64) {
        self.0.fetch_add(n, Ordering::SeqCst);
    }
    fn absolute(&self, _: u64) {}
}

impl metrics::Recorder for Panicky {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        if key.name() == "pgwarden_lease_renewer_panics_total" {
            metrics::Counter::from_arc(Arc::new(Counts(self.renewer_panics.clone())))
        } else {
            metrics::Counter::noop()
        }
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        if key.name() == "pgwarden_lease_renew_interval_seconds" {
            metrics::Gauge::from_arc(Arc::new(Fails(self.gauge.clone(), 5)))
        } else {
            metrics::Gauge::noop()
        }
    }
    fn register_histogram(
        &self,
        key: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        if key.name() == "pgwarden_lease_renewal_duration_seconds" {
            metrics::Histogram::from_arc(Arc::new(Fails(self.histogram.clone(), 3)))
        } else {
            metrics::Histogram::noop()
        }
    }
}

backends!(the_renewer_survives_panics);
async fn the_renewer_survives_panics<B: Backend>() {
    let db = db().await;
    let recorder = Panicky::default();
    let pool = B::build(&db, &Settings::new("panicky", 3));
    // The handles are registered with the recorder when the instance is built.
    let leases = metrics::with_local_recorder(&recorder, || B::leases(&pool));
    let opts = LeaseOptions::new(2 * S).renew_every(250 * MS);
    let lease = B::acquire(&leases, "job", &opts, None)
        .await
        .unwrap()
        .unwrap();
    // The lease lives on, renewed, through 8 panics: the recorder panics in
    // the first 3 histogram records and the first 5 gauge sets, then no more.
    let panics = || recorder.renewer_panics.load(Ordering::SeqCst);
    eventually(20 * S, "8 renewer panics caught", || async {
        panics() >= 8
    })
    .await;
    // Then past a whole TTL more of renewals (9 at 250 ms: over 2 s) with no
    // further panic: a renewer that died with a panic would have lost the
    // lease by then.
    let renewed = B::lease_stats(&leases).renewed;
    eventually(20 * S, "9 renewals after the panics", || async {
        B::lease_stats(&leases).renewed >= renewed + 9
    })
    .await;
    let stats = B::lease_stats(&leases);
    eprintln!("{} renewer panics caught; {stats:?}", panics());
    assert_eq!(
        panics(),
        8,
        "3 in batches + 5 in ticks, each caught and counted"
    );
    assert!(
        !lease.is_lost(),
        "{:?}",
        futures_util::FutureExt::now_or_never(lease.lost())
    );
    assert!(stats.renewed >= 8, "{stats:?}");
    B::release(lease).await.unwrap();
}

/// Takes `name` on a current-thread runtime kept busy by 100 always-ready
/// tasks, returns from its `block_on` at the first poll after the renewer
/// (started there by this first checkout) spawned a task of `kind` (its
/// `spawned` trace event: "renewal batch" or "purge round"), looking from
/// `after` on: with the ready tasks ahead of it, that task has not been
/// polled yet; then drops the runtime. The lease, and whether such a spawn
/// was seen (within 30 s of `after`: a hang guard).
///
/// The hostile reader's probe of stop 47 (its F1 and F2): a task dropped
/// before its first poll left the marks its tick had set (a batch's leases
/// "in flight", the purge "running") for good. The spawn is seen by its
/// event, not by the runtime's count of live tasks, which a task ending at
/// the same time hid (and sqlx spawns tasks of its own).
fn dropped_right_after_a_spawn<B: Backend>(
    leases: &B::Leases,
    name: &str,
    opts: &LeaseOptions,
    after: Duration,
    kind: &'static str,
) -> (B::Lease, bool) {
    use tracing_subscriber::layer::SubscriberExt;
    let other = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let spawned = Arc::new(AtomicBool::new(false));
    // This thread's: the current-thread runtime runs the renewer's tick here.
    let _seen = tracing::subscriber::set_default(
        tracing_subscriber::registry().with(Spawned(kind, spawned.clone())),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let out = other.block_on(async {
        for _ in 0..100 {
            let stop = stop.clone();
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    tokio::task::yield_now().await;
                }
            });
        }
        let lease = B::acquire(leases, name, opts, None)
            .await
            .unwrap()
            .expect("free");
        let t0 = Instant::now();
        while t0.elapsed() < after {
            tokio::task::yield_now().await;
        }
        spawned.store(false, Ordering::SeqCst);
        while t0.elapsed() < after + 30 * S {
            tokio::task::yield_now().await;
            if spawned.load(Ordering::SeqCst) {
                return (lease, true);
            }
        }
        (lease, false)
    });
    stop.store(true, Ordering::Relaxed);
    drop(other);
    out
}

/// Sets its flag at pgwarden's trace event of a spawned task of its kind.
struct Spawned(&'static str, Arc<AtomicBool>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Spawned {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Kind<'a>(&'a str, bool);
        impl tracing::field::Visit for Kind<'_> {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                self.1 |= field.name() == "spawned" && value == self.0;
            }
            fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
        }
        let mut kind = Kind(self.0, false);
        event.record(&mut kind);
        if kind.1 {
            self.1.store(true, Ordering::SeqCst);
        }
    }
}

/// A multi-thread runtime of 2 workers, and a database on which it made the
/// lease table (through a pool named `name` of its own: no other pool has
/// checked out on it yet).
fn installed<B: Backend>(name: &'static str) -> (tokio::runtime::Runtime, TestDb) {
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let db = main.block_on(async {
        let db = db().await;
        let installer = B::build(&db, &Settings::new(name, 2));
        B::install(&B::leases(&installer)).await.unwrap();
        db
    });
    (main, db)
}

backends!(
    sync,
    a_renewal_batch_dropped_before_its_first_poll_strands_no_lease
);
/// A renewal batch spawned by the renewer's tick and dropped unpolled with
/// its runtime: once a checkout on another runtime revives the renewer,
/// the same lease is renewed again (its "in flight" mark was set for good:
/// 30 of 30 rounds never renewed it again, and it was reported lost with a
/// healthy database).
fn a_renewal_batch_dropped_before_its_first_poll_strands_no_lease<B: Backend>() {
    let (main, db) = installed::<B>("unpolled-batch-install");
    let opts = LeaseOptions::new(20 * S).renew_every(300 * MS);
    let mut caught = 0;
    for i in 0..4 {
        // A pool and instance of their own: their first checkout (on the
        // dropped runtime) starts the renewer there.
        let pool = main.block_on(async { B::build(&db, &Settings::new("unpolled-batch", 4)) });
        let leases = B::leases(&pool);
        let (lease, seen) = dropped_right_after_a_spawn::<B>(
            &leases,
            &format!("job-{i}"),
            &opts,
            200 * MS,
            "renewal batch",
        );
        caught += usize::from(seen);
        let before = B::lease_stats(&leases).renewed;
        main.block_on(async {
            drop(B::get(&pool).await.unwrap());
            // 30 s: a hang guard (the old code never renewed it again).
            eventually(30 * S, "the same lease renewed again", || {
                std::future::ready(B::lease_stats(&leases).renewed >= before + 2)
            })
            .await;
            assert!(!lease.is_lost());
            B::release(lease).await.unwrap();
        });
    }
    assert!(caught > 0, "no round dropped a batch before its first poll");
}

backends!(
    sync,
    a_purge_round_dropped_before_its_first_poll_leaves_the_purge_running
);
/// The same for a purge round (every 300 ms): dropped unpolled with its
/// runtime, the purge runs again once the renewer is revived elsewhere
/// (its "running" mark was set for good: the instance never purged again).
fn a_purge_round_dropped_before_its_first_poll_leaves_the_purge_running<B: Backend>() {
    let (main, db) = installed::<B>("unpolled-purge-install");
    let opts = LeaseOptions::new(60 * S);
    // Every 300 ms: each round of the loop sees a round's spawn soon.
    let settings = LeaseSettings::default().purge(Duration::ZERO, Some(300 * MS));
    let mut caught = 0;
    for i in 0..4u64 {
        let pool = main.block_on(async { B::build(&db, &Settings::new("unpolled-purge", 4)) });
        let leases = B::leases_with(&pool, &settings).unwrap();
        let after = Duration::from_millis(100 + i * 7 % 30);
        let (lease, seen) = dropped_right_after_a_spawn::<B>(
            &leases,
            &format!("job-{i}"),
            &opts,
            after,
            "purge round",
        );
        caught += usize::from(seen);
        let before = B::lease_stats(&leases).purge_statements;
        main.block_on(async {
            drop(B::get(&pool).await.unwrap());
            // 30 s: a hang guard (the old code never purged again; with
            // 5 s both sqlx cases failed in one CI run, whose message was
            // not kept).
            eventually(30 * S, "purge statements again", || {
                std::future::ready(B::lease_stats(&leases).purge_statements >= before + 2)
            })
            .await;
            B::release(lease).await.unwrap();
        });
    }
    assert!(caught > 0, "no round dropped a task before its first poll");
}
