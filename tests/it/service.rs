//! `examples/service` as processes on one database (issue 5 §3): the
//! cluster jobs run exactly once per period across instances, the per-node
//! job once per period on each node, and SIGTERM releases the leases.
//!
//! Three instances: `a` and `c` on node `node-a`, `b` on `node-b`. With
//! `PGWARDEN_TIME_SCALE=0.0005` the periods are: cleanup 1.8 s; alerts,
//! mail checks and uptime 1 s (the scheduler's minimum). Every run is
//! recorded in `job_runs` (in a transaction fenced by its lease), with its
//! period and the start of its lease's term; periods are slots of the
//! database clock aligned on the epoch, and a run belongs to the slot its
//! term started in (what the scheduler promises). When it was recorded can
//! be a later slot: a run taken late in a slot and slowed by a loaded
//! machine records after the boundary, while the next slot's run is
//! already taken elsewhere.

use crate::support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pgwarden_testing::TestServer;
use support::service::{wait_for, Instance, Result};
use tokio_postgres::Client;

const SCALE: &str = "0.0005";
const CLUSTER_JOBS: &[&str] = &["cleanup", "alerts", "mail-checks"];

/// (job, node for per-node jobs else "", slot) → instances that ran it.
type Runs = BTreeMap<(String, String, i64), Vec<String>>;

/// The runs by the slot their term started in, the period of each job, and
/// how many runs were recorded in a later slot than their term's.
async fn runs(db: &Client) -> Result<(Runs, BTreeMap<String, i64>, i64)> {
    let rows = db
        .query(
            "SELECT job, CASE WHEN job = 'uptime' THEN node ELSE '' END, \
                    floor(extract(epoch FROM taken_at) * 1000 / period_ms)::bigint, \
                    instance, period_ms, \
                    floor(extract(epoch FROM ran_at) * 1000 / period_ms)::bigint \
             FROM job_runs ORDER BY taken_at",
            &[],
        )
        .await?;
    let mut out = Runs::new();
    let mut periods = BTreeMap::new();
    let mut recorded_later = 0;
    for r in rows {
        let job: String = r.get(0);
        let slot: i64 = r.get(2);
        periods.insert(job.clone(), r.get::<_, i64>(4));
        recorded_later += i64::from(r.get::<_, i64>(5) > slot);
        out.entry((job, r.get(1), slot)).or_default().push(r.get(3));
    }
    Ok((out, periods, recorded_later))
}

async fn db_now_ms(db: &Client) -> Result<i64> {
    let r = db
        .query_one(
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint",
            &[],
        )
        .await?;
    Ok(r.get(0))
}

