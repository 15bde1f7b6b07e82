//! Benchmark 2: checkout + return with no query, raw deadpool against
//! pgwarden (criterion). The nanoseconds pgwarden adds per checkout.
//! With feature `sqlx-0_8`, row 2s: the same, raw sqlx 0.8 against
//! `pgwarden::sqlx::Pool` (a return is asynchronous in sqlx: the time is
//! the checkout plus handing the connection back to its return task; a
//! current-thread runtime runs that task between iterations, for both;
//! both pools with `test_before_acquire(false)`, sqlx's cheapest checkout:
//! its default ping, a round trip, would hide pgwarden's nanoseconds).
//!
//! `cargo bench --bench checkout`; `PGWARDEN_BENCH_SMOKE=1` for a quick run;
//! `PGWARDEN_BENCH_ORDER=pgwarden-first` measures pgwarden before the raw
//! pool (`benches/run.sh` runs it several times, alternating).

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use pgwarden_testing::TestServer;
// pgwarden's module over sqlx 0.8 (named `sqlx_0_8` when 0.9 is on too).
#[cfg(all(feature = "sqlx-0_8", not(feature = "sqlx-0_9")))]
use pgwarden::sqlx as warden_sqlx;
#[cfg(all(feature = "sqlx-0_8", feature = "sqlx-0_9"))]
use pgwarden::sqlx_0_8 as warden_sqlx;
#[cfg(feature = "sqlx-0_8")]
#[path = "sqlx_options.rs"]
mod sqlx_options;

fn checkout(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let db = rt.block_on(async {
        TestServer::shared()
            .unwrap()
            .create_database()
            .await
            .unwrap()
    });
    let raw = db.deadpool(16).unwrap();
    let warden = rt.block_on(async {
        pgwarden::Pool::builder(db.deadpool(16).unwrap())
            .name("bench")
            .build()
            .unwrap()
    });
    // Open a connection in each pool first: the benchmark measures reuse.
    rt.block_on(async {
        drop(raw.get().await.unwrap());
        drop(warden.get().await.unwrap());
    });
    let smoke = std::env::var_os("PGWARDEN_BENCH_SMOKE").is_some();
    let mut g = c.benchmark_group("checkout_return");
    if smoke {
        g.warm_up_time(Duration::from_millis(100))
            .measurement_time(Duration::from_millis(300))
            .sample_size(10);
    }
    let pgwarden_first = std::env::var("PGWARDEN_BENCH_ORDER").is_ok_and(|o| o == "pgwarden-first");
    for side in if pgwarden_first { [1, 0] } else { [0, 1] } {
        if side == 0 {
            g.bench_function("raw_deadpool", |b| {
                b.to_async(&rt)
                    .iter(|| async { drop(raw.get().await.unwrap()) })
            });
        } else {
            g.bench_function("pgwarden", |b| {
                b.to_async(&rt)
                    .iter(|| async { drop(warden.get().await.unwrap()) })
            });
        }
    }
    g.finish();
    #[cfg(feature = "sqlx-0_8")]
    sqlx_checkout(c, &rt, &db, smoke, pgwarden_first);
}

/// Row 2s: raw sqlx 0.8's `acquire` + drop against pgwarden's.
#[cfg(feature = "sqlx-0_8")]
fn sqlx_checkout(
    c: &mut Criterion,
    rt: &tokio::runtime::Runtime,
    db: &pgwarden_testing::TestDb,
    smoke: bool,
    pgwarden_first: bool,
) {
    use sqlx08::postgres::PgPoolOptions;
    let (raw, warden) = rt.block_on(async {
        let pool = || {
            PgPoolOptions::new()
                .max_connections(16)
                .connect_lazy_with(sqlx_options::sqlx_options(db))
        };
        let raw = pool();
        let warden = warden_sqlx::Pool::builder(pool())
            .name("bench-sqlx")
            .build()
            .unwrap();
        drop(raw.acquire().await.unwrap());
        drop(warden.acquire().await.unwrap());
        (raw, warden)
    });
    let mut g = c.benchmark_group("checkout_return_sqlx");
    if smoke {
        g.warm_up_time(Duration::from_millis(100))
            .measurement_time(Duration::from_millis(300))
            .sample_size(10);
    }
    for side in if pgwarden_first { [1, 0] } else { [0, 1] } {
        if side == 0 {
            g.bench_function("raw_sqlx", |b| {
                b.to_async(rt)
                    .iter(|| async { drop(raw.acquire().await.unwrap()) })
            });
        } else {
            g.bench_function("pgwarden", |b| {
                b.to_async(rt)
                    .iter(|| async { drop(warden.acquire().await.unwrap()) })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, checkout);
criterion_main!(benches);
