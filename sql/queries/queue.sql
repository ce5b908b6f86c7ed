-- The inbox's queue protocol (migration 7): a key held for a queued job,
-- taken by each of the job's attempts with a token of its own, completed
-- or dead-lettered. Used by package inbox; see docs/inbox.md.
-- Operators are OPERATOR(pg_catalog.x) and the millisecond arguments
-- double precision (an exact match), as in protocol.sql: an operator
-- bigint * interval in a schema another role may write would otherwise run
-- as the inbox's role (inbox.TestQueueStatementsIgnoreOtherRolesObjects).

-- name: QueueHold :one
-- dead_job_id: the job of the dead hold this one replaces, 0 for none.
SELECT coalesce(idem.queue_hold(sqlc.arg(source)::text, sqlc.arg(key)::text, sqlc.arg(token)::bigint,
                                sqlc.arg(job_id)::bigint), 0)::bigint AS dead_job_id;

-- name: QueueTake :one
SELECT t.outcome::text                  AS outcome,
       coalesce(t.token, 0)::bigint     AS token,
       coalesce(t.attempt, 0)::integer  AS attempt,
       t.lease_expires_at::timestamptz  AS lease_expires_at,
       coalesce(t.error, '')::text      AS error
  FROM idem.queue_take(sqlc.arg(source)::text, sqlc.arg(key)::text, sqlc.arg(job_token)::bigint,
                       sqlc.arg(job_id)::bigint, sqlc.arg(lease_ms)::bigint::double precision OPERATOR(pg_catalog.*) interval '1 millisecond') AS t;

-- name: QueueComplete :one
SELECT idem.queue_complete(sqlc.arg(source)::text, sqlc.arg(key)::text, sqlc.arg(job_token)::bigint,
                           sqlc.arg(token)::bigint, sqlc.narg(result)::text::jsonb,
                           sqlc.narg(reason)::text)::text AS outcome;

-- name: QueueFail :one
SELECT idem.queue_fail(sqlc.arg(source)::text, sqlc.arg(key)::text, sqlc.arg(job_token)::bigint,
                       sqlc.arg(token)::bigint, sqlc.arg(error)::text, sqlc.arg(dead)::boolean)::text AS outcome;

-- name: QueueRepair :one
SELECT idem.queue_repair(sqlc.arg(source)::text, sqlc.arg(key)::text, sqlc.arg(job_token)::bigint,
                         sqlc.arg(old_job_id)::bigint, sqlc.narg(new_job_id)::bigint,
                         sqlc.narg(reason)::text)::text AS outcome;

-- name: QueueDeadOldest :many
-- One page of the dead letters a filter selects (all sources when source is
-- empty; one key when key is given; dead-lettered in [since, until); whose
-- error contains error_contains, case-insensitive, when it is not empty),
-- oldest first, after the cursor
-- (after_at, after_source, after_key) when paged: keyset pagination, so
-- that a replay that leaves some dead letters as they are still reaches
-- every one behind them.
SELECT h.source, h.key, h.token, coalesce(h.job_id, 0)::bigint AS job_id, h.held_at,
       h.dead_at::timestamptz AS dead_at, coalesce(h.error, '')::text AS error
  FROM idem.holds h
 WHERE h.state = 'dead'
   AND (sqlc.arg(source)::text = '' OR h.source = sqlc.arg(source)::text)
   AND (sqlc.arg(key)::text = '' OR h.key = sqlc.arg(key)::text)
   AND h.dead_at >= sqlc.arg(since)::timestamptz
   AND h.dead_at < sqlc.arg(until)::timestamptz
   AND (sqlc.arg(error_contains)::text = '' OR strpos(lower(h.error), lower(sqlc.arg(error_contains)::text)) > 0)
   AND (NOT sqlc.arg(paged)::boolean
        OR (h.dead_at, h.source, h.key) > (sqlc.arg(after_at)::timestamptz, sqlc.arg(after_source)::text, sqlc.arg(after_key)::text))
 ORDER BY h.dead_at, h.source, h.key
 LIMIT sqlc.arg(max_rows)::integer;

-- name: QueueDeadNewest :many
-- QueueDeadOldest, newest first: the page before the cursor.
SELECT h.source, h.key, h.token, coalesce(h.job_id, 0)::bigint AS job_id, h.held_at,
       h.dead_at::timestamptz AS dead_at, coalesce(h.error, '')::text AS error
  FROM idem.holds h
 WHERE h.state = 'dead'
   AND (sqlc.arg(source)::text = '' OR h.source = sqlc.arg(source)::text)
   AND (sqlc.arg(key)::text = '' OR h.key = sqlc.arg(key)::text)
   AND h.dead_at >= sqlc.arg(since)::timestamptz
   AND h.dead_at < sqlc.arg(until)::timestamptz
   AND (sqlc.arg(error_contains)::text = '' OR strpos(lower(h.error), lower(sqlc.arg(error_contains)::text)) > 0)
   AND (NOT sqlc.arg(paged)::boolean
        OR (h.dead_at, h.source, h.key) < (sqlc.arg(after_at)::timestamptz, sqlc.arg(after_source)::text, sqlc.arg(after_key)::text))
 ORDER BY h.dead_at DESC, h.source DESC, h.key DESC
 LIMIT sqlc.arg(max_rows)::integer;

