-- idem 14: least privilege that holds (docs/security.md).
--
-- * Maintenance locks that no other login can hold: idem.try_lock and
--   idem.prune_batch no longer take a blocking advisory lock on a fixed id
--   (any role can hold one, which made every prune and rotation wait for
--   ever). The lease row in idem.maintenance_locks is the lock, and only
--   idem's functions write it; try_lock waits at most 2 seconds for a row
--   lock, so a second instance is told at once who holds the lease.
-- * CALL idem.prune() and CALL idem.rotate() are immune to search_path
--   tricks: a procedure that commits cannot pin search_path, so every
--   operator they use is written OPERATOR(pg_catalog.x) and every function
--   qualified; their arguments are checked by idem.check_prune_args and
--   idem.check_rotate_args, which idemctl calls too (one rule for both).
-- * Partitions are what they are: idem.partition_months reads the bounds
--   under DateStyle ISO whatever the session's; a month's partition is the
--   attached one with the month's bounds, never a table that merely has its
--   name (idem.make_month refuses a table somebody else made, ID007).
-- * Rows in the default partition stay there until prune deletes them
--   (claims find them there); their month gets no partition meanwhile.
--   Moving them locked the default partition, which every claim reads, for
--   as long as the move took. idem.make_month makes one month: created and
--   attached in one short transaction (the attach scans the default
--   partition under its lock: a read, far shorter than a move), or kept.
--   idem.create_partition is make_month returning the partition's name.
-- * One role cannot be both: idem.role_conflicts() lists the roles that
--   hold the application's and the maintainer's rights (directly or through
--   membership); grant_app and grant_maintainer refuse a grant that makes
--   one (ID008). idem.audit() is what idemctl check reports.
--
-- Down restores the previous versions of every replaced routine and drops
-- the new ones.

-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.try_lock(name text, holder text, ttl interval)
RETURNS TABLE (acquired boolean, lock_holder text, lock_expires_at timestamptz)
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    -- Only idem's functions lock the row, each for one short statement.
    SET lock_timeout = '2s'
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz;
    v_ttl interval := coalesce(try_lock.ttl, idem.lock_ttl(try_lock.name));
BEGIN
    IF try_lock.name IS NULL OR try_lock.holder IS NULL OR try_lock.holder = '' THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.try_lock: name and holder must not be empty';
    END IF;
    IF v_ttl IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004',
            MESSAGE = format('idem.try_lock: lock %L has no default ttl; pass one', try_lock.name);
    END IF;
    IF v_ttl <= interval '0' OR v_ttl > interval '1 day' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('idem.try_lock: ttl %s is out of range (0 to 1 day)', v_ttl);
    END IF;
    v_now := clock_timestamp();
    RETURN QUERY
    INSERT INTO idem.maintenance_locks AS l (name, holder, acquired_at, expires_at)
    VALUES (try_lock.name, try_lock.holder, v_now, v_now + v_ttl)
    ON CONFLICT (name) DO UPDATE
       SET holder = EXCLUDED.holder,
           acquired_at = CASE WHEN l.holder = EXCLUDED.holder THEN l.acquired_at ELSE EXCLUDED.acquired_at END,
           expires_at = EXCLUDED.expires_at
     WHERE l.holder = EXCLUDED.holder OR l.expires_at <= v_now
    RETURNING true, l.holder, l.expires_at;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, l.holder, l.expires_at FROM idem.maintenance_locks l WHERE l.name = try_lock.name;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Deletes up to batch_size expired rows and returns how many it deleted,
-- for the holder of the maintenance lock 'prune' (ID001 otherwise). A lease
-- that ends during a batch lets a second prune start: both delete only
-- expired rows, skipping the ones the other has locked.
CREATE OR REPLACE FUNCTION idem.prune_batch(holder text, batch_size integer DEFAULT 5000)
RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now     timestamptz;
    v_left    integer := prune_batch.batch_size;
    v_deleted bigint := 0;
    v_n       bigint;
    v_part    regclass;
    v_citus   boolean;
BEGIN
    IF v_left IS NULL OR v_left < 1 OR v_left > 1000000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('idem.prune_batch: batch_size %s is out of range (1 to 1000000)', v_left);
    END IF;
    IF NOT EXISTS (SELECT 1 FROM idem.maintenance_locks l
                    WHERE l.name = 'prune' AND l.holder = prune_batch.holder AND l.expires_at > clock_timestamp()) THEN
        RAISE EXCEPTION USING ERRCODE = 'ID001',
            MESSAGE = format('idem.prune_batch: %s does not hold the prune lock', prune_batch.holder),
            HINT = 'Take it with idem.try_lock(''prune'', holder, NULL) first; it may have expired.';
    END IF;
    v_now := idem.clock();
    v_citus := idem.distributed();
    FOR v_part IN SELECT p.partition FROM idem.partition_months() p LOOP
        IF v_citus THEN
            -- Citus plans neither ctid lists nor FOR UPDATE on a
            -- distributed table: the batch is addressed by primary key,
            -- and the outer DELETE checks the conditions again, so a row a
            -- claim replaced meanwhile (same key and month) is kept.
            EXECUTE format(
                'DELETE FROM %1$s d
                  WHERE (d.source, d.key, d.first_seen_month) IN (
                         SELECT x.source, x.key, x.first_seen_month FROM %1$s x
                          WHERE x.expires_at < $1
                            AND (x.status <> ''processing'' OR x.lease_expires_at IS NULL OR x.lease_expires_at < $1)
                          LIMIT $2)
                    AND d.expires_at < $1
                    AND (d.status <> ''processing'' OR d.lease_expires_at IS NULL OR d.lease_expires_at < $1)
                    AND NOT EXISTS (SELECT 1 FROM idem.holds h
                                     WHERE h.source = d.source AND h.key = d.key AND h.state = ''queued'')', v_part)
                USING v_now, v_left;
        ELSE
            EXECUTE format(
                'DELETE FROM %1$s d WHERE d.ctid = ANY (ARRAY(
                     SELECT x.ctid FROM %1$s x
                      WHERE x.expires_at < $1
                        AND (x.status <> ''processing'' OR x.lease_expires_at IS NULL OR x.lease_expires_at < $1)
                        AND NOT EXISTS (SELECT 1 FROM idem.holds h
                                         WHERE h.source = x.source AND h.key = x.key AND h.state = ''queued'')
                      LIMIT $2
                      FOR UPDATE SKIP LOCKED))', v_part)
                USING v_now, v_left;
        END IF;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_deleted := v_deleted + v_n;
        v_left := v_left - v_n;
        EXIT WHEN v_left <= 0;
    END LOOP;
    RETURN v_deleted;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- The partitions of processed_events and their month ranges, read from the
