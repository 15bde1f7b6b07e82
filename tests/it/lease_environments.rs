//! Leases in the environments a deployment brings, not faults of pgwarden's
//! own: a holder cut off inside a fenced transaction (a TCP proxy that
//! black-holes its traffic: no FIN, no RST, the server keeps the session),
//! a take-over stuck on a locked row while other names are acquired,
//! instances whose `search_path`s differ, a same-named sequence earlier in
//! a search path, other roles holding advisory locks or row locks, a
//! statement that cannot even get its connection, and a scheduled run
//! interrupted at shutdown. On every backend, from one source.

use crate::support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics_util::debugging::DebuggingRecorder;
use pgwarden::{Job, LeaseOptions};
use pgwarden_testing::{Proxy, TestServer};
use support::backend::{pool_on, Backend, LeaseSettings, Settings};
use support::leases::{insert_expired, lock_rows};
use support::recorder::snapshot;
use support::{admin, counter, db, eventually, within, Logs};

const S: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

/// Whether a session of `pool` has schema `app` first in its search path
/// (the connection's `options` reached the server).
async fn app_first<B: Backend>(pool: &B::Pool) -> bool {
    let mut c = B::get(pool).await.unwrap();
    B::count(
        &mut c,
        "SELECT count(*) FILTER (WHERE (current_schemas(false))[1] = 'app')",
    )
    .await
        == 1
}

fn suffix() -> String {
    format!("{:08x}", rand_u32())
}

fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.finish() as u32
}

backends!(a_holder_cut_off_inside_a_fenced_transaction_is_taken_over_within_its_ttl);
/// Point 1: the holder is cut off (black hole) right after `fence`, its
/// fenced transaction open on the server with the row locked. At default
/// server settings the server ends that session soon after the term's
/// expiry (fence bounds its own transaction), so another instance takes the
/// lease over within TTL + 10 s, and the stale holder's commit never lands.
async fn a_holder_cut_off_inside_a_fenced_transaction_is_taken_over_within_its_ttl<B: Backend>() {
    let server = TestServer::shared().expect("server");
    let db = server.create_database().await.expect("db");
    let admin = admin(&db).await;
    admin
        .batch_execute("CREATE TABLE ledger (holder text, token bigint)")
        .await
        .unwrap();
    let proxy = Proxy::start(server).expect("proxy");
    let pool_a = B::build_on(&proxy.pg_config(&db), &Settings::new("cut-a", 3));
    let a = B::leases(&pool_a);
    let b = B::leases(&B::build(&db, &Settings::new("cut-b", 3)));
    let ttl = 3 * S;
    let opts = LeaseOptions::new(ttl);
    let lease = B::acquire(&a, "nightly", &opts, None)
        .await
        .unwrap()
        .unwrap();
    let mut conn = B::tx_source(&pool_a).await;
    let tx = B::begin(&mut conn, None).await;
    let mut tx = B::fence(&lease, tx).await.unwrap();
    let token = lease.term().token;
    B::fx_run(&mut tx, "INSERT INTO ledger VALUES ('a', $1)", Some(token))
        .await
        .unwrap();
    // Cut off: the server keeps A's session idle in its transaction.
    proxy.blackhole();
    let cut = Instant::now();
    // The margin: fence bounds the transaction to the term's end + 1 s,
    // and the take-over ends a fenced session past that; 9 s more is for a
    // loaded machine. Without that bound the cut-off session would stay
    // idle in its transaction, the row locked, until TCP keepalives end it
    // (hours): no take-over at all.
    let margin = 10 * S;
    let taken = within(
        ttl + margin + 10 * S,
        "the take-over",
        B::acquire(&b, "nightly", &opts, Some(ttl + margin)),
    )
    .await
    .unwrap()
    .expect("taken over");
    let took = cut.elapsed();
    eprintln!("take-over {took:?} after the holder was cut off inside fence (TTL {ttl:?})");
    assert!(took <= ttl + margin, "take-over after {took:?}");
    assert!(taken.term().token > lease.term().token);
    // The server ended A's session: its commit cannot land once the
    // network heals.
    proxy.heal();
    let commit = within(10 * S, "the stale commit", B::fx_commit(tx)).await;
    assert!(commit.is_err(), "a stale holder's commit went through");
    drop(conn);
    let rows: i64 = admin
        .query_one("SELECT count(*) FROM ledger WHERE holder = 'a'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0, "the stale holder's write landed");
    within(10 * S, "A learns of the loss", lease.lost()).await;
    B::release(taken).await.unwrap();
}

backends!(a_free_name_is_acquired_at_once_while_a_takeover_is_stuck);
/// Point 2: while a take-over is stuck on a locked row (three callers
/// waiting on it), acquisitions of other names on the same instance, whose
/// pool has one acquisition slot, are not held up.
async fn a_free_name_is_acquired_at_once_while_a_takeover_is_stuck<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    // A long statement timeout: a take-over statement stuck on the row
    // (waiting on its lock instead of answering busy) would hold the one
    // acquisition slot that long, and the free names below behind it.
    let b = B::leases_bounded(&B::build(&db, &Settings::new("stuck-b", 4)), 60 * S);
    B::install(&b).await.unwrap();
    insert_expired(&admin, "stale", "old-holder").await;
    let locker = lock_rows(&db, "pgwarden_leases", &["stale"], "FOR KEY SHARE").await;
    let stop = Arc::new(AtomicBool::new(false));
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let (b, stop) = (b.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let got = B::acquire(&b, "stale", &LeaseOptions::new(30 * S), Some(S))
                        .await
                        .unwrap();
                    assert!(got.is_none(), "the stale row is locked");
                }
            })
        })
        .collect();
    eventually(5 * S, "take-overs blocked", || async {
        B::lease_stats(&b).takeovers_blocked >= 3
    })
    .await;
    let mut took = Vec::new();
    for i in 0..20 {
        let t = Instant::now();
        let lease = B::acquire(&b, &format!("free-{i}"), &LeaseOptions::new(30 * S), None)
            .await
            .unwrap()
            .expect("a free name");
        took.push(t.elapsed());
        B::release(lease).await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for w in waiters {
        within(5 * S, "a waiter ends", w).await.unwrap();
    }
    drop(locker);
    took.sort();
    let blocked = B::lease_stats(&b).takeovers_blocked;
    eprintln!(
        "free names while a take-over is stuck ({blocked} blocked attempts): median {:?}, max {:?}",
        took[took.len() / 2],
        took[took.len() - 1]
    );
    // Not held up: each in well under the minute a take-over stuck on the
    // row would hold the slot (a blocked take-over answers busy after its
    // 20 ms row-lock bound; the rest is a loaded machine's round trips).
    assert!(took[took.len() - 1] < 10 * S, "{took:?}");
}

