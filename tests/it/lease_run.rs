//! Running under leases against a real PostgreSQL: Leases::run (skip,
//! renewal, release, cancel on loss), the at-least hold, bad input refused
//! at the call, and futures dropped mid-flight. On every backend, from one
//! source.

use crate::support;

use std::ops::Bound;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgwarden::{Error, InvalidInput, LeaseError, LeaseOptions, LostReason, NameRule, OnLost};
use support::backend::{Backend, LeaseSettings, Settings};
use support::leases::row;
use support::{admin, db, eventually, within};

const S: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

// ---- Leases::run ----

backends!(run_skips_renews_releases_and_cancels);
async fn run_skips_renews_releases_and_cancels<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let leases = B::leases(&B::build(&db, &Settings::new("run", 3)));
    // Runs; a concurrent run skips; it outlives its TTL, renewed. A 2 s
    // TTL renewed every 100 ms: lost only if a loaded machine stalls the
    // renewals for 1.75 s.
    let l2 = leases.clone();
    let opts = LeaseOptions::new(2 * S).renew_every(100 * MS);
    let watcher = &admin;
    let out = B::run_job(&leases, "nightly", &opts, |lease| async move {
        let inner = B::run_job(&l2, "nightly", &LeaseOptions::new(S), |_| async {})
            .await
            .unwrap();
        assert!(inner.is_none(), "a second run skips");
        // The scenario: the run outlives its TTL, on the database's
        // clock, and its term is still in force there (renewed).
        eventually(30 * S, "the run past its first term, renewed", || async {
            watcher
                .query_one(
                    "SELECT now() > taken_at + interval '2 s' AND expires_at > now() \
                           FROM pgwarden_leases WHERE name = 'nightly'",
                    &[],
                )
                .await
                .unwrap()
                .get::<_, bool>(0)
        })
        .await;
        assert!(!lease.is_lost());
        lease.term().token
    })
    .await
    .unwrap();
    assert!(out.is_some());
    // Released after: free at once.
    assert_eq!(row(&admin, "nightly").await, None);

    // OnLost::Cancel: the job is dropped at once when its lease is taken.
    let dropped = Arc::new(AtomicBool::new(false));
    struct Flag(Arc<AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let opts = LeaseOptions::new(S).on_lost(OnLost::Cancel);
    let flag = Flag(dropped.clone());
    let admin2 = &admin;
    let err = within(5 * S, "cancelled run", B::run_job(&leases, "steal-me", &opts, |_| async move {
        let _flag = flag;
        // Another holder takes the row over.
        admin2
            .batch_execute("UPDATE pgwarden_leases SET holder = 'thief', token = 0 WHERE name = 'steal-me'")
            .await
            .unwrap();
        tokio::time::sleep(60 * S).await;
    }))
    .await
    .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Lease(LeaseError::Lost {
                reason: LostReason::Taken,
                ..
            })
        ),
        "{err}"
    );
    assert!(dropped.load(Ordering::SeqCst));
    assert_eq!(row(&admin, "steal-me").await, Some(("thief".to_owned(), 0)));

    // OnLost::Signal (default): the job sees the signal and finishes its way.
    let out = within(
        5 * S,
        "signalled run",
        B::run_job(
            &leases,
            "steal-me-too",
            &LeaseOptions::new(S),
            |lease| async move {
                admin2
                    .batch_execute(
                        "UPDATE pgwarden_leases SET holder = 'thief' WHERE name = 'steal-me-too'",
                    )
                    .await
                    .unwrap();
                lease.lost().await
            },
        ),
    )
    .await
    .unwrap();
    assert_eq!(out, Some(LostReason::Taken));
}

// ---- at-least-hold ----

