-- idem 15: legacy data as it really is, and a release that takes effect
-- at one moment in the database and in every cache (issue 36).
--
-- * idem.adoptions gains three counters, reported by idemctl adopt:
--   future (rows stamped in the future, copied as processed now),
--   bad_keys (NULL, empty, blank or over-long keys: skipped) and no_stamp
--   (rows with no processed-at: skipped).
-- * idem.adopt_batch, version 15: a NULL key is never paged over (a full
--   first batch of them re-read the same rows forever, and claims kept
--   consulting the legacy table); future stamps are clamped to now (they
--   were copied into a month claims never look at, so the retry of an
--   event the old system processed ran again); several rows of one key in
--   a batch give one key, the latest.
-- * idem.adopt_key, version 15 (the claim's look-up while copying): the
--   legacy row must read back as exactly the claimed key, so a typed key
--   column never answers '01' or ' 1' from row 1; a cast that fails
--   (out of range, any data exception) means "not there", never an
--   error of the claim; future stamps clamped as the copy clamps them.
-- * idem.release, version 15: instead of deleting the key's row, ends its
--   retention 2 seconds later (idem.ReleaseGrace): a process's cache could
--   answer the released key for a moment while the database no longer
--   did; now both answer "completed" until the same moment, and neither
--   after it.
--
-- * idem.count_duplicate, version 15: counts nothing in a transaction
--   that set idem.uncounted: the Go client's claim after a WithWait, whose
--   first claim counted the duplicate already (it was counted twice).
--
-- Down restores adopt_batch and adopt_key version 9, release version 13
-- and count_duplicate version 10, and drops the counters.

-- +goose Up
-- +goose StatementBegin
ALTER TABLE idem.adoptions
    ADD COLUMN future   bigint NOT NULL DEFAULT 0,
    ADD COLUMN bad_keys bigint NOT NULL DEFAULT 0,
    ADD COLUMN no_stamp bigint NOT NULL DEFAULT 0;
-- +goose StatementEnd

-- +goose StatementBegin
-- adopt_batch, version 15.
CREATE OR REPLACE FUNCTION idem.adopt_batch(id bigint, batch_size integer,
                                 OUT read bigint, OUT copied bigint, OUT skipped bigint, OUT done boolean)
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    a        idem.adoptions;
    e        record;
    v_now    timestamptz := idem.clock();
    v_last   text;
    v_future bigint;
    v_bad    bigint;
    v_nostamp bigint;
    v_nulls  bigint := 0;
BEGIN
    IF adopt_batch.batch_size IS NULL OR adopt_batch.batch_size < 1 OR adopt_batch.batch_size > 1000000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('idem.adopt_batch: batch_size %s must be between 1 and 1000000', adopt_batch.batch_size);
    END IF;
    -- One copier per adoption at a time.
    SELECT * INTO a FROM idem.adoptions x WHERE x.id = adopt_batch.id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('idem.adopt_batch: no adoption %s', adopt_batch.id);
    END IF;
    IF a.state = 'done' THEN
        read := 0; copied := 0; skipped := 0; done := true;
        RETURN;
    END IF;
    SELECT * INTO e FROM idem.adopt_exprs(a);
    -- A legacy relation that would run its owner's code as this reader
    -- (made a view, given row level security since adopt_start) is
    -- refused (idem.check_legacy, migration 14).
    PERFORM idem.check_legacy(a.legacy);
    -- (version 15) Legacy rows as they really are: a NULL key is never
    -- paged over (counted once, at the end), a key idem cannot hold
    -- (empty, blank, over 512 bytes) or a row with no processed-at is
    -- skipped and counted, a processed-at in the future is taken as now
    -- (counted), and of several rows of one key in a batch the latest is
    -- kept.
    EXECUTE format($q$
        WITH src AS (
            SELECT %1$s AS key, l.%2$I AS ord, %3$s AS at, %4$s AS result
              FROM %5$s l
             WHERE l.%2$I IS NOT NULL AND ($1::text IS NULL OR l.%2$I > $1::%6$s)
             ORDER BY l.%2$I
             LIMIT $2),
        valid AS (
            SELECT DISTINCT ON (s.key) s.key, LEAST(s.at, $4) AS at, s.at > $4 AS future, s.result
              FROM src s
             WHERE s.at IS NOT NULL
               AND octet_length(s.key) BETWEEN 1 AND 512 AND btrim(s.key, E' \t\r\n') <> ''
             ORDER BY s.key, s.at DESC),
        ins AS (
            INSERT INTO idem.processed_events AS p
                   (source, key, first_seen_month, status, attempts, token, result, first_seen, updated_at, completed_at, expires_at)
            SELECT $3, v.key, idem.utc_month(v.at), 'completed', 1, idem.new_token(), v.result, v.at, $4, v.at, v.at + $5
              FROM valid v
             WHERE v.at + $5 > $4
               AND NOT EXISTS (SELECT 1 FROM idem.processed_events x
                                WHERE x.source = $3 AND x.key = v.key AND x.expires_at > $4)
            ON CONFLICT DO NOTHING
            RETURNING 1)
        SELECT (SELECT count(*) FROM src), (SELECT count(*) FROM ins),
               (SELECT s.ord::text FROM src s ORDER BY s.ord DESC LIMIT 1),
               (SELECT count(*) FROM valid v WHERE v.future),
               (SELECT count(*) FROM src s WHERE s.at IS NOT NULL
                   AND NOT (octet_length(s.key) BETWEEN 1 AND 512 AND btrim(s.key, E' \t\r\n') <> '')),
               (SELECT count(*) FROM src s WHERE s.at IS NULL)$q$,
        e.key_expr, a.key_column, e.at_expr, e.result_expr, a.legacy, e.key_type)
    INTO read, copied, v_last, v_future, v_bad, v_nostamp
    USING a.last_key, adopt_batch.batch_size, a.source, v_now, a.ttl;
    done := read < adopt_batch.batch_size;
    IF done THEN
        EXECUTE format('SELECT count(*) FROM %s l WHERE l.%I IS NULL', a.legacy, a.key_column) INTO v_nulls;
        read := read + v_nulls;
    END IF;
    skipped := read - copied;
    UPDATE idem.adoptions x
       SET last_key = coalesce(v_last, x.last_key), copied = x.copied + adopt_batch.copied,
           skipped = x.skipped + adopt_batch.skipped, batches = x.batches + 1, updated_at = now(),
           future = x.future + v_future, bad_keys = x.bad_keys + v_bad + v_nulls, no_stamp = x.no_stamp + v_nostamp,
           state = CASE WHEN adopt_batch.done THEN 'done' ELSE 'copying' END,
           finished_at = CASE WHEN adopt_batch.done THEN now() END
     WHERE x.id = adopt_batch.id;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- adopt_key, version 15.
CREATE OR REPLACE FUNCTION idem.adopt_key(id bigint, key text, now timestamptz, lo date, hi date) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    a      idem.adoptions;
    e      record;
    v_at   timestamptz;
    v_res  jsonb;
BEGIN
    IF adopt_key.id IS NULL OR adopt_key.key IS NULL OR adopt_key.now IS NULL THEN
        RETURN;
    END IF;
    SELECT * INTO a FROM idem.adoptions x WHERE x.id = adopt_key.id;
    IF NOT FOUND OR a.state <> 'copying' THEN
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM idem.processed_events p
                WHERE p.source = a.source AND p.key = adopt_key.key
                  AND p.first_seen_month >= adopt_key.lo AND p.first_seen_month <= adopt_key.hi
                  AND p.expires_at > adopt_key.now) THEN
        RETURN;
    END IF;
    SELECT * INTO e FROM idem.adopt_exprs(a);
    -- A legacy relation that would run its owner's code as this reader
    -- (made a view, given row level security since adopt_start) is
    -- refused (idem.check_legacy, migration 14).
    PERFORM idem.check_legacy(a.legacy);
    -- (version 15) The legacy row is found through its key column's own
    -- type (its index), and must then read back as exactly this key, as
    -- the copy writes it: a key the type cannot hold (out of range, not of
    -- its form) is not there, and one the cast would fold into another
    -- ('01', ' 1' and '1' into integer 1, a case-insensitive type or
    -- collation, a varchar(n) truncation) is not that row: the text is
    -- compared byte for byte (COLLATE "C").
    BEGIN
        EXECUTE format('SELECT %s, %s FROM %s l WHERE l.%I = $1::%s AND (%s) COLLATE "C" = $1 ORDER BY 1 DESC NULLS LAST LIMIT 1',
                       e.at_expr, e.result_expr, a.legacy, a.key_column, e.key_type, e.key_expr)
           INTO v_at, v_res USING adopt_key.key;
    EXCEPTION WHEN data_exception THEN
        RETURN; -- a key that cannot be of the legacy key's type is not there
    END;
    IF v_at IS NULL OR v_at + a.ttl <= adopt_key.now THEN
        RETURN; -- not processed there, or its retention is over: a new key
    END IF;
    -- A stamp in the future is taken as now, as the copy takes it.
    v_at := LEAST(v_at, adopt_key.now);
    INSERT INTO idem.processed_events
           (source, key, first_seen_month, status, attempts, token, result, first_seen, updated_at, completed_at, expires_at)
    VALUES (a.source, adopt_key.key, idem.utc_month(v_at), 'completed', 1, idem.new_token(), v_res, v_at, adopt_key.now, v_at, v_at + a.ttl)
    ON CONFLICT DO NOTHING;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- release, version 15.
