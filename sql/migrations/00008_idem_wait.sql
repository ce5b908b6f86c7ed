-- idem 8: a duplicate may wait for the original instead of answering 409.
--
-- * idem.waiters (UNLOGGED: a waiter is a session's state, not data): a
--   duplicate that found its key in progress and chose to wait registers
--   (idem.wait_begin) and deregisters (idem.wait_end); rows past their
--   deadline are deleted by the next registration.
-- * A trigger on idem.processed_events, when a key leaves 'processing'
--   (completed, failed, released: any protocol function, the inbox's
--   included), sends pg_notify('idem_done', md5(source || E'\x1f' || key))
--   only when someone waits for that key: NOTIFY takes a cluster-wide lock
--   at commit, so a completion that nobody waits for never pays for it (one
--   probe of an almost always empty table's index).
-- * idem.peek(source, key): the key's status and remaining lease, read-only,
--   for a waiter that polls (behind a transaction pooler, LISTEN gets
--   nothing) without counting itself as a duplicate again.
-- * idem.release(source, key): an operator's re-run. The key's rows are
--   deleted (every month), so its next delivery runs the work again, and
--   channel idem_released is notified, so that the Go client's cache of
--   completed outcomes (idem.Config.Cache) drops the key in every process.
--   Refused (ID004) while the key is in progress under a live lease or held
--   by the inbox (a queued job, or a dead letter: replay it instead).
-- * grant_app gives the three wait functions, grant_maintainer release;
--   roles granted before get them.

-- +goose Up
-- +goose StatementBegin
CREATE UNLOGGED TABLE idem.waiters (
    id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source text NOT NULL,
    key    text NOT NULL,
    until  timestamptz NOT NULL
);
-- +goose StatementEnd

-- +goose StatementBegin
CREATE INDEX waiters_key_idx ON idem.waiters (source, key);
-- +goose StatementEnd

-- +goose StatementBegin
CREATE INDEX waiters_until_idx ON idem.waiters (until);
-- +goose StatementEnd

-- +goose StatementBegin
-- The channel payload of a key: what the Go client computes too.
CREATE FUNCTION idem.wait_channel_key(source text, key text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $$ SELECT md5(source || E'\x1f' || key) $$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION idem.wait_begin(source text, key text, wait interval) RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_id  bigint;
    v_now timestamptz := idem.clock();
BEGIN
    PERFORM idem.check_key('idem.wait_begin', wait_begin.source, wait_begin.key);
    IF wait_begin.wait IS NULL OR wait_begin.wait <= interval '0' OR wait_begin.wait > interval '1 hour' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('idem.wait_begin: wait %s must be above 0 and at most 1 hour', wait_begin.wait);
    END IF;
    DELETE FROM idem.waiters w WHERE w.until < v_now - interval '1 minute';
    INSERT INTO idem.waiters (source, key, until)
    VALUES (wait_begin.source, wait_begin.key, v_now + wait_begin.wait)
    RETURNING id INTO v_id;
    RETURN v_id;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.wait_begin(text, text, interval) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION idem.wait_end(id bigint) RETURNS void
    LANGUAGE sql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$ DELETE FROM idem.waiters w WHERE w.id = wait_end.id $$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.wait_end(bigint) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- The key's latest row: its status, and for 'processing' the lease left by
-- the database's clock (negative: lapsed). No row: status NULL.
CREATE FUNCTION idem.peek(source text, key text, OUT status text, OUT lease_remaining_ms bigint)
    LANGUAGE sql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
SELECT e.status,
       CASE WHEN e.status = 'processing'
            THEN (extract(epoch FROM e.lease_expires_at - idem.clock()) * 1000)::bigint END
  FROM idem.processed_events e
 WHERE e.source = peek.source AND e.key = peek.key
 ORDER BY e.first_seen_month DESC
 LIMIT 1
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.peek(text, text) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION idem.release(source text, key text) RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_n bigint;
BEGIN
    PERFORM idem.check_key('idem.release', release.source, release.key);
    -- The key's lock, as claims take it: no claim is half-way meanwhile.
    PERFORM pg_advisory_xact_lock(1768187245, hashtext(release.source || chr(31) || release.key));
    IF EXISTS (SELECT 1 FROM idem.holds h WHERE h.source = release.source AND h.key = release.key) THEN
        RAISE EXCEPTION USING ERRCODE = 'ID004',
            MESSAGE = format('idem.release: key %L of source %L is held by the inbox (a queued job or a dead letter)', left(release.key, 64), release.source),
            HINT = 'Replay a dead letter with idemctl inbox replay; a queued job processes the event itself.';
    END IF;
    IF EXISTS (SELECT 1 FROM idem.processed_events e
                WHERE e.source = release.source AND e.key = release.key
                  AND e.status = 'processing' AND e.lease_expires_at > idem.clock()) THEN
        RAISE EXCEPTION USING ERRCODE = 'ID004',
            MESSAGE = format('idem.release: key %L of source %L is in progress: a worker holds its lease', left(release.key, 64), release.source),
            HINT = 'Release it once the work has finished or its lease has ended.';
    END IF;
    DELETE FROM idem.processed_events e WHERE e.source = release.source AND e.key = release.key;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    PERFORM pg_notify('idem_released', idem.wait_channel_key(release.source, release.key));
    RETURN v_n;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.release(text, text) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION idem.notify_done() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM idem.waiters w WHERE w.source = NEW.source AND w.key = NEW.key) THEN
        PERFORM pg_notify('idem_done', idem.wait_channel_key(NEW.source, NEW.key));
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.notify_done() FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE TRIGGER processed_events_done
    AFTER UPDATE OF status ON idem.processed_events
    FOR EACH ROW
    WHEN (OLD.status = 'processing' AND NEW.status IS DISTINCT FROM 'processing')
    EXECUTE FUNCTION idem.notify_done();
-- +goose StatementEnd

-- +goose StatementBegin
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
        idem.release(text, text) TO %s', role);
    EXECUTE format('GRANT EXECUTE ON PROCEDURE idem.prune(integer, integer), idem.rotate(integer, boolean, interval) TO %s', role);
    -- Reading for stats and check; no writes.
    EXECUTE format('GRANT SELECT ON idem.processed_events, idem.processed_events_default, idem.policies, idem.maintenance_locks,
        idem.lookbacks, idem.duplicate_counts, idem.holds, idem.queue_counts TO %s', role);
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
DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT a.grantee::regrole::text AS role
               FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
              WHERE p.oid = 'idem.extend(text, text, bigint, interval)'::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        PERFORM idem.grant_app(r.role::regrole);
    END LOOP;
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
DROP TRIGGER IF EXISTS processed_events_done ON idem.processed_events;
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.notify_done();
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.release(text, text);
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.peek(text, text);
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.wait_end(bigint);
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.wait_begin(text, text, interval);
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.wait_channel_key(text, text);
-- +goose StatementEnd

-- +goose StatementBegin
DROP TABLE IF EXISTS idem.waiters;
-- +goose StatementEnd

-- +goose StatementBegin
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
        idem.complete_unstored(text, text, bigint, text),
        idem.fail(text, text, bigint, text, boolean),
        idem.extend(text, text, bigint, interval),
        idem.queue_hold(text, text, bigint, bigint),
        idem.queue_take(text, text, bigint, bigint, interval),
        idem.queue_complete(text, text, bigint, bigint, jsonb, text),
        idem.queue_fail(text, text, bigint, bigint, text, boolean),
        idem.queue_repair(text, text, bigint, bigint, bigint, text),
        idem.queue_replay(text, text, bigint, interval),
        idem.queue_forget(text, text, bigint) TO %s', role);
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
        idem.compact_duplicate_counts() TO %s', role);
    EXECUTE format('GRANT EXECUTE ON PROCEDURE idem.prune(integer, integer), idem.rotate(integer, boolean, interval) TO %s', role);
    -- Reading for stats and check; no writes.
    EXECUTE format('GRANT SELECT ON idem.processed_events, idem.processed_events_default, idem.policies, idem.maintenance_locks,
        idem.lookbacks, idem.duplicate_counts, idem.holds, idem.queue_counts TO %s', role);
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
