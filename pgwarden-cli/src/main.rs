//! `pgwarden`: run a command under a lease, and see who holds what.
//!
//! See `pgwarden --help` and the README's "On call" section.

/// `eprintln!` that can neither panic nor block: `run` and its keeper write
/// their messages with it, so that a closed stderr (a log pipe whose reader
/// died) or a stuck one (a reader that stopped reading, a terminal stopped
/// with Ctrl-S) never holds either of them up half-way through stopping a
/// command (see [`say::line`]).
macro_rules! say {
    ($($arg:tt)*) => {{
        $crate::say::line(format_args!($($arg)*));
    }};
}

mod say;

mod connect;
mod format;
mod inspect;
mod keeper;
mod run;
mod service;

use std::ffi::OsString;
use std::fmt;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::format::parse_duration;

/// Exit code: the lease was not acquired within `--wait` (EX_TEMPFAIL).
pub(crate) const EXIT_NOT_ACQUIRED: u8 = 75;
/// Exit code: the lease was lost and the command stopped (EX_PROTOCOL).
pub(crate) const EXIT_LOST: u8 = 76;
/// Exit code: the database cannot be reached (EX_UNAVAILABLE).
pub(crate) const EXIT_UNREACHABLE: u8 = 69;
/// Exit code: bad input (as clap's own usage errors).
pub(crate) const EXIT_USAGE: u8 = 2;

