//! The Grafana dashboard and the Prometheus alert rules in `dashboards/`
//! against the metric names in `src/metrics.rs`. No database needed.
//!
//! `promtool check rules` / `promtool test rules` check the rules' syntax and
//! behaviour; this checks that they (and the dashboard) only speak of metrics
//! pgwarden exports, and that the dashboard stays importable with a
//! datasource chosen at import time.

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::Value;

#[path = "dashboards/names.rs"]
mod names;
use names::{exported_names, referenced_names};

/// The alerts issues 5 and 12 ask for.
const REQUIRED_ALERTS: &[&str] = &[
    "PgwardenLockBudgetExhausted",
    "PgwardenSessionLockHeldTooLong",
    "PgwardenPoolSaturated",
    "PgwardenRequestLaneStarving",
    "PgwardenReadinessFailing",
    "PgwardenLeaseLost",
    "PgwardenLeaseRenewalSlow",
    "PgwardenAdvisoryLockOnIdleConnection",
    "PgwardenRequestsShed",
];

const DATASOURCE_REF: &str = "${datasource}";

fn read(rel: &str) -> String {
    let path: PathBuf = [env!("CARGO_MANIFEST_DIR"), rel].iter().collect();
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn dashboard() -> Value {
    serde_json::from_str(&read("dashboards/pgwarden.json"))
        .expect("dashboards/pgwarden.json is not valid JSON")
}

/// Every panel, rows' nested panels included.
fn panels(dash: &Value) -> Vec<&Value> {
    fn walk<'a>(list: &'a Value, out: &mut Vec<&'a Value>) {
        for p in list.as_array().into_iter().flatten() {
            out.push(p);
            if let Some(nested) = p.get("panels") {
                walk(nested, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(&dash["panels"], &mut out);
    out
}

fn exprs(dash: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for p in panels(dash) {
        for t in p["targets"].as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or("?").to_owned();
            let expr = t["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("panel {title:?}: a target without expr"));
            out.push((title, expr.to_owned()));
        }
    }
    out
}

/// Every `"datasource"` value anywhere in the dashboard.
fn datasource_refs<'a>(v: &'a Value, at: String, out: &mut Vec<(String, &'a Value)>) {
    match v {
        Value::Object(m) => {
            for (k, child) in m {
                if k == "datasource" {
                    out.push((at.clone(), child));
                }
                datasource_refs(child, format!("{at}.{k}"), out);
            }
        }
        Value::Array(a) => {
            for (i, child) in a.iter().enumerate() {
                datasource_refs(child, format!("{at}[{i}]"), out);
            }
        }
        _ => {}
    }
}

fn template_var<'a>(dash: &'a Value, name: &str) -> &'a Value {
    dash["templating"]["list"]
        .as_array()
        .expect("templating.list")
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no template variable {name:?}"))
}

#[test]
fn dashboard_has_datasource_and_pool_variables() {
    let dash = dashboard();
    assert!(dash["title"].is_string() && dash["uid"].is_string());
    assert!(
        dash["schemaVersion"].as_u64().is_some_and(|v| v >= 36),
        "schemaVersion"
    );

    let ds = template_var(&dash, "datasource");
    assert_eq!(ds["type"], "datasource");
    assert_eq!(ds["query"], "prometheus");

    let pool = template_var(&dash, "pool");
    assert_eq!(pool["type"], "query");
    assert_eq!(pool["datasource"]["uid"], DATASOURCE_REF);
    let def = "label_values(pgwarden_connections_max, pool)";
    assert_eq!(pool["definition"], def);
    let query = pool["query"].get("query").unwrap_or(&pool["query"]);
    assert_eq!(query, def);
    assert_eq!(pool["multi"], true);
    assert_eq!(pool["includeAll"], true);
}

#[test]
fn every_panel_uses_the_datasource_variable() {
    let dash = dashboard();
    let data_panels: Vec<_> = panels(&dash)
        .into_iter()
        .filter(|p| p["type"] != "row")
        .collect();
    assert!(data_panels.len() >= 9, "only {} panels", data_panels.len());
    let mut ids = BTreeSet::new();
    for p in &data_panels {
        let title = p["title"].as_str().expect("panel title");
        assert!(
            ids.insert(p["id"].as_u64().expect("panel id")),
            "duplicate id in {title:?}"
        );
        assert_eq!(p["datasource"]["type"], "prometheus", "panel {title:?}");
        assert_eq!(p["datasource"]["uid"], DATASOURCE_REF, "panel {title:?}");
        let desc = p["description"].as_str().unwrap_or("");
        assert!(
            desc.len() >= 80,
            "panel {title:?} needs a description for the on-call engineer"
        );
        let targets = p["targets"].as_array().filter(|t| !t.is_empty());
        for t in targets.unwrap_or_else(|| panic!("panel {title:?} has no targets")) {
            assert_eq!(
                t["datasource"]["uid"], DATASOURCE_REF,
                "a target of panel {title:?}"
            );
        }
    }

    // No hard-coded datasource anywhere: every reference is the variable.
    let mut refs = Vec::new();
    datasource_refs(&dash, String::new(), &mut refs);
    assert!(!refs.is_empty());
    for (at, r) in refs {
        assert!(
            r.is_object(),
            "{at}: datasource given by name ({r}), use {{\"uid\": \"{DATASOURCE_REF}\"}}"
        );
        assert_eq!(r["uid"], DATASOURCE_REF, "{at}: hard-coded datasource uid");
    }
}

#[test]
fn every_panel_query_filters_by_pool_and_uses_rate_interval() {
    let dash = dashboard();
    for (title, expr) in exprs(&dash) {
        assert!(
            expr.contains("pool=~\"$pool\""),
            "panel {title:?}: {expr} ignores $pool"
        );
        if expr.contains("rate(") || expr.contains("increase(") {
            assert!(
                expr.contains("[$__rate_interval]"),
                "panel {title:?}: {expr} should use $__rate_interval"
            );
        }
        if expr.contains("histogram_quantile") {
            assert!(
                expr.contains("_bucket") && expr.contains("le"),
                "panel {title:?}: {expr}"
            );
        }
        assert!(
            !referenced_names(&expr).is_empty(),
            "panel {title:?}: {expr} uses no pgwarden metric"
        );
    }
}

#[test]
fn every_metric_in_the_dashboard_exists() {
    let names = exported_names(&read("src/metrics.rs"));
    let dash = dashboard();
    let mut used = BTreeSet::new();
    for (title, expr) in exprs(&dash) {
        for n in referenced_names(&expr) {
            assert!(
                names.contains(&n),
                "panel {title:?} queries {n}, which src/metrics.rs does not export"
            );
            used.insert(n);
        }
    }
    // The variable's query too.
    for n in referenced_names(&dash["templating"].to_string()) {
        assert!(
            names.contains(&n),
            "template variable uses unknown metric {n}"
        );
    }
    // The panels the issue asks for are there.
    for needed in [
        "pgwarden_lane_in_use",
        "pgwarden_lane_max",
        "pgwarden_lane_pending",
        "pgwarden_acquire_duration_seconds_bucket",
        "pgwarden_acquire_failures_total",
        "pgwarden_budget_overruns_total",
        "pgwarden_session_lock_connections",
        "pgwarden_oldest_hold_seconds",
        "pgwarden_census_idle_advisory_locks",
        "pgwarden_census_leaks_total",
        "pgwarden_readiness_duration_seconds_bucket",
        "pgwarden_readiness_failures_total",
        "pgwarden_leases_held",
        "pgwarden_lease_renewals_total",
        "pgwarden_lease_renewal_duration_seconds_bucket",
        "pgwarden_lease_renew_interval_seconds",
        "pgwarden_lease_lost_total",
        "pgwarden_lease_takeovers_total",
        "pgwarden_requests_shed_total",
        "pgwarden_requests_admitted_total",
    ] {
        assert!(used.contains(needed), "no panel shows {needed}");
    }
}

/// The rules file split per alert: (name, the text of its rule).
fn alert_blocks(rules: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in rules.lines() {
        if let Some(name) = line.trim().strip_prefix("- alert:") {
            out.push((name.trim().to_owned(), String::new()));
        } else if line.trim().starts_with("- ")
            && !line.trim().starts_with("- alert")
            && line.contains("name:")
        {
            // A new group ends the previous rule.
            out.push((String::new(), String::new()));
        } else if let Some((_, body)) = out.last_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    out.retain(|(n, _)| !n.is_empty());
    out
}

#[test]
fn every_metric_in_the_alert_rules_exists() {
    let names = exported_names(&read("src/metrics.rs"));
    let rules = read("dashboards/alerts.yml");
    let used = referenced_names(&rules);
    assert!(used.len() >= 10, "alerts.yml uses only {used:?}");
    for n in used {
        assert!(
            names.contains(&n),
            "dashboards/alerts.yml uses {n}, which src/metrics.rs does not export"
        );
    }
}

#[test]
fn every_required_alert_exists_and_is_actionable() {
    let rules = read("dashboards/alerts.yml");
    let blocks = alert_blocks(&rules);
    let mut seen = BTreeSet::new();
    for (name, body) in &blocks {
        assert!(seen.insert(name.as_str()), "alert {name} defined twice");
        for key in ["expr:", "for:", "severity:", "summary:", "description:"] {
            assert!(body.contains(key), "alert {name} has no {key}");
        }
        assert!(
            !referenced_names(body).is_empty(),
            "alert {name} uses no pgwarden metric"
        );
        assert!(
            body.contains("{{ $labels.pool }}"),
            "alert {name} does not name the pool"
        );
    }
    for required in REQUIRED_ALERTS {
        assert!(
            seen.contains(required),
            "dashboards/alerts.yml lacks alert {required}"
        );
    }
    let tests = read("dashboards/alerts_test.yml") + &read("dashboards/alerts_test_leases.yml");
    for required in REQUIRED_ALERTS {
        assert!(
            tests.contains(&format!("alertname: {required}")),
            "dashboards/alerts_test*.yml have no case for {required}"
        );
    }
}