backends!(at_least_hold_outlives_an_early_release);
async fn at_least_hold_outlives_an_early_release<B: Backend>() {
    let db = db().await;
    let leases = B::leases(&B::build(&db, &Settings::new("hold", 2)));
    let opts = LeaseOptions::new(S).at_least(1500 * MS);
    let start = Instant::now();
    let first = B::acquire(&leases, "mail", &opts, None)
        .await
        .unwrap()
        .unwrap();
    let first_token = first.term().token;
    B::release(first).await.unwrap();
    // Released, still held: nobody gets it before 1.5 s.
    assert!(B::acquire(&leases, "mail", &LeaseOptions::new(S), None)
        .await
        .unwrap()
        .is_none());
    let second = B::acquire(&leases, "mail", &LeaseOptions::new(S), Some(5 * S))
        .await
        .unwrap()
        .expect("taken within the wait");
    assert!(start.elapsed() >= 1400 * MS, "{:?}", start.elapsed());
    // A released row is not a take-over.
    assert_eq!(second.term().took_over_from.as_deref(), None);
    assert!(second.term().token > first_token);
    B::release(second).await.unwrap();
    assert!(B::acquire(&leases, "mail", &LeaseOptions::new(S), None)
        .await
        .unwrap()
        .is_some());
}

// ---- bad input ----

backends!(bad_input_is_a_typed_error_at_the_call);
async fn bad_input_is_a_typed_error_at_the_call<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let pool = B::build(&db, &Settings::new("bad", 2));
    let invalid = |e: Error| assert!(matches!(e, Error::Invalid(_)), "{e}");
    // Each refusal names the value and the rule it breaks.
    let name_rule = |e: Error| match e {
        Error::Invalid(InvalidInput::Name { what, value, rule }) => (what, value, rule),
        e => panic!("{e}"),
    };
    let table_cases: [(&str, &str, NameRule); 8] = [
        ("", "", NameRule::Empty),
        (
            "lea ses",
            "lea ses",
            NameRule::Character {
                found: ' ',
                allowed: "",
            },
        ),
        (
            "leases\"; DROP TABLE x; --",
            "",
            NameRule::Character {
                found: '"',
                allowed: "",
            },
        ),
        (
            "a.b.c",
            "a.b.c",
            NameRule::Character {
                found: '.',
                allowed: "",
            },
        ),
        ("app.", "", NameRule::Empty),
        (
            "x'y",
            "x'y",
            NameRule::Character {
                found: '\'',
                allowed: "",
            },
        ),
        (
            "n\0ul",
            "n\0ul",
            NameRule::Character {
                found: '\0',
                allowed: "",
            },
        ),
        (&"t".repeat(54), "", NameRule::TooLong { len: 54, max: 53 }),
    ];
    for (table, part, want) in table_cases {
        let named = LeaseSettings::default().table(table);
        let (what, value, rule) = name_rule(B::leases_with(&pool, &named).unwrap_err());
        assert_eq!(what, "lease table name");
        if !part.is_empty() {
            assert_eq!(value, part, "{table:?}");
        }
        match (&rule, &want) {
            (NameRule::Character { found, .. }, NameRule::Character { found: w, .. }) => {
                assert_eq!(found, w, "{table:?}")
            }
            _ => assert_eq!(rule, want, "{table:?}"),
        }
    }
    let unbounded = LeaseSettings::default().statement_timeout(Duration::ZERO);
    match B::leases_with(&pool, &unbounded).unwrap_err() {
        Error::Invalid(InvalidInput::Duration {
            value, min, max, ..
        }) => {
            assert_eq!(value, Duration::ZERO);
            assert_eq!(min, Bound::Excluded(Duration::ZERO));
            assert_eq!(max, Bound::Included(24 * 3600 * S));
        }
        e => panic!("{e}"),
    }
    let leases = B::leases(&pool);
    let long = "n".repeat(129);
    for name in ["", "a\0b", "new\nline", long.as_str()] {
        invalid(
            B::acquire(&leases, name, &LeaseOptions::new(S), None)
                .await
                .unwrap_err(),
        );
        invalid(
            B::acquire(&leases, name, &LeaseOptions::new(S), Some(S))
                .await
                .unwrap_err(),
        );
        let opts = LeaseOptions::default();
        invalid(
            B::run_job(&leases, name, &opts, |_| async {})
                .await
                .unwrap_err(),
        );
    }
    for ttl in [Duration::ZERO, 999 * MS, 25 * 3600 * S, Duration::MAX] {
        let e = B::acquire(&leases, "x", &LeaseOptions::new(ttl), None)
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Invalid(InvalidInput::Duration { what: "lease TTL", value, min: Bound::Included(min), max: Bound::Included(max) })
                    if value == ttl && min == S && max == 24 * 3600 * S
            ),
            "{e}"
        );
    }
    for opts in [
        LeaseOptions::new(2 * S).renew_every(2 * S),
        LeaseOptions::new(2 * S).renew_every(3 * S),
        LeaseOptions::new(2 * S).renew_every(Duration::ZERO),
        LeaseOptions::new(2 * S).safety_margin(2 * S),
        LeaseOptions::new(2 * S).at_least(400 * 24 * 3600 * S),
    ] {
        invalid(B::acquire(&leases, "x", &opts, None).await.unwrap_err());
        invalid(
            B::run_job(&leases, "x", &opts, |_| async {})
                .await
                .unwrap_err(),
        );
    }
    // Refused before any statement: nothing was installed.
    assert_eq!(B::lease_stats(&leases).statements, 0);
    let exists: bool = admin
        .query_typed_one("SELECT to_regclass('pgwarden_leases') IS NOT NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!exists);
    // A name that looks like SQL is only data.
    let odd = "x'); DROP TABLE pgwarden_leases; --";
    let lease = B::acquire(&leases, odd, &LeaseOptions::new(S), None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row(&admin, odd).await.unwrap().1, lease.term().token);
    B::release(lease).await.unwrap();
}

