//! Lease metrics, checked with a local debugging recorder after scripted
//! events (acquire, skip, renew, lose, take over, release), and their
//! labels bounded, counted on the Prometheus exporter's own output. On
//! every backend, from one source.

use crate::support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use pgwarden::{LeaseOptions, LostReason};
use support::backend::{Backend, LeaseSettings, Settings};
use support::recorder::{counter, gauge, key_of};
use support::{admin, db, eventually, within};

const S: Duration = Duration::from_secs(1);

/// Everything recorded so far: name{label=value,...} -> value, labels
/// sorted. A debugging snapshot resets what it reads (counters and gauges to
/// zero, histograms drained), so readings are summed here, except for the
/// gauges pgwarden sets (the renewal interval), which keep their last value.
#[derive(Default)]
struct Totals(HashMap<String, DebugValue>);

impl Totals {
    fn read(&mut self, s: &Snapshotter) -> &HashMap<String, DebugValue> {
        for (ck, _, _, v) in s.snapshot().into_vec() {
            let k = key_of(ck.key());
            let set_gauge = ck.key().name() == "pgwarden_lease_renew_interval_seconds";
            let merged = match (self.0.remove(&k), v) {
                (Some(DebugValue::Counter(a)), DebugValue::Counter(b)) => {
                    DebugValue::Counter(a + b)
                }
                (Some(DebugValue::Gauge(a)), DebugValue::Gauge(b)) if !set_gauge => {
                    DebugValue::Gauge((a.into_inner() + b.into_inner()).into())
                }
                (Some(DebugValue::Histogram(mut a)), DebugValue::Histogram(b)) => {
                    a.extend(b);
                    DebugValue::Histogram(a)
                }
                (_, v) => v,
            };
            self.0.insert(k, merged);
        }
        &self.0
    }
}

backends!(sync, lease_events_are_recorded);
fn lease_events_are_recorded<B: Backend>() {
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    // A current-thread runtime inside the local recorder: the renewer task
    // runs on this thread and records there too.
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(scenario::<B>(&snap, &mut Totals::default()));
    });
}

