-- idem 6: one maintenance implementation, idem's own SQLSTATEs.
--
-- * The maintenance loops live in SQL step functions that both idemctl (Go:
--   pacing, retries, progress, metrics, logs) and the pg_cron procedures
--   (CALL idem.prune(); CALL idem.rotate();) drive, with the same defaults:
--   - idem.try_lock(name, holder, NULL) takes the lock's default lease,
--     idem.lock_ttl(name): 'prune' 30 seconds (renewed before every batch),
--     'rotate' 10 minutes.
--   - idem.partitions_to_retire(): the months rotation tries to retire.
--   - prune ends by folding idem.duplicate_counts' per-backend rows into one
--     row per source (idem.compact_duplicate_counts(), version 5), so that
--     table no longer grows by a row per (source, backend) ever seen.
-- * idem's own conditions get SQLSTATEs of class ID that PostgreSQL never
--   raises: ID001 "does not hold the maintenance lock" (was 55P03, which
--   PostgreSQL raises for lock_timeout, so a prune batch that timed out
--   behind rotation read as a lost lock), ID002 "not a partition of
--   idem.processed_events" (was 42P01, undefined_table).
-- * idem.partitions() estimates rows of a partition never analyzed by
--   counting them (its reltuples is -1 until the first ANALYZE, which read
--   as 0 rows).
--
-- Down restores version 5's functions and procedures.

-- +goose Up
-- +goose StatementBegin
-- The lease a maintenance lock gets when try_lock is given no ttl.
CREATE FUNCTION idem.lock_ttl(name text) RETURNS interval
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
SELECT CASE name WHEN 'prune' THEN interval '30 seconds' WHEN 'rotate' THEN interval '10 minutes' END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.lock_ttl(text) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- Takes the lock `name` for `holder`, or renews it if `holder` has it, for
-- ttl (NULL: idem.lock_ttl(name)). Returns acquired = false and the
-- current holder when someone else has it.
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
-- +goose StatementEnd

