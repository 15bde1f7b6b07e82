//! [`LockKey`] and [`Namespace`]: PostgreSQL's two advisory-lock key spaces,
//! kept apart in the type, and named keys hashed client-side.

use std::fmt;

/// The key of an advisory lock.
///
/// PostgreSQL has two key spaces that never meet: one `bigint`, or a pair of
/// `int4`. `pg_advisory_lock(1)` and `pg_advisory_lock(0, 1)` do not block each
/// other, and neither do `LockKey::Single(1)` and `LockKey::Pair(0, 1)`.
///
/// Prefer pairs: the first `i32` is an application namespace ([`Namespace`]),
/// declared once as a named constant, so that two services sharing a database
/// cannot collide by accident (the key space is global to the database).
///
/// ```
/// use pgwarden::{LockKey, Namespace};
///
/// pub const BILLING: Namespace = Namespace::new(1);
///
/// let invoice = BILLING.key(987);                  // pg_advisory_lock(1, 987)
/// assert_eq!(invoice, LockKey::Pair(1, 987));
/// let nightly = BILLING.named("nightly-export");   // (1, fnv1a32("nightly-export"))
/// assert_eq!(nightly, LockKey::Pair(1, 0x042b_0053));
/// assert_ne!(LockKey::Single(1), LockKey::Pair(0, 1));
/// ```
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LockKey {
    /// One 64-bit key: `pg_advisory_lock(bigint)`.
    Single(i64),
    /// Two 32-bit keys: `pg_advisory_lock(int4, int4)`.
    Pair(i32, i32),
}

impl LockKey {
    /// Decodes a key from `pg_locks` (`classid`, `objid`, `objsubid`):
    /// a `bigint` key has `classid` = its high 32 bits, `objid` = its low 32
    /// bits and `objsubid` = 1; a pair has `classid` = the first key, `objid` =
    /// the second and `objsubid` = 2. `None` for any other `objsubid`.
    pub(crate) fn from_pg_locks(classid: u32, objid: u32, objsubid: i16) -> Option<LockKey> {
        match objsubid {
            1 => Some(LockKey::Single(
                ((u64::from(classid) << 32) | u64::from(objid)) as i64,
            )),
            2 => Some(LockKey::Pair(classid as i32, objid as i32)),
            _ => None,
        }
    }

    /// The key as it appears in `pg_locks`: (`classid`, `objid`, `objsubid`).
    #[cfg(test)]
    pub(crate) fn to_pg_locks(self) -> (u32, u32, i16) {
        match self {
            LockKey::Single(k) => ((k as u64 >> 32) as u32, k as u64 as u32, 1),
            LockKey::Pair(a, b) => (a as u32, b as u32, 2),
        }
    }

    /// The SQL arguments of the key, numbered from `$first`: `"$1"` or `"$1, $2"`.
    pub(crate) fn placeholders(self, first: usize) -> String {
        match self {
            LockKey::Single(_) => format!("${first}"),
            LockKey::Pair(..) => format!("${first}, ${}", first + 1),
        }
    }

    /// The SQL arguments of the key written out, for a statement that
    /// binds no parameters (sent where it must end a transaction in the
    /// same round trip): `'-42'::int8` or `'1'::int4, '987'::int4`. Only
    /// the key's own integers, formatted by Rust and quoted (a bare
    /// `-9223372036854775808` would be the minus of a `numeric`).
    pub(crate) fn literals(self) -> String {
        match self {
            LockKey::Single(k) => format!("'{k}'::int8"),
            LockKey::Pair(a, b) => format!("'{a}'::int4, '{b}'::int4"),
        }
    }
}

/// `42` for a single key, `1:987` for a pair.
impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockKey::Single(k) => write!(f, "{k}"),
            LockKey::Pair(a, b) => write!(f, "{a}:{b}"),
        }
    }
}

impl From<i64> for LockKey {
    fn from(k: i64) -> LockKey {
        LockKey::Single(k)
    }
}

impl From<(i32, i32)> for LockKey {
    fn from((a, b): (i32, i32)) -> LockKey {
        LockKey::Pair(a, b)
    }
}

/// An application namespace: the first `i32` of a [`LockKey::Pair`].
///
/// Declare each namespace once, as a named constant, in one place of the
/// application: `pub const BILLING: Namespace = Namespace::new(1);`.
///
/// ```
/// use pgwarden::{LockKey, Namespace};
/// const BILLING: Namespace = Namespace::new(1);
/// assert_eq!(BILLING.key(7), LockKey::Pair(1, 7));
/// assert_eq!(BILLING.id(), 1);
/// ```
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Namespace(i32);

impl Namespace {
    /// pgwarden's own namespace (`0x7067_7764`, "pgwd" in ASCII), used by
    /// [`crate::Pool::run_once`]. Do not declare it in an application.
    pub(crate) const PGWARDEN: Namespace = Namespace(0x7067_7764);

    /// A namespace with the given number.
    pub const fn new(id: i32) -> Namespace {
        Namespace(id)
    }

    /// Its number: the first key of its pairs.
    pub const fn id(self) -> i32 {
        self.0
    }

