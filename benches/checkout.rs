//! Benchmark 2: checkout + return with no query, raw deadpool against
//! pgwarden (criterion). The nanoseconds pgwarden adds per checkout.
//!
//! `cargo bench --bench checkout`; `PGWARDEN_BENCH_SMOKE=1` for a quick run;
//! `PGWARDEN_BENCH_ORDER=pgwarden-first` measures pgwarden before raw
//! deadpool (`benches/run.sh` runs it several times, alternating).

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use pgwarden_testing::TestServer;

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
}

criterion_group!(benches, checkout);
criterion_main!(benches);
