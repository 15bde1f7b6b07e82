//! The purge against a real PostgreSQL: old rows go, live ones stay, and
//! tokens still grow with every term of a name, under 16 contenders with an
//! aggressive purge and stalled backends.

use crate::support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgwarden::LeaseOptions;
use support::backend::{named, Backend, LeaseSettings, Settings};
use support::leases::{backends, insert_expired, names};
use support::{admin, db, eventually, Stopped};

const S: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

backends!(tokens_grow_under_16_contenders_with_an_aggressive_purge);
/// Sixteen contenders take and release one name for a second (and on until
/// the purge has deleted rows between terms: a loaded machine may need
/// longer for that), while every
/// instance purges each 10 ms everything released (age zero). Half the
/// contenders hold for at least 1 ms, so their release keeps the row and the
/// purge deletes it; the others' release deletes it at once when it can.
/// Terms alternate between a new row (its token drawn before the insert)
/// and a take-over of a kept one, and tokens still grow with every term.
async fn tokens_grow_under_16_contenders_with_an_aggressive_purge<B: Backend>() {
    let db = db().await;
    let purge = LeaseSettings::default().purge(Duration::ZERO, Some(10 * MS));
    let (instances, apps): (Vec<B::Leases>, Vec<String>) = ["purge0", "purge1", "purge2", "purge3"]
        .into_iter()
        .map(|app| {
            let (pool, app) = named::<B>(&db, app, &Settings::new(app, 5));
            (B::leases_with(&pool, &purge).unwrap(), app)
        })
        .unzip();
    B::install(&instances[0]).await.unwrap();
    // Keep every renewer (and its purge) running: each instance holds a
    // lease of its own.
    let mut keep = Vec::new();
    for (i, l) in instances.iter().enumerate() {
        keep.push(
            B::acquire(l, &format!("keep{i}"), &LeaseOptions::new(3 * S), None)
                .await
                .unwrap()
                .unwrap(),
        );
    }

    let inside = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(parking_lot::Mutex::new(Vec::new()));
    // At least a second, then until the purge has deleted rows and there
    // were a few terms (what the assertions below need), at most a minute.
    let done = Arc::new(AtomicBool::new(false));
    // Sixteen contenders on one name leave it released for a moment only:
    // under load the purge (every 10 ms) can miss every such moment for a
    // minute (sqlx 0.8, 1,333 purge statements, 0 rows). So now and then
    // the contenders pause (`hush`) until the purge has deleted a row or
    // 100 ms have passed: a window between two terms, made by an event.
    let hush = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let leases = instances[i % 4].clone();
            let (inside, tokens, done) = (inside.clone(), tokens.clone(), done.clone());
            let hush = hush.clone();
            let opts = match i % 2 {
                0 => LeaseOptions::new(2 * S).at_least(MS),
                _ => LeaseOptions::new(2 * S),
            };
            tokio::spawn(async move {
                while !done.load(Ordering::SeqCst) {
                    if hush.load(Ordering::SeqCst) {
                        tokio::time::sleep(MS).await;
                        continue;
                    }
                    if let Some(lease) = B::acquire(&leases, "mutex", &opts, None).await.unwrap() {
                        assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                        // The token of each term, in the order terms happened.
                        tokens.lock().push(lease.term().token);
                        tokio::time::sleep(2 * MS).await;
                        inside.fetch_sub(1, Ordering::SeqCst);
                        B::release(lease).await.unwrap();
                    }
                }
            })
        })
        .collect();
    // Meanwhile, contenders' backends stall at random points of their
    // statements (SIGSTOP for 1 to 20 ms): a statement that drew its token
    // and then stalls is what could make a token go backwards.
    let staller = {
        let admin = admin(&db).await;
        let done = done.clone();
        tokio::spawn(async move {
            let mut stalls = 0;
            while !done.load(Ordering::SeqCst) {
                let mut pids = Vec::new();
                for app in &apps {
                    pids.extend(backends(&admin, app).await);
                }
                if let Some(&pid) = pids.get(rand::random::<usize>() % pids.len().max(1)) {
                    let pause = Duration::from_millis(1 + rand::random::<u64>() % 20);
                    let stopped = Stopped::stop(vec![pid]).expect("SIGSTOP");
                    tokio::time::sleep(pause).await;
                    drop(stopped);
                    stalls += 1;
                }
                tokio::time::sleep(Duration::from_millis(rand::random::<u64>() % 5)).await;
            }
            stalls
        })
    };
    let purged_now = || -> u64 { instances.iter().map(|l| B::lease_stats(l).purged).sum() };
    let mut rounds = 0u32;
    loop {
        let purged = purged_now();
        let enough = purged > 0 && tokens.lock().len() > 5;
        if (enough && started.elapsed() >= S) || started.elapsed() >= 60 * S {
            break;
        }
        tokio::time::sleep(10 * MS).await;
        rounds += 1;
        if rounds % 20 == 0 {
            // A hush: until a row is purged, or 100 ms.
            hush.store(true, Ordering::SeqCst);
            let quiet = Instant::now();
            while purged_now() == purged && quiet.elapsed() < 100 * MS {
                tokio::time::sleep(MS).await;
            }
            hush.store(false, Ordering::SeqCst);
        }
    }
    done.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await.unwrap();
    }
    let stalls = staller.await.unwrap();
    let tokens = tokens.lock().clone();
    let purged: u64 = instances.iter().map(|l| B::lease_stats(l).purged).sum();
    let purges: u64 = instances
        .iter()
        .map(|l| B::lease_stats(l).purge_statements)
        .sum();
    eprintln!(
        "16 contenders, purge every 10 ms, {stalls} backend stalls: {} terms, {purges} purge statements deleted {purged} rows",
        tokens.len()
    );
    assert!(tokens.len() > 5, "{} terms", tokens.len());
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens grow: {tokens:?}"
    );
    assert!(purged > 0, "the purge deleted rows between terms");
    for lease in keep {
        B::release(lease).await.unwrap();
    }
}

