//! Gathering when callers give up, stop polling, or ask about one name
//! together, against a real PostgreSQL: a term answered to a caller that
//! never takes it is released; a dropped acquisition's release comes after
//! its statement's end (also where no cancel can reach it); a batch answers
//! every caller before it releases those that gave up; callers of one name
//! share one attempt; a caller that falls back to its own statement reports
//! its whole wait. On every backend, from one source.

use crate::support;

use std::time::Duration;

use futures_util::future::join_all;
use futures_util::poll;
use pgwarden::{Error, LeaseError, LeaseOptions, PoolerMode};
use support::backend::{named, Backend, Settings};
use support::leases::busy_backends;
use support::{admin, db, eventually, within};

const S: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

fn opts() -> LeaseOptions {
    LeaseOptions::new(30 * S)
}

/// Takes `first` and `second` in another session's open transaction: an
/// acquisition of either waits on that transaction until `ROLLBACK`.
async fn insert_uncommitted(db: &pgwarden_testing::TestDb) -> tokio_postgres::Client {
    let inserter = db.connect().await.unwrap();
    inserter
        .batch_execute(
            "BEGIN; INSERT INTO pgwarden_leases (name, holder, token, expires_at)
             SELECT n, 'inserter', nextval('pgwarden_leases_token_seq'), now() - interval '1 s'
               FROM unnest(ARRAY['first', 'second']) n",
        )
        .await
        .unwrap();
    inserter
}

/// Whether `name`'s row is held (a holder, unexpired).
async fn held(admin: &tokio_postgres::Client, name: &str) -> bool {
    admin
        .query_one(
            "SELECT count(*) FROM pgwarden_leases WHERE name = $1 AND holder <> '' AND expires_at > now()",
            &[&name],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
        == 1
}

/// Whether `name` has a row, released.
async fn released(admin: &tokio_postgres::Client, name: &str) -> bool {
    admin
        .query_one(
            "SELECT count(*) FROM pgwarden_leases WHERE name = $1 AND holder = ''",
            &[&name],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
        == 1
}

/// The statement of a caller that gave up on `name` has ended (no backend
/// of `app` is active) and nobody holds `name`: the statement took it and
/// it was released (deadpool: the statement committed on its own), or the
/// statement's own transaction was rolled back (sqlx behind a transaction
/// pooler: each statement is pinned in one, whose `COMMIT` never went out).
async fn settled(admin: &tokio_postgres::Client, app: &str, name: &str) -> bool {
    let held: i64 = admin
        .query_one(
            "SELECT count(*) FROM pgwarden_leases WHERE name = $1 AND holder <> ''",
            &[&name],
        )
        .await
        .unwrap()
        .get(0);
    busy_backends(admin, app).await.1 == 0 && held == 0
}

backends!(
    a_term_answered_to_a_caller_that_never_takes_it_is_released,
    flavor = "multi_thread",
    worker_threads = 2
);
/// A caller waiting for a batch is answered (its batch took the lease for
/// it) while nobody polls its future, which is then dropped: the lease is
/// released. Before: it stayed held until its TTL.
async fn a_term_answered_to_a_caller_that_never_takes_it_is_released<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let (pool, app) = named::<B>(&db, "unpolled", &Settings::new("unpolled", 16));
    let leases = B::leases_bounded(&pool, 10 * S);
    B::install(&leases).await.unwrap();
    let inserter = insert_uncommitted(&db).await;
    let o = opts();
    // `first` and `second` take the statements out (and wait on the
    // insert), in tasks that keep polling them.
    let stuck: Vec<_> = ["first", "second"]
        .into_iter()
        .map(|n| {
            let (leases, o) = (leases.clone(), o.clone());
            tokio::spawn(async move { B::acquire(&leases, n, &o, None).await })
        })
        .collect();
    eventually(5 * S, "both statements wait on the insert", || async {
        busy_backends(&admin, &app).await.0 == 2
    })
    .await;
    {
        // Polled once: `unpolled` waits for a batch.
        let mut unpolled = Box::pin(B::acquire(&leases, "unpolled", &o, None));
        assert!(poll!(unpolled.as_mut()).is_pending());
        assert_eq!(B::lease_stats(&leases).acquisitions_waiting, 1);
        // The insert goes: the statements out end, the batch runs and
        // answers `unpolled` (its caller is not polled meanwhile).
        inserter.batch_execute("ROLLBACK").await.unwrap();
        eventually(5 * S, "the batch takes `unpolled`", || {
            held(&admin, "unpolled")
        })
        .await;
        // Dropped here, its answer never taken.
    }
    eventually(5 * S, "`unpolled` released", || async {
        !held(&admin, "unpolled").await
    })
    .await;
    for h in stuck {
        let lease = within(5 * S, "a stuck acquisition", h).await.unwrap();
        let lease = lease.unwrap().expect("free once the insert rolled back");
        B::release(lease).await.unwrap();
    }
}

backends!(
    a_dropped_acquisition_is_released_after_its_statement_ends,
    flavor = "multi_thread",
    worker_threads = 2
);
/// Where no cancel request goes (a transaction pooler, or a direct
/// connection before detection ends: here a direct connection configured
/// as behind a pooler), an acquisition dropped while its statement waits
/// on the server: the statement goes on, takes the lease once the insert
/// it waits on rolls back, and the lease is released after that (sqlx: the
/// statement's own transaction is rolled back instead). Before: the release
/// ran at once, before the statement's commit, and the lease stayed held
/// until its TTL.
async fn a_dropped_acquisition_is_released_after_its_statement_ends<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let s = Settings::new("undetected", 4).pooler(PoolerMode::Transaction);
    let (pool, app) = named::<B>(&db, "undetected", &s);
    let leases = B::leases_bounded(&pool, 10 * S);
    B::install(&leases).await.unwrap();
    let inserter = insert_uncommitted(&db).await;
    let gave_up = tokio::time::timeout(200 * MS, B::acquire(&leases, "first", &opts(), None)).await;
    assert!(gave_up.is_err(), "the acquisition waits on the insert");
    // Its statement still waits on the server.
    eventually(5 * S, "the statement waits on the insert", || async {
        busy_backends(&admin, &app).await.0 == 1
    })
    .await;
    inserter.batch_execute("ROLLBACK").await.unwrap();
    eventually(5 * S, "the statement ended, `first` held by none", || {
        settled(&admin, &app, "first")
    })
    .await;
    if B::NAME == "deadpool" {
        assert!(released(&admin, "first").await, "taken, then released");
    }
}