/// `run --help`'s epilogue: the guarantee, its limit, the child's
/// environment and the exit codes.
const RUN_HELP: &str = "\
How CMD is kept to the lease:
  CMD runs in a process group of its own under a small keeper process (a
  child subreaper, in a session of its own: a signal to run's process
  group, kill -9 %1, kill -STOP %1, timeout -k, does not reach it). The
  keeper kills CMD and every process it started (SIGKILL to the group and
  to each descendant, setsid daemons included) when pgwarden run is gone
  (even by SIGKILL, alone or with its process group), when run stops
  answering for longer than its lease can be trusted (SIGSTOP, a stalled
  process), when the lease is lost, and when CMD exits (what it left
  running in the background is killed too). run watches the keeper in
  turn: a keeper stopped for a second, or hung past the deadline it
  acknowledged, is killed by run, with everything under it, before the
  lease can be taken over. After a lost lease (no renewal before the local deadline) CMD gets
  SIGTERM, then SIGKILL within TTL/16: it is dead before anyone else can
  take the lease. A revoked or taken-over lease kills CMD at once.
  CMD's database sessions are named after the term (application_name
  `pgwarden run NAME token N #ID`, unless PGAPPNAME is set): once CMD's tree is
  dead, and before the lease is released, run cancels those still running
  a statement, and terminates them a second later (best effort: it needs
  the database, and pg_signal_backend for another role's sessions).
  What remains possible: run and the keeper both killed or stopped at once
  (pkill -9 pgwarden), or the machine frozen or suspended as a whole (a VM
  paused, a laptop asleep): CMD's processes may then run a moment after
  another holder took the lease. So may work CMD hands to something outside
  its process tree (systemd-run, at, ssh), and another user's process the
  keeper may not signal (setuid, sudo). And a killed client's statement
  runs on in its backend (the server notices a dead client only when it
  next writes to it, or at client_connection_check_interval) when run
  cannot reach the database to cancel it, when run itself is killed (the
  keeper has no connection), or when the sessions are not named as above. Writes that must never overlap
  carry PGWARDEN_TOKEN: a fenced transaction or a store that rejects a
  token lower than the last it saw.
  Signals: SIGTERM, SIGINT, SIGHUP and SIGQUIT sent to run reach every
  process of CMD once; SIGKILL follows after --grace if they ignore them.
  CMD's own process group is not the terminal's foreground group: run
  forwards the terminal's signals. CMD has no controlling terminal (its
  keeper's session has none): it reads and writes the terminal through its
  standard input and output, but /dev/tty cannot be opened (a password
  prompt of ssh or sudo fails: give CMD its input another way).

Environment given to CMD (besides run's own):
  PGWARDEN_LEASE   the lease name
  PGWARDEN_TOKEN   this term's fencing token (grows with every take-over)
  DATABASE_URL     the server run reached, with every libpq setting given
                   (hosts, hostaddr, ssl*, sslcert/sslkey, options,
                   target_session_attrs, passfile, the rest as given) but
                   the password (PGPASSWORD and ~/.pgpass are read by libpq
                   clients as usual), with application_name=pgwarden run
                   NAME token N
  PGAPPNAME        pgwarden run NAME token N #ID (unless PGAPPNAME is set):
                   how run finds the command's sessions to cancel them

Exit codes:
  CMD's own (128 + N when signal N ended it); 75 the lease was not acquired
  within --wait (see --skip-code); 76 the lease was lost and CMD was stopped,
  or run stopped answering and the keeper killed CMD, or the keeper was
  killed, stopped or hung and run killed CMD; 69 the database is
  unreachable; 127 CMD not found; 126 CMD not executable; 2 bad input.";

#[derive(Parser, Debug)]
#[command(
    name = "pgwarden",
    version,
    about = "Run a command under a PostgreSQL table lease, and see who holds what: leases, advisory locks, health checks.",
    after_help = "Exit codes: the command's own (run); 75 lease not acquired within --wait; 76 lease lost, command stopped; 69 database unreachable; 1 check findings or an error; 2 bad input."
)]
struct Cli {
    /// The database: a postgres:// URL or a key=value string, as libpq reads
    /// them: `sslmode` (disable, prefer, require, verify-ca, verify-full),
    /// `sslrootcert`, `sslcert`, `sslkey`, `passfile` and `service` are
    /// honoured; what the URL does not say comes from the service
    /// (`service=NAME`, else PGSERVICE) in pg_service.conf (PGSERVICEFILE,
    /// else ~/.pg_service.conf, then PGSYSCONFDIR/pg_service.conf), then
    /// from PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE, PGAPPNAME,
    /// PGCONNECT_TIMEOUT, PGOPTIONS, PGTARGETSESSIONATTRS, PGSSLMODE,
    /// PGSSLROOTCERT, PGSSLCERT, PGSSLKEY and the password file
    /// (PGPASSFILE, else ~/.pgpass, mode 0600); keep the password out of
    /// the URL. Several hosts are tried in order, target_session_attrs
    /// (any, read-write, read-only, primary, standby, prefer-standby)
    /// choosing one as libpq does; run and revoke take the read-write one
    /// when none is given.
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    url: Option<String>,
    /// The lease table, `[schema.]table` (schema `public` by default),
    /// read as psql reads a name: unquoted parts are folded to lower case,
    /// a "quoted" part keeps its case.
    #[arg(long, global = true, default_value = "pgwarden_leases")]
    table: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run CMD only while holding lease NAME (renewed while it runs,
    /// released when it exits); like `consul lock` for PostgreSQL.
    #[command(after_help = RUN_HELP)]
    Run(RunArgs),
    /// List every lease row: holder, token, expiry, and a session holding a
    /// row lock on it (on a hot standby: that it is one, whether replay is
    /// paused and how old its copy is).
    Leases(ListArgs),
    /// List the advisory locks of every database of the server, with their
    /// sessions (a session's locks in one row, a summary line at the end).
    Locks(LocksArgs),
    /// Exit 0 when healthy, 1 with one line per finding (for cron, probes
    /// and runbooks); the role needs pg_monitor and SELECT on the lease
    /// table (without it, the locks are still checked and a finding says
    /// what to grant).
    Check(CheckArgs),
    /// End the current term of lease NAME: its holder's fence is refused
    /// from then on, and it learns of the loss at its next renewal.
    Revoke(RevokeArgs),
    /// Print the SQL that creates the lease table (for migration tools).
    Ddl,
    /// Print a shell completion script: `pgwarden completions bash >
    /// /etc/bash_completion.d/pgwarden` (bash, zsh, fish, elvish,
    /// powershell).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

#[derive(Args, Debug)]
pub(crate) struct RunArgs {
    /// The lease name: at most 128 bytes, no control characters.
    pub(crate) name: String,
    /// The lease's time to live: how long after a crash others wait.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub(crate) ttl: Duration,
    /// How long to wait for the lease when it is held (0s: one attempt).
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    pub(crate) wait: Duration,
    /// How long the command has between a forwarded signal (SIGTERM,
    /// SIGINT, SIGHUP, SIGQUIT) and SIGKILL. After a lost lease it is
    /// capped at TTL/16 (half the safety margin), so that SIGKILL lands
    /// before anyone else can take the lease.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) grace: Duration,
    /// The exit code when the lease was not acquired (0 for cron).
    #[arg(long, default_value_t = EXIT_NOT_ACQUIRED)]
    pub(crate) skip_code: u8,
    /// Say nothing when the lease is not acquired (for cron).
    #[arg(long, short)]
    pub(crate) quiet: bool,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true, value_name = "CMD")]
    pub(crate) cmd: Vec<OsString>,
}

#[derive(Args, Debug)]
pub(crate) struct ListArgs {
    /// One JSON array on stdout (with --watch: one JSON object per line,
    /// per sample: time, database, and the rows or the error).
    #[arg(long)]
    pub(crate) json: bool,
    /// Redraw every SECS seconds until interrupted (in place on a terminal,
    /// one sample after the other otherwise); an error is shown and the
    /// next sample tried.
    #[arg(long, value_name = "SECS", value_parser = parse_watch)]
    pub(crate) watch: Option<Duration>,
}