-- name: QueueDeadCount :one
-- How many dead letters QueueDead's filter matches, without a limit.
SELECT count(*)::bigint AS dead
  FROM idem.holds h
 WHERE h.state = 'dead'
   AND (sqlc.arg(source)::text = '' OR h.source = sqlc.arg(source)::text)
   AND (sqlc.arg(key)::text = '' OR h.key = sqlc.arg(key)::text)
   AND h.dead_at >= sqlc.arg(since)::timestamptz
   AND h.dead_at < sqlc.arg(until)::timestamptz
   AND (sqlc.arg(error_contains)::text = '' OR strpos(lower(h.error), lower(sqlc.arg(error_contains)::text)) > 0);

-- name: QueueQueued :many
-- Queued holds, oldest first, held before `before`: the candidates of a
-- repair (their jobs are looked up on the queue's side).
SELECT h.source, h.key, h.token, coalesce(h.job_id, 0)::bigint AS job_id, h.held_at
  FROM idem.holds h
 WHERE h.state = 'queued' AND h.held_at < sqlc.arg(before)::timestamptz
 ORDER BY h.held_at
 LIMIT sqlc.arg(max_rows)::integer;

-- name: QueueCounts :many
-- Per source: events accepted and processed (counters), dead-lettered and
-- still queued (holds).
WITH c AS (
    SELECT q.source, sum(q.accepted)::bigint AS accepted, sum(q.processed)::bigint AS processed, min(q.since) AS since
      FROM idem.queue_counts q GROUP BY q.source),
h AS (
    SELECT x.source, count(*) FILTER (WHERE x.state = 'queued')::bigint AS queued,
           count(*) FILTER (WHERE x.state = 'dead')::bigint AS dead
      FROM idem.holds x GROUP BY x.source)
SELECT coalesce(c.source, h.source)::text AS source,
       coalesce(c.accepted, 0)::bigint    AS accepted,
       coalesce(c.processed, 0)::bigint   AS processed,
       coalesce(h.dead, 0)::bigint        AS dead,
       coalesce(h.queued, 0)::bigint      AS queued
  FROM c FULL JOIN h ON h.source = c.source
 ORDER BY 1;

-- name: QueueForget :one
SELECT idem.queue_forget(sqlc.arg(source)::text, sqlc.arg(key)::text, sqlc.arg(job_token)::bigint)::boolean AS forgotten;

-- name: QueueReplay :one
SELECT r.outcome::text                 AS outcome,
       coalesce(r.token, 0)::bigint    AS token,
       r.first_seen::timestamptz       AS first_seen,
       r.expires_at::timestamptz       AS expires_at,
       coalesce(r.error, '')::text     AS error
  FROM idem.queue_replay(sqlc.arg(source)::text, sqlc.arg(key)::text, sqlc.arg(job_token)::bigint,
                         sqlc.narg(ttl_ms)::bigint::double precision OPERATOR(pg_catalog.*) interval '1 millisecond') AS r;

-- name: QueueKeepPayload :one
-- Keeps a dead letter's payload (its job's encoded args) on its hold
-- (migration 17): false when the hold is not that job's dead letter.
SELECT idem.queue_keep_payload(sqlc.arg(source)::text, sqlc.arg(key)::text, sqlc.arg(job_token)::bigint,
                               sqlc.arg(payload)::jsonb)::boolean AS kept;

-- name: QueueDeadKept :many
-- What a dead letter's listing shows of the payload kept on its hold,
-- without reading the payload: no row when the hold is not that job's dead
-- letter or keeps none.
SELECT coalesce(h.payload->>'event_type', '')::text AS event_type,
       coalesce(h.payload->>'accepted_at', '')::text AS accepted_at
  FROM idem.holds h
 WHERE h.source = sqlc.arg(source)::text AND h.key = sqlc.arg(key)::text
   AND h.token = sqlc.arg(job_token)::bigint AND h.state = 'dead' AND h.payload IS NOT NULL;

-- name: QueueDeadPayload :many
-- The payload kept on a dead letter's hold: no row when the hold is not
-- that job's dead letter, a NULL payload when none was kept.
SELECT h.payload::jsonb AS payload
  FROM idem.holds h
 WHERE h.source = sqlc.arg(source)::text AND h.key = sqlc.arg(key)::text
   AND h.token = sqlc.arg(job_token)::bigint AND h.state = 'dead';