-- catalog only (the default partition has NULL bounds). The bounds are
-- printed by pg_get_expr in the session's DateStyle: pinned to ISO here,
-- whatever the database's or the caller's setting.
CREATE OR REPLACE FUNCTION idem.partition_months()
RETURNS TABLE (partition regclass, is_default boolean, month_from date, month_to date)
    LANGUAGE sql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    SET DateStyle = 'ISO, YMD'
AS $$
    SELECT c.oid::regclass,
           b.bound = 'DEFAULT',
           (regexp_match(b.bound, 'FROM \(''([0-9]{4}-[0-9]{2}-[0-9]{2})''\)'))[1]::date,
           (regexp_match(b.bound, 'TO \(''([0-9]{4}-[0-9]{2}-[0-9]{2})''\)'))[1]::date
      FROM pg_inherits i
      JOIN pg_class c ON c.oid = i.inhrelid
     CROSS JOIN LATERAL (SELECT pg_get_expr(c.relpartbound, c.oid) AS bound) b
     WHERE i.inhparent = 'idem.processed_events'::regclass
     ORDER BY 3 NULLS LAST
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- The bounds CALL idem.prune() and idemctl prune accept (22023 otherwise).
CREATE FUNCTION idem.check_prune_args(batch_size integer, max_batches integer) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF batch_size IS NULL OR batch_size < 1 OR batch_size > 1000000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('batch_size %s is out of range (1 to 1000000)', coalesce(batch_size::text, 'NULL'));
    END IF;
    IF max_batches IS NULL OR max_batches < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('max_batches %s is out of range (1 to 2147483647)', coalesce(max_batches::text, 'NULL'));
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- The bounds CALL idem.rotate() and idemctl partitions rotate accept
-- (22023 otherwise): at most 24 months ahead (every partition is one more
-- that each claim's plan carries), and a lock wait of 1ms to 1h (0 would
-- mean no limit, and claims queue behind rotation's lock request for as
-- long as it waits). Returns the lock wait in whole milliseconds, for
-- lock_timeout.
CREATE FUNCTION idem.check_rotate_args(premake integer, lock_wait interval) RETURNS text
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF premake IS NULL OR premake < 0 OR premake > 24 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('premake %s is out of range (0 to 24 months)', coalesce(premake::text, 'NULL'));
    END IF;
    -- Compared as the number of seconds it becomes (an interval's months
    -- and years compare as 30 and 360 days, but count 365.25 in its epoch).
    IF lock_wait IS NULL OR extract(epoch FROM lock_wait) < 0.001 OR extract(epoch FROM lock_wait) > 3600 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('lock_wait %s is out of range (1ms to 1h)', coalesce(extract(epoch FROM lock_wait)::text || 's', 'NULL')),
            HINT = 'Without a bound a DDL step waits without limit, and claims queue behind it.';
    END IF;
    RETURN floor(extract(epoch FROM lock_wait) * 1000)::bigint::text;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Makes the partition of one month, and says what became of it:
--   'exists'   the month has its partition (attached with its bounds);
--   'created'  this call made and attached it;
--   'kept: ...' rows of the month are in the default partition: they stay
--              there (claims find them) until prune deletes them, and the
--              month gets no partition meanwhile (moving them would lock
--              the partition every claim reads for as long as it took).
-- A month is recognised by what it is, never by a table's name: a table
-- with the month's name that is not its partition is refused (ID007),
-- whether somebody else made it or it is a month detached by rotate
-- --keep-detached. A month more than 24 months ahead is refused (22023),
-- as rotation's premake. The attach locks the default partition while it
-- checks that it holds none of the month's rows (a read of that
-- partition; the caller's lock_timeout bounds the wait for the lock).
CREATE FUNCTION idem.make_month(month date) RETURNS text
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    SET DateStyle = 'ISO, YMD'
AS $$
DECLARE
    v_lo    date;
    v_hi    date;
    v_name  text;
    v_rel   regclass;
    v_owner oid := (SELECT n.nspowner FROM pg_namespace n WHERE n.nspname = 'idem');
