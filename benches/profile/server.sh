#!/usr/bin/env bash
# Server instructions per lease pair (acquire + release of a new name) for
# each variant of pgwarden's two statements, and the seed's SQL: callgrind
# on a single-user PostgreSQL backend running PAIRS prepared executions of
# each (EXECUTE, a new name each) on a fresh copy of one data directory
# whose lease table holds ROWS released rows (VACUUM ANALYZEd), minus the
# same run of `SELECT $1, $2, $3` / `SELECT $1, $2`. With --native, also
# the CPU seconds (user + system, no valgrind) of NATIVE_PAIRS pairs of the
# null, seed and shipped pairs, for the conversion of instructions to µs.
#
#   bash benches/profile/server.sh [--native] [PAIRS] [ROWS]
#   ONLY="seed shipped" bash benches/profile/server.sh 2000 300000
#
# Variants: benches/profile/stmts/<variant>.sql ("acquire.sql" and
# "release.sql" are the shipped texts, checked against src/lease/table.rs
# by a unit test). Run as root (the backend runs as user postgres) or as
# the postgres user. Output: one line per run, and target/profile-server.txt.
set -euo pipefail
cd "$(dirname "$0")"
HERE=$PWD
NATIVE=0
if [[ "${1:-}" == "--native" ]]; then NATIVE=1; shift; fi
PAIRS=${1:-2000}
ROWS=${2:-20000}
NATIVE_PAIRS=${NATIVE_PAIRS:-20000}
PGBIN=${PGBIN:-/usr/lib/postgresql/15/bin}
WORK=${WORK:-$(mktemp -d /tmp/pgwarden-profile.XXXXXX)}
OUT=$HERE/../../target/profile-server.txt
mkdir -p "$(dirname "$OUT")"
as_pg() { if [[ $(id -un) == postgres ]]; then "$@"; else runuser -u postgres -- "$@"; fi; }
mkdir -p "$WORK"; chmod 755 "$WORK"; chown postgres "$WORK" 2>/dev/null || true

# One data directory, database "p": both tables, ROWS released pgwarden rows.
as_pg "$PGBIN/initdb" -D "$WORK/base" -U postgres -A trust --no-sync -E UTF8 --locale=C.UTF-8 >/dev/null
cat >> "$WORK/base/postgresql.conf" <<CONF
fsync = off
synchronous_commit = off
full_page_writes = off
log_checkpoints = off
CONF
single() { as_pg "$PGBIN/postgres" --single -D "$1" "$2"; }
echo "CREATE DATABASE p" | single "$WORK/base" postgres >/dev/null
{
  sed 's/--.*//' ../../sql/leases.sql | tr '\n' ' ' | sed 's/;/;\n/g'
  echo "CREATE TABLE leases (name text PRIMARY KEY, holder text NOT NULL, taken_at timestamptz NOT NULL DEFAULT now(), expires_at timestamptz NOT NULL);"
  echo "INSERT INTO pgwarden_leases (name, holder, token, taken_at, expires_at, renewed_at) SELECT 'old-' || g, '', nextval('pgwarden_leases_token_seq'), now(), now(), now() FROM generate_series(1, $ROWS) g;"
  echo "VACUUM ANALYZE pgwarden_leases;"
  # The seed's table is left as made (never vacuumed: the planner assumes
  # 10 pages, and its generic plans use the primary key). Vacuumed empty,
  # its release's generic plan is a sequential scan, through every row
  # deleted since: the count then grows with PAIRS.
} | single "$WORK/base" p >/dev/null

# input TAG ACQ REL N: the EXECUTEs of N pairs, new names
input() {
  python3 - "$@" <<'PY'
import sys
tag, acq, rel, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
text = lambda f: " ".join(open(f).read().split()).rstrip(";")
print("PREPARE acq(text,text,float8) AS " + text(acq) + ";\n")
print("PREPARE rel(text,text) AS " + text(rel) + ";\n")
for i in range(n):
    name = "n-%d-%s" % (i, tag)
    print("EXECUTE acq('%s','h-%s',60);\n" % (name, name))
    print("EXECUTE rel('%s','h-%s');\n" % (name, name))
PY
}

# run TAG ACQ REL: instructions of PAIRS pairs (fresh copy of the data)
run() {
  local tag=$1 dir=$WORK/run-$1
  rm -rf "$dir"; cp -a "$WORK/base" "$dir"
  input "$tag" "stmts/$2.sql" "stmts/$3.sql" "$PAIRS" > "$WORK/in-$tag.txt"
  as_pg valgrind --tool=callgrind --callgrind-out-file="$WORK/cg-$tag.out" \
    "$PGBIN/postgres" --single -D "$dir" p < "$WORK/in-$tag.txt" > "$WORK/out-$tag.txt" 2> "$WORK/err-$tag.txt"
  grep -q "ERROR" "$WORK/out-$tag.txt" "$WORK/err-$tag.txt" && { echo "$tag: an ERROR, see $WORK/err-$tag.txt" >&2; exit 1; }
  rm -rf "$dir"
  # The total, less single-user mode's printing of each statement's
  # columns and rows as text (debugStartup, debugtup): a client gets them
  # in binary (printtup, a few hundred instructions a row).
  callgrind_annotate --inclusive=yes "$WORK/cg-$tag.out" 2>/dev/null | awk '
    { gsub(",", "", $1) }
    /PROGRAM TOTALS/ && !t { t = $1 }
    /:debugtup |:debugStartup / { p += $1 }
    END { print t, t - p }'
}

