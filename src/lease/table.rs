//! The lease table's name: validated, quoted, and the DDL that creates it.

use std::fmt;

use crate::error::{name_error, Error, NameRule};

/// The default lease table: `public.pgwarden_leases`.
pub(crate) const DEFAULT_TABLE: &str = "pgwarden_leases";

/// The schema of a table name given without one: `public`, whatever the
/// session's `search_path` (two instances whose search paths differ must
/// use the same table).
pub(crate) const DEFAULT_SCHEMA: &str = "public";

/// The longest table name part, in bytes: PostgreSQL truncates identifiers
/// past 63 bytes, and the token sequence adds `_token_seq` (10 bytes).
pub(crate) const MAX_TABLE_LEN: usize = 53;

/// The longest schema name, in bytes (PostgreSQL's identifier limit).
pub(crate) const MAX_SCHEMA_LEN: usize = 63;

const SEQ_SUFFIX: &str = "_token_seq";

/// The DDL shipped in `sql/leases.sql`, written for the default names.
pub(crate) const DDL_TEMPLATE: &str = include_str!("../../sql/leases.sql");

/// A validated `[schema.]table` name, always resolved to a schema: a name
/// given without one is in [`DEFAULT_SCHEMA`], never looked up through the
/// session's `search_path`.
///
/// Each part is 1 to 63 bytes (the table part 1 to [`MAX_TABLE_LEN`]) of
/// `[A-Za-z0-9_]`, not starting with a digit. Quotes, spaces, NUL bytes and
/// any other character are refused rather than escaped, so that the name
/// reads the same in SQL, logs and `psql`. Each part is double-quoted in the
/// statements, which keeps its case and allows reserved words (`user`).
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct TableName {
    schema: String,
    table: String,
    /// The name was given without a schema.
    defaulted: bool,
}

fn valid_part(part: &str, max: usize) -> Result<(), NameRule> {
    if part.is_empty() {
        return Err(NameRule::Empty);
    }
    if part.len() > max {
        return Err(NameRule::TooLong {
            len: part.len(),
            max,
        });
    }
    if part.as_bytes().first().is_some_and(u8::is_ascii_digit) {
        return Err(NameRule::StartsWithDigit);
    }
    if let Some(found) = part
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_'))
    {
        return Err(NameRule::Character {
            found,
            allowed: ALLOWED,
        });
    }
    Ok(())
}

/// What a table name may contain.
const ALLOWED: &str = "[A-Za-z0-9_] in each part, and one dot between schema and table";

impl TableName {
    /// Parses `table` or `schema.table`.
    pub(crate) fn parse(name: &str) -> Result<TableName, Error> {
        fn bad(part: &str) -> impl FnOnce(NameRule) -> Error + '_ {
            move |rule| name_error("lease table name", part, rule)
        }
        let mut parts = name.split('.');
        let (schema, table) = match (parts.next(), parts.next(), parts.next()) {
            (Some(t), None, _) => (None, t),
            (Some(s), Some(t), None) => (Some(s), t),
            _ => {
                return Err(bad(name)(NameRule::Character {
                    found: '.',
                    allowed: ALLOWED,
                }))
            }
        };
        if let Some(s) = schema {
            valid_part(s, MAX_SCHEMA_LEN).map_err(bad(s))?;
        }
        valid_part(table, MAX_TABLE_LEN).map_err(bad(table))?;
        Ok(TableName {
            schema: schema.unwrap_or(DEFAULT_SCHEMA).to_owned(),
            table: table.to_owned(),
            defaulted: schema.is_none(),
        })
    }

    fn qualified(&self, table: &str) -> String {
        format!("{}.{}", quote_ident(&self.schema), quote_ident(table))
    }

    /// The table part alone, quoted, as `search_path` would resolve it:
    /// for the check that no other table of that name shadows this one in
    /// the session's search path (set only when the schema was defaulted).
    pub(crate) fn unqualified_if_defaulted(&self) -> Option<String> {
        self.defaulted.then(|| quote_ident(&self.table))
    }

    /// The table, quoted for SQL: `"app"."leases"`.
    pub(crate) fn quoted(&self) -> String {
        self.qualified(&self.table)
    }

    /// The token sequence, quoted for SQL: `"app"."leases_token_seq"`.
    pub(crate) fn sequence_quoted(&self) -> String {
        self.qualified(&format!("{}{SEQ_SUFFIX}", self.table))
    }

    /// The token sequence as a string literal for `nextval(…)`.
    pub(crate) fn sequence_literal(&self) -> String {
        quote_literal(&self.sequence_quoted())
    }

    /// The DDL of `sql/leases.sql` for this table.
    pub(crate) fn ddl(&self) -> String {
        let seq = format!("\"{DEFAULT_SCHEMA}\".\"{DEFAULT_TABLE}{SEQ_SUFFIX}\"");
        let table = format!("\"{DEFAULT_SCHEMA}\".\"{DEFAULT_TABLE}\"");
        DDL_TEMPLATE
            .replace(&seq, &self.sequence_quoted())
            .replace(&table, &self.quoted())
    }
}