CREATE OR REPLACE FUNCTION idem.release(source text, key text) RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_n bigint;
BEGIN
    PERFORM idem.check_key('idem.release', release.source, release.key);
    -- (version 13) Not on Citus: here, on the coordinator, the key's lock
    -- below would not exclude the claims of the key, which take it on the
    -- worker that holds the key, and the notification would not reach the
    -- caches of processes whose claims a worker answers.
    IF idem.distributed() THEN
        RAISE EXCEPTION USING ERRCODE = 'ID006',
            MESSAGE = 'idem.release does not run on a distributed (Citus) installation',
            DETAIL = 'Its per-key lock would be taken on the coordinator, where the key''s claims do not take theirs, so a claim in progress could be released under it.',
            HINT = 'Let the key expire, or delete its row on the worker that holds it while no claim of it runs (docs/citus.md).';
    END IF;
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
    -- (version 15) The key's retention ends 2 seconds from now instead of
    -- its row going at once: until then the database answers as every
    -- process's cache may still answer (a cache hears the notification
    -- below within milliseconds, and stops answering when its listener has
    -- not been heard from for 1.5 s), so the release takes effect at one
    -- moment everywhere, idem.ReleaseGrace after the commit. A completed
    -- answer this close to its end is never cached.
    UPDATE idem.processed_events e
       SET expires_at = LEAST(e.expires_at, idem.clock() + interval '2 seconds')
     WHERE e.source = release.source AND e.key = release.key AND e.expires_at > idem.clock();
    GET DIAGNOSTICS v_n = ROW_COUNT;
    PERFORM pg_notify('idem_released', idem.wait_channel_key(release.source, release.key));
    RETURN v_n;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- count_duplicate, version 15.
