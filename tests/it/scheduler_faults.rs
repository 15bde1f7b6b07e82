//! The scheduler survives its jobs, against a real PostgreSQL: a job that
//! panics runs again the next period (caught, logged, counted); a holder
//! that crashes mid-job (a process killed with SIGKILL) is not rerun in its
//! period and is taken over in the next; shutdown cancels an acquisition in
//! flight on the server; a release that fails once is retried at once. On
//! every backend, from one source.

use crate::support;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, UNIX_EPOCH};

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use pgwarden::{Job, LeaseHandle, LeaseOptions};
use support::backend::{named, pool_on, Backend, Settings};
use support::leases::{busy_backends, insert_expired, lock_rows};
use support::{admin, db, eventually, within};
use tokio_postgres::types::Type;

const S: Duration = Duration::from_secs(1);

/// Runs per job: (period, whether that run panicked).
type PanicLog = Arc<parking_lot::Mutex<BTreeMap<&'static str, Vec<(i64, bool)>>>>;
/// Runs: (period, the holder taken over from, token).
type RunLog = Arc<parking_lot::Mutex<Vec<(i64, Option<String>, i64)>>>;

fn slot_of(lease: &LeaseHandle, period: Duration) -> i64 {
    let t = lease.term().taken_at.duration_since(UNIX_EPOCH).unwrap();
    (t.as_secs_f64() / period.as_secs_f64()).floor() as i64
}

backends!(a_panicking_job_runs_again_next_period);
async fn a_panicking_job_runs_again_next_period<B: Backend>() {
    let db = db().await;
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let pool = B::build(&db, &Settings::new("panics", 3));
    let log: PanicLog = Arc::default();
    let job = |name: &'static str, in_future: bool| {
        let log = log.clone();
        Job::every(name, S, move |lease: LeaseHandle| {
            let mut log = log.lock();
            let runs = log.entry(name).or_default();
            let first = runs.is_empty();
            runs.push((slot_of(&lease, S), first));
            drop(log);
            if first && !in_future {
                panic!("{name}: boom while making the job");
            }
            async move {
                if first {
                    panic!("boom inside the job");
                }
            }
        })
    };
    let scheduler = metrics::with_local_recorder(&recorder, || {
        let leases = B::leases(&pool);
        let jobs = vec![job("boom-inside", true), job("boom-making", false)];
        B::schedule_node(&leases, "n1", jobs).unwrap()
    });
    eventually(6 * S, "three runs of each job", || async {
        let log = log.lock();
        log.len() == 2 && log.values().all(|runs| runs.len() >= 3)
    })
    .await;
    scheduler.shutdown(10 * S).await;
    for (name, runs) in log.lock().iter() {
        eprintln!("{name}: {runs:?}");
        // Once per period, the panicked one included: a panic is not rerun
        // within its period, and the job runs again in the next ones.
        let slots: Vec<i64> = runs.iter().map(|r| r.0).collect();
        assert!(slots.windows(2).all(|w| w[0] < w[1]), "{name}: {slots:?}");
        assert!(runs[0].1 && runs[1..].iter().all(|r| !r.1));
    }
    // Counted, per job.
    let panics: BTreeMap<String, u64> = snap
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(k, ..)| k.key().name() == "pgwarden_lease_job_panics_total")
        .map(|(k, _, _, v)| {
            let job = k
                .key()
                .labels()
                .find(|l| l.key() == "lease")
                .map(|l| l.value().to_owned())
                .unwrap();
            let DebugValue::Counter(n) = v else {
                panic!("{v:?}")
            };
            (job, n)
        })
        .collect();
    assert_eq!(
        panics,
        BTreeMap::from([("boom-inside".to_owned(), 1), ("boom-making".to_owned(), 1)])
    );
}

