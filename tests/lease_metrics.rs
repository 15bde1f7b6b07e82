//! Lease metrics, checked with a local debugging recorder after scripted
//! events (acquire, skip, renew, lose, take over, release).

mod support;

use std::collections::HashMap;
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use pgwarden::metrics as m;
use pgwarden::{Leases, LostReason};
use support::leases::pool;
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
            let set_gauge = ck.key().name() == m::LEASE_RENEW_INTERVAL;
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

#[test]
fn lease_events_are_recorded() {
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    // A current-thread runtime inside the local recorder: the renewer task
    // runs on this thread and records there too.
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(scenario(&snap, &mut Totals::default()));
    });
}

async fn scenario(snap: &Snapshotter, totals: &mut Totals) {
    let db = db().await;
    let admin = admin(&db).await;
    let pool_a = pool(&db, 2, "mx");
    let a = Leases::new(&pool_a);
    let b = Leases::new(&pool(&db, 2, "mx"));
    let held = a.try_acquire("cleanup", S).await.unwrap().unwrap();
    assert!(b.try_acquire("cleanup", S).await.unwrap().is_none());
    let renewed = a.stats().renewed;
    eventually(3 * S, "two renewals", || async {
        a.stats().renewed >= renewed + 2
    })
    .await;

    let s = totals.read(snap);
    assert_eq!(
        counter(
            s,
            &format!("{}{{lease=cleanup,pool=mx}}", m::LEASE_ACQUIRED)
        ),
        1
    );
    assert_eq!(
        counter(s, &format!("{}{{lease=cleanup,pool=mx}}", m::LEASE_SKIPPED)),
        1
    );
    assert_eq!(gauge(s, &format!("{}{{pool=mx}}", m::LEASES_HELD)), 1.0);
    assert!(counter(s, &format!("{}{{pool=mx,result=ok}}", m::LEASE_RENEWALS)) >= 2);
    assert_eq!(
        gauge(s, &format!("{}{{pool=mx}}", m::LEASE_RENEW_INTERVAL)),
        0.25
    );
    match s.get(&format!("{}{{pool=mx}}", m::LEASE_RENEWAL_DURATION)) {
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
            &format!("{}{{lease=cleanup,pool=mx,reason=taken}}", m::LEASE_LOST)
        ),
        1
    );
    assert_eq!(
        counter(s, &format!("{}{{pool=mx,result=lost}}", m::LEASE_RENEWALS)),
        1
    );
    assert_eq!(gauge(s, &format!("{}{{pool=mx}}", m::LEASES_HELD)), 0.0);
    drop(held);

    // A crashed holder's lease is taken over after its TTL.
    let crashed = a.try_acquire("alerts", S).await.unwrap().unwrap();
    pool_a.close();
    let taken = b.acquire("alerts", S, 5 * S).await.unwrap();
    assert_eq!(
        within(3 * S, "lost", crashed.lost()).await,
        LostReason::Deadline
    );
    let s = totals.read(snap);
    assert_eq!(
        counter(
            s,
            &format!("{}{{lease=alerts,pool=mx}}", m::LEASE_TAKEOVERS)
        ),
        1
    );
    assert_eq!(
        counter(
            s,
            &format!("{}{{lease=alerts,pool=mx,reason=deadline}}", m::LEASE_LOST)
        ),
        1
    );
    assert!(counter(s, &format!("{}{{pool=mx,result=error}}", m::LEASE_RENEWALS)) >= 1);
    assert_eq!(gauge(s, &format!("{}{{pool=mx}}", m::LEASES_HELD)), 1.0);
    taken.release().await.unwrap();
    drop(crashed);
    let s = totals.read(snap);
    assert_eq!(gauge(s, &format!("{}{{pool=mx}}", m::LEASES_HELD)), 0.0);
}