impl Default for TableName {
    fn default() -> TableName {
        TableName {
            schema: DEFAULT_SCHEMA.to_owned(),
            table: DEFAULT_TABLE.to_owned(),
            defaulted: true,
        }
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.schema, self.table)
    }
}

impl fmt::Debug for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.to_string())
    }
}

/// Quotes an identifier: wraps it in double quotes, doubling any inside.
pub(crate) fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// Quotes a string literal: wraps it in single quotes, doubling any inside.
pub(crate) fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::InvalidInput;

    #[test]
    fn accepts_plain_and_schema_qualified_names() {
        let t = TableName::parse("leases").unwrap();
        assert_eq!(t.quoted(), r#""public"."leases""#);
        assert_eq!(t.sequence_quoted(), r#""public"."leases_token_seq""#);
        assert_eq!(t.to_string(), "public.leases");
        assert_eq!(t.unqualified_if_defaulted().as_deref(), Some(r#""leases""#));
        let t = TableName::parse("app.Job_Leases2").unwrap();
        assert_eq!(t.quoted(), r#""app"."Job_Leases2""#);
        assert_eq!(t.sequence_literal(), r#"'"app"."Job_Leases2_token_seq"'"#);
        assert_eq!(t.to_string(), "app.Job_Leases2");
        assert_eq!(t.unqualified_if_defaulted(), None);
        let t = TableName::parse("user").unwrap();
        assert_eq!(t.quoted(), r#""public"."user""#);
        assert_eq!(
            TableName::default().quoted(),
            r#""public"."pgwarden_leases""#
        );
    }

    #[test]
    fn refuses_quotes_spaces_dots_and_nul() {
        for bad in [
            "",
            ".",
            "app.",
            ".leases",
            "a.b.c",
            "lea ses",
            "leases\"; DROP TABLE x; --",
            "lea'ses",
            "lea\0ses",
            "1leases",
            "app.1leases",
            "lé",
            "leases;",
            "\"leases\"",
        ] {
            let e = TableName::parse(bad).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Invalid(InvalidInput::Name {
                        what: "lease table name",
                        ..
                    })
                ),
                "{bad:?}: {e}"
            );
        }
        assert!(TableName::parse(&"t".repeat(MAX_TABLE_LEN)).is_ok());
        assert!(TableName::parse(&"t".repeat(MAX_TABLE_LEN + 1)).is_err());
        assert!(TableName::parse(&format!("{}.t", "s".repeat(MAX_SCHEMA_LEN))).is_ok());
        assert!(TableName::parse(&format!("{}.t", "s".repeat(MAX_SCHEMA_LEN + 1))).is_err());
    }

    #[test]
    fn quoting_doubles_quotes() {
        assert_eq!(quote_ident(r#"a"b"#), r#""a""b""#);
        assert_eq!(quote_literal("a'b"), "'a''b'");
    }

    #[test]
    fn ddl_is_the_shipped_file_with_the_names_replaced() {
        assert_eq!(TableName::default().ddl(), DDL_TEMPLATE);
        let ddl = TableName::parse("app.leases").unwrap().ddl();
        assert!(ddl.contains(
            r#"CREATE SEQUENCE IF NOT EXISTS "app"."leases_token_seq" AS bigint CACHE 1;"#
        ));
        assert!(ddl.contains(r#"CREATE TABLE IF NOT EXISTS "app"."leases" ("#));
        assert!(ddl
            .contains(r#"ALTER SEQUENCE "app"."leases_token_seq" OWNED BY "app"."leases".token;"#));
        assert!(!ddl.contains("\"pgwarden_leases"));
    }
}
