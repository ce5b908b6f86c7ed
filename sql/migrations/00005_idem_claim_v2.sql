-- idem 5: claim v2. Cost flat in the months retained, read-only
-- duplicates, fewer statements per claim. See docs/design.md ("Claim v2")
-- and docs/performance.md.
--
-- * idem.lookbacks: per source, how long a row can stay live after its
--   first_seen (only ever grows). A live row of a source always sits in a
--   month no older than utc_month(now - lookback), so a claim probes only
--   the months from there to the next month instead of every partition.
--   Raised by a policy's ttl (trigger), by a claim with a longer ttl, and
--   before a reacquire or extend pushes expires_at further, always under
--   the key's advisory lock that claims take before reading it.
-- * idem.claim takes the key's advisory lock first (try, then the bounded
--   wait of version 4 when another claim of the key is in an open
--   transaction), then one statement probes the window and, only when no
--   live row is there, inserts into the current month. A duplicate is
--   answered without a write and without a row lock.
-- * Duplicates are counted per source in idem.duplicate_counts, an
--   UNLOGGED table (no WAL, no flush at commit; emptied by a crash), one
--   duplicate in duplicate_sampling counted as duplicate_sampling.
--   Counting into the key's own row (processed_events.duplicates and
--   last_seen_at, a logged write) is now opt-in: policies.count_per_key.
-- * complete, complete_unstored, fail and extend look in the previous,
--   current and next month first, then everywhere (as before) only when
--   the row is not there.
--
-- Down restores version 4's functions and drops what version 5 added.

-- +goose Up
-- +goose StatementBegin
CREATE TABLE idem.lookbacks (
    source    text PRIMARY KEY,
    lookback  interval NOT NULL CONSTRAINT lookbacks_lookback_check CHECK (lookback > interval '0'),
    raised_at timestamptz NOT NULL DEFAULT now()
);
-- +goose StatementEnd

-- +goose StatementBegin
COMMENT ON TABLE idem.lookbacks IS
    'Per source (''*'': every source), an upper bound on expires_at - first_seen of its rows; a claim uses the larger of its source''s and ''*''. Only ever raised; managed by idem.';
-- +goose StatementEnd

-- +goose StatementBegin
-- A whole number of days no shorter than the interval i can last from any
-- starting point, in any time zone: a month counts 31 days, a year 12 such
-- months, and a day more covers a daylight-saving hour and rounding.
CREATE FUNCTION idem.days_at_most(i interval) RETURNS interval
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
SELECT pg_catalog.make_interval(days =>
           (CASE WHEN pg_catalog.date_part('year', i) * 12 + pg_catalog.date_part('month', i) >= 0 THEN 31 ELSE 28 END)
             * (pg_catalog.date_part('year', i) * 12 + pg_catalog.date_part('month', i))::int
           + pg_catalog.date_part('day', i)::int
           + pg_catalog.ceil((pg_catalog.date_part('hour', i) * 3600 + pg_catalog.date_part('minute', i) * 60
                              + pg_catalog.date_part('second', i)) / 86400.0)::int
           + 1)
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- The oldest month that can hold a row live at ts for a lookback, in UTC.
CREATE FUNCTION idem.window_start(ts timestamptz, lookback interval) RETURNS date
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT pg_catalog.date_trunc('month', (ts AT TIME ZONE 'UTC') - lookback)::date $$;
-- +goose StatementEnd

