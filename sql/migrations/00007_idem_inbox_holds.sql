-- idem 7: the inbox's queue holds. An accepted event is processed exactly
-- once or waits, visible, as a dead letter, however long the workers are
-- down and whatever prune and rotation do meanwhile.
--
-- * idem.holds: a key accepted for a queue (package inbox) is held, from
--   the accept's transaction until its job completes it (the hold is
--   deleted in the job's transaction) or dead-letters it (state 'dead',
--   with the error). While a hold is 'queued':
--   - idem.claim never acquires the key (not as a new row, not by taking a
--     lost lease or a retryable failure over): it answers in_progress. The
--     hold is read on the acquire paths only, by (source, key), so a held
--     row is found whatever its month and however long ago it expired.
--   - prune never deletes the key's row and rotation never retires its
--     month.
--   A 'dead' hold does not block claims: the sender's redelivery, or a
--   replay, acquires the key and holds it again for a new job.
-- * Every attempt of a job is fenced from every other: idem.queue_take
--   gives each attempt a token of its own (the job keeps the token it was
--   accepted under, in idem.holds), so an attempt that another attempt took
--   the key from cannot complete it, and a second attempt never commits
--   once another completed the key (idem.queue_complete answers not_held).
-- * idem.queue_counts: per source, events accepted and processed (one row
--   per backend, folded by idem.compact_duplicate_counts like the duplicate
--   counts; logged, since reconciliation must survive a crash). With the
--   holds: accepted = processed + dead-lettered + queued.
-- * idem.queue_complete completes without storing a result over the 1 MiB
--   limit (idem.complete's own check), as Do does, recording why.
-- * grant_app / grant_maintainer give the queue functions; roles granted
--   before get them too.
--
-- Down restores version 6's functions and drops what version 7 added
-- (holds and counts with it).

-- +goose Up
-- +goose StatementBegin
CREATE TABLE idem.holds (
    source  text        NOT NULL,
    key     text        NOT NULL,
    -- The token the key was accepted (or replayed) under: its job's.
    token   bigint      NOT NULL,
    -- The queue's job (River's river_job.id), for reconciliation.
    job_id  bigint,
    state   text        NOT NULL DEFAULT 'queued'
            CONSTRAINT holds_state_check CHECK (state IN ('queued', 'dead')),
    held_at timestamptz NOT NULL,
    dead_at timestamptz,
    error   text,
    PRIMARY KEY (source, key)
);
-- +goose StatementEnd

-- +goose StatementBegin
CREATE INDEX holds_dead_idx ON idem.holds (source, dead_at) WHERE state = 'dead';
-- +goose StatementEnd

-- +goose StatementBegin
CREATE TABLE idem.queue_counts (
    source    text    NOT NULL,
    slot      integer NOT NULL,
    accepted  bigint  NOT NULL DEFAULT 0,
    processed bigint  NOT NULL DEFAULT 0,
    since     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, slot)
);
-- +goose StatementEnd

-- +goose StatementBegin
-- Counts accepted and processed events of a source in this backend's slot
-- (no two sessions wait for one row).
CREATE FUNCTION idem.queue_count(p_source text, p_accepted integer, p_processed integer) RETURNS void
    LANGUAGE sql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO idem.queue_counts AS c (source, slot, accepted, processed)
    VALUES (p_source, pg_backend_pid(), p_accepted, p_processed)
    ON CONFLICT (source, slot) DO UPDATE
       SET accepted = c.accepted + EXCLUDED.accepted, processed = c.processed + EXCLUDED.processed
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.queue_count(text, integer, integer) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- idem.claim, version 7 (same signature and outcomes as version 5): a key
-- held by the inbox's queue (idem.holds, state 'queued') is never acquired:
-- not as a new row, not by taking over a lost lease or a retryable failure.
-- It answers in_progress until its job completes it or dead-letters it. The
-- hold is looked up on the acquire paths only; a duplicate of a settled key
-- is answered as before, without reading it.
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
-- Holds a key the caller acquired with token (idem.claim, in this
-- transaction) for the queue's job job_id. A dead hold of the key (a
-- dead-lettered event accepted again, or replayed) is replaced, and its
-- job id returned, for the caller to remove that dead job in the same
-- transaction; otherwise NULL. A new hold counts one accepted event.
CREATE FUNCTION idem.queue_hold(source text, key text, token bigint, job_id bigint) RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_state text;
    v_old   bigint;
