#!/usr/bin/env bash
# Reproduces every benchmark and writes BENCHMARKS.md (or, with --smoke, a
# quick check that the benches still build and run: target/BENCHMARKS.smoke.md).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--smoke" ]]; then
  rm -rf target/criterion-rounds
  PGWARDEN_BENCH_SMOKE=1 cargo bench --bench checkout -- --noplot
  cargo bench --bench workloads -- --smoke
else
  # Row 2: criterion run ten times, the side measured first alternating
  # (the machine's speed drifts between runs more than within one); each
  # run's estimates kept for the report.
  rm -rf target/criterion-rounds
  for k in 1 2 3 4 5 6 7 8 9 10; do
    order=raw-first
    if (( k % 2 == 0 )); then order=pgwarden-first; fi
    PGWARDEN_BENCH_ORDER=$order cargo bench --bench checkout -- --noplot \
      --warm-up-time 1 --measurement-time 3
    mkdir -p "target/criterion-rounds/$k"
    for side in raw_deadpool pgwarden; do
      cp "target/criterion/checkout_return/$side/new/estimates.json" \
        "target/criterion-rounds/$k/$side.json"
    done
  done
  cargo bench --bench workloads
fi