CREATE OR REPLACE FUNCTION idem.count_duplicate(p_source text, p_key text, p_month date, p_weight integer,
                                     p_per_key boolean, p_now timestamptz) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- (version 15) A waiting duplicate's claim after its wait (WithWait)
    -- runs in a transaction marked idem.uncounted: its first claim, which
    -- found the key in progress, counted it already.
    IF pg_catalog.current_setting('idem.uncounted', true) = 'on' THEN
        RETURN;
    END IF;
    INSERT INTO idem.duplicate_counts AS d (source, slot, duplicates, since, last_seen_at)
    VALUES (p_source, pg_backend_pid(), p_weight, p_now, p_now)
    ON CONFLICT (source, slot) DO UPDATE
       SET duplicates = d.duplicates + EXCLUDED.duplicates, last_seen_at = EXCLUDED.last_seen_at;
    -- (version 10) and in its minute of idem.activity.
    PERFORM idem.count_activity(p_source, p_now, 0, p_weight);
    IF p_per_key THEN
        UPDATE idem.processed_events e
           SET duplicates = e.duplicates + p_weight, last_seen_at = p_now
          FROM (SELECT l.first_seen_month FROM idem.processed_events l
                 WHERE l.source = p_source AND l.key = p_key AND l.first_seen_month = p_month
                   FOR UPDATE SKIP LOCKED) l
         WHERE e.source = p_source AND e.key = p_key AND e.first_seen_month = l.first_seen_month;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