BEGIN
    PERFORM idem.check_key('idem.queue_hold', queue_hold.source, queue_hold.key);
    IF queue_hold.token IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.queue_hold: token must not be NULL';
    END IF;
    PERFORM 1 FROM idem.processed_events e
     WHERE e.source = queue_hold.source AND e.key = queue_hold.key
       AND e.token = queue_hold.token AND e.status = 'processing';
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'ID003',
            MESSAGE = format('idem.queue_hold: key %L of source %L is not acquired with this token', left(queue_hold.key, 64), queue_hold.source),
            HINT = 'Hold a key in the transaction that acquired it with idem.claim.';
    END IF;
    SELECT h.state, h.job_id INTO v_state, v_old FROM idem.holds h
     WHERE h.source = queue_hold.source AND h.key = queue_hold.key FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO idem.holds (source, key, token, job_id, state, held_at)
        VALUES (queue_hold.source, queue_hold.key, queue_hold.token, queue_hold.job_id, 'queued', idem.clock());
        PERFORM idem.queue_count(queue_hold.source, 1, 0);
        RETURN NULL;
    ELSIF v_state = 'queued' THEN
        RAISE EXCEPTION USING ERRCODE = 'ID003',
            MESSAGE = format('idem.queue_hold: key %L of source %L is already held by job %s', left(queue_hold.key, 64), queue_hold.source, v_old);
    END IF;
    UPDATE idem.holds h
       SET token = queue_hold.token, job_id = queue_hold.job_id, state = 'queued', held_at = idem.clock(),
           dead_at = NULL, error = NULL
     WHERE h.source = queue_hold.source AND h.key = queue_hold.key;
    RETURN v_old;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.queue_hold(text, text, bigint, bigint) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- One attempt of the job that holds the key with job_token takes the key:
-- under the key's lock (as claims take it), the key's row gets a token of
-- this attempt's own and a lease of `lease`. Outcomes:
--   taken       the attempt owns the key: token, attempt, lease_expires_at,
--               and error (the previous attempt's, if any)
--   done        the key is completed (by an earlier attempt): nothing to do
--   superseded  another job holds the key now (a replay, or a redelivery
--               after this job was dead-lettered): nothing to do
--   gone        the key's row is missing (deleted, or its partition
--               dropped): the hold is dead-lettered with that reason
--   failed      the key failed for good outside the queue: dead-lettered
-- A job accepted before version 7 (no hold, the row still under its token)
-- is held now. A dead hold of this job (River retried a dead letter) is
-- revived.
CREATE FUNCTION idem.queue_take(source text, key text, job_token bigint, job_id bigint, lease interval)
RETURNS TABLE (outcome text, token bigint, attempt integer, lease_expires_at timestamptz, error text)
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    h          record;
    r          record;
    v_held     boolean;
    v_row      boolean;
    v_now      timestamptz;
    v_until    timestamptz;
    v_lookback interval;
    v_need     interval;
    v_gone     text := 'the event''s key was gone before its job ran (deleted, or its month dropped); replay it to process it';
