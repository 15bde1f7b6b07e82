//! libpq's connection service file (`pg_service.conf`): a service's
//! settings, found as libpq finds them.

use std::path::{Path, PathBuf};

use crate::Failure;

/// One `key=value` line of a service.
pub(crate) struct Setting {
    pub(crate) key: String,
    pub(crate) value: String,
    pub(crate) line: usize,
}

/// A service's settings and the file they come from.
pub(crate) struct Found {
    pub(crate) file: PathBuf,
    pub(crate) settings: Vec<Setting>,
}

/// The system-wide directory of `pg_service.conf` when `PGSYSCONFDIR` is
/// not set: libpq's compiled-in one, which differs between packagings
/// (Debian and Ubuntu, the PGDG RPMs, a source build); the first that
/// exists.
const SYSCONFDIRS: &[&str] = &[
    "/etc/postgresql-common",
    "/etc/sysconfig/pgsql",
    "/usr/local/pgsql/etc",
];

fn env(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.is_empty())
}

/// Service `name`'s settings, in libpq's order: `PGSERVICEFILE` (which
/// must exist if set), else `~/.pg_service.conf` (if it exists); then, when
/// the service is not there, `pg_service.conf` in `PGSYSCONFDIR`.
pub(crate) fn lookup(name: &str) -> Result<Found, Failure> {
    let mut looked = Vec::new();
    let user = match env("PGSERVICEFILE") {
        Some(f) => Some((PathBuf::from(f), true)),
        None => env("HOME").map(|h| (Path::new(&h).join(".pg_service.conf"), false)),
    };
    if let Some((file, must)) = user {
        if must || file.exists() {
            if let Some(settings) = read(&file, name)? {
                return Ok(Found { file, settings });
            }
            looked.push(file);
        }
    }
    let dir = env("PGSYSCONFDIR").map(PathBuf::from).or_else(|| {
        SYSCONFDIRS
            .iter()
            .map(PathBuf::from)
            .find(|d| d.join("pg_service.conf").exists())
    });
    if let Some(dir) = dir {
        let file = dir.join("pg_service.conf");
        if file.exists() {
            if let Some(settings) = read(&file, name)? {
                return Ok(Found { file, settings });
            }
            looked.push(file);
        }
    }
    let looked = if looked.is_empty() {
        "no service file exists: PGSERVICEFILE, ~/.pg_service.conf or PGSYSCONFDIR/pg_service.conf"
            .to_owned()
    } else {
        format!(
            "looked in {}",
            looked
                .iter()
                .map(|f| f.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    Err(Failure::usage(format!(
        "definition of service {name:?} not found ({looked})"
    )))
}

/// The settings of `[name]` in `file`, or `None` when it has no such
/// section. libpq's syntax: whitespace around a line is ignored, `#`
/// starts a comment line, `[name]` a section (the first section of that
/// name counts), `key=value` with no space around `=`; a key that is not a
/// connection setting, or `service`, is an error.
fn read(file: &Path, name: &str) -> Result<Option<Vec<Setting>>, Failure> {
    let shown = file.display();
    let text = std::fs::read(file).map_err(|e| {
        Failure::usage(if e.kind() == std::io::ErrorKind::NotFound {
            format!("service file {shown} not found")
        } else {
            format!("service file {shown}: {e}")
        })
    })?;
    let text = String::from_utf8_lossy(&text);
    let mut found: Option<Vec<Setting>> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        let n = i + 1;
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(section) = line.strip_prefix('[') {
            if found.is_some() {
                break;
            }
            if section
                .strip_prefix(name)
                .is_some_and(|r| r.starts_with(']'))
            {
                found = Some(Vec::new());
            }
            continue;
        }
        let Some(settings) = found.as_mut() else {
            continue;
        };
        if line.starts_with("ldap") {
            return Err(Failure::usage(format!(
                "service file {shown}, line {n}: LDAP lookups are not supported by pgwarden"
            )));
        }
        let Some((key, value)) = line.split_once('=') else {
            return Err(Failure::usage(format!(
                "syntax error in service file {shown}, line {n}: expected key=value or [service]"
            )));
        };
        if key == "service" {
            return Err(Failure::usage(format!(
                "nested service specifications not supported in service file {shown}, line {n}"
            )));
        }
        if key.is_empty() || key.contains(char::is_whitespace) {
            return Err(Failure::usage(format!(
                "syntax error in service file {shown}, line {n}: {key:?} is not a setting (no space around =)"
            )));
        }
        // The first setting of a key counts (libpq's rule).
        if !settings.iter().any(|s| s.key == key) {
            settings.push(Setting {
                key: key.to_owned(),
                value: value.to_owned(),
                line: n,
            });
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_and_lines_follow_libpq() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("s.conf");
        std::fs::write(
            &f,
            "#c\n[ab]\nhost=x\n  [a]  trailing\n port=1 \nport=2\nuser= sp\n[a]\nport=3\n",
        )
        .unwrap();
        let got = read(&f, "a").map_err(|e| e.message).unwrap().unwrap();
        let pairs: Vec<(&str, &str, usize)> = got
            .iter()
            .map(|s| (s.key.as_str(), s.value.as_str(), s.line))
            .collect();
        assert_eq!(pairs, [("port", "1", 5), ("user", " sp", 7)]);
        assert!(read(&f, "none").map_err(|e| e.message).unwrap().is_none());
        std::fs::write(&f, "[a]\nservice=b\n").unwrap();
        let e = read(&f, "a").err().unwrap().message;
        assert!(e.contains("nested") && e.contains("line 2"), "{e}");
        std::fs::write(&f, "[a]\nhost\n").unwrap();
        assert!(read(&f, "a")
            .err()
            .unwrap()
            .message
            .contains("syntax error"));
    }
}