async fn scenario<B: Backend>(snap: &Snapshotter, totals: &mut Totals) {
    let db = db().await;
    let admin = admin(&db).await;
    // Both instances' pools are named `mx-<backend>`.
    let settings = Settings::new("mx", 2);
    let mx = settings.pool_name::<B>();
    let pool_a = B::build(&db, &settings);
    // Declared names are labels of their own.
    let declared = LeaseSettings::default().declare(&["cleanup", "alerts"]);
    let a = B::leases_with(&pool_a, &declared).unwrap();
    let b = B::leases_with(&B::build(&db, &settings), &declared).unwrap();
    let held = B::acquire(&a, "cleanup", &LeaseOptions::new(S), None)
        .await
        .unwrap()
        .unwrap();
    assert!(B::acquire(&b, "cleanup", &LeaseOptions::new(S), None)
        .await
        .unwrap()
        .is_none());
    let renewed = B::lease_stats(&a).renewed;
    eventually(3 * S, "two renewals", || async {
        B::lease_stats(&a).renewed >= renewed + 2
    })
    .await;

    let s = totals.read(snap);
    assert_eq!(
        counter(
            s,
            &format!(
                "{}{{lease=cleanup,pool={mx}}}",
                "pgwarden_lease_acquired_total"
            )
        ),
        1
    );
    assert_eq!(
        counter(
            s,
            &format!(
                "{}{{lease=cleanup,pool={mx}}}",
                "pgwarden_lease_skipped_total"
            )
        ),
        1
    );
    assert_eq!(
        gauge(s, &format!("{}{{pool={mx}}}", "pgwarden_leases_held")),
        1.0
    );
    assert!(
        counter(
            s,
            &format!("{}{{pool={mx},result=ok}}", "pgwarden_lease_renewals_total")
        ) >= 2
    );
    assert_eq!(
        gauge(
            s,
            &format!("{}{{pool={mx}}}", "pgwarden_lease_renew_interval_seconds")
        ),
        0.25
    );
    match s.get(&format!(
        "{}{{pool={mx}}}",
        "pgwarden_lease_renewal_duration_seconds"
    )) {
        Some(DebugValue::Histogram(v)) => assert!(v.len() >= 2),
        other => panic!("renewal duration: {other:?}"),
    }

    // Another holder takes the row: the next renewal touches nothing.
    admin
        .batch_execute("UPDATE pgwarden_leases SET holder = 'thief', token = 0")
        .await
        .unwrap();
    assert_eq!(within(3 * S, "lost", held.lost()).await, LostReason::Taken);
    let s = totals.read(snap);
    assert_eq!(
        counter(
            s,
            &format!(
                "{}{{lease=cleanup,pool={mx},reason=taken}}",
                "pgwarden_lease_lost_total"
            )
        ),
        1
    );
    assert_eq!(
        counter(
            s,
            &format!(
                "{}{{pool={mx},result=lost}}",
                "pgwarden_lease_renewals_total"
            )
        ),
        1
    );
    assert_eq!(
        gauge(s, &format!("{}{{pool={mx}}}", "pgwarden_leases_held")),
        0.0
    );
    drop(held);

    // A crashed holder's lease is taken over after its TTL.
    let crashed = B::acquire(&a, "alerts", &LeaseOptions::new(S), None)
        .await
        .unwrap()
        .unwrap();
    B::close(&pool_a).await;
    let taken = B::acquire(&b, "alerts", &LeaseOptions::new(S), Some(5 * S))
        .await
        .unwrap()
        .expect("taken within the wait");
    assert_eq!(
        within(3 * S, "lost", crashed.lost()).await,
        LostReason::Deadline
    );
    let s = totals.read(snap);
    assert_eq!(
        counter(
            s,
            &format!(
                "{}{{lease=alerts,pool={mx}}}",
                "pgwarden_lease_takeovers_total"
            )
        ),
        1
    );
    assert_eq!(
        counter(
            s,
            &format!(
                "{}{{lease=alerts,pool={mx},reason=deadline}}",
                "pgwarden_lease_lost_total"
            )
        ),
        1
    );
    assert!(
        counter(
            s,
            &format!(
                "{}{{pool={mx},result=error}}",
                "pgwarden_lease_renewals_total"
            )
        ) >= 1
    );
    assert_eq!(
        gauge(s, &format!("{}{{pool={mx}}}", "pgwarden_leases_held")),
        1.0
    );
    B::release(taken).await.unwrap();
    drop(crashed);
    let s = totals.read(snap);
    assert_eq!(
        gauge(s, &format!("{}{{pool={mx}}}", "pgwarden_leases_held")),
        0.0
    );

    // An undeclared name counts under the one fixed label.
    let other = B::acquire(&b, "user-1234", &LeaseOptions::new(S), None)
        .await
        .unwrap()
        .unwrap();
    B::release(other).await.unwrap();
    let s = totals.read(snap);
    assert_eq!(
        counter(
            s,
            &format!(
                "{}{{lease=_other,pool={mx}}}",
                "pgwarden_lease_acquired_total"
            )
        ),
        1
    );
    assert!(!s.keys().any(|k| k.contains("user-1234")));
}

/// The series of each lease metric in an exposition: `name{labels}` lines
/// (histogram buckets, sums and counts fold into their metric).
fn series(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with("pgwarden_lease")) {
        let (name, rest) = line.split_once('{').unwrap_or((line, ""));
        let labels = rest.rsplit_once('}').map_or("", |(l, _)| l);
        let labels: Vec<&str> = labels
            .split(',')
            .filter(|l| !l.starts_with("le="))
            .collect();
        let name = name
            .trim_end_matches("_bucket")
            .trim_end_matches("_sum")
            .trim_end_matches("_count");
        out.entry(name.split_whitespace().next().unwrap().to_owned())
            .or_default()
            .insert(labels.join(","));
    }
    out
}

