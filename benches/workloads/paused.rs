//! Workload 7: a lease holder paused inside a fenced transaction (the
//! scenario in `paused_holder.rs`): readiness success and p99 on the
//! healthy instance, this build (B) against `main`'s behaviour (A).
//!
//! `main` cannot run inside this binary: `bash benches/paused_holder_main.sh`
//! builds the same scenario file against another revision (default
//! a44f94e) and writes `target/paused_holder_main.txt`, which this row
//! reads for column A.

use std::time::Duration;

use pgwarden_testing::TestServer;

use crate::paused_holder::{run, Outcome, Setup};
use crate::{BoxError, Row, Settings};

const P99_TARGET: Duration = Duration::from_millis(50);
const MAIN_FIGURES: &str = "target/paused_holder_main.txt";

fn plan(s: Settings) -> (usize, Setup) {
    let setup = Setup::default();
    if s.smoke {
        (
            1,
            Setup {
                hold: Duration::from_secs(1),
                ..setup
            },
        )
    } else {
        (3, setup)
    }
}

pub fn describe(s: Settings) -> String {
    let (rounds, p) = plan(s);
    format!(
        "7: instance B holds lease `x` and pauses {:?} inside a transaction after `lease.fence(&tx)`; \
         instance A (pool {}, default limits) runs {} tasks polling `acquire(\"x\", None)` (each blocks \
         on B's row lock), {} request tasks looping `get` + `SELECT pg_sleep(0.002)`, {} leases of its \
         own (TTL {:?}), and `readiness({:?})` every {:?}; a failed probe counts as the bound in the \
         p99; {rounds} round(s); A is the same scenario file built against `main` \
         (`bash benches/paused_holder_main.sh`)",
        p.hold,
        p.pool,
        p.contenders,
        p.request_tasks,
        p.own_leases,
        p.own_ttl,
        p.probe_bound,
        p.probe_every
    )
}

pub async fn paused_holder(server: &TestServer, s: Settings) -> Result<Row, BoxError> {
    let (rounds, setup) = plan(s);
    let mut all = Outcome::default();
    for _ in 0..rounds {
        let db = server.create_database().await?;
        all.merge(run(&db, setup).await?);
    }
    let p99 = all.probe_percentile(99.0);
    let ok = all.probes_ok == all.probes.len() && p99 <= P99_TARGET && all.own_lost == 0;
    let main = std::fs::read_to_string(MAIN_FIGURES)
        .map(|t| t.trim().to_owned())
        .unwrap_or_else(|_| format!("main: not measured (run `bash benches/paused_holder_main.sh`, writes {MAIN_FIGURES})"));
    Ok(Row {
        id: "7",
        workload: format!(
            "lease holder paused {:?} in a fenced transaction; pool {}, {} contenders, request traffic",
            setup.hold, setup.pool, setup.contenders
        ),
        a: main,
        b: format!("this build: {}", all.summary()),
        ratio: "-".into(),
        target: "readiness 100 %, p99 ≤ 50 ms",
        met: (!s.smoke).then_some(ok),
        notes: format!(
            "this build: {} renewals of its own leases, {} failed renewal statements; {} acquisition attempts on `x` returned ({} errors)",
            all.renewed, all.renewal_failures, all.attempts, all.attempt_errors
        ),
    })
}