backends!(
    a_batch_answers_every_caller_before_releasing_those_that_gave_up,
    flavor = "multi_thread",
    worker_threads = 2
);
/// A batch takes two names; the caller of one (`slow-a`) gives up while
/// the batch runs, and its release is held up on the server (a trigger
/// waits on an advisory lock the test holds). The other caller (`zed`) is
/// answered all the same, before that release ends. Before: the batch
/// awaited the release inline, and `zed` waited for it.
async fn a_batch_answers_every_caller_before_releasing_those_that_gave_up<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let (pool, app) = named::<B>(&db, "answers", &Settings::new("answers", 16));
    let leases = B::leases_bounded(&pool, 10 * S);
    B::install(&leases).await.unwrap();
    // The batch's insert of `slow-a` takes 2 s; a release of it waits for
    // the gate (advisory lock 4242).
    admin
        .batch_execute(
            "CREATE FUNCTION slow_lease() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
               IF TG_OP = 'INSERT' AND NEW.name = 'slow-a' THEN PERFORM pg_sleep(2); END IF;
               IF TG_OP = 'UPDATE' AND NEW.name = 'slow-a' AND NEW.holder = '' AND OLD.holder <> '' THEN
                 PERFORM pg_advisory_xact_lock(4242);
               END IF;
               RETURN NEW;
             END $$;
             CREATE TRIGGER slow_lease BEFORE INSERT OR UPDATE ON pgwarden_leases
               FOR EACH ROW EXECUTE FUNCTION slow_lease();",
        )
        .await
        .unwrap();
    let gate = db.connect().await.unwrap();
    gate.batch_execute("SELECT pg_advisory_lock(4242)")
        .await
        .unwrap();
    let inserter = insert_uncommitted(&db).await;
    let o = opts();
    let stuck: Vec<_> = ["first", "second"]
        .into_iter()
        .map(|n| {
            let (leases, o) = (leases.clone(), o.clone());
            tokio::spawn(async move { B::acquire(&leases, n, &o, None).await })
        })
        .collect();
    eventually(5 * S, "both statements wait on the insert", || async {
        busy_backends(&admin, &app).await.0 == 2
    })
    .await;
    let mut slow = Box::pin(B::acquire(&leases, "slow-a", &o, None));
    let mut zed = Box::pin(B::acquire(&leases, "zed", &o, None));
    assert!(poll!(slow.as_mut()).is_pending());
    assert!(poll!(zed.as_mut()).is_pending());
    assert_eq!(B::lease_stats(&leases).acquisitions_waiting, 2);
    inserter.batch_execute("ROLLBACK").await.unwrap();
    // The batch of `slow-a` and `zed` runs (2 s in the trigger): the
    // caller of `slow-a` gives up meanwhile.
    eventually(5 * S, "the batch runs", || async {
        admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1
                   AND state = 'active' AND query LIKE '%unnest%'",
                &[&app],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 1
    })
    .await;
    drop(slow);
    // `zed` is answered while the release of `slow-a` still waits on the
    // gate.
    let lease = within(8 * S, "zed's answer", zed)
        .await
        .unwrap()
        .expect("zed is free");
    assert!(
        held(&admin, "slow-a").await,
        "slow-a's release cannot have ended: the gate is held"
    );
    gate.batch_execute("SELECT pg_advisory_unlock(4242)")
        .await
        .unwrap();
    eventually(5 * S, "slow-a released once the gate opens", || async {
        !held(&admin, "slow-a").await
    })
    .await;
    B::release(lease).await.unwrap();
    for h in stuck {
        if let Some(l) = within(10 * S, "a stuck acquisition", h)
            .await
            .unwrap()
            .unwrap()
        {
            B::release(l).await.unwrap();
        }
    }
}