-- +goose StatementBegin
-- The partitions of processed_events and their month ranges, read from the
-- catalog only (the default partition has NULL bounds): what prune and
-- rotation walk, what idem.partitions() describes, and what idemctl's
-- check and /metrics read (without idem.partitions()' row counts).
CREATE FUNCTION idem.partition_months()
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
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.partition_months() FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- The partitions of processed_events with their month ranges and sizes.
-- est_rows is the planner's estimate, or an exact count for a partition
-- not analyzed yet (its reltuples is -1 until the first ANALYZE).
CREATE OR REPLACE FUNCTION idem.partitions()
RETURNS TABLE (partition regclass, is_default boolean, month_from date, month_to date,
               est_rows bigint, total_bytes bigint)
    LANGUAGE sql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
    SELECT m.partition, m.is_default, m.month_from, m.month_to,
           CASE WHEN c.reltuples >= 0 THEN c.reltuples::bigint
                -- count(*) from a SQL function: query_to_xml runs a query
                -- built at run time (the partition's name is a regclass,
                -- quoted by its output function).
                ELSE ((xpath('/row/n/text()',
                             query_to_xml(format('SELECT count(*) AS n FROM %s', m.partition), false, true, '')))[1]::text)::bigint
           END,
           pg_total_relation_size(m.partition)
      FROM idem.partition_months() m
      JOIN pg_class c ON c.oid = m.partition
     ORDER BY m.month_from NULLS LAST
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- The past months rotation tries to retire, oldest first (their month is
-- over by the database's clock, in UTC). Whether one can go is for
-- idem.retire_partition to say.
CREATE FUNCTION idem.partitions_to_retire() RETURNS SETOF regclass
    LANGUAGE sql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
    SELECT p.partition FROM idem.partition_months() p
     WHERE NOT p.is_default AND p.month_to <= idem.utc_month(idem.clock())
     ORDER BY p.month_from
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.partitions_to_retire() FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- Deletes up to batch_size expired rows and returns how many it deleted.
-- A row is deleted only when its retention has passed and it is not under
-- a live lease. Rows locked by a claim are skipped, never waited for. The
-- caller must hold the maintenance lock 'prune' as holder (SQLSTATE ID001
-- otherwise). Rows are addressed by ctid within each partition (a ctid is
-- not unique across partitions).
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
    FOR v_part IN SELECT p.partition FROM idem.partition_months() p LOOP
        EXECUTE format(
            'DELETE FROM %1$s d WHERE d.ctid = ANY (ARRAY(
                 SELECT x.ctid FROM %1$s x
                  WHERE x.expires_at < $1
                    AND (x.status <> ''processing'' OR x.lease_expires_at IS NULL OR x.lease_expires_at < $1)
                  LIMIT $2
                  FOR UPDATE SKIP LOCKED))', v_part)
            USING v_now, v_left;
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
CREATE OR REPLACE FUNCTION idem.retire_partition(part regclass, keep_detached boolean DEFAULT false)
RETURNS text
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    p      record;
    v_now  timestamptz := idem.clock();
    v_live boolean;
BEGIN
    SELECT * INTO p FROM idem.partition_months() x WHERE x.partition = retire_partition.part;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'ID002',
            MESSAGE = format('idem.retire_partition: %s is not a partition of idem.processed_events', part);
    END IF;
    IF p.is_default THEN
        RETURN 'kept: the default partition is never retired';
    END IF;
    IF p.month_to > idem.utc_month(v_now) THEN
        RETURN 'kept: the month is not over';
    END IF;
    -- A row is live while expires_at has not passed; a leased row always
    -- has expires_at >= lease_expires_at (claim and extend keep it so), so
    -- one probe of the expires_at index answers. Asked once before locking
    -- (no lock for a month that is not ready) and again under the lock.
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s x WHERE x.expires_at >= $1)', part) INTO v_live USING v_now;
    IF v_live THEN
        RETURN 'kept: it still has live rows';
    END IF;
    LOCK TABLE ONLY idem.processed_events IN ACCESS EXCLUSIVE MODE;
    EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', part);
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s x WHERE x.expires_at >= $1)', part) INTO v_live USING v_now;
    IF v_live THEN
        RETURN 'kept: it still has live rows';
    END IF;
    IF keep_detached THEN
        EXECUTE format('ALTER TABLE idem.processed_events DETACH PARTITION %s', part);
        RETURN 'detached';
    END IF;
    EXECUTE format('DROP TABLE %s', part);
    RETURN 'dropped';
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
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
-- +goose StatementEnd

-- +goose StatementBegin
-- For pg_cron: CALL idem.prune(); deletes expired rows in batches,
-- committing after each, until a short batch, then folds the per-backend
-- duplicate counts. The same steps, lease and defaults as idemctl prune.
-- Skips (with a NOTICE) when another prune holds the lock. Call it outside
-- a transaction block.
CREATE OR REPLACE PROCEDURE idem.prune(batch_size integer DEFAULT 5000, max_batches integer DEFAULT 10000)
    LANGUAGE plpgsql
AS $$
DECLARE
    v_holder  text := 'sql:' || pg_catalog.pg_backend_pid() || ':' || pg_catalog.md5(pg_catalog.clock_timestamp()::text);
    v_got     boolean;
    v_n       bigint;
    v_total   bigint := 0;
    v_folded  bigint;
BEGIN
    SELECT acquired INTO v_got FROM idem.try_lock('prune', v_holder, NULL);
    IF NOT v_got THEN
        RAISE NOTICE 'idem.prune: skipped, another prune holds the lock';
        RETURN;
    END IF;
    COMMIT;
    FOR i IN 1..max_batches LOOP
        PERFORM idem.try_lock('prune', v_holder, NULL);
        v_n := idem.prune_batch(v_holder, batch_size);
        v_total := v_total + v_n;
        COMMIT;
        EXIT WHEN v_n < batch_size;
    END LOOP;
    v_folded := idem.compact_duplicate_counts();
    COMMIT;
    PERFORM idem.release_lock('prune', v_holder);
    COMMIT;
    RAISE NOTICE 'idem.prune: deleted % rows, folded % duplicate-count rows', v_total, v_folded;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- For pg_cron: CALL idem.rotate(); makes the partitions for the next
