//! Table leases on every backend, from one source: each test is a generic
//! `async fn` over [`Backend`], run by [`backends!`] on the deadpool pool
//! and (features `sqlx-0_8`, `sqlx-0_9`) on pgwarden's sqlx pool over sqlx
//! 0.8 and 0.9: acquire, renew and release; a held name refused; the
//! take-over of an unrenewed term with a larger token, and its holder's
//! lost signal; the fence (a commit that says Ok has landed; refused after
//! a take-over, its write not landed); the scheduler across two instances.
//!
//! Then the mixed fleet: a deadpool instance and a sqlx instance on one
//! lease table, contending for one name in many rounds, taking it over from
//! each other in both directions; every term writes its token to a ledger
//! through a fenced transaction, and the ledger shows one holder at a time,
//! commits in token order.

use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use pgwarden::{Error, Job, LeaseError, LeaseHandle, LeaseOptions, LostReason};
use support::backend::{Backend, Settings, LEDGER};
use support::leases::short;
use support::stalls::Stalls;
use support::{admin, db, eventually, within};
use tokio_postgres::Client;

const S: Duration = Duration::from_secs(1);
/// The guard against a hang: only a wrong behaviour waits it out.
const GUARD: Duration = Duration::from_secs(60);

/// Marks `name`'s current term expired in the database (what a holder cut
/// off for longer than its TTL looks like to the others).
async fn expire(admin: &Client, name: &str) {
    let n = admin
        .execute(
            "UPDATE pgwarden_leases SET expires_at = now() - interval '1 ms' WHERE name = $1",
            &[&name],
        )
        .await
        .expect("expire");
    assert_eq!(n, 1);
}

/// Expires `name`'s term and takes it over on `l`: again if a renewal of
/// the old term came between the two (it renews even an expired term).
async fn take_over<B: Backend>(
    admin: &Client,
    l: &B::Leases,
    name: &str,
    opts: &LeaseOptions,
) -> B::Lease {
    let began = std::time::Instant::now();
    loop {
        expire(admin, name).await;
        if let Some(lease) = get::<B>(l, name, opts, None).await {
            return lease;
        }
        assert!(began.elapsed() < GUARD, "{name} never taken over");
    }
}

/// `Leases::acquire` on `l`, which must not fail.
async fn get<B: Backend>(
    l: &B::Leases,
    name: &str,
    opts: &LeaseOptions,
    wait: Option<Duration>,
) -> Option<B::Lease> {
    B::acquire(l, name, opts, wait).await.unwrap()
}

/// Terms of 60 s (renewed every 15 s): a test expires them by hand.
fn long() -> LeaseOptions {
    LeaseOptions::new(60 * S)
}

/// The ledger's rows, by token: (token, prev).
async fn ledger(admin: &Client) -> Vec<(i64, Option<i64>)> {
    admin
        .query("SELECT token, prev FROM ledger ORDER BY token", &[])
        .await
        .expect("ledger")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Each write saw the one before it in token order, and nothing after: no
/// two terms wrote at once, and they committed in token order.
fn assert_chained(rows: &[(i64, Option<i64>)]) {
    let mut prev = None;
    for &(token, seen) in rows {
        assert_eq!(
            seen, prev,
            "the write of token {token} saw {seen:?}, not the token before it: {rows:?}"
        );
        prev = Some(token);
    }
}

backends!(lease_acquire_renew_release);
async fn lease_acquire_renew_release<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("lease-arr", 4));
    let leases = B::leases(&pool);
    assert!(B::install(&leases).await.unwrap(), "a fresh database");
    let lease = get::<B>(&leases, "arr", &short(), None)
        .await
        .expect("a free name");
    let first = lease.term().token;
    // Renewed in the background (every 1 s): one renewal at least.
    eventually(GUARD, "a renewal", || {
        std::future::ready(B::lease_stats(&leases).renewed >= 1)
    })
    .await;
    assert!(!lease.is_lost());
    // The operator's listing reads it back, every column decoded.
    let rows = B::rows(&leases).await.unwrap();
    let [row] = &rows[..] else {
        panic!("one row: {rows:?}")
    };
    let term = lease.term();
    assert_eq!(
        (&*row.name, &*row.holder, row.token),
        ("arr", &*term.holder, first)
    );
    // Times travel as float8 seconds one way, timestamptz the other.
    let close = |a: Duration, b: Duration| a.abs_diff(b) < Duration::from_millis(1);
    let at = |t: std::time::SystemTime| t.duration_since(UNIX_EPOCH).unwrap();
    assert!(close(at(row.taken_at), at(term.taken_at)), "{row:?}");
    assert!(row.live && row.expires_in_s > 0.0, "{row:?}");
    assert!(row.ttl.is_some_and(|t| close(t, 3 * S)), "{row:?}");
    assert_eq!((row.held_until, row.blocker_pid), (None, None), "{row:?}");
    B::release(lease).await.unwrap();
    let a = admin(&db).await;
    assert_eq!(support::leases::row(&a, "arr").await, None, "released");
    // Free again at once, under a larger token.
    let again = get::<B>(&leases, "arr", &short(), None)
        .await
        .expect("free after its release");
    assert!(again.term().token > first);
    assert!(again.term().took_over_from.is_none());
    B::release(again).await.unwrap();
    assert_eq!(B::lease_stats(&leases).held, 0);
}