backends!(
    ignore_all = "the child process of a_holder_crashing_mid_job_is_not_rerun_in_its_period",
    crash_child
);
/// What the crashing child does: run "report" every 2 s with a TTL of 1 s,
/// record the run's start (on a connection of its own: the record is the
/// test's, not the backend's), and hang in it until it is killed.
async fn crash_child<B: Backend>() {
    let Ok(url) = std::env::var("PGWARDEN_CRASH_CHILD_URL") else {
        return;
    };
    let config: tokio_postgres::Config = url.parse().unwrap();
    let leases = B::leases(&pool_on::<B>(&config, "crash-child", 3).0);
    let report = Job::every("report", 2 * S, move |lease: LeaseHandle| {
        let config = config.clone();
        async move {
            let (conn, io) = config.connect(tokio_postgres::NoTls).await.unwrap();
            tokio::spawn(io);
            let (holder, token) = (lease.term().holder.clone(), lease.term().token);
            // The run's slot is its term's (`taken_at`), not the moment this
            // row lands: under load the insert can come in the next slot.
            let taken = lease.term().taken_at.duration_since(UNIX_EPOCH).unwrap();
            conn.query_typed(
                "INSERT INTO runs VALUES ('child', $1, $2, to_timestamp($3))",
                &[
                    (&holder, Type::TEXT),
                    (&token, Type::INT8),
                    (&taken.as_secs_f64(), Type::FLOAT8),
                ],
            )
            .await
            .unwrap();
            drop(conn);
            // The scenario: hung mid-job until the test kills us.
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
    })
    .options(LeaseOptions::new(S));
    let scheduler = B::schedule_node(&leases, "child", vec![report]).unwrap();
    // The scenario: alive until the test kills us (60 s at most if it never does).
    tokio::time::sleep(Duration::from_secs(60)).await;
    drop(scheduler);
}

backends!(a_holder_crashing_mid_job_is_not_rerun_in_its_period);
async fn a_holder_crashing_mid_job_is_not_rerun_in_its_period<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    admin
        .batch_execute(
            "CREATE TABLE runs (instance text, holder text, token bigint, at timestamptz)",
        )
        .await
        .unwrap();
    B::install(&B::leases(&B::build(&db, &Settings::new("crash-setup", 2))))
        .await
        .unwrap();
    // The child test's full name: its module path without the crate's name
    // and its backend's variant (`scheduler_faults::crash_child::deadpool`
    // in the `it` binary).
    let variant = match B::NAME {
        "sqlx08" => "sqlx_0_8",
        "sqlx09" => "sqlx_0_9",
        name => name,
    };
    let child_test = match module_path!().split_once("::") {
        Some((_, module)) => format!("{module}::crash_child::{variant}"),
        None => format!("crash_child::{variant}"),
    };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", &child_test, "--nocapture"])
        .env("PGWARDEN_CRASH_CHILD_URL", db.url())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = || async {
        admin
            .query_typed_opt(
                "SELECT holder, token, extract(epoch FROM at)::float8 FROM runs WHERE instance = 'child'",
                &[],
            )
            .await
            .unwrap()
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1), r.get::<_, f64>(2)))
    };
    eventually(30 * S, "the child's run started", || async {
        started().await.is_some()
    })
    .await;
    // Crash mid-job: no release, no clean-up.
    child.kill().unwrap();
    child.wait().unwrap();
    let (crashed, crashed_token, at) = started().await.unwrap();
    let crashed_slot = (at / 2.0).floor() as i64;

    // Another instance runs the same job from now on.
    let runs: RunLog = Arc::default();
    let log = runs.clone();
    let leases = B::leases(&B::build(&db, &Settings::new("crash-b", 3)));
    let report = Job::every("report", 2 * S, move |lease: LeaseHandle| {
        log.lock().push((
            slot_of(&lease, 2 * S),
            lease.term().took_over_from.clone(),
            lease.term().token,
        ));
        std::future::ready(())
    })
    .options(LeaseOptions::new(S));
    let b = B::schedule_node(&leases, "b", vec![report]).unwrap();
    eventually(8 * S, "B's first run", || async { !runs.lock().is_empty() }).await;
    b.shutdown(10 * S).await;
    let (slot, took_over_from, token) = runs.lock()[0].clone();
    eprintln!(
        "crashed in period {crashed_slot}; the next run in period {slot}, taken over from {took_over_from:?}"
    );
    // Not rerun in the crashed run's period; the next one takes the crashed
    // holder's expired term over, with a larger token.
    assert!(slot > crashed_slot, "{slot} vs {crashed_slot}");
    assert_eq!(took_over_from.as_deref(), Some(crashed.as_str()));
    assert!(token > crashed_token);
}

