//! Optional tools (`pgbouncer`, `promtool`): find them, or skip a test
//! when one is missing (fail instead on CI).

use std::io::Write as _;
use std::path::PathBuf;

use crate::process;
use crate::TestingError;

/// Whether the `CI` environment variable says we run on CI (`CI=true`, or
/// any value other than empty, `0`, `false`, `no`).
pub fn ci() -> bool {
    match std::env::var("CI") {
        Ok(v) => !matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "" | "0" | "false" | "no"
        ),
        Err(_) => false,
    }
}

/// Whether the executable `name` exists: on `PATH`, in `/usr/local/sbin`,
/// `/usr/sbin`, `/sbin` (often not on a non-root `PATH`, and where Debian
/// puts `pgbouncer`), or in `/usr/lib/postgresql/*/bin`.
pub fn tool_available(name: &str) -> bool {
    find_tool(name).is_some()
}

/// The path of the executable `name`, searched as in [`tool_available`].
pub fn find_tool(name: &str) -> Option<PathBuf> {
    process::find_tool(name)
}

/// The Debian package that provides a tool this harness knows about.
fn package_of(tool: &str) -> &str {
    match tool {
        "promtool" | "prometheus" => "prometheus",
        "initdb" | "postgres" | "pg_ctl" => "postgresql",
        "psql" | "pg_isready" => "postgresql-client",
        other => other,
    }
}

/// For tests that need an optional tool: `Ok(true)` when it is there;
/// when it is missing, `Ok(false)` (and a note on stderr: skip the test), or,
/// when [`ci`] is true, [`TestingError::ToolMissing`] (fail the test).
///
/// ```no_run
/// # fn t() -> Result<(), pgwarden_testing::TestingError> {
/// if !pgwarden_testing::require_tool("pgbouncer")? {
///     return Ok(()); // skipped
/// }
/// # Ok(())
/// # }
/// ```
pub fn require_tool(name: &str) -> Result<bool, TestingError> {
    if tool_available(name) {
        return Ok(true);
    }
    let package = package_of(name).to_owned();
    if ci() {
        return Err(TestingError::ToolMissing {
            tool: name.to_owned(),
            package,
        });
    }
    // Straight to stderr, past libtest's output capture, so the skip shows.
    let _ = writeln!(
        std::io::stderr(),
        "note: `{name}` not found, skipping; install it with `apt-get install -y {package}` \
         (with CI=true this is a failure)"
    );
    Ok(false)
}