#[derive(Args, Debug)]
pub(crate) struct LocksArgs {
    #[command(flatten)]
    pub(crate) list: ListArgs,
    /// Only the locks of this backend pid.
    #[arg(long)]
    pub(crate) pid: Option<i32>,
    /// Only the locks of sessions with this application_name.
    #[arg(long)]
    pub(crate) app: Option<String>,
    /// Only this key: `42`, `1:987`, `pgwarden:leases.install`.
    #[arg(long)]
    pub(crate) key: Option<String>,
    /// Only the locks taken in this database.
    #[arg(long)]
    pub(crate) database: Option<String>,
}

#[derive(Args, Debug)]
pub(crate) struct CheckArgs {
    /// Flag session advisory locks held by a session idle longer than
    /// this, and lock waiters waiting longer.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    pub(crate) max_idle_lock: Duration,
    /// One JSON array of findings on stdout.
    #[arg(long)]
    pub(crate) json: bool,
    /// Print nothing when there is no finding (for cron).
    #[arg(long, short)]
    pub(crate) quiet: bool,
    /// Check advisory locks only: this database has no lease table.
    #[arg(long)]
    pub(crate) no_leases: bool,
    /// Check only the advisory locks taken in this database (default: every
    /// database of the server); a name that is no database of the server
    /// is a finding.
    #[arg(long)]
    pub(crate) database: Option<String>,
}

#[derive(Args, Debug)]
pub(crate) struct RevokeArgs {
    /// The lease name: at most 128 bytes, no control characters.
    pub(crate) name: String,
    /// Do it; without it, only print what would be done.
    #[arg(long)]
    pub(crate) yes: bool,
}

/// The longest lease name, in bytes (the library's limit).
const MAX_NAME: usize = 128;

/// A lease name: checked here so that a huge one is not echoed whole.
fn parse_name(s: &str) -> Result<String, String> {
    if s.is_empty() {
        return Err("lease name: empty".to_owned());
    }
    if s.len() > MAX_NAME {
        let head: String = s.chars().take(32).collect();
        return Err(format!(
            "lease name {head:?}…: {} bytes, at most {MAX_NAME}",
            s.len()
        ));
    }
    if let Some(c) = s.chars().find(|c| c.is_control()) {
        return Err(format!(
            "lease name {s:?}: control character {c:?}; no NUL byte or other control character"
        ));
    }
    Ok(s.to_owned())
}

/// `--table` as psql reads a name: each part unquoted (folded to lower
/// case) or "quoted" (kept as is; `""` inside is a quote, which the
/// library refuses as it refuses every character but `[A-Za-z0-9_]`).
/// The result is the name the library takes (`schema.table`, no quotes).
fn table_name(s: &str) -> Result<String, Failure> {
    let mut parts = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        let mut part = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            loop {
                match chars.next() {
                    Some('"') if chars.peek() == Some(&'"') => {
                        chars.next();
                        part.push('"');
                    }
                    Some('"') => break,
                    Some(c) => part.push(c),
                    None => {
                        return Err(Failure::usage(format!(
                            "--table {s}: unterminated quoted name"
                        )))
                    }
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c == '.' || c == '"' {
                    break;
                }
                part.push(c.to_ascii_lowercase());
                chars.next();
            }
        }
        parts.push(part);
        match chars.next() {
            None => break,
            Some('.') => continue,
            Some(c) => {
                return Err(Failure::usage(format!(
                    "--table {s}: unexpected {c:?} (a name is [schema.]table, each part unquoted or \"quoted\")"
                )))
            }
        }
    }
    Ok(parts.join("."))
}

/// Quotes an identifier for SQL (messages that show a fix).
pub(crate) fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// `schema.table` (schema `public` if none) quoted for SQL.
pub(crate) fn quoted_table(table: &str) -> String {
    let (schema, name) = table.split_once('.').unwrap_or(("public", table));
    format!("{}.{}", quote_ident(schema), quote_ident(name))
}

fn parse_watch(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_millis(100) {
        return Err(format!("--watch {s}: at least 0.1 s"));
    }
    Ok(d)
}