BEGIN
    IF month IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.make_month: month must not be NULL';
    END IF;
    v_lo := date_trunc('month', month::timestamp)::date;
    v_hi := (v_lo::timestamp + interval '1 month')::date;
    IF v_lo > (idem.utc_month(idem.clock())::timestamp + interval '24 months')::date THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('idem.make_month: %s is more than 24 months ahead', to_char(v_lo, 'YYYY-MM'));
    END IF;
    v_name := idem.partition_name(v_lo);

    IF EXISTS (SELECT 1 FROM idem.partition_months() p
                WHERE NOT p.is_default AND p.month_from = v_lo AND p.month_to = v_hi) THEN
        RETURN 'exists';
    END IF;

    v_rel := to_regclass(format('idem.%I', v_name));
    IF v_rel IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = v_rel AND c.relowner = v_owner AND c.relkind = 'r' AND NOT c.relispartition) THEN
            RAISE EXCEPTION USING ERRCODE = 'ID007',
                MESSAGE = format('idem.make_month: %s is a detached month (kept by rotate --keep-detached), not the partition of %s', v_rel, to_char(v_lo, 'YYYY-MM')),
                HINT = 'Archive it under another name (ALTER TABLE ... RENAME) or drop it; the next rotation makes the month.';
        END IF;
        RAISE EXCEPTION USING ERRCODE = 'ID007',
            MESSAGE = format('idem.make_month: %s is not the partition of %s: idem did not make it', v_rel, to_char(v_lo, 'YYYY-MM')),
            DETAIL = format('Its owner is %s; a table of that name is never taken for the month.',
                            (SELECT c.relowner::regrole FROM pg_class c WHERE c.oid = v_rel)),
            HINT = 'Inspect it, then drop or rename it (and revoke CREATE on schema idem from everyone but its owner); the next rotation makes the month.';
    END IF;

    IF EXISTS (SELECT 1 FROM idem.processed_events_default d
                WHERE d.first_seen_month >= v_lo AND d.first_seen_month < v_hi) THEN
        RETURN 'kept: rows of this month are in the default partition; they stay there until prune deletes them';
    END IF;

    -- The month's own check lets the attach skip scanning the new table.
    EXECUTE format('CREATE TABLE idem.%I (LIKE idem.processed_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES) WITH (fillfactor = 85)', v_name);
    EXECUTE format('ALTER TABLE idem.%I ADD CONSTRAINT idem_month CHECK (first_seen_month >= %L::date AND first_seen_month < %L::date)',
                   v_name, v_lo, v_hi);
    EXECUTE format('ALTER TABLE idem.processed_events ATTACH PARTITION idem.%I FOR VALUES FROM (%L) TO (%L)',
                   v_name, v_lo, v_hi);
    RETURN 'created';
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- The month's partition (idem.make_month): its name, or NULL when the
-- month's rows are in the default partition.
CREATE OR REPLACE FUNCTION idem.create_partition(p_month date) RETURNS text
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_month IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.create_partition: month must not be NULL';
    END IF;
    IF idem.make_month(p_month) LIKE 'kept:%' THEN
        RETURN NULL;
    END IF;
    RETURN idem.partition_name(date_trunc('month', p_month::timestamp)::date);
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- The current month and the next `premake` (0 to 24) that have no
-- partition attached with their bounds.
CREATE OR REPLACE FUNCTION idem.months_to_create(premake integer)
RETURNS SETOF date
    LANGUAGE plpgsql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM idem.check_rotate_args(premake, interval '1 second');
    RETURN QUERY
    SELECT s.m FROM (
        SELECT (idem.utc_month(idem.clock())::timestamp + make_interval(months => g))::date AS m
          FROM generate_series(0, premake) g) s
     WHERE NOT EXISTS (SELECT 1 FROM idem.partition_months() p WHERE NOT p.is_default AND p.month_from = s.m)
     ORDER BY 1;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Drops a month that rotation detached: a table of idem's owner, not a
-- partition, that carried the month's partition bounds when attached (its
-- idem_month check) and not some table that merely has such a name.
CREATE OR REPLACE FUNCTION idem.drop_detached(part regclass) RETURNS text
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                    WHERE c.oid = part AND n.nspname = 'idem' AND c.relname ~ '^processed_events_p[0-9]{4}_[0-9]{2}$'
                      AND NOT c.relispartition AND c.relkind = 'r' AND c.relowner = n.nspowner) THEN
        RAISE EXCEPTION USING ERRCODE = 'ID002',
            MESSAGE = format('idem.drop_detached: %s is not a detached month of idem.processed_events', part);
    END IF;
    EXECUTE format('DROP TABLE %s', part);
    RETURN 'dropped';
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- How CALL idem.prune() and CALL idem.rotate() name themselves in the lock
-- table and idem.runs.
CREATE FUNCTION idem.sql_holder() RETURNS text
    LANGUAGE sql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
    SELECT format('sql:%s:%s', pg_backend_pid(), md5(clock_timestamp()::text))
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- For pg_cron: CALL idem.prune(); deletes expired rows in batches,
-- committing after each, until a short batch, then folds the per-backend
-- duplicate counts, and records the run in idem.runs. The same steps,
-- lease and bounds as idemctl prune; skips (with a NOTICE) when another
-- prune holds the lock. Call it outside a transaction block. It commits,
-- so it cannot pin search_path: every operator is qualified.
CREATE OR REPLACE PROCEDURE idem.prune(batch_size integer DEFAULT 5000, max_batches integer DEFAULT 10000)
    LANGUAGE plpgsql
AS $$
DECLARE
    v_holder  text;
    v_start   timestamptz := pg_catalog.clock_timestamp();
    v_got     boolean;
    v_n       bigint;
    v_total   bigint := 0;
    v_batches integer := 0;
    v_folded  bigint;
BEGIN
    PERFORM idem.check_prune_args(batch_size, max_batches);
    v_holder := idem.sql_holder();
    SELECT l.acquired INTO v_got FROM idem.try_lock('prune'::text, v_holder, NULL::interval) l;
    IF NOT v_got THEN
        PERFORM idem.record_run('prune'::text, v_start, 'skipped'::text, '{}'::jsonb, NULL::text, v_holder);
        RAISE NOTICE 'idem.prune: skipped, another prune holds the lock';
        RETURN;
    END IF;
    COMMIT;
    FOR i IN 1..max_batches LOOP
        PERFORM idem.try_lock('prune'::text, v_holder, NULL::interval);
        v_n := idem.prune_batch(v_holder, batch_size);
        v_total := v_total OPERATOR(pg_catalog.+) v_n;
        v_batches := v_batches OPERATOR(pg_catalog.+) 1;
        COMMIT;
        EXIT WHEN v_n OPERATOR(pg_catalog.<) batch_size;
    END LOOP;
    v_folded := idem.compact_duplicate_counts();
    COMMIT;
    PERFORM idem.release_lock('prune'::text, v_holder);
    PERFORM idem.record_run('prune'::text, v_start, 'ok'::text,
        pg_catalog.jsonb_build_object('deleted'::text, v_total, 'batches'::text, v_batches, 'folded'::text, v_folded), NULL::text, v_holder);
    COMMIT;
    RAISE NOTICE 'idem.prune: deleted % rows, folded % duplicate-count rows', v_total, v_folded;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- For pg_cron: CALL idem.rotate(); makes the partitions of the current
