#!/usr/bin/env bash
# Reproduces every benchmark and writes BENCHMARKS.md (or, with --smoke, a
# quick check that the benches still build and run: target/BENCHMARKS.smoke.md).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--smoke" ]]; then
  PGWARDEN_BENCH_SMOKE=1 cargo bench --bench checkout -- --noplot
  cargo bench --bench workloads -- --smoke
else
  cargo bench --bench checkout -- --noplot
  cargo bench --bench workloads
fi