-- `premake` months (and for months that have rows in the default
-- partition), then retires past months whose rows have all expired. Each
-- step commits on its own and waits at most lock_wait for its locks; a step
-- that times out is left for the next run. The same steps, lease and
-- defaults as idemctl partitions rotate (which also retries a step).
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
BEGIN
    SELECT acquired INTO v_got FROM idem.try_lock('rotate', v_holder, NULL);
    IF NOT v_got THEN
        RAISE NOTICE 'idem.rotate: skipped, another rotation holds the lock';
        RETURN;
    END IF;
    COMMIT;
    FOR v_month IN SELECT * FROM idem.months_to_create(premake) LOOP
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout', pg_catalog.floor(extract(epoch FROM lock_wait) * 1000)::text, true);
            PERFORM idem.create_partition(v_month);
            RAISE NOTICE 'idem.rotate: created partition for %', v_month;
        EXCEPTION WHEN lock_not_available THEN
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
            RAISE NOTICE 'idem.rotate: could not lock %, left for the next run', v_part;
        END;
        COMMIT;
        IF v_res = 'detached' AND NOT keep_detached THEN
            PERFORM idem.drop_detached(v_part);
            COMMIT;
        END IF;
    END LOOP;
    PERFORM idem.release_lock('rotate', v_holder);
    COMMIT;
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
        idem.lookbacks, idem.duplicate_counts TO %s', role);
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Maintainers granted before version 6 get what version 6 adds.
DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT a.grantee::regrole::text AS role
               FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
              WHERE p.oid = 'idem.prunable_rows()'::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION idem.partition_months(), idem.partitions_to_retire() TO %s', r.role);
    END LOOP;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- Version 5's functions and procedures (same signatures: grants are kept).
