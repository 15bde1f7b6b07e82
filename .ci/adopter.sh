#!/usr/bin/env bash
# The adopter's path, built for real (issue 18):
#
# 1. A scratch crate written against deadpool's `Pool` API
#    (`status().max_size/size/available/waiting`, `is_closed`, `timeouts`,
#    `resize`, `retain`, `manager`, `close`, `get`), with a lockfile that
#    holds deadpool-postgres 0.14.0 and deadpool 0.12.1, as lockfiles
#    written in 2024 do. It builds against deadpool-postgres.
# 2. pgwarden is added as a dependency, and the crate builds with no
#    `cargo update`: cargo moves deadpool-postgres to 0.14.2 on its own, and
#    the tree has one deadpool. pgwarden (default features) builds without
#    a warning.
# 3. The `use` line is changed to `pgwarden::Pool`, and nothing else: it
#    builds again, against pgwarden.
#
# The lockfile starts as a copy of pgwarden's own (then pinned down), and the
# target directory is under target/: the dependencies the two share are
# compiled once.
set -euo pipefail
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export CARGO_TARGET_DIR="${ADOPTER_TARGET_DIR:-$src/target/adopter}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

crate="$work/adopter"
mkdir -p "$crate/src"
cat >"$crate/Cargo.toml" <<'TOML'
[package]
name = "adopter"
version = "0.1.0"
edition = "2021"
publish = false

[workspace]

[dependencies]
deadpool-postgres = "0.14.0"
tokio = { version = "1", features = ["rt", "macros"] }
TOML

cat >"$crate/src/main.rs" <<'RS'
#![deny(warnings)]
mod uses_pool;

fn main() {
    // Compiled, not run: the functions below are the adopter's code.
    let _ = uses_pool::report;
    let _ = uses_pool::maintain;
}
RS

# Written once, against deadpool's Pool API; step 3 changes the `use` line.
cat >"$crate/src/uses_pool.rs" <<'RS'
use deadpool_postgres::Pool;
use std::time::Duration;

pub async fn report(pool: &Pool) -> Result<i64, Box<dyn std::error::Error>> {
    let s = pool.status();
    println!("{} of {} open, {} available, {} waiting", s.size, s.max_size, s.available, s.waiting);
    if pool.is_closed() {
        return Err("closed".into());
    }
    let bound: Option<Duration> = pool.timeouts().wait;
    println!("checkouts wait up to {bound:?}");
    let client = pool.get().await?;
    let row = client.query_one("SELECT 1::int8", &[]).await?;
    Ok(row.get(0))
}

pub fn maintain(pool: &Pool) {
    let _ = pool.resize(8);
    let _ = pool.retain(|_, metrics| metrics.last_used() < Duration::from_secs(60));
    let _caches = &pool.manager().statement_caches;
    pool.close();
}
RS

cd "$crate"
cp "$src/Cargo.lock" Cargo.lock
cargo update --quiet -p deadpool-postgres --precise 0.14.0
cargo update --quiet -p deadpool --precise 0.12.1
locked() { awk -v n="$1" '$0 == "name = \"" n "\"" { getline; gsub(/version = |"/, ""); print }' Cargo.lock | sort | paste -sd' ' -; }
echo "adopter lockfile: deadpool-postgres $(locked deadpool-postgres), deadpool $(locked deadpool)"
[[ "$(locked deadpool-postgres)" == 0.14.0 && "$(locked deadpool)" == 0.12.1 ]] || {
    echo "error: could not make the adopter lockfile" >&2
    exit 1
}

echo "== 1. the adopter builds against deadpool-postgres"
cargo build --quiet

echo "== 2. pgwarden added; cargo build, no cargo update"
cat >>Cargo.toml <<TOML
pgwarden = { path = "$src" }
TOML
# Default features, as an adopter builds it: not one warning (cargo replays
# a path dependency's warnings even when it is built already).
cargo build 2>&1 | tee "$work/build.log"
if grep -q '^warning' "$work/build.log"; then
    echo "error: pgwarden builds with warnings for an adopter (default features)" >&2
    exit 1
fi
echo "after adding pgwarden: deadpool-postgres $(locked deadpool-postgres), deadpool $(locked deadpool)"
if [[ "$(locked deadpool)" == *" "* ]]; then
    echo "error: two deadpools in the adopter's tree: $(locked deadpool)" >&2
    exit 1
fi

echo "== 3. only the use line changed: use pgwarden::Pool"
sed -i 's/^use deadpool_postgres::Pool;$/use pgwarden::Pool;/' src/uses_pool.rs
grep -q '^use pgwarden::Pool;$' src/uses_pool.rs
cargo build --quiet
echo "adopter: deadpool's Pool API code builds against pgwarden::Pool, lockfile kept without cargo update"