BEGIN
    PERFORM idem.check_key('idem.queue_take', queue_take.source, queue_take.key);
    IF queue_take.job_token IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.queue_take: job_token must not be NULL';
    END IF;
    IF queue_take.lease IS NULL OR NOT idem.valid_lease(queue_take.lease) THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('idem.queue_take: lease %s is out of range', queue_take.lease),
            HINT = 'lease must be between 1 second and 7 days.';
    END IF;
    PERFORM pg_advisory_xact_lock(1768187245, hashtext(queue_take.source || chr(31) || queue_take.key));
    SELECT x.token, x.state INTO h FROM idem.holds x
     WHERE x.source = queue_take.source AND x.key = queue_take.key FOR UPDATE;
    v_held := FOUND;
    v_now := idem.clock();
    SELECT e.first_seen_month, e.first_seen, e.status, e.token, e.retryable, e.last_error, e.expires_at INTO r
      FROM idem.processed_events e
     WHERE e.source = queue_take.source AND e.key = queue_take.key
     ORDER BY e.first_seen_month DESC
     LIMIT 1;
    v_row := FOUND;

    IF v_held AND h.token <> queue_take.job_token THEN
        RETURN QUERY SELECT 'superseded'::text, NULL::bigint, NULL::integer, NULL::timestamptz, NULL::text;
        RETURN;
    END IF;
    IF NOT v_held THEN
        IF v_row AND r.token = queue_take.job_token AND r.status = 'processing' THEN
            -- Accepted before version 7: hold it now.
            INSERT INTO idem.holds (source, key, token, job_id, state, held_at)
            VALUES (queue_take.source, queue_take.key, queue_take.job_token, queue_take.job_id, 'queued', v_now);
            PERFORM idem.queue_count(queue_take.source, 1, 0);
        ELSIF v_row AND r.status = 'completed' THEN
            RETURN QUERY SELECT 'done'::text, NULL::bigint, NULL::integer, NULL::timestamptz, NULL::text;
            RETURN;
        ELSIF v_row THEN
            RETURN QUERY SELECT 'superseded'::text, NULL::bigint, NULL::integer, NULL::timestamptz, NULL::text;
            RETURN;
        ELSE
            INSERT INTO idem.holds (source, key, token, job_id, state, held_at, dead_at, error)
            VALUES (queue_take.source, queue_take.key, queue_take.job_token, queue_take.job_id, 'dead', v_now, v_now, v_gone);
            PERFORM idem.queue_count(queue_take.source, 1, 0);
            RETURN QUERY SELECT 'gone'::text, NULL::bigint, NULL::integer, NULL::timestamptz, v_gone;
            RETURN;
        END IF;
    ELSIF h.state = 'dead' THEN
        UPDATE idem.holds x SET state = 'queued', dead_at = NULL, error = NULL,
               job_id = coalesce(queue_take.job_id, x.job_id)
         WHERE x.source = queue_take.source AND x.key = queue_take.key;
    END IF;

    IF NOT v_row THEN
        UPDATE idem.holds x SET state = 'dead', dead_at = v_now, error = v_gone
         WHERE x.source = queue_take.source AND x.key = queue_take.key;
        RETURN QUERY SELECT 'gone'::text, NULL::bigint, NULL::integer, NULL::timestamptz, v_gone;
        RETURN;
    ELSIF r.status = 'completed' THEN
        DELETE FROM idem.holds x WHERE x.source = queue_take.source AND x.key = queue_take.key;
        PERFORM idem.queue_count(queue_take.source, 0, 1);
        RETURN QUERY SELECT 'done'::text, NULL::bigint, NULL::integer, NULL::timestamptz, NULL::text;
        RETURN;
    ELSIF r.status = 'failed' AND NOT coalesce(r.retryable, false) THEN
        UPDATE idem.holds x SET state = 'dead', dead_at = v_now, error = r.last_error
         WHERE x.source = queue_take.source AND x.key = queue_take.key;
        RETURN QUERY SELECT 'failed'::text, NULL::bigint, NULL::integer, NULL::timestamptz, r.last_error;
        RETURN;
    END IF;

    -- Take it, with a token of this attempt's own. A lease past the row's
    -- retention raises the source's lookback first, as extend does.
    v_until := v_now + queue_take.lease;
    IF r.expires_at < v_until THEN
        v_need := v_until - idem.row_anchor(r.first_seen, r.first_seen_month);
        SELECT max(l.lookback) INTO v_lookback FROM idem.lookbacks l WHERE l.source IN (queue_take.source, '*');
        IF v_lookback IS NULL OR v_need > v_lookback THEN
            PERFORM idem.raise_lookback(queue_take.source, v_need);
        END IF;
    END IF;
    RETURN QUERY
    UPDATE idem.processed_events e
       SET status = 'processing', token = idem.new_token(),
           attempts = e.attempts + CASE WHEN e.token = queue_take.job_token THEN 0 ELSE 1 END,
           lease_expires_at = v_until, retryable = NULL, updated_at = v_now,
           expires_at = greatest(e.expires_at, v_until)
     WHERE e.source = queue_take.source AND e.key = queue_take.key
       AND e.first_seen_month = r.first_seen_month AND e.token = r.token
    RETURNING 'taken'::text, e.token, e.attempts, e.lease_expires_at, e.last_error;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.queue_take(text, text, bigint, bigint, interval) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- Completes the key for the attempt that owns it (token) of the job that