backends!(instances_with_different_search_paths_share_one_table);
/// Point 3: two instances whose search paths differ (one through the
/// connection's `options`, one a role with a schema of its own) use one
/// table: the second sees the first's lease. A table of the same name that
/// a session's search path finds first is refused at install, named.
async fn instances_with_different_search_paths_share_one_table<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let role = format!("sp_{}", suffix());
    admin
        .batch_execute(&format!(
            "CREATE SCHEMA app;
             CREATE ROLE {role} LOGIN;
             GRANT ALL ON SCHEMA public TO {role};
             CREATE SCHEMA AUTHORIZATION {role};"
        ))
        .await
        .unwrap();
    let mut in_app = db.pg_config();
    in_app.options("-csearch_path=app,public");
    let pool_a = pool_on::<B>(&in_app, "sp-a", 3).0;
    assert!(app_first::<B>(&pool_a).await, "set-up: the search path");
    let a = B::leases(&pool_a);
    let lease = B::acquire(&a, "nightly", &LeaseOptions::new(30 * S), None)
        .await
        .unwrap()
        .unwrap();
    admin
        .batch_execute(&format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON public.pgwarden_leases TO {role};
             GRANT USAGE ON SEQUENCE public.pgwarden_leases_token_seq TO {role};"
        ))
        .await
        .unwrap();
    // The role's own schema comes first in its search path ("$user").
    let mut as_role = db.pg_config();
    as_role.user(&role);
    let pool_r = pool_on::<B>(&as_role, "sp-r", 3).0;
    let r = B::leases(&pool_r);
    assert!(
        B::acquire(&r, "nightly", &LeaseOptions::new(30 * S), None)
            .await
            .unwrap()
            .is_none(),
        "both instances use public.pgwarden_leases"
    );
    let tables: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_class WHERE relname = 'pgwarden_leases' AND relkind = 'r'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 1);
    B::release(lease).await.unwrap();

    // An older install (or a mistake) left a table of that name in the
    // role's schema: its search path finds that one first. Refused, named.
    admin
        .batch_execute(&format!(
            "CREATE TABLE {role}.pgwarden_leases (LIKE public.pgwarden_leases);
             ALTER TABLE {role}.pgwarden_leases OWNER TO {role}"
        ))
        .await
        .unwrap();
    let fresh = B::leases(&pool_r);
    let err = B::install(&fresh).await.unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(
            err,
            pgwarden::Error::Lease(pgwarden::LeaseError::TableMismatch { .. })
        ),
        "{text}"
    );
    assert!(
        text.contains(&format!("{role}.pgwarden_leases")),
        "names the other table: {text}"
    );
    // Named with its schema, the same table is used without complaint.
    let public = LeaseSettings::default().table("public.pgwarden_leases");
    let named = B::leases_with(&pool_r, &public).unwrap();
    assert!(!B::install(&named).await.unwrap());
}

