//! Issue 30, points 1 to 3 and 4.1, against a real PostgreSQL: readers of
//! the lease table lock nothing a writer waits for (a listing stopped
//! half-way, a read-only session), the purge keeps the table small under a
//! continuous stream of new names and never waits on a row lock, and the
//! install refuses a token sequence that can hand out a smaller value.

use crate::support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgwarden::{Error, LeaseError, LeaseOptions, Leases};
use pgwarden_testing::{Proxy, TestServer};
use support::leases::{insert_expired, pool, pool_with};
use support::{admin, db, eventually};

const S: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

/// A listing whose link stops half-way (a frozen laptop, a slow link) holds
/// up nobody: the holder keeps renewing and an expired lease is taken over
/// while it hangs. Before, the listing probed row locks with `FOR UPDATE
/// SKIP LOCKED` in a transaction it had not ended: every row stayed locked
/// for as long as the link was stopped.
#[tokio::test]
async fn a_listing_stopped_half_way_blocks_no_writer() {
    let db = db().await;
    let admin = admin(&db).await;
    let holder = Leases::new(&pool(&db, 4, "obs-holder"));
    holder.install().await.unwrap();
    let opts = LeaseOptions::new(2 * S);
    let held = holder.acquire("held", &opts, None).await.unwrap().unwrap();
    insert_expired(&admin, "expired", "gone").await;

    // The listing goes through a proxy with a slow link, then the link
    // stops while the listing is on the server.
    let proxy = Proxy::start(TestServer::shared().unwrap()).unwrap();
    proxy.set_latency(100 * MS);
    let reader = Leases::builder(&pool_with(proxy.pg_config(&db), 2, "obs-reader"))
        .statement_timeout(30 * S)
        .build()
        .unwrap();
    reader
        .rows()
        .await
        .expect("a listing through the slow link");
    let t0: std::time::SystemTime = admin
        .query_one("SELECT clock_timestamp()", &[])
        .await
        .unwrap()
        .get(0);
    let listing = tokio::spawn({
        let reader = reader.clone();
        async move { reader.rows().await }
    });
    // Once this listing's first statement on the table has reached the
    // server, the link stops: whatever the listing holds then, it keeps.
    eventually(10 * S, "the listing reached the server", || async {
        admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE application_name = 'obs-reader' AND query LIKE '%pgwarden_leases%'
                    AND query_start > $1",
                &[&t0],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
            > 0
    })
    .await;
    proxy.blackhole();

    // Three renewals of the held lease succeed while the listing hangs...
    let renewed = holder.stats().renewed;
    eventually(10 * S, "three renewals while the listing hangs", || async {
        holder.stats().renewed >= renewed + 3
    })
    .await;
    assert!(!held.is_lost(), "the holder lost its lease to a listing");
    // ... and another instance takes the expired lease over.
    let other = Leases::new(&pool(&db, 2, "obs-other"));
    let taken = other
        .acquire("expired", &opts, Some(5 * S))
        .await
        .unwrap()
        .expect("the take-over is not blocked by the listing");
    assert_eq!(taken.term().took_over_from.as_deref(), Some("gone"));
    // No session of the listing holds a lock on a row: nothing in pg_locks
    // but the table's ACCESS SHARE.
    let modes: Vec<String> = admin
        .query(
            "SELECT k.mode FROM pg_locks k JOIN pg_stat_activity a ON a.pid = k.pid
              WHERE a.application_name = 'obs-reader' AND k.locktype = 'relation'
                AND k.relation = 'pgwarden_leases'::regclass",
            &[],
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
    taken.release().await.unwrap();
    held.release().await.unwrap();
}

/// From a read-only session (a replica reached by mistake, an on-call role
/// with `default_transaction_read_only`), the listing works and still names
/// the session holding a row: from `pg_locks`, which every role reads.
/// Before: `25006 cannot execute SELECT FOR UPDATE in a read-only
/// transaction`.
#[tokio::test]
async fn the_listing_works_read_only_and_names_the_blocker() {
    let db = db().await;
    let admin = admin(&db).await;
    let leases = Leases::new(&pool(&db, 2, "obs-ro-writer"));
    leases.install().await.unwrap();
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
    let reader = Leases::builder(&pool_with(config, 2, "obs-ro"))
        .auto_install(false)
        .build()
        .unwrap();
    let rows = reader
        .rows()
        .await
        .expect("a listing from a read-only role");
    let names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["free", "stuck"]);
    assert_eq!(rows[1].blocker_pid, Some(locker_pid));
    assert_eq!(rows[0].blocker_pid, None);
    locker.batch_execute("ROLLBACK").await.unwrap();
    // Once the transaction ended, the row's stale xmax names nobody.
    let rows = reader.rows().await.unwrap();
    assert!(rows.iter().all(|r| r.blocker_pid.is_none()), "{rows:?}");
}

