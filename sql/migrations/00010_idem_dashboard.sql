-- idem 10: what an operator's page reads (package dashboard, idemctl run --http).
--
-- Every query of the dashboard reads an index or the catalog, whatever the
-- size of processed_events; what would need a scan of it is counted as it
-- happens, or taken by a maintenance step and stored:
--
-- * idem.activity (UNLOGGED, like the duplicate counts: statistics, emptied
--   by a crash): per UTC minute and source, acquisitions and duplicates,
--   sampled as the duplicate counts are (1 in the policy's
--   duplicate_sampling counted, as that many). idem.claim, version 10,
--   counts an acquisition there; idem.count_duplicate, version 10, a
--   duplicate. One row per (minute, source, backend), so no two sessions
--   wait for one row; idem.compact_duplicate_counts, version 10 (run by
--   prune), folds finished minutes into slot 0 and deletes minutes older
--   than 8 days.
-- * idem.claim, version 10, is also leaner on the duplicate path (issue 28):
--   the live row is read alone, and the insert and the adoption probe come
--   only when there is none: duplicates 1.19x of the claim without this (pgbench,
--   8 clients), new keys unchanged.
-- * idem.source_stats(): the one scan that counts keys by status per source
--   (idemctl stats runs it live); idem.snapshot_stats() stores its rows with
--   the time they were taken in idem.source_snapshots (idemctl run does, on
--   --stats-schedule; pg_cron users schedule SELECT idem.snapshot_stats()).
-- * idem.runs: the last 100 runs of each maintenance job (prune, rotate,
--   snapshot) with their figures, written by idem.record_run, which idemctl
--   and CALL idem.prune() / CALL idem.rotate() (version 10) call at the end
--   of a run.
-- * grant_maintainer gives snapshot_stats, record_run and reading the new
--   tables; grant_app nothing new (claims count through idem.claim).
--
-- Down restores version 9's functions and procedures and drops what version
-- 10 added.

-- +goose Up
-- +goose StatementBegin
CREATE UNLOGGED TABLE idem.activity (
    minute     timestamptz NOT NULL,
    source     text        NOT NULL,
    slot       integer     NOT NULL,
    acquired   bigint      NOT NULL DEFAULT 0,
    duplicates bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (minute, source, slot)
);
-- +goose StatementEnd

-- +goose StatementBegin
-- The UTC minute of t (whatever the session's TimeZone). STABLE, as extract
-- from a timestamptz is: an IMMUTABLE declaration would keep it from being
-- inlined into the queries that call it.
CREATE FUNCTION idem.activity_minute(t timestamptz) RETURNS timestamptz
    LANGUAGE sql STABLE PARALLEL SAFE
AS $$
SELECT pg_catalog.to_timestamp(pg_catalog.floor(extract(epoch FROM t) / 60) * 60)
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Adds to the source's row of the minute of p_now for this backend. Called
-- by idem.claim and idem.count_duplicate, which run as idem's owner with
-- their search_path pinned; granted to no role. plpgsql, without SET
-- clauses: its INSERT's plan is cached for the session (a SQL function with
-- a SET clause is parsed and planned again at every call: 80 us).
CREATE FUNCTION idem.count_activity(p_source text, p_now timestamptz, p_acquired integer, p_duplicates integer)
    RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    INSERT INTO idem.activity AS a (minute, source, slot, acquired, duplicates)
    VALUES (idem.activity_minute(p_now), p_source, pg_catalog.pg_backend_pid(), p_acquired, p_duplicates)
    ON CONFLICT (minute, source, slot) DO UPDATE
       SET acquired = a.acquired + EXCLUDED.acquired, duplicates = a.duplicates + EXCLUDED.duplicates;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.count_activity(text, timestamptz, integer, integer) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- Per source: keys by status, retried, stuck (processing past its lease) and
-- expired (not pruned yet). A full scan of processed_events: an operator's
-- command or a scheduled snapshot, never a page's query.
CREATE FUNCTION idem.source_stats()
RETURNS TABLE (source text, keys bigint, processing bigint, completed bigint, unstored bigint,
               released bigint, failed bigint, retried bigint, stuck bigint, expired bigint,
               oldest timestamptz, newest timestamptz)
    LANGUAGE sql STABLE
    SET search_path = pg_catalog, pg_temp