backends!(a_same_named_sequence_earlier_in_the_search_path_changes_no_token);
/// Point 4: a sequence named like the token sequence, earlier in one
/// instance's search path, with a smaller value: tokens still grow (the
/// sequence is schema-qualified). A sequence the table does not own is
/// refused by the install check.
async fn a_same_named_sequence_earlier_in_the_search_path_changes_no_token<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let a = B::leases(&B::build(&db, &Settings::new("seq-a", 3)));
    let mut tokens = Vec::new();
    for _ in 0..2 {
        let l = B::acquire(&a, "nightly", &LeaseOptions::new(30 * S), None)
            .await
            .unwrap()
            .unwrap();
        tokens.push(l.term().token);
        B::release(l).await.unwrap();
    }
    admin
        .batch_execute("CREATE SCHEMA app; CREATE SEQUENCE app.pgwarden_leases_token_seq AS bigint")
        .await
        .unwrap();
    let mut in_app = db.pg_config();
    in_app.options("-csearch_path=app,public");
    let pool_b = pool_on::<B>(&in_app, "seq-b", 3).0;
    assert!(app_first::<B>(&pool_b).await, "set-up: the search path");
    let b = B::leases(&pool_b);
    for _ in 0..2 {
        let l = B::acquire(&b, "nightly", &LeaseOptions::new(30 * S), None)
            .await
            .unwrap()
            .unwrap();
        tokens.push(l.term().token);
        B::release(l).await.unwrap();
    }
    assert!(tokens.windows(2).all(|w| w[1] > w[0]), "{tokens:?}");
    let other: i64 = admin
        .query_one("SELECT last_value FROM app.pgwarden_leases_token_seq", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(other, 1, "the other sequence was never drawn from");

    // A table whose token sequence is not its own.
    admin
        .batch_execute(
            "CREATE TABLE app.jobs (LIKE public.pgwarden_leases INCLUDING ALL);
             CREATE SEQUENCE app.jobs_token_seq AS bigint;",
        )
        .await
        .unwrap();
    let jobs = LeaseSettings::default().table("app.jobs");
    let c = B::leases_with(&B::build(&db, &Settings::new("seq-c", 3)), &jobs).unwrap();
    let err = B::install(&c).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("is not owned by the table's token column"),
        "{err}"
    );
}