-- count_duplicate, version 10.
CREATE OR REPLACE FUNCTION idem.count_duplicate(p_source text, p_key text, p_month date, p_weight integer,
                                     p_per_key boolean, p_now timestamptz) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    INSERT INTO idem.duplicate_counts AS d (source, slot, duplicates, since, last_seen_at)
    VALUES (p_source, pg_backend_pid(), p_weight, p_now, p_now)
    ON CONFLICT (source, slot) DO UPDATE
       SET duplicates = d.duplicates + EXCLUDED.duplicates, last_seen_at = EXCLUDED.last_seen_at;
    -- (version 10) and in its minute of idem.activity.
    PERFORM idem.count_activity(p_source, p_now, 0, p_weight);
    IF p_per_key THEN
        UPDATE idem.processed_events e
           SET duplicates = e.duplicates + p_weight, last_seen_at = p_now
          FROM (SELECT l.first_seen_month FROM idem.processed_events l
                 WHERE l.source = p_source AND l.key = p_key AND l.first_seen_month = p_month
                   FOR UPDATE SKIP LOCKED) l
         WHERE e.source = p_source AND e.key = p_key AND e.first_seen_month = l.first_seen_month;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- release, version 13.
CREATE OR REPLACE FUNCTION idem.release(source text, key text) RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_n bigint;
BEGIN
    PERFORM idem.check_key('idem.release', release.source, release.key);
    -- (version 13) Not on Citus: here, on the coordinator, the key's lock
    -- below would not exclude the claims of the key, which take it on the
    -- worker that holds the key, and the notification would not reach the
    -- caches of processes whose claims a worker answers.
    IF idem.distributed() THEN
        RAISE EXCEPTION USING ERRCODE = 'ID006',
            MESSAGE = 'idem.release does not run on a distributed (Citus) installation',
            DETAIL = 'Its per-key lock would be taken on the coordinator, where the key''s claims do not take theirs, so a claim in progress could be released under it.',
            HINT = 'Let the key expire, or delete its row on the worker that holds it while no claim of it runs (docs/citus.md).';
    END IF;
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
CREATE OR REPLACE FUNCTION idem.adopt_key(id bigint, key text, now timestamptz, lo date, hi date) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    a      idem.adoptions;
    e      record;
    v_at   timestamptz;
    v_res  jsonb;
