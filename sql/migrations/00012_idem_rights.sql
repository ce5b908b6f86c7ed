-- idem 12: the roles' rights as data. Until 11 every migration that added
-- a function the application or the maintainer calls replaced grant_app or
-- grant_maintainer with a copy that named one more object, and re-granted
-- the roles granted before in a block of its own. From 12 the rights are
-- rows of idem.rights, which grant_app and grant_maintainer grant; a later
-- migration adds its rows and calls idem.regrant() (Down: deletes them and
-- revokes what they granted).
--
-- * idem.rights (grantee 'app' or 'maintainer', privilege, kind of object,
--   object): what version 11's grant_app and version 10's grant_maintainer
--   granted, and idem.distributed() to both (version 11 revoked it from
--   PUBLIC and granted it to nobody; the inbox asks it before it accepts,
--   works or replays, and refuses to run on a distributed (Citus)
--   installation, where its queue functions would take a key's lock on the
--   coordinator while the key's claims take it on the worker that holds
--   the key: docs/citus.md).
-- * idem.grant_rights(grantee, role): grants role the rows of grantee, and
--   SELECT on goose's version table where it is in schema idem.
-- * grant_app and grant_maintainer, version 12: grant_rights('app') and
--   grant_rights('maintainer').
-- * idem.regrant(): grants again every role granted before (an
--   application role holds EXECUTE on idem.claim, a maintainer role on
--   idem.prunable_rows()); run at the end of this migration, so roles
--   granted at 11 get idem.distributed().
--
-- Run as idem's owner, like the grant functions; none of them is granted to
-- anyone. Down restores grant_app version 11 and grant_maintainer version
-- 10, takes idem.distributed() back from every role but its owner and drops
-- the new objects.

-- +goose Up
CREATE TABLE idem.rights (
    grantee   text NOT NULL CHECK (grantee IN ('app', 'maintainer')),
    privilege text NOT NULL CHECK (privilege IN ('USAGE', 'EXECUTE', 'SELECT')),
    kind      text NOT NULL CHECK (kind IN ('SCHEMA', 'FUNCTION', 'PROCEDURE', 'TABLE')),
    object    text NOT NULL,
    PRIMARY KEY (grantee, kind, object, privilege)
);
REVOKE ALL ON idem.rights FROM PUBLIC;

