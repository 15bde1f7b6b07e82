//! How to hold a lease and how to set up a [`Leases`](super::Leases):
//! [`LeaseOptions`] (a lease's TTL, renewal, safety margin and hold) and
//! [`OnLost`]; the settings of an instance as its shared state takes them
//! ([`Settings`], [`PurgeSettings`]) and their defaults; and the rules for
//! names: lease names, job and node names, holder identities.

use std::sync::OnceLock;
use std::time::Duration;

use super::table::TableName;
use super::term::{self, Timing};
use crate::error::{check_text_name, name_error, Error, NameRule};

/// The default lease TTL: 2 minutes.
pub(crate) const DEFAULT_TTL: Duration = Duration::from_secs(120);

/// What a job does when its lease is lost while it runs.
///
/// ```
/// use pgwarden::{LeaseOptions, OnLost};
/// // A job whose second concurrent run would do harm stops at the loss.
/// let opts = LeaseOptions::default().on_lost(OnLost::Cancel);
/// # let _ = opts;
/// ```
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum OnLost {
    /// Keep running; the loss is logged, counted, and visible through
    /// [`LeaseHandle::lost`](crate::LeaseHandle::lost). Default: an
    /// idempotent job may run twice rather than stop halfway.
    /// Writes that a second run would damage belong in a fenced transaction
    /// ([`LeaseHandle::fence`](crate::LeaseHandle::fence)).
    #[default]
    Signal,
    /// Drop the job's future at once (it is cancelled at its next `.await`)
    /// and return [`LeaseError::Lost`](crate::LeaseError::Lost).
    Cancel,
}

/// How to hold one lease: TTL, renewal, safety margin, at-least-hold, and
/// what a job does on loss. Validated when used (by
/// [`Leases::acquire`](crate::Leases::acquire), [`Leases::run`](crate::Leases::run)
/// or [`SchedulerBuilder::start`](crate::SchedulerBuilder::start)), with a
/// typed error.
///
/// ```
/// use std::time::Duration;
/// let opts = pgwarden::LeaseOptions::new(Duration::from_secs(120))
///     .renew_every(Duration::from_secs(30))
///     .at_least(Duration::from_secs(10))
///     .on_lost(pgwarden::OnLost::Cancel);
/// assert_ne!(opts, pgwarden::LeaseOptions::default()); // default: 2 min TTL
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use = "options do nothing until passed to an acquire or run call"]
pub struct LeaseOptions {
    ttl: Duration,
    renew_every: Option<Duration>,
    safety_margin: Option<Duration>,
    at_least: Duration,
    on_lost: OnLost,
    pub(crate) period: Option<Duration>,
}

impl Default for LeaseOptions {
    fn default() -> Self {
        LeaseOptions::new(DEFAULT_TTL)
    }
}

impl LeaseOptions {
    /// A lease of `ttl`: how long the database keeps it without a renewal,
    /// 1 s to 24 h. Default (through `Default`): 2 min.
    pub fn new(ttl: Duration) -> LeaseOptions {
        LeaseOptions {
            ttl,
            renew_every: None,
            safety_margin: None,
            at_least: Duration::ZERO,
            on_lost: OnLost::Signal,
            period: None,
        }
    }

    /// How often the lease is renewed while held: at least 10 ms and below
    /// the TTL minus the safety margin. Default: TTL / 4.
    pub fn renew_every(mut self, every: Duration) -> Self {
        self.renew_every = Some(every);
        self
    }

    /// How long before the database could let another holder in the holder
    /// stops trusting its lease: [`LeaseHandle::lost`](crate::LeaseHandle::lost)
    /// fires at (start of the last successful renewal) + TTL − margin.
    /// At most TTL / 2. Default: TTL / 8.
    pub fn safety_margin(mut self, margin: Duration) -> Self {
        self.safety_margin = Some(margin);
        self
    }

    /// Keep the lease for at least this long after it was taken, even when
    /// released earlier (ShedLock's `lockAtLeastFor`): a fast job cannot run
    /// again on another instance within that time. A crashed holder still
    /// loses the lease at its TTL. At most 366 days. Default: zero.
    pub fn at_least(mut self, at_least: Duration) -> Self {
        self.at_least = at_least;
        self
    }

    /// What [`Leases::run`](crate::Leases::run) and a scheduled
    /// [`Job`](crate::Job) do when the lease is lost mid-job. Default:
    /// [`OnLost::Signal`].
    pub fn on_lost(mut self, on_lost: OnLost) -> Self {
        self.on_lost = on_lost;
        self
    }

    pub(crate) fn on_lost_policy(&self) -> OnLost {
        self.on_lost
    }

    pub(crate) fn at_least_time(&self) -> Duration {
        self.at_least
    }

    /// Validates everything; the timing of the lease.
    pub(crate) fn validate(&self) -> Result<Timing, Error> {
        let t = Timing::new(self.ttl, self.renew_every, self.safety_margin)?;
        term::check_at_least(self.at_least)?;
        if let Some(p) = self.period {
            term::check_period(p)?;
        }
        Ok(t)
    }
}

/// The longest a lease statement may take by default (checkout included)
/// before it is cancelled on the server and fails: 10 s.
pub(crate) const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);

/// Rows expired for longer than their TTL plus this (a holder that stopped
/// renewing: what `pgwarden check` reports once it has been expired for
/// its TTL) are purged by default: one minute. Released rows do not wait
/// for it: they go in the round after the one that marked them.
pub(crate) const DEFAULT_PURGE_AFTER: Duration = Duration::from_secs(60);

/// How often the renewer purges by default: every 5 s. A released row stays
/// at most about two intervals, so the table holds the live leases and
/// about 10 s of releases, whatever the rate of new names (at 17,000 new
/// names a second on the 2-core machine of the benchmarks, about 170,000
/// rows; with rounds of 10 s twice that, and the rate fell with it).
pub(crate) const DEFAULT_PURGE_INTERVAL: Duration = Duration::from_secs(5);

/// When to delete old rows.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct PurgeSettings {
    /// Rows released or expired for longer than this are deleted.
    pub(crate) age: Duration,
    /// At most one purge statement per this interval.
    pub(crate) every: Duration,
    /// Whether the renewer purges.
    pub(crate) auto: bool,
}

/// The settings [`Inner::new`](super::inner::Inner::new) takes.
pub(crate) struct Settings {
    pub(crate) table: TableName,
    pub(crate) statement_timeout: Duration,
    pub(crate) auto_install: bool,
    pub(crate) purge: PurgeSettings,
    pub(crate) declared: Vec<String>,
}

/// Every setting at its default.
pub(super) fn default_settings() -> Settings {
    Settings {
        table: TableName::default(),
        statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
        auto_install: true,
        purge: PurgeSettings {
            age: DEFAULT_PURGE_AFTER,
            every: DEFAULT_PURGE_INTERVAL,
            auto: true,
        },
        declared: Vec::new(),
    }
}

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
    fn validates_at_the_call() {
        let s = Duration::from_secs(1);
        assert!(LeaseOptions::default().validate().is_ok());
        assert!(LeaseOptions::new(Duration::ZERO).validate().is_err());
        assert!(LeaseOptions::new(2 * s)
            .renew_every(2 * s)
            .validate()
            .is_err());
        assert!(LeaseOptions::new(2 * s)
            .at_least(400 * 24 * 3600 * s)
            .validate()
            .is_err());
        let mut o = LeaseOptions::new(2 * s);
        o.period = Some(Duration::from_millis(10));
        assert!(o.validate().is_err());
    }

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