backends!(shutdown_cancels_an_acquisition_in_flight);
async fn shutdown_cancels_an_acquisition_in_flight<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let (pool, app) = named::<B>(&db, "shut-inflight", &Settings::new("shut-inflight", 3));
    let leases = B::leases(&pool);
    B::install(&leases).await.unwrap();
    // The job's lease: an expired term whose holder sits in a fenced
    // transaction, so the take-over waits on it.
    insert_expired(&admin, "stuck", "stale").await;
    let locker = lock_rows(&db, "pgwarden_leases", &["stuck"], "FOR KEY SHARE").await;
    let scheduler =
        B::schedule_node(&leases, "n1", vec![Job::every("stuck", S, |_| async {})]).unwrap();
    eventually(5 * S, "the attempt waits on the row", || async {
        busy_backends(&admin, &app).await.0 == 1
    })
    .await;
    let t = Instant::now();
    // Half the shutdown's own 10 s bound: a shutdown that waited for the
    // attempt instead of cancelling it would take all 10 s (the row stays
    // locked), so this tells the two apart on a loaded machine too.
    within(5 * S, "shutdown", scheduler.shutdown(10 * S)).await;
    eprintln!("shutdown with an attempt in flight: {:?}", t.elapsed());
    eventually(30 * S, "the attempt is cancelled on the server", || async {
        busy_backends(&admin, &app).await == (0, 0)
    })
    .await;
    // The stale term ends: nobody took it behind the scheduler's back.
    // Ended here, not by a drop: once ROLLBACK returns the row lock is gone,
    // and no statement of the scheduler is left on the server to take the row after it
    // (checked above), so the row read next is final.
    within(
        5 * S,
        "the stale holder's ROLLBACK",
        locker.batch_execute("ROLLBACK"),
    )
    .await
    .unwrap();
    let holder: String = admin
        .query_typed_one(
            "SELECT holder FROM pgwarden_leases WHERE name = 'stuck'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(holder, "stale");
}

backends!(a_failed_release_is_retried_at_once);
/// A job's lease release that fails once (as on a connection the server
/// closed right after a primary failover) is tried again at once, within the
/// statement bound: the lease is released after the run, not left held
/// until its TTL (30 s here).
async fn a_failed_release_is_retried_at_once<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let leases = B::leases(&B::build(&db, &Settings::new("release-retry", 3)));
    B::install(&leases).await.unwrap();
    // The first release of any term fails on the server: a release marks the
    // row released (holder ''); acquisitions and renewals set a holder.
    admin
        .batch_execute(
            "CREATE SEQUENCE release_failures;
             CREATE FUNCTION fail_first_release() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
               IF NEW.holder = '' AND nextval('release_failures') = 1 THEN
                 RAISE EXCEPTION 'injected: the first release fails';
               END IF;
               RETURN NEW;
             END $$;
             CREATE TRIGGER fail_first_release BEFORE UPDATE ON pgwarden_leases
               FOR EACH ROW EXECUTE FUNCTION fail_first_release();",
        )
        .await
        .unwrap();
    let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = ran.clone();
    // Hourly: it runs once, at start-up; its release keeps the row (the
    // period's hold), marked released.
    let report = Job::every("report", 3600 * S, move |_| {
        let flag = flag.clone();
        async move { flag.store(true, std::sync::atomic::Ordering::SeqCst) }
    })
    .options(LeaseOptions::new(30 * S));
    let scheduler = B::schedule_node(&leases, "n1", vec![report]).unwrap();
    eventually(5 * S, "the run", || async {
        ran.load(std::sync::atomic::Ordering::SeqCst)
    })
    .await;
    let t = Instant::now();
    let holder = || async {
        admin
            .query_typed_one(
                "SELECT holder FROM pgwarden_leases WHERE name = 'report'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, String>(0)
    };
    eventually(
        3 * S,
        "the lease released despite the failed release",
        || async { holder().await.is_empty() },
    )
    .await;
    eprintln!("released {:?} after the run", t.elapsed());
    let failures: i64 = admin
        .query_typed_one("SELECT last_value FROM release_failures", &[])
        .await
        .unwrap()
        .get(0);
    assert!(failures >= 1, "the injected failure happened");
    assert_eq!(B::lease_stats(&leases).held, 0);
    scheduler.shutdown(S).await;
}