# native TAG ACQ REL: CPU seconds (perf stat's task-clock) of NATIVE_PAIRS
# pairs, printing included, no valgrind
native() {
  local tag=$1 dir=$WORK/nrun-$1
  [[ -f "$WORK/nin-$tag.txt" ]] || input "$tag" "stmts/$2.sql" "stmts/$3.sql" "$NATIVE_PAIRS" > "$WORK/nin-$tag.txt"
  rm -rf "$dir"; cp -a "$WORK/base" "$dir"
  as_pg perf stat -x, -e task-clock -o "$WORK/perf-$tag" "$PGBIN/postgres" --single -D "$dir" p \
    < "$WORK/nin-$tag.txt" > /dev/null 2>&1
  rm -rf "$dir"
  awk -F, '$3 ~ /^task-clock/ { print $1 / 1000 }' "$WORK/perf-$tag"
}

VARIANTS=(
  "null null-acquire null-release"
  "seed seed-acquire seed-release"
  "shipped acquire release"
  "no-probe acquire-no-probe release"
  "no-token acquire-no-token release"
  "no-acquire-bound acquire-no-bound release"
  "token-only acquire-token-only release"
  "no-renewed-at acquire-no-renewed-at release"
  "release-delete acquire release-delete"
  "no-release-bound acquire release-no-bound"
  "no-bounds acquire-no-bound release-no-bound"
  "taken-at-raw acquire-taken-at-raw release"
  "bare acquire-bare release-bare"
)
: > "$OUT"
echo "# $(date -u '+%F %T') UTC; $PAIRS pairs per run, $ROWS released rows; load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT"
# Per pair, minus the null pair: all instructions (printing included) and
# those of the statements (printing excluded).
for v in "${VARIANTS[@]}"; do
  set -- $v
  # ONLY="seed shipped": those (and the null pair) alone
  [[ -n "${ONLY:-}" && $1 != null && " $ONLY " != *" $1 "* ]] && continue
  read -r all exec < <(run "$1" "$2" "$3")
  [[ $1 == null ]] && { null_all=$all; null_exec=$exec; }
  python3 -c "print('%-18s %8.1fk per pair, printing included %8.1fk' % ('$1', ($exec - $null_exec) / $PAIRS / 1000, ($all - $null_all) / $PAIRS / 1000))" | tee -a "$OUT"
done
# The conversion: the same runs without valgrind, NATIVE_ROUNDS rounds of
# the three interleaved, each run's CPU time (printing included, as in the
# instruction totals of callgrind's PROGRAM TOTALS, printed to cg-*.out).
if (( NATIVE )); then
  for k in $(seq "${NATIVE_ROUNDS:-5}"); do
    for v in "null null-acquire null-release" "seed seed-acquire seed-release" "shipped acquire release"; do
      set -- $v
      echo "native $1 $(native "$1" "$2" "$3") s for $NATIVE_PAIRS pairs; load $(cut -d' ' -f1 /proc/loadavg)" | tee -a "$OUT"
    done
  done
  # µs per 1,000 instructions: the shipped pair's and the seed's CPU time
  # above the null pair's (medians of the rounds), over their instructions
  # printing included.
  python3 - "$OUT" "$NATIVE_PAIRS" <<'PY' | tee -a "$OUT"
import re, statistics, sys
lines = open(sys.argv[1]).read().splitlines()
n = int(sys.argv[2])
t = {}
for l in lines:
    m = re.match(r"native (\S+) ([0-9.]+) s", l)
    if m:
        t.setdefault(m.group(1), []).append(float(m.group(2)))
ir = {l.split()[0]: float(l.split()[-1].rstrip("k")) for l in lines if "printing included" in l}
med = {k: statistics.median(v) for k, v in t.items()}
for side in ("seed", "shipped"):
    us = (med[side] - med["null"]) * 1e6 / n
    print("%s: %.2f µs a pair above the null pair for %.1fk instructions: %.3f µs per 1,000" % (side, us, ir[side], us / ir[side]))
d = (med["shipped"] - med["seed"]) * 1e6 / n
print("shipped - seed: %.2f µs a pair for %.1fk instructions: %.3f µs per 1,000" % (d, ir["shipped"] - ir["seed"], d / (ir["shipped"] - ir["seed"])))
PY
fi
echo "work files: $WORK"
