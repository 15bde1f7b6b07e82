//! Workload 7: a job holder paused inside a transaction (the scenario in
//! `paused_holder.rs`), and what it does to a healthy instance: readiness
//! success and p99 there, pgwarden (B: table leases, the holder paused in a
//! fenced transaction) against the raw-deadpool design users run today (A:
//! session advisory locks on pooled connections, contenders polling
//! `pg_try_advisory_lock`). Rounds interleave A B, B A, …, each on a fresh
//! database; the n-th rounds of the two sides make a pair.

use pgwarden_testing::TestServer;

use crate::ab::{all, interleave, Compared};
use crate::paused_holder::{run, run_raw, Outcome, Setup};
use crate::support::backend::Deadpool;
use crate::{BoxError, Row, Settings};

/// Targets, pgwarden against raw deadpool: readiness success at least as
/// high, a readiness p99 at most half.
const READY_TARGET: f64 = 1.0;
const P99_TARGET: f64 = 0.5;

fn plan(s: Settings) -> (usize, Setup) {
    let setup = Setup::default();
    if s.smoke {
        (
            1,
            Setup {
                hold: std::time::Duration::from_secs(1),
                ..setup
            },
        )
    } else {
        (4, setup)
    }
}

pub fn describe(s: Settings) -> String {
    let (rounds, p) = plan(s);
    format!(
        "7: a holder of job `x` on another instance pauses {:?} inside a transaction; the healthy \
         instance (pool {}) runs {} tasks contending for `x`, {} request tasks looping `get` + \
         `SELECT pg_sleep(0.002)`, {} jobs of its own, and a readiness probe every {:?} bounded by \
         {:?} (a failed probe counts as the bound in the p99). A, raw deadpool: `x` a session \
         advisory lock held on a pooled connection, the holder's transaction on that connection; \
         contenders poll `pg_try_advisory_lock` on their own checkouts (10 ms apart); its own jobs \
         are session locks, each keeping its connection; the probe is `get` + `SELECT 1` on the \
         same pool. B, pgwarden on default limits and timeouts: `x` a table lease, the holder \
         paused after `lease.fence(tx)`; contenders poll `acquire(\"x\", None)` (each blocks on \
         the holder's row lock); its own jobs are leases (TTL {:?}); the probe is \
         `Pool::readiness`. {rounds} interleaved round pairs, a fresh database each; ratios over \
         the pairs",
        p.hold,
        p.pool,
        p.contenders,
        p.request_tasks,
        p.own_leases,
        p.probe_every,
        p.probe_bound,
        p.own_ttl,
    )
}

fn ready_share(o: &Outcome) -> f64 {
    o.probes_ok as f64 / o.probes.len().max(1) as f64
}

fn p99_ms(o: &Outcome) -> f64 {
    o.probe_percentile(99.0).as_secs_f64() * 1e3
}

pub async fn paused_holder(server: &TestServer, s: Settings) -> Result<Row, BoxError> {
    let (rounds, setup) = plan(s);
    let raw_rounds = std::sync::Mutex::new(Vec::new());
    let warden_rounds = std::sync::Mutex::new(Vec::new());
    // `interleave` takes measurements; the outcomes are kept beside them.
    let failed = std::sync::Mutex::new(None::<BoxError>);
    let record = |o: Result<Outcome, BoxError>, into: &std::sync::Mutex<Vec<Outcome>>| {
        match o {
            Ok(o) => into.lock().unwrap().push(o),
            Err(e) => *failed.lock().unwrap() = Some(e),
        }
        0.0
    };
    interleave(
        rounds,
        || async {
            let o = match server.create_database().await {
                Ok(db) => run_raw(&db, setup).await,
                Err(e) => Err(e.into()),
            };
            record(o, &raw_rounds)
        },
        || async {
            let o = match server.create_database().await {
                Ok(db) => run::<Deadpool>(&db, setup).await,
                Err(e) => Err(e.into()),
            };
            record(o, &warden_rounds)
        },
    )
    .await;
    if let Some(e) = failed.into_inner().unwrap() {
        return Err(e);
    }
    let (a, b) = (
        raw_rounds.into_inner().unwrap(),
        warden_rounds.into_inner().unwrap(),
    );
    let per = |v: &[Outcome], f: fn(&Outcome) -> f64| v.iter().map(f).collect::<Vec<f64>>();
    let ready = Compared::new(&per(&a, ready_share), &per(&b, ready_share));
    let p99 = Compared::new(&per(&a, p99_ms), &per(&b, p99_ms));
    let merged = |v: Vec<Outcome>| {
        let mut all = Outcome::default();
        for o in v {
            all.merge(o);
        }
        all
    };
    let (a, b) = (merged(a), merged(b));
    let verdict = all(&[ready.at_least(READY_TARGET), p99.at_most(P99_TARGET)]);
    Ok(Row {
        id: "7",
        workload: format!(
            "job holder paused {:?} in a transaction; pool {}, {} contenders, request traffic",
            setup.hold, setup.pool, setup.contenders
        ),
        a: format!(
            "raw deadpool, session advisory locks: {}; {} requests",
            a.summary().replace("own leases lost", "own locks lost"),
            a.requests
        ),
        b: format!(
            "pgwarden, table leases: {}; {} requests",
            b.summary(),
            b.requests
        ),
        ratio: format!("readiness {:.3}; p99 {:.3}", ready.pairs, p99.pairs),
        target: "readiness ≥ 1.0; p99 ≤ 0.5",
        met: (!s.smoke).then_some(verdict).flatten(),
        notes: format!(
            "readiness: {}; p99: {}; raw: {} `pg_try_advisory_lock` attempts on `x` ({} errors); \
             pgwarden: {} acquisition attempts on `x` returned ({} errors), {} renewals of its own \
             leases, {} failed renewal statements",
            ready.spread(),
            p99.spread(),
            a.attempts,
            a.attempt_errors,
            b.attempts,
            b.attempt_errors,
            b.renewed,
            b.renewal_failures
        ),
    })
}