backends!(
    callers_of_one_name_share_one_attempt,
    flavor = "multi_thread",
    worker_threads = 2
);
/// 32 callers of one instance ask about one name held by another instance,
/// all at once: they share one attempt per statement (two go alone, the
/// 30 others share the next statement). Before: one attempt per caller,
/// 32 statements.
async fn callers_of_one_name_share_one_attempt<B: Backend>() {
    let db = db().await;
    let other = B::leases(&B::build(&db, &Settings::new("share-holder", 2)));
    let holder = B::acquire(&other, "busy", &opts(), None)
        .await
        .unwrap()
        .unwrap();
    let leases = B::leases(&B::build(&db, &Settings::new("share", 16)));
    B::install(&leases).await.unwrap();
    let o = opts();
    // A call waits at most 100 ms for a batch: on a loaded machine a round
    // may see some go alone, so rounds run until one shows the sharing.
    for round in 0..5 {
        let before = B::lease_stats(&leases);
        let got = join_all((0..32).map(|_| B::acquire(&leases, "busy", &o, None))).await;
        for r in got {
            assert!(r.unwrap().is_none(), "held by the other instance");
        }
        let statements = B::lease_stats(&leases).statements - before.statements;
        eprintln!("round {round}: 32 attempts in {statements} statements");
        if statements <= 8 {
            B::release(holder).await.unwrap();
            return;
        }
    }
    panic!("no round of 5 shared its attempts");
}

backends!(
    a_fallback_timeout_reports_the_whole_wait,
    flavor = "multi_thread",
    worker_threads = 2
);
/// A caller waits for a batch behind two stuck statements, goes alone after
/// its patience, and its own statement is stuck too: its timeout reports
/// its whole wait (the statement timeout), not only its own statement's.
async fn a_fallback_timeout_reports_the_whole_wait<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let timeout = S;
    let (pool, app) = named::<B>(&db, "whole-wait", &Settings::new("whole-wait", 16));
    let leases = B::leases_bounded(&pool, timeout);
    B::install(&leases).await.unwrap();
    let inserter = insert_uncommitted(&db).await;
    let o = opts();
    let stuck: Vec<_> = ["first", "second"]
        .into_iter()
        .map(|n| {
            let (leases, o) = (leases.clone(), o.clone());
            tokio::spawn(async move { B::acquire(&leases, n, &o, None).await })
        })
        .collect();
    eventually(5 * S, "both statements wait on the insert", || async {
        busy_backends(&admin, &app).await.0 == 2
    })
    .await;
    let err = B::acquire(&leases, "first", &o, None).await.unwrap_err();
    match err {
        Error::Lease(LeaseError::Timeout { waited, .. }) => {
            eprintln!("timed out after {waited:?} (statement timeout {timeout:?})");
            assert!(
                waited >= timeout,
                "reported {waited:?} of a {timeout:?} wait"
            );
        }
        e => panic!("{e}"),
    }
    inserter.batch_execute("ROLLBACK").await.unwrap();
    for h in stuck {
        let _ = within(10 * S, "a stuck acquisition", h).await;
    }
}

