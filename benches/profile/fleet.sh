#!/usr/bin/env bash
# Server side of row 6b alone: 16 sessions (pgbench, -M prepared, 2
# threads) each running acquire + release of a new name with one variant of
# the two statements (benches/profile/stmts/<acq>.sql, <rel>.sql; `$1` and
# `$2` become a random name, `$3` 60), on a fresh copy of a database with
# both lease tables, under benches/profile/waits.py (CPU per pair of every
# server process and of pgbench, run-queue time, wake-ups, wait events).
# Rounds interleave the variants (A B C … then … C B A). NAMES=seq: names
# 0, 1, 2, … in the order row 6b takes them, instead of random ones.
#
#   DATABASE_URL="host=... port=... user=postgres dbname=postgres" PGDATA=... \
#     bash benches/profile/fleet.sh [PAIRS_PER_CLIENT] [ROUNDS] "seed:seed-acquire:seed-release shipped:acquire:release ..."
set -euo pipefail
cd "$(dirname "$0")"
PER=${1:-3000}
ROUNDS=${2:-2}
VARIANTS=${3:-"seed:seed-acquire:seed-release shipped:acquire:release"}
: "${DATABASE_URL:?}" "${PGDATA:?}"
psql -X -q "$DATABASE_URL" -f waits.sql
psql -X -q "$DATABASE_URL" -c "DROP DATABASE IF EXISTS pgw_fleet_tpl" -c "CREATE DATABASE pgw_fleet_tpl"
tpl_url="${DATABASE_URL/dbname=postgres/dbname=pgw_fleet_tpl}"
psql -X -q "$tpl_url" -f ../../sql/leases.sql
psql -X -q "$tpl_url" -c "CREATE TABLE leases (name text PRIMARY KEY, holder text NOT NULL, taken_at timestamptz NOT NULL DEFAULT now(), expires_at timestamptz NOT NULL)"
tmp=$(mktemp -d)
script() { # ACQ REL -> pgbench script
  if [[ "${NAMES:-random}" == seq ]]; then
    # s-0, s-1, … as row 6b names them: a counter per session (pgbench's
    # variables outlive a transaction), interleaved across the 16
    printf '%s\n' '\set i :i + 1' '\set n :i * 16 + :client_id'
  else
    printf '%s\n' '\set n random(1, 1000000000000000)'
  fi
  for f in "$1" "$2"; do
    tr '\n' ' ' < "stmts/$f.sql" | sed -e 's/\$1/:n/g; s/\$2/:n/g; s/\$3/60/g'
    echo ";"
  done
}
order=($VARIANTS)
for r in $(seq "$ROUNDS"); do
  list=("${order[@]}")
  if (( r % 2 == 0 )); then
    list=(); for ((i=${#order[@]}-1; i>=0; i--)); do list+=("${order[i]}"); done
  fi
  for v in "${list[@]}"; do
    IFS=: read -r tag acq rel <<< "$v"
    script "$acq" "$rel" > "$tmp/$tag.pgb"
    db=pgw_fleet_$tag
    psql -X -q "$DATABASE_URL" -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db TEMPLATE pgw_fleet_tpl"
    url="${DATABASE_URL/dbname=postgres/dbname=$db}"
    SAMPLE_AFTER=0.3 CMD="pgbench -n -M prepared -c 16 -j 2 -t $PER -D i=0 -f $tmp/$tag.pgb '$url'" \
      python3 waits.py "$tag" $((PER * 16)) 16 2
  done
done
rm -r "$tmp"