/// A failed command: what to print, and the exit code.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) code: u8,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn usage(message: impl Into<String>) -> Failure {
        Failure {
            code: EXIT_USAGE,
            message: message.into(),
        }
    }
    pub(crate) fn unreachable(message: impl Into<String>) -> Failure {
        Failure {
            code: EXIT_UNREACHABLE,
            message: format!("database unreachable: {}", message.into()),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// A library error: bad input is a usage error, the rest exit 1 with the
/// server's message (pgwarden's `Display` carries SQLSTATE and message).
impl From<pgwarden::Error> for Failure {
    fn from(e: pgwarden::Error) -> Failure {
        let code = if matches!(e, pgwarden::Error::Invalid(_)) {
            EXIT_USAGE
        } else {
            1
        };
        let mut message = e.to_string();
        if let pgwarden::Error::Db(db) = &e {
            use tokio_postgres::error::SqlState;
            if db.code() == Some(&SqlState::UNDEFINED_TABLE)
                || db.code() == Some(&SqlState::INVALID_SCHEMA_NAME)
            {
                message.push_str(
                    "; hint: no lease table yet (nothing took a lease), or --table names another (unquoted names are folded to lower case; \"Name\" keeps its case)",
                );
            }
            if db.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) {
                message.push_str(
                    "; hint: this role needs SELECT on the lease table (UPDATE for revoke, and USAGE on its schema): GRANT SELECT ON <table> TO <role>",
                );
            }
            if db.code() == Some(&tokio_postgres::error::SqlState::READ_ONLY_SQL_TRANSACTION) {
                message.push_str(
                    "; hint: this session is read-only (a hot standby, or default_transaction_read_only): leases are taken on the primary",
                );
            }
        }
        Failure { code, message }
    }
}

fn main() -> ExitCode {
    let mut argv = std::env::args_os();
    if argv.nth(1).is_some_and(|a| a == keeper::KEEPER_ARG) {
        return keeper::main(argv.collect());
    }
    let cli = Cli::parse();
    if !matches!(cli.cmd, Cmd::Run(_)) {
        // A closed stdout (`pgwarden locks | head -1`) ends the read-only
        // commands quietly, as it ends `ls` (run keeps running its command).
        // SAFETY: resetting a signal disposition before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            say!("pgwarden: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(dispatch(cli)) {
        Ok(code) => ExitCode::from(code),
        Err(f) => {
            if !f.message.is_empty() {
                say!("pgwarden: {f}");
            }
            ExitCode::from(f.code)
        }
    }
}

async fn dispatch(cli: Cli) -> Result<u8, Failure> {
    if let Cmd::Completions { shell } = cli.cmd {
        use clap::CommandFactory as _;
        clap_complete::generate(
            shell,
            &mut Cli::command(),
            "pgwarden",
            &mut std::io::stdout(),
        );
        return Ok(0);
    }
    let table = table_name(&cli.table)?;
    if let Cmd::Ddl = cli.cmd {
        print!("{}", inspect::ddl(&table)?);
        return Ok(0);
    }
    match &cli.cmd {
        Cmd::Run(RunArgs { name, .. }) | Cmd::Revoke(RevokeArgs { name, .. }) => {
            parse_name(name).map_err(Failure::usage)?;
        }
        _ => {}
    }
    let mut target = connect::parse(cli.url.as_deref())?;
    if matches!(cli.cmd, Cmd::Run(_) | Cmd::Revoke(_)) {
        // They write: among several hosts, the one that takes writes.
        target.need_writes();
    }
    let (pool, server) = connect::pool(&mut target).await?;
    let leases = pgwarden::Leases::builder(&pool)
        .table(table.as_str())
        .build()?;
    let place = connect::place(&target);
    let user = target.config.get_user().unwrap_or_default();
    let out = match cli.cmd {
        Cmd::Run(args) => run::run(&pool, &leases, args, connect::child_env(&target)).await,
        Cmd::Leases(args) => inspect::leases(&pool, &leases, &args, &place, server).await,
        Cmd::Locks(args) => inspect::locks(&pool, &args, &place, server).await,
        Cmd::Check(args) => inspect::check(&pool, &leases, &args, &table, user, server).await,
        Cmd::Revoke(args) => inspect::revoke(&leases, &args).await,
        Cmd::Ddl | Cmd::Completions { .. } => Ok(0), // printed above
    };
    pool.close();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_read_as_psql_reads_them() {
        let ok = |s: &str| table_name(s).map_err(|f| f.message).unwrap();
        assert_eq!(ok("Pgwarden_Leases"), "pgwarden_leases");
        assert_eq!(ok("Ops.Leases"), "ops.leases");
        assert_eq!(ok("\"Ops\".Leases"), "Ops.leases");
        assert_eq!(ok("ops.\"Lea\"\"ses\""), "ops.Lea\"ses");
        assert!(table_name("\"ops").is_err());
        assert!(table_name("\"a\"b").is_err());
        assert_eq!(quoted_table("a.b"), "\"a\".\"b\"");
        assert_eq!(quoted_table("t"), "\"public\".\"t\"");
    }
}
