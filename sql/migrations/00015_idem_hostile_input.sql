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
-- * idem.check_key, version 15: a source must not contain an ASCII control
--   character (0x01-0x1F, 0x7F), the same rule as the Go client's: idem
--   joins a source and a key with one (chr(31)) for the per-key lock and
--   the wait channel, so no two (source, key) pairs can give one string.
--   idem.claim, version 15: version 13 sending such a source to check_key
--   from its first check (on Citus, delegated again, as migration 13).
--
-- * idem.count_duplicate, version 15: counts nothing in a transaction
--   that set idem.uncounted: the Go client's claim after a WithWait, whose
--   first claim counted the duplicate already (it was counted twice).
--
-- Down restores claim version 13, check_key version 1, adopt_batch and adopt_key version 9, release version 13
-- and count_duplicate version 10, and drops the counters.

-- +goose Up
-- +goose StatementBegin
-- check_key, version 15.
CREATE OR REPLACE FUNCTION idem.check_key(fn text, source text, key text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    IF source IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = fn || ': source must not be NULL';
    ELSIF key IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = fn || ': key must not be NULL';
    ELSIF btrim(source, E' \t\r\n') = '' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = fn || ': source must not be empty';
    ELSIF btrim(key, E' \t\r\n') = '' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = fn || ': key must not be empty';
    ELSIF source ~ '[\x01-\x1f\x7f]' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = fn || ': source must not contain a control character',
            HINT = 'A source is a short name such as ''stripe'': 1 to 64 bytes, no control characters (idem joins a source and a key with one).';
    ELSIF octet_length(source) > 64 THEN
        RAISE EXCEPTION USING ERRCODE = '22001',
            MESSAGE = fn || ': source is longer than 64 bytes',
            HINT = 'Use a short namespace such as ''stripe'' or ''github''.';
    ELSIF octet_length(key) > 512 THEN
        RAISE EXCEPTION USING ERRCODE = '22001',
            MESSAGE = fn || ': key is longer than 512 bytes',
            HINT = 'Hash long natural keys (the Go package has helpers).';
    END IF;
END
$$;
-- +goose StatementEnd

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

-- +goose StatementBegin
-- claim, version 15: version 13 with check_key's source rule in its
-- first check (a source holding a control character goes to check_key,
-- which refuses it).
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
    v_adopt_seen boolean := false;
    v_token    bigint;
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
       OR claim.source ~ '[\x01-\x1f\x7f]'
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

    -- (version 11) On Citus (idem.citus_setup sets idem.citus on this
    -- function) the key's lock below is the owning node's only: a claim
    -- that was not delegated to the node holding the key's shard would not
    -- exclude a delegated claim of the same key, so it is refused.
    IF current_setting('idem.citus', true) = 'on' THEN  -- (NULL elsewhere; AND would not stop at it)
        IF NOT idem.key_is_local(claim.key) THEN
            RAISE EXCEPTION USING ERRCODE = 'ID005',
                MESSAGE = 'idem.claim ran on a node that does not hold the key''s shard',
                DETAIL = 'On Citus the per-key lock is taken on the node that owns the key; this call was not delegated there.',
                HINT = 'Call it as SELECT ... FROM idem.claim(...) with the key as a constant or parameter (as idem''s Go API does), not from another query or function.';
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
            -- While a legacy table is being adopted (idemctl adopt), a key
            -- that is not in idem yet but processed in the legacy table is
            -- adopted now, under the key's lock, and answered below as the
            -- completed key it is.
            -- The live row in the window, if there is one: a duplicate is
            -- answered from it without preparing an insert.
            SELECT e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at
              INTO r FROM idem.processed_events e
             WHERE e.source = claim.source AND e.key = claim.key
               AND e.first_seen_month >= v_lo AND e.first_seen_month <= v_hi
               AND e.expires_at > v_now
             LIMIT 1;
            v_found := FOUND;
            IF NOT v_found AND NOT v_adopt_seen THEN
                -- While a legacy table is being adopted (idemctl adopt), a
                -- key that is not in idem yet but processed in the legacy
                -- table is adopted now, under the key's lock, and answered
                -- as the completed key it is (read again). Looked up once,
                -- and only for a key with no live row.
                v_adopt_seen := true;
                SELECT a.id INTO v_adopt FROM idem.adoptions a WHERE a.source = claim.source AND a.state = 'copying' LIMIT 1;
                IF v_adopt IS NOT NULL THEN
                    PERFORM idem.adopt_key(v_adopt, claim.key, v_now, v_lo, v_hi);
                    v_tries := v_tries - 1;
                    CONTINUE;
                END IF;
            END IF;
            IF NOT v_found THEN
                -- Held by the queue (its row may have expired, or sit in a
                -- month before the window): its job owns it.
                IF EXISTS (SELECT 1 FROM idem.holds h
                            WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued') THEN
                    outcome := 'in_progress';
                    EXIT;
                END IF;
                -- None: a new row in the current month (under the key's
                -- lock no other claim of the key writes meanwhile). (version
                -- 13) VALUES, and the token read first: Citus can neither
                -- run an INSERT .. SELECT .. ON CONFLICT DO NOTHING
                -- RETURNING that meets a conflict inside a function, nor
                -- a volatile function in a statement on a distributed table.
                v_token := idem.new_token();
                INSERT INTO idem.processed_events AS e
                       (source, key, first_seen_month, event_type, status, attempts, token,
                        lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
                VALUES (claim.source, claim.key, idem.utc_month(v_now), claim.event_type,
                        'processing', 1, v_token, v_now + v_lease, claim.fingerprint, v_now, v_now,
                        v_now + greatest(v_ttl, v_lease))
                ON CONFLICT DO NOTHING
                RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
                v_found := FOUND;
                IF v_found THEN
                    outcome := 'acquired';
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
            v_token := idem.new_token();  -- (version 13) not in the UPDATE: Citus refuses volatile functions there
            UPDATE idem.processed_events e
               SET status = 'processing',
                   attempts = e.attempts + 1,
                   token = v_token,
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

    -- (version 10) One acquisition in v_sample is counted, as v_sample, in
    -- its minute of idem.activity: the dashboard's claims per minute.
    IF outcome = 'acquired' AND v_sample > 0 AND v_iso <> 'serializable' AND (v_sample = 1 OR random() * v_sample < 1) THEN
        PERFORM idem.count_activity(claim.source, v_now, v_sample, 0);
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
-- On Citus, delegate the new claim in this transaction, as migration 13.
DO $$
BEGIN
    IF idem.distributed() THEN
        PERFORM idem.citus_setup();
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
-- check_key as migration 1 left it.
CREATE OR REPLACE FUNCTION idem.check_key(fn text, source text, key text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    IF source IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = fn || ': source must not be NULL';
    ELSIF key IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = fn || ': key must not be NULL';
    ELSIF btrim(source, E' \t\r\n') = '' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = fn || ': source must not be empty';
    ELSIF btrim(key, E' \t\r\n') = '' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = fn || ': key must not be empty';
    ELSIF octet_length(source) > 64 THEN
        RAISE EXCEPTION USING ERRCODE = '22001',
            MESSAGE = fn || ': source is longer than 64 bytes',
            HINT = 'Use a short namespace such as ''stripe'' or ''github''.';
    ELSIF octet_length(key) > 512 THEN
        RAISE EXCEPTION USING ERRCODE = '22001',
            MESSAGE = fn || ': key is longer than 512 bytes',
            HINT = 'Hash long natural keys (the Go package has helpers).';
    END IF;
END
$$;
-- +goose StatementEnd

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

-- +goose StatementBegin
-- claim as migration 13 left it.
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
    v_adopt_seen boolean := false;
    v_token    bigint;
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

    -- (version 11) On Citus (idem.citus_setup sets idem.citus on this
    -- function) the key's lock below is the owning node's only: a claim
    -- that was not delegated to the node holding the key's shard would not
    -- exclude a delegated claim of the same key, so it is refused.
    IF current_setting('idem.citus', true) = 'on' THEN  -- (NULL elsewhere; AND would not stop at it)
        IF NOT idem.key_is_local(claim.key) THEN
            RAISE EXCEPTION USING ERRCODE = 'ID005',
                MESSAGE = 'idem.claim ran on a node that does not hold the key''s shard',
                DETAIL = 'On Citus the per-key lock is taken on the node that owns the key; this call was not delegated there.',
                HINT = 'Call it as SELECT ... FROM idem.claim(...) with the key as a constant or parameter (as idem''s Go API does), not from another query or function.';
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
            -- While a legacy table is being adopted (idemctl adopt), a key
            -- that is not in idem yet but processed in the legacy table is
            -- adopted now, under the key's lock, and answered below as the
            -- completed key it is.
            -- The live row in the window, if there is one: a duplicate is
            -- answered from it without preparing an insert.
            SELECT e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at
              INTO r FROM idem.processed_events e
             WHERE e.source = claim.source AND e.key = claim.key
               AND e.first_seen_month >= v_lo AND e.first_seen_month <= v_hi
               AND e.expires_at > v_now
             LIMIT 1;
            v_found := FOUND;
            IF NOT v_found AND NOT v_adopt_seen THEN
                -- While a legacy table is being adopted (idemctl adopt), a
                -- key that is not in idem yet but processed in the legacy
                -- table is adopted now, under the key's lock, and answered
                -- as the completed key it is (read again). Looked up once,
                -- and only for a key with no live row.
                v_adopt_seen := true;
                SELECT a.id INTO v_adopt FROM idem.adoptions a WHERE a.source = claim.source AND a.state = 'copying' LIMIT 1;
                IF v_adopt IS NOT NULL THEN
                    PERFORM idem.adopt_key(v_adopt, claim.key, v_now, v_lo, v_hi);
                    v_tries := v_tries - 1;
                    CONTINUE;
                END IF;
            END IF;
            IF NOT v_found THEN
                -- Held by the queue (its row may have expired, or sit in a
                -- month before the window): its job owns it.
                IF EXISTS (SELECT 1 FROM idem.holds h
                            WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued') THEN
                    outcome := 'in_progress';
                    EXIT;
                END IF;
                -- None: a new row in the current month (under the key's
                -- lock no other claim of the key writes meanwhile). (version
                -- 13) VALUES, and the token read first: Citus can neither
                -- run an INSERT .. SELECT .. ON CONFLICT DO NOTHING
                -- RETURNING that meets a conflict inside a function, nor
                -- a volatile function in a statement on a distributed table.
                v_token := idem.new_token();
                INSERT INTO idem.processed_events AS e
                       (source, key, first_seen_month, event_type, status, attempts, token,
                        lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
                VALUES (claim.source, claim.key, idem.utc_month(v_now), claim.event_type,
                        'processing', 1, v_token, v_now + v_lease, claim.fingerprint, v_now, v_now,
                        v_now + greatest(v_ttl, v_lease))
                ON CONFLICT DO NOTHING
                RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
                v_found := FOUND;
                IF v_found THEN
                    outcome := 'acquired';
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
            v_token := idem.new_token();  -- (version 13) not in the UPDATE: Citus refuses volatile functions there
            UPDATE idem.processed_events e
               SET status = 'processing',
                   attempts = e.attempts + 1,
                   token = v_token,
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

    -- (version 10) One acquisition in v_sample is counted, as v_sample, in
    -- its minute of idem.activity: the dashboard's claims per minute.
    IF outcome = 'acquired' AND v_sample > 0 AND v_iso <> 'serializable' AND (v_sample = 1 OR random() * v_sample < 1) THEN
        PERFORM idem.count_activity(claim.source, v_now, v_sample, 0);
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
-- On Citus, delegate the new claim in this transaction, as migration 13.
DO $$
BEGIN
    IF idem.distributed() THEN
        PERFORM idem.citus_setup();
    END IF;
END
$$;
-- +goose StatementEnd