-- month and the next `premake` (idem.make_month, a transaction each), then retires past months whose rows have all expired, and
-- records the run in idem.runs. Each step waits at most lock_wait for its
-- locks; a step that times out is left for the next run. The same steps,
-- lease and bounds as idemctl partitions rotate (which also retries a
-- step). It commits, so it cannot pin search_path: every operator is
-- qualified.
CREATE OR REPLACE PROCEDURE idem.rotate(premake integer DEFAULT 3, keep_detached boolean DEFAULT false,
                             lock_wait interval DEFAULT '2 seconds')
    LANGUAGE plpgsql
AS $$
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
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- The roles that hold both the application's rights (idem.claim) and the
-- maintainer's (reading idem.processed_events: every stored result),
-- directly, by inheritance, or through a role they may SET ROLE to; and
-- through which roles. Superusers and idem's owner (and its members) are
-- not listed: they hold every right by design.
CREATE FUNCTION idem.role_conflicts()
RETURNS TABLE (role text, app_via text, maintainer_via text)
    LANGUAGE sql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
    WITH owner AS (SELECT n.nspowner AS oid FROM pg_namespace n WHERE n.nspname = 'idem')
    SELECT r.rolname::text, a.rolname::text, m.rolname::text
      FROM pg_roles r
     CROSS JOIN owner o
     CROSS JOIN LATERAL (
            SELECT x.rolname FROM pg_roles x
             WHERE pg_has_role(r.oid, x.oid, 'MEMBER')
               AND has_function_privilege(x.oid, 'idem.claim(text, text, text, interval, interval, text, interval)', 'EXECUTE')
             ORDER BY x.oid = r.oid, x.rolname LIMIT 1) a
     CROSS JOIN LATERAL (
            SELECT x.rolname FROM pg_roles x
             WHERE pg_has_role(r.oid, x.oid, 'MEMBER')
               AND has_table_privilege(x.oid, 'idem.processed_events', 'SELECT')
             ORDER BY x.oid = r.oid, x.rolname LIMIT 1) m
     WHERE NOT r.rolsuper AND NOT pg_has_role(r.oid, o.oid, 'MEMBER')
     ORDER BY 1
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Raises ID008 when granting `role` made a role that is both (see
-- idem.role_conflicts): the role itself or a member of it.
CREATE FUNCTION idem.refuse_role_conflicts(role regrole) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c record;
BEGIN
    SELECT * INTO c FROM idem.role_conflicts() x WHERE pg_has_role(x.role::name, refuse_role_conflicts.role::oid, 'MEMBER') LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'ID008',
            MESSAGE = format('refused: role %s would hold both the application''s rights (through %s) and the maintainer''s (through %s)',
                             c.role, c.app_via, c.maintainer_via),
            HINT = 'The application role must not read every stored result: use two roles, neither a member of the other.';
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.grant_app(role regrole) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM idem.grant_rights('app', role);
    PERFORM idem.refuse_role_conflicts(role);
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.grant_maintainer(role regrole) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM idem.grant_rights('maintainer', role);
    PERFORM idem.refuse_role_conflicts(role);
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- What idemctl check reports about who may do what: roles that are both,
-- CREATE on schema idem for anyone but its owner, tables named like a
-- month that are not its partition, and any other object in schema idem
-- that idem's owner does not own (it could shadow idem's functions). One row a problem, with what to do.
CREATE FUNCTION idem.audit() RETURNS TABLE (problem text, fix text)
    LANGUAGE sql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
    SELECT format('role %s holds both the application''s rights (through %s) and the maintainer''s (through %s)',
                  c.role, c.app_via, c.maintainer_via),
           format('give the application and maintenance two roles, neither a member of the other (REVOKE the maintainer''s rights from %s, or its membership)', c.role)
      FROM idem.role_conflicts() c
    UNION ALL
    SELECT format('%s may create objects in schema idem', coalesce(nullif(a.grantee, 0)::regrole::text, 'PUBLIC')),
           format('REVOKE CREATE ON SCHEMA idem FROM %s', coalesce(nullif(a.grantee, 0)::regrole::text, 'PUBLIC'))
      FROM pg_namespace n, aclexplode(n.nspacl) a
     WHERE n.nspname = 'idem' AND a.privilege_type = 'CREATE' AND a.grantee <> n.nspowner
    UNION ALL
    SELECT format('table %s (owner %s) is named like a month of idem.processed_events but is not its partition',
                  c.oid::regclass, c.relowner::regrole),
           format('inspect it, then DROP TABLE %s (rotation makes the month)', c.oid::regclass)
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE n.nspname = 'idem' AND c.relname ~ '^processed_events_p[0-9]{4}_[0-9]{2}$' AND NOT c.relispartition
       AND c.relowner <> n.nspowner
    UNION ALL
    SELECT format('%s %s in schema idem is owned by %s, not by idem''s owner', o.kind, o.name, o.owner),
           format('inspect it, then drop it: a role that may create in schema idem can shadow idem''s own functions')
      FROM (SELECT 'function' AS kind, p.oid::regprocedure::text AS name, p.proowner::regrole::text AS owner
              FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
             WHERE n.nspname = 'idem' AND p.proowner <> n.nspowner
            UNION ALL
            SELECT 'relation', c.oid::regclass::text, c.relowner::regrole::text
              FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = 'idem' AND c.relowner <> n.nspowner
               AND c.relname !~ '^processed_events_p[0-9]{4}_[0-9]{2}$'
            UNION ALL
            SELECT 'type', t.oid::regtype::text, t.typowner::regrole::text
              FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
             WHERE n.nspname = 'idem' AND t.typowner <> n.nspowner AND t.typrelid = 0 AND t.typelem = 0) o
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Refuses (42809) a legacy relation that would run code of its owner's
-- choosing as whoever reads it: the adoption reads it as idem's owner,
-- and claims read it through SECURITY DEFINER functions while it copies.
-- A view, a materialized view, a foreign or partitioned table, a table
-- with children, or one with row level security (its policies' functions
-- run as the reader) is refused: copy its rows into a plain table first.
CREATE FUNCTION idem.check_legacy(legacy regclass) RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c record;
BEGIN
    SELECT x.relkind, x.relrowsecurity, x.relhassubclass INTO c FROM pg_class x WHERE x.oid = check_legacy.legacy;
    IF NOT FOUND OR c.relkind <> 'r' OR c.relrowsecurity OR c.relhassubclass THEN
        RAISE EXCEPTION USING ERRCODE = '42809',
            MESSAGE = format('idem.adopt: %s is not a plain table (a view, a foreign or partitioned table, a table with children or with row level security runs code of its owner''s choosing as whoever reads it)', check_legacy.legacy),
            HINT = 'Copy the legacy rows into a plain table (CREATE TABLE ... AS SELECT ...) as a role you trust, and adopt that.';
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- adopt_start, version 14: the legacy relation must be a plain table
-- (idem.check_legacy).
CREATE OR REPLACE FUNCTION idem.adopt_start(source text, legacy regclass, key_column text, at_column text,
                                 result_column text DEFAULT NULL, ttl interval DEFAULT NULL) RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_id   bigint;
    v_ttl  interval;
    v_col  text;
    v_min  timestamptz;
    v_m    date;
    a      idem.adoptions;
    e      record;
