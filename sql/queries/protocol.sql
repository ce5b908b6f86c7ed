-- The claim protocol. Every query calls one idem.* function; the columns are
-- cast so that sqlc generates precise types instead of interface{}.
-- Durations travel as milliseconds so both drivers agree on their type.
-- They run as the application's role with the session's search_path, on
-- which another role may own a schema (public, writable by every role
-- before PostgreSQL 15): every function is pg_catalog's by name and every
-- operator OPERATOR(pg_catalog.x), so no look-alike there (one that
-- matches better than pg_catalog's through a cast, or polymorphism) runs
-- with the application's rights. Type names (text, jsonb) are pg_catalog's
-- as long as the search_path does not list another schema before
-- pg_catalog (TestClientStatementsIgnoreOtherRolesObjects).
-- Timestamps travel as microseconds since the Unix epoch (0: none): a
-- timestamptz in text (pgx's exec and simple-protocol modes, which
-- PgBouncer setups use, and lib/pq) is written in the session's DateStyle,
-- which any client of a pooled connection can set ('SQL, DMY', 'German')
-- and which neither driver reads back.

-- name: Claim :one
-- lease_remaining_ms: the lease granted (acquired) or left (in_progress), by
-- the database's clock; 0 when unknown.
SELECT c.outcome::text             AS outcome,
       coalesce(c.token, 0)::bigint AS token,
       coalesce(c.attempt, 0)::integer AS attempt,
       coalesce(pg_catalog.round(pg_catalog.date_part('epoch', c.lease_expires_at) OPERATOR(pg_catalog.*) 1000000::double precision), 0)::bigint AS lease_expires_at_us,
       c.result::jsonb             AS result,
       coalesce(c.error, '')::text AS error,
       coalesce(pg_catalog.round(pg_catalog.date_part('epoch', c.first_seen) OPERATOR(pg_catalog.*) 1000000::double precision), 0)::bigint AS first_seen_us,
       coalesce(pg_catalog.round(pg_catalog.date_part('epoch', c.expires_at) OPERATOR(pg_catalog.*) 1000000::double precision), 0)::bigint AS expires_at_us,
       coalesce(pg_catalog.floor(pg_catalog.date_part('epoch', c.lease_remaining) OPERATOR(pg_catalog.*) 1000::double precision), 0)::bigint AS lease_remaining_ms
  FROM idem.claim(
         sqlc.arg(source)::text,
         sqlc.arg(key)::text,
         sqlc.narg(fingerprint)::text,
         sqlc.narg(ttl_ms)::bigint::double precision OPERATOR(pg_catalog.*) interval '1 millisecond',
         sqlc.narg(lease_ms)::bigint::double precision OPERATOR(pg_catalog.*) interval '1 millisecond',
         sqlc.narg(event_type)::text,
         sqlc.narg(lock_wait_ms)::bigint::double precision OPERATOR(pg_catalog.*) interval '1 millisecond') AS c;

-- name: Complete :one
SELECT idem.complete(sqlc.arg(source)::text, sqlc.arg(key)::text, sqlc.arg(token)::bigint,
                     sqlc.narg(result)::text::jsonb)::text AS outcome;

-- name: CompleteStored :one
-- Complete, returning the result as stored (jsonb's text form: normalized
-- white space and key order): what every later claim of the key returns, so
-- Do gives its first caller the same bytes as its duplicates (migration 11:
-- one function in FROM, which Citus delegates to the key's node).
SELECT c.outcome::text AS outcome,
       c.stored::text  AS stored
  FROM idem.complete_stored(sqlc.arg(source)::text, sqlc.arg(key)::text, sqlc.arg(token)::bigint,
                            sqlc.arg(result)::text::jsonb) AS c;

-- name: CompleteUnstored :one
SELECT idem.complete_unstored(sqlc.arg(source)::text, sqlc.arg(key)::text, sqlc.arg(token)::bigint,
                              sqlc.arg(reason)::text)::text AS outcome;

-- name: Fail :one
SELECT idem.fail(sqlc.arg(source)::text, sqlc.arg(key)::text, sqlc.arg(token)::bigint,
                 sqlc.narg(error)::text, sqlc.arg(retryable)::boolean)::text AS outcome;

-- name: FailMomentary :one
-- A failure about the moment, not the work (migration 20): released, and
-- not counted as an attempt. An earlier schema takes NULL as retryable.
SELECT idem.fail(sqlc.arg(source)::text, sqlc.arg(key)::text, sqlc.arg(token)::bigint,
                 sqlc.narg(error)::text, NULL::boolean)::text AS outcome;

-- name: Extend :one
SELECT e.outcome::text                AS outcome,
       coalesce(pg_catalog.round(pg_catalog.date_part('epoch', e.lease_expires_at) OPERATOR(pg_catalog.*) 1000000::double precision), 0)::bigint AS lease_expires_at_us
  FROM idem.extend(sqlc.arg(source)::text, sqlc.arg(key)::text, sqlc.arg(token)::bigint,
                   sqlc.narg(lease_ms)::bigint::double precision OPERATOR(pg_catalog.*) interval '1 millisecond') AS e;

-- name: WaitBegin :one
-- A duplicate that waits for the key's original registers, so that the
-- original's completion notifies channel idem_done (migration 8).
SELECT idem.wait_begin(sqlc.arg(source)::text, sqlc.arg(key)::text,
                       sqlc.arg(wait_ms)::bigint::double precision OPERATOR(pg_catalog.*) interval '1 millisecond')::bigint AS id;

-- name: WaitEnd :exec
SELECT idem.wait_end(sqlc.arg(id)::bigint);

-- name: Peek :one
-- The key's status and remaining lease, read-only (no duplicate counted).
-- status '' when there is no row.
SELECT coalesce(p.status, '')::text               AS status,
       coalesce(p.lease_remaining_ms, 0)::bigint AS lease_remaining_ms
  FROM idem.peek(sqlc.arg(source)::text, sqlc.arg(key)::text) AS p;

-- name: Cacheable :one
-- Whether a completed answer read in the current transaction was committed
-- by another one and is read with a snapshot per statement: this
-- transaction has written nothing (no transaction id yet; PostgreSQL 13+)
-- and runs at READ COMMITTED. Config.Cache inside the caller's transaction.
SELECT (pg_catalog.pg_current_xact_id_if_assigned() IS NULL
        AND pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.=) 'read committed')::boolean AS cacheable;

-- name: CitusInstalled :one
-- Whether Citus is installed in this database and idem can be asked
-- whether it is distributed (migration 11): asked of the catalog, which
-- every role may read, so it answers at every schema version and for every
-- role. Where it is false, idem is not distributed.
SELECT (pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL
        AND pg_catalog.to_regprocedure('idem.distributed()') IS NOT NULL)::boolean AS installed;

-- name: Distributed :one
-- Whether idem.processed_events is a Citus distributed table; ask only
-- where CitusInstalled is true (the application's and maintainer's roles
-- may since migration 12).
SELECT idem.distributed()::boolean AS distributed;

-- name: MissingFunctions :one
-- Which of the functions listed (regprocedure signatures, separated by ';')
-- do not exist; empty when the schema has every function the client calls.
-- Asked of the catalog, which every role may read, before the first claim.
SELECT coalesce(pg_catalog.string_agg(f.sig, '; '), '')::text AS missing
  FROM pg_catalog.unnest(pg_catalog.string_to_array(sqlc.arg(functions)::text, ';')) AS f(sig)
 WHERE pg_catalog.to_regprocedure(f.sig) IS NULL;

-- name: ClaimBatch :many
-- idem.claim_batch (migration 18): one row per key, ord its position in
-- keys. The arrays travel as PostgreSQL array literals in text, which every
-- driver passes as it is (database/sql has no array type).
SELECT c.ord::integer              AS ord,
       c.outcome::text             AS outcome,
       coalesce(c.token, 0)::bigint AS token,
       coalesce(c.attempt, 0)::integer AS attempt,
       coalesce(pg_catalog.round(pg_catalog.date_part('epoch', c.lease_expires_at) OPERATOR(pg_catalog.*) 1000000::double precision), 0)::bigint AS lease_expires_at_us,
       c.result::jsonb             AS result,
       coalesce(c.error, '')::text AS error,
       coalesce(pg_catalog.round(pg_catalog.date_part('epoch', c.first_seen) OPERATOR(pg_catalog.*) 1000000::double precision), 0)::bigint AS first_seen_us,
       coalesce(pg_catalog.round(pg_catalog.date_part('epoch', c.expires_at) OPERATOR(pg_catalog.*) 1000000::double precision), 0)::bigint AS expires_at_us,
       coalesce(pg_catalog.floor(pg_catalog.date_part('epoch', c.lease_remaining) OPERATOR(pg_catalog.*) 1000::double precision), 0)::bigint AS lease_remaining_ms
  FROM idem.claim_batch(
         sqlc.arg(source)::text,
         sqlc.arg(keys)::text::text[],
         sqlc.narg(fingerprints)::text::text[],
         sqlc.narg(ttl_ms)::bigint::double precision OPERATOR(pg_catalog.*) interval '1 millisecond',
         sqlc.narg(lease_ms)::bigint::double precision OPERATOR(pg_catalog.*) interval '1 millisecond',
         sqlc.narg(event_types)::text::text[],
         sqlc.narg(lock_wait_ms)::bigint::double precision OPERATOR(pg_catalog.*) interval '1 millisecond') AS c;

-- name: CompleteBatch :many
-- idem.complete_batch: per item its outcome and the result as stored
-- (jsonb's text form), ord its position.
SELECT c.ord::integer AS ord,
       c.outcome::text AS outcome,
       coalesce(c.stored, '')::text AS stored
  FROM idem.complete_batch(sqlc.arg(source)::text, sqlc.arg(keys)::text::text[],
                           sqlc.arg(tokens)::text::bigint[], sqlc.arg(results)::text::jsonb[]) AS c;

-- name: FailBatch :many
SELECT f.ord::integer AS ord,
       f.outcome::text AS outcome
  FROM idem.fail_batch(sqlc.arg(source)::text, sqlc.arg(keys)::text::text[],
                       sqlc.arg(tokens)::text::bigint[], sqlc.arg(errors)::text::text[],
                       sqlc.arg(retryable)::text::boolean[]) AS f;
