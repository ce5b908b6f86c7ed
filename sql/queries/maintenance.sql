-- Maintenance: locks, prune, partitions. Used by idemctl (internal/prune,
-- internal/partition, internal/cli).

-- name: TryLock :one
SELECT l.acquired::boolean             AS acquired,
       l.lock_holder::text             AS holder,
       l.lock_expires_at::timestamptz  AS expires_at
  FROM idem.try_lock(sqlc.arg(name)::text, sqlc.arg(holder)::text,
                     sqlc.narg(ttl_ms)::bigint::double precision * interval '1 millisecond') AS l;

-- name: ReleaseLock :one
SELECT idem.release_lock(sqlc.arg(name)::text, sqlc.arg(holder)::text)::boolean AS released;

-- name: PruneBatch :one
SELECT idem.prune_batch(sqlc.arg(holder)::text, sqlc.arg(batch_size)::integer)::bigint AS deleted;

-- name: CompactDuplicateCounts :one
SELECT idem.compact_duplicate_counts()::bigint AS folded;

-- name: PrunableRows :one
SELECT idem.prunable_rows()::bigint AS rows;

-- name: ListPartitions :many
SELECT p.partition::text                 AS name,
       p.is_default::boolean             AS is_default,
       p.month_from::date                AS month_from,
       p.month_to::date                  AS month_to,
       p.est_rows::bigint                AS est_rows,
       p.total_bytes::bigint             AS total_bytes
  FROM idem.partitions() AS p;

-- name: PartitionMonths :many
-- The partitions and their months, from the catalog only (no row counts).
SELECT p.partition::text      AS name,
       p.is_default::boolean  AS is_default,
       p.month_from::date     AS month_from,
       p.month_to::date       AS month_to
  FROM idem.partition_months() AS p;

-- name: MonthsToCreate :many
SELECT m::date AS month FROM idem.months_to_create(sqlc.arg(premake)::integer) AS m;

-- name: CreatePartition :one
SELECT idem.create_partition(sqlc.arg(month)::date)::text AS name;

-- name: MakeMonth :one
-- Makes a month's partition (migration 14): 'exists', 'created' or
-- 'kept: ...' (its rows are in the default partition).
SELECT idem.make_month(sqlc.arg(month)::date)::text AS result;

-- name: CheckRotateArgs :one
-- The bounds of CALL idem.rotate()'s arguments (22023 when out of range).
SELECT idem.check_rotate_args(sqlc.arg(premake)::integer,
                              sqlc.arg(lock_wait_ms)::bigint::double precision * interval '1 millisecond')::text AS lock_timeout;

-- name: CheckPruneArgs :exec
-- The bounds of CALL idem.prune()'s arguments (22023 when out of range).
SELECT idem.check_prune_args(sqlc.arg(batch_size)::integer, sqlc.arg(max_batches)::integer);

-- name: Audit :many
-- Who may do what, as idemctl check reports it (migration 14).
SELECT a.problem::text AS problem, a.fix::text AS fix FROM idem.audit() AS a;

-- name: RetirePartition :one
SELECT idem.retire_partition(sqlc.arg(name)::text::regclass, sqlc.arg(keep_detached)::boolean)::text AS result;

-- name: PartitionsToRetire :many
SELECT p::text AS name FROM idem.partitions_to_retire() AS p;

-- name: DropDetached :one
SELECT idem.drop_detached(sqlc.arg(name)::text::regclass)::text AS result;

-- name: DefaultPartitionRows :one
SELECT count(*)::bigint AS rows FROM idem.processed_events_default;

-- name: DefaultPartitionRowsUpTo :one
-- The default partition's rows, counted up to cap + 1: a scrape reads at
-- most that many, however many there are.
SELECT count(*)::bigint AS rows FROM (SELECT 1 FROM idem.processed_events_default LIMIT sqlc.arg(cap)::bigint + 1) d;

-- name: MonthInDefault :one
-- Whether rows of the month are in the default partition (it gets no
-- partition while they are).
SELECT EXISTS (SELECT 1 FROM idem.processed_events_default d
                WHERE d.first_seen_month >= sqlc.arg(month)::date
                  AND d.first_seen_month < (sqlc.arg(month)::date + interval '1 month')::date)::boolean AS in_default;

-- name: CurrentMonth :one
SELECT idem.utc_month(idem.clock())::date AS month;