-- +goose StatementBegin
-- Takes the lock `name` for `holder`, or renews it if `holder` has it.
-- Returns acquired = false and the current holder when someone else has it.
CREATE OR REPLACE FUNCTION idem.try_lock(name text, holder text, ttl interval)
RETURNS TABLE (acquired boolean, lock_holder text, lock_expires_at timestamptz)
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz;
BEGIN
    IF try_lock.name IS NULL OR try_lock.holder IS NULL OR try_lock.holder = '' THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.try_lock: name and holder must not be empty';
    END IF;
    IF try_lock.ttl IS NULL OR try_lock.ttl <= interval '0' OR try_lock.ttl > interval '1 day' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('idem.try_lock: ttl %s is out of range (0 to 1 day)', try_lock.ttl);
    END IF;
    PERFORM pg_advisory_xact_lock(1768187247, hashtext(try_lock.name));
    v_now := clock_timestamp();
    RETURN QUERY
    INSERT INTO idem.maintenance_locks AS l (name, holder, acquired_at, expires_at)
    VALUES (try_lock.name, try_lock.holder, v_now, v_now + try_lock.ttl)
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
-- The partitions of processed_events with their month ranges. The default
-- partition has NULL bounds.
CREATE OR REPLACE FUNCTION idem.partitions()
RETURNS TABLE (partition regclass, is_default boolean, month_from date, month_to date,
               est_rows bigint, total_bytes bigint)
    LANGUAGE sql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
    SELECT c.oid::regclass,
           b.bound = 'DEFAULT',
           (regexp_match(b.bound, 'FROM \(''([0-9-]+)''\)'))[1]::date,
           (regexp_match(b.bound, 'TO \(''([0-9-]+)''\)'))[1]::date,
           greatest(c.reltuples, 0)::bigint,
           pg_total_relation_size(c.oid)
      FROM pg_inherits i
      JOIN pg_class c ON c.oid = i.inhrelid
     CROSS JOIN LATERAL (SELECT pg_get_expr(c.relpartbound, c.oid) AS bound) b
     WHERE i.inhparent = 'idem.processed_events'::regclass
     ORDER BY 3 NULLS LAST
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Deletes up to batch_size expired rows and returns how many it deleted.
-- A row is deleted only when its retention has passed and it is not under
-- a live lease. Rows locked by a claim are skipped, never waited for. The
-- caller must hold the maintenance lock 'prune' as holder (SQLSTATE 55P03
-- otherwise). Rows are addressed by ctid within each partition (a ctid is
-- not unique across partitions).
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
BEGIN
    IF v_left IS NULL OR v_left < 1 OR v_left > 1000000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('idem.prune_batch: batch_size %s is out of range (1 to 1000000)', v_left);
    END IF;
    PERFORM pg_advisory_xact_lock(1768187247, hashtext('prune'));
    IF NOT EXISTS (SELECT 1 FROM idem.maintenance_locks l
                    WHERE l.name = 'prune' AND l.holder = prune_batch.holder AND l.expires_at > clock_timestamp()) THEN
        RAISE EXCEPTION USING ERRCODE = '55P03',
            MESSAGE = format('idem.prune_batch: %s does not hold the prune lock', prune_batch.holder),
            HINT = 'Take it with idem.try_lock(''prune'', holder, ttl) first; it may have expired.';
    END IF;
    v_now := idem.clock();
    FOR v_part IN SELECT p.partition FROM idem.partitions() p LOOP
        EXECUTE format(
            'DELETE FROM %1$s d WHERE d.ctid = ANY (ARRAY(
                 SELECT x.ctid FROM %1$s x
                  WHERE x.expires_at < $1
                    AND (x.status <> ''processing'' OR x.lease_expires_at IS NULL OR x.lease_expires_at < $1)
                  LIMIT $2
                  FOR UPDATE SKIP LOCKED))', v_part)
            USING v_now, v_left;
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
-- Drops a table that retire_partition(..., keep_detached => true) detached
-- (a table of schema idem named like a month's partition that is no longer
-- attached). Rotation retires a month in two transactions, DETACH then
-- this, so that the lock on processed_events is held only for the detach.
CREATE OR REPLACE FUNCTION idem.drop_detached(part regclass) RETURNS text
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                    WHERE c.oid = part AND n.nspname = 'idem' AND c.relname ~ '^processed_events_p[0-9]{4}_[0-9]{2}$'
                      AND NOT c.relispartition) THEN
        RAISE EXCEPTION USING ERRCODE = '42P01',
            MESSAGE = format('idem.drop_detached: %s is not a detached month of idem.processed_events', part);
    END IF;
    EXECUTE format('DROP TABLE %s', part);
    RETURN 'dropped';
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- For pg_cron: CALL idem.prune(); deletes expired rows in batches,
-- committing after each, until a short batch. Skips (with a NOTICE) when
-- another prune holds the lock. Call it outside a transaction block.
CREATE OR REPLACE PROCEDURE idem.prune(batch_size integer DEFAULT 5000, max_batches integer DEFAULT 10000)
    LANGUAGE plpgsql
AS $$
DECLARE
    v_holder  text := 'sql:' || pg_catalog.pg_backend_pid() || ':' || pg_catalog.md5(pg_catalog.clock_timestamp()::text);
    v_got     boolean;
    v_n       bigint;
    v_total   bigint := 0;
BEGIN
    SELECT acquired INTO v_got FROM idem.try_lock('prune', v_holder, interval '5 minutes');
    IF NOT v_got THEN
        RAISE NOTICE 'idem.prune: skipped, another prune holds the lock';
        RETURN;
    END IF;
    COMMIT;
    FOR i IN 1..max_batches LOOP
        PERFORM idem.try_lock('prune', v_holder, interval '5 minutes');
        v_n := idem.prune_batch(v_holder, batch_size);
        v_total := v_total + v_n;
        COMMIT;
        EXIT WHEN v_n < batch_size;
    END LOOP;
    PERFORM idem.release_lock('prune', v_holder);
    COMMIT;
    RAISE NOTICE 'idem.prune: deleted % rows', v_total;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.retire_partition(part regclass, keep_detached boolean DEFAULT false)
