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
//!   the contender holding the lease. Target: at most TTL + the poll interval.
//!   The contender starts waiting when the holder has the lease, so its
//!   polling is at a random point of its cycle too.
//! - graceful: the holder is told to release on its stdin; latency from that
//!   instant to the contender holding the lease.
//!
//! Trials interleave: crash, graceful, crash, graceful …

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use pgwarden::{LeaseOptions, Leases, Pool};
use pgwarden_testing::TestServer;

use crate::ab::median;
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
            pairs: 7,
        }
    }
}

pub fn describe(s: Settings) -> String {
    let p = plan(s);
    format!(
        "6: TTL {:?}, renewal every {:?}, default safety margin; the holder is a separate \
         process (pool 2), the contender `Leases::acquire` on its own pool of 2, waiting from the \
         moment the holder has the lease; the kill or release comes 1 to 3 renewal intervals \
         later (uniformly random); {} interleaved crash/graceful trial pairs",
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

    let mut crash = Vec::new();
    let mut graceful = Vec::new();
    for i in 0..p.pairs {
        for kill in [true, false] {
            let name = format!("w6-{i}-{}", if kill { "crash" } else { "graceful" });
            let mut holder = {
                let (url, name) = (url.clone(), name.clone());
                tokio::task::spawn_blocking(move || Holder::spawn(&url, &name, p)).await??
            };
            // The contender waits from now on, as another instance would.
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
            // Past at least one renewal, at a random point of the renewal
            // cycle and of the contender's polling.
            let phase = rand::random::<f64>();
            tokio::time::sleep(p.renew_every.mul_f64(1.0 + 2.0 * phase)).await;
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
    Ok(Row {
        id: "6",
        workload: format!(
            "lease take-over latency, TTL {:?}, renewal every {:?}",
            p.ttl, p.renew_every
        ),
        a: format!("crash (SIGKILL, no release): {}", stat(&crash)),
        b: format!("graceful release: {}", stat(&graceful)),
        ratio: format!("{:.3} (worst crash / (TTL + poll))", worst / bound),
        target: "crash ≤ TTL + poll interval; report graceful",
        met: (!s.smoke).then_some(worst <= bound),
        notes: format!(
            "{} trials each; poll interval = `Leases::acquire`'s longest pause, {} ms; bound {bound:.0} ms",
            crash.len(),
            POLL.as_millis()
        ),
    })
}
