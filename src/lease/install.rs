//! `install()`: create the lease table and its token sequence when they are
//! missing, and check the shape of what exists.
//!
//! A table that exists with other columns, without a primary key on `name`,
//! or without its sequence would make every acquisition fail with an SQL
//! error later; the check names what differs instead, once, at install or
//! at first use.

use std::time::Duration;

use deadpool_postgres::ClientWrapper as Client;
use tokio_postgres::types::Type;

use super::sql::{Statements, INSTALL_LOCK_KEY};
use crate::error::{Error, LeaseError};
use crate::lock::{xact_lock, LockMode};

/// The columns pgwarden reads and writes: name, type, and whether NULL must
/// be allowed (`prev_holder` is NULL for a new row).
const COLUMNS: &[(&str, &str, bool)] = &[
    ("name", "text", false),
    ("holder", "text", false),
    ("token", "bigint", false),
    ("taken_at", "timestamp with time zone", false),
    ("expires_at", "timestamp with time zone", false),
    ("held_until", "timestamp with time zone", false),
    ("prev_holder", "text", true),
];

/// One column as the catalog describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Column {
    pub(crate) name: String,
    pub(crate) type_name: String,
    pub(crate) not_null: bool,
    pub(crate) has_default: bool,
}

/// What the catalog says about the table and its sequence.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Shape {
    /// `relkind` of the table (`r`, `p`, or another kind), `None` if missing.
    pub(crate) table_kind: Option<String>,
    pub(crate) columns: Vec<Column>,
    /// The primary key's columns, in order (empty: none).
    pub(crate) primary_key: Vec<String>,
    /// `relkind` of the sequence, `None` if missing.
    pub(crate) sequence_kind: Option<String>,
    /// The sequence's data type (`bigint`, `integer`…).
    pub(crate) sequence_type: Option<String>,
    /// The sequence is the one owned by the table's `token` column
    /// (`OWNED BY`): `Some(false)` when it is another, or owned by nothing;
    /// `None` without a `token` column.
    pub(crate) sequence_owned: Option<bool>,
    /// Another table that the session's `search_path` finds under the bare
    /// table name (only checked when the name was given without a schema):
    /// the table an older pgwarden (or a mistyped configuration) would use.
    pub(crate) shadowed_by: Option<String>,
}

impl Shape {
    /// What differs from the shape pgwarden needs; empty when it fits.
    pub(crate) fn differences(&self, sequence: &str) -> Vec<String> {
        let mut out = Vec::new();
        match self.table_kind.as_deref() {
            None => out.push("the table does not exist".to_owned()),
            Some("r" | "p") => {}
            Some(kind) => out.push(format!("it is not a table (relkind {kind:?})")),
        }
        for (name, ty, nullable) in COLUMNS {
            match self.columns.iter().find(|c| c.name == *name) {
                None => out.push(format!("column {name} ({ty}) is missing")),
                Some(c) if c.type_name != *ty => {
                    out.push(format!("column {name} is {}, expected {ty}", c.type_name))
                }
                Some(c) if *nullable && c.not_null && !c.has_default => {
                    out.push(format!("column {name} is NOT NULL, it must allow NULL"))
                }
                Some(_) => {}
            }
        }
        for c in &self.columns {
            let ours = COLUMNS.iter().any(|(n, _, _)| *n == c.name);
            if !ours && c.not_null && !c.has_default {
                out.push(format!(
                    "extra column {} is NOT NULL without a default: pgwarden's inserts would fail",
                    c.name
                ));
            }
        }
        if self.primary_key != ["name"] {
            if self.primary_key.is_empty() {
                out.push("there is no primary key (expected PRIMARY KEY (name))".to_owned());
            } else {
                out.push(format!(
                    "the primary key is ({}), expected (name)",
                    self.primary_key.join(", ")
                ));
            }
        }
        match (self.sequence_kind.as_deref(), self.sequence_type.as_deref()) {
            (None, _) => out.push(format!("the token sequence {sequence} does not exist")),
            (Some("S"), Some("bigint")) => {}
            (Some("S"), other) => out.push(format!(
                "the token sequence {sequence} is {}, expected bigint",
                other.unwrap_or("of an unknown type")
            )),
            (Some(kind), _) => out.push(format!("{sequence} is not a sequence (relkind {kind:?})")),
        }
        if self.sequence_kind.is_some() && self.sequence_owned == Some(false) {
            out.push(format!(
                "the token sequence {sequence} is not owned by the table's token column \
                 (ALTER SEQUENCE … OWNED BY <table>.token, as in sql/leases.sql)"
            ));
        }
        if let Some(other) = &self.shadowed_by {
            out.push(format!(
                "this session's search_path finds another table of that name, {other}: \
                 a table name without a schema means public; name the table with its \
                 schema (LeasesBuilder::table) so that every instance uses the same one"
            ));
        }
        out
    }

    /// The DDL has something to create (it skips what exists).
    fn is_missing(&self) -> bool {
        self.table_kind.is_none() || self.sequence_kind.is_none()
    }
}

