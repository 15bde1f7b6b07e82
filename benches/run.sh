#!/usr/bin/env bash
# Reproduces every benchmark and writes BENCHMARKS.md (or, with --smoke, a
# quick check that the benches still build and run: target/BENCHMARKS.smoke.md).
set -euo pipefail
cd "$(dirname "$0")/.."
# Rows 1s and 2s measure the sqlx 0.8 backend against raw sqlx 0.8.
FEATURES=(--features sqlx-0_8)
if [[ "${1:-}" == "--smoke" ]]; then
  # The smoke run checks that the benches build and run end to end; its
  # figures are judged nowhere. So it builds them as `cargo test
  # --all-features` builds everything else (the test profile, every
  # feature: the benches' `sqlx-0_8` code is in, under its `sqlx_0_8`
  # name), reusing that build's dependencies instead of a release build of
  # its own (about 250 s in CI). `--bench` puts criterion in its
  # benchmarking mode, as `cargo bench` does: it writes the estimates the
  # workloads bench reads.
  rm -rf target/criterion-rounds
  PGWARDEN_BENCH_SMOKE=1 cargo test --all-features --bench checkout -- --bench --noplot
  cargo test --all-features --bench workloads -- --smoke
else
  # Row 2: criterion run twenty times, each a process of its own, the side
  # measured first alternating (runs differ from each other far more than
  # criterion's interval within one run: many short runs, not a few long
  # ones); each run's estimates kept for the report.
  rm -rf target/criterion-rounds
  for k in $(seq 1 20); do
    order=raw-first
    if (( k % 2 == 0 )); then order=pgwarden-first; fi
    PGWARDEN_BENCH_ORDER=$order cargo bench "${FEATURES[@]}" --bench checkout -- --noplot \
      --warm-up-time 0.5 --measurement-time 1.5
    for side in checkout_return/raw_deadpool checkout_return/pgwarden \
      checkout_return_sqlx/raw_sqlx checkout_return_sqlx/pgwarden; do
      mkdir -p "target/criterion-rounds/$k/${side%/*}"
      cp "target/criterion/$side/new/estimates.json" \
        "target/criterion-rounds/$k/$side.json"
    done
  done
  cargo bench "${FEATURES[@]}" --bench workloads
fi