backends!(
    sync,
    two_thousand_dynamic_names_make_at_most_declared_plus_one_series
);
fn two_thousand_dynamic_names_make_at_most_declared_plus_one_series<B: Backend>() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let db = db().await;
            let pool = B::build(&db, &Settings::new("labels", 8));
            let declared = LeaseSettings::default().declare(&["cleanup"]);
            let leases = B::leases_with(&pool, &declared).unwrap();
            let other = B::leases(&pool);
            let ran = Arc::new(AtomicBool::new(false));
            let flag = ran.clone();
            let uptime = pgwarden::Job::per_node("uptime", S, move |_| {
                let flag = flag.clone();
                async move { flag.store(true, Ordering::SeqCst) }
            });
            let scheduler = B::schedule_node(&leases, "host-7f3a", vec![uptime]).unwrap();
            let cleanup = B::acquire(&leases, "cleanup", &LeaseOptions::new(S), None)
                .await
                .unwrap()
                .unwrap();
            let before = handle.render().len();
            // 2,000 names made at run time: taken, skipped, released (10,000
            // before the test ran on three backends at once: 6 s each alone,
            // 20 s each together; 2,000 show the same bound).
            let t = std::time::Instant::now();
            let tasks: Vec<_> = (0..16)
                .map(|task| {
                    let (leases, other) = (leases.clone(), other.clone());
                    tokio::spawn(async move {
                        for i in (task..2_000).step_by(16) {
                            let name = format!("user-{i}");
                            let lease = B::acquire(&leases, &name, &LeaseOptions::new(S), None)
                                .await
                                .unwrap()
                                .unwrap();
                            assert!(B::acquire(&other, &name, &LeaseOptions::new(S), None)
                                .await
                                .unwrap()
                                .is_none());
                            B::release(lease).await.unwrap();
                        }
                    })
                })
                .collect();
            for task in tasks {
                task.await.unwrap();
            }
            eventually(5 * S, "the per-node job ran", || async {
                ran.load(Ordering::SeqCst)
            })
            .await;
            scheduler.shutdown(10 * S).await;
            B::release(cleanup).await.unwrap();
            let text = handle.render();
            let all = series(&text);
            // The time is for the reader (the load, not a promise); the
            // bytes are asserted below.
            eprintln!(
                "2,000 dynamic names in {:?}: exposition {} -> {} bytes",
                t.elapsed(),
                before,
                text.len()
            );
            // Measured (10,000 names): 19,710 -> 19,888 bytes (larger counts, a few
            // `_other` values). Allowed: 8 KiB more, a few series and their
            // buckets; a series per dynamic name would add over 100 KiB.
            assert!(
                text.len() <= before + 8 * 1024,
                "the exposition grew from {before} to {} bytes",
                text.len()
            );
            // Declared: "cleanup" (builder) and "uptime" (the per-node job,
            // under its job name, never its host); everything else is "_other".
            for metric in [
                "pgwarden_lease_acquired_total",
                "pgwarden_lease_skipped_total",
            ] {
                let got = &all[metric];
                eprintln!("{metric}: {got:?}");
                assert!(got.len() <= 3, "{metric}: {got:?}");
                assert!(
                    got.iter().any(|l| l.contains("lease=\"_other\"")),
                    "{got:?}"
                );
            }
            // Every lease metric: at most declared + 1 values of `lease`
            // (other labels, such as `reason`, multiply by their own bounded
            // sets).
            for (metric, labels) in &all {
                let leases: BTreeSet<&str> = labels
                    .iter()
                    .flat_map(|l| l.split(','))
                    .filter(|l| l.starts_with("lease="))
                    .collect();
                assert!(leases.len() <= 3, "{metric}: {leases:?}");
            }
            let lost = &all["pgwarden_lease_lost_total"];
            // Five reasons: taken, deadline, expired, released, revoked.
            assert!(lost.len() <= 3 * 5, "{lost:?}");
            assert!(!text.contains("user-"), "no dynamic name in the exposition");
            assert!(!text.contains("host-7f3a"), "no host in the exposition");
            assert!(
                text.contains("lease=\"uptime\""),
                "the per-node job by job name"
            );
            assert!(text.len() < 64 * 1024, "{} bytes", text.len());
        });
    });
}
