//! Issue 30, points 1 to 3 and 4.1, against a real PostgreSQL: readers of
//! the lease table lock nothing a writer waits for (a listing stopped
//! half-way, a read-only session), the purge keeps the table small under a
//! continuous stream of new names and never waits on a row lock, and the
//! install refuses a token sequence that can hand out a smaller value. On
//! every backend, from one source.

use crate::support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgwarden::{Error, LeaseError, LeaseOptions};
use pgwarden_testing::{Proxy, TestServer};
use support::backend::{pool_on, Backend, LeaseSettings, Settings};
use support::leases::{insert_expired, names};
use support::{admin, db, eventually};

const S: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

backends!(a_listing_stopped_half_way_blocks_no_writer);
/// A listing whose link stops half-way (a frozen laptop, a slow link) holds
/// up nobody: the holder keeps renewing and an expired lease is taken over
/// while it hangs. Before, the listing probed row locks with `FOR UPDATE
/// SKIP LOCKED` in a transaction it had not ended: every row stayed locked
/// for as long as the link was stopped.
async fn a_listing_stopped_half_way_blocks_no_writer<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let holder = B::leases(&B::build(&db, &Settings::new("obs-holder", 4)));
    B::install(&holder).await.unwrap();
    let opts = LeaseOptions::new(2 * S);
    let held = B::acquire(&holder, "held", &opts, None)
        .await
        .unwrap()
        .unwrap();
    insert_expired(&admin, "expired", "gone").await;

    // The listing goes through a proxy with a slow link, then the link
    // stops while the listing is on the server.
    let proxy = Proxy::start(TestServer::shared().unwrap()).unwrap();
    proxy.set_latency(100 * MS);
    let (reader_pool, reader_app) = pool_on::<B>(&proxy.pg_config(&db), "obs-reader", 2);
    let reader = B::leases_bounded(&reader_pool, 30 * S);
    B::rows(&reader)
        .await
        .expect("a listing through the slow link");
    let t0: std::time::SystemTime = admin
        .query_one("SELECT clock_timestamp()", &[])
        .await
        .unwrap()
        .get(0);
    let listing = tokio::spawn({
        let reader = reader.clone();
        async move { B::rows(&reader).await }
    });
    // Once this listing's first statement on the table has reached the
    // server, the link stops: whatever the listing holds then, it keeps.
    eventually(10 * S, "the listing reached the server", || async {
        admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE application_name = $1 AND query LIKE '%pgwarden_leases%'
                    AND query_start > $2",
                &[&reader_app, &t0],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
            > 0
    })
    .await;
    proxy.blackhole();

    // Three renewals of the held lease succeed while the listing hangs...
    let renewed = B::lease_stats(&holder).renewed;
    eventually(10 * S, "three renewals while the listing hangs", || async {
        B::lease_stats(&holder).renewed >= renewed + 3
    })
    .await;
    assert!(!held.is_lost(), "the holder lost its lease to a listing");
    // ... and another instance takes the expired lease over.
    let other = B::leases(&B::build(&db, &Settings::new("obs-other", 2)));
    let taken = B::acquire(&other, "expired", &opts, Some(5 * S))
        .await
        .unwrap()
        .expect("the take-over is not blocked by the listing");
    assert_eq!(taken.term().took_over_from.as_deref(), Some("gone"));
    // No session of the listing holds a lock on a row: nothing in pg_locks
    // but the table's ACCESS SHARE.
    let modes: Vec<String> = admin
        .query(
            "SELECT k.mode FROM pg_locks k JOIN pg_stat_activity a ON a.pid = k.pid
              WHERE a.application_name = $1 AND k.locktype = 'relation'
                AND k.relation = 'pgwarden_leases'::regclass",
            &[&reader_app],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        modes.iter().all(|m| m == "AccessShareLock"),
        "the listing holds {modes:?}"
    );
    proxy.heal();
    listing.abort();
    B::release(taken).await.unwrap();
    B::release(held).await.unwrap();
}