BEGIN
    SELECT * INTO a FROM idem.adoptions x WHERE x.id = adopt_key.id;
    IF NOT FOUND OR a.state <> 'copying' THEN
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM idem.processed_events p
                WHERE p.source = a.source AND p.key = adopt_key.key
                  AND p.first_seen_month >= adopt_key.lo AND p.first_seen_month <= adopt_key.hi
                  AND p.expires_at > adopt_key.now) THEN
        RETURN;
    END IF;
    SELECT * INTO e FROM idem.adopt_exprs(a);
    EXECUTE format('SELECT %s, %s FROM %s l WHERE l.%I = $1::%s LIMIT 1', e.at_expr, e.result_expr, a.legacy, a.key_column, e.key_type)
       INTO v_at, v_res USING adopt_key.key;
    IF v_at IS NULL OR v_at + a.ttl <= adopt_key.now THEN
        RETURN; -- not processed there, or its retention is over: a new key
    END IF;
    INSERT INTO idem.processed_events
           (source, key, first_seen_month, status, attempts, token, result, first_seen, updated_at, completed_at, expires_at)
    VALUES (a.source, adopt_key.key, idem.utc_month(v_at), 'completed', 1, idem.new_token(), v_res, v_at, adopt_key.now, v_at, v_at + a.ttl)
    ON CONFLICT DO NOTHING;
EXCEPTION WHEN invalid_text_representation THEN
    RETURN; -- a key that cannot be of the legacy key's type is not there
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.adopt_batch(id bigint, batch_size integer,
                                 OUT read bigint, OUT copied bigint, OUT skipped bigint, OUT done boolean)
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    a      idem.adoptions;
    e      record;
    v_now  timestamptz := idem.clock();
    v_last text;
BEGIN
    IF adopt_batch.batch_size IS NULL OR adopt_batch.batch_size < 1 OR adopt_batch.batch_size > 1000000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('idem.adopt_batch: batch_size %s must be between 1 and 1000000', adopt_batch.batch_size);
    END IF;
    -- One copier per adoption at a time.
    SELECT * INTO a FROM idem.adoptions x WHERE x.id = adopt_batch.id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('idem.adopt_batch: no adoption %s', adopt_batch.id);
    END IF;
    IF a.state = 'done' THEN
        read := 0; copied := 0; skipped := 0; done := true;
        RETURN;
    END IF;
    SELECT * INTO e FROM idem.adopt_exprs(a);
    EXECUTE format($q$
        WITH src AS (
            SELECT %1$s AS key, l.%2$I AS ord, %3$s AS at, %4$s AS result
              FROM %5$s l
             WHERE $1::text IS NULL OR l.%2$I > $1::%6$s
             ORDER BY l.%2$I
             LIMIT $2),
        ins AS (
            INSERT INTO idem.processed_events AS p
                   (source, key, first_seen_month, status, attempts, token, result, first_seen, updated_at, completed_at, expires_at)
            SELECT $3, s.key, idem.utc_month(s.at), 'completed', 1, idem.new_token(), s.result, s.at, $4, s.at, s.at + $5
              FROM src s
             WHERE s.at + $5 > $4
               AND octet_length(s.key) BETWEEN 1 AND 512 AND btrim(s.key, E' 	
') <> ''
               AND NOT EXISTS (SELECT 1 FROM idem.processed_events x
                                WHERE x.source = $3 AND x.key = s.key AND x.expires_at > $4)
            ON CONFLICT DO NOTHING
            RETURNING 1)
        SELECT (SELECT count(*) FROM src), (SELECT count(*) FROM ins),
               (SELECT s.ord::text FROM src s ORDER BY s.ord DESC LIMIT 1)$q$,
        e.key_expr, a.key_column, e.at_expr, e.result_expr, a.legacy, e.key_type)
    INTO read, copied, v_last
    USING a.last_key, adopt_batch.batch_size, a.source, v_now, a.ttl;
    skipped := read - copied;
    done := read < adopt_batch.batch_size;
    UPDATE idem.adoptions x
       SET last_key = coalesce(v_last, x.last_key), copied = x.copied + adopt_batch.copied,
           skipped = x.skipped + adopt_batch.skipped, batches = x.batches + 1, updated_at = now(),
           state = CASE WHEN adopt_batch.done THEN 'done' ELSE 'copying' END,
           finished_at = CASE WHEN adopt_batch.done THEN now() END
     WHERE x.id = adopt_batch.id;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
ALTER TABLE idem.adoptions DROP COLUMN future, DROP COLUMN bad_keys, DROP COLUMN no_stamp;
-- +goose StatementEnd
