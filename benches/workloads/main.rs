//! pgwarden's benchmark workloads, measured side by side in one run.
//!
//! ```sh
//! bash benches/run.sh          # full run: writes BENCHMARKS.md
//! bash benches/run.sh --smoke  # seconds, tiny sizes: checks the benches still work
//! ```
//!
//! Method: A and B rounds interleave (A B A B …); each row reports both
//! medians and the median of the pairwise B/A ratios. Absolute numbers are
//! context on a shared 2-core machine; ratios are the result.

mod ab;
mod overhead;

use std::fmt::Write as _;

use pgwarden::testing::TestServer;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One row of BENCHMARKS.md.
#[derive(Debug, Clone)]
pub struct Row {
    pub id: &'static str,
    pub workload: String,
    pub a: String,
    pub b: String,
    pub ratio: String,
    pub target: &'static str,
    pub met: Option<bool>,
    pub notes: String,
}

/// Settings every workload reads.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub smoke: bool,
    /// Interleaved A/B round pairs.
    pub rounds: usize,
    /// Length of one round.
    pub round: std::time::Duration,
}

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().collect();
    let smoke = args.iter().any(|a| a == "--smoke");
    let only: Option<String> = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1).cloned());
    let settings = if smoke {
        Settings {
            smoke,
            rounds: 2,
            round: std::time::Duration::from_millis(150),
        }
    } else {
        Settings {
            smoke,
            rounds: 7,
            round: std::time::Duration::from_secs(2),
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let rows = rt.block_on(async {
        let server = TestServer::shared()?;
        let mut rows = Vec::new();
        let want = |id: &str| only.as_deref().is_none_or(|o| o == id);
        if want("1") {
            rows.push(overhead::get_select_1(server, settings).await?);
        }
        if want("2") {
            rows.push(overhead::checkout_from_criterion());
        }
        Ok::<_, BoxError>(rows)
    })?;
    let md = render(&rows, settings);
    print!("{md}");
    let path = if smoke {
        "target/BENCHMARKS.smoke.md"
    } else {
        "BENCHMARKS.md"
    };
    std::fs::write(path, md)?;
    eprintln!("wrote {path}");
    let missed: Vec<_> = rows
        .iter()
        .filter(|r| r.met == Some(false))
        .map(|r| r.id)
        .collect();
    if !missed.is_empty() && !smoke {
        eprintln!("targets missed: {missed:?}");
    }
    Ok(())
}

fn render(rows: &[Row], s: Settings) -> String {
    let mut md = String::new();
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let date = std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d %H:%M UTC")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .unwrap_or_default();
    let _ = writeln!(md, "# Benchmarks\n");
    let _ = writeln!(
        md,
        "- command: `bash benches/run.sh`{}",
        if s.smoke { " --smoke" } else { "" }
    );
    let _ = writeln!(md, "- machine: {cores} cores; client and server share them");
    let _ = writeln!(md, "- date: {}", date.trim());
    let _ = writeln!(
        md,
        "- server: throwaway PostgreSQL from `pgwarden::testing` (unix socket, fsync=off, synchronous_commit=off, full_page_writes=off) unless `DATABASE_URL` is set"
    );
    let _ = writeln!(
        md,
        "- method: {} interleaved A/B round pairs of {:?}; medians, and the median of pairwise B/A ratios\n",
        s.rounds, s.round
    );
    let _ = writeln!(
        md,
        "| # | workload | A | B | B/A (median of pairs) | target | met | notes |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|");
    for r in rows {
        let met = match r.met {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "n/a",
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            r.id, r.workload, r.a, r.b, r.ratio, r.target, met, r.notes
        );
    }
    md
}
