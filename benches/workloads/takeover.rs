//! Workload 6: how long until another instance takes a lease over, after its
//! holder crashed (A) or released it (B).
//!
//! The holder is another process: this benchmark binary run again with
//! `--lease-holder`, which takes the lease, prints its token, and keeps it
//! renewed. A contender in this process waits for it with `Leases::acquire`
//! (which polls: the database says how long until the lease is free, and it
//! sleeps that long, at most 500 ms between attempts).
//!
//! - crash: the holder is killed (SIGKILL, no release) at a random point of
//!   its renewal cycle, after at least one renewal; latency from the kill to
//!   the contender holding the lease, at most TTL + the poll interval. The
//!   contender starts waiting at a random point of the holder's renewal
//!   cycle.
//! - graceful: the holder is told to release on its stdin; latency from that
//!   instant to the contender holding the lease.
//!
//! The same two trials run against what a user writes by hand instead: the
//! plain lease SQL (rows 4b/4c: `INSERT … ON CONFLICT … WHERE expires_at <
//! now()`, `DELETE` to release), its holder renewing with an `UPDATE` every
//! renewal interval and its contender trying every 500 ms (the poll interval
//! pgwarden's own waits never exceed). The plain holder runs in this
//! process: its crash is its renewal task aborted and its pool dropped,
//! which for a table lease is what a SIGKILL does (the row stays until it
//! expires). Targets: after a crash, pgwarden's take-over at most the plain
//! SQL's (its contender sleeps until the expiry the database reports, the
//! plain one finds it at its next try); after a release, no more than 10 %
//! slower (both find a release at their next try: pgwarden has no
//! notification of a release).
//!
//! Trials interleave: crash, graceful, crash, graceful …, each pgwarden
//! trial followed by the plain SQL's.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use pgwarden::{LeaseOptions, Leases, Pool};
use pgwarden_testing::{TestDb, TestServer};

use crate::ab::{all, median, Compared};
use crate::plain::{PLAIN_ACQUIRE, PLAIN_DDL, PLAIN_RELEASE};
use crate::{BoxError, Row, Settings};

/// `Leases::acquire`'s longest pause between attempts.
const POLL: Duration = Duration::from_millis(500);

#[derive(Clone, Copy)]
struct Plan {
    ttl: Duration,
    renew_every: Duration,
    pairs: usize,
}

fn plan(s: Settings) -> Plan {
    if s.smoke {
        Plan {
            ttl: Duration::from_secs(1),
            renew_every: Duration::from_millis(250),
            pairs: 1,
        }
    } else {
        Plan {
            ttl: Duration::from_secs(2),
            renew_every: Duration::from_millis(500),
            // Enough for a 95 % confidence interval of the median that
            // leaves out the two most extreme pairs on each side (with 7,
            // the interval is the pairs' whole range: one slow trial of
            // the plain SQL's decided the verdict).
            pairs: 12,
        }
    }
}

pub fn describe(s: Settings) -> String {
    let p = plan(s);
    format!(
        "6: TTL {:?}, renewal every {:?}, default safety margin; the holder is a separate \
         process (pool 2), the contender `Leases::acquire` on its own pool of 2, waiting from the \
         moment the holder has the lease; the kill or release comes 1 to 3 renewal intervals \
         later (uniformly random); {} interleaved crash/graceful trial pairs, each pgwarden trial followed by one of \
         the plain lease SQL (holder in this process renewing with an `UPDATE`, contender trying every 500 ms) \
         at the same point of the renewal cycle",
        p.ttl, p.renew_every, p.pairs
    )
}

/// The `--lease-holder URL NAME TTL_MS RENEW_MS` mode: takes the lease,
/// prints `held TOKEN`, then on a line `release` on stdin releases it and
/// prints `released`. Killed, it releases nothing.
pub fn holder_main(args: &[String]) -> Result<(), BoxError> {
    let [url, name, ttl, renew] = args else {
        return Err("usage: --lease-holder URL NAME TTL_MS RENEW_MS".into());
    };
    let ttl = Duration::from_millis(ttl.parse()?);
    let renew = Duration::from_millis(renew.parse()?);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let pool = Pool::from_url(url, 2)?.name("bench-holder").build()?;
        let leases = Leases::new(&pool);
        let opts = LeaseOptions::new(ttl).renew_every(renew);
        let lease = leases
            .acquire(name, &opts, None)
            .await?
            .ok_or("the lease is held")?;
        println!("held {}", lease.term().token);
        std::io::stdout().flush()?;
        let line = tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).map(|_| line)
        })
        .await??;
        if line.trim() == "release" {
            lease.release().await?;
            println!("released");
            std::io::stdout().flush()?;
        }
        Ok(())
    })
}

