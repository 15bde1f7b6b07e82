//! The two parsers the dashboard and alert checks rely on: the metric names
//! pgwarden exports, and the names a query or a description uses.

use std::collections::BTreeSet;

/// Every metric name pgwarden exports, as Prometheus sees it: the
/// `pub(crate) const X: &str = "pgwarden_…";` lines of `src/metrics.rs`, plus
/// `_bucket`, `_sum` and `_count` for the names passed to `describe_histogram!`.
pub(crate) fn exported_names(src: &str) -> BTreeSet<String> {
    let mut consts = Vec::new();
    for line in src.lines() {
        let line = line.trim();
        let Some(rest) = line
            .strip_prefix("pub(crate) const ")
            .or_else(|| line.strip_prefix("pub const "))
        else {
            continue;
        };
        let Some((ident, value)) = rest.split_once(": &str = \"") else {
            continue;
        };
        let Some(name) = value.strip_suffix("\";") else {
            continue;
        };
        if name.starts_with("pgwarden_") {
            consts.push((ident.trim().to_owned(), name.to_owned()));
        }
    }
    assert!(
        consts.len() >= 20,
        "parsed only {} metric names from src/metrics.rs",
        consts.len()
    );
    let histograms: BTreeSet<&str> = src
        .split("describe_histogram!(")
        .skip(1)
        .filter_map(|s| s.split(',').next())
        .map(str::trim)
        .collect();
    assert!(
        !histograms.is_empty(),
        "no describe_histogram! in src/metrics.rs"
    );
    let mut names = BTreeSet::new();
    for (ident, name) in &consts {
        if histograms.contains(ident.as_str()) {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{suffix}"));
            }
        }
        names.insert(name.clone());
    }
    for h in &histograms {
        assert!(
            consts.iter().any(|(i, _)| i == h),
            "describe_histogram!({h}) names no pgwarden_ const"
        );
    }
    names
}

/// Every `pgwarden_…` identifier in `text` (a metric name in PromQL, or one
/// quoted in a description).
pub(crate) fn referenced_names(text: &str) -> BTreeSet<String> {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut out = BTreeSet::new();
    let mut from = 0;
    while let Some(i) = text[from..].find("pgwarden_") {
        let start = from + i;
        let preceded = text[..start].chars().next_back().is_some_and(is_ident);
        let len = text[start..]
            .find(|c: char| !is_ident(c))
            .unwrap_or(text.len() - start);
        if !preceded {
            out.insert(text[start..start + len].to_owned());
        }
        from = start + len;
    }
    out
}

#[test]
fn name_parsing_catches_unknown_metrics() {
    // The checks above are only as good as these two parsers.
    let mut src = String::from(
        "pub(crate) const A: &str = \"pgwarden_a_total\";\n\
         pub const H: &str = \"pgwarden_h_seconds\";\n\
         fn d() { describe_histogram!(H, Unit::Seconds, \"h\"); }\n",
    );
    for i in 0..20 {
        src.push_str(&format!("pub const X{i}: &str = \"pgwarden_x{i}\";\n"));
    }
    let names = exported_names(&src);
    assert!(names.contains("pgwarden_a_total"));
    assert!(names.contains("pgwarden_h_seconds_bucket"));
    assert!(names.contains("pgwarden_h_seconds_count"));
    assert!(!names.contains("pgwarden_a_total_bucket"));
    let used = referenced_names(
        "histogram_quantile(0.99, sum by (le) (rate(pgwarden_h_seconds_bucket{pool=~\"$pool\"}[5m]))) \
         > pgwarden_typo_seconds and on() xpgwarden_not_a_name",
    );
    assert_eq!(
        used,
        BTreeSet::from([
            "pgwarden_h_seconds_bucket".to_owned(),
            "pgwarden_typo_seconds".to_owned()
        ])
    );
    assert!(!names.contains("pgwarden_typo_seconds"));
}
