-- Least privilege. Nothing in schema idem is executable by PUBLIC; two
-- helpers grant what an application role and a maintainer role need:
--
--   SELECT idem.grant_app('app_role');         -- claim / complete / fail / extend, nothing else
--   SELECT idem.grant_maintainer('ops_role');  -- prune, rotate, stats, check
--
-- (or `idemctl grant --app app_role --maintainer ops_role`). The protocol
-- and maintenance functions are SECURITY DEFINER, so neither role needs, or
-- gets, INSERT, UPDATE, DELETE or TRUNCATE on idem's tables. Run the helpers
-- as idem's owner (the role that applied the migrations).

-- +goose Up
-- +goose StatementBegin
CREATE FUNCTION idem.grant_app(role regrole) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF role IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.grant_app: role must not be NULL';
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA idem TO %s', role);
    EXECUTE format('GRANT EXECUTE ON FUNCTION
        idem.claim(text, text, text, interval, interval, text),
        idem.complete(text, text, bigint, jsonb),
        idem.fail(text, text, bigint, text, boolean),
        idem.extend(text, text, bigint, interval) TO %s', role);
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION idem.grant_maintainer(role regrole) RETURNS void
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
        idem.partition_name(date),
        idem.partitions(),
        idem.create_partition(date),
        idem.retire_partition(regclass, boolean),
        idem.drop_detached(regclass),
        idem.months_to_create(integer),
        idem.try_lock(text, text, interval),
        idem.release_lock(text, text),
        idem.prune_batch(text, integer),
        idem.prunable_rows() TO %s', role);
    EXECUTE format('GRANT EXECUTE ON PROCEDURE idem.prune(integer, integer), idem.rotate(integer, boolean, interval) TO %s', role);
    -- Reading for stats and check; no writes.
    EXECUTE format('GRANT SELECT ON idem.processed_events, idem.processed_events_default, idem.policies, idem.maintenance_locks TO %s', role);
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON ALL ROUTINES IN SCHEMA idem FROM PUBLIC;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.grant_maintainer(regrole);
DROP FUNCTION IF EXISTS idem.grant_app(regrole);
GRANT EXECUTE ON ALL ROUTINES IN SCHEMA idem TO PUBLIC;
-- +goose StatementEnd
