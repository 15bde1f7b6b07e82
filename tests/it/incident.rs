//! The incident, both ways, as assertions.

#[path = "../../examples/incident/scenarios.rs"]
#[allow(dead_code)]
mod scenarios;

use crate::support;

use pgwarden::BudgetPolicy;
use scenarios::{check, JOBS, PROBE_BOUND};
use support::{db, Logs};

#[tokio::test]
async fn raw_deadpool_loses_readiness_and_deadlocks_its_jobs() {
    let o = scenarios::raw_deadpool(&db().await).await.unwrap();
    assert_eq!(
        o.granted,
        JOBS.len(),
        "every job got its lock and kept its connection"
    );
    assert_eq!(o.probes_ok, 0, "the readiness probe got no connection");
    assert!(o.worst_probe >= PROBE_BOUND);
    assert_eq!(o.work_done, 0, "no job got a work connection");
    assert_eq!(o.waiting_seen, JOBS.len());
    assert_eq!(o.held_between_statements, JOBS.len());
}

#[tokio::test]
async fn pgwarden_refuse_grants_the_budget_and_stays_ready() {
    let o = scenarios::pgwarden_session_locks(&db().await, BudgetPolicy::Refuse)
        .await
        .unwrap();
    assert_eq!(check(&o, 1), Vec::<String>::new(), "{o:?}");
    assert_eq!(o.refused, 3);
}

#[tokio::test]
async fn pgwarden_warn_admits_to_the_floor_logs_and_stays_ready() {
    let logs = Logs::default();
    let _guard = tracing::subscriber::set_default(logs.subscriber());
    let o = scenarios::pgwarden_session_locks(&db().await, BudgetPolicy::Warn)
        .await
        .unwrap();
    assert_eq!(check(&o, 2), Vec::<String>::new(), "{o:?}");
    assert_eq!(o.refused, 2, "past the hard floor, warn refuses too");
    let text = logs.text();
    assert!(
        text.contains("session lock admitted past its budget") && text.contains("scenarios.rs"),
        "the overrun is logged with its call site: {text}"
    );
}

#[tokio::test]
async fn pgwarden_leases_run_all_four_jobs_holding_no_connection() {
    let o = scenarios::pgwarden_leases(&db().await).await.unwrap();
    assert_eq!(check(&o, JOBS.len()), Vec::<String>::new(), "{o:?}");
    assert_eq!(o.held_between_statements, 0);
    assert_eq!(o.refused, 0);
}

/// The same incident on sqlx, from the same scenarios: raw `sqlx::PgPool`
/// with sqlx's own `PgAdvisoryLock` loses readiness and its jobs' work;
/// pgwarden's sqlx pool grants the budget (refuse: 1, warn: 2) and stays
/// ready; leases run all four jobs holding no connection.
#[cfg(any(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
#[tokio::test]
async fn the_incident_on_sqlx_both_ways() {
    use scenarios::on_sqlx;
    let db = db().await;
    let raw = on_sqlx::raw_sqlx(&db).await.unwrap();
    assert_eq!(raw.granted, JOBS.len(), "{raw:?}");
    assert_eq!(
        raw.probes_ok, 0,
        "the readiness probe got no connection: {raw:?}"
    );
    assert_eq!(raw.work_done, 0, "no job got a work connection: {raw:?}");
    assert_eq!(raw.held_between_statements, JOBS.len());
    let refuse = on_sqlx::pgwarden_session_locks(&db, BudgetPolicy::Refuse)
        .await
        .unwrap();
    assert_eq!(check(&refuse, 1), Vec::<String>::new(), "{refuse:?}");
    assert_eq!(refuse.refused, 3);
    let warn = on_sqlx::pgwarden_session_locks(&db, BudgetPolicy::Warn)
        .await
        .unwrap();
    assert_eq!(check(&warn, 2), Vec::<String>::new(), "{warn:?}");
    assert_eq!(warn.refused, 2);
    let leases = on_sqlx::pgwarden_leases(&db).await.unwrap();
    assert_eq!(
        check(&leases, JOBS.len()),
        Vec::<String>::new(),
        "{leases:?}"
    );
    assert_eq!(leases.held_between_statements, 0);
}
