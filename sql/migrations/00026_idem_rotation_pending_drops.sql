-- idem 26: a month that rotation detached to drop is dropped by the next
-- rotation when its DROP did not happen.
--
-- Rotation retires a month in two transactions, DETACH then DROP, so that
-- the lock every claim queues behind lasts only the detach. When the DROP
-- gave up on a lock (a reader such as pg_dump queued behind the detach),
-- or rotation was stopped between the two, the table stayed in schema idem
-- with all its rows, and idem.partitions_to_retire(), which lists attached
-- partitions only, never showed it to a later rotation: it stayed forever,
-- unlisted, and idemctl check said healthy.
--
-- * idem.mark_for_drop(part): the detaching transaction marks a month it
--   detached to drop (a comment on the table, 'idem: detached by rotation,
--   to be dropped'), in the same transaction as the detach, so the intent
--   is never lost and a month detached to be kept (--keep-detached) is
--   never taken for one.
-- * idem.detached_months(): every detached month of schema idem (a table
--   of idem's owner named like a month, not a partition), and whether a
--   drop is pending for it. idemctl's rotation drops the pending ones
--   first; idemctl check reports them until then; partitions list shows
--   them.
-- * CALL idem.rotate(), version 30: marks what it detaches to drop, drops
--   the pending months first, and a DROP that times out on a lock is left
--   for the next run (counted as gave_up) instead of failing the run.
--
-- The maintainer may execute both functions (idem.rights). Down restores
-- the procedure and drops the functions; marked tables keep their comment.

-- +goose Up
-- +goose StatementBegin
CREATE FUNCTION idem.mark_for_drop(part regclass)
RETURNS void
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
                    WHERE c.oid OPERATOR(pg_catalog.=) mark_for_drop.part AND n.nspname OPERATOR(pg_catalog.=) 'idem'
                      AND c.relname OPERATOR(pg_catalog.~) '^processed_events_p[0-9]{4}_[0-9]{2}$'
                      AND NOT c.relispartition AND c.relkind OPERATOR(pg_catalog.=) 'r'
                      AND c.relowner OPERATOR(pg_catalog.=) n.nspowner) THEN
        RAISE EXCEPTION USING ERRCODE = 'ID002',
            MESSAGE = format('idem.mark_for_drop: %s is not a detached month of idem.processed_events', mark_for_drop.part);
    END IF;
    EXECUTE format('COMMENT ON TABLE %s IS %L', mark_for_drop.part, 'idem: detached by rotation, to be dropped');
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION idem.detached_months()
RETURNS TABLE (part regclass, drop_pending boolean)
    LANGUAGE sql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
    SELECT c.oid::regclass,
           coalesce(d.description OPERATOR(pg_catalog.=) 'idem: detached by rotation, to be dropped', false)
      FROM pg_class c
      JOIN pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
      LEFT JOIN pg_description d ON d.objoid OPERATOR(pg_catalog.=) c.oid
                                AND d.classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::regclass
                                AND d.objsubid OPERATOR(pg_catalog.=) 0
     WHERE n.nspname OPERATOR(pg_catalog.=) 'idem'
       AND c.relname OPERATOR(pg_catalog.~) '^processed_events_p[0-9]{4}_[0-9]{2}$'
       AND NOT c.relispartition AND c.relkind OPERATOR(pg_catalog.=) 'r'
       AND c.relowner OPERATOR(pg_catalog.=) n.nspowner
     ORDER BY c.relname
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE PROCEDURE idem.rotate(IN premake integer DEFAULT 3, IN keep_detached boolean DEFAULT false, IN lock_wait interval DEFAULT '00:00:02'::interval)
 LANGUAGE plpgsql
AS $procedure$
DECLARE
    v_holder text;
    v_wait   text;
    v_got    boolean;
    v_month  date;
    v_part   regclass;
    v_res    text;
    v_start  timestamptz := pg_catalog.clock_timestamp();
    v_made   integer := 0;
    v_gone   integer := 0;
    v_kept   integer := 0;
    v_gaveup integer := 0;
    -- An error in a step: kept to release the lock and record the run
    -- first, then raised.
    v_state  text;
    v_msg    text;
    v_detail text;
    v_hint   text;
BEGIN
    v_wait := idem.check_rotate_args(premake, lock_wait);
    v_holder := idem.sql_holder();
    SELECT l.acquired INTO v_got FROM idem.try_lock('rotate'::text, v_holder, NULL::interval) l;
    IF NOT v_got THEN
        PERFORM idem.record_run('rotate'::text, v_start, 'skipped'::text, '{}'::jsonb, NULL::text, v_holder);
        RAISE NOTICE 'idem.rotate: skipped, another rotation holds the lock';
        RETURN;
    END IF;
    COMMIT;
    -- Months an earlier rotation detached to drop and did not drop.
    FOR v_part IN SELECT d.part FROM idem.detached_months() d WHERE d.drop_pending LOOP
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout'::text, v_wait, true);
            PERFORM idem.drop_detached(v_part);
            v_gone := v_gone OPERATOR(pg_catalog.+) 1;
            RAISE NOTICE 'idem.rotate: %: dropped (detached by an earlier rotation)', v_part;
        EXCEPTION
            WHEN lock_not_available THEN
                v_gaveup := v_gaveup OPERATOR(pg_catalog.+) 1;
                RAISE NOTICE 'idem.rotate: could not lock % to drop it, left for the next run', v_part;
        END;
        COMMIT;
    END LOOP;
    FOR v_month IN SELECT m.m FROM idem.months_to_create(premake) m(m) LOOP
        v_res := NULL;
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout'::text, v_wait, true);
            v_res := idem.make_month(v_month);
        EXCEPTION
            WHEN lock_not_available THEN
                v_gaveup := v_gaveup OPERATOR(pg_catalog.+) 1;
                RAISE NOTICE 'idem.rotate: could not lock for %, left for the next run', v_month;
            WHEN OTHERS THEN
                GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_msg = MESSAGE_TEXT,
                                        v_detail = PG_EXCEPTION_DETAIL, v_hint = PG_EXCEPTION_HINT;
        END;
        COMMIT;
        EXIT WHEN v_state IS NOT NULL;
        IF v_res OPERATOR(pg_catalog.=) 'created' THEN
            v_made := v_made OPERATOR(pg_catalog.+) 1;
            RAISE NOTICE 'idem.rotate: created partition for %', v_month;
        ELSIF v_res IS NOT NULL THEN
            RAISE NOTICE 'idem.rotate: %: %', v_month, v_res;
        END IF;
    END LOOP;
    FOR v_part IN SELECT p.p FROM idem.partitions_to_retire() p(p) LOOP
        EXIT WHEN v_state IS NOT NULL;
        v_res := NULL; -- a lock timeout must not leave the previous partition's result behind
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout'::text, v_wait, true);
            v_res := idem.retire_partition(v_part, true);
            IF v_res OPERATOR(pg_catalog.=) 'detached' AND NOT keep_detached THEN
                PERFORM idem.mark_for_drop(v_part);
            END IF;
            RAISE NOTICE 'idem.rotate: %: %', v_part, v_res;
        EXCEPTION
            WHEN lock_not_available THEN
                v_gaveup := v_gaveup OPERATOR(pg_catalog.+) 1;
                RAISE NOTICE 'idem.rotate: could not lock %, left for the next run', v_part;
            WHEN OTHERS THEN
                GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_msg = MESSAGE_TEXT,
                                        v_detail = PG_EXCEPTION_DETAIL, v_hint = PG_EXCEPTION_HINT;
        END;
        COMMIT;
        IF v_res OPERATOR(pg_catalog.=) 'detached' OR v_res OPERATOR(pg_catalog.=) 'dropped' THEN
            v_gone := v_gone OPERATOR(pg_catalog.+) 1;
        ELSIF v_res IS NOT NULL THEN
            v_kept := v_kept OPERATOR(pg_catalog.+) 1;
        END IF;
        IF v_res OPERATOR(pg_catalog.=) 'detached' AND NOT keep_detached THEN
            BEGIN
                PERFORM pg_catalog.set_config('lock_timeout'::text, v_wait, true);
                PERFORM idem.drop_detached(v_part);
            EXCEPTION
                WHEN lock_not_available THEN
                    v_gaveup := v_gaveup OPERATOR(pg_catalog.+) 1;
                    RAISE NOTICE 'idem.rotate: could not lock % to drop it, left for the next run', v_part;
            END;
            COMMIT;
        END IF;
    END LOOP;
    PERFORM idem.release_lock('rotate'::text, v_holder);
    PERFORM idem.record_run('rotate'::text, v_start,
        CASE WHEN v_state IS NOT NULL THEN 'error'::text WHEN v_gaveup OPERATOR(pg_catalog.>) 0 THEN 'incomplete'::text ELSE 'ok'::text END,
        pg_catalog.jsonb_build_object('created'::text, v_made, 'retired'::text, v_gone, 'kept'::text, v_kept, 'gave_up'::text, v_gaveup), v_msg, v_holder);
    COMMIT;
    IF v_state IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = v_state, MESSAGE = v_msg,
            DETAIL = coalesce(v_detail, ''), HINT = coalesce(v_hint, '');
    END IF;
END
$procedure$;
-- +goose StatementEnd

REVOKE ALL ON FUNCTION idem.mark_for_drop(regclass), idem.detached_months() FROM PUBLIC;

INSERT INTO idem.rights (grantee, privilege, kind, object) VALUES
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.mark_for_drop(regclass)'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.detached_months()');

