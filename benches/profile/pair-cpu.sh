#!/usr/bin/env bash
# CPU per lease pair, client and whole server, of one side of rows 6a/6b:
# `workloads --profile-single plain|pgwarden PAIRS [INSTANCES]` against a
# running PostgreSQL of its own (every process of it counted: backends, WAL
# writer, checkpointer, ...), ROUNDS rounds with the two sides alternating.
#
#   PGDATA=/path/to/data DATABASE_URL="host=... port=... user=postgres dbname=postgres" \
#     bash benches/profile/pair-cpu.sh [PAIRS] [INSTANCES] [ROUNDS]
#
# The workloads binary: $B, else the newest target/release/deps/workloads-*
# (`cargo bench --bench workloads --no-run` builds it). Client CPU: user +
# system time of that process (/usr/bin/time); server CPU: utime + stime +
# the reaped children's of the postmaster and its children (/proc/<pid>/stat),
# before and after.
set -euo pipefail
cd "$(dirname "$0")/../.."
PAIRS=${1:-20000}
INSTANCES=${2:-1}
ROUNDS=${3:-4}
: "${PGDATA:?the data directory of the server}"
: "${DATABASE_URL:?the server}"
B=${B:-$(ls -t target/release/deps/workloads-* | grep -v '\.d$' | head -1)}
HZ=$(getconf CLK_TCK)
server_ticks() {
  local pm t=0 p s
  pm=$(head -1 "$PGDATA/postmaster.pid")
  for p in $pm $(pgrep -P "$pm"); do
    s=$(awk '{print $14 + $15 + $16 + $17}' "/proc/$p/stat" 2>/dev/null || echo 0)
    t=$((t + s))
  done
  echo $t
}
for r in $(seq "$ROUNDS"); do
  sides=(plain pgwarden)
  (( r % 2 == 0 )) && sides=(pgwarden plain)
  for side in "${sides[@]}"; do
    s0=$(server_ticks)
    out=$( { /usr/bin/time -f "time %U %S" "$B" --profile-single "$side" "$PAIRS" "$INSTANCES"; } 2>&1 )
    sleep 0.5 # for the WAL writer
    s1=$(server_ticks)
    python3 - "$side" "$PAIRS" "$s0" "$s1" "$HZ" "$out" <<'PY'
import sys
side, n, s0, s1, hz, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
u, s = [float(x) for x in [l for l in out.splitlines() if l.startswith("time ")][-1].split()[1:]]
line = [l for l in out.splitlines() if "pairs in" in l][-1]
load = open("/proc/loadavg").read().split()[0]
print("%-8s client %5.1f µs/pair, server %5.1f µs/pair | %s | load %s" % (side, (u + s) * 1e6 / n, (s1 - s0) * 1e6 / hz / n, line.split(": ", 1)[1], load))
PY
  done
done

