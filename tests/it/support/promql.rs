//! PromQL against a real Prometheus for the end-to-end test: the
//! dashboard's queries with Grafana's variables substituted, the alert rules
//! as Prometheus loaded them, the selectors inside an expression, polling.

use std::time::{Duration, Instant};

use pgwarden_testing::Prometheus;
use serde_json::Value;

use super::service::{wait_for, Instance, Result};

/// Grafana's variables, as a dashboard user would have them: the pool regex
/// (the service's pool is named `service`) and a rate window of 15 scrapes.
const SUBSTITUTIONS: &[(&str, &str)] = &[
    ("${pool:regex}", "service"),
    ("${pool}", "service"),
    ("$pool", "service"),
    ("${__rate_interval}", "15s"),
    ("$__rate_interval", "15s"),
    ("${__interval}", "5s"),
    ("$__interval", "5s"),
    ("$__range", "1m"),
];

pub fn substitute(expr: &str) -> String {
    let mut e = expr.to_owned();
    for (var, val) in SUBSTITUTIONS {
        e = e.replace(var, val);
    }
    e
}

pub fn read_dashboard_file(rel: &str) -> Result<String> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(&p).map_err(|e| format!("reading {}: {e}", p.display()).into())
}

/// (panel title, expr) for every target of every panel, rows included.
pub fn panel_queries(dashboard: &Value) -> Vec<(String, String)> {
    fn walk(panels: &Value, out: &mut Vec<(String, String)>) {
        for p in panels.as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or("?").to_owned();
            for t in p["targets"].as_array().into_iter().flatten() {
                if let Some(e) = t["expr"].as_str() {
                    out.push((title.clone(), e.to_owned()));
                }
            }
            walk(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// The metric selectors of a PromQL expression as Prometheus prints it
/// (`name{matchers}`), without range or offset.
pub fn selectors(expr: &str) -> Vec<String> {
    let b = expr.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(pos) = expr[i..].find("pgwarden_") {
        let start = i + pos;
        if start > 0 && ident(b[start - 1]) {
            i = start + 1;
            continue;
        }
        let mut end = start;
        while end < b.len() && ident(b[end]) {
            end += 1;
        }
        if end < b.len() && b[end] == b'{' {
            let mut in_str = false;
            let mut j = end + 1;
            while j < b.len() {
                match b[j] {
                    b'\\' if in_str => j += 1,
                    b'"' => in_str = !in_str,
                    b'}' if !in_str => break,
                    _ => {}
                }
                j += 1;
            }
            end = (j + 1).min(b.len());
        }
        let s = expr[start..end].to_owned();
        if !out.contains(&s) {
            out.push(s);
        }
        i = end;
    }
    out
}

/// The result vector of an instant query's JSON.
pub fn series(json: &str) -> Result<Vec<Value>> {
    let v: Value = serde_json::from_str(json)?;
    if v["status"] != "success" {
        return Err(format!("query failed: {json}").into());
    }
    Ok(match &v["data"]["result"] {
        Value::Array(a) => a.clone(),
        // A scalar or string result counts as one.
        Value::Null => Vec::new(),
        other => vec![other.clone()],
    })
}

/// Polls `expr` until it returns at least one series or `deadline` passes;
/// the series count (0 at the deadline). A parse error fails at once.
pub fn poll_series(prom: &Prometheus, expr: &str, deadline: Instant) -> Result<usize> {
    loop {
        let n = series(&prom.query(expr)?)?.len();
        if n > 0 || Instant::now() >= deadline {
            return Ok(n);
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The alert rules as Prometheus loaded them, once each has been evaluated.
pub fn loaded_rules(prom: &Prometheus) -> Result<Vec<Value>> {
    wait_for(Duration::from_secs(20), "every rule evaluated", || {
        let v: Value = serde_json::from_str(&prom.get("/api/v1/rules?type=alert")?)?;
        let rules: Vec<Value> = v["data"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        let evaluated = rules.iter().all(|r| r["health"] != "unknown");
        Ok((evaluated && !rules.is_empty()).then_some(rules))
    })
}

/// Polls the expression of alert `name` until it is true for `instance`;
/// the series' labels.
pub fn alert_true_for(
    prom: &Prometheus,
    rules: &[Value],
    name: &str,
    instance: &Instance,
) -> Result<Value> {
    let rule = rules
        .iter()
        .find(|r| r["name"] == name)
        .ok_or(format!("no {name} rule"))?;
    let expr = rule["query"].as_str().ok_or("rule without query")?;
    let target = instance.addr.to_string();
    let hit = wait_for(
        Duration::from_secs(20),
        &format!("{name} true for instance {}", instance.name),
        || {
            let s = series(&prom.query(expr)?)?;
            Ok(s.into_iter()
                .find(|s| s["metric"]["instance"] == target.as_str()))
        },
    )?;
    Ok(hit["metric"].clone())
}
