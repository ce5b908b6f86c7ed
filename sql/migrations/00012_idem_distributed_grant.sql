-- idem 12: the application's and the maintainer's roles may ask
-- idem.distributed() (version 11 revoked it from PUBLIC and granted it to
-- nobody). The inbox asks it before it accepts, works or replays, and
-- refuses to run on a distributed (Citus) installation, where its queue
-- functions would take a key's lock on the coordinator while the key's
-- claims take it on the worker that holds the key (docs/citus.md).
--
-- * grant_app, version 12: version 11 and idem.distributed().
-- * grant_maintainer, version 12: version 10 and idem.distributed().
-- * Roles granted before get it.
--
-- Down restores grant_app version 11 and grant_maintainer version 10 and
-- takes idem.distributed() back from every role but its owner.

-- +goose Up
-- +goose StatementBegin
-- grant_app, version 12: idem.distributed() too (the inbox asks it).
CREATE OR REPLACE FUNCTION idem.grant_app(role regrole) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF role IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.grant_app: role must not be NULL';
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA idem TO %s', role);
    EXECUTE format('GRANT EXECUTE ON FUNCTION
        idem.claim(text, text, text, interval, interval, text, interval),
        idem.complete(text, text, bigint, jsonb),
        idem.complete_stored(text, text, bigint, jsonb),
        idem.distributed(),
        idem.complete_unstored(text, text, bigint, text),
        idem.fail(text, text, bigint, text, boolean),
        idem.extend(text, text, bigint, interval),
        idem.queue_hold(text, text, bigint, bigint),
        idem.queue_take(text, text, bigint, bigint, interval),
        idem.queue_complete(text, text, bigint, bigint, jsonb, text),
        idem.queue_fail(text, text, bigint, bigint, text, boolean),
        idem.queue_repair(text, text, bigint, bigint, bigint, text),
        idem.queue_replay(text, text, bigint, interval),
        idem.queue_forget(text, text, bigint),
        idem.wait_begin(text, text, interval),
        idem.wait_end(bigint),
        idem.peek(text, text) TO %s', role);
    -- The inbox's reconciliation and dead letters (keys and errors, no
    -- results, no payloads).
    EXECUTE format('GRANT SELECT ON idem.holds, idem.queue_counts TO %s', role);
    -- The schema's version, for a program to tell it is behind.
    IF to_regclass('idem.goose_db_version') IS NOT NULL THEN
        EXECUTE format('GRANT SELECT ON idem.goose_db_version TO %s', role);
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- grant_maintainer, version 12: idem.distributed() too (the inbox's replay
-- asks it).
CREATE OR REPLACE FUNCTION idem.grant_maintainer(role regrole) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF role IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.grant_maintainer: role must not be NULL';
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA idem TO %s', role);
    EXECUTE format('GRANT EXECUTE ON FUNCTION
        idem.clock(),
        idem.utc_month(timestamptz),
        idem.partition_name(date),
        idem.partitions(),
        idem.create_partition(date),
        idem.retire_partition(regclass, boolean),
        idem.drop_detached(regclass),
        idem.months_to_create(integer),
        idem.try_lock(text, text, interval),
        idem.release_lock(text, text),
        idem.prune_batch(text, integer),
        idem.prunable_rows(),
        idem.partition_months(),
        idem.partitions_to_retire(),
        idem.compact_duplicate_counts(),
        idem.release(text, text),
        idem.source_stats(),
        idem.snapshot_stats(),
        idem.record_run(text, timestamptz, text, jsonb, text, text),
        idem.distributed() TO %s', role);
    EXECUTE format('GRANT EXECUTE ON PROCEDURE idem.prune(integer, integer), idem.rotate(integer, boolean, interval) TO %s', role);
    -- Reading for stats and check; no writes.
    EXECUTE format('GRANT SELECT ON idem.processed_events, idem.processed_events_default, idem.policies, idem.maintenance_locks,
        idem.lookbacks, idem.duplicate_counts, idem.holds, idem.queue_counts,
        idem.activity, idem.source_snapshots, idem.runs TO %s', role);
    -- Replaying the inbox's dead letters (version 7): the claim of a
    -- dead-lettered key only, and its hold for the new job.
    EXECUTE format('GRANT EXECUTE ON FUNCTION
        idem.queue_replay(text, text, bigint, interval),
        idem.queue_hold(text, text, bigint, bigint),
        idem.queue_forget(text, text, bigint) TO %s', role);
    -- The schema's version, for idemctl to tell it is behind.
    IF to_regclass('idem.goose_db_version') IS NOT NULL THEN
        EXECUTE format('GRANT SELECT ON idem.goose_db_version TO %s', role);
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Application roles granted before get idem.distributed().
DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT a.grantee::regrole::text AS role
               FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
              WHERE p.oid = 'idem.complete_stored(text, text, bigint, jsonb)'::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        PERFORM idem.grant_app(r.role::regrole);
    END LOOP;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Maintainer roles granted before get idem.distributed().
DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT a.grantee::regrole::text AS role
               FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
              WHERE p.oid = 'idem.prunable_rows()'::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        PERFORM idem.grant_maintainer(r.role::regrole);
    END LOOP;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
-- Every role but the owner loses idem.distributed() (version 11's rights).
DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT a.grantee::regrole::text AS role
               FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
              WHERE p.oid = 'idem.distributed()'::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION idem.distributed() FROM %s', r.role);
    END LOOP;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- grant_app, version 11.
CREATE OR REPLACE FUNCTION idem.grant_app(role regrole) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF role IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.grant_app: role must not be NULL';
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA idem TO %s', role);
    EXECUTE format('GRANT EXECUTE ON FUNCTION
        idem.claim(text, text, text, interval, interval, text, interval),
        idem.complete(text, text, bigint, jsonb),
        idem.complete_stored(text, text, bigint, jsonb),
        idem.complete_unstored(text, text, bigint, text),
        idem.fail(text, text, bigint, text, boolean),
        idem.extend(text, text, bigint, interval),
        idem.queue_hold(text, text, bigint, bigint),
        idem.queue_take(text, text, bigint, bigint, interval),
        idem.queue_complete(text, text, bigint, bigint, jsonb, text),
        idem.queue_fail(text, text, bigint, bigint, text, boolean),
        idem.queue_repair(text, text, bigint, bigint, bigint, text),
        idem.queue_replay(text, text, bigint, interval),
        idem.queue_forget(text, text, bigint),
        idem.wait_begin(text, text, interval),
        idem.wait_end(bigint),
        idem.peek(text, text) TO %s', role);
    -- The inbox's reconciliation and dead letters (keys and errors, no
    -- results, no payloads).
    EXECUTE format('GRANT SELECT ON idem.holds, idem.queue_counts TO %s', role);
    -- The schema's version, for a program to tell it is behind.
    IF to_regclass('idem.goose_db_version') IS NOT NULL THEN
        EXECUTE format('GRANT SELECT ON idem.goose_db_version TO %s', role);
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- grant_maintainer, version 10.
CREATE OR REPLACE FUNCTION idem.grant_maintainer(role regrole) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF role IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.grant_maintainer: role must not be NULL';
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA idem TO %s', role);
    EXECUTE format('GRANT EXECUTE ON FUNCTION
        idem.clock(),
        idem.utc_month(timestamptz),
        idem.partition_name(date),
        idem.partitions(),
        idem.create_partition(date),
        idem.retire_partition(regclass, boolean),
        idem.drop_detached(regclass),
        idem.months_to_create(integer),
        idem.try_lock(text, text, interval),
        idem.release_lock(text, text),
        idem.prune_batch(text, integer),
        idem.prunable_rows(),
        idem.partition_months(),
        idem.partitions_to_retire(),
        idem.compact_duplicate_counts(),
        idem.release(text, text),
        idem.source_stats(),
        idem.snapshot_stats(),
        idem.record_run(text, timestamptz, text, jsonb, text, text) TO %s', role);
    EXECUTE format('GRANT EXECUTE ON PROCEDURE idem.prune(integer, integer), idem.rotate(integer, boolean, interval) TO %s', role);
    -- Reading for stats and check; no writes.
    EXECUTE format('GRANT SELECT ON idem.processed_events, idem.processed_events_default, idem.policies, idem.maintenance_locks,
        idem.lookbacks, idem.duplicate_counts, idem.holds, idem.queue_counts,
        idem.activity, idem.source_snapshots, idem.runs TO %s', role);
    -- Replaying the inbox's dead letters (version 7): the claim of a
    -- dead-lettered key only, and its hold for the new job.
    EXECUTE format('GRANT EXECUTE ON FUNCTION
        idem.queue_replay(text, text, bigint, interval),
        idem.queue_hold(text, text, bigint, bigint),
        idem.queue_forget(text, text, bigint) TO %s', role);
    -- The schema's version, for idemctl to tell it is behind.
    IF to_regclass('idem.goose_db_version') IS NOT NULL THEN
        EXECUTE format('GRANT SELECT ON idem.goose_db_version TO %s', role);
    END IF;
END
$$;
-- +goose StatementEnd
