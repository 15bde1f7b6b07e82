//! The incident pgwarden exists for, reproduced both ways: four background jobs holding
//! session advisory locks on a pool of four, with raw deadpool and with
//! pgwarden's budgeted session locks (refuse and warn); then the same four
//! jobs on pgwarden's table leases, which hold no connection.
//!
//! ```sh
//! cargo run --example incident
//! cargo run --example incident --features sqlx-0_8   # and on sqlx 0.8
//! ```
//!
//! Uses `DATABASE_URL` when set, otherwise a throwaway PostgreSQL. Prints a
//! side-by-side table and exits 0 only when pgwarden behaved as claimed.

mod scenarios;

use std::io::IsTerminal;

use pgwarden::BudgetPolicy;
use pgwarden_testing::TestServer;
use scenarios::{check, Table};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        // Colour only on a terminal: redirected to a file or a pipe, stderr
        // gets plain text (`.ci/run` checks it).
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match run().await {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("incident: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

async fn run() -> Result<bool, scenarios::BoxError> {
    let server = TestServer::shared()?;
    let db = server.create_database().await?;
    let raw = scenarios::raw_deadpool(&db).await?;
    let refuse = scenarios::pgwarden_session_locks(&db, BudgetPolicy::Refuse).await?;
    let warn = scenarios::pgwarden_session_locks(&db, BudgetPolicy::Warn).await?;
    let leases = scenarios::pgwarden_leases(&db).await?;
    #[allow(unused_mut)]
    let mut sides = vec![[raw, refuse, warn, leases]];
    // With a sqlx feature on (`--features sqlx-0_8`), the same incident on
    // sqlx: raw `PgAdvisoryLock`, then pgwarden's sqlx pool.
    #[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
    {
        use scenarios::on_sqlx;
        sides.push([
            on_sqlx::raw_sqlx(&db).await?,
            on_sqlx::pgwarden_session_locks(&db, BudgetPolicy::Refuse).await?,
            on_sqlx::pgwarden_session_locks(&db, BudgetPolicy::Warn).await?,
            on_sqlx::pgwarden_leases(&db).await?,
        ]);
    }
    let rows: Vec<_> = sides.iter().flatten().cloned().collect();
    println!("{}", Table(&rows));
    let mut bad = Vec::new();
    for [raw, refuse, warn, leases] in &sides {
        bad.extend(check(refuse, 1));
        bad.extend(check(warn, 2));
        bad.extend(check(leases, scenarios::JOBS.len()));
        if leases.held_between_statements != 0 {
            bad.push(format!(
                "{}: connections held between statements",
                leases.scenario
            ));
        }
        if raw.probes_ok != 0 {
            println!(
                "note: {}: the readiness probe answered; the incident did not reproduce",
                raw.scenario
            );
        }
    }
    for b in &bad {
        println!("NOT AS CLAIMED: {b}");
    }
    if bad.is_empty() {
        println!("pgwarden behaved as claimed: readiness answered every time, and the work under every granted lock completed.");
    }
    Ok(bad.is_empty())
}