backends!(
    a_timed_out_acquisition_is_released_after_its_statement_ends,
    flavor = "multi_thread",
    worker_threads = 2
);
/// Where no cancel goes (a direct connection configured as behind a
/// pooler), an acquisition that runs out of time while its statement is
/// still busy on the server (a trigger sleeps 2 s, past the 1 s statement
/// timeout; no lock wait, so its `lock_timeout` does not end it): the
/// release that follows waits for the statement's end, and the lease the
/// statement took is released. Before: the release ran at once, the
/// statement committed after it, and the lease stayed held until its TTL.
async fn a_timed_out_acquisition_is_released_after_its_statement_ends<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let s = Settings::new("timed-out", 4).pooler(PoolerMode::Transaction);
    let (pool, app) = named::<B>(&db, "timed-out", &s);
    let leases = B::leases_bounded(&pool, S);
    B::install(&leases).await.unwrap();
    // A pair first, so that the acquisition below finds a connection open
    // and its statement reaches the server within its 1 s.
    let warm = B::acquire(&leases, "warm-up", &opts(), None)
        .await
        .unwrap()
        .expect("a free name");
    B::release(warm).await.unwrap();
    admin
        .batch_execute(
            "CREATE FUNCTION slow_insert() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
               IF NEW.name LIKE 'slow-insert-%' THEN PERFORM pg_sleep(2); END IF;
               RETURN NEW;
             END $$;
             CREATE TRIGGER slow_insert BEFORE INSERT ON pgwarden_leases
               FOR EACH ROW EXECUTE FUNCTION slow_insert();",
        )
        .await
        .unwrap();
    // On a loaded machine the statement can miss its 1 s before it reaches
    // the server (no row is then written, and there is nothing to release):
    // each such try is followed by another, on a new name, until one
    // statement took its lease (deadpool: it commits on its own).
    let mut taken = false;
    for attempt in 0..5 {
        let name = format!("slow-insert-{attempt}");
        let err = B::acquire(&leases, &name, &opts(), None).await.unwrap_err();
        assert!(
            matches!(err, Error::Lease(LeaseError::Timeout { .. })),
            "{err}"
        );
        eventually(
            10 * S,
            "the statement ended, the lease held by none",
            || settled(&admin, &app, &name),
        )
        .await;
        if B::NAME != "deadpool" || released(&admin, &name).await {
            taken = true;
            break;
        }
    }
    assert!(taken, "taken, then released (in one of 5 tries)");
}

backends!(
    a_dropped_acquisition_on_a_direct_connection_is_cancelled_on_the_server,
    flavor = "multi_thread",
    worker_threads = 2
);
/// On a connection known to be direct, an acquisition dropped while its
/// statement waits on the server (on another session's uncommitted insert
/// of the same name): the statement is cancelled there while the insert is
/// still open, and nothing is left held; once the insert rolls back, the
/// name is free. A lone acquisition runs in its caller's future (no task of
/// its own, so that a pair where nothing is gathered costs what its two
/// statements cost): this is its path when the caller is dropped.
async fn a_dropped_acquisition_on_a_direct_connection_is_cancelled_on_the_server<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let s = Settings::new("dropped-direct", 4).pooler(PoolerMode::Direct);
    let (pool, app) = named::<B>(&db, "dropped-direct", &s);
    let leases = B::leases_bounded(&pool, 10 * S);
    B::install(&leases).await.unwrap();
    let inserter = insert_uncommitted(&db).await;
    let caller = tokio::spawn({
        let leases = leases.clone();
        async move { B::acquire(&leases, "first", &opts(), None).await.map(drop) }
    });
    eventually(5 * S, "the statement waits on the insert", || async {
        busy_backends(&admin, &app).await.0 == 1
    })
    .await;
    caller.abort(); // its future dropped while the statement waits
    eventually(
        5 * S,
        "the statement cancelled on the server, the insert still open",
        || async { busy_backends(&admin, &app).await.0 == 0 },
    )
    .await;
    assert!(!held(&admin, "first").await, "nothing took `first`");
    inserter.batch_execute("ROLLBACK").await.unwrap();
    let lease = B::acquire(&leases, "first", &opts(), None)
        .await
        .unwrap()
        .expect("free once the insert rolled back");
    B::release(lease).await.unwrap();
}