backends!(the_listing_works_read_only_and_names_the_blocker);
/// From a read-only session (a replica reached by mistake, an on-call role
/// with `default_transaction_read_only`), the listing works and still names
/// the session holding a row: from `pg_locks`, which every role reads.
/// Before: `25006 cannot execute SELECT FOR UPDATE in a read-only
/// transaction`.
async fn the_listing_works_read_only_and_names_the_blocker<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let leases = B::leases(&B::build(&db, &Settings::new("obs-ro-writer", 2)));
    B::install(&leases).await.unwrap();
    insert_expired(&admin, "stuck", "frozen").await;
    insert_expired(&admin, "free", "gone").await;
    // A fenced transaction left open: the row locked FOR KEY SHARE.
    let locker = db.connect().await.unwrap();
    locker
        .batch_execute(
            "BEGIN; SELECT 1 FROM pgwarden_leases WHERE name = 'stuck' FOR KEY SHARE; SET LOCAL application_name = 'frozen-holder'",
        )
        .await
        .unwrap();
    let locker_pid: i32 = locker
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);

    let role = format!("ro_{}", db.name());
    admin
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; ALTER ROLE {role} SET default_transaction_read_only = on;
             GRANT SELECT ON pgwarden_leases TO {role};"
        ))
        .await
        .unwrap();
    let mut config = db.pg_config();
    config.user(&role);
    let manual = LeaseSettings::default().auto_install(false);
    let reader = B::leases_with(&pool_on::<B>(&config, "obs-ro", 2).0, &manual).unwrap();
    let rows = B::rows(&reader)
        .await
        .expect("a listing from a read-only role");
    let names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["free", "stuck"]);
    assert_eq!(rows[1].blocker_pid, Some(locker_pid));
    assert_eq!(rows[0].blocker_pid, None);
    locker.batch_execute("ROLLBACK").await.unwrap();
    // Once the transaction ended, the row's stale xmax names nobody.
    let rows = B::rows(&reader).await.unwrap();
    assert!(rows.iter().all(|r| r.blocker_pid.is_none()), "{rows:?}");
}