AS $$
SELECT e.source,
       count(*),
       count(*) FILTER (WHERE e.status = 'processing'),
       count(*) FILTER (WHERE e.status = 'completed'),
       count(*) FILTER (WHERE e.status = 'completed' AND e.last_error IS NOT NULL),
       -- failed and released for a retry (the next delivery runs it again)
       -- apart from failed for good (fail(retryable => false), max_attempts).
       count(*) FILTER (WHERE e.status = 'failed' AND e.retryable IS DISTINCT FROM false),
       count(*) FILTER (WHERE e.status = 'failed' AND e.retryable = false),
       count(*) FILTER (WHERE e.attempts > 1),
       count(*) FILTER (WHERE e.status = 'processing' AND e.lease_expires_at < c.now),
       count(*) FILTER (WHERE e.expires_at < c.now),
       min(e.first_seen),
       max(e.first_seen)
  FROM idem.processed_events e, (SELECT idem.clock() AS now) c
 GROUP BY e.source
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.source_stats() FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE TABLE idem.source_snapshots (
    source     text        PRIMARY KEY,
    taken_at   timestamptz NOT NULL,
    took       interval    NOT NULL,
    keys       bigint      NOT NULL,
    processing bigint      NOT NULL,
    completed  bigint      NOT NULL,
    unstored   bigint      NOT NULL,
    released   bigint      NOT NULL,
    failed     bigint      NOT NULL,
    retried    bigint      NOT NULL,
    stuck      bigint      NOT NULL,
    expired    bigint      NOT NULL,
    oldest     timestamptz,
    newest     timestamptz
);
-- +goose StatementEnd

-- +goose StatementBegin
-- Takes idem.source_stats() and stores it, replacing the previous snapshot
-- (a source with no keys left disappears). Returns the number of sources.
CREATE FUNCTION idem.snapshot_stats() RETURNS integer
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_start timestamptz := clock_timestamp();
    v_n     integer;
BEGIN
    WITH r AS (SELECT * FROM idem.source_stats()),
    gone AS (DELETE FROM idem.source_snapshots s WHERE NOT EXISTS (SELECT 1 FROM r WHERE r.source = s.source))
    INSERT INTO idem.source_snapshots AS s
           (source, taken_at, took, keys, processing, completed, unstored, released, failed, retried, stuck, expired, oldest, newest)
    SELECT r.source, idem.clock(), clock_timestamp() - v_start, r.keys, r.processing, r.completed, r.unstored, r.released,
           r.failed, r.retried, r.stuck, r.expired, r.oldest, r.newest
      FROM r
    ON CONFLICT (source) DO UPDATE
       SET taken_at = EXCLUDED.taken_at, took = EXCLUDED.took, keys = EXCLUDED.keys, processing = EXCLUDED.processing,
           completed = EXCLUDED.completed, unstored = EXCLUDED.unstored, released = EXCLUDED.released,
           failed = EXCLUDED.failed, retried = EXCLUDED.retried, stuck = EXCLUDED.stuck, expired = EXCLUDED.expired,
           oldest = EXCLUDED.oldest, newest = EXCLUDED.newest;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.snapshot_stats() FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE TABLE idem.runs (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job         text        NOT NULL CONSTRAINT runs_job_check CHECK (job IN ('prune', 'rotate', 'snapshot')),
    started_at  timestamptz NOT NULL,
    finished_at timestamptz NOT NULL,
    outcome     text        NOT NULL CONSTRAINT runs_outcome_check
                            CHECK (outcome IN ('ok', 'skipped', 'interrupted', 'incomplete', 'error')),
    figures     jsonb       NOT NULL DEFAULT '{}',
    error       text,
    run_by      text        NOT NULL
);
-- +goose StatementEnd

-- +goose StatementBegin
CREATE INDEX runs_job_idx ON idem.runs (job, finished_at DESC);
-- +goose StatementEnd

-- +goose StatementBegin
-- Records one maintenance run (the end time is now) and keeps the last 100
-- runs of the job. An error's text is cut to 1000 characters.
CREATE FUNCTION idem.record_run(job text, started_at timestamptz, outcome text, figures jsonb,
                                error text, run_by text) RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_id bigint;
BEGIN
    INSERT INTO idem.runs (job, started_at, finished_at, outcome, figures, error, run_by)
    VALUES (record_run.job, record_run.started_at, clock_timestamp(), record_run.outcome,
            coalesce(record_run.figures, '{}'), left(record_run.error, 1000), coalesce(record_run.run_by, ''))
    RETURNING id INTO v_id;
    DELETE FROM idem.runs r
     WHERE r.job = record_run.job
       AND r.id < (SELECT x.id FROM idem.runs x WHERE x.job = record_run.job ORDER BY x.id DESC OFFSET 99 LIMIT 1);
    RETURN v_id;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.record_run(text, timestamptz, text, jsonb, text, text) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- idem.count_duplicate, version 10: the duplicate is also counted in its
