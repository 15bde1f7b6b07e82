//! `pgwarden_testing::Prometheus` against the real Prometheus binary: it
//! scrapes a target, answers instant queries, loads rule files, reports
//! parse errors, and stops on drop.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use pgwarden_testing::{require_tool, Prometheus};
use serde_json::Value;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A minimal `/metrics` endpoint on a thread: one gauge, one counter.
fn exporter() -> Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let mut r = BufReader::new(&s);
            let mut line = String::new();
            // Read the request head up to its blank line.
            while r.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
                if line == "\r\n" {
                    break;
                }
                line.clear();
            }
            let body = "# TYPE harness_gauge gauge\nharness_gauge{pool=\"p\"} 3\n\
                        # TYPE harness_total counter\nharness_total 7\n";
            let _ = write!(
                &s,
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    Ok(addr)
}

fn result(json: &str) -> Result<Vec<Value>> {
    let v: Value = serde_json::from_str(json)?;
    assert_eq!(v["status"], "success", "{json}");
    Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
}

#[test]
fn prometheus_scrapes_queries_and_stops_on_drop() -> Result {
    if !require_tool("prometheus")? {
        return Ok(());
    }
    let target = exporter()?;
    let dir = tempfile::tempdir()?;
    let rules = dir.path().join("rules.yml");
    std::fs::write(
        &rules,
        "groups:\n  - name: h\n    rules:\n      - alert: HarnessGaugeHigh\n        expr: harness_gauge > 2\n",
    )?;
    let started = Instant::now();
    let prom = Prometheus::start_with_rules(&[target], Duration::from_secs(1), &[&rules])?;
    let json = prom.wait_for_series("harness_gauge", Duration::from_secs(30))?;
    eprintln!("first sample after {:?}: {json}", started.elapsed());
    let series = result(&json)?;
    assert_eq!(series.len(), 1);
    assert_eq!(series[0]["metric"]["job"], "pgwarden");
    assert_eq!(series[0]["metric"]["instance"], target.to_string());
    assert_eq!(series[0]["value"][1], "3");

    // Selectors with quotes, braces and regexes survive the URL encoding.
    let json = prom
        .query(r#"sum by (pool) (harness_gauge{pool=~"p|q"}) + on() group_left() harness_total"#)?;
    assert_eq!(result(&json)?[0]["value"][1], "10");

    // A parse error is an error that carries Prometheus's explanation.
    let err = prom.query("sum(harness_gauge").unwrap_err().to_string();
    assert!(err.contains("400") && err.contains("parse error"), "{err}");

    // The rule file is loaded; its alert fires (it has no `for`).
    let json = prom.wait_for_series(
        r#"ALERTS{alertname="HarnessGaugeHigh", alertstate="firing"}"#,
        Duration::from_secs(20),
    )?;
    assert_eq!(result(&json)?.len(), 1);

    let pid = prom.pid();
    let dir = prom.dir().to_path_buf();
    drop(prom);
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| c.is_empty())
                .unwrap_or(true),
        "prometheus still running after drop"
    );
    assert!(!dir.exists(), "temporary directory left behind");
    Ok(())
}
