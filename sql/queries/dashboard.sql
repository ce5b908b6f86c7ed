-- The operator's page (package dashboard, migration 10). Every query reads
-- an index, a small table or the catalog: never a scan of processed_events.

-- name: DashClock :one
SELECT idem.clock()::timestamptz AS now;

-- name: DashActivity :many
-- Acquisitions and duplicates per source in buckets of bucket_seconds since
-- `since` (idem.activity's primary key starts with the minute).
SELECT a.source::text AS source,
       pg_catalog.to_timestamp(floor(pg_catalog.date_part('epoch', a.minute) / sqlc.arg(bucket_seconds)::integer::double precision)
                               * sqlc.arg(bucket_seconds)::integer::double precision)::timestamptz AS bucket,
       sum(a.acquired)::bigint   AS acquired,
       sum(a.duplicates)::bigint AS duplicates
  FROM idem.activity a
 WHERE a.minute >= sqlc.arg(since)::timestamptz
 GROUP BY 1, 2
 ORDER BY 1, 2;

-- name: DashPolicies :many
SELECT p.source::text                                 AS source,
       (pg_catalog.date_part('epoch', p.ttl) * 1000::double precision)::bigint      AS ttl_ms,
       (pg_catalog.date_part('epoch', p.lease) * 1000::double precision)::bigint    AS lease_ms,
       coalesce(p.max_attempts, 0)::integer            AS max_attempts,
       p.duplicate_sampling::integer                   AS duplicate_sampling
  FROM idem.policies p
 ORDER BY p.source;

-- name: DashSnapshots :many
SELECT s.source::text AS source, s.taken_at, (pg_catalog.date_part('epoch', s.took) * 1000::double precision)::bigint AS took_ms,
       s.keys, s.processing, s.completed, s.unstored, s.released, s.failed, s.retried, s.stuck, s.expired,
       s.oldest, s.newest
  FROM idem.source_snapshots s
 ORDER BY s.source;

-- name: DashHolds :many
-- The inbox's holds per source: queued and dead-lettered.
SELECT h.source::text AS source,
       (count(*) FILTER (WHERE h.state = 'queued'))::bigint AS queued,
       (count(*) FILTER (WHERE h.state = 'dead'))::bigint   AS dead
  FROM idem.holds h
 GROUP BY h.source
 ORDER BY h.source;

-- name: DashKey :many
-- One key in every month (the primary key); the result only when asked.
SELECT e.source, e.key, e.first_seen_month, coalesce(e.event_type, '')::text AS event_type, e.status, e.attempts,
       e.lease_expires_at, coalesce(e.fingerprint, '')::text AS fingerprint,
       coalesce(octet_length(e.result::text), 0)::bigint AS result_bytes,
       coalesce(CASE WHEN sqlc.arg(with_result)::boolean THEN e.result::text END, '')::text AS result,
       coalesce(e.last_error, '')::text AS last_error, e.retryable, e.first_seen, e.updated_at, e.completed_at,
       e.expires_at, e.duplicates
  FROM idem.processed_events e
 WHERE e.source = sqlc.arg(source)::text AND e.key = sqlc.arg(key)::text
 ORDER BY e.first_seen_month DESC;

-- name: DashKeys :many
-- Keys by status, newest expiry first, after the cursor (before,
-- before_source, before_key) in the order (expires_at, source, key)
-- descending, so that keys sharing an expires_at are neither skipped nor
-- repeated from one page to the next (with before_source and before_key
-- empty, the rows with expires_at < before): among the scan_limit rows
-- that come first (read on the expires_at index, in order; each run of
-- one expires_at sorted on the way), those of the source and status asked
-- (stuck: processing past its lease).
SELECT e.source, e.key, e.first_seen_month, coalesce(e.event_type, '')::text AS event_type, e.status, e.attempts,
       e.lease_expires_at, coalesce(e.fingerprint, '')::text AS fingerprint,
       coalesce(octet_length(e.result::text), 0)::bigint AS result_bytes,
       coalesce(e.last_error, '')::text AS last_error, e.first_seen, e.expires_at
  FROM (SELECT x.* FROM idem.processed_events x
         WHERE (x.expires_at, x.source, x.key)
             < (sqlc.arg(before)::timestamptz, sqlc.arg(before_source)::text, sqlc.arg(before_key)::text)
         ORDER BY x.expires_at DESC, x.source DESC, x.key DESC
         LIMIT sqlc.arg(scan_limit)::integer) e
 WHERE (sqlc.arg(source)::text = '' OR e.source = sqlc.arg(source)::text)
   AND (sqlc.arg(status)::text = '' OR e.status = sqlc.arg(status)::text
        OR (sqlc.arg(status)::text = 'stuck' AND e.status = 'processing' AND e.lease_expires_at < idem.clock()))
 ORDER BY e.expires_at DESC, e.source DESC, e.key DESC
 LIMIT sqlc.arg(max_rows)::integer;

-- name: DashPartitions :many
-- Months, the planner's row estimates (-1: not analyzed yet) and sizes,
-- from the catalog.
SELECT m.partition::text AS name, m.is_default::boolean AS is_default, m.month_from::date AS month_from,
       m.month_to::date AS month_to, c.reltuples::bigint AS est_rows,
       pg_catalog.pg_total_relation_size(m.partition)::bigint AS total_bytes
  FROM idem.partition_months() m
  JOIN pg_catalog.pg_class c ON c.oid = m.partition::oid
 ORDER BY m.month_from NULLS LAST;

-- name: DashDefaultRows :one
-- Rows in the default partition, counted up to cap + 1.
SELECT count(*)::bigint AS rows
  FROM (SELECT 1 FROM idem.processed_events_default LIMIT sqlc.arg(cap)::integer + 1) d;

-- name: DashRuns :many
-- The last runs of each maintenance job, newest first.
SELECT r.id, r.job, r.started_at, r.finished_at, r.outcome, r.figures::text AS figures,
       coalesce(r.error, '')::text AS error, r.run_by
  FROM unnest(ARRAY['prune', 'rotate', 'snapshot']::text[]) j(job),
       LATERAL (SELECT x.* FROM idem.runs x WHERE x.job = j.job ORDER BY x.finished_at DESC
                LIMIT sqlc.arg(per_job)::integer) r
 ORDER BY r.job, r.finished_at DESC;

-- name: DashLocks :many
SELECT l.name, l.holder, l.acquired_at, l.expires_at
  FROM idem.maintenance_locks l
 ORDER BY l.name;

-- name: DashKeyHold :many
-- The inbox's hold of one key (its primary key): queued or dead, since when.
SELECT h.state, h.held_at, h.dead_at, coalesce(h.error, '')::text AS error, coalesce(h.job_id, 0)::bigint AS job_id
  FROM idem.holds h
 WHERE h.source = sqlc.arg(source)::text AND h.key = sqlc.arg(key)::text;

-- name: DashKeyEffects :many
-- The effects recorded for one event (Client.Effect): keys of source
-- "<source>/effects" named "<name>/<key>", read on the primary key's
-- source prefix (a hashed effect key, of a long event key, is not found).
SELECT e.key, e.status, e.attempts, e.first_seen, e.completed_at, coalesce(e.last_error, '')::text AS last_error
  FROM idem.processed_events e
 WHERE e.source = sqlc.arg(source)::text || '/effects'
   AND pg_catalog.right(e.key, pg_catalog.length(sqlc.arg(key)::text) + 1) = '/' || sqlc.arg(key)::text
 ORDER BY e.first_seen
 LIMIT 50;