backends!(lease_held_name_is_refused);
async fn lease_held_name_is_refused<B: Backend>() {
    let db = db().await;
    let pool = B::build(&db, &Settings::new("lease-held", 4));
    let (a, b) = (B::leases(&pool), B::leases(&pool));
    let held = get::<B>(&a, "held", &short(), None).await.unwrap();
    assert!(get::<B>(&b, "held", &short(), None).await.is_none());
    // A wait shorter than the term: still refused, the holder untouched.
    assert!(get::<B>(&b, "held", &short(), Some(S / 2)).await.is_none());
    assert!(!held.is_lost());
    B::release(held).await.unwrap();
    let next = get::<B>(&b, "held", &short(), None)
        .await
        .expect("free once released");
    B::release(next).await.unwrap();
}

backends!(lease_taken_over_after_its_ttl_and_its_holder_told);
/// Holder A's pool closes (it stops renewing): B takes the name over once
/// the term has expired, with a larger token, naming A's term; A's lost
/// signal fires (its local deadline, before the expiry).
async fn lease_taken_over_after_its_ttl_and_its_holder_told<B: Backend>() {
    let db = db().await;
    let pool_a = B::build(&db, &Settings::new("lease-ttl-a", 3));
    let pool_b = B::build(&db, &Settings::new("lease-ttl-b", 3));
    let (a, b) = (B::leases(&pool_a), B::leases(&pool_b));
    let crashed = get::<B>(&a, "ttl", &short(), None).await.unwrap();
    B::close(&pool_a).await;
    let taken = get::<B>(&b, "ttl", &short(), Some(GUARD)).await;
    let taken = taken.expect("taken over within the wait");
    let (old, new) = (crashed.term(), taken.term());
    assert!(new.token > old.token, "{old:?} then {new:?}");
    assert_eq!(new.took_over_from.as_ref(), Some(&old.holder));
    assert_eq!(
        within(GUARD, "A's lost signal", crashed.lost()).await,
        LostReason::Deadline
    );
    B::release(taken).await.unwrap();
}

backends!(lease_fence_lands_while_held_and_refuses_after_loss);
/// A fenced commit that says Ok has landed; after a take-over the old
/// holder's fence is refused, its write never lands, and its lost signal
/// says why; the new holder's lands.
async fn lease_fence_lands_while_held_and_refuses_after_loss<B: Backend>() {
    let db = db().await;
    let a_db = admin(&db).await;
    a_db.batch_execute(LEDGER).await.unwrap();
    let pool = B::build(&db, &Settings::new("lease-fence", 4));
    let (a, b) = (B::leases(&pool), B::leases(&pool));
    let old = get::<B>(&a, "fence", &long(), None).await.unwrap();
    B::fenced_write(&pool, &old).await.unwrap();
    assert_eq!(ledger(&a_db).await, [(old.term().token, None)], "landed");

    let new = take_over::<B>(&a_db, &b, "fence", &long()).await;
    assert!(new.term().token > old.term().token);
    match B::fenced_write(&pool, &old).await {
        Err(Error::Lease(LeaseError::Lost { reason, .. })) => {
            assert_eq!(reason, LostReason::Taken)
        }
        other => panic!("a stale holder's fence: {other:?}"),
    }
    assert_eq!(
        within(GUARD, "the old term's lost signal", old.lost()).await,
        LostReason::Taken
    );
    B::fenced_write(&pool, &new).await.unwrap();
    let rows = ledger(&a_db).await;
    assert_eq!(
        rows,
        [
            (old.term().token, None),
            (new.term().token, Some(old.term().token))
        ],
        "the stale write did not land"
    );
    B::release(new).await.unwrap();
}