/// Sixteen tasks take and release a new name each, without a pause, while
/// the instance purges every 100 ms whatever was released (age zero): the
/// purge deletes rows *while* the stream goes on, and the table never holds
/// more than a few rounds' worth. Before, the purge needed a moment with no
/// lease statement in flight (a `SHARE` lock taken with `NOWAIT`), which a
/// steady stream never gives: it deleted nothing and the table grew by
/// every name. Two sessions taking turns on the table's lock make sure
/// there is no such moment here.
#[tokio::test]
async fn the_purge_keeps_up_with_a_stream_of_new_names() {
    let db = db().await;
    let admin = admin(&db).await;
    let leases = Leases::builder(&pool(&db, 16, "obs-stream"))
        .purge(Duration::ZERO, Some(100 * MS))
        .build()
        .unwrap();
    leases.install().await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let pairs = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..16)
        .map(|t| {
            let (leases, stop, pairs) = (leases.clone(), stop.clone(), pairs.clone());
            tokio::spawn(async move {
                let opts = LeaseOptions::new(10 * S);
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let lease = leases
                        .acquire(&format!("entity-{t}-{i}"), &opts, None)
                        .await
                        .unwrap()
                        .expect("a new name is free");
                    lease.release().await.unwrap();
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
        || async { leases.stats().purged >= 2_000 },
    )
    .await;
    // ... and over the next rounds the table holds at most what was taken
    // since the mark before last, not every name ever used.
    let mut worst: (i64, u64) = (0, 0);
    for _ in 0..5 {
        let round = leases.stats().purge_statements;
        let before = pairs.load(Ordering::Relaxed);
        eventually(60 * S, "another purge round", || async {
            leases.stats().purge_statements >= round + 4
        })
        .await;
        let n = rows().await;
        let since = pairs.load(Ordering::Relaxed) - before;
        worst = worst.max((n, since));
        // Rows: the names taken since the round before last (at most the
        // pairs made while we waited for two rounds and a half, plus the 16
        // in flight); never the whole stream.
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
    let s = leases.stats();
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
        || async { leases.stats().purged + (rows().await as u64) >= total },
    )
    .await;
    // Once the stream stops, the rest goes within two rounds.
    eventually(30 * S, "the table emptied", || async { rows().await == 0 }).await;
}

/// An old row locked by another session (a frozen fenced holder, a user's
/// `SELECT … FOR UPDATE`) is skipped: the purge deletes the others and
/// waits for nothing, and no lease statement waits for the purge. Before,
/// the purge took the table's `SHARE` lock, then its `DELETE` waited on the
/// locked row with no bound while every acquisition, renewal and release
/// queued behind the table lock.
#[tokio::test]
async fn the_purge_never_waits_on_a_locked_row() {
    let db = db().await;
    let admin = admin(&db).await;
    // The table, with 50 expired rows and one of them locked, before the
    // purging instance exists (its purge would take them at once).
    Leases::builder(&pool(&db, 2, "obs-purge-install"))
        .purge(Duration::ZERO, None)
        .build()
        .unwrap()
        .install()
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
    let leases = Leases::builder(&pool(&db, 4, "obs-purge-lock"))
        .purge(Duration::ZERO, Some(20 * MS))
        .statement_timeout(120 * S)
        .build()
        .unwrap();
    // Keep the renewer (and the purge) running.
    let opts = LeaseOptions::new(2 * S);
    let keep = leases.acquire("keep", &opts, None).await.unwrap().unwrap();
    let names = || async {
        admin
            .query("SELECT name FROM pgwarden_leases ORDER BY name", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get::<_, String>(0))
            .collect::<Vec<_>>()
    };
    eventually(60 * S, "the 49 unlocked old rows purged", || async {
        names().await == ["keep", "old-07"]
    })
    .await;
    // While the row stays locked, purge rounds go on, and lease statements
    // of this instance do not queue behind any of them.
    for i in 0..20 {
        let round = leases.stats().purge_statements;
        let lease = leases
            .acquire(&format!("new-{i}"), &opts, None)
            .await
            .unwrap()
            .unwrap();
        lease.release().await.unwrap();
        eventually(60 * S, "a purge round", || async {
            leases.stats().purge_statements > round
        })
        .await;
    }
    let waiting: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'obs-purge-lock' AND wait_event_type = 'Lock'",
            &[],
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
    keep.release().await.unwrap();
}

/// A token sequence that can hand out a smaller value later is refused at
/// install (and first use), naming the setting to change: `CACHE > 1` (two
/// pools drew 1, 22, 3, 24, 5 for successive terms of one name), a
/// negative `INCREMENT`, `CYCLE`. Before, the shape check looked at the
/// sequence's type only.
#[tokio::test]
async fn a_token_sequence_that_can_go_backwards_is_refused() {
    let db = db().await;
    let admin = admin(&db).await;
    let leases = Leases::new(&pool(&db, 2, "obs-seq"));
    leases.install().await.unwrap();
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
        let fresh = Leases::new(&pool(&db, 2, "obs-seq2"));
        match fresh.install().await {
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
    assert!(Leases::new(&pool(&db, 2, "obs-seq3"))
        .install()
        .await
        .is_ok());
    // A sequence behind the table's tokens (rows copied in from elsewhere,
    // a sequence made anew) would give the next term a smaller token.
    admin
        .batch_execute(
            "INSERT INTO pgwarden_leases (name, holder, token, expires_at)
             VALUES ('copied', '', 1000000, now() - interval '1 h')",
        )
        .await
        .unwrap();
    match Leases::new(&pool(&db, 2, "obs-seq4")).install().await {
        Err(Error::Lease(LeaseError::TableMismatch { differences, .. })) => {
            let all = differences.join("\n");
            assert!(all.contains("is behind the table's tokens"), "{all}");
            assert!(all.contains("1000000"), "{all}");
        }
        other => panic!("a sequence behind the table: expected a TableMismatch, got {other:?}"),
    }
}

/// A revoked holder is told it was revoked, not taken over: its renewal
/// finds its row still carrying its token, with no holder. A lease taken
/// over after expiring is still `Taken`.
#[tokio::test]
async fn a_revoked_holder_is_told_it_was_revoked() {
    let db = db().await;
    let leases = Leases::new(&pool(&db, 4, "obs-revoke"));
    let opts = LeaseOptions::new(2 * S).renew_every(100 * MS);
    let lease = leases.acquire("job", &opts, None).await.unwrap().unwrap();
    let token = lease.term().token;
    let before = Leases::new(&pool(&db, 2, "obs-revoker"))
        .revoke("job")
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
