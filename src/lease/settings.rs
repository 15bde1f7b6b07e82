//! The settings of a [`Leases`](super::Leases) instance as its shared state
//! takes them ([`Settings`], [`PurgeSettings`]), and their defaults.

use std::time::Duration;

use super::table::TableName;

/// The longest a lease statement may take by default (checkout included)
/// before it is cancelled on the server and fails: 10 s.
pub(crate) const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);

/// Rows released or expired for longer than this are purged by default:
/// 10 minutes.
pub(crate) const DEFAULT_PURGE_AFTER: Duration = Duration::from_secs(600);

/// How often the renewer purges by default: once a minute.
pub(crate) const DEFAULT_PURGE_INTERVAL: Duration = Duration::from_secs(60);

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