#[test]
fn cluster_jobs_once_per_period_node_jobs_once_per_node_and_sigterm_releases_leases() -> Result {
    let t0 = Instant::now();
    let rt = tokio::runtime::Runtime::new()?;
    let server = TestServer::shared()?;
    let db = rt.block_on(server.create_database())?;
    let client = rt.block_on(db.connect())?;
    support::service::service_binary()?;
    let env = [("PGWARDEN_TIME_SCALE", SCALE), ("POOL_SIZE", "4")];
    let a = Instance::start(&db.url(), "svc-a", "node-a", &env)?;
    let mut b = Instance::start(&db.url(), "svc-b", "node-b", &env)?;
    let c = Instance::start(&db.url(), "svc-c", "node-a", &env)?;
    let start_ms = rt.block_on(db_now_ms(&client))?;
    say!("{:>5.1?}  three instances up", t0.elapsed());

    // Several periods of the slowest job (cleanup, 1.8 s) after all started.
    wait_for(Duration::from_secs(40), "six cleanup periods", || {
        let (runs, periods, _) = rt.block_on(runs(&client))?;
        let Some(p) = periods.get("cleanup") else {
            return Ok(None);
        };
        let after = runs
            .keys()
            .filter(|(job, _, slot)| job == "cleanup" && slot * p >= start_ms)
            .count();
        Ok((after >= 6).then_some(()))
    })?;
    let end_ms = rt.block_on(db_now_ms(&client))?;
    let (all, periods, recorded_later) = rt.block_on(runs(&client))?;
    say!(
        "{:>5.1?}  observed {:.1} s of database time; periods (ms): {periods:?}; \
         {recorded_later} runs recorded in a later period than their term's",
        t0.elapsed(),
        (end_ms - start_ms) as f64 / 1000.0
    );

    // Never twice in one period: for any job (per node for uptime), at any time.
    let doubles: Vec<_> = all.iter().filter(|(_, who)| who.len() > 1).collect();
    assert!(doubles.is_empty(), "runs twice in one period: {doubles:?}");

    // Exactly once in every period fully inside the window.
    let mut report = Vec::new();
    let groups: Vec<(&str, &str)> = CLUSTER_JOBS
        .iter()
        .map(|j| (*j, ""))
        .chain([("uptime", "node-a"), ("uptime", "node-b")])
        .collect();
    for (job, node) in groups {
        let p = *periods.get(job).ok_or(format!("{job} never ran"))?;
        let first = (start_ms + p - 1).div_euclid(p); // first slot starting at or after start
        let last = end_ms.div_euclid(p) - 1; // last slot ending at or before end
        assert!(
            last - first + 1 >= 5,
            "{job}: only {} full periods observed",
            last - first + 1
        );
        let mut by_instance: BTreeMap<&str, usize> = BTreeMap::new();
        let mut missed = Vec::new();
        for slot in first..=last {
            match all.get(&(job.to_owned(), node.to_owned(), slot)) {
                Some(who) => *by_instance.entry(who[0].as_str()).or_default() += 1,
                None => missed.push(slot),
            }
        }
        assert!(
            missed.is_empty(),
            "{job} {node}: no run in periods {missed:?} of {first}..={last}"
        );
        match node {
            "node-a" => assert!(
                by_instance.keys().all(|i| *i == "svc-a" || *i == "svc-c"),
                "node-a's uptime ran elsewhere: {by_instance:?}"
            ),
            "node-b" => assert!(
                by_instance.keys().all(|i| *i == "svc-b"),
                "node-b's uptime ran elsewhere: {by_instance:?}"
            ),
            _ => {}
        }
        report.push(format!(
            "{job:<12}{node:<8} {} periods, one run each: {by_instance:?}",
            last - first + 1
        ));
    }
    for line in &report {
        say!("{line}");
    }

    // SIGTERM releases the leases: b holds a lease with a 60 s TTL…
    let holder = {
        let addr = b.addr;
        std::thread::spawn(move || {
            support::service::http(
                addr,
                "POST",
                "/debug/hold-lease?name=report&ms=60000&ttl_ms=60000",
            )
        })
    };
    let b_pid = format!("%:{}:%", b.pid());
    wait_for(
        Duration::from_secs(10),
        "b holds the lease `report`",
        || {
            let n = rt.block_on(client.query_one(
                "SELECT count(*) FROM pgwarden_leases WHERE name = 'report' AND holder LIKE $1",
                &[&b_pid],
            ))?;
            Ok((n.get::<_, i64>(0) == 1).then_some(()))
        },
    )?;
    let (status, body) = a.post("/debug/hold-lease?name=report&ms=0")?;
    assert_eq!(status, 409, "a took a lease b holds: {body}");
    // …and lets go of it at once when told to stop.
    let stopping = Instant::now();
    let exit = b.terminate(Duration::from_secs(20))?;
    assert!(exit.success(), "b exited with {exit}");
    say!(
        "{:>5.1?}  b stopped {:.1?} after SIGTERM: {:?}",
        t0.elapsed(),
        stopping.elapsed(),
        b.stdout().last()
    );
    let answer = holder.join().map_err(|_| "holder thread panicked")??;
    say!("b's lease request answered {answer:?}");
    let left = rt.block_on(client.query_one(
        "SELECT count(*) FROM pgwarden_leases WHERE holder LIKE $1",
        &[&b_pid],
    ))?;
    assert_eq!(
        left.get::<_, i64>(0),
        0,
        "b still holds leases after SIGTERM"
    );
    let (status, body) = a.post("/debug/hold-lease?name=report&ms=0")?;
    assert_eq!(status, 200, "the lease b held is not free: {body}");
    assert!(
        stopping.elapsed() < Duration::from_secs(30),
        "the lease was freed by expiry, not by b"
    );

    drop((a, c));
    say!("{:>5.1?}  done", t0.elapsed());
    Ok(())
}