BEGIN
    IF adopt_start.source IS NULL OR btrim(adopt_start.source) = '' OR octet_length(adopt_start.source) > 64 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'idem.adopt_start: source must be 1 to 64 bytes, not blank';
    END IF;
    IF adopt_start.legacy IS NULL OR adopt_start.key_column IS NULL OR adopt_start.at_column IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.adopt_start: legacy, key_column and at_column are required';
    END IF;
    PERFORM idem.check_legacy(adopt_start.legacy);
    FOREACH v_col IN ARRAY ARRAY[adopt_start.key_column, adopt_start.at_column, adopt_start.result_column] LOOP
        IF v_col IS NOT NULL AND NOT EXISTS (SELECT 1 FROM pg_attribute t WHERE t.attrelid = adopt_start.legacy
                                                AND t.attname = v_col AND t.attnum > 0 AND NOT t.attisdropped) THEN
            RAISE EXCEPTION USING ERRCODE = '42703',
                MESSAGE = format('idem.adopt_start: %s has no column %I', adopt_start.legacy, v_col);
        END IF;
    END LOOP;
    IF NOT EXISTS (SELECT 1 FROM pg_attribute t WHERE t.attrelid = adopt_start.legacy AND t.attname = adopt_start.at_column
                      AND t.atttypid IN ('timestamptz'::regtype, 'timestamp'::regtype, 'date'::regtype)) THEN
        RAISE EXCEPTION USING ERRCODE = '42804',
            MESSAGE = format('idem.adopt_start: %s.%I is not a timestamp or a date', adopt_start.legacy, adopt_start.at_column);
    END IF;
    SELECT x.id INTO v_id FROM idem.adoptions x WHERE x.source = adopt_start.source AND x.state = 'copying';
    IF FOUND THEN
        SELECT * INTO a FROM idem.adoptions x WHERE x.id = v_id;
        IF a.legacy <> adopt_start.legacy OR a.key_column <> adopt_start.key_column OR a.at_column <> adopt_start.at_column
           OR a.result_column IS DISTINCT FROM adopt_start.result_column THEN
            RAISE EXCEPTION USING ERRCODE = '55000',
                MESSAGE = format('idem.adopt_start: source %L is already adopting %s (key %I, at %I); finish it first', adopt_start.source, a.legacy, a.key_column, a.at_column);
        END IF;
        RETURN v_id; -- resumed
    END IF;
    v_ttl := coalesce(adopt_start.ttl,
                      (SELECT p.ttl FROM idem.policies p WHERE p.source IN (adopt_start.source, '*') ORDER BY p.source = '*' LIMIT 1));
    IF v_ttl IS NULL OR NOT idem.valid_ttl(v_ttl) THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('idem.adopt_start: ttl %s is out of range (1 minute to 10 years) or there is no policy', v_ttl);
    END IF;
    INSERT INTO idem.adoptions (source, legacy, key_column, at_column, result_column, ttl)
    VALUES (adopt_start.source, adopt_start.legacy, adopt_start.key_column, adopt_start.at_column, adopt_start.result_column, v_ttl)
    RETURNING * INTO a;
    -- Claims look back as far as the adopted rows' retention.
    PERFORM idem.raise_lookback(adopt_start.source, idem.days_at_most(v_ttl));
    -- The months the live legacy rows were processed in.
    SELECT * INTO e FROM idem.adopt_exprs(a);
    EXECUTE format('SELECT min(%s) FROM %s l WHERE %s > $1', e.at_expr, a.legacy, e.at_expr) INTO v_min USING idem.clock() - v_ttl;
    IF v_min IS NOT NULL THEN
        FOR v_m IN SELECT g::date FROM generate_series(idem.utc_month(v_min)::timestamp, idem.utc_month(idem.clock())::timestamp, interval '1 month') g LOOP
            PERFORM idem.create_partition(v_m);
        END LOOP;
    END IF;
    RETURN a.id;
END
$$;
-- +goose StatementEnd

REVOKE ALL ON FUNCTION idem.check_prune_args(integer, integer), idem.check_rotate_args(integer, interval),
    idem.make_month(date), idem.sql_holder(), idem.role_conflicts(), idem.refuse_role_conflicts(regrole),
    idem.audit(), idem.check_legacy(regclass) FROM PUBLIC;

INSERT INTO idem.rights (grantee, privilege, kind, object) VALUES
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.check_prune_args(integer, integer)'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.check_rotate_args(integer, interval)'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.make_month(date)'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.sql_holder()'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.audit()');

SELECT idem.regrant();

-- +goose Down
DELETE FROM idem.rights x
 WHERE x.object IN ('idem.check_prune_args(integer, integer)', 'idem.check_rotate_args(integer, interval)',
                    'idem.make_month(date)', 'idem.sql_holder()', 'idem.audit()');

-- +goose StatementBegin
-- idem.try_lock as migration 6 left it.
CREATE OR REPLACE FUNCTION idem.try_lock(name text, holder text, ttl interval)
RETURNS TABLE (acquired boolean, lock_holder text, lock_expires_at timestamptz)
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz;
    v_ttl interval := coalesce(try_lock.ttl, idem.lock_ttl(try_lock.name));