-- holds it (job_token), and releases the hold, counting one processed
-- event: call it in the transaction of the job's own writes and its
-- completion. A result over idem.complete's limit (1 MiB), or one the
-- caller gives a reason not to store, completes the key without it.
-- Returns completed, completed_unstored, or, with nothing done: not_held
-- (another job holds the key, or the key is done), stale_token (another
-- attempt took the key), not_found.
CREATE FUNCTION idem.queue_complete(source text, key text, job_token bigint, token bigint,
                                    result jsonb DEFAULT NULL, reason text DEFAULT NULL) RETURNS text
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_out      text;
    v_unstored boolean := queue_complete.reason IS NOT NULL;
    v_reason   text := queue_complete.reason;
BEGIN
    PERFORM idem.check_key('idem.queue_complete', queue_complete.source, queue_complete.key);
    IF queue_complete.job_token IS NULL OR queue_complete.token IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.queue_complete: tokens must not be NULL';
    END IF;
    -- The hold first, as queue_take locks it: no deadlock with an attempt
    -- taking the key meanwhile.
    PERFORM 1 FROM idem.holds h
     WHERE h.source = queue_complete.source AND h.key = queue_complete.key
       AND h.token = queue_complete.job_token AND h.state = 'queued'
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'not_held';
    END IF;
    IF NOT v_unstored THEN
        BEGIN
            v_out := idem.complete(queue_complete.source, queue_complete.key, queue_complete.token, queue_complete.result);
        EXCEPTION WHEN program_limit_exceeded THEN
            v_unstored := true;
            v_reason := SQLERRM;
        END;
    END IF;
    IF v_unstored THEN
        v_out := idem.complete_unstored(queue_complete.source, queue_complete.key, queue_complete.token, v_reason);
    END IF;
    IF v_out <> 'completed' THEN
        RETURN v_out;
    END IF;
    DELETE FROM idem.holds h WHERE h.source = queue_complete.source AND h.key = queue_complete.key;
    PERFORM idem.queue_count(queue_complete.source, 0, 1);
    RETURN CASE WHEN v_unstored THEN 'completed_unstored' ELSE 'completed' END;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.queue_complete(text, text, bigint, bigint, jsonb, text) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- Records a failed attempt (token) of the job that holds the key
