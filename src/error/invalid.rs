//! [`InvalidInput`]: bad input at the call, with the offending value and
//! what is allowed.

use std::fmt;
use std::ops::{Bound, RangeBounds};
use std::time::Duration;

/// Bad input at the call (a setting, a name), refused before anything ran.
/// Each variant carries the value given and what is allowed. Recover by
/// fixing the call: retrying the same input fails the same way.
///
/// ```no_run
/// use pgwarden::{Error, InvalidInput, Leases};
/// use std::ops::Bound;
/// use std::time::Duration;
///
/// # fn demo(pool: pgwarden::Pool) {
/// let e = Leases::builder(&pool)
///     .statement_timeout(Duration::ZERO)
///     .build()
///     .unwrap_err();
/// let Error::Invalid(InvalidInput::Duration { value, min, .. }) = e else { panic!("{e}") };
/// assert_eq!(value, Duration::ZERO);
/// assert_eq!(min, Bound::Excluded(Duration::ZERO));
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidInput {
    /// A duration outside its allowed range.
    #[error("invalid {what} {value:?}: allowed {}", Interval(min, max))]
    Duration {
        /// The setting, as its builder method or option names it.
        what: &'static str,
        /// The value given.
        value: Duration,
        /// The least allowed value (excluded or included).
        min: Bound<Duration>,
        /// The greatest allowed value (excluded or included).
        max: Bound<Duration>,
    },
    /// A name that breaks a rule.
    #[error("invalid {what} {value:?}: {rule}")]
    Name {
        /// Which name: `lease name`, `lease table name`, `job name`,
        /// `node name`, `migrate_once name`.
        what: &'static str,
        /// The name given (for a `schema.table` name, the part at fault).
        value: String,
        /// The rule it breaks.
        rule: NameRule,
    },
    /// The call needs a running tokio runtime and was made outside one.
    #[error("{what} needs a running tokio runtime: call it inside one")]
    NoRuntime {
        /// The call.
        what: &'static str,
    },
    /// The call takes a transaction-scoped lock and was given a connection
    /// in no transaction (sqlx: none opened with sqlx's `begin`), where
    /// the lock would be released as soon as its own statement ended.
    #[error("{what} needs a transaction open on the connection: pass `&mut tx` of a transaction opened with `begin`")]
    NoTransaction {
        /// The call.
        what: &'static str,
    },
}

/// The rule a name breaks ([`InvalidInput::Name`]).
///
/// ```no_run
/// use pgwarden::{Error, InvalidInput, Leases, NameRule};
///
/// # fn demo(pool: pgwarden::Pool) {
/// let e = Leases::builder(&pool).table("my leases").build().unwrap_err();
/// assert!(matches!(
///     e,
///     Error::Invalid(InvalidInput::Name { rule: NameRule::Character { found: ' ', .. }, .. })
/// ));
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum NameRule {
    /// It is empty.
    Empty,
    /// It is longer than allowed, in bytes.
    TooLong {
        /// Its length in bytes.
        len: usize,
        /// The most allowed.
        max: usize,
    },
    /// It contains a character not allowed.
    Character {
        /// The first character not allowed.
        found: char,
        /// What is allowed.
        allowed: &'static str,
    },
    /// It starts with a digit.
    StartsWithDigit,
    /// Another of the same kind has this name already.
    Duplicate,
}

impl fmt::Display for NameRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NameRule::Empty => f.write_str("it is empty"),
            NameRule::TooLong { len, max } => write!(f, "it is {len} bytes, more than {max}"),
            NameRule::Character { found, allowed } => {
                write!(f, "it contains {found:?}; allowed: {allowed}")
            }
            NameRule::StartsWithDigit => f.write_str("it starts with a digit"),
            NameRule::Duplicate => f.write_str("it is given twice"),
        }
    }
}

/// `[1s, 24h]`, `(0ns, 5s]`, `[10ms, 7s)`.
struct Interval<'a>(&'a Bound<Duration>, &'a Bound<Duration>);

impl fmt::Display for Interval<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Bound::Included(d) => write!(f, "[{d:?}, ")?,
            Bound::Excluded(d) => write!(f, "({d:?}, ")?,
            Bound::Unbounded => f.write_str("(-, ")?,
        }
        match self.1 {
            Bound::Included(d) => write!(f, "{d:?}]"),
            Bound::Excluded(d) => write!(f, "{d:?})"),
            Bound::Unbounded => f.write_str("-)"),
        }
    }
}

/// `value` within `[min, max]`, else [`InvalidInput::Duration`].
pub(crate) fn within(
    what: &'static str,
    value: Duration,
    min: Duration,
    max: Duration,
) -> Result<(), InvalidInput> {
    in_range(what, value, Bound::Included(min), Bound::Included(max))
}

/// `value` at most `max`, else [`InvalidInput::Duration`].
pub(crate) fn at_most(
    what: &'static str,
    value: Duration,
    max: Duration,
) -> Result<(), InvalidInput> {
    within(what, value, Duration::ZERO, max)
}

/// `value` between `min` and `max`, else [`InvalidInput::Duration`].
pub(crate) fn in_range(
    what: &'static str,
    value: Duration,
    min: Bound<Duration>,
    max: Bound<Duration>,
) -> Result<(), InvalidInput> {
    if (min, max).contains(&value) {
        return Ok(());
    }
    Err(InvalidInput::Duration {
        what,
        value,
        min,
        max,
    })
}

/// Checks a name given as free text (a lease name, a migration name): 1 to
/// `max` bytes of UTF-8, no NUL byte and no other control character.
pub(crate) fn check_text_name(
    what: &'static str,
    name: &str,
    max: usize,
) -> Result<(), super::Error> {
    let bad = |rule| Err(name_error(what, name, rule));
    if name.is_empty() {
        return bad(NameRule::Empty);
    }
    if name.len() > max {
        return bad(NameRule::TooLong {
            len: name.len(),
            max,
        });
    }
    if let Some(found) = name.chars().find(|c| c.is_control()) {
        return bad(NameRule::Character {
            found,
            allowed: "no NUL byte or other control character",
        });
    }
    Ok(())
}

/// [`InvalidInput::Name`], as an [`Error`](super::Error).
pub(crate) fn name_error(what: &'static str, value: &str, rule: NameRule) -> super::Error {
    super::Error::Invalid(InvalidInput::Name {
        what,
        value: value.to_owned(),
        rule,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn durations_name_the_value_and_the_range() {
        assert!(within("x", S, S, 2 * S).is_ok());
        assert!(within("x", 2 * S, S, 2 * S).is_ok());
        let e = within("lease TTL", 3 * S, S, 2 * S).unwrap_err();
        assert_eq!(e.to_string(), "invalid lease TTL 3s: allowed [1s, 2s]");
        let e = in_range(
            "x",
            Duration::ZERO,
            Bound::Excluded(Duration::ZERO),
            Bound::Included(S),
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "invalid x 0ns: allowed (0ns, 1s]");
        assert!(in_range("x", S, Bound::Included(Duration::ZERO), Bound::Excluded(S)).is_err());
        assert!(at_most("x", S, S).is_ok());
    }
}