BEGIN
    IF try_lock.name IS NULL OR try_lock.holder IS NULL OR try_lock.holder = '' THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.try_lock: name and holder must not be empty';
    END IF;
    IF v_ttl IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004',
            MESSAGE = format('idem.try_lock: lock %L has no default ttl; pass one', try_lock.name);
    END IF;
    IF v_ttl <= interval '0' OR v_ttl > interval '1 day' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('idem.try_lock: ttl %s is out of range (0 to 1 day)', v_ttl);
    END IF;
    PERFORM pg_advisory_xact_lock(1768187247, hashtext(try_lock.name));
    v_now := clock_timestamp();
    RETURN QUERY
    INSERT INTO idem.maintenance_locks AS l (name, holder, acquired_at, expires_at)
    VALUES (try_lock.name, try_lock.holder, v_now, v_now + v_ttl)
    ON CONFLICT (name) DO UPDATE
       SET holder = EXCLUDED.holder,
           acquired_at = CASE WHEN l.holder = EXCLUDED.holder THEN l.acquired_at ELSE EXCLUDED.acquired_at END,
           expires_at = EXCLUDED.expires_at
     WHERE l.holder = EXCLUDED.holder OR l.expires_at <= v_now
    RETURNING true, l.holder, l.expires_at;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, l.holder, l.expires_at FROM idem.maintenance_locks l WHERE l.name = try_lock.name;
    END IF;
END
$$;

-- idem.prune_batch as migration 11 left it.
CREATE OR REPLACE FUNCTION idem.prune_batch(holder text, batch_size integer DEFAULT 5000)
RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now     timestamptz;
    v_left    integer := prune_batch.batch_size;
    v_deleted bigint := 0;
    v_n       bigint;
    v_part    regclass;
    v_citus   boolean;
BEGIN
    IF v_left IS NULL OR v_left < 1 OR v_left > 1000000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('idem.prune_batch: batch_size %s is out of range (1 to 1000000)', v_left);
    END IF;
    PERFORM pg_advisory_xact_lock(1768187247, hashtext('prune'));
    IF NOT EXISTS (SELECT 1 FROM idem.maintenance_locks l
                    WHERE l.name = 'prune' AND l.holder = prune_batch.holder AND l.expires_at > clock_timestamp()) THEN
        RAISE EXCEPTION USING ERRCODE = 'ID001',
            MESSAGE = format('idem.prune_batch: %s does not hold the prune lock', prune_batch.holder),
            HINT = 'Take it with idem.try_lock(''prune'', holder, NULL) first; it may have expired.';
    END IF;
    v_now := idem.clock();
    v_citus := idem.distributed();
    FOR v_part IN SELECT p.partition FROM idem.partition_months() p LOOP
        IF v_citus THEN
            -- (version 11) Citus plans neither ctid lists nor FOR UPDATE on
            -- a distributed table: the batch is addressed by primary key,
            -- and the outer DELETE checks the conditions again, so a row a
            -- claim replaced meanwhile (same key and month) is kept.
            EXECUTE format(
                'DELETE FROM %1$s d
                  WHERE (d.source, d.key, d.first_seen_month) IN (
                         SELECT x.source, x.key, x.first_seen_month FROM %1$s x
                          WHERE x.expires_at < $1
                            AND (x.status <> ''processing'' OR x.lease_expires_at IS NULL OR x.lease_expires_at < $1)
                          LIMIT $2)
                    AND d.expires_at < $1
                    AND (d.status <> ''processing'' OR d.lease_expires_at IS NULL OR d.lease_expires_at < $1)
                    AND NOT EXISTS (SELECT 1 FROM idem.holds h
                                     WHERE h.source = d.source AND h.key = d.key AND h.state = ''queued'')', v_part)
                USING v_now, v_left;
        ELSE
            EXECUTE format(
                'DELETE FROM %1$s d WHERE d.ctid = ANY (ARRAY(
                     SELECT x.ctid FROM %1$s x
                      WHERE x.expires_at < $1
                        AND (x.status <> ''processing'' OR x.lease_expires_at IS NULL OR x.lease_expires_at < $1)
                        AND NOT EXISTS (SELECT 1 FROM idem.holds h
                                         WHERE h.source = x.source AND h.key = x.key AND h.state = ''queued'')
                      LIMIT $2
                      FOR UPDATE SKIP LOCKED))', v_part)
                USING v_now, v_left;
        END IF;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_deleted := v_deleted + v_n;
        v_left := v_left - v_n;
        EXIT WHEN v_left <= 0;
    END LOOP;
    RETURN v_deleted;
END
$$;

-- idem.partition_months as migration 6 left it.
CREATE OR REPLACE FUNCTION idem.partition_months()
RETURNS TABLE (partition regclass, is_default boolean, month_from date, month_to date)
    LANGUAGE sql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
    SELECT c.oid::regclass,
           b.bound = 'DEFAULT',
           (regexp_match(b.bound, 'FROM \(''([0-9-]+)''\)'))[1]::date,
           (regexp_match(b.bound, 'TO \(''([0-9-]+)''\)'))[1]::date
      FROM pg_inherits i
      JOIN pg_class c ON c.oid = i.inhrelid
     CROSS JOIN LATERAL (SELECT pg_get_expr(c.relpartbound, c.oid) AS bound) b
     WHERE i.inhparent = 'idem.processed_events'::regclass
     ORDER BY 3 NULLS LAST
$$;

-- idem.create_partition as migration 4 left it.
CREATE OR REPLACE FUNCTION idem.create_partition(p_month date) RETURNS text
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_lo   date := date_trunc('month', p_month::timestamp)::date;
    v_hi   date := (date_trunc('month', p_month::timestamp) + interval '1 month')::date;
    v_name text := idem.partition_name(v_lo);