RETURNS text
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    p      record;
    v_now  timestamptz := idem.clock();
    v_live boolean;
BEGIN
    SELECT * INTO p FROM idem.partitions() x WHERE x.partition = retire_partition.part;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = '42P01',
            MESSAGE = format('idem.retire_partition: %s is not a partition of idem.processed_events', part);
    END IF;
    IF p.is_default THEN
        RETURN 'kept: the default partition is never retired';
    END IF;
    IF p.month_to > idem.utc_month(v_now) THEN
        RETURN 'kept: the month is not over';
    END IF;
    -- A row is live while expires_at has not passed; a leased row always
    -- has expires_at >= lease_expires_at (claim and extend keep it so), so
    -- one probe of the expires_at index answers. Asked once before locking
    -- (no lock for a month that is not ready) and again under the lock.
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s x WHERE x.expires_at >= $1)', part) INTO v_live USING v_now;
    IF v_live THEN
        RETURN 'kept: it still has live rows';
    END IF;
    LOCK TABLE ONLY idem.processed_events IN ACCESS EXCLUSIVE MODE;
    EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', part);
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s x WHERE x.expires_at >= $1)', part) INTO v_live USING v_now;
    IF v_live THEN
        RETURN 'kept: it still has live rows';
    END IF;
    IF keep_detached THEN
        EXECUTE format('ALTER TABLE idem.processed_events DETACH PARTITION %s', part);
        RETURN 'detached';
    END IF;
    EXECUTE format('DROP TABLE %s', part);
    RETURN 'dropped';
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
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
BEGIN
    SELECT acquired INTO v_got FROM idem.try_lock('rotate', v_holder, interval '10 minutes');
    IF NOT v_got THEN
        RAISE NOTICE 'idem.rotate: skipped, another rotation holds the lock';
        RETURN;
    END IF;
    COMMIT;
    FOR v_month IN SELECT * FROM idem.months_to_create(premake) LOOP
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout', pg_catalog.floor(extract(epoch FROM lock_wait) * 1000)::text, true);
            PERFORM idem.create_partition(v_month);
            RAISE NOTICE 'idem.rotate: created partition for %', v_month;
        EXCEPTION WHEN lock_not_available THEN
            RAISE NOTICE 'idem.rotate: could not lock for %, left for the next run', v_month;
        END;
        COMMIT;
    END LOOP;
    FOR v_part IN SELECT p.partition FROM idem.partitions() p
                   WHERE NOT p.is_default AND p.month_to <= idem.utc_month(idem.clock()) LOOP
        v_res := NULL; -- a lock timeout must not leave the previous partition's result behind
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout', pg_catalog.floor(extract(epoch FROM lock_wait) * 1000)::text, true);
            v_res := idem.retire_partition(v_part, true);
            RAISE NOTICE 'idem.rotate: %: %', v_part, v_res;
        EXCEPTION WHEN lock_not_available THEN
            RAISE NOTICE 'idem.rotate: could not lock %, left for the next run', v_part;
        END;
        COMMIT;
        IF v_res = 'detached' AND NOT keep_detached THEN
            PERFORM idem.drop_detached(v_part);
            COMMIT;
        END IF;
    END LOOP;
    PERFORM idem.release_lock('rotate', v_holder);
    COMMIT;
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
        idem.compact_duplicate_counts() TO %s', role);
    EXECUTE format('GRANT EXECUTE ON PROCEDURE idem.prune(integer, integer), idem.rotate(integer, boolean, interval) TO %s', role);
    -- Reading for stats and check; no writes.
    EXECUTE format('GRANT SELECT ON idem.processed_events, idem.processed_events_default, idem.policies, idem.maintenance_locks,
        idem.lookbacks, idem.duplicate_counts TO %s', role);
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.partitions_to_retire();
DROP FUNCTION IF EXISTS idem.partition_months();
DROP FUNCTION IF EXISTS idem.lock_ttl(text);
-- +goose StatementEnd