INSERT INTO idem.rights (grantee, privilege, kind, object) VALUES
    ('app', 'USAGE', 'SCHEMA', 'idem'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.claim(text, text, text, interval, interval, text, interval)'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.complete(text, text, bigint, jsonb)'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.complete_stored(text, text, bigint, jsonb)'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.distributed()'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.complete_unstored(text, text, bigint, text)'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.fail(text, text, bigint, text, boolean)'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.extend(text, text, bigint, interval)'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.queue_hold(text, text, bigint, bigint)'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.queue_take(text, text, bigint, bigint, interval)'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.queue_complete(text, text, bigint, bigint, jsonb, text)'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.queue_fail(text, text, bigint, bigint, text, boolean)'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.queue_repair(text, text, bigint, bigint, bigint, text)'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.queue_replay(text, text, bigint, interval)'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.queue_forget(text, text, bigint)'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.wait_begin(text, text, interval)'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.wait_end(bigint)'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.peek(text, text)'),
    ('app', 'SELECT', 'TABLE', 'idem.holds'),
    ('app', 'SELECT', 'TABLE', 'idem.queue_counts'),
    ('maintainer', 'USAGE', 'SCHEMA', 'idem'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.clock()'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.utc_month(timestamptz)'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.partition_name(date)'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.partitions()'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.create_partition(date)'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.retire_partition(regclass, boolean)'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.drop_detached(regclass)'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.months_to_create(integer)'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.try_lock(text, text, interval)'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.release_lock(text, text)'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.prune_batch(text, integer)'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.prunable_rows()'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.partition_months()'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.partitions_to_retire()'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.compact_duplicate_counts()'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.release(text, text)'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.source_stats()'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.snapshot_stats()'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.record_run(text, timestamptz, text, jsonb, text, text)'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.distributed()'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.queue_replay(text, text, bigint, interval)'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.queue_hold(text, text, bigint, bigint)'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.queue_forget(text, text, bigint)'),
    ('maintainer', 'EXECUTE', 'PROCEDURE', 'idem.prune(integer, integer)'),
    ('maintainer', 'EXECUTE', 'PROCEDURE', 'idem.rotate(integer, boolean, interval)'),
    ('maintainer', 'SELECT', 'TABLE', 'idem.processed_events'),
    ('maintainer', 'SELECT', 'TABLE', 'idem.processed_events_default'),
    ('maintainer', 'SELECT', 'TABLE', 'idem.policies'),
    ('maintainer', 'SELECT', 'TABLE', 'idem.maintenance_locks'),
    ('maintainer', 'SELECT', 'TABLE', 'idem.lookbacks'),
    ('maintainer', 'SELECT', 'TABLE', 'idem.duplicate_counts'),
    ('maintainer', 'SELECT', 'TABLE', 'idem.holds'),
    ('maintainer', 'SELECT', 'TABLE', 'idem.queue_counts'),
    ('maintainer', 'SELECT', 'TABLE', 'idem.activity'),
    ('maintainer', 'SELECT', 'TABLE', 'idem.source_snapshots'),
    ('maintainer', 'SELECT', 'TABLE', 'idem.runs');

-- +goose StatementBegin
-- GRANT privilege ON kind object TO role for each row of grantee: objects
-- are named by idem's migrations (only idem's owner writes idem.rights),
-- so they are formatted as they are; the role is a regrole, quoted by its
-- output function.
CREATE FUNCTION idem.grant_rights(grantee text, role regrole) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    r record;
BEGIN
    IF role IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = format('idem.grant_%s: role must not be NULL', grant_rights.grantee);
    END IF;
    -- The schema first: USAGE before the objects in it.
    FOR r IN SELECT x.privilege, x.kind, x.object FROM idem.rights x
              WHERE x.grantee = grant_rights.grantee
              ORDER BY x.kind <> 'SCHEMA', x.kind, x.object LOOP
        EXECUTE format('GRANT %s ON %s %s TO %s', r.privilege, r.kind, r.object, role);
    END LOOP;
    -- The schema's version, for a program to tell it is behind.
    IF to_regclass('idem.goose_db_version') IS NOT NULL THEN
        EXECUTE format('GRANT SELECT ON idem.goose_db_version TO %s', role);
    END IF;
END
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.grant_rights(text, regrole) FROM PUBLIC;

-- +goose StatementBegin
-- grant_app, version 12: the rows of 'app' in idem.rights.
CREATE OR REPLACE FUNCTION idem.grant_app(role regrole) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM idem.grant_rights('app', role);
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- grant_maintainer, version 12: the rows of 'maintainer' in idem.rights.
CREATE OR REPLACE FUNCTION idem.grant_maintainer(role regrole) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM idem.grant_rights('maintainer', role);
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Every role granted before, granted again from idem.rights: a later
-- migration that adds rows calls it. Returns how many roles.
CREATE FUNCTION idem.regrant() RETURNS integer
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    r record;
    n integer := 0;
BEGIN
    FOR r IN SELECT DISTINCT m.grantee, a.grantee::regrole AS role
               FROM (VALUES ('app', 'idem.claim(text, text, text, interval, interval, text, interval)'),
                            ('maintainer', 'idem.prunable_rows()')) m(grantee, marker),
                    pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
              WHERE p.oid = m.marker::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        PERFORM idem.grant_rights(r.grantee, r.role);
        n := n + 1;
    END LOOP;
    RETURN n;
END
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.regrant() FROM PUBLIC;

SELECT idem.regrant();

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

DROP FUNCTION idem.regrant();
DROP FUNCTION idem.grant_rights(text, regrole);
DROP TABLE idem.rights;