-- (job_token): the key is failed as retryable, with the error. With dead,
-- the job will not be tried again: the hold is dead-lettered with the
-- error, and the key can be acquired again (a replay, or the sender's
-- redelivery). Returns failed, dead, or, with nothing done: not_held,
-- stale_token, not_found.
CREATE FUNCTION idem.queue_fail(source text, key text, job_token bigint, token bigint, error text, dead boolean)
RETURNS text
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_out text;
BEGIN
    PERFORM idem.check_key('idem.queue_fail', queue_fail.source, queue_fail.key);
    IF queue_fail.job_token IS NULL OR queue_fail.token IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.queue_fail: tokens must not be NULL';
    END IF;
    PERFORM 1 FROM idem.holds h
     WHERE h.source = queue_fail.source AND h.key = queue_fail.key
       AND h.token = queue_fail.job_token AND h.state = 'queued'
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'not_held';
    END IF;
    v_out := idem.fail(queue_fail.source, queue_fail.key, queue_fail.token, queue_fail.error, true);
    IF v_out <> 'failed' THEN
        RETURN v_out;
    END IF;
    IF coalesce(queue_fail.dead, false) THEN
        UPDATE idem.holds h
           SET state = 'dead', dead_at = idem.clock(), error = left(coalesce(queue_fail.error, 'failed'), 8192)
         WHERE h.source = queue_fail.source AND h.key = queue_fail.key;
        RETURN 'dead';
    END IF;
    RETURN 'failed';
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.queue_fail(text, text, bigint, bigint, text, boolean) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- Repairs a hold whose job can no longer run it (the queue lost it, or
-- finished it without completing the key: found by the caller from the
-- queue's side), unless an attempt holds a live lease on the key. With
-- new_job_id, the hold passes to that job (enqueued by the caller in this
-- transaction, with the same job_token); without, the hold is
-- dead-lettered with reason. Returns requeued, dead, or skipped.
CREATE FUNCTION idem.queue_repair(source text, key text, job_token bigint, old_job_id bigint, new_job_id bigint, reason text)
RETURNS text
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    PERFORM idem.check_key('idem.queue_repair', queue_repair.source, queue_repair.key);
    PERFORM pg_advisory_xact_lock(1768187245, hashtext(queue_repair.source || chr(31) || queue_repair.key));
    PERFORM 1 FROM idem.holds h
     WHERE h.source = queue_repair.source AND h.key = queue_repair.key AND h.token = queue_repair.job_token
       AND h.state = 'queued' AND h.job_id IS NOT DISTINCT FROM queue_repair.old_job_id
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'skipped';
    END IF;
    -- An attempt (a token other than the job's own, which the key has from
    -- its accept until the first attempt takes it) with a live lease.
    PERFORM 1 FROM idem.processed_events e
     WHERE e.source = queue_repair.source AND e.key = queue_repair.key
       AND e.status = 'processing' AND e.lease_expires_at > idem.clock() AND e.token <> queue_repair.job_token;
    IF FOUND THEN
        RETURN 'skipped';
    END IF;
    IF queue_repair.new_job_id IS NOT NULL THEN
        UPDATE idem.holds h SET job_id = queue_repair.new_job_id
         WHERE h.source = queue_repair.source AND h.key = queue_repair.key;
        RETURN 'requeued';
    END IF;
    UPDATE idem.holds h
       SET state = 'dead', dead_at = idem.clock(), error = left(coalesce(queue_repair.reason, 'the job was lost'), 8192)
     WHERE h.source = queue_repair.source AND h.key = queue_repair.key;
    RETURN 'dead';
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.queue_repair(text, text, bigint, bigint, bigint, text) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- Claims a dead-lettered key again for a replay (the maintainer's right to
-- claim: only keys whose hold, with job_token, is dead), with the claim's
-- outcome; not_dead when the key has no such dead letter.
CREATE FUNCTION idem.queue_replay(source text, key text, job_token bigint, ttl interval DEFAULT NULL)
RETURNS TABLE (outcome text, token bigint, first_seen timestamptz, expires_at timestamptz, error text)
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    PERFORM idem.check_key('idem.queue_replay', queue_replay.source, queue_replay.key);
    PERFORM 1 FROM idem.holds h
     WHERE h.source = queue_replay.source AND h.key = queue_replay.key AND h.token = queue_replay.job_token
       AND h.state = 'dead';
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_dead'::text, NULL::bigint, NULL::timestamptz, NULL::timestamptz, NULL::text;
        RETURN;
    END IF;
    RETURN QUERY SELECT c.outcome, c.token, c.first_seen, c.expires_at, c.error
                   FROM idem.claim(queue_replay.source, queue_replay.key, NULL, queue_replay.ttl, NULL, NULL, NULL) c;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.queue_replay(text, text, bigint, interval) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- Removes the dead hold of a key that was processed meanwhile (completed:
-- a replay has nothing to run), counting it processed. Returns whether it
-- did.
CREATE FUNCTION idem.queue_forget(source text, key text, job_token bigint) RETURNS boolean
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    PERFORM idem.check_key('idem.queue_forget', queue_forget.source, queue_forget.key);
    DELETE FROM idem.holds h
     WHERE h.source = queue_forget.source AND h.key = queue_forget.key AND h.token = queue_forget.job_token
       AND h.state = 'dead'
       AND EXISTS (SELECT 1 FROM idem.processed_events e
                    WHERE e.source = queue_forget.source AND e.key = queue_forget.key AND e.status = 'completed');
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM idem.queue_count(queue_forget.source, 0, 1);
    RETURN true;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.queue_forget(text, text, bigint) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- Whether a month's partition holds the row of a key a queue holds (its
-- job has not finished): rotation keeps such a month.
CREATE FUNCTION idem.holds_in(part regclass) RETURNS boolean
    LANGUAGE plpgsql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v boolean;
BEGIN
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM idem.holds h JOIN %s x ON x.source = h.source AND x.key = h.key
                     WHERE h.state = ''queued'')', part) INTO v;
    RETURN v;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.holds_in(regclass) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- Deletes up to batch_size expired rows and returns how many it deleted.