backends!(no_advisory_lock_blocks_a_lease_and_a_row_lock_is_reported);
/// Point 5: a role with no privilege on the lease table holds advisory
/// locks on every key an older pgwarden used for a name: the lease is
/// acquired all the same. A role that may write the table can lock an
/// expired row: the take-over answers busy, counted and logged with the
/// blocking session's pid, never silently.
async fn no_advisory_lock_blocks_a_lease_and_a_row_lock_is_reported<B: Backend>() {
    let db = db().await;
    let admin = admin(&db).await;
    let (intruder, writer) = (format!("in_{}", suffix()), format!("wr_{}", suffix()));
    admin
        .batch_execute(&format!(
            "CREATE ROLE {intruder} LOGIN; CREATE ROLE {writer} LOGIN;"
        ))
        .await
        .unwrap();
    let logs = Logs::default();
    let _guard = tracing::subscriber::set_default(logs.subscriber());
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let settings = Settings::new("victim", 3);
    let declared = LeaseSettings::default().declare(&["nightly", "stale"]);
    let a = metrics::with_local_recorder(&recorder, || {
        B::leases_with(&B::build(&db, &settings), &declared).unwrap()
    });
    B::install(&a).await.unwrap();
    admin
        .batch_execute(&format!(
            "GRANT SELECT, UPDATE ON pgwarden_leases TO {writer}"
        ))
        .await
        .unwrap();

    let mut cfg = db.pg_config();
    cfg.user(&intruder);
    let other = pgwarden_testing::deadpool(cfg, 1).unwrap();
    let other = other.get().await.unwrap();
    // The per-name key of older versions, shared and exclusive, and the
    // whole of pgwarden's namespace for good measure.
    other
        .batch_execute(
            "SELECT pg_advisory_lock(1885828964, hashtext('\"pgwarden_leases\"' || 'nightly'));
             SELECT pg_advisory_lock(1885828964, hashtext('\"public\".\"pgwarden_leases\"' || 'nightly'));
             SELECT pg_advisory_lock(1885828964, g) FROM generate_series(-100, 100) g;",
        )
        .await
        .unwrap();
    // Not waited on either: an acquisition waiting on one of those locks
    // would end in the lease statement timeout, an error.
    let lease = B::acquire(&a, "nightly", &LeaseOptions::new(30 * S), None)
        .await
        .unwrap()
        .expect("no advisory lock keeps a free name busy");
    B::release(lease).await.unwrap();

    // A row lock by a role with write privileges on an expired row.
    insert_expired(&admin, "stale", "old").await;
    let mut cfg = db.pg_config();
    cfg.user(&writer);
    cfg.application_name("row-locker");
    let (locker, conn) = cfg.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    locker
        .batch_execute(
            "BEGIN; SELECT 1 FROM public.pgwarden_leases WHERE name = 'stale' FOR UPDATE",
        )
        .await
        .unwrap();
    let locker_pid: i32 = locker
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let got = B::acquire(&a, "stale", &LeaseOptions::new(30 * S), None)
        .await
        .unwrap();
    assert!(got.is_none(), "a locked row is busy");
    assert_eq!(B::lease_stats(&a).takeovers_blocked, 1);
    let counted = counter(
        &snapshot(&snap),
        &format!(
            "pgwarden_lease_takeovers_blocked_total{{lease=stale,pool={}}}",
            settings.pool_name::<B>()
        ),
    );
    assert_eq!(counted, 1);
    let text = logs.text();
    assert!(
        text.contains("lease take-over blocked by a row lock")
            && text.contains(&format!("blocking_pid={locker_pid}"))
            && text.contains("row-locker"),
        "{text}"
    );
    locker.batch_execute("ROLLBACK").await.unwrap();
    assert!(B::acquire(&a, "stale", &LeaseOptions::new(30 * S), None)
        .await
        .unwrap()
        .is_some());
}

backends!(a_statement_that_times_out_in_its_checkout_is_a_lease_timeout);
/// Point 7: a lease statement that cannot get its connection in time (the
/// request lane holds every connection acquisitions may take) fails with
/// the lease statement timeout, and the metric counts it.
async fn a_statement_that_times_out_in_its_checkout_is_a_lease_timeout<B: Backend>() {
    let db = db().await;
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let settings = Settings::new("starved", 3);
    let pool = B::build(&db, &settings);
    let leases = metrics::with_local_recorder(&recorder, || B::leases_bounded(&pool, 300 * MS));
    B::install(&leases).await.unwrap();
    // Pool of 3: the probe reserve, and two request connections taken.
    let _held = (B::get(&pool).await.unwrap(), B::get(&pool).await.unwrap());
    let mut timeouts = 0;
    for _ in 0..5 {
        let t = Instant::now();
        let err = B::acquire(&leases, "x", &LeaseOptions::new(30 * S), None)
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                pgwarden::Error::Lease(pgwarden::LeaseError::Timeout { .. })
            ),
            "{err}"
        );
        // The configured 300 ms, not the default statement timeout (10 s)
        // nor the pool's wait: half the default leaves a loaded machine
        // 4.7 s.
        assert!(t.elapsed() < 5 * S, "{:?}", t.elapsed());
        timeouts += 1;
    }
    let counted = counter(
        &snapshot(&snap),
        &format!(
            "pgwarden_lease_statement_timeouts_total{{pool={},statement=acquisition}}",
            settings.pool_name::<B>()
        ),
    );
    assert_eq!(counted, timeouts);
}

