#!/usr/bin/env bash
# Column A of benchmark row 7: the paused-holder scenario
# (benches/workloads/paused_holder.rs, public API only) built against
# another revision of pgwarden, by default a44f94e (main before the probe
# and lease lanes). Writes its one-line result to target/paused_holder_main.txt,
# which `bash benches/run.sh` then shows.
#
#   bash benches/paused_holder_main.sh [REV]     # ROUNDS=3 by default
#
# The scenario file is taken as it was written for that revision's API
# (SCENARIO_REV, by default d52b33c: the same scenario, with the lease calls
# named as a44f94e names them and its in-crate harness); this build runs the
# current file.
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:-a44f94e}"
work="$(mktemp -d)"
dir="$work/pgwarden-$rev"
git worktree add --detach "$dir" "$rev" >/dev/null
trap 'git worktree remove --force "$dir"; rm -rf "$work"' EXIT
git show "${SCENARIO_REV:-d52b33c}:benches/workloads/paused_holder.rs" > "$dir/tests/paused_holder_scenario.rs.inc"
cat > "$dir/tests/paused_holder_main.rs" <<'RS'
#[path = "paused_holder_scenario.rs.inc"]
#[allow(dead_code)]
mod paused_holder;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_holder() {
    let rounds: usize = std::env::var("ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(3);
    let server = pgwarden::testing::TestServer::shared().unwrap();
    let mut all = paused_holder::Outcome::default();
    for _ in 0..rounds {
        let db = server.create_database().await.unwrap();
        let o = paused_holder::run(&db, paused_holder::Setup::default()).await.unwrap();
        eprintln!("round: {}", o.summary());
        all.merge(o);
    }
    println!("PAUSED_HOLDER {} ({rounds} rounds)", all.summary());
}
RS
mkdir -p target
CARGO_TARGET_DIR="$PWD/target/other-rev" cargo test --release --all-features \
  --manifest-path "$dir/Cargo.toml" --test paused_holder_main -- --nocapture \
  | tee target/paused_holder_main.log
grep '^PAUSED_HOLDER ' target/paused_holder_main.log | sed 's/^PAUSED_HOLDER //' \
  | sed "s/^/$rev: /" > target/paused_holder_main.txt
cat target/paused_holder_main.txt