-- name: SourceStats :many
-- Per source: keys by status (idem.source_stats(), a full scan: an
-- operator's command, not something to poll every second), duplicates
-- absorbed.
SELECT s.source::text                                                        AS source,
       s.keys::bigint                                                        AS keys,
       s.processing::bigint                                                  AS processing,
       s.completed::bigint                                                   AS completed,
       s.unstored::bigint                                                    AS unstored,
       s.released::bigint                                                    AS released,
       s.failed::bigint                                                      AS failed,
       -- Duplicates per source are counted in idem.duplicate_counts (sampled,
       -- unlogged); per-key counts in the rows only when a policy asks.
       coalesce((SELECT sum(d.duplicates) FROM idem.duplicate_counts d
                  WHERE d.source = s.source), 0)::bigint                     AS duplicates,
       -- 1 in duplicate_sampling duplicates is counted, as that many: with
       -- sampling above 1 the count is an estimate (0: not counted).
       coalesce((SELECT p.duplicate_sampling FROM idem.policies p
                  WHERE p.source IN (s.source, '*')
                  ORDER BY p.source = '*' LIMIT 1), 0)::integer              AS duplicate_sampling,
       s.retried::bigint                                                     AS retried,
       s.stuck::bigint                                                       AS stuck,
       s.expired::bigint                                                     AS expired,
       s.oldest::timestamptz                                                 AS oldest,
       s.newest::timestamptz                                                 AS newest
  FROM idem.source_stats() s
 ORDER BY s.source;

-- name: SnapshotStats :one
-- Stores idem.source_stats() in idem.source_snapshots (migration 10).
SELECT idem.snapshot_stats()::integer AS sources;

-- name: RecordRun :one
-- Records a maintenance run in idem.runs (migration 10).
SELECT idem.record_run(sqlc.arg(job)::text, sqlc.arg(started_at)::timestamptz, sqlc.arg(outcome)::text,
                       sqlc.arg(figures)::text::jsonb, sqlc.narg(error)::text, sqlc.arg(run_by)::text)::bigint AS id;

-- name: StuckLeases :one
-- Keys still processing whose lease ended more than grace ago, and whose
-- retention has not ended: a released key (idemctl release) or an expired
-- one is answered as new by its next delivery, so it is stuck no longer.
SELECT count(*)::bigint AS stuck
  FROM idem.processed_events e
 WHERE e.status = 'processing'
   AND e.lease_expires_at < idem.clock() - sqlc.arg(grace_ms)::bigint::double precision * interval '1 millisecond'
   AND e.expires_at > idem.clock();

-- name: LapsedLeases :one
-- Keys still processing whose lease ended less than grace ago (not yet
-- stuck: a redelivery may still take them), retention not ended.
SELECT count(*)::bigint AS lapsed
  FROM idem.processed_events e
 WHERE e.status = 'processing'
   AND e.lease_expires_at < idem.clock()
   AND e.lease_expires_at >= idem.clock() - sqlc.arg(grace_ms)::bigint::double precision * interval '1 millisecond'
   AND e.expires_at > idem.clock();

-- name: PublicRoutines :many
-- Routines of schema idem that PUBLIC may execute (there should be none).
SELECT p.oid::regprocedure::text AS routine
  FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
 WHERE n.nspname = 'idem' AND pg_catalog.has_function_privilege('public', p.oid, 'EXECUTE')
 ORDER BY 1;

-- name: Release :one
-- An operator's re-run (migration 8): the key's rows are deleted and every
-- process's cache is told; refused (ID004) while in progress or held by the
-- inbox. Returns the rows deleted.
SELECT idem.release(sqlc.arg(source)::text, sqlc.arg(key)::text)::bigint AS released;

-- name: DefaultMonths :many
-- The months that have rows in the default partition, and how many each.
SELECT month::date AS month, row_count::bigint AS row_count FROM idem.default_months();

-- name: MoveDefaultMonth :one
-- Moves a month's rows out of the default partition into the month's new
-- partition (migration 25); ID010 when there are more than max_rows.
SELECT idem.move_default_month(sqlc.arg(month)::date, sqlc.arg(max_rows)::bigint)::bigint AS moved;

-- name: MarkForDrop :exec
-- Marks a month rotation detached to drop, in the detaching transaction
-- (migration 26).
SELECT idem.mark_for_drop(sqlc.arg(name)::text::regclass);

-- name: DetachedMonths :many
-- Every detached month of schema idem, and whether a drop is pending for
-- it (migration 26).
SELECT part::text AS name, drop_pending::boolean AS drop_pending FROM idem.detached_months();