backends!(the_purge_keeps_up_with_a_stream_of_new_names);
/// Sixteen tasks take and release a new name each, without a pause, while
/// the instance purges every 100 ms whatever was released (age zero): the
/// purge deletes rows *while* the stream goes on, and the table never holds
/// more than a few rounds' worth. Before, the purge needed a moment with no
/// lease statement in flight (a `SHARE` lock taken with `NOWAIT`), which a
/// steady stream never gives: it deleted nothing and the table grew by
/// every name. Two sessions taking turns on the table's lock make sure
/// there is no such moment here.
async fn the_purge_keeps_up_with_a_stream_of_new_names<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let purge = LeaseSettings::default().purge(Duration::ZERO, Some(100 * MS));
    let leases = B::leases_with(&B::build(&db, &Settings::new("obs-stream", 16)), &purge).unwrap();
    B::install(&leases).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let pairs = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..16)
        .map(|t| {
            let (leases, stop, pairs) = (leases.clone(), stop.clone(), pairs.clone());
            tokio::spawn(async move {
                let opts = LeaseOptions::new(10 * S);
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let lease = B::acquire(&leases, &format!("entity-{t}-{i}"), &opts, None)
                        .await
                        .unwrap()
                        .expect("a new name is free");
                    B::release(lease).await.unwrap();
                    pairs.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            })
        })
        .collect();
    // And, as a busier fleet would, statements on the table overlap without
    // a gap: two sessions take turns holding its ROW EXCLUSIVE lock (what
    // every lease statement holds while in flight), each taking it before
    // the other lets go.
    let overlap = {
        let (a, b) = (db.connect().await.unwrap(), db.connect().await.unwrap());
        let stop = stop.clone();
        tokio::spawn(async move {
            a.batch_execute("BEGIN; LOCK TABLE pgwarden_leases IN ROW EXCLUSIVE MODE")
                .await
                .unwrap();
            let (mut holding, mut next) = (a, b);
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(20 * MS).await;
                next.batch_execute("BEGIN; LOCK TABLE pgwarden_leases IN ROW EXCLUSIVE MODE")
                    .await
                    .unwrap();
                holding.batch_execute("COMMIT").await.unwrap();
                std::mem::swap(&mut holding, &mut next);
            }
            holding.batch_execute("COMMIT").await.unwrap();
        })
    };
    let rows = || async {
        admin
            .query_one("SELECT count(*) FROM pgwarden_leases", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    // The purge deletes rows while the stream runs...
    eventually(
        60 * S,
        "the purge deleted 2,000 rows under load",
        || async { B::lease_stats(&leases).purged >= 2_000 },
    )
    .await;
    // ... and over the next rounds the table holds at most what was taken
    // since the look, not every name ever used. Two rounds that deleted
    // rows: the first ends with a new mark (taken after the look), the
    // second deletes what was released before that mark; what is left is
    // the names of the pairs made since the look, the 16 in flight, and
    // what a round cut short by its statement timeout left (the slack).
    // (Four purge statements after the look, the wait before stop 45, may
    // all be one round's or rounds that waited for the turn-taking
    // sessions: on a loaded machine the rows released before the look then
    // outnumbered the slack.)
    let purged = || B::lease_stats(&leases).purged;
    let mut worst: (i64, u64) = (0, 0);
    for _ in 0..5 {
        let before = pairs.load(Ordering::Relaxed);
        for _ in 0..2 {
            let p = purged();
            eventually(60 * S, "a purge round that deleted rows", || {
                std::future::ready(purged() > p)
            })
            .await;
        }
        let n = rows().await;
        let since = pairs.load(Ordering::Relaxed) - before;
        worst = worst.max((n, since));
        assert!(
            (n as u64) <= since + 16 + 2_000,
            "{n} rows after {since} pairs since the last look"
        );
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    overlap.await.unwrap();
    let total = pairs.load(Ordering::Relaxed);
    let s = B::lease_stats(&leases);
    eprintln!(
        "{total} pairs; purged {}, {} purge statements, {} rounds waited; worst look: {:?}",
        s.purged, s.purge_statements, s.purges_waited, worst
    );
    // Every name taken is a row still or was purged. The purge goes on in
    // the background: a purge whose DELETE has committed but whose count
    // is not in the stats yet would make a single look come short, so the
    // sum is awaited (rows that vanished otherwise never come back).
    eventually(
        30 * S,
        "every name a row or purged (rows vanished)",
        || async { B::lease_stats(&leases).purged + (rows().await as u64) >= total },
    )
    .await;
    // Once the stream stops, the rest goes within two rounds.
    eventually(30 * S, "the table emptied", || async { rows().await == 0 }).await;
}

backends!(the_purge_never_waits_on_a_locked_row);
/// An old row locked by another session (a frozen fenced holder, a user's
/// `SELECT … FOR UPDATE`) is skipped: the purge deletes the others and
/// waits for nothing, and no lease statement waits for the purge. Before,
/// the purge took the table's `SHARE` lock, then its `DELETE` waited on the
/// locked row with no bound while every acquisition, renewal and release
/// queued behind the table lock.
async fn the_purge_never_waits_on_a_locked_row<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    // The table, with 50 expired rows and one of them locked, before the
    // purging instance exists (its purge would take them at once).
    let never = LeaseSettings::default().purge(Duration::ZERO, None);
    let installer = B::build(&db, &Settings::new("obs-purge-install", 2));
    B::install(&B::leases_with(&installer, &never).unwrap())
        .await
        .unwrap();
    for i in 0..50 {
        insert_expired(&admin, &format!("old-{i:02}"), "gone").await;
    }
    let locker = db.connect().await.unwrap();
    locker
        .batch_execute("BEGIN; SELECT 1 FROM pgwarden_leases WHERE name = 'old-07' FOR UPDATE")
        .await
        .unwrap();
    // Long statement timeouts: a purge that waits would wait that long, and
    // everything behind it too.
    let every = LeaseSettings::default()
        .purge(Duration::ZERO, Some(20 * MS))
        .statement_timeout(120 * S);
    let (pool, app) = pool_on::<B>(&db.pg_config(), "obs-purge-lock", 4);
    let leases = B::leases_with(&pool, &every).unwrap();
    // Keep the renewer (and the purge) running.
    let opts = LeaseOptions::new(2 * S);
    let keep = B::acquire(&leases, "keep", &opts, None)
        .await
        .unwrap()
        .unwrap();
    let names = || names(&admin);
    eventually(60 * S, "the 49 unlocked old rows purged", || async {
        names().await == ["keep", "old-07"]
    })
    .await;
    // While the row stays locked, purge rounds go on, and lease statements
    // of this instance do not queue behind any of them.
    for i in 0..20 {
        let round = B::lease_stats(&leases).purge_statements;
        let lease = B::acquire(&leases, &format!("new-{i}"), &opts, None)
            .await
            .unwrap()
            .unwrap();
        B::release(lease).await.unwrap();
        eventually(60 * S, "a purge round", || async {
            B::lease_stats(&leases).purge_statements > round
        })
        .await;
    }
    let waiting: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'",
            &[&app],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(waiting, 0, "a lease statement waits on a lock");
    assert!(!keep.is_lost());
    locker.batch_execute("ROLLBACK").await.unwrap();
    eventually(60 * S, "the unlocked row purged", || async {
        names().await == ["keep"]
    })
    .await;
    B::release(keep).await.unwrap();
}

backends!(a_token_sequence_that_can_go_backwards_is_refused);
/// A token sequence that can hand out a smaller value later is refused at
/// install (and first use), naming the setting to change: `CACHE > 1` (two
/// pools drew 1, 22, 3, 24, 5 for successive terms of one name), a
/// negative `INCREMENT`, `CYCLE`. Before, the shape check looked at the
/// sequence's type only.
async fn a_token_sequence_that_can_go_backwards_is_refused<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let leases = B::leases(&B::build(&db, &Settings::new("obs-seq", 2)));
    B::install(&leases).await.unwrap();
    for (alter, want, undo) in [
        ("CACHE 20", "has CACHE 20", "CACHE 1"),
        ("INCREMENT BY -1", "has INCREMENT -1", "INCREMENT BY 1"),
        ("CYCLE", "has CYCLE", "NO CYCLE"),
    ] {
        admin
            .batch_execute(&format!("ALTER SEQUENCE pgwarden_leases_token_seq {alter}"))
            .await
            .unwrap();
        // A new instance checks the shape at install.
        let fresh = B::leases(&B::build(&db, &Settings::new("obs-seq2", 2)));
        match B::install(&fresh).await {
            Err(Error::Lease(LeaseError::TableMismatch { differences, .. })) => {
                let all = differences.join("\n");
                assert!(all.contains(want), "{want:?} not in {all}");
                assert!(all.contains("ALTER SEQUENCE"), "{all}");
            }
            other => panic!("{alter}: expected a TableMismatch, got {other:?}"),
        }
        admin
            .batch_execute(&format!("ALTER SEQUENCE pgwarden_leases_token_seq {undo}"))
            .await
            .unwrap();
    }
    let fixed = B::leases(&B::build(&db, &Settings::new("obs-seq3", 2)));
    assert!(B::install(&fixed).await.is_ok());
    // A sequence behind the table's tokens (rows copied in from elsewhere,
    // a sequence made anew) would give the next term a smaller token.
    admin
        .batch_execute(
            "INSERT INTO pgwarden_leases (name, holder, token, expires_at)
             VALUES ('copied', '', 1000000, now() - interval '1 h')",
        )
        .await
        .unwrap();
    let behind = B::leases(&B::build(&db, &Settings::new("obs-seq4", 2)));
    match B::install(&behind).await {
        Err(Error::Lease(LeaseError::TableMismatch { differences, .. })) => {
            let all = differences.join("\n");
            assert!(all.contains("is behind the table's tokens"), "{all}");
            assert!(all.contains("1000000"), "{all}");
        }
        other => panic!("a sequence behind the table: expected a TableMismatch, got {other:?}"),
    }
}

backends!(a_revoked_holder_is_told_it_was_revoked);
/// A revoked holder is told it was revoked, not taken over: its renewal
/// finds its row still carrying its token, with no holder. A lease taken
/// over after expiring is still `Taken`.
async fn a_revoked_holder_is_told_it_was_revoked<B: Backend>() {
    let db = db().await;
    let leases = B::leases(&B::build(&db, &Settings::new("obs-revoke", 4)));
    let opts = LeaseOptions::new(2 * S).renew_every(100 * MS);
    let lease = B::acquire(&leases, "job", &opts, None)
        .await
        .unwrap()
        .unwrap();
    let token = lease.term().token;
    let revoker = B::leases(&B::build(&db, &Settings::new("obs-revoker", 2)));
    let before = B::revoke(&revoker, "job")
        .await
        .unwrap()
        .expect("a term to revoke");
    assert_eq!(before.token, token);
    let reason = tokio::time::timeout(30 * S, lease.lost())
        .await
        .expect("the holder learns of it at its next renewal");
    assert_eq!(reason, pgwarden::LostReason::Revoked);
    assert_eq!(
        reason.to_string(),
        "revoked: the term was ended by hand (pgwarden revoke)"
    );
    drop(lease);
}
