//! [`LeasesBuilder`]: the settings of a [`Leases`] instance, and their
//! defaults.

use std::time::Duration;

use super::inner::{PoolRef, PurgeSettings, Settings};
use super::leases::Leases;
use super::name::check_name;
use super::table::{TableName, DEFAULT_TABLE};
use super::timing;
use crate::error::Error;
use crate::pool::Pool;

/// The longest a lease statement may take by default (checkout included)
/// before it is cancelled on the server and fails: 10 s.
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);

/// Rows released or expired for longer than this are purged by default:
/// 10 minutes.
pub const DEFAULT_PURGE_AFTER: Duration = Duration::from_secs(600);

/// How often the renewer purges by default: once a minute.
pub const DEFAULT_PURGE_INTERVAL: Duration = Duration::from_secs(60);

/// The shortest purge interval accepted: 10 ms.
pub const MIN_PURGE_INTERVAL: Duration = Duration::from_millis(10);

/// Builds a [`Leases`]. Every setting has a default.
#[must_use = "builder does nothing until .build()"]
#[derive(Debug)]
pub struct LeasesBuilder {
    pool: Pool,
    table: String,
    statement_timeout: Duration,
    auto_install: bool,
    purge: PurgeSettings,
    declared: Vec<String>,
}

impl LeasesBuilder {
    /// The lease table: `table` or `schema.table`, each part of
    /// `[A-Za-z0-9_]` not starting with a digit, the table part at most
    /// [`MAX_TABLE_LEN`](super::MAX_TABLE_LEN) bytes (its sequence adds `_token_seq`). Quotes,
    /// spaces and other characters are refused. Default: [`DEFAULT_TABLE`].
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = name.into();
        self
    }

    /// The longest a lease statement may take, checkout included, before it
    /// fails with [`Error::LeaseTimeout`]. The bound holds on the server too:
    /// each statement sets its own transaction's `lock_timeout` to what is
    /// left of it, so the server ends a wait on a row lock by itself, even
    /// when the client is gone; on a connection known to be direct a cancel
    /// request is sent as well. Its connection is then closed. Renewals are
    /// bounded by the local deadline as well.
    /// Default: [`DEFAULT_STATEMENT_TIMEOUT`] (10 s).
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// Create the table (and its sequence) at the first acquisition when it
    /// does not exist, as [`Leases::install`] does. Turn off when migrations
    /// own the schema. Default: true.
    pub fn auto_install(mut self, on: bool) -> Self {
        self.auto_install = on;
        self
    }

    /// Declares lease names up front: each becomes a value of the `lease`
    /// label of the lease metrics. Every name not declared (here or as a
    /// [`Scheduler`](super::Scheduler) job) counts under
    /// [`UNDECLARED_LEASE`](super::UNDECLARED_LEASE), so that names made at
    /// run time (per user, per tenant) cannot grow the metrics without bound.
    /// Default: none.
    pub fn declare<I, S>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.declared.extend(names.into_iter().map(Into::into));
        self
    }

    /// Purge rows released or expired for longer than `age`: the renewer
    /// deletes them, one statement (at most 500 rows) per
    /// [`LeasesBuilder::purge_interval`]. A purged name starts again with a
    /// new row; its tokens still grow (see [`Leases::purge`]). Between 0 and
    /// 366 days. Default: [`DEFAULT_PURGE_AFTER`] (10 min).
    pub fn purge_after(mut self, age: Duration) -> Self {
        self.purge.age = age;
        self
    }

    /// How often the renewer purges: at least [`MIN_PURGE_INTERVAL`].
    /// Default: [`DEFAULT_PURGE_INTERVAL`] (60 s).
    pub fn purge_interval(mut self, every: Duration) -> Self {
        self.purge.every = every;
        self
    }

    /// Whether the renewer purges at all ([`Leases::purge`] still works).
    /// Default: true.
    pub fn auto_purge(mut self, on: bool) -> Self {
        self.purge.auto = on;
        self
    }

    /// Validates the settings.
    pub fn build(self) -> Result<Leases, Error> {
        let table = TableName::parse(&self.table)?;
        let p = self.purge;
        {
            if p.age > timing::MAX_HOLD {
                return Err(Error::invalid(
                    "lease purge age",
                    format!("{:?} is more than {:?}", p.age, timing::MAX_HOLD),
                ));
            }
            if p.every < MIN_PURGE_INTERVAL || p.every > timing::MAX_HOLD {
                return Err(Error::invalid(
                    "lease purge interval",
                    format!(
                        "{:?} is outside {MIN_PURGE_INTERVAL:?} to {:?}",
                        p.every,
                        timing::MAX_HOLD
                    ),
                ));
            }
        }
        for name in &self.declared {
            check_name(name)?;
        }
        if self.statement_timeout.is_zero() || self.statement_timeout > timing::MAX_TTL {
            return Err(Error::invalid(
                "lease statement timeout",
                format!(
                    "{:?} is outside (0, {:?}]",
                    self.statement_timeout,
                    timing::MAX_TTL
                ),
            ));
        }
        let settings = Settings {
            table,
            statement_timeout: self.statement_timeout,
            auto_install: self.auto_install,
            purge: self.purge,
            declared: self.declared,
        };
        Ok(Leases::from_parts(
            PoolRef::Strong(self.pool.clone()),
            &self.pool,
            settings,
        ))
    }
}

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

impl Leases {
    /// Starts a builder: table name, statement timeout, auto-install,
    /// purge, declared names.
    pub fn builder(pool: &Pool) -> LeasesBuilder {
        let d = default_settings();
        LeasesBuilder {
            pool: pool.clone(),
            table: DEFAULT_TABLE.to_owned(),
            statement_timeout: d.statement_timeout,
            auto_install: d.auto_install,
            purge: d.purge,
            declared: d.declared,
        }
    }
}