-- +goose StatementBegin
-- What a row's life is measured from: first_seen, or the start of its month
-- when the month was stored wrong (version 3 and older computed it in the
-- server's time zone).
CREATE FUNCTION idem.row_anchor(first_seen timestamptz, first_seen_month date) RETURNS timestamptz
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT CASE WHEN idem.utc_month(first_seen) = first_seen_month THEN first_seen
                  ELSE first_seen_month::timestamp AT TIME ZONE 'UTC' END $$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Raises the lookback of p_source ('*' for all sources) to at least p_need,
-- rounded up to whole days plus one. Returns the lookback now in force for
-- the source (its own or '*', the larger). Callers that write expires_at
-- hold the key's advisory lock; the raise commits with their write.
CREATE FUNCTION idem.raise_lookback(p_source text, p_need interval) RETURNS interval
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v interval := make_interval(days => ceil(extract(epoch FROM p_need) / 86400)::int + 1);
BEGIN
    IF p_source IS NULL OR p_need IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.raise_lookback: source and need must not be NULL';
    END IF;
    INSERT INTO idem.lookbacks AS l (source, lookback) VALUES (p_source, v)
    ON CONFLICT (source) DO UPDATE SET lookback = EXCLUDED.lookback, raised_at = now()
     WHERE l.lookback < EXCLUDED.lookback;
    RETURN (SELECT max(l.lookback) FROM idem.lookbacks l WHERE l.source IN (p_source, '*'));
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.raise_lookback(text, interval) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- A policy's ttl is a lookback of its source.
CREATE FUNCTION idem.policies_raise_lookback() RETURNS trigger
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM idem.raise_lookback(NEW.source, idem.days_at_most(greatest(NEW.ttl, NEW.lease)));
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.policies_raise_lookback() FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE TRIGGER policies_raise_lookback AFTER INSERT OR UPDATE OF source, ttl, lease ON idem.policies
    FOR EACH ROW EXECUTE FUNCTION idem.policies_raise_lookback();
-- +goose StatementEnd

-- +goose StatementBegin
-- Existing installations: every policy's ttl, and what the stored rows
-- need (a processing row can still be extended, so it counts even when its
-- expires_at has passed).
SELECT idem.raise_lookback(p.source, idem.days_at_most(greatest(p.ttl, p.lease))) FROM idem.policies p;
-- +goose StatementEnd

-- +goose StatementBegin
SELECT idem.raise_lookback('*', interval '30 days')
 WHERE NOT EXISTS (SELECT 1 FROM idem.lookbacks WHERE source = '*');
-- +goose StatementEnd

-- +goose StatementBegin
SELECT idem.raise_lookback(x.source, x.need)
  FROM (SELECT e.source, max(e.expires_at - idem.row_anchor(e.first_seen, e.first_seen_month)) AS need
          FROM idem.processed_events e
         WHERE e.expires_at > now() - interval '1 day' OR e.status = 'processing'
         GROUP BY e.source) x
 WHERE x.need > interval '0';
-- +goose StatementEnd

-- +goose StatementBegin
-- Per-source duplicate counts. UNLOGGED: counting writes no WAL and waits
-- for no flush; a crash empties the table (counts are statistics). One row
-- per source and backend (slot = pg_backend_pid(), so two sessions never
-- wait for each other's row); idem.compact_duplicate_counts folds them
-- into slot 0.
CREATE UNLOGGED TABLE idem.duplicate_counts (
    source       text     NOT NULL,
    slot         integer  NOT NULL,
    duplicates   bigint   NOT NULL DEFAULT 0,
    since        timestamptz NOT NULL DEFAULT now(),
    last_seen_at timestamptz,
    PRIMARY KEY (source, slot)
);
-- +goose StatementEnd

-- +goose StatementBegin
INSERT INTO idem.duplicate_counts (source, slot, duplicates, since, last_seen_at)
SELECT e.source, 0, sum(e.duplicates), min(e.first_seen), max(e.last_seen_at)
  FROM idem.processed_events e
 GROUP BY e.source
HAVING sum(e.duplicates) > 0;
-- +goose StatementEnd

-- +goose StatementBegin
ALTER TABLE idem.policies ADD COLUMN count_per_key boolean NOT NULL DEFAULT false;
-- +goose StatementEnd

-- +goose StatementBegin
COMMENT ON COLUMN idem.policies.count_per_key IS
    'Also count sampled duplicates in the key''s own row (processed_events.duplicates, last_seen_at): a logged write on the duplicate path. Off by default; per-source counts are always kept in idem.duplicate_counts.';
-- +goose StatementEnd

-- +goose StatementBegin
-- Counts one sampled duplicate (as p_weight) for the source, and in the
-- key's row when the policy asks for it. Never waits for a row.
CREATE FUNCTION idem.count_duplicate(p_source text, p_key text, p_month date, p_weight integer,
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
REVOKE ALL ON FUNCTION idem.count_duplicate(text, text, date, integer, boolean, timestamptz) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- Folds every slot of a source into slot 0 (maintainers may run it; rows
-- a live session is writing are skipped).
CREATE FUNCTION idem.compact_duplicate_counts() RETURNS bigint
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
    RETURN v_n;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.compact_duplicate_counts() FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- What a live row answers without the key being taken over: mismatch,
-- completed, failed (permanently), in_progress (live lease), or NULL (a lost
-- lease or a retryable failure: the claim may take the key). Inlined into
-- the claim's expressions.
CREATE FUNCTION idem.settled_outcome(status text, retryable boolean, lease_expires_at timestamptz,
                                     stored_fingerprint text, fingerprint text, at timestamptz) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
SELECT CASE
    WHEN fingerprint IS NOT NULL AND stored_fingerprint IS NOT NULL
         AND stored_fingerprint <> fingerprint THEN 'mismatch'
    WHEN status = 'completed' THEN 'completed'
    WHEN status = 'failed' AND NOT retryable THEN 'failed'
    WHEN status = 'processing' AND lease_expires_at > at THEN 'in_progress'
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- idem.claim, version 5 (same signature and outcomes as version 4).
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
                ON CONFLICT DO NOTHING
                RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at, true AS inserted)
            SELECT * INTO r FROM i UNION ALL SELECT * FROM f;
            v_found := FOUND;
            IF v_found AND r.inserted THEN
                outcome := 'acquired';
                EXIT;
            END IF;
            IF NOT v_found THEN
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
            -- the key's lock).
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
-- idem.complete, version 5: the key's row is looked for in the previous,
-- current and next month first (where a key being worked on almost always
-- is), then, as before, everywhere.
CREATE OR REPLACE FUNCTION idem.complete(source text, key text, token bigint, result jsonb DEFAULT NULL)
RETURNS text
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_now    timestamptz;
    v_month  date;
    v_window date[];
    v_status text;
    v_token  bigint;
BEGIN
    PERFORM idem.check_key('idem.complete', complete.source, complete.key);
    IF complete.token IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.complete: token must not be NULL';
    END IF;
    IF pg_column_size(complete.result) > 1048576 THEN
        RAISE EXCEPTION USING ERRCODE = '54000',
            MESSAGE = format('idem.complete: result is %s bytes, over the 1 MiB limit', pg_column_size(complete.result)),
            HINT = 'Store large results in your own table and keep a reference in the result.';
    END IF;
    v_now := idem.clock();
    v_month := idem.utc_month(v_now);
    -- The previous, current and next month first (where a key being
    -- worked on almost always is: a few partitions), then every month.
    FOREACH v_window SLICE 1 IN ARRAY ARRAY[[(v_month - interval '1 month')::date, (v_month + interval '1 month')::date],
                                           ['-infinity'::date, 'infinity'::date]] LOOP
        UPDATE idem.processed_events e
           SET status = 'completed', result = complete.result, completed_at = v_now, updated_at = v_now,
               lease_expires_at = NULL, retryable = NULL, last_error = NULL
         WHERE e.source = complete.source AND e.key = complete.key
           AND e.first_seen_month >= v_window[1] AND e.first_seen_month <= v_window[2]
           AND e.token = complete.token AND e.status = 'processing';
        IF FOUND THEN
            RETURN 'completed';
        END IF;
    END LOOP;
    SELECT e.status, e.token INTO v_status, v_token
      FROM idem.processed_events e
     WHERE e.source = complete.source AND e.key = complete.key
     ORDER BY e.token = complete.token DESC
     LIMIT 1;
    IF NOT FOUND THEN
        RETURN 'not_found';
    ELSIF v_token = complete.token AND v_status = 'completed' THEN
        RETURN 'already_completed';
    END IF;
    RETURN 'stale_token';
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.complete_unstored(source text, key text, token bigint, reason text)
RETURNS text
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_now    timestamptz;
    v_month  date;
    v_window date[];
    v_status text;
    v_token  bigint;
    v_error  text;
BEGIN
    PERFORM idem.check_key('idem.complete_unstored', complete_unstored.source, complete_unstored.key);
    IF complete_unstored.token IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.complete_unstored: token must not be NULL';
    END IF;
    v_now := idem.clock();
    v_month := idem.utc_month(v_now);
    v_error := left('result not stored: ' || coalesce(complete_unstored.reason, 'no reason given'), 8192);
    -- The previous, current and next month first (where a key being
    -- worked on almost always is: a few partitions), then every month.
    FOREACH v_window SLICE 1 IN ARRAY ARRAY[[(v_month - interval '1 month')::date, (v_month + interval '1 month')::date],
                                           ['-infinity'::date, 'infinity'::date]] LOOP
        UPDATE idem.processed_events e
           SET status = 'completed', result = NULL, completed_at = v_now, updated_at = v_now,
               lease_expires_at = NULL, retryable = NULL, last_error = v_error
         WHERE e.source = complete_unstored.source AND e.key = complete_unstored.key
           AND e.first_seen_month >= v_window[1] AND e.first_seen_month <= v_window[2]
           AND e.token = complete_unstored.token AND e.status = 'processing';
        IF FOUND THEN
            RETURN 'completed';
        END IF;
    END LOOP;
    SELECT e.status, e.token INTO v_status, v_token
      FROM idem.processed_events e
     WHERE e.source = complete_unstored.source AND e.key = complete_unstored.key
     ORDER BY e.token = complete_unstored.token DESC
     LIMIT 1;
    IF NOT FOUND THEN
        RETURN 'not_found';
    ELSIF v_token = complete_unstored.token AND v_status = 'completed' THEN
        RETURN 'already_completed';
    END IF;
    RETURN 'stale_token';
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.fail(source text, key text, token bigint, error text DEFAULT NULL, retryable boolean DEFAULT true)
RETURNS text
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_now   timestamptz;
    v_month date;
    v_window date[];
    v_error text;
BEGIN
    PERFORM idem.check_key('idem.fail', fail.source, fail.key);
    IF fail.token IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.fail: token must not be NULL';
    END IF;
    v_now := idem.clock();
    v_month := idem.utc_month(v_now);
    v_error := left(coalesce(fail.error, 'failed'), 8192);
    -- The previous, current and next month first (where a key being
    -- worked on almost always is: a few partitions), then every month.
    FOREACH v_window SLICE 1 IN ARRAY ARRAY[[(v_month - interval '1 month')::date, (v_month + interval '1 month')::date],
                                           ['-infinity'::date, 'infinity'::date]] LOOP
        UPDATE idem.processed_events e
           SET status = 'failed', retryable = coalesce(fail.retryable, true),
               last_error = v_error, lease_expires_at = NULL, updated_at = v_now
         WHERE e.source = fail.source AND e.key = fail.key
           AND e.first_seen_month >= v_window[1] AND e.first_seen_month <= v_window[2]
           AND e.token = fail.token AND e.status = 'processing';
        IF FOUND THEN
            RETURN 'failed';
        END IF;
    END LOOP;
    PERFORM 1 FROM idem.processed_events e
     WHERE e.source = fail.source AND e.key = fail.key AND e.token = fail.token AND e.status = 'failed';
    IF FOUND THEN
        RETURN 'failed';
    END IF;
    PERFORM 1 FROM idem.processed_events e WHERE e.source = fail.source AND e.key = fail.key;
    IF NOT FOUND THEN
        RETURN 'not_found';
    END IF;
    RETURN 'stale_token';
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- idem.extend, version 5. A lease that stays inside the key's expires_at
-- (the common case) is one windowed update. One that pushes expires_at
-- further takes the key's advisory lock first, as claims do, and raises the
-- source's lookback before the row outlives it.
CREATE OR REPLACE FUNCTION idem.extend(source text, key text, token bigint, lease interval DEFAULT NULL)
RETURNS TABLE (outcome text, lease_expires_at timestamptz)
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_now      timestamptz;
    v_month    date;
    v_lease    interval := extend.lease;
    v_until    timestamptz;
    v_lookback interval;
    v_need     interval;
    r          record;
BEGIN
    PERFORM idem.check_key('idem.extend', extend.source, extend.key);
    IF extend.token IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.extend: token must not be NULL';
    END IF;
    IF v_lease IS NULL THEN
        SELECT x.lease INTO v_lease
          FROM (SELECT p.lease FROM idem.policies p WHERE p.source = extend.source
                UNION ALL
                SELECT p.lease FROM idem.policies p WHERE p.source = '*'
                 LIMIT 1) x;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = '42704',
                MESSAGE = format('idem.extend: no policy for source %L and no default policy', extend.source);
        END IF;
    ELSIF NOT idem.valid_lease(v_lease) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('idem.extend: lease %s is out of range', v_lease),
            HINT = 'lease must be between 1 second and 7 days.';
    END IF;
    v_now := idem.clock();
    v_month := idem.utc_month(v_now);
    UPDATE idem.processed_events e
       SET lease_expires_at = v_now + v_lease, updated_at = v_now
     WHERE e.source = extend.source AND e.key = extend.key
       AND e.first_seen_month >= (v_month - interval '1 month')::date
       AND e.first_seen_month <= (v_month + interval '1 month')::date
       AND e.token = extend.token AND e.status = 'processing'
       AND e.expires_at >= v_now + v_lease
    RETURNING e.lease_expires_at INTO v_until;
    IF FOUND THEN
        RETURN QUERY SELECT 'extended'::text, v_until;
        RETURN;
    END IF;

    PERFORM pg_advisory_xact_lock(1768187245, hashtext(extend.source || chr(31) || extend.key));
    v_now := idem.clock();
    SELECT e.first_seen, e.first_seen_month, e.expires_at INTO r
      FROM idem.processed_events e
     WHERE e.source = extend.source AND e.key = extend.key
       AND e.token = extend.token AND e.status = 'processing';
    IF FOUND AND r.expires_at < v_now + v_lease THEN
        v_need := (v_now + v_lease) - idem.row_anchor(r.first_seen, r.first_seen_month);
        SELECT max(l.lookback) INTO v_lookback FROM idem.lookbacks l WHERE l.source IN (extend.source, '*');
        IF v_lookback IS NULL OR v_need > v_lookback THEN
            PERFORM idem.raise_lookback(extend.source, v_need);
        END IF;
    END IF;
    UPDATE idem.processed_events e
       SET lease_expires_at = v_now + v_lease, updated_at = v_now,
           expires_at = greatest(e.expires_at, v_now + v_lease)
     WHERE e.source = extend.source AND e.key = extend.key
       AND e.token = extend.token AND e.status = 'processing'
    RETURNING e.lease_expires_at INTO v_until;
    IF FOUND THEN
        RETURN QUERY SELECT 'extended'::text, v_until;
        RETURN;
    END IF;
    PERFORM 1 FROM idem.processed_events e WHERE e.source = extend.source AND e.key = extend.key;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::timestamptz;
    ELSE
        RETURN QUERY SELECT 'stale_token'::text, NULL::timestamptz;
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
        idem.compact_duplicate_counts() TO %s', role);
    EXECUTE format('GRANT EXECUTE ON PROCEDURE idem.prune(integer, integer), idem.rotate(integer, boolean, interval) TO %s', role);
    -- Reading for stats and check; no writes.
    EXECUTE format('GRANT SELECT ON idem.processed_events, idem.processed_events_default, idem.policies, idem.maintenance_locks,
        idem.lookbacks, idem.duplicate_counts TO %s', role);
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Maintainers granted before version 5 get what version 5 adds.
DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT a.grantee::regrole::text AS role
               FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
              WHERE p.oid = 'idem.prunable_rows()'::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION idem.compact_duplicate_counts() TO %s', r.role);
        EXECUTE format('GRANT SELECT ON idem.lookbacks, idem.duplicate_counts TO %s', r.role);
    END LOOP;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
-- Version 4's claim (same signature: grants are kept).
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
AS $$
#variable_conflict use_column
DECLARE
    v_iso    text := current_setting('transaction_isolation');
    v_now    timestamptz;
    v_ttl    interval;
    v_lease  interval;
    v_max    integer;
    v_sample integer;
    r        idem.processed_events%ROWTYPE;
    v_found  boolean;
    v_lockkey integer;
    v_until  timestamptz;
    v_sleep  double precision := 0.001;
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

    SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling INTO v_ttl, v_lease, v_max, v_sample
      FROM idem.policies p
     WHERE p.source = claim.source OR p.source = '*'
     ORDER BY p.source = '*'
     LIMIT 1;
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

    -- Pass 1 reads without locking: completed keys, permanent failures,
    -- mismatches and live leases are answered from one index probe per
    -- partition. Pass 2 serializes on a per-key advisory lock, looks again
    -- with a fresh snapshot and takes the row lock before writing.
    FOR pass IN 1..2 LOOP
        IF pass = 1 THEN
            v_now := idem.clock();
            SELECT * INTO r FROM idem.processed_events e
             WHERE e.source = claim.source AND e.key = claim.key;
            v_found := FOUND;
        ELSE
            -- The per-key lock is held by another claim of this key until
            -- its transaction ends. Wait for it at most lock_wait (default
            -- 5 seconds), polling so the wait is bounded whatever the
            -- caller's lock_timeout; past it, answer in_progress from what
            -- pass 1 saw.
            v_lockkey := hashtext(claim.source || chr(31) || claim.key);
            IF NOT pg_try_advisory_xact_lock(1768187245, v_lockkey) THEN
                v_until := clock_timestamp() + coalesce(claim.lock_wait, interval '5 seconds');
                LOOP
                    IF clock_timestamp() >= v_until THEN
                        outcome := 'in_progress';
                        EXIT;
                    END IF;
                    PERFORM pg_sleep(least(v_sleep, greatest(extract(epoch FROM v_until - clock_timestamp()), 0)));
                    v_sleep := least(v_sleep * 2, 0.05);
                    EXIT WHEN pg_try_advisory_xact_lock(1768187245, v_lockkey);
                END LOOP;
                IF outcome = 'in_progress' THEN
                    v_now := idem.clock();
                    EXIT;
                END IF;
            END IF;
            v_now := idem.clock();
            SELECT * INTO r FROM idem.processed_events e
             WHERE e.source = claim.source AND e.key = claim.key
             FOR UPDATE;
            v_found := FOUND;
        END IF;

        IF v_found AND r.expires_at > v_now THEN
            outcome := CASE
                WHEN claim.fingerprint IS NOT NULL AND r.fingerprint IS NOT NULL
                     AND r.fingerprint <> claim.fingerprint THEN 'mismatch'
                WHEN r.status = 'completed' THEN 'completed'
                WHEN r.status = 'failed' AND NOT r.retryable THEN 'failed'
                WHEN r.status = 'processing' AND r.lease_expires_at > v_now THEN 'in_progress'
            END;
            IF outcome IS NOT NULL THEN
                -- A duplicate. Count one in v_sample, as v_sample, without
                -- ever waiting for the row.
                IF v_sample > 0 AND v_iso <> 'serializable' AND (v_sample = 1 OR random() * v_sample < 1) THEN
                    UPDATE idem.processed_events e
                       SET duplicates = e.duplicates + v_sample, last_seen_at = v_now
                      FROM (SELECT l.first_seen_month FROM idem.processed_events l
                             WHERE l.source = r.source AND l.key = r.key
                               AND l.first_seen_month = r.first_seen_month
                               FOR UPDATE SKIP LOCKED) l
                     WHERE e.source = r.source AND e.key = r.key
                       AND e.first_seen_month = l.first_seen_month;
                END IF;
                EXIT;
            END IF;
            -- A lost lease or a retryable failure: re-acquire (pass 2 only).
            IF pass = 2 THEN
                IF v_max IS NOT NULL AND r.attempts >= v_max THEN
                    UPDATE idem.processed_events e
                       SET status = 'failed', retryable = false, lease_expires_at = NULL, updated_at = v_now,
                           last_error = format('idem: gave up after %s attempts; last error: %s',
                                               r.attempts, coalesce(r.last_error, 'lease expired'))
                     WHERE e.source = r.source AND e.key = r.key AND e.first_seen_month = r.first_seen_month
                    RETURNING e.* INTO r;
                    outcome := 'failed';
                    EXIT;
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
                 WHERE e.source = r.source AND e.key = r.key AND e.first_seen_month = r.first_seen_month
                RETURNING e.* INTO r;
                outcome := 'acquired';
                EXIT;
            END IF;
        ELSIF pass = 2 THEN
            IF v_found THEN
                -- Past its retention: the key is new again.
                DELETE FROM idem.processed_events e
                 WHERE e.source = r.source AND e.key = r.key AND e.first_seen_month = r.first_seen_month;
            END IF;
            INSERT INTO idem.processed_events AS e
                   (source, key, first_seen_month, event_type, status, attempts, token,
                    lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
            VALUES (claim.source, claim.key, date_trunc('month', v_now AT TIME ZONE 'UTC')::date, claim.event_type,
                    'processing', 1, idem.new_token(), v_now + v_lease, claim.fingerprint, v_now, v_now,
                    v_now + greatest(v_ttl, v_lease))
            ON CONFLICT DO NOTHING
            RETURNING e.* INTO r;
            IF NOT FOUND THEN
                -- Only reachable when a row was written without the advisory
                -- lock; SERIALIZABLE raises 40001 itself before this point.
                RAISE EXCEPTION USING ERRCODE = '40001',
                    MESSAGE = 'idem.claim: concurrent claim of the same key',
                    HINT = 'Retry the transaction.';
            END IF;
            outcome := 'acquired';
        END IF;
    END LOOP;

    token            := CASE WHEN outcome = 'acquired' THEN r.token END;
    attempt          := r.attempts;
    lease_expires_at := CASE WHEN outcome IN ('acquired', 'in_progress', 'mismatch') THEN r.lease_expires_at END;
    result           := CASE WHEN outcome = 'completed' THEN r.result END;
    error            := CASE WHEN outcome IN ('failed', 'acquired', 'completed') THEN r.last_error END;
    first_seen       := r.first_seen;
    expires_at       := r.expires_at;
    lease_remaining  := CASE WHEN outcome = 'acquired' THEN v_lease
                             WHEN outcome = 'in_progress' THEN greatest(r.lease_expires_at - v_now, interval '0') END;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.complete(source text, key text, token bigint, result jsonb DEFAULT NULL)
RETURNS text
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now    timestamptz;
    v_status text;
    v_token  bigint;
BEGIN
    PERFORM idem.check_key('idem.complete', complete.source, complete.key);
    IF complete.token IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.complete: token must not be NULL';
    END IF;
    IF pg_column_size(complete.result) > 1048576 THEN
        RAISE EXCEPTION USING ERRCODE = '54000',
            MESSAGE = format('idem.complete: result is %s bytes, over the 1 MiB limit', pg_column_size(complete.result)),
            HINT = 'Store large results in your own table and keep a reference in the result.';
    END IF;
    v_now := idem.clock();
    UPDATE idem.processed_events e
       SET status = 'completed', result = complete.result, completed_at = v_now, updated_at = v_now,
           lease_expires_at = NULL, retryable = NULL, last_error = NULL
     WHERE e.source = complete.source AND e.key = complete.key
       AND e.token = complete.token AND e.status = 'processing';
    IF FOUND THEN
        RETURN 'completed';
    END IF;
    SELECT e.status, e.token INTO v_status, v_token
      FROM idem.processed_events e
     WHERE e.source = complete.source AND e.key = complete.key;
    IF NOT FOUND THEN
        RETURN 'not_found';
    ELSIF v_token = complete.token AND v_status = 'completed' THEN
        RETURN 'already_completed';
    END IF;
    RETURN 'stale_token';
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.complete_unstored(source text, key text, token bigint, reason text)
RETURNS text
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now    timestamptz;
    v_status text;
    v_token  bigint;
BEGIN
    PERFORM idem.check_key('idem.complete_unstored', complete_unstored.source, complete_unstored.key);
    IF complete_unstored.token IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.complete_unstored: token must not be NULL';
    END IF;
    v_now := idem.clock();
    UPDATE idem.processed_events e
       SET status = 'completed', result = NULL, completed_at = v_now, updated_at = v_now,
           lease_expires_at = NULL, retryable = NULL,
           last_error = left('result not stored: ' || coalesce(complete_unstored.reason, 'no reason given'), 8192)
     WHERE e.source = complete_unstored.source AND e.key = complete_unstored.key
       AND e.token = complete_unstored.token AND e.status = 'processing';
    IF FOUND THEN
        RETURN 'completed';
    END IF;
    SELECT e.status, e.token INTO v_status, v_token
      FROM idem.processed_events e
     WHERE e.source = complete_unstored.source AND e.key = complete_unstored.key;
    IF NOT FOUND THEN
        RETURN 'not_found';
    ELSIF v_token = complete_unstored.token AND v_status = 'completed' THEN
        RETURN 'already_completed';
    END IF;
    RETURN 'stale_token';
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.fail(source text, key text, token bigint, error text DEFAULT NULL, retryable boolean DEFAULT true)
RETURNS text
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now    timestamptz;
    v_status text;
    v_token  bigint;
BEGIN
    PERFORM idem.check_key('idem.fail', fail.source, fail.key);
    IF fail.token IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.fail: token must not be NULL';
    END IF;
    v_now := idem.clock();
    UPDATE idem.processed_events e
       SET status = 'failed', retryable = coalesce(fail.retryable, true),
           last_error = left(coalesce(fail.error, 'failed'), 8192),
           lease_expires_at = NULL, updated_at = v_now
     WHERE e.source = fail.source AND e.key = fail.key
       AND e.token = fail.token AND e.status = 'processing';
    IF FOUND THEN
        RETURN 'failed';
    END IF;
    SELECT e.status, e.token INTO v_status, v_token
      FROM idem.processed_events e
     WHERE e.source = fail.source AND e.key = fail.key;
    IF NOT FOUND THEN
        RETURN 'not_found';
    ELSIF v_token = fail.token AND v_status = 'failed' THEN
        RETURN 'failed';
    END IF;
    RETURN 'stale_token';
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.extend(source text, key text, token bigint, lease interval DEFAULT NULL)
RETURNS TABLE (outcome text, lease_expires_at timestamptz)
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now   timestamptz;
    v_lease interval := extend.lease;
    v_until timestamptz;
BEGIN
    PERFORM idem.check_key('idem.extend', extend.source, extend.key);
    IF extend.token IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.extend: token must not be NULL';
    END IF;
    IF v_lease IS NULL THEN
        SELECT p.lease INTO v_lease FROM idem.policies p
         WHERE p.source = extend.source OR p.source = '*'
         ORDER BY p.source = '*' LIMIT 1;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = '42704',
                MESSAGE = format('idem.extend: no policy for source %L and no default policy', extend.source);
        END IF;
    ELSIF NOT idem.valid_lease(v_lease) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('idem.extend: lease %s is out of range', v_lease),
            HINT = 'lease must be between 1 second and 7 days.';
    END IF;
    v_now := idem.clock();
    UPDATE idem.processed_events e
       SET lease_expires_at = v_now + v_lease, updated_at = v_now,
           expires_at = greatest(e.expires_at, v_now + v_lease)
     WHERE e.source = extend.source AND e.key = extend.key
       AND e.token = extend.token AND e.status = 'processing'
    RETURNING e.lease_expires_at INTO v_until;
    IF FOUND THEN
        RETURN QUERY SELECT 'extended'::text, v_until;
        RETURN;
    END IF;
    PERFORM 1 FROM idem.processed_events e WHERE e.source = extend.source AND e.key = extend.key;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::timestamptz;
    ELSE
        RETURN QUERY SELECT 'stale_token'::text, NULL::timestamptz;
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
        idem.prunable_rows() TO %s', role);
    EXECUTE format('GRANT EXECUTE ON PROCEDURE idem.prune(integer, integer), idem.rotate(integer, boolean, interval) TO %s', role);
    -- Reading for stats and check; no writes.
    EXECUTE format('GRANT SELECT ON idem.processed_events, idem.processed_events_default, idem.policies, idem.maintenance_locks TO %s', role);
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.compact_duplicate_counts();
DROP FUNCTION IF EXISTS idem.settled_outcome(text, boolean, timestamptz, text, text, timestamptz);
DROP FUNCTION IF EXISTS idem.count_duplicate(text, text, date, integer, boolean, timestamptz);
DROP TRIGGER IF EXISTS policies_raise_lookback ON idem.policies;
DROP FUNCTION IF EXISTS idem.policies_raise_lookback();
DROP FUNCTION IF EXISTS idem.raise_lookback(text, interval);
DROP FUNCTION IF EXISTS idem.row_anchor(timestamptz, date);
DROP FUNCTION IF EXISTS idem.window_start(timestamptz, interval);
DROP FUNCTION IF EXISTS idem.days_at_most(interval);
DROP TABLE IF EXISTS idem.duplicate_counts;
DROP TABLE IF EXISTS idem.lookbacks;
ALTER TABLE idem.policies DROP COLUMN IF EXISTS count_per_key;
-- +goose StatementEnd
