-- idem maintenance: PgBouncer-safe maintenance locks, batched prune and
-- partition rotation, callable from idemctl (which adds retries, pacing and
-- progress) and from SQL (pg_cron: CALL idem.prune(); CALL idem.rotate();).
--
-- The functions are SECURITY DEFINER with a pinned search_path: they run as
-- idem's owner, so a maintainer role needs EXECUTE on them and nothing on
-- the tables (idem.grant_maintainer). The two procedures cannot pin
-- search_path (a procedure with a SET clause cannot COMMIT), so they run as
-- their caller, qualify every object, and only call the functions above.

-- +goose Up
-- +goose StatementBegin
-- A maintenance lock is a lease in a table, not a session advisory lock: a
-- session lock left on a pooled PgBouncer backend would block every later
-- run, while a lease ends by itself when its holder dies. Changes to a lease
-- are serialized by a transaction-scoped advisory lock (the gate).
CREATE TABLE idem.maintenance_locks (
    name        text PRIMARY KEY,
    holder      text        NOT NULL,
    acquired_at timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL
);
-- +goose StatementEnd

-- +goose StatementBegin
-- Takes the lock `name` for `holder`, or renews it if `holder` has it.
-- Returns acquired = false and the current holder when someone else has it.
CREATE FUNCTION idem.try_lock(name text, holder text, ttl interval)
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
CREATE FUNCTION idem.release_lock(name text, holder text) RETURNS boolean
    LANGUAGE sql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
    WITH d AS (DELETE FROM idem.maintenance_locks l
                WHERE l.name = release_lock.name AND l.holder = release_lock.holder
               RETURNING 1)
    SELECT count(*) > 0 FROM d
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- The partitions of processed_events with their month ranges. The default
-- partition has NULL bounds.
CREATE FUNCTION idem.partitions()
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
CREATE FUNCTION idem.prune_batch(holder text, batch_size integer DEFAULT 5000)
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
-- How many rows prune would delete now (for --dry-run and check).
CREATE FUNCTION idem.prunable_rows() RETURNS bigint
    LANGUAGE sql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
    SELECT count(*) FROM idem.processed_events x
     WHERE x.expires_at < idem.clock()
       AND (x.status <> 'processing' OR x.lease_expires_at IS NULL OR x.lease_expires_at < idem.clock())
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Retires one past month's partition when every row in it has expired and
-- none is under a live lease: DROP, or DETACH when keep_detached (the table
-- stays, outside processed_events, for archiving). Returns 'dropped',
-- 'detached', or 'kept: <reason>'. It locks processed_events (parent first,
-- so it cannot deadlock with a claim): run it with a short lock_timeout.
CREATE FUNCTION idem.retire_partition(part regclass, keep_detached boolean DEFAULT false)
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
    IF p.month_to > date_trunc('month', v_now, 'UTC')::date THEN
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
-- Drops a table that retire_partition(..., keep_detached => true) detached
-- (a table of schema idem named like a month's partition that is no longer
-- attached). Rotation retires a month in two transactions, DETACH then
-- this, so that the lock on processed_events is held only for the detach.
CREATE FUNCTION idem.drop_detached(part regclass) RETURNS text
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
-- The months rotation should make: from the oldest month with rows in the
-- default partition (so they move out) to premake months ahead.
CREATE FUNCTION idem.months_to_create(premake integer)
RETURNS SETOF date
    LANGUAGE sql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
    SELECT m::date FROM (
        SELECT DISTINCT d.first_seen_month AS m FROM idem.processed_events_default d
        UNION
        SELECT (date_trunc('month', idem.clock(), 'UTC') + make_interval(months => g))::date
          FROM generate_series(0, greatest(premake, 0)) g
    ) s
    WHERE to_regclass('idem.' || quote_ident(idem.partition_name(m::date))) IS NULL
    ORDER BY 1
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- For pg_cron: CALL idem.prune(); deletes expired rows in batches,
-- committing after each, until a short batch. Skips (with a NOTICE) when
-- another prune holds the lock. Call it outside a transaction block.
CREATE PROCEDURE idem.prune(batch_size integer DEFAULT 5000, max_batches integer DEFAULT 10000)
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
-- For pg_cron: CALL idem.rotate(); makes the partitions for the next
-- `premake` months (and for months that have rows in the default
-- partition), then retires past months whose rows have all expired. Each
-- step commits on its own and waits at most lock_timeout (default here 2s)
-- for its locks; a step that times out is left for the next run.
CREATE PROCEDURE idem.rotate(premake integer DEFAULT 3, keep_detached boolean DEFAULT false,
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
                   WHERE NOT p.is_default AND p.month_to <= pg_catalog.date_trunc('month', idem.clock(), 'UTC')::date LOOP
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

-- +goose Down
-- +goose StatementBegin
DROP PROCEDURE IF EXISTS idem.rotate(integer, boolean, interval);
DROP PROCEDURE IF EXISTS idem.prune(integer, integer);
DROP FUNCTION IF EXISTS idem.months_to_create(integer);
DROP FUNCTION IF EXISTS idem.drop_detached(regclass);
DROP FUNCTION IF EXISTS idem.retire_partition(regclass, boolean);
DROP FUNCTION IF EXISTS idem.prunable_rows();
DROP FUNCTION IF EXISTS idem.prune_batch(text, integer);
DROP FUNCTION IF EXISTS idem.partitions();
DROP FUNCTION IF EXISTS idem.release_lock(text, text);
DROP FUNCTION IF EXISTS idem.try_lock(text, text, interval);
DROP TABLE IF EXISTS idem.maintenance_locks;
-- +goose StatementEnd