BEGIN
    IF p_month IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.create_partition: month must not be NULL';
    END IF;
    IF to_regclass(format('idem.%I', v_name)) IS NOT NULL THEN
        RETURN v_name;
    END IF;
    EXECUTE format('CREATE TABLE idem.%I (LIKE idem.processed_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES) WITH (fillfactor = 85)', v_name);
    LOCK TABLE idem.processed_events_default IN ACCESS EXCLUSIVE MODE;
    EXECUTE format('WITH moved AS (DELETE FROM idem.processed_events_default d
                                    WHERE d.first_seen_month >= $1 AND d.first_seen_month < $2
                                    RETURNING d.*)
                    INSERT INTO idem.%I SELECT * FROM moved', v_name)
        USING v_lo, v_hi;
    EXECUTE format('ALTER TABLE idem.processed_events ATTACH PARTITION idem.%I FOR VALUES FROM (%L) TO (%L)',
                   v_name, v_lo, v_hi);
    RETURN v_name;
END
$$;

-- idem.months_to_create as migration 11 left it.
CREATE OR REPLACE FUNCTION idem.months_to_create(premake integer)
RETURNS SETOF date
    LANGUAGE plpgsql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_default date[];
BEGIN
    SELECT array_agg(DISTINCT d.first_seen_month) INTO v_default FROM idem.processed_events_default d;
    RETURN QUERY
    SELECT m::date FROM (
        SELECT unnest(coalesce(v_default, '{}')) AS m
        UNION
        SELECT (idem.utc_month(idem.clock())::timestamp + make_interval(months => g))::date
          FROM generate_series(0, greatest(months_to_create.premake, 0)) g
    ) s
    WHERE to_regclass('idem.' || quote_ident(idem.partition_name(m::date))) IS NULL
    ORDER BY 1;
END
$$;

-- idem.drop_detached as migration 6 left it.
CREATE OR REPLACE FUNCTION idem.drop_detached(part regclass) RETURNS text
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                    WHERE c.oid = part AND n.nspname = 'idem' AND c.relname ~ '^processed_events_p[0-9]{4}_[0-9]{2}$'
                      AND NOT c.relispartition) THEN
        RAISE EXCEPTION USING ERRCODE = 'ID002',
            MESSAGE = format('idem.drop_detached: %s is not a detached month of idem.processed_events', part);
    END IF;
    EXECUTE format('DROP TABLE %s', part);
    RETURN 'dropped';
END
$$;

-- idem.prune as migration 10 left it.
CREATE OR REPLACE PROCEDURE idem.prune(batch_size integer DEFAULT 5000, max_batches integer DEFAULT 10000)
    LANGUAGE plpgsql
AS $$
DECLARE
    v_holder  text := 'sql:' || pg_catalog.pg_backend_pid() || ':' || pg_catalog.md5(pg_catalog.clock_timestamp()::text);
    v_start   timestamptz := pg_catalog.clock_timestamp();
    v_got     boolean;
    v_n       bigint;
    v_total   bigint := 0;
    v_batches integer := 0;
    v_folded  bigint;
BEGIN
    SELECT acquired INTO v_got FROM idem.try_lock('prune', v_holder, NULL);
    IF NOT v_got THEN
        PERFORM idem.record_run('prune', v_start, 'skipped', '{}', NULL, v_holder);
        RAISE NOTICE 'idem.prune: skipped, another prune holds the lock';
        RETURN;
    END IF;
    COMMIT;
    FOR i IN 1..max_batches LOOP
        PERFORM idem.try_lock('prune', v_holder, NULL);
        v_n := idem.prune_batch(v_holder, batch_size);
        v_total := v_total + v_n;
        v_batches := v_batches + 1;
        COMMIT;
        EXIT WHEN v_n < batch_size;
    END LOOP;
    v_folded := idem.compact_duplicate_counts();
    COMMIT;
    PERFORM idem.release_lock('prune', v_holder);
    PERFORM idem.record_run('prune', v_start, 'ok',
        pg_catalog.jsonb_build_object('deleted', v_total, 'batches', v_batches, 'folded', v_folded), NULL, v_holder);
    COMMIT;
    RAISE NOTICE 'idem.prune: deleted % rows, folded % duplicate-count rows', v_total, v_folded;
END
$$;

-- idem.rotate as migration 10 left it.
CREATE OR REPLACE PROCEDURE idem.rotate(premake integer DEFAULT 3, keep_detached boolean DEFAULT false,
                             lock_wait interval DEFAULT '2 seconds')
    LANGUAGE plpgsql
AS $$
DECLARE
    v_holder text := 'sql:' || pg_catalog.pg_backend_pid() || ':' || pg_catalog.md5(pg_catalog.clock_timestamp()::text);
    v_got    boolean;
    v_month  date;
    v_part   regclass;
    v_res    text;
    v_start  timestamptz := pg_catalog.clock_timestamp();
    v_made   integer := 0;
    v_gone   integer := 0;
    v_kept   integer := 0;
    v_gaveup integer := 0;
BEGIN
    SELECT acquired INTO v_got FROM idem.try_lock('rotate', v_holder, NULL);
    IF NOT v_got THEN
        PERFORM idem.record_run('rotate', v_start, 'skipped', '{}', NULL, v_holder);
        RAISE NOTICE 'idem.rotate: skipped, another rotation holds the lock';
        RETURN;
    END IF;
    COMMIT;
    FOR v_month IN SELECT * FROM idem.months_to_create(premake) LOOP
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout', pg_catalog.floor(extract(epoch FROM lock_wait) * 1000)::text, true);
            PERFORM idem.create_partition(v_month);
            v_made := v_made + 1;
            RAISE NOTICE 'idem.rotate: created partition for %', v_month;
        EXCEPTION WHEN lock_not_available THEN
            v_gaveup := v_gaveup + 1;
            RAISE NOTICE 'idem.rotate: could not lock for %, left for the next run', v_month;
        END;
        COMMIT;
    END LOOP;
    FOR v_part IN SELECT * FROM idem.partitions_to_retire() LOOP
        v_res := NULL; -- a lock timeout must not leave the previous partition's result behind
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout', pg_catalog.floor(extract(epoch FROM lock_wait) * 1000)::text, true);
            v_res := idem.retire_partition(v_part, true);
            RAISE NOTICE 'idem.rotate: %: %', v_part, v_res;
        EXCEPTION WHEN lock_not_available THEN
            v_gaveup := v_gaveup + 1;
            RAISE NOTICE 'idem.rotate: could not lock %, left for the next run', v_part;
        END;
        COMMIT;
        IF v_res IN ('detached', 'dropped') THEN
            v_gone := v_gone + 1;
        ELSIF v_res IS NOT NULL THEN
            v_kept := v_kept + 1;
        END IF;
        IF v_res = 'detached' AND NOT keep_detached THEN
            PERFORM idem.drop_detached(v_part);
            COMMIT;
        END IF;
    END LOOP;
    PERFORM idem.release_lock('rotate', v_holder);
    PERFORM idem.record_run('rotate', v_start, CASE WHEN v_gaveup > 0 THEN 'incomplete' ELSE 'ok' END,
        pg_catalog.jsonb_build_object('created', v_made, 'retired', v_gone, 'kept', v_kept, 'gave_up', v_gaveup), NULL, v_holder);
    COMMIT;