-- minute of idem.activity.
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
-- idem.compact_duplicate_counts, version 10: also folds idem.activity.
CREATE OR REPLACE FUNCTION idem.compact_duplicate_counts() RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_n bigint;
BEGIN
    WITH moved AS (
        DELETE FROM idem.duplicate_counts d
         WHERE d.slot <> 0
           AND (d.source, d.slot) IN (SELECT x.source, x.slot FROM idem.duplicate_counts x
                                       WHERE x.slot <> 0 FOR UPDATE SKIP LOCKED)
        RETURNING d.*),
    sums AS (
        SELECT m.source, sum(m.duplicates) AS duplicates, min(m.since) AS since, max(m.last_seen_at) AS last_seen_at,
               count(*) AS n
          FROM moved m GROUP BY m.source),
    ins AS (
        INSERT INTO idem.duplicate_counts AS d (source, slot, duplicates, since, last_seen_at)
        SELECT s.source, 0, s.duplicates, s.since, s.last_seen_at FROM sums s
        ON CONFLICT (source, slot) DO UPDATE
           SET duplicates = d.duplicates + EXCLUDED.duplicates,
               since = least(d.since, EXCLUDED.since),
               last_seen_at = greatest(d.last_seen_at, EXCLUDED.last_seen_at))
    SELECT coalesce(sum(n), 0) INTO v_n FROM sums;
    -- The inbox's counts, the same way (version 7).
    WITH moved AS (
        DELETE FROM idem.queue_counts d
         WHERE d.slot <> 0
           AND (d.source, d.slot) IN (SELECT x.source, x.slot FROM idem.queue_counts x
                                       WHERE x.slot <> 0 FOR UPDATE SKIP LOCKED)
        RETURNING d.*),
    sums AS (
        SELECT m.source, sum(m.accepted) AS accepted, sum(m.processed) AS processed, min(m.since) AS since,
               count(*) AS n
          FROM moved m GROUP BY m.source),
    ins AS (
        INSERT INTO idem.queue_counts AS d (source, slot, accepted, processed, since)
        SELECT s.source, 0, s.accepted, s.processed, s.since FROM sums s
        ON CONFLICT (source, slot) DO UPDATE
           SET accepted = d.accepted + EXCLUDED.accepted,
               processed = d.processed + EXCLUDED.processed,
               since = least(d.since, EXCLUDED.since))
    SELECT v_n + coalesce(sum(n), 0) INTO v_n FROM sums;
    -- (version 10) idem.activity: the slots of each finished minute folded
    -- into slot 0, and minutes older than 8 days deleted.
    DELETE FROM idem.activity a WHERE a.minute < idem.clock() - interval '8 days';
    WITH moved AS (
        DELETE FROM idem.activity d
         WHERE d.slot <> 0 AND d.minute < idem.activity_minute(idem.clock())
           AND (d.minute, d.source, d.slot) IN (SELECT x.minute, x.source, x.slot FROM idem.activity x
                                                 WHERE x.slot <> 0 AND x.minute < idem.activity_minute(idem.clock())
                                                   FOR UPDATE SKIP LOCKED)
        RETURNING d.*),
    sums AS (
        SELECT m.minute, m.source, sum(m.acquired) AS acquired, sum(m.duplicates) AS duplicates, count(*) AS n
          FROM moved m GROUP BY m.minute, m.source),
    ins AS (
        INSERT INTO idem.activity AS d (minute, source, slot, acquired, duplicates)
        SELECT s.minute, s.source, 0, s.acquired, s.duplicates FROM sums s
        ON CONFLICT (minute, source, slot) DO UPDATE
           SET acquired = d.acquired + EXCLUDED.acquired, duplicates = d.duplicates + EXCLUDED.duplicates)
    SELECT v_n + coalesce(sum(n), 0) INTO v_n FROM sums;
    RETURN v_n;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- idem.claim, version 10 (same signature and outcomes as version 9): an
