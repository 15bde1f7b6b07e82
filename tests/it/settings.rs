//! Settings that cannot work are `BuildError`s that name the setting and the
//! value, never panics or aborts; and pgwarden owns the capacity of the
//! deadpool pool it wraps: a deadpool pool in use at build is refused, and
//! one resized or drained behind pgwarden's back is reported within the
//! checkout's bound.

use crate::support;

use std::time::{Duration, Instant};

use pgwarden::{BuildError, CheckoutError, Error, Lane, LimitsError, Pool};

/// The largest pool pgwarden accepts (PostgreSQL's own `max_connections` limit).
const MAX_POOL_SIZE: usize = 262_143;
use support::{db, within};

/// A wait bound that only a wrong behaviour waits out…
const HOUR: Duration = Duration::from_secs(3600);
/// …and the guard against that hang: the right behaviour returns well
/// within it on any machine.
const GUARD: Duration = Duration::from_secs(60);

#[test]
fn pool_sizes_past_the_maximum_are_errors_not_panics_or_aborts() {
    for size in [MAX_POOL_SIZE + 1, 1 << 40, usize::MAX] {
        let e = Pool::from_url("host=/tmp user=x", size).unwrap_err();
        let want = LimitsError::TooLarge {
            size,
            max: MAX_POOL_SIZE,
        };
        assert!(matches!(&e, BuildError::Limits(l) if *l == want), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains(&size.to_string()) && msg.contains("262143"),
            "names both numbers: {msg}"
        );
        let mut cfg = deadpool_postgres::Config::new();
        cfg.host = Some("/tmp".into());
        cfg.pool = Some(deadpool_postgres::PoolConfig::new(size));
        let e = Pool::from_config(&cfg).unwrap_err();
        assert!(matches!(&e, BuildError::Limits(l) if *l == want), "{e}");
    }
}

#[tokio::test]
async fn every_settings_error_names_the_setting_and_the_value() {
    let db = db().await;
    let e = Pool::builder(db.deadpool(4).unwrap())
        .housekeeping_interval(Duration::ZERO)
        .build()
        .unwrap_err();
    assert!(
        matches!(
            e,
            BuildError::InvalidDuration {
                setting: "housekeeping_interval",
                value: Duration::ZERO,
                why: "must be above zero"
            }
        ),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "invalid housekeeping_interval 0ns: must be above zero"
    );
    let e = Pool::builder(db.deadpool(4).unwrap())
        .census_interval(Some(Duration::ZERO))
        .build()
        .unwrap_err();
    assert!(
        e.to_string().starts_with("invalid census_interval 0ns"),
        "{e}"
    );

    let e = Pool::builder(db.deadpool(1).unwrap()).build().unwrap_err();
    assert!(
        matches!(e, BuildError::Limits(LimitsError::TooSmall { size: 1 })),
        "{e}"
    );
    assert!(e.to_string().contains("pool size 1 is too small"), "{e}");
    let e = Pool::builder(db.deadpool(4).unwrap())
        .lane(Lane::Control, 3, 2)
        .build()
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "control lane reserves 3 but its maximum is 2"
    );
    let e = Pool::builder(db.deadpool(4).unwrap())
        .lane(Lane::Lease, 0, 1)
        .build()
        .unwrap_err();
    assert!(
        e.to_string().contains("lease lane maximum 1 is too small"),
        "{e}"
    );
    let e = Pool::builder(db.deadpool(4).unwrap())
        .lane(Lane::Probe, 0, 1)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("the probe lane reserves 0"), "{e}");
    let e = Pool::builder(db.deadpool(4).unwrap())
        .lane(Lane::SessionLock, 0, 3)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("session_lock maximum 3"), "{e}");
    let e = Pool::builder(db.deadpool(4).unwrap())
        .name("no spaces")
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("\"no spaces\""), "{e}");
}

#[tokio::test]
async fn a_deadpool_pool_in_use_or_closed_is_refused_at_build() {
    let db = db().await;
    let inner = db.deadpool(4).unwrap();
    let held = inner.get().await.unwrap();
    let e = Pool::builder(inner.clone()).build().unwrap_err();
    assert!(
        matches!(
            e,
            BuildError::DeadpoolInUse {
                in_use: 1,
                max_size: 4
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("1 of 4 connections out"), "{e}");
    drop(held);
    inner.close();
    let e = Pool::builder(inner).build().unwrap_err();
    assert!(matches!(e, BuildError::DeadpoolClosed), "{e}");
}

#[tokio::test]
async fn deadpool_drained_behind_pgwardens_back_is_reported_within_the_bound() {
    let db = db().await;
    let inner = db.deadpool(3).unwrap();
    // The pool's own wait bound is an hour: a checkout that ignored the
    // 500 ms it was given, or waited on deadpool for objects that never come
    // back, would hang past the guard (no clock on the machine's speed).
    let pool = Pool::builder(inner.clone())
        .name("drained")
        .pooler(pgwarden::PoolerMode::Direct)
        .census_interval(None)
        .wait_timeout(HOUR)
        .build()
        .unwrap();
    // The caller kept a clone and takes two of the three objects with it.
    let stolen = (inner.get().await.unwrap(), inner.get().await.unwrap());
    let first = pool.get().await.unwrap();
    let start = Instant::now();
    let e = within(
        GUARD,
        "the mismatch reported at the bound",
        pool.get_within(Duration::from_millis(500)),
    )
    .await
    .unwrap_err();
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(500),
        "before its bound: {took:?}"
    );
    match &e {
        Error::Checkout(CheckoutError::DeadpoolMismatch {
            size,
            deadpool_max,
            in_use,
            ..
        }) => assert_eq!((*size, *deadpool_max, *in_use), (3, 3, 2)),
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().contains("held outside pgwarden"), "{e}");
    // The objects come back: checkouts work again.
    drop(stolen);
    let second = pool.get_within(GUARD).await.unwrap();
    drop((first, second));

    // Resized behind its back: answered at once, naming both sizes.
    inner.resize(1);
    let held = pool.get().await.unwrap();
    // At once: with an hour to wait, a checkout that waited would hang.
    let e = within(GUARD, "the resize answered at once", pool.get_within(HOUR))
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("deadpool's max_size is 1, pgwarden owns 3"),
        "{e}"
    );
    drop(held);
    assert_eq!(inner.status().max_size, 1);
}