-- A row is deleted only when its retention has passed, it is not under
-- a live lease, and its key is not held by a queue (version 7). Rows locked by a claim are skipped, never waited for. The
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
                    AND NOT EXISTS (SELECT 1 FROM idem.holds h
                                     WHERE h.source = x.source AND h.key = x.key AND h.state = ''queued'')
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
    IF idem.holds_in(part) THEN
        RETURN 'kept: it has keys held by a queue whose jobs have not finished';
    END IF;
    LOCK TABLE ONLY idem.processed_events IN ACCESS EXCLUSIVE MODE;
    EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', part);
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s x WHERE x.expires_at >= $1)', part) INTO v_live USING v_now;
    IF v_live THEN
        RETURN 'kept: it still has live rows';
    END IF;
    IF idem.holds_in(part) THEN
        RETURN 'kept: it has keys held by a queue whose jobs have not finished';
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
-- How many rows prune would delete now (for --dry-run and check).
CREATE OR REPLACE FUNCTION idem.prunable_rows() RETURNS bigint
    LANGUAGE sql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
    SELECT count(*) FROM idem.processed_events x
     WHERE x.expires_at < idem.clock()
       AND (x.status <> 'processing' OR x.lease_expires_at IS NULL OR x.lease_expires_at < idem.clock())
       AND NOT EXISTS (SELECT 1 FROM idem.holds h WHERE h.source = x.source AND h.key = x.key AND h.state = 'queued')
$$;
-- +goose StatementEnd


-- +goose StatementBegin
-- Folds every slot of a source into slot 0, in idem.duplicate_counts and
-- (version 7) idem.queue_counts (maintainers may run it; rows
-- a live session is writing are skipped).
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
        idem.complete_unstored(text, text, bigint, text),
        idem.fail(text, text, bigint, text, boolean),
        idem.extend(text, text, bigint, interval),
        idem.queue_hold(text, text, bigint, bigint),
        idem.queue_take(text, text, bigint, bigint, interval),
        idem.queue_complete(text, text, bigint, bigint, jsonb, text),
        idem.queue_fail(text, text, bigint, bigint, text, boolean),
        idem.queue_repair(text, text, bigint, bigint, bigint, text),
        idem.queue_replay(text, text, bigint, interval),
        idem.queue_forget(text, text, bigint) TO %s', role);
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
-- Roles granted before version 7 get what version 7 adds: application
-- roles (EXECUTE on idem.extend) the queue functions, maintainers (EXECUTE
-- on idem.prunable_rows) replay and the inbox's tables.
DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT a.grantee::regrole::text AS role
               FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
              WHERE p.oid = 'idem.extend(text, text, bigint, interval)'::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        PERFORM idem.grant_app(r.role::regrole);
    END LOOP;
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
-- Version 5's claim (same signature: grants are kept).
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
-- How many rows prune would delete now (for --dry-run and check).
CREATE OR REPLACE FUNCTION idem.prunable_rows() RETURNS bigint
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
-- Folds every slot of a source into slot 0 (maintainers may run it; rows
-- a live session is writing are skipped).
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
    RETURN v_n;
END
$$;
-- +goose StatementEnd


-- +goose StatementBegin
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
        idem.complete_unstored(text, text, bigint, text),
        idem.fail(text, text, bigint, text, boolean),
        idem.extend(text, text, bigint, interval) TO %s', role);
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
DROP FUNCTION IF EXISTS idem.holds_in(regclass);
DROP FUNCTION IF EXISTS idem.queue_forget(text, text, bigint);
DROP FUNCTION IF EXISTS idem.queue_replay(text, text, bigint, interval);
DROP FUNCTION IF EXISTS idem.queue_repair(text, text, bigint, bigint, bigint, text);
DROP FUNCTION IF EXISTS idem.queue_fail(text, text, bigint, bigint, text, boolean);
DROP FUNCTION IF EXISTS idem.queue_complete(text, text, bigint, bigint, jsonb, text);
DROP FUNCTION IF EXISTS idem.queue_take(text, text, bigint, bigint, interval);
DROP FUNCTION IF EXISTS idem.queue_hold(text, text, bigint, bigint);
DROP FUNCTION IF EXISTS idem.queue_count(text, integer, integer);
DROP TABLE IF EXISTS idem.queue_counts;
DROP TABLE IF EXISTS idem.holds;
-- +goose StatementEnd