// ---- cancellation ----

backends!(dropped_futures_leave_no_connection_and_no_stray_lease);
async fn dropped_futures_leave_no_connection_and_no_stray_lease<B: Backend>() {
    let db = db().await;
    B::install(&B::leases(&B::build(&db, &Settings::new("cancel", 2))))
        .await
        .unwrap();
    // Drop acquisitions and releases after every number of polls: each
    // number on a pool of 2 of its own, with lease names of its own, all at
    // once. (A dropped statement's cancel is sent on another connection of
    // its pool, which waits up to 2 s for one when the other is out too:
    // one number after another on one pool, the twelve took 20 s.)
    futures_util::future::join_all((0..12).map(|polls| drop_after::<B>(&db, polls))).await;
}

/// [`dropped_futures_leave_no_connection_and_no_stray_lease`] for one number
/// of polls: an acquisition and a release, each polled `polls` times (or
/// until it completes: a completed future must not be polled again), then
/// dropped; then no connection stays out, a dropped acquisition registers
/// nothing, and whatever it took in the database expires after its TTL.
async fn drop_after<B: Backend>(db: &pgwarden_testing::TestDb, polls: usize) {
    let pool = B::build(db, &Settings::new("cancel", 2));
    let leases = B::leases(&pool);
    let (c_name, r_name) = (format!("c{polls}"), format!("r{polls}"));
    let opts = LeaseOptions::new(S);
    let mut fut = B::acquire(&leases, &c_name, &opts, None);
    for _ in 0..polls {
        if futures_util::poll!(&mut fut).is_ready() {
            break;
        }
        tokio::task::yield_now().await;
    }
    drop(fut);
    if let Some(lease) = B::acquire(&leases, &r_name, &LeaseOptions::new(S), None)
        .await
        .unwrap()
    {
        let mut fut = B::release(lease);
        for _ in 0..polls {
            if futures_util::poll!(&mut fut).is_ready() {
                break;
            }
            tokio::task::yield_now().await;
        }
        drop(fut);
    }
    // A connection kept out never comes back: 10 s is for a loaded
    // machine, where a dropped statement's cancel can wait 2 s for a
    // connection of its own.
    eventually(10 * S, "connections back", || {
        std::future::ready(B::status(&pool).in_use == 0)
    })
    .await;
    assert_eq!(B::lease_stats(&leases).held, 0);
    // Taken again once the strays' 1 s terms end (a wait that only stops
    // a stray renewed for ever), and held: with a 30 s
    // TTL of their own, so that the first is not lost while a loaded
    // machine takes the second (with 1 s, it was, at load 16).
    let again = LeaseOptions::new(30 * S);
    let c = B::acquire(&leases, &c_name, &again, Some(10 * S))
        .await
        .unwrap()
        .expect("taken within the wait");
    let r = B::acquire(&leases, &r_name, &again, Some(10 * S))
        .await
        .unwrap()
        .expect("taken within the wait");
    assert!(!c.is_lost() && !r.is_lost(), "{polls} polls");
}
