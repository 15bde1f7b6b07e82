//! pgwarden's own prepared statements on deadpool connections, found by
//! the addresses of the connection's statement cache and of the statement's
//! text: a few multiplications and one comparison of the text, where
//! deadpool's cache (`prepare_typed_cached`) hashes the whole text with
//! SipHash and clones its cell under a lock at every call (a lease
//! acquisition's text is 800 bytes: 4.5k client instructions a lone pair
//! of lease statements there, 0.4k here; callgrind).
//!
//! An entry keeps a `Weak` of the connection's deadpool cache (an `Arc`
//! made with the connection), so that address is never reused while the
//! entry lives: same address, same connection. A text's address may be
//! reused once its owner is gone (a dropped `Leases`), so an entry keeps
//! its own copy of the text and a hit compares it, with the parameters'
//! types. Statements are still prepared through deadpool's cache (a miss
//! goes there first), so `statement_caches` counts them; clearing
//! deadpool's caches does not drop these entries: pgwarden's statements
//! touch its own tables only, whose plans PostgreSQL makes again by itself
//! after a schema change. Entries of closed connections go at the next
//! miss.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Weak};

use deadpool_postgres::StatementCache;
use parking_lot::Mutex;
use tokio_postgres::types::Type;
use tokio_postgres::Statement;

/// Hashes the key (two addresses) with a multiplication each: keys are
/// addresses this process made, not chosen input.
#[derive(Default, Clone, Copy)]
struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.0 = (self.0 ^ n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// (the connection's cache address, the text's address)
type Key = (usize, usize);

struct Entry {
    conn: Weak<StatementCache>,
    text: Box<str>,
    stmt: Statement,
}

type Map = HashMap<Key, Entry, BuildHasherDefault<AddrHasher>>;

static KNOWN: Mutex<Option<Map>> = Mutex::new(None);

fn key(conn: &Arc<StatementCache>, text: &str) -> Key {
    (Arc::as_ptr(conn) as usize, text.as_ptr() as usize)
}

/// The statement `text` with parameters `types`, prepared before on the
/// connection whose deadpool cache is `conn`.
pub(super) fn get(conn: &Arc<StatementCache>, text: &str, types: &[Type]) -> Option<Statement> {
    let known = KNOWN.lock();
    let e = known.as_ref()?.get(&key(conn, text))?;
    // The entry's `Weak` pins the address: equal, it is this connection.
    (e.conn.as_ptr() == Arc::as_ptr(conn) && *e.text == *text && e.stmt.params() == types)
        .then(|| e.stmt.clone())
}

/// Keeps `stmt`, just prepared on the connection whose deadpool cache is
/// `conn`; forgets the statements of connections closed since.
pub(super) fn put(conn: &Arc<StatementCache>, text: &str, stmt: &Statement) {
    let mut known = KNOWN.lock();
    let map = known.get_or_insert_with(Map::default);
    map.retain(|_, e| e.conn.strong_count() > 0);
    map.insert(
        key(conn, text),
        Entry {
            conn: Arc::downgrade(conn),
            text: text.into(),
            stmt: stmt.clone(),
        },
    );
}

#[cfg(test)]
mod tests {
    use pgwarden_testing::TestServer;

    use super::{get, KNOWN};
    use crate::stmt::{Exec, Param, Row, Sent};

    /// How many statements are kept for the connection whose deadpool
    /// cache is at address `p`.
    fn kept_for(p: usize) -> usize {
        KNOWN
            .lock()
            .as_ref()
            .map_or(0, |m| m.keys().filter(|(c, _)| *c == p).count())
    }

    /// How many statements of text `text` the session has prepared.
    async fn prepared(c: &tokio_postgres::Client, text: &str) -> i64 {
        c.query_one(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement = $1",
            &[&text],
        )
        .await
        .unwrap()
        .get(0)
    }

    #[tokio::test]
    async fn a_statement_is_found_on_its_own_connection_only() {
        let db = TestServer::shared()
            .unwrap()
            .create_database()
            .await
            .unwrap();
        let pool = db.deadpool(1).unwrap();
        const TEXT: &str = "SELECT 40 + $1::int4";
        let types = [tokio_postgres::types::Type::INT4];

        let first = pool.get().await.unwrap();
        let cache = first.statement_cache.clone();
        assert!(get(&cache, TEXT, &types).is_none(), "not prepared yet");
        for n in 1..=2 {
            let rows = Exec::query(&*first, TEXT, &[Param::Int4(n)], Sent::Prepared)
                .await
                .unwrap();
            assert_eq!(rows[0].col::<i32>(0).unwrap(), 40 + n);
        }
        let kept = get(&cache, TEXT, &types).expect("kept after its first run");
        let rows = tokio_postgres::Client::query(&first, &kept, &[&3i32])
            .await
            .unwrap();
        assert_eq!(rows[0].get::<_, i32>(0), 43);
        // Prepared once on the server (deadpool's cache holds it too).
        assert_eq!(prepared(&first, TEXT).await, 1);
        let addr = std::sync::Arc::as_ptr(&cache) as usize;
        assert_eq!(kept_for(addr), 1);
        // The same text at another address, or with other parameter types:
        // not this entry.
        let copy = TEXT.to_owned();
        assert!(get(&cache, &copy, &types).is_none());
        assert!(get(&cache, TEXT, &[tokio_postgres::types::Type::INT8]).is_none());

        // The connection closed, a new one: the old entry is never handed
        // out for it, and goes at the next statement prepared.
        drop(cache);
        drop(deadpool_postgres::Object::take(first));
        let second = pool.get().await.unwrap();
        assert!(get(&second.statement_cache, TEXT, &types).is_none());
        let rows = Exec::query(&*second, TEXT, &[Param::Int4(2)], Sent::Prepared)
            .await
            .unwrap();
        assert_eq!(rows[0].col::<i32>(0).unwrap(), 42);
        assert_eq!(kept_for(addr), 0, "the closed connection's entry is gone");
        assert!(get(&second.statement_cache, TEXT, &types).is_some());
        assert_eq!(prepared(&second, TEXT).await, 1);
    }
}
