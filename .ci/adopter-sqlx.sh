#!/usr/bin/env bash
# The sqlx adopter's path, built and run for real (issue 32), once per sqlx
# version (0.8 with its lockfile at 0.8.6, and 0.9):
#
# 1. A scratch crate whose code (`src/uses_pool.rs`) is written against
#    `sqlx::PgPool`: the executor (`query`, `query_as`, `query_scalar`,
#    `execute`, `fetch_one`, `fetch_all`), `begin`/`commit`/`rollback`,
#    `acquire` (a connection that derefs to `PgConnection`), `size`,
#    `num_idle`, `is_closed`, `close`. Its lockfile holds sqlx at the
#    version given. It compiles: built with step 3, as a module of its own
#    (`src/uses_sqlx.rs`, the code as written, not run), against the sqlx of
#    the same lockfile.
# 2. pgwarden is added (feature `sqlx-0_8` or `sqlx-0_9`), with no
#    `cargo update`: the lockfile keeps its sqlx, the tree has one sqlx,
#    and pgwarden builds without a warning.
# 3. `src/uses_pool.rs` has only its `use` line changed, to
#    `use pgwarden::sqlx::Pool as PgPool;`; `main.rs` wraps the sqlx pool
#    as the README says (`pgwarden::sqlx::Pool::builder(pg).build()`). It
#    builds (with step 2) and runs against a throwaway server, through
#    pgwarden's admission.
#
# Usage: bash .ci/adopter-sqlx.sh [0.8|0.9]... (default: both). The
# lockfile starts as a copy of pgwarden's own; the target directory is
# under target/, shared by both versions and by `.ci/adopter.sh`.
set -euo pipefail
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$(mktemp -d)
# The server user (postgres, when run as root) reaches its directory inside.
chmod 711 "$work"
export CARGO_TARGET_DIR="${ADOPTER_TARGET_DIR:-$src/target/adopter}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
# Line tables only, as pgwarden's own dev profile: less to write and link.
export CARGO_PROFILE_DEV_DEBUG=line-tables-only
versions=("$@")
((${#versions[@]})) || versions=(0.8 0.9)

# ---- a throwaway server on a Unix socket ----
pgbin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)
[[ -n "$pgbin" ]] || pgbin=$(dirname "$(command -v initdb)")
as_pg() {
    if [[ "$(id -u)" -eq 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi
}
pgdir="$work/pg"
mkdir -p "$pgdir"
[[ "$(id -u)" -ne 0 ]] || chown postgres "$pgdir"
port=$((40000 + RANDOM % 20000))
stop_pg() {
    as_pg "$pgbin/pg_ctl" -D "$pgdir/data" -m immediate stop >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap stop_pg EXIT
as_pg "$pgbin/initdb" -D "$pgdir/data" -A trust -U postgres >"$work/initdb.log" 2>&1 ||
    { cat "$work/initdb.log" >&2; exit 1; }
as_pg "$pgbin/pg_ctl" -D "$pgdir/data" -l "$pgdir/log" -w \
    -o "-c listen_addresses= -k $pgdir -p $port -c fsync=off" start >/dev/null
export DATABASE_URL="postgres://postgres@localhost/postgres?host=$pgdir&port=$port"

locked() { awk -v n="$1" '$0 == "name = \"" n "\"" { getline; gsub(/version = |"/, ""); print }' Cargo.lock | sort | paste -sd' ' -; }

adopter() {
    local v=$1 req feature
    case "$v" in
        0.8) req="0.8.6"; feature="sqlx-0_8" ;;
        0.9) req="0.9.1"; feature="sqlx-0_9" ;;
        *) echo "error: unknown sqlx version $v" >&2; exit 1 ;;
    esac
    local crate="$work/adopter-sqlx-$v"
    mkdir -p "$crate/src"
    cat >"$crate/Cargo.toml" <<TOML
[package]
name = "adopter-sqlx"
version = "0.1.0"
edition = "2021"
publish = false

[workspace]

[dependencies]
sqlx = { version = "$req", default-features = false, features = ["postgres", "runtime-tokio"] }
tokio = { version = "1", features = ["rt-multi-thread", "macros"] }
TOML

    # main.rs: builds the pool (the one place that names how).
    cat >"$crate/src/main.rs" <<'RS'
#![deny(warnings)]
mod uses_pool;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")?;
    let pg = sqlx::postgres::PgPoolOptions::new().max_connections(4).connect(&url).await?;
    // WRAP
    let pool = pg;
    let sum = uses_pool::work(&pool).await?;
    println!("adopter: sum {sum}");
    uses_pool::shut(&pool).await;
    Ok(())
}
RS

    # The adopter's code, written once against sqlx's PgPool; step 3
    # changes its `use` line only.
    cat >"$crate/src/uses_pool.rs" <<'RS'
use sqlx::PgPool;

pub async fn work(pool: &PgPool) -> Result<i64, sqlx::Error> {
    sqlx::query("DROP TABLE IF EXISTS items").execute(pool).await?;
    sqlx::query("CREATE TABLE items (id int8, name text)").execute(pool).await?;
    let mut tx = pool.begin().await?;
    for i in 1..=3_i64 {
        sqlx::query("INSERT INTO items VALUES ($1, $2)")
            .bind(i)
            .bind(format!("item {i}"))
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    let tx = pool.begin().await?;
    tx.rollback().await?;
    let rows: Vec<(i64, String)> = sqlx::query_as("SELECT id, name FROM items ORDER BY id")
        .fetch_all(pool)
        .await?;
    assert_eq!(rows.len(), 3);
    let mut conn = pool.acquire().await?;
    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut *conn).await?;
    assert_eq!(one, 1);
    drop(conn);
    println!("pool: size {}, idle {}, closed {}", pool.size(), pool.num_idle(), pool.is_closed());
    let sum: i64 = sqlx::query_scalar("SELECT sum(id)::int8 FROM items").fetch_one(pool).await?;
    Ok(sum)
}

pub async fn shut(pool: &PgPool) {
    pool.close().await;
    assert!(pool.is_closed());
}
RS

    cd "$crate"
    cp "$src/Cargo.lock" Cargo.lock
    # Resolved for this crate: the packages it does not use leave the copy.
    cargo tree --quiet >/dev/null
    echo "sqlx $v adopter lockfile: sqlx $(locked sqlx), sqlx-core $(locked sqlx-core)"
    [[ "$(locked sqlx)" == "$req" ]] || { echo "error: could not make the adopter lockfile" >&2; exit 1; }

    echo "== sqlx $v: 1-3. pgwarden added (feature $feature), no cargo update; the code as written and its copy with only the use line changed, in one build"
    cat >>Cargo.toml <<TOML
pgwarden = { path = "$src", features = ["$feature"] }
TOML
    # Step 1 in the same build: the adopter's code as written, kept beside
    # the changed copy (src/uses_sqlx.rs, a module of the crate, compiled
    # and not run), against the sqlx of the same lockfile. A `cargo check`
    # of its own before pgwarden was added built the metadata of sqlx's
    # whole tree a second time (about 40 % of this step's CPU).
    cp src/uses_pool.rs src/uses_sqlx.rs
    sed -i 's/^mod uses_pool;$/mod uses_pool;\n#[allow(dead_code)]\nmod uses_sqlx;/' src/main.rs
    grep -q '^mod uses_sqlx;$' src/main.rs
    sed -i 's/^use sqlx::PgPool;$/use pgwarden::sqlx::Pool as PgPool;/' src/uses_pool.rs
    grep -q '^use pgwarden::sqlx::Pool as PgPool;$' src/uses_pool.rs
    # Only the use line differs between the two.
    [[ "$(diff src/uses_sqlx.rs src/uses_pool.rs | grep -c '^[<>]')" == 2 ]] || {
        diff src/uses_sqlx.rs src/uses_pool.rs >&2
        echo "error: the changed copy differs from the adopter's code by more than its use line" >&2
        exit 1
    }
    grep -q '^use sqlx::PgPool;$' src/uses_sqlx.rs
    sed -i 's|^    // WRAP$|    let pg = pgwarden::sqlx::Pool::builder(pg).name("adopter").build()?;|' src/main.rs
    # pgwarden builds for a sqlx adopter without a warning (cargo replays a
    # path dependency's warnings even when it is built already).
    cargo build 2>&1 | tee "$work/build.log"
    if grep -q '^warning' "$work/build.log"; then
        echo "error: pgwarden builds with warnings for a sqlx adopter" >&2
        exit 1
    fi
    echo "after adding pgwarden: sqlx $(locked sqlx), sqlx-core $(locked sqlx-core), sqlx-postgres $(locked sqlx-postgres)"
    if [[ "$(locked sqlx)" != "$req" || "$(locked sqlx-core)" == *" "* ]]; then
        echo "error: the adopter's sqlx moved, or two sqlx in its tree: $(locked sqlx) / $(locked sqlx-core)" >&2
        exit 1
    fi
    "$CARGO_TARGET_DIR/debug/adopter-sqlx" | tee "$work/run.log"
    grep -q "adopter: sum 6" "$work/run.log"
    echo "adopter (sqlx $v): PgPool code runs against pgwarden::sqlx::Pool, lockfile kept without cargo update"
    cd "$src"
}

for v in "${versions[@]}"; do
    adopter "$v"
done
