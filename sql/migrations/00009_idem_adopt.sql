-- idem 9: adopt an existing table of processed events, online.
--
-- The teams this is for already have a plain processed_events table (an
-- event id, when it was processed, maybe a result) written by their own
-- handlers. idemctl adopt copies it into idem in batches, resumable, while
-- the application already claims through idem:
--
-- * idem.adoptions: one row per adoption (source, legacy table and columns,
--   retention, progress: the last key copied, rows copied and skipped,
--   state copying | done). Each batch commits with its progress, so a
--   killed copy resumes where it stopped.
-- * idem.adopt_start(...) validates the table and columns, creates the
--   months the live legacy rows need and raises the source's lookback;
--   idem.adopt_batch(id, n) copies the next n legacy rows in key order (one
--   statement; rows whose retention is over are skipped, and so are keys
--   idem already has) and marks the adoption done after a short batch. A
--   legacy row becomes a completed key in the month it was processed, its
--   result the legacy result (as jsonb), kept for the retention from when it
--   was processed.
-- * idem.claim, version 9: while an adoption of its source is copying, a
--   key with no live row in idem is looked up in the legacy table (one
--   indexed probe, dynamic SQL) and, when processed there, adopted on the
--   spot under the key's lock and answered completed: a retry that arrives
--   during the copy is never processed twice, whether the copy reached its
--   key or not. Once the adoption is done, claims no longer look.
--
-- The adopt functions read a table the caller names: they are granted to
-- no role (run idemctl adopt as the role that owns idem's schema).

-- +goose Up
-- +goose StatementBegin
CREATE TABLE idem.adoptions (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source        text NOT NULL,
    legacy        regclass NOT NULL,
    key_column    text NOT NULL,
    at_column     text NOT NULL,
    result_column text,
    ttl           interval NOT NULL,
    state         text NOT NULL DEFAULT 'copying' CHECK (state IN ('copying', 'done')),
    last_key      text,
    copied        bigint NOT NULL DEFAULT 0,
    skipped       bigint NOT NULL DEFAULT 0,
    batches       bigint NOT NULL DEFAULT 0,
    started_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    finished_at   timestamptz
);
-- +goose StatementEnd

-- +goose StatementBegin
CREATE UNIQUE INDEX adoptions_copying_idx ON idem.adoptions (source) WHERE state = 'copying';
-- +goose StatementEnd

-- +goose StatementBegin
-- The SQL expressions that read a legacy row's key (as text), processed-at
-- (as timestamptz; a timestamp without time zone is taken as UTC) and
-- result (as jsonb, NULL over 1 MiB), for the adoption a.
CREATE FUNCTION idem.adopt_exprs(a idem.adoptions, OUT key_expr text, OUT at_expr text, OUT result_expr text, OUT key_type text)
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_at_type text;
BEGIN
    SELECT format_type(t.atttypid, t.atttypmod) INTO key_type
      FROM pg_attribute t WHERE t.attrelid = a.legacy AND t.attname = a.key_column AND t.attnum > 0 AND NOT t.attisdropped;
    SELECT format_type(t.atttypid, t.atttypmod) INTO v_at_type
      FROM pg_attribute t WHERE t.attrelid = a.legacy AND t.attname = a.at_column AND t.attnum > 0 AND NOT t.attisdropped;
    key_expr := format('l.%I::text', a.key_column);
    at_expr := CASE WHEN v_at_type = 'timestamp without time zone' THEN format('(l.%I AT TIME ZONE ''UTC'')', a.at_column)
                    ELSE format('l.%I::timestamptz', a.at_column) END;
    result_expr := CASE WHEN a.result_column IS NULL THEN 'NULL::jsonb'
                        ELSE format('(SELECT CASE WHEN pg_catalog.pg_column_size(j) <= 1048576 THEN j END FROM pg_catalog.to_jsonb(l.%I) AS j)', a.result_column) END;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.adopt_exprs(idem.adoptions) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- Starts (or resumes) the adoption of legacy into source and returns its id.
CREATE FUNCTION idem.adopt_start(source text, legacy regclass, key_column text, at_column text,
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

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.adopt_start(text, regclass, text, text, text, interval) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- Copies the next batch_size legacy rows of adoption id (in key order),
-- records its progress, and marks it done after a short batch. Returns what
-- this batch read, copied and skipped (retention over, or already in idem),
-- and whether the adoption is done. One transaction: a killed copy resumes
-- after the last committed batch.
CREATE FUNCTION idem.adopt_batch(id bigint, batch_size integer,
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
REVOKE ALL ON FUNCTION idem.adopt_batch(bigint, integer) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- Called by idem.claim (under the key's lock) while adoption id copies: a
-- key with no live row in idem's window that is processed in the legacy
-- table is adopted now (completed, in the month it was processed).
CREATE FUNCTION idem.adopt_key(id bigint, key text, now timestamptz, lo date, hi date) RETURNS void
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
REVOKE ALL ON FUNCTION idem.adopt_key(bigint, text, timestamptz, date, date) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- idem.claim, version 9 (same signature and outcomes as version 7): while an
-- adoption of the source copies, a key not in idem is adopted from the legacy
-- table first (idem.adopt_key).
CREATE OR REPLACE FUNCTION idem.claim(
    source      text,
    key         text,
    fingerprint text     DEFAULT NULL,
    ttl         interval DEFAULT NULL,
    lease       interval DEFAULT NULL,
    event_type  text     DEFAULT NULL,
    lock_wait   interval DEFAULT NULL,
    OUT outcome          text,
    OUT token            bigint,
    OUT attempt          integer,
    OUT lease_expires_at timestamptz,
    OUT result           jsonb,
    OUT error            text,
    OUT first_seen       timestamptz,
    OUT expires_at       timestamptz,
    OUT lease_remaining  interval)
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    -- Run-time partition pruning on a cached plan; a custom plan would be
    -- replanned on every call (several times slower).
    SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_iso      text := current_setting('transaction_isolation');
    v_lockkey  integer;
    v_locked   boolean;
    v_now      timestamptz;
    v_ttl      interval;
    v_lease    interval;
    v_max      integer;
    v_sample   integer;
    v_per_key  boolean;
    v_lookback interval;
    v_need     interval;
    v_lo       date;
    v_hi       date;
    r          record;
    v_found    boolean := false;
    v_until    timestamptz;
    v_sleep    double precision := 0.001;
    v_tries    integer := 0;
    v_adopt    bigint;
BEGIN
    IF v_iso = 'repeatable read' THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'idem.claim: REPEATABLE READ is not supported',
            DETAIL = 'A repeatable-read snapshot cannot see a claim of the same key committed in another monthly partition after the snapshot was taken, so a duplicate could run.',
            HINT = 'Claim in READ COMMITTED (the default) or SERIALIZABLE.';
    END IF;
    -- All input checks as one expression (cheap); only bad input takes the
    -- slow path that names the problem.
    IF claim.source IS NULL OR claim.key IS NULL
       OR octet_length(claim.source) NOT BETWEEN 1 AND 64 OR octet_length(claim.key) NOT BETWEEN 1 AND 512
       OR btrim(claim.source, E' \t\r\n') = '' OR btrim(claim.key, E' \t\r\n') = ''
       OR octet_length(claim.fingerprint) > 512 OR octet_length(claim.event_type) > 256
       OR (claim.ttl IS NOT NULL AND NOT (claim.ttl >= interval '1 minute' AND claim.ttl <= interval '10 years'))
       OR (claim.lease IS NOT NULL AND NOT (claim.lease >= interval '1 second' AND claim.lease <= interval '7 days'))
       OR (claim.lock_wait IS NOT NULL AND NOT (claim.lock_wait >= interval '0' AND claim.lock_wait <= interval '1 hour')) THEN
        PERFORM idem.check_key('idem.claim', claim.source, claim.key);
        IF octet_length(claim.fingerprint) > 512 THEN
            RAISE EXCEPTION USING ERRCODE = '22001', MESSAGE = 'idem.claim: fingerprint is longer than 512 bytes',
                HINT = 'Pass a hash of the request, not the request.';
        END IF;
        IF octet_length(claim.event_type) > 256 THEN
            RAISE EXCEPTION USING ERRCODE = '22001', MESSAGE = 'idem.claim: event_type is longer than 256 bytes';
        END IF;
        IF claim.ttl IS NOT NULL AND NOT idem.valid_ttl(claim.ttl) THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: ttl %s is out of range', claim.ttl),
                HINT = 'ttl must be between 1 minute and 10 years.';
        END IF;
        IF claim.lease IS NOT NULL AND NOT idem.valid_lease(claim.lease) THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lease %s is out of range', claim.lease),
                HINT = 'lease must be between 1 second and 7 days.';
        END IF;
        IF claim.lock_wait IS NOT NULL AND NOT (claim.lock_wait >= interval '0' AND claim.lock_wait <= interval '1 hour') THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lock_wait %s is out of range', claim.lock_wait),
                HINT = 'lock_wait must be between 0 and 1 hour.';
        END IF;
    END IF;

    -- The key's lock first: every write of a row of this key (and every
    -- raise of its source's lookback by a write) happens under it, so what
    -- is read after it (lookback, rows) includes every earlier claim of the
    -- key. Free in the common case; held by another claim of the key only
    -- while that claim's transaction is open.
    v_lockkey := hashtext(claim.source || chr(31) || claim.key);
    v_locked := pg_try_advisory_xact_lock(1768187245, v_lockkey);

    <<answer>>
    LOOP
        SELECT x.ttl, x.lease, x.max_attempts, x.duplicate_sampling, x.count_per_key,
               (SELECT max(l.lookback) FROM idem.lookbacks l WHERE l.source IN (claim.source, '*')),
               (SELECT a.id FROM idem.adoptions a WHERE a.source = claim.source AND a.state = 'copying' LIMIT 1)
          INTO v_ttl, v_lease, v_max, v_sample, v_per_key, v_lookback, v_adopt
          FROM (SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = claim.source
                UNION ALL
                SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = '*'
                 LIMIT 1) x;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = '42704',
                MESSAGE = format('idem.claim: no policy for source %L and no default policy', claim.source),
                HINT = 'Insert a row for the source, or the default row with source ''*'', into idem.policies.';
        END IF;
        v_ttl := coalesce(claim.ttl, v_ttl);
        v_lease := coalesce(claim.lease, v_lease);
        IF v_lease > v_ttl THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lease %s is longer than ttl %s', v_lease, v_ttl);
        END IF;
        EXIT answer WHEN v_locked;

        -- Another claim of this key is in an open transaction. Answer from
        -- what is committed when that is final (completed, failed, a
        -- mismatch, a live lease), without waiting.
        v_now := idem.clock();
        SELECT e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r FROM idem.processed_events e
         WHERE e.source = claim.source AND e.key = claim.key
           AND e.first_seen_month >= idem.window_start(v_now, v_lookback)
           AND e.expires_at > v_now
         LIMIT 1;
        v_found := FOUND;
        IF v_found THEN
            outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim.fingerprint, v_now);
            IF outcome IS NOT NULL THEN
                IF v_sample > 0 AND v_iso <> 'serializable' AND (v_sample = 1 OR random() * v_sample < 1) THEN
                    PERFORM idem.count_duplicate(claim.source, claim.key, r.first_seen_month, v_sample, v_per_key, v_now);
                END IF;
                EXIT answer;
            END IF;
        END IF;
        -- Wait for the lock at most lock_wait (default 5 seconds), polling
        -- so the wait is bounded whatever the caller's lock_timeout; past
        -- it, answer in_progress.
        v_until := clock_timestamp() + coalesce(claim.lock_wait, interval '5 seconds');
        LOOP
            IF clock_timestamp() >= v_until THEN
                outcome := 'in_progress';
                v_now := idem.clock();
                EXIT answer;
            END IF;
            PERFORM pg_sleep(least(v_sleep, greatest(extract(epoch FROM v_until - clock_timestamp()), 0)));
            v_sleep := least(v_sleep * 2, 0.05);
            EXIT WHEN pg_try_advisory_xact_lock(1768187245, v_lockkey);
        END LOOP;
        -- Locked now: read the policy and lookback again (the holder may
        -- have raised it) and go on as if the lock had been free.
        v_locked := true;
    END LOOP;

    IF outcome IS NULL THEN
        LOOP
            v_tries := v_tries + 1;
            IF v_tries > 5 THEN
                RAISE EXCEPTION USING ERRCODE = '40001',
                    MESSAGE = 'idem.claim: the key kept changing under the claim',
                    HINT = 'Retry the transaction.';
            END IF;
            v_now := idem.clock();
            v_need := idem.days_at_most(greatest(v_ttl, v_lease));
            IF v_need > v_lookback THEN
                v_lookback := idem.raise_lookback(claim.source, v_need);
            END IF;
            -- The window: from the oldest month that can hold a live row of
            -- this source to the month of tomorrow. A claim that committed
            -- before this one took the lock read the clock before this one
            -- did, so its month is not later than this one's; the day of
            -- margin covers a clock stepped back across a month's end.
            v_lo := idem.window_start(v_now, v_lookback);
            v_hi := idem.utc_month(v_now + interval '1 day');
            -- While a legacy table is being adopted (idemctl adopt), a key
            -- that is not in idem yet but processed in the legacy table is
            -- adopted now, under the key's lock, and answered below as the
            -- completed key it is.
            IF v_adopt IS NOT NULL THEN
                PERFORM idem.adopt_key(v_adopt, claim.key, v_now, v_lo, v_hi);
            END IF;
            -- One statement: the live row in the window if there is one,
            -- else a new row in the current month.
            WITH f AS (
                SELECT e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at, false AS inserted FROM idem.processed_events e
                 WHERE e.source = claim.source AND e.key = claim.key
                   AND e.first_seen_month >= v_lo AND e.first_seen_month <= v_hi
                   AND e.expires_at > v_now
                 LIMIT 1),
            i AS (
                INSERT INTO idem.processed_events AS e
                       (source, key, first_seen_month, event_type, status, attempts, token,
                        lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
                SELECT claim.source, claim.key, idem.utc_month(v_now), claim.event_type,
                       'processing', 1, idem.new_token(), v_now + v_lease, claim.fingerprint, v_now, v_now,
                       v_now + greatest(v_ttl, v_lease)
                 WHERE NOT EXISTS (SELECT 1 FROM f)
                   AND NOT EXISTS (SELECT 1 FROM idem.holds h
                                    WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued')
                ON CONFLICT DO NOTHING
                RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at, true AS inserted)
            SELECT * INTO r FROM i UNION ALL SELECT * FROM f;
            v_found := FOUND;
            IF v_found AND r.inserted THEN
                outcome := 'acquired';
                EXIT;
            END IF;
            IF NOT v_found THEN
                -- Held by the queue (its row may have expired, or sit in a
                -- month before the window): its job owns it.
                IF EXISTS (SELECT 1 FROM idem.holds h
                            WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued') THEN
                    outcome := 'in_progress';
                    EXIT;
                END IF;
                -- No live row, and the insert met a row of this key in the
                -- current month: an expired one. Remove it and insert again.
                DELETE FROM idem.processed_events e
                 WHERE e.source = claim.source AND e.key = claim.key
                   AND e.first_seen_month = idem.utc_month(v_now) AND e.expires_at <= v_now;
                CONTINUE;
            END IF;
            outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim.fingerprint, v_now);
            IF outcome IS NOT NULL THEN
                -- A duplicate: read, not written. Count one in v_sample.
                IF v_sample > 0 AND v_iso <> 'serializable' AND (v_sample = 1 OR random() * v_sample < 1) THEN
                    PERFORM idem.count_duplicate(claim.source, claim.key, r.first_seen_month, v_sample, v_per_key, v_now);
                END IF;
                EXIT;
            END IF;
            -- A lost lease or a retryable failure: take the key over, if the
            -- row is still as read (complete, fail and extend do not take
            -- the key's lock), and not held by the queue (between a job's
            -- attempts, or while a crashed worker's job waits for rescue).
            IF EXISTS (SELECT 1 FROM idem.holds h
                        WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued') THEN
                outcome := 'in_progress';
                EXIT;
            END IF;
            IF v_max IS NOT NULL AND r.attempts >= v_max THEN
                UPDATE idem.processed_events e
                   SET status = 'failed', retryable = false, lease_expires_at = NULL, updated_at = v_now,
                       last_error = format('idem: gave up after %s attempts; last error: %s',
                                           r.attempts, coalesce(r.last_error, 'lease expired'))
                 WHERE e.source = claim.source AND e.key = claim.key AND e.first_seen_month = r.first_seen_month
                   AND e.token = r.token AND e.status = r.status
                RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
                IF FOUND THEN
                    outcome := 'failed';
                    EXIT;
                END IF;
                CONTINUE;
            END IF;
            v_need := greatest(r.expires_at, v_now + v_lease) - idem.row_anchor(r.first_seen, r.first_seen_month);
            IF v_need > v_lookback THEN
                v_lookback := idem.raise_lookback(claim.source, v_need);
            END IF;
            UPDATE idem.processed_events e
               SET status = 'processing',
                   attempts = e.attempts + 1,
                   token = idem.new_token(),
                   lease_expires_at = v_now + v_lease,
                   retryable = NULL,
                   updated_at = v_now,
                   expires_at = greatest(e.expires_at, v_now + v_lease),
                   fingerprint = coalesce(e.fingerprint, claim.fingerprint),
                   event_type = coalesce(e.event_type, claim.event_type)
             WHERE e.source = claim.source AND e.key = claim.key AND e.first_seen_month = r.first_seen_month
               AND e.token = r.token AND e.status = r.status
            RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
            IF FOUND THEN
                outcome := 'acquired';
                EXIT;
            END IF;
        END LOOP;
    END IF;

    IF v_found THEN
        token            := CASE WHEN outcome = 'acquired' THEN r.token END;
        attempt          := r.attempts;
        lease_expires_at := CASE WHEN outcome IN ('acquired', 'in_progress', 'mismatch') THEN r.lease_expires_at END;
        result           := CASE WHEN outcome = 'completed' THEN r.result END;
        error            := CASE WHEN outcome IN ('failed', 'acquired', 'completed') THEN r.last_error END;
        first_seen       := r.first_seen;
        expires_at       := r.expires_at;
        lease_remaining  := CASE WHEN outcome = 'acquired' THEN v_lease
                                 WHEN outcome = 'in_progress' THEN greatest(r.lease_expires_at - v_now, interval '0') END;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
-- idem.claim, version 7.
CREATE OR REPLACE FUNCTION idem.claim(
    source      text,
    key         text,
    fingerprint text     DEFAULT NULL,
    ttl         interval DEFAULT NULL,
    lease       interval DEFAULT NULL,
    event_type  text     DEFAULT NULL,
    lock_wait   interval DEFAULT NULL,
    OUT outcome          text,
    OUT token            bigint,
    OUT attempt          integer,
    OUT lease_expires_at timestamptz,
    OUT result           jsonb,
    OUT error            text,
    OUT first_seen       timestamptz,
    OUT expires_at       timestamptz,
    OUT lease_remaining  interval)
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    -- Run-time partition pruning on a cached plan; a custom plan would be
    -- replanned on every call (several times slower).
    SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_iso      text := current_setting('transaction_isolation');
    v_lockkey  integer;
    v_locked   boolean;
    v_now      timestamptz;
    v_ttl      interval;
    v_lease    interval;
    v_max      integer;
    v_sample   integer;
    v_per_key  boolean;
    v_lookback interval;
    v_need     interval;
    v_lo       date;
    v_hi       date;
    r          record;
    v_found    boolean := false;
    v_until    timestamptz;
    v_sleep    double precision := 0.001;
    v_tries    integer := 0;
BEGIN
    IF v_iso = 'repeatable read' THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'idem.claim: REPEATABLE READ is not supported',
            DETAIL = 'A repeatable-read snapshot cannot see a claim of the same key committed in another monthly partition after the snapshot was taken, so a duplicate could run.',
            HINT = 'Claim in READ COMMITTED (the default) or SERIALIZABLE.';
    END IF;
    -- All input checks as one expression (cheap); only bad input takes the
    -- slow path that names the problem.
    IF claim.source IS NULL OR claim.key IS NULL
       OR octet_length(claim.source) NOT BETWEEN 1 AND 64 OR octet_length(claim.key) NOT BETWEEN 1 AND 512
       OR btrim(claim.source, E' \t\r\n') = '' OR btrim(claim.key, E' \t\r\n') = ''
       OR octet_length(claim.fingerprint) > 512 OR octet_length(claim.event_type) > 256
       OR (claim.ttl IS NOT NULL AND NOT (claim.ttl >= interval '1 minute' AND claim.ttl <= interval '10 years'))
       OR (claim.lease IS NOT NULL AND NOT (claim.lease >= interval '1 second' AND claim.lease <= interval '7 days'))
       OR (claim.lock_wait IS NOT NULL AND NOT (claim.lock_wait >= interval '0' AND claim.lock_wait <= interval '1 hour')) THEN
        PERFORM idem.check_key('idem.claim', claim.source, claim.key);
        IF octet_length(claim.fingerprint) > 512 THEN
            RAISE EXCEPTION USING ERRCODE = '22001', MESSAGE = 'idem.claim: fingerprint is longer than 512 bytes',
                HINT = 'Pass a hash of the request, not the request.';
        END IF;
        IF octet_length(claim.event_type) > 256 THEN
            RAISE EXCEPTION USING ERRCODE = '22001', MESSAGE = 'idem.claim: event_type is longer than 256 bytes';
        END IF;
        IF claim.ttl IS NOT NULL AND NOT idem.valid_ttl(claim.ttl) THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: ttl %s is out of range', claim.ttl),
                HINT = 'ttl must be between 1 minute and 10 years.';
        END IF;
        IF claim.lease IS NOT NULL AND NOT idem.valid_lease(claim.lease) THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lease %s is out of range', claim.lease),
                HINT = 'lease must be between 1 second and 7 days.';
        END IF;
        IF claim.lock_wait IS NOT NULL AND NOT (claim.lock_wait >= interval '0' AND claim.lock_wait <= interval '1 hour') THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lock_wait %s is out of range', claim.lock_wait),
                HINT = 'lock_wait must be between 0 and 1 hour.';
        END IF;
    END IF;

    -- The key's lock first: every write of a row of this key (and every
    -- raise of its source's lookback by a write) happens under it, so what
    -- is read after it (lookback, rows) includes every earlier claim of the
    -- key. Free in the common case; held by another claim of the key only
    -- while that claim's transaction is open.
    v_lockkey := hashtext(claim.source || chr(31) || claim.key);
    v_locked := pg_try_advisory_xact_lock(1768187245, v_lockkey);

    <<answer>>
    LOOP
        SELECT x.ttl, x.lease, x.max_attempts, x.duplicate_sampling, x.count_per_key,
               (SELECT max(l.lookback) FROM idem.lookbacks l WHERE l.source IN (claim.source, '*'))
          INTO v_ttl, v_lease, v_max, v_sample, v_per_key, v_lookback
          FROM (SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = claim.source
                UNION ALL
                SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = '*'
                 LIMIT 1) x;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = '42704',
                MESSAGE = format('idem.claim: no policy for source %L and no default policy', claim.source),
                HINT = 'Insert a row for the source, or the default row with source ''*'', into idem.policies.';
        END IF;
        v_ttl := coalesce(claim.ttl, v_ttl);
        v_lease := coalesce(claim.lease, v_lease);
        IF v_lease > v_ttl THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lease %s is longer than ttl %s', v_lease, v_ttl);
        END IF;
        EXIT answer WHEN v_locked;

        -- Another claim of this key is in an open transaction. Answer from
        -- what is committed when that is final (completed, failed, a
        -- mismatch, a live lease), without waiting.
        v_now := idem.clock();
        SELECT e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r FROM idem.processed_events e
         WHERE e.source = claim.source AND e.key = claim.key
           AND e.first_seen_month >= idem.window_start(v_now, v_lookback)
           AND e.expires_at > v_now
         LIMIT 1;
        v_found := FOUND;
        IF v_found THEN
            outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim.fingerprint, v_now);
            IF outcome IS NOT NULL THEN
                IF v_sample > 0 AND v_iso <> 'serializable' AND (v_sample = 1 OR random() * v_sample < 1) THEN
                    PERFORM idem.count_duplicate(claim.source, claim.key, r.first_seen_month, v_sample, v_per_key, v_now);
                END IF;
                EXIT answer;
            END IF;
        END IF;
        -- Wait for the lock at most lock_wait (default 5 seconds), polling
        -- so the wait is bounded whatever the caller's lock_timeout; past
        -- it, answer in_progress.
        v_until := clock_timestamp() + coalesce(claim.lock_wait, interval '5 seconds');
        LOOP
            IF clock_timestamp() >= v_until THEN
                outcome := 'in_progress';
                v_now := idem.clock();
                EXIT answer;
            END IF;
            PERFORM pg_sleep(least(v_sleep, greatest(extract(epoch FROM v_until - clock_timestamp()), 0)));
            v_sleep := least(v_sleep * 2, 0.05);
            EXIT WHEN pg_try_advisory_xact_lock(1768187245, v_lockkey);
        END LOOP;
        -- Locked now: read the policy and lookback again (the holder may
        -- have raised it) and go on as if the lock had been free.
        v_locked := true;
    END LOOP;

    IF outcome IS NULL THEN
        LOOP
            v_tries := v_tries + 1;
            IF v_tries > 5 THEN
                RAISE EXCEPTION USING ERRCODE = '40001',
                    MESSAGE = 'idem.claim: the key kept changing under the claim',
                    HINT = 'Retry the transaction.';
            END IF;
            v_now := idem.clock();
            v_need := idem.days_at_most(greatest(v_ttl, v_lease));
            IF v_need > v_lookback THEN
                v_lookback := idem.raise_lookback(claim.source, v_need);
            END IF;
            -- The window: from the oldest month that can hold a live row of
            -- this source to the month of tomorrow. A claim that committed
            -- before this one took the lock read the clock before this one
            -- did, so its month is not later than this one's; the day of
            -- margin covers a clock stepped back across a month's end.
            v_lo := idem.window_start(v_now, v_lookback);
            v_hi := idem.utc_month(v_now + interval '1 day');
            -- One statement: the live row in the window if there is one,
            -- else a new row in the current month.
            WITH f AS (
                SELECT e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at, false AS inserted FROM idem.processed_events e
                 WHERE e.source = claim.source AND e.key = claim.key
                   AND e.first_seen_month >= v_lo AND e.first_seen_month <= v_hi
                   AND e.expires_at > v_now
                 LIMIT 1),
            i AS (
                INSERT INTO idem.processed_events AS e
                       (source, key, first_seen_month, event_type, status, attempts, token,
                        lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
                SELECT claim.source, claim.key, idem.utc_month(v_now), claim.event_type,
                       'processing', 1, idem.new_token(), v_now + v_lease, claim.fingerprint, v_now, v_now,
                       v_now + greatest(v_ttl, v_lease)
                 WHERE NOT EXISTS (SELECT 1 FROM f)
                   AND NOT EXISTS (SELECT 1 FROM idem.holds h
                                    WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued')
                ON CONFLICT DO NOTHING
                RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at, true AS inserted)
            SELECT * INTO r FROM i UNION ALL SELECT * FROM f;
            v_found := FOUND;
            IF v_found AND r.inserted THEN
                outcome := 'acquired';
                EXIT;
            END IF;
            IF NOT v_found THEN
                -- Held by the queue (its row may have expired, or sit in a
                -- month before the window): its job owns it.
                IF EXISTS (SELECT 1 FROM idem.holds h
                            WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued') THEN
                    outcome := 'in_progress';
                    EXIT;
                END IF;
                -- No live row, and the insert met a row of this key in the
                -- current month: an expired one. Remove it and insert again.
                DELETE FROM idem.processed_events e
                 WHERE e.source = claim.source AND e.key = claim.key
                   AND e.first_seen_month = idem.utc_month(v_now) AND e.expires_at <= v_now;
                CONTINUE;
            END IF;
            outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim.fingerprint, v_now);
            IF outcome IS NOT NULL THEN
                -- A duplicate: read, not written. Count one in v_sample.
                IF v_sample > 0 AND v_iso <> 'serializable' AND (v_sample = 1 OR random() * v_sample < 1) THEN
                    PERFORM idem.count_duplicate(claim.source, claim.key, r.first_seen_month, v_sample, v_per_key, v_now);
                END IF;
                EXIT;
            END IF;
            -- A lost lease or a retryable failure: take the key over, if the
            -- row is still as read (complete, fail and extend do not take
            -- the key's lock), and not held by the queue (between a job's
            -- attempts, or while a crashed worker's job waits for rescue).
            IF EXISTS (SELECT 1 FROM idem.holds h
                        WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued') THEN
                outcome := 'in_progress';
                EXIT;
            END IF;
            IF v_max IS NOT NULL AND r.attempts >= v_max THEN
                UPDATE idem.processed_events e
                   SET status = 'failed', retryable = false, lease_expires_at = NULL, updated_at = v_now,
                       last_error = format('idem: gave up after %s attempts; last error: %s',
                                           r.attempts, coalesce(r.last_error, 'lease expired'))
                 WHERE e.source = claim.source AND e.key = claim.key AND e.first_seen_month = r.first_seen_month
                   AND e.token = r.token AND e.status = r.status
                RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
                IF FOUND THEN
                    outcome := 'failed';
                    EXIT;
                END IF;
                CONTINUE;
            END IF;
            v_need := greatest(r.expires_at, v_now + v_lease) - idem.row_anchor(r.first_seen, r.first_seen_month);
            IF v_need > v_lookback THEN
                v_lookback := idem.raise_lookback(claim.source, v_need);
            END IF;
            UPDATE idem.processed_events e
               SET status = 'processing',
                   attempts = e.attempts + 1,
                   token = idem.new_token(),
                   lease_expires_at = v_now + v_lease,
                   retryable = NULL,
                   updated_at = v_now,
                   expires_at = greatest(e.expires_at, v_now + v_lease),
                   fingerprint = coalesce(e.fingerprint, claim.fingerprint),
                   event_type = coalesce(e.event_type, claim.event_type)
             WHERE e.source = claim.source AND e.key = claim.key AND e.first_seen_month = r.first_seen_month
               AND e.token = r.token AND e.status = r.status
            RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
            IF FOUND THEN
                outcome := 'acquired';
                EXIT;
            END IF;
        END LOOP;
    END IF;

    IF v_found THEN
        token            := CASE WHEN outcome = 'acquired' THEN r.token END;
        attempt          := r.attempts;
        lease_expires_at := CASE WHEN outcome IN ('acquired', 'in_progress', 'mismatch') THEN r.lease_expires_at END;
        result           := CASE WHEN outcome = 'completed' THEN r.result END;
        error            := CASE WHEN outcome IN ('failed', 'acquired', 'completed') THEN r.last_error END;
        first_seen       := r.first_seen;
        expires_at       := r.expires_at;
        lease_remaining  := CASE WHEN outcome = 'acquired' THEN v_lease
                                 WHEN outcome = 'in_progress' THEN greatest(r.lease_expires_at - v_now, interval '0') END;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.adopt_key(bigint, text, timestamptz, date, date);
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.adopt_batch(bigint, integer);
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.adopt_start(text, regclass, text, text, text, interval);
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.adopt_exprs(idem.adoptions);
-- +goose StatementEnd

-- +goose StatementBegin
DROP TABLE IF EXISTS idem.adoptions;
-- +goose StatementEnd
