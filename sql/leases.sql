-- pgwarden table leases: the DDL that `pgwarden::Leases::install()` runs, for
-- applications that run their own migrations.
--
-- The default names are shown: `public.pgwarden_leases` and its token
-- sequence `public.pgwarden_leases_token_seq`, always schema-qualified: a
-- table name given without a schema is in `public`, never looked up through
-- the session's search_path, so instances whose search paths differ share
-- one table. With another table name
-- (`Leases::builder(&pool).table("app.leases")`), replace both quoted names:
-- the sequence is always the table's name + `_token_seq`, in the table's
-- schema. `install()` runs these statements inside a transaction
-- holding `pg_advisory_xact_lock(1885828964, 594100531)` (pgwarden's key
-- `Namespace::PGWARDEN.named("leases.install")`), so that instances starting
-- together do not race.
--
-- A logged table on purpose: unlike advisory locks, leases survive a primary
-- failover. Every time comes from the database clock. A released row is
-- kept, marked released (holder ''), until the purge deletes it (once no
-- acquisition that drew a smaller token can still be in flight); the next
-- term of a name takes its row over and draws its token with the row
-- locked. Either way tokens grow with every term of a name.
--
-- pgwarden checks this shape at install and first use: the columns and
-- their types, PRIMARY KEY (name), and the bigint sequence owned by the
-- token column.

-- Fencing tokens: one value per take-over, increasing across the cluster.
-- CACHE 1 keeps values increasing in the order sessions take them.
CREATE SEQUENCE IF NOT EXISTS "public"."pgwarden_leases_token_seq" AS bigint CACHE 1;

CREATE TABLE IF NOT EXISTS "public"."pgwarden_leases" (
    -- The lease's name: 1 to 128 bytes, chosen by the application (pgwarden
    -- checks it before any statement; a CHECK here would cost every insert
    -- a parse of its expression). Compared byte by byte (COLLATE "C"): the
    -- same equality as any deterministic collation, and every key
    -- comparison of the primary key's index (several per statement, more
    -- as the table grows) a memcmp instead of the locale's strcoll. A table
    -- made without it works the same, a little slower.
    name        text        COLLATE "C" PRIMARY KEY,
    -- Who holds it: host:pid:64 random bits, new on every acquisition;
    -- '' once released while the row is kept.
    holder      text        NOT NULL,
    -- The fencing token of the current term.
    token       bigint      NOT NULL,
    -- When the current term began.
    taken_at    timestamptz NOT NULL DEFAULT now(),
    -- When the lease expires unless renewed.
    expires_at  timestamptz NOT NULL,
    -- Nobody may take the lease before this, even once released: the
    -- at-least-hold time, or the start of a scheduled job's next period.
    held_until  timestamptz NOT NULL DEFAULT '-infinity',
    -- The holder of the previous term, when this term took the row over.
    prev_holder text,
    -- When the current term's expiry was last set (its acquisition or its
    -- last renewal, in the same statement): the term's TTL is
    -- expires_at - renewed_at while it is held and renewed_at >= taken_at.
    -- NULL, or older than taken_at, in a row written by a pgwarden that did
    -- not know this column: readers then guess the TTL.
    renewed_at  timestamptz
);

-- A table made by an earlier pgwarden has no renewed_at: `install()` adds it
-- when its role may (the table's owner); this line does the same for
-- applications that run their own migrations. Without it leases work, and
-- readers (`pgwarden check`) guess each term's TTL.
ALTER TABLE "public"."pgwarden_leases" ADD COLUMN IF NOT EXISTS renewed_at timestamptz;

ALTER SEQUENCE "public"."pgwarden_leases_token_seq" OWNED BY "public"."pgwarden_leases".token;
