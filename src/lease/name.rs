//! Lease names and holder identities.

use std::sync::OnceLock;

use crate::error::{check_text_name, name_error, Error, NameRule};

/// The longest lease name, in bytes (the table's `CHECK` says the same).
pub(crate) const MAX_NAME_LEN: usize = 128;

/// Validates a lease name: 1 to [`MAX_NAME_LEN`] bytes of UTF-8, no NUL
/// byte and no other control character. Lease names are metric labels:
/// keep them to the names your application declares.
pub(crate) fn check_name(name: &str) -> Result<(), Error> {
    check_text_name("lease name", name, MAX_NAME_LEN)
}

/// A job or node name, one part of a per-node lease name `job@node`:
/// not empty, no `@`.
pub(crate) fn check_part(what: &'static str, part: &str) -> Result<(), Error> {
    if part.is_empty() {
        return Err(name_error(what, part, NameRule::Empty));
    }
    if part.contains('@') {
        let rule = NameRule::Character {
            found: '@',
            allowed: "any character but '@' (it joins job@node)",
        };
        return Err(name_error(what, part, rule));
    }
    Ok(())
}

/// The host part of holder ids: `$HOSTNAME`, else the kernel's hostname,
/// else `unknown-host`; at most 64 characters, control characters replaced.
pub(crate) fn hostname() -> &'static str {
    static HOST: OnceLock<String> = OnceLock::new();
    HOST.get_or_init(|| {
        let raw = std::env::var("HOSTNAME")
            .ok()
            .filter(|h| !h.trim().is_empty())
            .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
            .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
            .unwrap_or_default();
        let clean: String = raw
            .trim()
            .chars()
            .take(64)
            .map(|c| if c.is_control() { '?' } else { c })
            .collect();
        if clean.is_empty() {
            "unknown-host".to_owned()
        } else {
            clean
        }
    })
}

/// A new holder id for one acquisition: `host:pid:64 random bits`.
///
/// Every call is its own holder: two tasks of one process exclude
/// each other, and a late release can never match a later term.
pub(crate) fn new_holder() -> String {
    use std::fmt::Write as _;
    static PREFIX: OnceLock<String> = OnceLock::new();
    let prefix = PREFIX.get_or_init(|| format!("{}:{}:", hostname(), std::process::id()));
    let mut holder = String::with_capacity(prefix.len() + 16);
    holder.push_str(prefix);
    // infallible: writing to a String cannot fail.
    let _ = write!(holder, "{:016x}", rand::random::<u64>());
    holder
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::InvalidInput;

    #[test]
    fn names() {
        assert!(check_name("cleanup").is_ok());
        assert!(check_name("uptime@node-1").is_ok());
        assert!(check_name("évaluation des alertes").is_ok());
        assert!(check_name(&"n".repeat(MAX_NAME_LEN)).is_ok());
        for bad in ["", "a\0b", "tab\there", "line\nbreak", "\u{7f}"] {
            let e = check_name(bad).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Invalid(InvalidInput::Name {
                        what: "lease name",
                        ..
                    })
                ),
                "{bad:?}"
            );
        }
        let e = check_name(&"n".repeat(MAX_NAME_LEN + 1)).unwrap_err();
        assert!(e.to_string().contains("more than 128"), "{e}");
        // a multi-byte name is measured in bytes, like the table's CHECK
        assert!(check_name(&"é".repeat(65)).is_err());
    }

    #[test]
    fn holders_are_unique_per_call() {
        let a = new_holder();
        let b = new_holder();
        assert_ne!(a, b);
        assert!(a.starts_with(&format!("{}:{}:", hostname(), std::process::id())));
        assert_eq!(a.rsplit(':').next().unwrap().len(), 16);
    }
}