-- acquisition is counted (sampled) in idem.activity; the live row is read by
-- a SELECT of its own and the insert runs only when there is none (version
-- 9's one WITH statement prepared the insert for a duplicate too), and the
-- adoptions are looked up only for a key with no live row.
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
                -- None: a new row in the current month (under the key's
                -- lock no other claim of the key writes meanwhile).
                INSERT INTO idem.processed_events AS e
                       (source, key, first_seen_month, event_type, status, attempts, token,
                        lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
                SELECT claim.source, claim.key, idem.utc_month(v_now), claim.event_type,
                       'processing', 1, idem.new_token(), v_now + v_lease, claim.fingerprint, v_now, v_now,
                       v_now + greatest(v_ttl, v_lease)
                 WHERE NOT EXISTS (SELECT 1 FROM idem.holds h
                                    WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued')
                ON CONFLICT DO NOTHING
                RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
                v_found := FOUND;
                IF v_found THEN
                    outcome := 'acquired';
                    EXIT;
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
-- For pg_cron: CALL idem.prune(); version 10 records the run in idem.runs.
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
-- +goose StatementEnd

-- +goose StatementBegin
-- For pg_cron: CALL idem.rotate(); version 10 records the run in idem.runs.
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
-- +goose StatementEnd

-- +goose StatementBegin
-- grant_maintainer, version 10: the dashboard's reads, snapshot_stats and
-- record_run.
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

-- +goose StatementBegin
-- Roles granted before get version 10's rights.
DO $$
DECLARE r record;
BEGIN
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
-- grant_maintainer, version 8.
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
-- CALL idem.prune() / idem.rotate(), version 6.
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
-- idem.claim, version 9.
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

-- +goose StatementBegin
-- idem.compact_duplicate_counts, version 7.
CREATE OR REPLACE FUNCTION idem.compact_duplicate_counts() RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_n bigint;
BEGIN
    WITH moved AS (
        DELETE FROM idem.duplicate_counts d
         WHERE d.slot <> 0
           AND (d.source, d.slot) IN (SELECT x.source, x.slot FROM idem.duplicate_counts x
                                       WHERE x.slot <> 0 FOR UPDATE SKIP LOCKED)
        RETURNING d.*),
    sums AS (
        SELECT m.source, sum(m.duplicates) AS duplicates, min(m.since) AS since, max(m.last_seen_at) AS last_seen_at,
               count(*) AS n
          FROM moved m GROUP BY m.source),
    ins AS (
        INSERT INTO idem.duplicate_counts AS d (source, slot, duplicates, since, last_seen_at)
        SELECT s.source, 0, s.duplicates, s.since, s.last_seen_at FROM sums s
        ON CONFLICT (source, slot) DO UPDATE
           SET duplicates = d.duplicates + EXCLUDED.duplicates,
               since = least(d.since, EXCLUDED.since),
               last_seen_at = greatest(d.last_seen_at, EXCLUDED.last_seen_at))
    SELECT coalesce(sum(n), 0) INTO v_n FROM sums;
    -- The inbox's counts, the same way (version 7).
    WITH moved AS (
        DELETE FROM idem.queue_counts d
         WHERE d.slot <> 0
           AND (d.source, d.slot) IN (SELECT x.source, x.slot FROM idem.queue_counts x
                                       WHERE x.slot <> 0 FOR UPDATE SKIP LOCKED)
        RETURNING d.*),
    sums AS (
        SELECT m.source, sum(m.accepted) AS accepted, sum(m.processed) AS processed, min(m.since) AS since,
               count(*) AS n
          FROM moved m GROUP BY m.source),
    ins AS (
        INSERT INTO idem.queue_counts AS d (source, slot, accepted, processed, since)
        SELECT s.source, 0, s.accepted, s.processed, s.since FROM sums s
        ON CONFLICT (source, slot) DO UPDATE
           SET accepted = d.accepted + EXCLUDED.accepted,
               processed = d.processed + EXCLUDED.processed,
               since = least(d.since, EXCLUDED.since))
    SELECT v_n + coalesce(sum(n), 0) INTO v_n FROM sums;
    RETURN v_n;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- idem.count_duplicate, version 5.
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
DROP FUNCTION IF EXISTS idem.record_run(text, timestamptz, text, jsonb, text, text);
-- +goose StatementEnd

-- +goose StatementBegin
DROP TABLE IF EXISTS idem.runs;
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.snapshot_stats();
-- +goose StatementEnd

-- +goose StatementBegin
DROP TABLE IF EXISTS idem.source_snapshots;
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.source_stats();
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.count_activity(text, timestamptz, integer, integer);
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.activity_minute(timestamptz);
-- +goose StatementEnd

-- +goose StatementBegin
DROP TABLE IF EXISTS idem.activity;
-- +goose StatementEnd