    /// The key `Pair(namespace, id)`.
    pub const fn key(self, id: i32) -> LockKey {
        LockKey::Pair(self.0, id)
    }

    /// The key `Pair(namespace, fnv1a32(name))`: the name hashed with 32-bit
    /// FNV-1a over its UTF-8 bytes, read as an `i32` (two's complement).
    ///
    /// The function is fixed (pinned by test vectors) and computed here, not
    /// with PostgreSQL's `hashtext`, whose output is not promised across
    /// PostgreSQL versions. Two names can collide (32 bits): keep a namespace's
    /// names few and list them in one place.
    pub const fn named(self, name: &str) -> LockKey {
        LockKey::Pair(self.0, fnv1a32(name.as_bytes()) as i32)
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// 32-bit FNV-1a: offset basis `0x811c9dc5`, prime `0x01000193`.
pub(crate) const fn fnv1a32(bytes: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    let mut i = 0;
    while i < bytes.len() {
        h ^= bytes[i] as u32;
        h = h.wrapping_mul(0x0100_0193);
        i += 1;
    }
    h
}

/// Exclusive or shared: one holder, or many readers and no writer.
///
/// ```no_run
/// # async fn demo(pool: pgwarden::Pool) -> Result<(), pgwarden::Error> {
/// use pgwarden::{LockKey, LockMode};
/// // Many readers at once; a writer waits for them all.
/// let read = pool.session_lock(LockKey::Single(1), LockMode::Shared, None).await?;
/// # Ok(()) }
/// ```
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum LockMode {
    /// One holder at a time (`pg_advisory_lock`); `ExclusiveLock` in `pg_locks`.
    Exclusive,
    /// Any number of shared holders, no exclusive one
    /// (`pg_advisory_lock_shared`); `ShareLock` in `pg_locks`.
    Shared,
}

impl LockMode {
    /// The mode as `pg_locks.mode` names it.
    #[cfg(test)]
    pub(crate) const fn pg_mode(self) -> &'static str {
        match self {
            LockMode::Exclusive => "ExclusiveLock",
            LockMode::Shared => "ShareLock",
        }
    }

    /// Reads `pg_locks.mode`.
    pub(crate) fn from_pg_mode(mode: &str) -> Option<LockMode> {
        match mode {
            "ExclusiveLock" => Some(LockMode::Exclusive),
            "ShareLock" => Some(LockMode::Shared),
            _ => None,
        }
    }
}

impl fmt::Display for LockMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LockMode::Exclusive => "exclusive",
            LockMode::Shared => "shared",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a32_vectors() {
        // The published FNV-1a 32 test vectors, and two of ours.
        assert_eq!(fnv1a32(b""), 0x811c_9dc5);
        assert_eq!(fnv1a32(b"a"), 0xe40c_292c);
        assert_eq!(fnv1a32(b"foobar"), 0xbf9c_f968);
        assert_eq!(fnv1a32("nightly-export".as_bytes()), 0x042b_0053);
        assert_eq!(fnv1a32("é".as_bytes()), 0x1e9d_e8c1);
    }

    #[test]
    fn named_keys_are_pairs_in_their_namespace() {
        const BILLING: Namespace = Namespace::new(1);
        const KEY: LockKey = BILLING.named("foobar");
        assert_eq!(KEY, LockKey::Pair(1, 0xbf9c_f968_u32 as i32));
        assert_eq!(KEY, LockKey::Pair(1, -1_080_231_576));
        assert_ne!(Namespace::new(2).named("foobar"), KEY);
    }

    #[test]
    fn pg_locks_round_trip() {
        for key in [
            LockKey::Single(0),
            LockKey::Single(1),
            LockKey::Single(-1),
            LockKey::Single(i64::MIN),
            LockKey::Single(i64::MAX),
            LockKey::Single(0x1234_5678_9abc_def0),
            LockKey::Pair(0, 1),
            LockKey::Pair(-1, i32::MIN),
            LockKey::Pair(i32::MAX, -7),
        ] {
            let (c, o, s) = key.to_pg_locks();
            assert_eq!(LockKey::from_pg_locks(c, o, s), Some(key), "{key:?}");
        }
        assert_eq!(LockKey::Single(-1).to_pg_locks(), (u32::MAX, u32::MAX, 1));
        assert_eq!(LockKey::Single(1).to_pg_locks(), (0, 1, 1));
        assert_eq!(LockKey::Pair(0, 1).to_pg_locks(), (0, 1, 2));
        assert_eq!(LockKey::from_pg_locks(0, 1, 3), None);
    }

    #[test]
    fn display_and_placeholders() {
        assert_eq!(LockKey::Single(-42).to_string(), "-42");
        assert_eq!(LockKey::Pair(1, 987).to_string(), "1:987");
        assert_eq!(LockKey::Single(5).placeholders(2), "$2");
        assert_eq!(LockKey::Pair(1, 2).placeholders(2), "$2, $3");
        assert_eq!(
            LockKey::Single(i64::MIN).literals(),
            "'-9223372036854775808'::int8"
        );
        assert_eq!(LockKey::Pair(-1, 2).literals(), "'-1'::int4, '2'::int4");
    }
}