/// The holder process; killed on drop if still running.
struct Holder {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl Holder {
    fn spawn(url: &str, name: &str, p: Plan) -> Result<Holder, BoxError> {
        let mut child = Command::new(std::env::current_exe()?)
            .arg("--lease-holder")
            .arg(url)
            .arg(name)
            .arg(p.ttl.as_millis().to_string())
            .arg(p.renew_every.as_millis().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        let mut h = Holder {
            child,
            stdin,
            stdout,
        };
        let line = h.line()?;
        if !line.starts_with("held ") {
            return Err(format!("lease holder: {line:?}").into());
        }
        Ok(h)
    }

    fn line(&mut self) -> Result<String, BoxError> {
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        Ok(line.trim().to_owned())
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The plain SQL's renewal: the holder's row, its expiry pushed forward.
const PLAIN_RENEW: &str =
    "UPDATE leases SET expires_at = now() + make_interval(secs => $3) WHERE name = $1 AND holder = $2";

/// The plain holder's renewals, every `every`, until aborted.
async fn plain_renewals(
    pool: deadpool_postgres::Pool,
    name: String,
    holder: String,
    ttl: f64,
    every: Duration,
) -> Result<(), BoxError> {
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    loop {
        tick.tick().await;
        let c = pool.get().await?;
        let stmt = c.prepare_cached(PLAIN_RENEW).await?;
        if c.execute(&stmt, &[&name, &holder, &ttl]).await? != 1 {
            return Err(format!("plain holder: {name} renewed no row").into());
        }
    }
}

/// The plain contender: tries every `POLL` until it holds `name` (then
/// releases it) or `wait` has passed; when it got it.
async fn plain_contender(
    pool: deadpool_postgres::Pool,
    name: String,
    ttl: f64,
    wait: Duration,
) -> Result<Option<Instant>, BoxError> {
    let me = format!("plain-contender-{:016x}", rand::random::<u64>());
    let until = Instant::now() + wait;
    loop {
        let c = pool.get().await?;
        let stmt = c.prepare_cached(PLAIN_ACQUIRE).await?;
        if c.query_opt(&stmt, &[&name, &me, &ttl]).await?.is_some() {
            let at = Instant::now();
            let stmt = c.prepare_cached(PLAIN_RELEASE).await?;
            c.execute(&stmt, &[&name, &me]).await?;
            return Ok(Some(at));
        }
        drop(c);
        if Instant::now() >= until {
            return Ok(None);
        }
        tokio::time::sleep(POLL).await;
    }
}

/// One trial of the plain lease SQL: a holder takes `name` and renews it;
/// after `after`, it crashes (`kill`: renewals stop, its pool is dropped,
/// its row stays) or releases it (`DELETE`). Milliseconds from then to the
/// contender, trying since the holder had it, holding the lease.
async fn plain_trial(
    db: &TestDb,
    contenders: &deadpool_postgres::Pool,
    name: &str,
    p: Plan,
    kill: bool,
    (offset, after): (Duration, Duration),
) -> Result<f64, BoxError> {
    let ttl = p.ttl.as_secs_f64();
    let pool = db.deadpool(2)?;
    let holder = format!("plain-holder-{:016x}", rand::random::<u64>());
    {
        let c = pool.get().await?;
        let stmt = c.prepare_cached(PLAIN_ACQUIRE).await?;
        if c.query_opt(&stmt, &[&name, &holder, &ttl]).await?.is_none() {
            return Err(format!("plain holder: {name} is held").into());
        }
    }
    let renewals = tokio::spawn(plain_renewals(
        pool.clone(),
        name.to_owned(),
        holder.clone(),
        ttl,
        p.renew_every,
    ));
    tokio::time::sleep(offset).await;
    let wait = p.ttl * 4;
    let contender = tokio::spawn(plain_contender(
        contenders.clone(),
        name.to_owned(),
        ttl,
        wait,
    ));
    tokio::time::sleep(after - offset).await;
    let t0 = Instant::now();
    renewals.abort();
    if kill {
        pool.close();
        drop(pool);
    } else {
        let c = pool.get().await?;
        let stmt = c.prepare_cached(PLAIN_RELEASE).await?;
        if c.execute(&stmt, &[&name, &holder]).await? != 1 {
            return Err(format!("plain holder: {name} released no row").into());
        }
    }
    if let Ok(Err(e)) = renewals.await {
        return Err(e);
    }
    let at = contender
        .await??
        .ok_or_else(|| format!("the plain contender did not get {name} within {wait:?}"))?;
    Ok(at.saturating_duration_since(t0).as_secs_f64() * 1e3)
}

pub async fn takeover(server: &TestServer, s: Settings) -> Result<Row, BoxError> {
    let p = plan(s);
    let db = server.create_database().await?;
    let pool = Pool::builder(db.deadpool(2)?)
        .name("bench-contender")
        .build()?;
    let leases = Leases::new(&pool);
    leases.install().await?;
    let opts = LeaseOptions::new(p.ttl).renew_every(p.renew_every);
    let wait = p.ttl * 4;
    let url = db.url();
    db.connect().await?.batch_execute(PLAIN_DDL).await?;
    let contenders = db.deadpool(2)?;

    let (mut crash, mut graceful) = (Vec::new(), Vec::new());
    let (mut plain_crash, mut plain_graceful) = (Vec::new(), Vec::new());
    for i in 0..p.pairs {
        for kill in [true, false] {
            let name = format!("w6-{i}-{}", if kill { "crash" } else { "graceful" });
            let mut holder = {
                let (url, name) = (url.clone(), name.clone());
                tokio::task::spawn_blocking(move || Holder::spawn(&url, &name, p)).await??
            };
            // The contender starts waiting at a random point of the
            // holder's renewal cycle (another instance has no reason to
            // start polling in step with the holder's renewals), then the
            // kill or release comes past at least one renewal, at a random
            // point of both cycles. The plain SQL's trial uses the same two
            // instants.
            let offset = POLL.min(p.renew_every).mul_f64(rand::random::<f64>());
            let after = p.renew_every.mul_f64(1.0 + 2.0 * rand::random::<f64>());
            tokio::time::sleep(offset).await;
            let contender = {
                let (leases, opts, name) = (leases.clone(), opts.clone(), name.clone());
                tokio::spawn(async move {
                    let lease = leases.acquire(&name, &opts, Some(wait)).await?;
                    let at = Instant::now();
                    let Some(lease) = lease else {
                        return Ok::<_, pgwarden::Error>(None);
                    };
                    lease.release().await?;
                    Ok(Some(at))
                })
            };
            tokio::time::sleep(after - offset).await;
            let t0 = Instant::now();
            if kill {
                holder.child.kill()?;
                holder.child.wait()?;
            } else {
                let mut stdin = holder.stdin.take().ok_or("no stdin")?;
                writeln!(stdin, "release")?;
                stdin.flush()?;
            }
            let at = contender
                .await??
                .ok_or_else(|| format!("the contender did not get the lease within {wait:?}"))?;
            let ms = at.saturating_duration_since(t0).as_secs_f64() * 1e3;
            if kill {
                crash.push(ms);
            } else {
                graceful.push(ms);
                tokio::task::spawn_blocking(move || {
                    let line = holder.line();
                    drop(holder);
                    line
                })
                .await??;
            }
            // The plain SQL's trial, at the same point of the cycle.
            let ms = plain_trial(
                &db,
                &contenders,
                &format!("{name}-plain"),
                p,
                kill,
                (offset, after),
            )
            .await?;
            if kill {
                plain_crash.push(ms);
            } else {
                plain_graceful.push(ms);
            }
        }
    }
    pool.close();

    let bound = (p.ttl + POLL).as_secs_f64() * 1e3;
    let worst = crash.iter().copied().fold(0.0, f64::max);
    let stat = |v: &[f64]| {
        format!(
            "median {:.0} ms, max {:.0} ms",
            median(v),
            v.iter().copied().fold(0.0, f64::max)
        )
    };
    let (c, g) = (
        Compared::new(&plain_crash, &crash),
        Compared::new(&plain_graceful, &graceful),
    );
    let within = worst <= bound;
    Ok(Row {
        id: "6",
        workload: format!(
            "lease take-over latency after a crash (SIGKILL, no release) and after a release, TTL {:?}, renewal every {:?}",
            p.ttl, p.renew_every
        ),
        a: format!(
            "plain lease SQL, tried every {} ms: crash {}; release {}",
            POLL.as_millis(),
            stat(&plain_crash),
            stat(&plain_graceful)
        ),
        b: format!(
            "pgwarden (`Leases::acquire`): crash {}; release {}",
            stat(&crash),
            stat(&graceful)
        ),
        ratio: format!(
            "crash {:.3}; release {:.3} (pgwarden / plain, median of pairs)",
            c.pairs, g.pairs
        ),
        target: "crash ≤ 1.0; release ≤ 1.1; worst crash ≤ TTL + poll interval",
        met: if s.smoke {
            None
        } else {
            all(&[c.at_most(1.0), g.at_most(1.1), Some(within)])
        },
        notes: format!(
            "{} trial pairs each, a pgwarden trial then the plain SQL's at the same point of the renewal cycle; \
             crash: {}; release: {}; pgwarden's worst crash {worst:.0} ms against the bound TTL + poll {bound:.0} ms \
             ({}); poll interval = `Leases::acquire`'s longest pause, {} ms",
            crash.len(),
            c.spread(),
            g.spread(),
            if within { "within" } else { "past it" },
            POLL.as_millis()
        ),
    })
}
