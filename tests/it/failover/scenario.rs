//! The failover scenario, run once per test binary and backend (every
//! backend at once on one cluster, `together.rs`) and observed by several
//! tests: two service instances on a synchronous primary/replica pair, under
//! request traffic, fenced writers and a scheduled job, holding a long and a
//! short lease and a session advisory lock; the primary crashes
//! (`pg_ctl stop -m immediate`), the short lease's deadline passes, the
//! replica is promoted, and the service finds it on its own.
//!
//! The scenario records what it sees ([`Outcome`], in `outcome.rs`) and asserts only what
//! it needs to go on; the tests assert the rest.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgwarden::{Lane, LeaseOptions, LockKey};
use pgwarden_testing::within;
use tokio_postgres::Client;

use super::common::{
    database, fenced_rows, fenced_write, sequence, service_pool, until, Front, Row, Tokens, STEP,
};
use super::outcome::Outcome;
use super::together::{Seat, Step};
use super::traffic::{self, Acked, Request};
use crate::support::backend::Backend;

/// The key of the session lock held across the failover.
const KEY: i64 = 0x5EED_F00D;
/// How long the scenario waits for anything to come back after promotion.
const RECOVERY: Duration = Duration::from_secs(20);

async fn lease_rows(c: &Client) -> Vec<(String, String, i64)> {
    c.query(
        "SELECT name, holder, token FROM pgwarden_leases ORDER BY name",
        &[],
    )
    .await
    .expect("lease rows")
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

async fn expiry(c: &Client, name: &str) -> f64 {
    c.query_one(
        "SELECT extract(epoch FROM expires_at)::float8 FROM pgwarden_leases WHERE name = $1",
        &[&name],
    )
    .await
    .expect("expires_at")
    .get(0)
}

/// The scenario on backend `B`, in a database of its own on the shared
/// (synchronous) cluster.
pub async fn run<B: Backend>(seat: &Seat) -> Outcome {
    let (db, old) = database(seat).await;

    // Two service instances, each on the service's way to the primary.
    let cluster = seat.cluster().await;
    let front = Front::new(&cluster);
    let svc = service_pool::<B>(&front, &cluster, &db, "svc-a", 8);
    let other = service_pool::<B>(&front, &cluster, &db, "svc-b", 4);
    drop(cluster);
    let leases = B::leases(&svc);
    let other_leases = B::leases(&other);
    B::install(&leases).await.expect("lease table");

    let stop = Arc::new(AtomicBool::new(false));
    let tokens = Tokens::default();
    let acked: Acked = Arc::default();
    let requests: Arc<Mutex<Vec<Request>>> = Arc::default();
    let mut tasks = traffic::requests::<B>(&svc, 4, &stop, &requests);
    for (l, p) in [(&leases, &svc), (&other_leases, &other)] {
        let w = traffic::writer::<B>(
            l.clone(),
            p.clone(),
            stop.clone(),
            tokens.clone(),
            acked.clone(),
        );
        tasks.push(w);
    }
    let schedulers = [
        traffic::scheduler::<B>(&leases, &svc, &tokens, &acked),
        traffic::scheduler::<B>(&other_leases, &other, &tokens, &acked),
    ];

    // The long lease outlives the outage; the short one does not.
    let long_opts =
        LeaseOptions::new(Duration::from_secs(60)).renew_every(Duration::from_millis(250));
    let long = B::acquire(&leases, "long", &long_opts, None)
        .await
        .unwrap()
        .expect("long lease");
    let short_opts = LeaseOptions::new(Duration::from_secs(2));
    let short = B::acquire(&leases, "short", &short_opts, None)
        .await
        .unwrap()
        .expect("short lease");
    tokens.record(long.term().token, "long");
    tokens.record(short.term().token, "short");
    let long_id = (long.term().holder.clone(), long.term().token);
    let short_id = (short.term().holder.clone(), short.term().token);
    let lock = B::session_lock(
        &svc,
        LockKey::Single(KEY),
        pgwarden::LockMode::Exclusive,
        None,
    )
    .await
    .unwrap()
    .expect("session lock");

    // Warm-up: the job ran, writers wrote under several terms, requests flow.
    let warm = until(Duration::from_secs(30), || async {
        let (terms, writer_terms) = {
            let acked = acked.lock().unwrap();
            let terms: BTreeSet<i64> = acked.iter().map(|(_, r)| r.token).collect();
            // The writers' own (`fenced_writes_never_interleave…` wants two
            // writer terms before the promotion: the job's terms counted
            // here too once made up the four with one writer term, on a
            // loaded machine).
            let writer_terms: BTreeSet<i64> = acked
                .iter()
                .filter(|(_, r)| r.lease == traffic::WRITER_LEASE)
                .map(|(_, r)| r.token)
                .collect();
            (terms, writer_terms)
        };
        let ok = requests
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, r)| r.is_ok())
            .count();
        tokens.count("job") >= 2 && terms.len() >= 4 && writer_terms.len() >= 2 && ok >= 20
    })
    .await;
    assert!(
        warm.is_some(),
        "no warm-up: job, writers or requests did not run"
    );
    // The last look at the old primary, taken while a writer holds its
    // lease: the writers' row exists only while a term holds it (a release
    // with no acquisition in flight deletes it), and a look between two
    // terms would miss it.
    let look: Mutex<Vec<(String, String, i64)>> = Mutex::default();
    let writer_held = until(STEP, || async {
        let rows = lease_rows(&old).await;
        let held = rows
            .iter()
            .any(|(n, h, _)| n == traffic::WRITER_LEASE && !h.is_empty());
        *look.lock().unwrap() = rows;
        held
    })
    .await;
    let rows_before = look.into_inner().unwrap();
    assert!(
        writer_held.is_some(),
        "no writer held its lease: {rows_before:?}"
    );
    let seq_primary_before_crash = sequence(&old).await;
    let replica = seat.cluster().await.replica().connect(&db).await;
    let replica = replica.expect("replica");

    // ---- the crash (once every backend's run is here) ----
    let crash = seat.step(Step::Crash).await;
    let (crashed_at, stopped_at) = (crash.started, crash.finished);
    let short_lost = tokio::time::timeout(STEP * 2, short.lost()).await.ok();
    let short_lost_after_crash = short_lost.map(|_| crashed_at.elapsed());
    // The instant `lost()` fires (the test's own wake-up comes later on a
    // loaded machine), past the moment the server was down.
    let short_deadline_past_stop = short.deadline().saturating_duration_since(stopped_at);
    let seq_replica_before_promotion = sequence(&replica).await;

    // ---- the promotion (once every backend's run is here) ----
    let promotion = seat.step(Step::Promote).await;
    let (promote_call, promoted) = (promotion.started, promotion.finished);
    let promote_took = promoted - promote_call;
    let cluster = seat.cluster().await;
    front.follow(&cluster);
    let (old_port, new_port) = (cluster.replica().port(), cluster.primary().port());
    let new = cluster.primary().connect(&db).await.expect("new primary");
    drop(cluster);
    let rows_at_promotion = lease_rows(&new).await;
    let long_expiry_at_promotion = expiry(&new, "long").await;

    // ---- what comes back by itself ----
    until(RECOVERY, || async {
        requests
            .lock()
            .unwrap()
            .iter()
            .any(|(at, r)| *at >= promote_call && r.is_ok())
    })
    .await;
    let long_renewed = until(RECOVERY, || async {
        expiry(&new, "long").await > long_expiry_at_promotion
    })
    .await;
    let long_fenced_write_after = fenced_write::<B>(&svc, &long, 0).await;
    until(RECOVERY, || async {
        tokens.count_since("job", promoted) >= 1
    })
    .await;
    // Five writes after the promotion, one at least under a term taken
    // after it (a token above every token handed out before the promotion
    // call): a term that spans the failover writes up to five rows by
    // itself, and on a loaded machine it once wrote them all before any new
    // term began ("writer terms 9 before, 0 after", sqlx 0.8).
    until(RECOVERY, || async {
        let max_before = tokens.split(promote_call).0.into_iter().max().unwrap_or(0);
        let acked = acked.lock().unwrap();
        let after = acked
            .iter()
            .filter(|(at, r)| *at >= promoted && r.lease == traffic::WRITER_LEASE);
        after.clone().count() >= 5 && after.clone().any(|(_, r)| r.token > max_before)
    })
    .await;
    let short_takeover = match B::acquire(&other_leases, "short", &short_opts, Some(STEP * 2)).await
    {
        Ok(Some(l)) => {
            tokens.record(l.term().token, "takeover");
            let t = (l.term().token, l.term().took_over_from.clone());
            let _ = B::release(l).await;
            Some(t)
        }
        Ok(None) | Err(_) => None,
    };

    // ---- the session lock held at the crash ----
    // pg_locks shows a bigint key as (high 32 bits, low 32 bits, 1); an
    // advisory lock is per database (the other backends' runs use the key
    // in theirs).
    let (classid, objid, objsubid) = ((KEY >> 32) as u32, KEY as u32, 1_i16);
    let lock_rows_on_new_primary: i64 = new
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
              AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
              AND classid = $1 AND objid = $2 AND objsubid = $3",
            &[&classid, &objid, &objsubid],
        )
        .await
        .unwrap()
        .get(0);
    let lock_free_on_new_primary: bool = new
        .query_one("SELECT pg_try_advisory_lock($1)", &[&KEY])
        .await
        .unwrap()
        .get(0);
    new.query_one("SELECT pg_advisory_unlock_all()", &[])
        .await
        .unwrap();
    let unlock = within(STEP, "unlock", B::unlock(lock)).await;
    let unlock_was_closed_connection = matches!(&unlock, Err(e) if B::is_connection_lost(e));
    let session_lane_emptied = until(STEP, || async {
        B::status(&svc).lane(Lane::SessionLock).in_use == 0
    })
    .await
    .is_some();

    // ---- stop the load, collect ----
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        within(STEP * 2, "traffic task", t)
            .await
            .expect("traffic task");
    }
    for s in schedulers {
        within(STEP * 3, "scheduler shutdown", s.shutdown(STEP)).await;
    }
    let long_lost = futures_util::FutureExt::now_or_never(long.lost());
    let long_release = B::release(long).await.map_err(|e| e.to_string());
    drop(short);
    let seq_cache: i64 = new
        .query_one(
            "SELECT cache_size FROM pg_sequences WHERE sequencename = 'pgwarden_leases_token_seq'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let fenced = fenced_rows(&new).await;
    let (tokens_before, tokens_after) = tokens.split(promote_call);
    let requests = std::mem::take(&mut *requests.lock().unwrap());
    let acked = std::mem::take(&mut *acked.lock().unwrap());
    let first_served = requests
        .iter()
        .filter(|(at, r)| *at >= promote_call && r.is_ok())
        .map(|(at, _)| *at)
        .min();
    let ports = |f: &dyn Fn(Instant) -> bool| -> BTreeSet<u16> {
        requests
            .iter()
            .filter(|(at, _)| f(*at))
            .filter_map(|(_, r)| r.as_ref().ok().copied())
            .collect()
    };
    let pick = |f: &dyn Fn(Instant) -> bool| -> Vec<Row> {
        acked
            .iter()
            .filter(|(at, _)| f(*at))
            .map(|(_, r)| r.clone())
            .collect()
    };
    Outcome {
        old_port,
        new_port,
        promote_took,
        outage: promoted - crashed_at,
        served_after_promote_call: first_served.map(|t| t - promote_call),
        ports_before: ports(&|at| at < crashed_at),
        ports_after: ports(&|at| at >= promote_call),
        requests_ok: requests.iter().filter(|(_, r)| r.is_ok()).count(),
        requests_failed: requests.iter().filter(|(_, r)| r.is_err()).count(),
        rows_before,
        rows_at_promotion,
        long: long_id,
        long_lost,
        long_renewed_after_promotion: long_renewed.map(|t| t - promoted),
        long_fenced_write_after,
        long_release,
        short: short_id,
        short_lost,
        short_lost_after_crash,
        short_deadline_past_stop,
        short_takeover,
        seq_primary_before_crash,
        seq_replica_before_promotion,
        seq_cache,
        tokens_before,
        tokens_after,
        job_runs_after: tokens.count_since("job", promoted),
        fenced,
        acked_before_crash: pick(&|at| at < crashed_at),
        acked_after_promotion: pick(&|at| at >= promoted),
        lock_rows_on_new_primary,
        lock_free_on_new_primary,
        unlock: unlock.map_err(|e| format!("{e:?}: {e}")),
        unlock_was_closed_connection,
        session_lane_emptied,
    }
}