backends!(lease_scheduler_runs_a_job_once_per_period_across_two_instances);
async fn lease_scheduler_runs_a_job_once_per_period_across_two_instances<B: Backend>() {
    let db = db().await;
    let log: Arc<parking_lot::Mutex<Vec<(usize, i64)>>> = Arc::default();
    let mut schedulers = Vec::new();
    let mut pools = Vec::new();
    for i in 0..2 {
        let name = ["lease-sched-0", "lease-sched-1"][i];
        let pool = B::build(&db, &Settings::new(name, 3));
        let leases = B::leases(&pool);
        B::install(&leases).await.unwrap();
        let log = log.clone();
        let job = Job::every("tick", S, move |lease: LeaseHandle| {
            let t = lease.term().taken_at.duration_since(UNIX_EPOCH).unwrap();
            log.lock().push((i, t.as_secs() as i64));
            std::future::ready(())
        });
        schedulers.push(B::schedule(&leases, vec![job]).unwrap());
        pools.push(pool);
    }
    let stalls = Stalls::watch();
    eventually(GUARD, "five periods", || {
        let slots: std::collections::BTreeSet<i64> = log.lock().iter().map(|r| r.1).collect();
        std::future::ready(slots.len() >= 5)
    })
    .await;
    for s in schedulers {
        s.shutdown(10 * S).await;
    }
    let runs = log.lock().clone();
    let mut by_slot: BTreeMap<i64, Vec<usize>> = BTreeMap::new();
    for (i, slot) in &runs {
        by_slot.entry(*slot).or_default().push(*i);
    }
    for (slot, instances) in &by_slot {
        assert_eq!(instances.len(), 1, "period {slot} ran on {instances:?}");
    }
    let (first, last) = (
        *by_slot.keys().next().unwrap(),
        *by_slot.keys().last().unwrap(),
    );
    // Every whole period ran, unless this runtime itself stalled then (see
    // `support::stalls`).
    for slot in (first + 1..last).filter(|s| !by_slot.contains_key(s)) {
        match stalls.during(slot, S) {
            Some(stall) => eprintln!("period {slot} missed: the runtime stalled {stall:?}"),
            None => panic!(
                "period {slot} missed with no stall of the runtime: {by_slot:?}; stalls {:?}",
                stalls.all()
            ),
        }
    }
    eprintln!("{} runs over periods {first}..={last}", runs.len());
}

/// How a term of the mixed fleet ends.
#[derive(Clone, Copy, Debug)]
enum End {
    /// Released by its holder.
    Release,
    /// Expired under it (its holder cut off): the other instance takes it
    /// over, and the old holder's fence is refused.
    Expire,
}

/// Takes "mixed" on `l` (waiting for it) and writes its token through a
/// fenced transaction on `pool`.
async fn take_and_write<B: Backend>(
    l: &B::Leases,
    pool: &B::Pool,
    opts: &LeaseOptions,
) -> B::Lease {
    let lease = get::<B>(l, "mixed", opts, Some(GUARD))
        .await
        .expect("the name within the wait");
    B::fenced_write(pool, &lease).await.unwrap();
    lease
}

/// Takes over the expired term of "mixed" on `l`, writes, releases: the
/// handle of its term.
async fn take_over_and_write<B: Backend>(
    admin: &Client,
    l: &B::Leases,
    pool: &B::Pool,
    opts: &LeaseOptions,
) -> LeaseHandle {
    let lease = take_over::<B>(admin, l, "mixed", opts).await;
    B::fenced_write(pool, &lease).await.unwrap();
    let handle = (*lease).clone();
    B::release(lease).await.unwrap();
    handle
}

/// `n` terms of "mixed" on `l`, each written and released, trying again
/// at once whenever the other side holds it (both sides at the row all the
/// time): their tokens.
async fn contend<B: Backend>(
    l: B::Leases,
    pool: B::Pool,
    opts: LeaseOptions,
    n: usize,
) -> Vec<i64> {
    let mut got = Vec::new();
    while got.len() < n {
        let Some(lease) = get::<B>(&l, "mixed", &opts, None).await else {
            tokio::task::yield_now().await;
            continue;
        };
        B::fenced_write(&pool, &lease).await.unwrap();
        got.push(lease.term().token);
        B::release(lease).await.unwrap();
    }
    got
}

