//! Errors that say what happened: a database error shows its SQLSTATE and
//! the server's message (tokio-postgres's own text is "db error"), other
//! errors of the connection their chain of causes, and a connection string
//! that does not parse the parser's reason.
use crate::support;

use std::time::Duration;

use pgwarden::{BuildError, Error, LockKey, Pool};
use support::*;

const T: Duration = Duration::from_secs(5);

#[tokio::test]
async fn a_database_error_shows_its_sqlstate_and_the_servers_message() {
    let db = db().await;
    let pool = builder(&db, 4).build().unwrap();
    let conn = pool.get().await.unwrap();
    let e: Error = conn
        .query("SELECT * FROM no_such_table", &[])
        .await
        .unwrap_err()
        .into();
    assert_eq!(
        e.to_string(),
        r#"database error 42P01: relation "no_such_table" does not exist"#
    );
    drop(conn);

    // Through pgwarden's own calls, detail included.
    let raw = db.connect().await.unwrap();
    raw.batch_execute("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1)")
        .await
        .unwrap();
    let e = pool
        .with_xact_lock(LockKey::Pair(20, 1), T, |tx| {
            Box::pin(async move {
                tx.execute("INSERT INTO t VALUES (1)", &[]).await?;
                Ok::<_, Error>(())
            })
        })
        .await
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.starts_with(
            r#"database error 23505: duplicate key value violates unique constraint "t_pkey""#
        ),
        "{msg}"
    );
    assert!(
        msg.contains("; detail: Key (id)=(1) already exists."),
        "{msg}"
    );
    // The parts stay reachable.
    let Error::Db(db_err) = &e else {
        panic!("{e:?}")
    };
    assert_eq!(
        db_err.code(),
        Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION)
    );
}

#[tokio::test]
async fn other_errors_of_the_connection_show_their_causes() {
    let db = db().await;
    let pool = builder(&db, 4).build().unwrap();
    let conn = pool.get().await.unwrap();
    let row = conn.query_one("SELECT 1::int4", &[]).await.unwrap();
    let e: Error = row.try_get::<_, String>(0).unwrap_err().into();
    let msg = e.to_string();
    assert!(
        msg.starts_with("database error: error deserializing column 0: cannot convert between"),
        "{msg}"
    );
    assert!(msg.contains("`int4`"), "{msg}");

    // A connection whose backend was terminated.
    let pid = conn.pid();
    let raw = db.connect().await.unwrap();
    raw.execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    let mut last = None;
    for _ in 0..3 {
        // The server's FATAL 57P01 may come first; then the connection is closed.
        let e: Error = conn.simple_query("SELECT 1").await.unwrap_err().into();
        let done = matches!(&e, Error::Db(d) if d.as_db_error().is_none());
        last = Some(e);
        if done {
            break;
        }
    }
    let msg = last.unwrap().to_string();
    assert_eq!(msg, "database error: connection closed");
}

#[test]
fn a_bad_connection_string_shows_the_parsers_reason() {
    let cases = [
        (
            "host=localhost port=eighty",
            "invalid connection string: invalid value for option `port`",
        ),
        (
            "host=localhost nonsense=1",
            "invalid connection string: unknown option `nonsense`",
        ),
        (
            "host='localhost",
            "invalid connection string: unterminated quoted connection parameter value",
        ),
        (
            "postgres://u@h/db?sslmode=sometimes",
            "invalid connection string: invalid value for option `sslmode`",
        ),
    ];
    for (url, want) in cases {
        let e = Pool::from_url(url, 4).unwrap_err();
        assert!(matches!(e, BuildError::InvalidUrl(_)), "{url}: {e:?}");
        assert_eq!(e.to_string(), want, "{url}");
        // The parser's error stays reachable as the source.
        let source = std::error::Error::source(&e).expect("a source");
        assert!(source.is::<tokio_postgres::Error>(), "{url}: {source:?}");
    }
}
