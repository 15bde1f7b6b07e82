//! [`BuildError`]: settings that cannot work.

use std::time::Duration;

use crate::admission::LimitsError;

/// Settings that cannot work, refused by `build()` (and by
/// `Pool::from_url`/`Pool::from_config` for the pool size, and by
/// [`Pool::resize`](crate::Pool::resize) with nothing changed). Each names the
/// setting and the value; where a library refused it, that library's error
/// is the [`source`](std::error::Error::source).
///
/// ```
/// use pgwarden::{BuildError, Pool};
///
/// let e = Pool::from_url("host=localhost port=eighty", 4).unwrap_err();
/// assert!(matches!(e, BuildError::InvalidUrl(_)));
/// assert_eq!(e.to_string(), "invalid connection string: invalid value for option `port`");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The pool size or the lane limits cannot work.
    #[error(transparent)]
    Limits(#[from] LimitsError),
    /// A duration setting is out of range.
    #[error("invalid {setting} {value:?}: {why}")]
    InvalidDuration {
        /// The setting, as the builder method names it.
        setting: &'static str,
        /// The value given.
        value: Duration,
        /// What is allowed.
        why: &'static str,
    },
    /// The deadpool pool handed to `Pool::builder` has connections out (or
    /// callers waiting) already: pgwarden must own all of its capacity.
    #[error(
        "the deadpool pool has {in_use} of {max_size} connections out or waited for already: \
         pgwarden must own all of its capacity; build pgwarden over a pool nothing else uses"
    )]
    DeadpoolInUse {
        /// Objects out or callers waiting in deadpool.
        in_use: usize,
        /// deadpool's `max_size`.
        max_size: usize,
    },
    /// The deadpool pool handed to `Pool::builder` is closed (or, from
    /// `Pool::resize`, the pool was closed).
    #[error("the deadpool pool is closed")]
    DeadpoolClosed,
    /// The pool name is empty or too long.
    #[error("invalid pool name {0:?}: use 1 to 64 characters of [A-Za-z0-9_.-]")]
    InvalidName(String),
    /// deadpool could not build the pool from the given configuration: its
    /// `CreatePoolError` or `BuildError`, the source.
    #[error("cannot build the deadpool pool: {0}")]
    Deadpool(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The connection string did not parse. Displayed with the parser's
    /// reason, for example ``invalid value for option `port` `` or
    /// `unexpected EOF`; the parser's error is the source.
    #[error("invalid connection string: {}", UrlReason(.0))]
    InvalidUrl(#[source] tokio_postgres::Error),
}

/// The parser's reason: the error's sources (its own text only says
/// "invalid connection string"), or the error when it has none.
struct UrlReason<'a>(&'a tokio_postgres::Error);

impl std::fmt::Display for UrlReason<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match std::error::Error::source(self.0) {
            Some(reason) => write!(f, "{}", super::Chain(reason)),
            None => write!(f, "{}", self.0),
        }
    }
}