backends!(a_run_dropped_at_shutdown_keeps_its_period);
/// Point 6: a scheduled run dropped at shutdown past its grace keeps its
/// period: another instance runs the job next period, never again in the
/// same one.
async fn a_run_dropped_at_shutdown_keeps_its_period<B: Backend>() {
    let db = db().await;
    let a = B::leases(&B::build(&db, &Settings::new("sched-a", 3)));
    let b = B::leases(&B::build(&db, &Settings::new("sched-b", 3)));
    B::install(&a).await.unwrap();
    let period = 3 * S;
    let runs: Arc<std::sync::Mutex<Vec<(char, std::time::SystemTime)>>> = Arc::default();
    let a_started = Arc::new(AtomicUsize::new(0));
    let job = |who: char, started: Arc<AtomicUsize>, hang: bool| {
        let runs = runs.clone();
        Job::every("hourly", period, move |lease| {
            let (runs, started) = (runs.clone(), started.clone());
            async move {
                runs.lock().unwrap().push((who, lease.term().taken_at));
                started.fetch_add(1, Ordering::SeqCst);
                if hang {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                }
            }
        })
    };
    let sa = B::schedule(&a, vec![job('a', a_started.clone(), true)]).unwrap();
    eventually(2 * period, "A runs the job", || async {
        a_started.load(Ordering::SeqCst) == 1
    })
    .await;
    let b_started = Arc::new(AtomicUsize::new(0));
    let sb = B::schedule(&b, vec![job('b', b_started.clone(), false)]).unwrap();
    sa.shutdown(50 * MS).await;
    eventually(3 * period, "B runs the job", || async {
        b_started.load(Ordering::SeqCst) >= 1
    })
    .await;
    sb.shutdown(S).await;
    let runs = runs.lock().unwrap().clone();
    let slot = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() / period.as_secs()
    };
    eprintln!(
        "runs (who, period): {:?}",
        runs.iter().map(|(w, t)| (*w, slot(*t))).collect::<Vec<_>>()
    );
    let (first, second) = (&runs[0], &runs[1]);
    assert_eq!(first.0, 'a');
    assert!(
        slot(second.1) > slot(first.1),
        "the interrupted run's period ran again: {runs:?}"
    );
}

backends!(a_scheduler_stops_quietly_once_its_pool_is_closed);
/// Point 12: a scheduler whose pool was closed stops quietly: its job task
/// ends at its next attempt, with one debug line and no warning.
async fn a_scheduler_stops_quietly_once_its_pool_is_closed<B: Backend>() {
    let db = db().await;
    let logs = Logs::default();
    let _guard = tracing::subscriber::set_default(logs.subscriber());
    let pool = B::build(&db, &Settings::new("closing", 3));
    let leases = B::leases(&pool);
    B::install(&leases).await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let scheduler = {
        let runs = runs.clone();
        let tick = Job::every("tick", S, move |_| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
            }
        });
        B::schedule(&leases, vec![tick]).unwrap()
    };
    eventually(5 * S, "the job ran", || async {
        runs.load(Ordering::SeqCst) >= 1
    })
    .await;
    B::close(&pool).await;
    eventually(5 * S, "the job task stops", || async {
        logs.text()
            .contains("scheduler job stops: its pool is closed")
    })
    .await;
    let text = logs.text();
    assert!(
        !text.contains("scheduler could not try the job's lease"),
        "{text}"
    );
    // Nothing is left to wait for: the bound is only against a hang.
    within(30 * S, "shutdown", scheduler.shutdown(S)).await;
}