SELECT idem.regrant();

-- +goose Down
DELETE FROM idem.rights x
 WHERE x.object IN ('idem.mark_for_drop(regclass)', 'idem.detached_months()');
-- +goose StatementBegin
CREATE OR REPLACE PROCEDURE idem.rotate(IN premake integer DEFAULT 3, IN keep_detached boolean DEFAULT false, IN lock_wait interval DEFAULT '00:00:02'::interval)
 LANGUAGE plpgsql
AS $procedure$
DECLARE
    v_holder text;
    v_wait   text;
    v_got    boolean;
    v_month  date;
    v_part   regclass;
    v_res    text;
    v_start  timestamptz := pg_catalog.clock_timestamp();
    v_made   integer := 0;
    v_gone   integer := 0;
    v_kept   integer := 0;
    v_gaveup integer := 0;
    -- An error in a step: kept to release the lock and record the run
    -- first, then raised.
    v_state  text;
    v_msg    text;
    v_detail text;
    v_hint   text;
BEGIN
    v_wait := idem.check_rotate_args(premake, lock_wait);
    v_holder := idem.sql_holder();
    SELECT l.acquired INTO v_got FROM idem.try_lock('rotate'::text, v_holder, NULL::interval) l;
    IF NOT v_got THEN
        PERFORM idem.record_run('rotate'::text, v_start, 'skipped'::text, '{}'::jsonb, NULL::text, v_holder);
        RAISE NOTICE 'idem.rotate: skipped, another rotation holds the lock';
        RETURN;
    END IF;
    COMMIT;
    FOR v_month IN SELECT m.m FROM idem.months_to_create(premake) m(m) LOOP
        v_res := NULL;
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout'::text, v_wait, true);
            v_res := idem.make_month(v_month);
        EXCEPTION
            WHEN lock_not_available THEN
                v_gaveup := v_gaveup OPERATOR(pg_catalog.+) 1;
                RAISE NOTICE 'idem.rotate: could not lock for %, left for the next run', v_month;
            WHEN OTHERS THEN
                GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_msg = MESSAGE_TEXT,
                                        v_detail = PG_EXCEPTION_DETAIL, v_hint = PG_EXCEPTION_HINT;
        END;
        COMMIT;
        EXIT WHEN v_state IS NOT NULL;
        IF v_res OPERATOR(pg_catalog.=) 'created' THEN
            v_made := v_made OPERATOR(pg_catalog.+) 1;
            RAISE NOTICE 'idem.rotate: created partition for %', v_month;
        ELSIF v_res IS NOT NULL THEN
            RAISE NOTICE 'idem.rotate: %: %', v_month, v_res;
        END IF;
    END LOOP;
    FOR v_part IN SELECT p.p FROM idem.partitions_to_retire() p(p) LOOP
        EXIT WHEN v_state IS NOT NULL;
        v_res := NULL; -- a lock timeout must not leave the previous partition's result behind
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout'::text, v_wait, true);
            v_res := idem.retire_partition(v_part, true);
            RAISE NOTICE 'idem.rotate: %: %', v_part, v_res;
        EXCEPTION
            WHEN lock_not_available THEN
                v_gaveup := v_gaveup OPERATOR(pg_catalog.+) 1;
                RAISE NOTICE 'idem.rotate: could not lock %, left for the next run', v_part;
            WHEN OTHERS THEN
                GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_msg = MESSAGE_TEXT,
                                        v_detail = PG_EXCEPTION_DETAIL, v_hint = PG_EXCEPTION_HINT;
        END;
        COMMIT;
        IF v_res OPERATOR(pg_catalog.=) 'detached' OR v_res OPERATOR(pg_catalog.=) 'dropped' THEN
            v_gone := v_gone OPERATOR(pg_catalog.+) 1;
        ELSIF v_res IS NOT NULL THEN
            v_kept := v_kept OPERATOR(pg_catalog.+) 1;
        END IF;
        IF v_res OPERATOR(pg_catalog.=) 'detached' AND NOT keep_detached THEN
            PERFORM idem.drop_detached(v_part);
            COMMIT;
        END IF;
    END LOOP;
    PERFORM idem.release_lock('rotate'::text, v_holder);
    PERFORM idem.record_run('rotate'::text, v_start,
        CASE WHEN v_state IS NOT NULL THEN 'error'::text WHEN v_gaveup OPERATOR(pg_catalog.>) 0 THEN 'incomplete'::text ELSE 'ok'::text END,
        pg_catalog.jsonb_build_object('created'::text, v_made, 'retired'::text, v_gone, 'kept'::text, v_kept, 'gave_up'::text, v_gaveup), v_msg, v_holder);
    COMMIT;
    IF v_state IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = v_state, MESSAGE = v_msg,
            DETAIL = coalesce(v_detail, ''), HINT = coalesce(v_hint, '');
    END IF;
END
$procedure$;
-- +goose StatementEnd

DROP FUNCTION idem.mark_for_drop(regclass);
DROP FUNCTION idem.detached_months();