backends!(ten_thousand_released_names_leave_under_a_hundred_rows);
async fn ten_thousand_released_names_leave_under_a_hundred_rows<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let pool = B::build(&db, &Settings::new("purge-10k", 8));
    // Takes and releases the names; purges nothing itself.
    let never = LeaseSettings::default().purge(Duration::from_secs(600), None);
    let leases = B::leases_with(&pool, &never).unwrap();
    B::install(&leases).await.unwrap();
    // Half with a hold (their rows are kept at release, for the purge), half
    // without (their release deletes the row when it can).
    let held = LeaseOptions::new(10 * S).at_least(MS);
    let plain = LeaseOptions::new(10 * S);
    let t = Instant::now();
    let tasks: Vec<_> = (0..16)
        .map(|task| {
            let (leases, held, plain) = (leases.clone(), held.clone(), plain.clone());
            tokio::spawn(async move {
                for i in (task..10_000).step_by(16) {
                    let opts = if i % 2 == 0 { &held } else { &plain };
                    let lease = B::acquire(&leases, &format!("n{i:05}"), opts, None)
                        .await
                        .unwrap()
                        .expect("a new name is free");
                    B::release(lease).await.unwrap();
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let rows = || async {
        admin
            .query_typed_one("SELECT count(*) FROM pgwarden_leases", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    let before = rows().await;
    eprintln!(
        "10,000 names acquired and released in {:?}: {before} rows before the purge",
        t.elapsed()
    );
    assert!(before >= 5_000, "held rows are kept at release: {before}");
    // Another instance purges every 50 ms whatever was released; one lease
    // held keeps its renewer (and so its purge) running.
    let every = LeaseSettings::default().purge(Duration::ZERO, Some(50 * MS));
    let purger = B::leases_with(&pool, &every).unwrap();
    let keep = B::acquire(&purger, "keep", &LeaseOptions::new(3 * S), None)
        .await
        .unwrap()
        .unwrap();
    let t = Instant::now();
    eventually(10 * S, "the renewer purged", || async {
        rows().await < 100
    })
    .await;
    let after = rows().await;
    // The server commits a sweep before its answer reaches the purger, which
    // counts it then: on a loaded machine the table read above can come
    // first (CI saw 0 counted with the table already down to 1 row).
    eventually(10 * S, "the purge's deletions counted", || {
        std::future::ready(B::lease_stats(&purger).purged >= 5_000)
    })
    .await;
    let stats = B::lease_stats(&purger);
    eprintln!(
        "after {:?}: {after} rows; {} purge statements deleted {} rows",
        t.elapsed(),
        stats.purge_statements,
        stats.purged
    );
    assert!(after < 100);
    assert!(stats.purged >= 5_000);
    B::release(keep).await.unwrap();
}

backends!(purge_deletes_released_rows_at_once_and_expired_ones_after_their_age);
/// A released row goes at the next rounds whatever the age (its hold over);
/// one still held by `at_least` stays; a crashed holder's expired row stays
/// for the age (what `pgwarden check` reports), then goes.
async fn purge_deletes_released_rows_at_once_and_expired_ones_after_their_age<B: Backend>() {
    let (_db, admin, leases) = purging::<B>("purge-age", Duration::from_secs(3600), 20 * MS).await;
    let names = || names(&admin);
    // A released row, one released but held for an hour, and a crashed
    // holder's expired row.
    let released = B::acquire(&leases, "released", &LeaseOptions::new(10 * S), None)
        .await
        .unwrap()
        .unwrap();
    let held = B::acquire(
        &leases,
        "held",
        &LeaseOptions::new(10 * S).at_least(Duration::from_secs(3600)),
        None,
    )
    .await
    .unwrap()
    .unwrap();
    insert_expired(&admin, "crashed", "gone").await;
    assert_eq!(names().await, ["crashed", "held", "released"]);
    B::release(released).await.unwrap();
    B::release(held).await.unwrap();
    // The released row goes (after a mark and a sweep); the others stay.
    eventually(10 * S, "the released row purged", || async {
        names().await == ["crashed", "held"]
    })
    .await;
    assert_eq!(B::lease_stats(&leases).purged, 1);
    // Two whole purge statements more: still there (younger than an hour,
    // held for an hour).
    purge_rounds::<B>(&leases, 2).await;
    assert_eq!(names().await, ["crashed", "held"]);
    assert_eq!(B::lease_stats(&leases).purged, 1);
    // Two hours old: purged, the held one (its hold now over) and the
    // expired one alike.
    admin
        .batch_execute(
            "UPDATE pgwarden_leases SET expires_at = expires_at - interval '2 h',
                    held_until = held_until - interval '2 h'",
        )
        .await
        .unwrap();
    // A live lease is never purged, however old its take.
    let live = B::acquire(&leases, "live", &LeaseOptions::new(10 * S), None)
        .await
        .unwrap()
        .unwrap();
    eventually(5 * S, "the old rows purged", || async {
        names().await == ["live"]
    })
    .await;
    assert_eq!(B::lease_stats(&leases).purged, 3);
    // A purged name starts again with a larger token.
    let again = B::acquire(&leases, "crashed", &LeaseOptions::new(10 * S), None)
        .await
        .unwrap()
        .unwrap();
    assert!(again.term().token > live.term().token);
    assert_eq!(again.term().took_over_from.as_deref(), None);
}

backends!(no_row_is_deleted_under_an_acquisition_in_flight);
/// The guard behind growing tokens, step by step: a release keeps its row
/// (marked released), so the next term of the name draws its token with
/// the row locked; and while any statement on the table is in flight (each
/// holds `ROW EXCLUSIVE` until it ends, from before it draws a token), the
/// purge deletes nothing: it skips its round, and purges once it is gone.
async fn no_row_is_deleted_under_an_acquisition_in_flight<B: Backend>() {
    let (db, admin, leases) = purging::<B>("guard", Duration::ZERO, 20 * MS).await;
    let row = || async {
        admin
            .query_typed_opt(
                "SELECT holder, token FROM pgwarden_leases WHERE name = 'n'",
                &[],
            )
            .await
            .unwrap()
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
    };

    // An acquisition in flight: what it holds on the table from its start.
    let inflight = db.connect().await.unwrap();
    inflight
        .batch_execute("BEGIN; LOCK TABLE pgwarden_leases IN ROW EXCLUSIVE MODE")
        .await
        .unwrap();
    let lease = B::acquire(&leases, "n", &LeaseOptions::new(10 * S), None)
        .await
        .unwrap()
        .unwrap();
    let first = lease.term().token;
    B::release(lease).await.unwrap();
    // Released: the row stays, marked released, with its token.
    assert_eq!(row().await, Some((String::new(), first)));
    purge_rounds::<B>(&leases, 3).await;
    assert_eq!(
        row().await,
        Some((String::new(), first)),
        "purged while a statement was in flight"
    );
    inflight.batch_execute("COMMIT").await.unwrap();
    eventually(5 * S, "the released row purged", || async {
        row().await.is_none()
    })
    .await;
    // A new row of the name: a larger token than the purged term's.
    let lease = B::acquire(&leases, "n", &LeaseOptions::new(10 * S), None)
        .await
        .unwrap()
        .unwrap();
    assert!(lease.term().token > first);
    // And a term after a release (the row kept) draws a larger one again.
    let second = lease.term().token;
    B::release(lease).await.unwrap();
    let again = B::acquire(&leases, "n", &LeaseOptions::new(10 * S), None)
        .await
        .unwrap()
        .unwrap();
    assert!(again.term().token > second);
    assert_eq!(row().await.map(|r| r.1), Some(again.term().token));
}

/// Waits until `n` more purge statements have run: with `n` = 2, at least
/// one ran from start to end after the call.
async fn purge_rounds<B: Backend>(leases: &B::Leases, n: u64) {
    let before = B::lease_stats(leases).purge_statements;
    eventually(5 * S, "purge statements", || {
        std::future::ready(B::lease_stats(leases).purge_statements >= before + n)
    })
    .await;
}

backends!(an_expired_row_stays_its_ttl_past_the_age);
/// A crashed holder's row stays for its term's TTL past the purge's age:
/// `pgwarden check` reports a holder once its lease has been expired for
/// its TTL, so a row purged at the age alone (60 s by default) was never
/// reported for a TTL over about 70 s (the hostile reader's finding 3 in
/// stop 44). A row without a stored TTL (a writer that did not know
/// `renewed_at`) goes at the age.
async fn an_expired_row_stays_its_ttl_past_the_age<B: Backend>() {
    let (_db, admin, leases) = purging::<B>("purge-ttl", Duration::ZERO, 10 * MS).await;
    // Expired a minute ago: `long` after a TTL of an hour, `short` after a
    // TTL of a second, `unknown` with no stored TTL.
    admin
        .batch_execute(
            "INSERT INTO pgwarden_leases (name, holder, token, taken_at, expires_at, renewed_at)
             VALUES ('long', 'dead-1', nextval('pgwarden_leases_token_seq'),
                     now() - interval '61 min', now() - interval '1 min', now() - interval '61 min'),
                    ('short', 'dead-2', nextval('pgwarden_leases_token_seq'),
                     now() - interval '61 s', now() - interval '1 min', now() - interval '61 s'),
                    ('unknown', 'dead-3', nextval('pgwarden_leases_token_seq'),
                     now() - interval '61 s', now() - interval '1 min', NULL)",
        )
        .await
        .unwrap();
    let names = || names(&admin);
    eventually(10 * S, "the short and unknown rows purged", || async {
        names().await == ["long"]
    })
    .await;
    purge_rounds::<B>(&leases, 2).await;
    assert_eq!(names().await, ["long"], "kept for its TTL");
    // Its TTL over too: purged.
    admin
        .batch_execute(
            "UPDATE pgwarden_leases SET taken_at = taken_at - interval '1 h',
                    expires_at = expires_at - interval '1 h', renewed_at = renewed_at - interval '1 h'",
        )
        .await
        .unwrap();
    eventually(10 * S, "the long row purged", || async {
        names().await.is_empty()
    })
    .await;
}

backends!(a_session_whose_transaction_ended_holds_no_purge_back);
/// The purge's mark waits for the lease statements in flight, which it
/// finds in `pg_locks` by their virtual transaction ids. A transaction that
/// has just ended still shows there for a moment under the id `B/0`
/// (PostgreSQL clears its local id before it releases its locks), and a
/// mark taken in that moment kept `B/0`; but backend `B` shows every lock
/// it holds under that same id while it is idle between transactions: a
/// session advisory lock held on that connection kept the purge from
/// deleting anything for as long as it was held (on a busy pool about 1
/// mark in 100 to 1,000 held such an id; stop 45's row 4d saw rounds wait
/// on no pid).
///
/// The test catches one of four writing sessions in that moment (stopped
/// with `SIGSTOP` until `pg_locks` shows its lock on the lease table under
/// `B/0`), lets the purge mark, continues it, and leaves it idle with the
/// session advisory lock it held throughout, for six purge statements: the
/// purge goes on.
async fn a_session_whose_transaction_ended_holds_no_purge_back<B: Backend>() {
    const WRITERS: usize = 4;
    let (db, admin, leases) = purging::<B>("ended", Duration::ZERO, 10 * MS).await;
    // A token drawn: a purge with none yet has nothing to wait for.
    let lease = B::acquire(&leases, "first", &LeaseOptions::new(10 * S), None)
        .await
        .unwrap()
        .unwrap();
    B::release(lease).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for _ in 0..WRITERS {
        let writer = Arc::new(db.connect().await.unwrap());
        let pid: i32 = writer
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        // A session lock held throughout (what a pooled connection may
        // hold for hours), and a statement that takes the table's ROW
        // EXCLUSIVE lock and writes nothing: short, so that its end is a
        // large part of its time.
        writer
            .execute("SELECT pg_advisory_lock($1)", &[&(7_000 + pid as i64)])
            .await
            .unwrap();
        let writes = tokio::spawn({
            let (writer, stop) = (writer.clone(), stop.clone());
            async move {
                while !stop.load(Ordering::Relaxed) {
                    writer
                        .execute(
                            "UPDATE pgwarden_leases SET holder = holder WHERE false",
                            &[],
                        )
                        .await
                        .unwrap();
                }
            }
        });
        writers.push((writer, pid, writes));
    }
    let pids: Vec<i32> = writers.iter().map(|w| w.1).collect();
    // Stop the writers until one is caught ended with its lock still held
    // (if one was stopped holding something `pg_locks` waits on, the look
    // times out: they are continued, and stopped again).
    let look = "SELECT pid FROM pg_locks WHERE pid = ANY ($1) AND locktype = 'relation' \
                AND mode = 'RowExclusiveLock' AND relation = to_regclass('pgwarden_leases') \
                AND virtualtransaction LIKE '%/0' LIMIT 1";
    let began = Instant::now();
    let mut tries = 0;
    let (caught, pid) = loop {
        assert!(
            began.elapsed() < 120 * S,
            "no writer was caught between its end and its locks' release ({tries} tries)"
        );
        tries += 1;
        let mut stopped: Vec<(i32, Stopped)> = pids
            .iter()
            .map(|&p| (p, Stopped::stop(vec![p]).unwrap()))
            .collect();
        for &p in &pids {
            wait_stopped(p).await;
        }
        if let Ok(row) = tokio::time::timeout(S, admin.query_opt(look, &[&pids])).await {
            if let Some(p) = row.unwrap().map(|r| r.get::<_, i32>(0)) {
                let k = stopped.iter().position(|s| s.0 == p).unwrap();
                break (stopped.swap_remove(k).1, p);
            }
        }
        drop(stopped);
        tokio::task::yield_now().await;
    };
    // Two rounds of the purge (a mark at least) while it shows so; then
    // the writers stop, idle, each holding its session lock.
    purge_rounds::<B>(&leases, 4).await;
    stop.store(true, Ordering::Relaxed);
    drop(caught);
    for (_, _, writes) in &mut writers {
        writes.await.unwrap();
    }
    let before = B::lease_stats(&leases).purges_waited;
    purge_rounds::<B>(&leases, 6).await;
    let spell = B::lease_stats(&leases).purges_waited - before;
    assert!(
        spell < 3,
        "the purge waited {spell} of 6 statements on session {pid}, idle outside a transaction \
         (caught after {tries} tries)"
    );
}

/// A database, its own client, and leases on a pool of 2 that purge rows
/// older than `age` every `every`, their table installed.
async fn purging<B: Backend>(
    name: &'static str,
    age: Duration,
    every: Duration,
) -> (pgwarden_testing::TestDb, tokio_postgres::Client, B::Leases) {
    let db = db().await;
    let admin = admin(&db).await;
    let pool = B::build(&db, &Settings::new(name, 2));
    let leases = B::leases_with(&pool, &LeaseSettings::default().purge(age, Some(every))).unwrap();
    B::install(&leases).await.unwrap();
    (db, admin, leases)
}

/// Waits until process `pid` is stopped (`T` in `/proc/<pid>/stat`): a
/// `SIGSTOP` is delivered a moment after `kill` returns.
async fn wait_stopped(pid: i32) {
    let path = format!("/proc/{pid}/stat");
    eventually(5 * S, "the process stopped", || {
        let stat = std::fs::read_to_string(&path).unwrap_or_default();
        // `pid (comm) state …`: the state follows the last ')'.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.trim_start().chars().next());
        std::future::ready(state == Some('T'))
    })
    .await;
}

backends!(
    sync,
    a_purge_round_dropped_with_its_runtime_leaves_the_purge_running
);
/// A purge round in flight (its sweep waiting on the lease table, which a
/// session locks) when the runtime that runs the renewer is dropped: the
/// renewer started again by the next acquisition, on another runtime,
/// purges again. (The round's mark of "a purge is running" outlived its
/// dropped task, and this instance never purged again.)
fn a_purge_round_dropped_with_its_runtime_leaves_the_purge_running<B: Backend>() {
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (_db, admin, leases, locker) = main.block_on(async {
        let db = db().await;
        let (admin, locker) = (admin(&db).await, db.connect().await.unwrap());
        // Installed through a pool of its own: this pool's next checkout
        // (below, on another runtime) starts the renewer.
        let other = B::build(&db, &Settings::new("purge-install", 2));
        B::install(&B::leases(&other)).await.unwrap();
        let pool = B::build(&db, &Settings::new("purge-dropped", 2));
        let settings = LeaseSettings::default().purge(Duration::ZERO, Some(50 * MS));
        let leases = B::leases_with(&pool, &settings).unwrap();
        (db, admin, leases, locker)
    });
    // The renewer, and its purge rounds, start on this runtime...
    let other = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let lease = other.block_on(async {
        let lease = B::acquire(&leases, "held", &LeaseOptions::new(60 * S), None)
            .await
            .unwrap()
            .expect("free");
        // A first round marks; the next one's sweep waits on the lock.
        purge_rounds::<B>(&leases, 1).await;
        locker
            .batch_execute("BEGIN; LOCK TABLE pgwarden_leases IN ACCESS EXCLUSIVE MODE")
            .await
            .unwrap();
        eventually(10 * S, "a purge statement waits on the table", || async {
            let waiting: i64 = admin
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                      WHERE datname = current_database() AND wait_event_type = 'Lock'
                        AND query LIKE '%DELETE%'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            waiting > 0
        })
        .await;
        lease
    });
    // ...which is dropped with the round in flight.
    drop(other);
    main.block_on(async {
        locker.batch_execute("ROLLBACK").await.unwrap();
        // The next acquisition starts the renewer here; it purges again.
        let again = B::acquire(&leases, "again", &LeaseOptions::new(60 * S), None)
            .await
            .unwrap()
            .expect("free");
        purge_rounds::<B>(&leases, 2).await;
        B::release(again).await.unwrap();
        B::release(lease).await.unwrap();
    });
}