END
$$;

-- idem.grant_app as migration 12 left it.
CREATE OR REPLACE FUNCTION idem.grant_app(role regrole) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM idem.grant_rights('app', role);
END
$$;

-- idem.grant_maintainer as migration 12 left it.
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
-- idem.adopt_start as migration 9 left it.
CREATE OR REPLACE FUNCTION idem.adopt_start(source text, legacy regclass, key_column text, at_column text,
                                 result_column text DEFAULT NULL, ttl interval DEFAULT NULL) RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_id   bigint;
    v_ttl  interval;
    v_col  text;
    v_min  timestamptz;
    v_m    date;
    a      idem.adoptions;
    e      record;
BEGIN
    IF adopt_start.source IS NULL OR btrim(adopt_start.source) = '' OR octet_length(adopt_start.source) > 64 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'idem.adopt_start: source must be 1 to 64 bytes, not blank';
    END IF;
    IF adopt_start.legacy IS NULL OR adopt_start.key_column IS NULL OR adopt_start.at_column IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.adopt_start: legacy, key_column and at_column are required';
    END IF;
    FOREACH v_col IN ARRAY ARRAY[adopt_start.key_column, adopt_start.at_column, adopt_start.result_column] LOOP
        IF v_col IS NOT NULL AND NOT EXISTS (SELECT 1 FROM pg_attribute t WHERE t.attrelid = adopt_start.legacy
                                                AND t.attname = v_col AND t.attnum > 0 AND NOT t.attisdropped) THEN
            RAISE EXCEPTION USING ERRCODE = '42703',
                MESSAGE = format('idem.adopt_start: %s has no column %I', adopt_start.legacy, v_col);
        END IF;
    END LOOP;
    IF NOT EXISTS (SELECT 1 FROM pg_attribute t WHERE t.attrelid = adopt_start.legacy AND t.attname = adopt_start.at_column
                      AND t.atttypid IN ('timestamptz'::regtype, 'timestamp'::regtype, 'date'::regtype)) THEN
        RAISE EXCEPTION USING ERRCODE = '42804',
            MESSAGE = format('idem.adopt_start: %s.%I is not a timestamp or a date', adopt_start.legacy, adopt_start.at_column);
    END IF;
    SELECT x.id INTO v_id FROM idem.adoptions x WHERE x.source = adopt_start.source AND x.state = 'copying';
    IF FOUND THEN
        SELECT * INTO a FROM idem.adoptions x WHERE x.id = v_id;
        IF a.legacy <> adopt_start.legacy OR a.key_column <> adopt_start.key_column OR a.at_column <> adopt_start.at_column
           OR a.result_column IS DISTINCT FROM adopt_start.result_column THEN
            RAISE EXCEPTION USING ERRCODE = '55000',
                MESSAGE = format('idem.adopt_start: source %L is already adopting %s (key %I, at %I); finish it first', adopt_start.source, a.legacy, a.key_column, a.at_column);
        END IF;
        RETURN v_id; -- resumed
    END IF;
    v_ttl := coalesce(adopt_start.ttl,
                      (SELECT p.ttl FROM idem.policies p WHERE p.source IN (adopt_start.source, '*') ORDER BY p.source = '*' LIMIT 1));
    IF v_ttl IS NULL OR NOT idem.valid_ttl(v_ttl) THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('idem.adopt_start: ttl %s is out of range (1 minute to 10 years) or there is no policy', v_ttl);
    END IF;
    INSERT INTO idem.adoptions (source, legacy, key_column, at_column, result_column, ttl)
    VALUES (adopt_start.source, adopt_start.legacy, adopt_start.key_column, adopt_start.at_column, adopt_start.result_column, v_ttl)
    RETURNING * INTO a;
    -- Claims look back as far as the adopted rows' retention.
    PERFORM idem.raise_lookback(adopt_start.source, idem.days_at_most(v_ttl));
    -- The months the live legacy rows were processed in.
    SELECT * INTO e FROM idem.adopt_exprs(a);
    EXECUTE format('SELECT min(%s) FROM %s l WHERE %s > $1', e.at_expr, a.legacy, e.at_expr) INTO v_min USING idem.clock() - v_ttl;
    IF v_min IS NOT NULL THEN
        FOR v_m IN SELECT g::date FROM generate_series(idem.utc_month(v_min)::timestamp, idem.utc_month(idem.clock())::timestamp, interval '1 month') g LOOP
            PERFORM idem.create_partition(v_m);
        END LOOP;
    END IF;
    RETURN a.id;
END
$$;
-- +goose StatementEnd

DROP FUNCTION idem.check_legacy(regclass);
DROP FUNCTION idem.audit();
DROP FUNCTION idem.refuse_role_conflicts(regrole);
DROP FUNCTION idem.role_conflicts();
DROP FUNCTION idem.sql_holder();
DROP FUNCTION idem.make_month(date);
DROP FUNCTION idem.check_rotate_args(integer, interval);
DROP FUNCTION idem.check_prune_args(integer, integer);
