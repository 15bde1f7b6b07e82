//! [`LeasesBuilder`]: the settings of a [`Leases`] instance, and their
//! defaults.

use std::ops::Bound;
use std::time::Duration;

use super::leases::Leases;
use super::options::check_name;
use super::options::{default_settings, PurgeSettings, Settings};
use super::table::{TableName, DEFAULT_TABLE};
use super::term;
use crate::error::{at_most, in_range, within, Error};
use crate::pool::Pool;

/// The shortest purge interval accepted: 10 ms.
pub(crate) const MIN_PURGE_INTERVAL: Duration = Duration::from_millis(10);

/// Builds a [`Leases`]. Every setting has a default.
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
/// use std::time::Duration;
/// let leases = pgwarden::Leases::builder(&pool)
///     .table("app.leases")
///     .auto_install(false) // migrations create it: see Leases::ddl
///     .declare(["cleanup", "report"])
///     .purge(Duration::from_secs(3600), Some(Duration::from_secs(300)))
///     .build()?;
/// # let _ = leases;
/// # Ok(()) }
/// ```
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
    /// `[A-Za-z0-9_]` not starting with a digit, the table part at most 53
    /// bytes (its sequence adds `_token_seq`; PostgreSQL's identifiers stop
    /// at 63), the schema at most 63. Quotes, spaces and other characters
    /// are refused. A name without a schema is in `public`, whatever the
    /// session's `search_path` (so that instances whose search paths differ
    /// use one table). Default: `public.pgwarden_leases`.
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = name.into();
        self
    }

    /// The longest a lease statement may take, checkout included, before it
    /// fails with [`LeaseError::Timeout`](crate::LeaseError::Timeout). The bound holds on the server too:
    /// each statement sets its own transaction's `lock_timeout` to what is
    /// left of it, so the server ends a wait on a row lock by itself, even
    /// when the client is gone; on a connection known to be direct a cancel
    /// request is sent as well. Its connection is then closed. Renewals are
    /// bounded by the local deadline as well.
    /// More than zero, at most 24 h. Default: 10 s.
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
    /// [`Scheduler`](super::Scheduler) job) counts under the label value
    /// `_other`, so that names made at run time (per user, per tenant)
    /// cannot grow the metrics without bound. Names are 1 to 128 bytes of
    /// UTF-8 without control characters. Default: none.
    pub fn declare<I, S>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.declared.extend(names.into_iter().map(Into::into));
        self
    }

    /// Old rows: the renewer deletes rows released or expired for longer
    /// than `after` (0 to 366 days), one statement (at most 500 rows) per
    /// `every` (10 ms to 366 days); `None` turns the purge off (the rows then
    /// stay: one per name ever used). Default: after 10 min, every 60 s.
    ///
    /// A purged name starts again with a new row, and its tokens still grow:
    /// a row is deleted only under an exclusive transaction-scoped try-lock
    /// on its name, which it cannot get while an acquisition of that name
    /// (which holds the lock shared from before it draws its token until it
    /// commits) is in flight. Rows it cannot lock stay for the next round; an
    /// acquisition that meets the purge of its name in the same instant
    /// finds the name busy (`Ok(None)`).
    pub fn purge(mut self, after: Duration, every: Option<Duration>) -> Self {
        self.purge.age = after;
        self.purge.auto = every.is_some();
        if let Some(every) = every {
            self.purge.every = every;
        }
        self
    }

    /// Validates the settings.
    pub fn build(self) -> Result<Leases, Error> {
        let table = TableName::parse(&self.table)?;
        let p = self.purge;
        {
            at_most("lease purge age", p.age, term::MAX_HOLD)?;
            within(
                "lease purge interval",
                p.every,
                MIN_PURGE_INTERVAL,
                term::MAX_HOLD,
            )?;
        }
        for name in &self.declared {
            check_name(name)?;
        }
        in_range(
            "lease statement timeout",
            self.statement_timeout,
            Bound::Excluded(Duration::ZERO),
            Bound::Included(term::MAX_TTL),
        )?;
        let settings = Settings {
            table,
            statement_timeout: self.statement_timeout,
            auto_install: self.auto_install,
            purge: self.purge,
            declared: self.declared,
        };
        Ok(Leases::from_parts(&self.pool, settings))
    }
}

impl Leases {
    /// Starts a builder: table name, statement timeout, auto-install,
    /// purge, declared names. See [`LeasesBuilder`].
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