impl Statements {
    /// Reads the shape of the table and its sequence from the catalog.
    pub(crate) async fn shape(
        &self,
        client: &Client,
        bare: Option<&str>,
    ) -> Result<Shape, tokio_postgres::Error> {
        let (t, s) = (&self.table, &self.sequence);
        let rel = client
            .query_typed(
                "SELECT (SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)),
                        (SELECT relkind::text FROM pg_class WHERE oid = to_regclass($2)),
                        (SELECT format_type(seqtypid, NULL) FROM pg_sequence WHERE seqrelid = to_regclass($2)),
                        coalesce((SELECT array_agg(a.attname::text ORDER BY k.ord)
                                    FROM pg_index i
                                   CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
                                    JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                                   WHERE i.indrelid = to_regclass($1) AND i.indisprimary), '{}'),
                        (SELECT coalesce(to_regclass(pg_get_serial_sequence($1, 'token')) = to_regclass($2), false)
                           FROM pg_attribute
                          WHERE attrelid = to_regclass($1) AND attname = 'token' AND NOT attisdropped),
                        (SELECT format('%I.%I', n.nspname, c.relname)
                           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                          WHERE c.oid = to_regclass($3) AND c.oid IS DISTINCT FROM to_regclass($1))",
                &[(t, Type::TEXT), (s, Type::TEXT), (&bare, Type::TEXT)],
            )
            .await?;
        let columns = client
            .query_typed(
                "SELECT attname::text, format_type(atttypid, atttypmod), attnotnull, atthasdef
                   FROM pg_attribute
                  WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped
                  ORDER BY attnum",
                &[(t, Type::TEXT)],
            )
            .await?;
        let mut shape = Shape::default();
        if let Some(r) = rel.first() {
            shape.table_kind = r.try_get(0)?;
            shape.sequence_kind = r.try_get(1)?;
            shape.sequence_type = r.try_get(2)?;
            shape.primary_key = r.try_get(3)?;
            shape.sequence_owned = r.try_get(4)?;
            shape.shadowed_by = r.try_get(5)?;
        }
        for r in &columns {
            shape.columns.push(Column {
                name: r.try_get(0)?,
                type_name: r.try_get(1)?,
                not_null: r.try_get(2)?,
                has_default: r.try_get(3)?,
            });
        }
        Ok(shape)
    }

    /// Creates the table and its sequence when either is missing, inside a
    /// transaction holding the transaction-scoped advisory lock
    /// [`INSTALL_LOCK_KEY`] (waiting up to `wait` for it); then checks the
    /// shape of what exists. Returns true when it ran the DDL.
    pub(crate) async fn install(
        &self,
        client: &mut Client,
        wait: Duration,
        table_name: &str,
        bare: Option<&str>,
    ) -> Result<bool, Error> {
        let mut ran = false;
        let mut shape = self.shape(client, bare).await?;
        if shape.is_missing() {
            let tx = client.transaction().await?;
            xact_lock(&tx, INSTALL_LOCK_KEY, LockMode::Exclusive, Some(wait)).await?;
            // `IF NOT EXISTS`: another instance may have created it while
            // this one waited for the lock.
            tx.batch_execute(&self.ddl).await?;
            tx.commit().await?;
            ran = true;
            shape = self.shape(client, bare).await?;
        }
        let differences = shape.differences(&self.sequence);
        if differences.is_empty() {
            Ok(ran)
        } else {
            Err(Error::Lease(LeaseError::TableMismatch {
                table: table_name.to_owned(),
                differences,
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> Shape {
        Shape {
            table_kind: Some("r".into()),
            columns: COLUMNS
                .iter()
                .map(|(n, t, nullable)| Column {
                    name: (*n).into(),
                    type_name: (*t).into(),
                    not_null: !nullable,
                    has_default: false,
                })
                .collect(),
            primary_key: vec!["name".into()],
            sequence_kind: Some("S".into()),
            sequence_type: Some("bigint".into()),
            sequence_owned: Some(true),
            shadowed_by: None,
        }
    }

    #[test]
    fn the_shipped_shape_fits() {
        assert_eq!(good().differences("s"), Vec::<String>::new());
        let mut extra = good();
        extra.columns.push(Column {
            name: "note".into(),
            type_name: "text".into(),
            not_null: false,
            has_default: false,
        });
        assert!(extra.differences("s").is_empty());
    }

    #[test]
    fn every_difference_is_named() {
        let mut s = good();
        s.columns[2].type_name = "integer".into();
        s.columns.retain(|c| c.name != "held_until");
        s.columns[5].not_null = true; // prev_holder
        s.columns.push(Column {
            name: "owner".into(),
            type_name: "text".into(),
            not_null: true,
            has_default: false,
        });
        s.primary_key = vec!["name".into(), "holder".into()];
        s.sequence_type = Some("integer".into());
        let d = s.differences(r#""leases_token_seq""#);
        let all = d.join("\n");
        for want in [
            "column token is integer, expected bigint",
            "column held_until (timestamp with time zone) is missing",
            "column prev_holder is NOT NULL, it must allow NULL",
            "extra column owner is NOT NULL without a default",
            "the primary key is (name, holder), expected (name)",
            r#"the token sequence "leases_token_seq" is integer, expected bigint"#,
        ] {
            assert!(all.contains(want), "{want:?} not in:\n{all}");
        }
        assert_eq!(d.len(), 6, "{all}");
        let mut other = good();
        other.sequence_owned = Some(false);
        other.shadowed_by = Some("app.pgwarden_leases".into());
        let all = other.differences("seq").join("\n");
        assert!(
            all.contains("seq is not owned by the table's token column"),
            "{all}"
        );
        assert!(
            all.contains("finds another table of that name, app.pgwarden_leases"),
            "{all}"
        );
        let mut none = good();
        none.primary_key.clear();
        none.sequence_kind = None;
        none.table_kind = Some("v".into());
        let all = none.differences("seq").join("\n");
        assert!(all.contains("there is no primary key"), "{all}");
        assert!(
            all.contains("the token sequence seq does not exist"),
            "{all}"
        );
        assert!(all.contains("it is not a table"), "{all}");
    }
}