/// A deadpool instance (`X`) and a sqlx one (`Y`) on one table: rounds of
/// hand-overs and take-overs in both directions, then the two contending
/// at once. Every term writes its token through a fenced transaction.
async fn mixed_fleet<X: Backend, Y: Backend>() {
    let db = db().await;
    let a_db = admin(&db).await;
    a_db.batch_execute(LEDGER).await.unwrap();
    let px = X::build(&db, &Settings::new("lease-mixed", 4));
    let py = Y::build(&db, &Settings::new("lease-mixed", 4));
    let (lx, ly) = (X::leases(&px), Y::leases(&py));
    let opts = long();
    let mut tokens = Vec::new();

    // Rounds, one side at a time: X then Y then X…, ending by release or
    // by expiry, so each side takes over from the other, both ways.
    let ends = [End::Release, End::Expire, End::Expire, End::Release];
    for round in 0..16 {
        let end = ends[round % ends.len()];
        let x_turn = round % 2 == 0;
        let stale = if x_turn {
            Stale::<X, Y>::X(take_and_write::<X>(&lx, &px, &opts).await)
        } else {
            Stale::<X, Y>::Y(take_and_write::<Y>(&ly, &py, &opts).await)
        };
        let term = match &stale {
            Stale::X(l) => l.term().clone(),
            Stale::Y(l) => l.term().clone(),
        };
        tokens.push(term.token);
        match (end, stale) {
            (End::Release, Stale::X(l)) => X::release(l).await.unwrap(),
            (End::Release, Stale::Y(l)) => Y::release(l).await.unwrap(),
            (End::Expire, stale) => {
                // The other side takes it over at once, and writes.
                let took = match &stale {
                    Stale::X(_) => take_over_and_write::<Y>(&a_db, &ly, &py, &opts).await,
                    Stale::Y(_) => take_over_and_write::<X>(&a_db, &lx, &px, &opts).await,
                };
                assert_eq!(took.term().took_over_from.as_deref(), Some(&*term.holder));
                tokens.push(took.term().token);
                // The cut-off holder's fenced write is refused.
                let stale_write = match &stale {
                    Stale::X(l) => X::fenced_write(&px, l).await,
                    Stale::Y(l) => Y::fenced_write(&py, l).await,
                };
                assert!(
                    matches!(
                        stale_write,
                        Err(Error::Lease(LeaseError::Lost {
                            reason: LostReason::Taken,
                            ..
                        }))
                    ),
                    "round {round}: {stale_write:?}"
                );
            }
        }
    }
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");

    // Contention: both sides at once, each term written and released.
    let per_side = 12;
    let x = tokio::spawn(contend::<X>(lx.clone(), px.clone(), opts.clone(), per_side));
    let y = tokio::spawn(contend::<Y>(ly.clone(), py.clone(), opts.clone(), per_side));
    let (gx, gy) = within(GUARD, "both sides' terms", async {
        (x.await.unwrap(), y.await.unwrap())
    })
    .await;
    assert!(gx.windows(2).all(|w| w[0] < w[1]), "X: {gx:?}");
    assert!(gy.windows(2).all(|w| w[0] < w[1]), "Y: {gy:?}");
    let last = *tokens.last().unwrap();
    assert!(gx.iter().chain(&gy).all(|t| *t > last));

    let rows = ledger(&a_db).await;
    assert_eq!(rows.len(), tokens.len() + 2 * per_side, "{rows:?}");
    assert_chained(&rows);
    let mut both: Vec<(i64, char)> = gx.iter().map(|t| (*t, 'X')).collect();
    both.extend(gy.iter().map(|t| (*t, 'Y')));
    both.sort();
    let turns = both.windows(2).filter(|w| w[0].1 != w[1].1).count();
    eprintln!(
        "mixed fleet: {} terms, tokens {}..={}; contention: {} hand-overs between the sides: {both:?}",
        rows.len(),
        rows[0].0,
        rows[rows.len() - 1].0,
        turns
    );
}

/// A term of one side or the other, kept after it ends.
enum Stale<X: Backend, Y: Backend> {
    X(X::Lease),
    Y(Y::Lease),
}

#[cfg(feature = "sqlx-0_8")]
#[tokio::test]
async fn lease_mixed_fleet_deadpool_and_sqlx_0_8() {
    mixed_fleet::<support::backend::Deadpool, support::backend::Sqlx08>().await
}

#[cfg(feature = "sqlx-0_9")]
#[tokio::test]
async fn lease_mixed_fleet_deadpool_and_sqlx_0_9() {
    mixed_fleet::<support::backend::Deadpool, support::backend::Sqlx09>().await
}
