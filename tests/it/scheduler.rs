//! The lease scheduler against a real PostgreSQL: once per period across
//! instances, once per node, graceful shutdown, jitter, a run past its
//! period's end. On every backend, from one source.

use crate::support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, UNIX_EPOCH};

use pgwarden::{Job, LeaseHandle, LeaseOptions};
use support::backend::{Backend, Settings};
use support::stalls::Stalls;
use support::{db, eventually};

const S: Duration = Duration::from_secs(1);

/// The instances' pool names (a `Settings` name is `'static`).
const SCHED: [&str; 3] = ["sched0", "sched1", "sched2"];
const OVERRUN: [&str; 2] = ["overrun0", "overrun1"];

/// One run: which instance, which lease, which period (database clock).
#[derive(Clone, Debug)]
struct Run {
    instance: usize,
    lease: String,
    slot: i64,
}

type Log = Arc<parking_lot::Mutex<Vec<Run>>>;

fn slot_of(lease: &LeaseHandle, period: Duration) -> i64 {
    let t = lease.term().taken_at.duration_since(UNIX_EPOCH).unwrap();
    (t.as_secs_f64() / period.as_secs_f64()).floor() as i64
}

fn recorder(
    log: &Log,
    instance: usize,
) -> impl Fn(LeaseHandle) -> std::future::Ready<()> + Send + Sync + 'static + use<> {
    let log = log.clone();
    move |lease| {
        log.lock().push(Run {
            instance,
            lease: lease.term().name.clone(),
            slot: slot_of(&lease, S),
        });
        std::future::ready(())
    }
}

backends!(three_instances_run_each_job_once_per_period_and_per_node);
async fn three_instances_run_each_job_once_per_period_and_per_node<B: Backend>() {
    let db = db().await;
    let nodes = ["n1", "n1", "n2"];
    let log: Log = Arc::default();
    let mut schedulers = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let leases = B::leases(&B::build(&db, &Settings::new(SCHED[i], 3)));
        B::install(&leases).await.unwrap();
        let jobs = vec![
            Job::every("tick", S, recorder(&log, i)),
            Job::per_node("uptime", S, recorder(&log, i)),
        ];
        let s = B::schedule_node(&leases, node, jobs).unwrap();
        schedulers.push(s);
    }
    // Seven periods of the cluster job: the five in the middle are whole.
    let start = Instant::now();
    let stalls = Stalls::watch();
    eventually(15 * S, "seven periods", || async {
        let slots: std::collections::BTreeSet<i64> = log
            .lock()
            .iter()
            .filter(|r| r.lease == "tick")
            .map(|r| r.slot)
            .collect();
        slots.len() >= 7
    })
    .await;
    for s in schedulers {
        s.shutdown(10 * S).await;
    }
    let runs = log.lock().clone();
    eprintln!("{} runs in {:?}", runs.len(), start.elapsed());

    let mut by_lease: BTreeMap<&str, BTreeMap<i64, Vec<usize>>> = BTreeMap::new();
    for r in &runs {
        by_lease
            .entry(r.lease.as_str())
            .or_default()
            .entry(r.slot)
            .or_default()
            .push(r.instance);
    }
    assert_eq!(
        by_lease.keys().copied().collect::<Vec<_>>(),
        ["tick", "uptime@n1", "uptime@n2"]
    );
    let ticks = &by_lease["tick"];
    let (first, last) = (*ticks.keys().next().unwrap(), *ticks.keys().last().unwrap());
    assert!(last - first >= 6, "{ticks:?}");
    for (lease, slots) in &by_lease {
        // Never twice in a period, on any instance.
        for (slot, instances) in slots {
            assert_eq!(
                instances.len(),
                1,
                "{lease} ran {instances:?} in period {slot}"
            );
        }
        // Every whole period ran (the first and last may be partial),
        // unless this runtime itself stalled then (see `support::stalls`).
        for slot in (first + 1..last).filter(|s| !slots.contains_key(s)) {
            match stalls.during(slot, S) {
                Some(stall) => eprintln!("{lease} missed period {slot}: the runtime stalled {stall:?}"),
                None => panic!(
                    "{lease} missed period {slot} with no stall of the runtime: {slots:?}; stalls {:?}",
                    stalls.all()
                ),
            }
        }
        // Per-node jobs run on their node.
        let allowed: &[usize] = match *lease {
            "uptime@n1" => &[0, 1],
            "uptime@n2" => &[2],
            _ => &[0, 1, 2],
        };
        for instances in slots.values() {
            assert!(
                allowed.contains(&instances[0]),
                "{lease} ran on instance {}",
                instances[0]
            );
        }
    }
    let per_instance: Vec<usize> = (0..3)
        .map(|i| runs.iter().filter(|r| r.instance == i).count())
        .collect();
    eprintln!("runs per instance: {per_instance:?}; periods {first}..={last}");
}

