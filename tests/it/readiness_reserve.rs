//! The readiness reserve nothing else can take, against a real PostgreSQL:
//! a lease holder of another instance paused inside its fenced transaction
//! for 5 s (two and a half TTLs of this instance's own leases), three
//! contenders on this instance polling its lease (each
//! acquisition blocks on the holder's row lock), request traffic filling the
//! request lane. The probe answers every time, and this instance's own
//! leases are renewed, not lost. On every backend: the scenario is the
//! benchmark's (`benches/workloads/paused_holder.rs`), generic over
//! [`Backend`].

#[path = "../../benches/workloads/paused_holder.rs"]
#[allow(dead_code)]
mod paused_holder;

use crate::support::backend::Backend;
use pgwarden_testing::TestServer;

backends!(
    readiness_and_renewals_hold_while_acquisitions_block_on_a_paused_holder,
    flavor = "multi_thread",
    worker_threads = 2
);
async fn readiness_and_renewals_hold_while_acquisitions_block_on_a_paused_holder<B: Backend>() {
    let db = TestServer::shared()
        .expect("throwaway PostgreSQL")
        .create_database()
        .await
        .expect("fresh database");
    // The benchmark's 10 s hold, halved: 5 s still outlasts the own leases'
    // TTL (2 s) twice over, so a renewal held up by the blocked
    // acquisitions would lose them.
    let s = paused_holder::Setup {
        hold: std::time::Duration::from_secs(5),
        ..paused_holder::Setup::default()
    };
    let o = paused_holder::run::<B>(&db, s).await.unwrap();
    eprintln!(
        "{}: probes {}/{} ok, p50 {:?}, p99 {:?}, max {:?}; own leases lost {}, renewed {} \
         ({} failed statements); acquisitions {} ({} errors); requests {}",
        B::NAME,
        o.probes_ok,
        o.probes.len(),
        o.probe_percentile(50.0),
        o.probe_percentile(99.0),
        o.probe_percentile(100.0),
        o.own_lost,
        o.renewed,
        o.renewal_failures,
        o.attempts,
        o.attempt_errors,
        o.requests,
    );
    // One probe every 100 ms for 5 s (fewer when a probe runs long).
    assert!(o.probes.len() >= 25, "{} probes", o.probes.len());
    assert_eq!(o.probes_ok, o.probes.len(), "every probe answered");
    assert!(o.probe_percentile(100.0) < s.probe_bound);
    assert_eq!(o.own_lost, 0, "own leases lost");
    // Three leases renewed every 500 ms for 5 s: about 30 renewals.
    assert!(o.renewed >= 15, "{} renewals", o.renewed);
    // The scenario did what it says: acquisitions were attempted and the
    // request lane was busy.
    assert!(o.attempts >= 1 && o.requests >= 100, "{o:?}");
}