backends!(graceful_shutdown_releases_leases);
async fn graceful_shutdown_releases_leases<B: Backend>() {
    let db = db().await;
    let admin = support::admin(&db).await;
    let a = B::leases(&B::build(&db, &Settings::new("shut-a", 3)));
    let b = B::leases(&B::build(&db, &Settings::new("shut-b", 3)));
    B::install(&a).await.unwrap();
    let started = Arc::new(AtomicBool::new(false));
    let dropped = Arc::new(AtomicBool::new(false));
    struct Flag(Arc<AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let daily_ran = Arc::new(AtomicBool::new(false));
    let (st, dr, daily) = (started.clone(), dropped.clone(), daily_ran.clone());
    let scheduler = B::schedule_node(
        &a,
        "n1",
        vec![
            // Runs once a day and is quick: its period is done once it ran.
            Job::every("daily", Duration::from_secs(24 * 3600), move |_| {
                let daily = daily.clone();
                async move { daily.store(true, Ordering::SeqCst) }
            }),
            // Still running at shutdown.
            Job::every("long", S, move |_| {
                let (st, flag) = (st.clone(), Flag(dr.clone()));
                async move {
                    let _flag = flag;
                    st.store(true, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_secs(60)).await;
                }
            }),
        ],
    )
    .unwrap();
    eventually(5 * S, "both jobs started", || async {
        started.load(Ordering::SeqCst) && daily_ran.load(Ordering::SeqCst)
    })
    .await;
    assert!(
        B::acquire(&b, "long", &LeaseOptions::new(S), None)
            .await
            .unwrap()
            .is_none(),
        "held while running"
    );

    let t = Instant::now();
    scheduler.shutdown(Duration::from_millis(200)).await;
    // The long job sleeps a minute: a shutdown that waited for it instead
    // of dropping it after its 200 ms grace would take that long. Half of
    // it is the bound.
    assert!(t.elapsed() < 30 * S, "shutdown took {:?}", t.elapsed());
    assert!(
        dropped.load(Ordering::SeqCst),
        "the long job was dropped after its grace"
    );
    // The interrupted run keeps its period: released at shutdown (no
    // holder), but nobody runs it again before the next period.
    let (holder, held_until, period_kept): (String, String, bool) = {
        let r = admin
            .query_typed_one(
                "SELECT holder, held_until::text,
                        held_until >= date_trunc('second', taken_at) + interval '1 second'
                   FROM pgwarden_leases WHERE name = 'long'",
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    assert_eq!(holder, "", "released at shutdown");
    assert!(
        period_kept,
        "the hold until the end of the run's period stays"
    );
    // Nobody takes it before that hold ends: an acquisition that gets it
    // was taken at or after `held_until` by the server's clock (the period
    // is a second: on a loaded machine it may end between the read above
    // and this acquisition, which a `held_until > now()` read first could
    // not tell from a broken hold).
    if let Some(early) = B::acquire(&b, "long", &LeaseOptions::new(S), None)
        .await
        .unwrap()
    {
        let after: bool = admin
            .query_typed_one(
                "SELECT taken_at >= $1::text::timestamptz FROM pgwarden_leases WHERE name = 'long'",
                &[(&held_until, tokio_postgres::types::Type::TEXT)],
            )
            .await
            .unwrap()
            .get(0);
        assert!(
            after,
            "the interrupted run's period is kept (taken before {held_until})"
        );
        B::release(early).await.unwrap();
    }
    // The next period is free.
    let long = B::acquire(&b, "long", &LeaseOptions::new(S), Some(3 * S))
        .await
        .unwrap();
    assert!(long.is_some(), "free in the next period");
    // The completed daily run keeps its period: nobody reruns it today.
    assert!(B::acquire(&b, "daily", &LeaseOptions::new(S), None)
        .await
        .unwrap()
        .is_none());
}

backends!(polls_are_jittered);
async fn polls_are_jittered<B: Backend>() {
    let db = db().await;
    let leases = B::leases(&B::build(&db, &Settings::new("jitter", 3)));
    B::install(&leases).await.unwrap();
    // When, within its period, each run took its lease (database clock).
    let offsets: Arc<parking_lot::Mutex<Vec<f64>>> = Arc::default();
    let log = offsets.clone();
    let spread = Job::every("spread", S, move |lease: LeaseHandle| {
        let t = lease.term().taken_at.duration_since(UNIX_EPOCH).unwrap();
        log.lock().push(t.as_secs_f64().fract());
        std::future::ready(())
    });
    // Capped at period / 4: 250 ms.
    let jitter = Some(Duration::from_millis(400));
    let s = B::schedule_jittered(&leases, "n1", jitter, vec![spread]).unwrap();
    eventually(10 * S, "seven runs", || async { offsets.lock().len() >= 7 }).await;
    s.shutdown(10 * S).await;
    // The first run came at start-up, not at a boundary.
    let offsets: Vec<f64> = offsets.lock()[1..].to_vec();
    eprintln!("offsets into the period: {offsets:?}");
    // Uniform in [0, 250 ms) past the boundary: six runs all within the
    // first 40 ms would happen once in 60,000 tries. The upper bound leaves
    // room for a loaded machine.
    assert!(offsets.iter().any(|&o| o > 0.04), "{offsets:?}");
    assert!(offsets.iter().all(|&o| o < 0.6), "{offsets:?}");
}

backends!(a_run_past_the_boundary_is_followed_at_once_in_the_period_it_ends_in);
/// A run still going at the boundary keeps its lease; the period it ends in
/// gets its run once it ends (the holder asks again at once), and that run
/// belongs to that period. So a slow run can end inside the next period's
/// run's period: what counts is when each term began. Periods of 2 s, the
/// first run ending 300 ms into the second: a loaded machine has 1.7 s to
/// wake the job and ask again within that period (a 1 s period left it
/// 700 ms, and a 500 ms bound on the asking).
async fn a_run_past_the_boundary_is_followed_at_once_in_the_period_it_ends_in<B: Backend>() {
    let db = db().await;
    // (slot of the term, when the term began, when the run ended).
    type Spans = Arc<parking_lot::Mutex<Vec<(i64, f64, f64)>>>;
    let spans: Spans = Arc::default();
    const P: Duration = Duration::from_secs(2);
    let p = P.as_secs_f64();
    let mut schedulers = Vec::new();
    for (i, name) in OVERRUN.into_iter().enumerate() {
        let leases = B::leases(&B::build(&db, &Settings::new(name, 3)));
        B::install(&leases).await.unwrap();
        let log = spans.clone();
        let slow = Job::every("slow", P, move |lease: LeaseHandle| {
            let log = log.clone();
            async move {
                let taken = lease.term().taken_at;
                let began = taken.duration_since(UNIX_EPOCH).unwrap().as_secs_f64();
                let first = log.lock().is_empty();
                if first {
                    // The first run ends 300 ms into the next period
                    // (the database and this process share a clock).
                    let end =
                        UNIX_EPOCH + Duration::from_secs_f64(((began / p).floor() + 1.0) * p + 0.3);
                    let left = end.duration_since(std::time::SystemTime::now());
                    tokio::time::sleep(left.unwrap_or_default()).await;
                }
                let ended = std::time::SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap()
                    .as_secs_f64();
                log.lock().push((slot_of(&lease, P), began, ended));
            }
        });
        let s = B::schedule_node(&leases, &format!("n{i}"), vec![slow]).unwrap();
        schedulers.push(s);
    }
    eventually(20 * S, "three runs", || async { spans.lock().len() >= 3 }).await;
    for s in schedulers {
        s.shutdown(10 * S).await;
    }
    let spans = spans.lock().clone();
    eprintln!("runs (slot, term began, run ended): {spans:?}");
    let (slot0, _, end0) = spans[0];
    let (slot1, began1, _) = spans[1];
    assert_eq!(
        (end0 / p).floor() as i64,
        slot0 + 1,
        "the first run ended in the next period"
    );
    // Asked again at once: the run came in the period the first run ended
    // in (0.3 s into it), not at a later boundary. No bound in seconds
    // beyond that: at a load average of 26, with three variants at once,
    // the next term began 0.64 s after the first run's end (the bound was
    // 0.5 s), still in that period.
    assert_eq!(
        slot1,
        slot0 + 1,
        "the period the first run ended in got its run ({:.3} s after it ended)",
        began1 - end0
    );
    assert!(
        began1 >= end0 - 0.005,
        "the second term began before the first run ended"
    );
    // "At once" is the period's own bound (checked above): how long the
    // asking took on this machine is reported, not asserted.
    eprintln!(
        "the next run began {:.3} s after the first ended",
        began1 - end0
    );
    let slots: std::collections::BTreeSet<i64> = spans.iter().map(|s| s.0).collect();
    assert_eq!(
        slots.len(),
        spans.len(),
        "two terms in one period: {spans:?}"
    );
}
