-- SERIALIZABLE claims: placeholders only where a claim committed after the
-- snapshot can have written the key, no second probe, no delete.
--
-- A new key in a SERIALIZABLE transaction left idem.claim's short path for
-- idem.claim_general after the short path's probe: the probe ran twice,
-- and so did the read of the source's settings. Its placeholders (migration
-- 21) went into every other month of the window (13 for a 400-day ttl) and
-- were deleted again, the delete walking every month's index once more.
-- Measured with `go run ./bench -only profile` (one connection, past months
-- holding keys), a new key with a 400-day ttl cost 3,164 us: the two probes
-- 768 + 544 us, the placeholders 371 us, their delete 656 us.
--
-- * idem.serializable_placeholders, called by idem.claim and
--   idem.claim_general, and idem.serializable_floor, its first month:
--   the placeholders go only into the months where a
--   claim committed after the snapshot can have written the key: from the
--   month of a day before the last checkpoint's start to the month of a
--   day ahead of now (most days only the current month, so none), unless
--   a transaction that took its id before that checkpoint is still open
--   (then every month of the window, as before). They are undone by the
--   rollback of the block that wrote them instead of a delete.
-- * idem.claim: a new key in a SERIALIZABLE transaction stays on the short
--   path: its placeholders, then its insert; like idem.claim_general, it
--   does not count it in idem.activity in SERIALIZABLE.
-- * idem.claim_batch (SERIALIZABLE keys): its placeholders go into the same
--   months (idem.serializable_floor, shared).
-- * idem.adopt_key and idem.adopt_batch write a copied key into the month
--   of their clock, not of its legacy stamp (first_seen keeps the stamp),
--   so that every writer of a key's row writes into the month of its own
--   clock; a copied row is live only while that month is in the window.
-- * idem.claim and idem.claim_general take the setting idem.citus for
--   Citus only where Citus' catalog is (pg_catalog.pg_dist_partition): any
--   role can set it at session level and a transaction-mode pooler carries
--   it to the next client, and on a single node every claim of that
--   connection then failed (42883, Citus' function missing). (A function's
--   SET idem.citus = off would need a superuser: PostgreSQL 15 refuses a
--   custom setting in a SET clause to other roles.)
--
-- Tests: idem_test.TestSessionSettingsCarriedOver (idem.citus),
-- idem_test.TestSerializableClaimsAcrossMonths and its negative
-- control, idem_test.TestSerializablePlaceholdersOldTransaction,
-- reliability.TestMonthBoundaryRace, migrate.TestUpgradeToSerializableCost.
-- Down restores the previous five functions.

-- +goose Up
-- +goose StatementBegin
CREATE FUNCTION idem.serializable_floor(p_now timestamp with time zone, p_lo date)
 RETURNS date
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_ckpt record;
BEGIN
    -- The first month a SERIALIZABLE claim's placeholders go into (the
    -- last is a day ahead of now; the window's p_lo at the earliest).
    --
    -- A SERIALIZABLE claim's snapshot cannot see a claim of the same key
    -- committed after it into another month's partition. A placeholder
    -- insert of the key into such a month meets every committed row of the
    -- unique index, visible or not, and on one the snapshot cannot see it
    -- fails with 40001 (the caller retries with a snapshot that sees it).
    -- Every writer of a key's row puts it in the month of its own clock,
    -- read just before it writes (a claim, a batch, an adoption; a
    -- take-over updates the row where it is, which the snapshot sees and
    -- the update meets). A transaction that commits after this snapshot was
    -- running when it was taken, or began after. If no transaction running
    -- then had taken its transaction id before the last checkpoint began
    -- (the snapshot's xmin is not older than the checkpoint's next xid),
    -- every such writer took its id, and so read its clock, after the
    -- checkpoint's start less the day of margin the design allows for a
    -- clock stepped back or a writer stalled between its clock and its
    -- insert: the months from then on are enough. Otherwise (a transaction
    -- older than the checkpoint is still open, or no checkpoint can be
    -- read) every month of the window.
    SELECT c.checkpoint_time, c.next_xid INTO v_ckpt FROM pg_catalog.pg_control_checkpoint() c;
    IF v_ckpt.next_xid OPERATOR(pg_catalog.~) '^[0-9]+:[0-9]+$' AND v_ckpt.checkpoint_time IS NOT NULL
       AND pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot())::pg_catalog.text::pg_catalog.numeric
           OPERATOR(pg_catalog.>=) ((pg_catalog.split_part(v_ckpt.next_xid, ':', 1)::pg_catalog.numeric OPERATOR(pg_catalog.*) 4294967296)
                                    OPERATOR(pg_catalog.+) pg_catalog.split_part(v_ckpt.next_xid, ':', 2)::pg_catalog.numeric) THEN
        RETURN GREATEST(p_lo, idem.utc_month(LEAST(v_ckpt.checkpoint_time, p_now) OPERATOR(pg_catalog.-) interval '1 day'));
    END IF;
    RETURN p_lo;
END
$function$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.serializable_floor(timestamp with time zone, date) FROM PUBLIC;
COMMENT ON FUNCTION idem.serializable_floor(timestamp with time zone, date) IS 'For SERIALIZABLE claims and batches: the first month of the window a claim committed after the snapshot can have written a key into (the month of a day before the last checkpoint began, unless a transaction older than that checkpoint is open: then p_lo, the window''s first).';

-- +goose StatementBegin
CREATE FUNCTION idem.serializable_placeholders(p_source text, p_key text, p_now timestamp with time zone, p_lo date, p_hi date)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    -- A placeholder of the key in each month from idem.serializable_floor
    -- to p_hi but the current one. The ones that went in are undone at once
    -- by the rollback of this block (SQLSTATE ID011, raised and caught here
    -- only), which costs less than deleting them again.
    BEGIN
        INSERT INTO idem.processed_events AS e
               (source, key, first_seen_month, status, attempts, token, first_seen, updated_at, expires_at)
        SELECT p_source, p_key, g::date, 'processing', 1, 0, p_now, p_now, p_now
          FROM pg_catalog.generate_series(idem.serializable_floor(p_now, p_lo)::timestamp, p_hi::timestamp, interval '1 month') g
         WHERE g::date OPERATOR(pg_catalog.<>) idem.utc_month(p_now)
        ON CONFLICT DO NOTHING;
        RAISE EXCEPTION USING ERRCODE = 'ID011', MESSAGE = 'idem.serializable_placeholders: undo the placeholders';
    EXCEPTION WHEN SQLSTATE 'ID011' THEN
        NULL;
    END;
END
$function$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.serializable_placeholders(text, text, timestamp with time zone, date, date) FROM PUBLIC;
COMMENT ON FUNCTION idem.serializable_placeholders(text, text, timestamp with time zone, date, date) IS 'For idem.claim and idem.claim_general in a SERIALIZABLE transaction: placeholder inserts of the key into the months where a claim committed after the snapshot can have written it (every month of the window when a transaction older than the last checkpoint is open), undone at once; one meets such a row with 40001.';

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.claim_general(source text, key text, fingerprint text DEFAULT NULL::text, ttl interval DEFAULT NULL::interval, lease interval DEFAULT NULL::interval, event_type text DEFAULT NULL::text, lock_wait interval DEFAULT NULL::interval, OUT outcome text, OUT token bigint, OUT attempt integer, OUT lease_expires_at timestamp with time zone, OUT result jsonb, OUT error text, OUT first_seen timestamp with time zone, OUT expires_at timestamp with time zone, OUT lease_remaining interval)
 RETURNS record
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
    v_copy     text;
    v_weight   integer;
BEGIN
    IF v_iso = 'repeatable read' THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'idem.claim: REPEATABLE READ is not supported',
            DETAIL = 'A repeatable-read snapshot cannot see a claim of the same key committed in another monthly partition after the snapshot was taken, so a duplicate could run.',
            HINT = 'Claim in READ COMMITTED (the default) or SERIALIZABLE.';
    END IF;
    -- All input checks as one expression (cheap); only bad input takes the
    -- slow path that names the problem.
    IF claim_general.source IS NULL OR claim_general.key IS NULL
       OR octet_length(claim_general.source) NOT BETWEEN 1 AND 64 OR octet_length(claim_general.key) NOT BETWEEN 1 AND 512
       OR btrim(claim_general.source, E' \t\r\n') = '' OR btrim(claim_general.key, E' \t\r\n') = ''
       OR claim_general.source ~ '[\x01-\x1f\x7f]'
       OR octet_length(claim_general.fingerprint) > 512 OR octet_length(claim_general.event_type) > 256
       OR (claim_general.ttl IS NOT NULL AND NOT (claim_general.ttl >= interval '1 minute' AND claim_general.ttl <= interval '10 years'))
       OR (claim_general.lease IS NOT NULL AND NOT (claim_general.lease >= interval '1 second' AND claim_general.lease <= interval '7 days'))
       OR (claim_general.lock_wait IS NOT NULL AND NOT (claim_general.lock_wait >= interval '0' AND claim_general.lock_wait <= interval '1 hour')) THEN
        PERFORM idem.check_key('idem.claim', claim_general.source, claim_general.key);
        IF octet_length(claim_general.fingerprint) > 512 THEN
            RAISE EXCEPTION USING ERRCODE = '22001', MESSAGE = 'idem.claim: fingerprint is longer than 512 bytes',
                HINT = 'Pass a hash of the request, not the request.';
        END IF;
        IF octet_length(claim_general.event_type) > 256 THEN
            RAISE EXCEPTION USING ERRCODE = '22001', MESSAGE = 'idem.claim: event_type is longer than 256 bytes';
        END IF;
        IF claim_general.ttl IS NOT NULL AND NOT idem.valid_ttl(claim_general.ttl) THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: ttl %s is out of range', claim_general.ttl),
                HINT = 'ttl must be between 1 minute and 10 years.';
        END IF;
        IF claim_general.lease IS NOT NULL AND NOT idem.valid_lease(claim_general.lease) THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lease %s is out of range', claim_general.lease),
                HINT = 'lease must be between 1 second and 7 days.';
        END IF;
        IF claim_general.lock_wait IS NOT NULL AND NOT (claim_general.lock_wait >= interval '0' AND claim_general.lock_wait <= interval '1 hour') THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lock_wait %s is out of range', claim_general.lock_wait),
                HINT = 'lock_wait must be between 0 and 1 hour.';
        END IF;
    END IF;

    -- (version 11) On Citus (idem.citus_setup sets idem.citus on this
    -- function) the key's lock below is the owning node's only: a claim
    -- that was not delegated to the node holding the key's shard would not
    -- exclude a delegated claim of the same key, so it is refused.
    -- A session's own idem.citus (any role can set one, and a pooler
    -- carries it to the next client) is not Citus: without Citus' catalog
    -- the setting is ignored.
    IF current_setting('idem.citus', true) IS NOT DISTINCT FROM 'on' AND to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        -- (version 28) '' when the key's shard is not on this node; the
        -- name of this claim's copy on the key's shard (idem.citus_shard_claims)
        -- when there is one: the claim is answered by it, its statements on
        -- the shard's tables, which PostgreSQL plans and caches without
        -- Citus; NULL without one (a shard split since): the statements
        -- below, through Citus. (In the copies this call reads NULL.)
        v_copy := idem.citus_shard_claim(claim_general.key);
        IF v_copy OPERATOR(pg_catalog.=) '' THEN
            RAISE EXCEPTION USING ERRCODE = 'ID005',
                MESSAGE = 'idem.claim ran on a node that does not hold the key''s shard',
                DETAIL = 'On Citus the per-key lock is taken on the node that owns the key; this call was not delegated there.',
                HINT = 'Call it as SELECT ... FROM idem.claim(...) with the key as a constant or parameter (as idem''s Go API does), not from another query or function.';
        END IF;
        IF v_copy IS NOT NULL THEN
            EXECUTE pg_catalog.format('SELECT * FROM %s($1, $2, $3, $4, $5, $6, $7)', v_copy)
               INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
              USING claim_general.source, claim_general.key, claim_general.fingerprint, claim_general.ttl, claim_general.lease, claim_general.event_type, claim_general.lock_wait;
            RETURN;
        END IF;
    END IF;

    -- The key's lock first: every write of a row of this key (and every
    -- raise of its source's lookback by a write) happens under it, so what
    -- is read after it (lookback, rows) includes every earlier claim of the
    -- key. Free in the common case; held by another claim of the key only
    -- while that claim's transaction is open.
    v_lockkey := hashtext(claim_general.source || chr(31) || claim_general.key);
    v_locked := pg_try_advisory_xact_lock(1768187245, v_lockkey);

    <<answer>>
    LOOP
        SELECT x.ttl, x.lease, x.max_attempts, x.duplicate_sampling, x.count_per_key,
               (SELECT max(l.lookback) FROM idem.lookbacks l WHERE l.source IN (claim_general.source, '*'))
          INTO v_ttl, v_lease, v_max, v_sample, v_per_key, v_lookback
          FROM (SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = claim_general.source
                UNION ALL
                SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = '*'
                 LIMIT 1) x;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = '42704',
                MESSAGE = format('idem.claim: no policy for source %L and no default policy', claim_general.source),
                HINT = 'Insert a row for the source, or the default row with source ''*'', into idem.policies.';
        END IF;
        v_ttl := coalesce(claim_general.ttl, v_ttl);
        v_lease := coalesce(claim_general.lease, v_lease);
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
         WHERE e.source = claim_general.source AND e.key = claim_general.key
           AND e.first_seen_month >= idem.window_start(v_now, v_lookback)
           AND e.expires_at > v_now
         LIMIT 1;
        v_found := FOUND;
        IF v_found THEN
            outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim_general.fingerprint, v_now);
            IF outcome IS NOT NULL THEN
                IF v_sample > 0 AND v_iso <> 'serializable' THEN
                    v_weight := idem.claim_weight(claim_general.source, v_sample, v_now);
                    IF v_weight > 0 THEN
                        PERFORM idem.count_duplicate(claim_general.source, claim_general.key, r.first_seen_month, v_weight, v_per_key, v_now);
                    END IF;
                END IF;
                EXIT answer;
            END IF;
        END IF;
        -- Wait for the lock at most lock_wait (default 5 seconds), polling
        -- so the wait is bounded whatever the caller's lock_timeout; past
        -- it, answer in_progress.
        v_until := clock_timestamp() + coalesce(claim_general.lock_wait, interval '5 seconds');
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
                v_lookback := idem.raise_lookback(claim_general.source, v_need);
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
             WHERE e.source = claim_general.source AND e.key = claim_general.key
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
                SELECT a.id INTO v_adopt FROM idem.adoptions a WHERE a.source = claim_general.source AND a.state = 'copying' LIMIT 1;
                IF v_adopt IS NOT NULL THEN
                    PERFORM idem.adopt_key(v_adopt, claim_general.key, v_now, v_lo, v_hi);
                    v_tries := v_tries - 1;
                    CONTINUE;
                END IF;
            END IF;
            IF NOT v_found THEN
                -- Held by the queue (its row may have expired, or sit in a
                -- month before the window): its job owns it.
                IF EXISTS (SELECT 1 FROM idem.holds h
                            WHERE h.source = claim_general.source AND h.key = claim_general.key AND h.state = 'queued') THEN
                    outcome := 'in_progress';
                    EXIT;
                END IF;
                -- SERIALIZABLE: a claim of this key committed into another
                -- month after this transaction's snapshot is not seen by
                -- the probe above (idem.serializable_placeholders).
                IF v_iso = 'serializable' AND (current_setting('idem.citus', true) IS DISTINCT FROM 'on' OR to_regclass('pg_catalog.pg_dist_partition') IS NULL) THEN
                    PERFORM idem.serializable_placeholders(claim_general.source, claim_general.key, v_now, v_lo, v_hi);
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
                VALUES (claim_general.source, claim_general.key, idem.utc_month(v_now), claim_general.event_type,
                        'processing', 1, v_token, v_now + v_lease, claim_general.fingerprint, v_now, v_now,
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
                 WHERE e.source = claim_general.source AND e.key = claim_general.key
                   AND e.first_seen_month = idem.utc_month(v_now) AND e.expires_at <= v_now;
                CONTINUE;
            END IF;
            outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim_general.fingerprint, v_now);
            IF outcome IS NOT NULL THEN
                -- A duplicate: read, not written. Counted with
                -- idem.claim_weight's weight.
                IF v_sample > 0 AND v_iso <> 'serializable' THEN
                    v_weight := idem.claim_weight(claim_general.source, v_sample, v_now);
                    IF v_weight > 0 THEN
                        PERFORM idem.count_duplicate(claim_general.source, claim_general.key, r.first_seen_month, v_weight, v_per_key, v_now);
                    END IF;
                END IF;
                EXIT;
            END IF;
            -- A lost lease or a retryable failure: take the key over, if the
            -- row is still as read (complete, fail and extend do not take
            -- the key's lock), and not held by the queue (between a job's
            -- attempts, or while a crashed worker's job waits for rescue).
            IF EXISTS (SELECT 1 FROM idem.holds h
                        WHERE h.source = claim_general.source AND h.key = claim_general.key AND h.state = 'queued') THEN
                outcome := 'in_progress';
                EXIT;
            END IF;
            IF v_max IS NOT NULL AND r.attempts >= v_max THEN
                UPDATE idem.processed_events e
                   SET status = 'failed', retryable = false, lease_expires_at = NULL, updated_at = v_now,
                       last_error = format('idem: gave up after %s attempts; last error: %s',
                                           r.attempts, coalesce(r.last_error, 'lease expired'))
                 WHERE e.source = claim_general.source AND e.key = claim_general.key AND e.first_seen_month = r.first_seen_month
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
                v_lookback := idem.raise_lookback(claim_general.source, v_need);
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
                   fingerprint = coalesce(e.fingerprint, claim_general.fingerprint),
                   event_type = coalesce(e.event_type, claim_general.event_type)
             WHERE e.source = claim_general.source AND e.key = claim_general.key AND e.first_seen_month = r.first_seen_month
               AND e.token = r.token AND e.status = r.status
            RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
            IF FOUND THEN
                outcome := 'acquired';
                EXIT;
            END IF;
        END LOOP;
    END IF;

    -- (version 19) An acquisition is counted in its minute of
    -- idem.activity (the dashboard's claims per minute) with the weight of
    -- idem.claim_weight: every one below idem.exact_counting_rate(), 1 in
    -- v_sample (as v_sample) above it.
    IF outcome = 'acquired' AND v_sample > 0 AND v_iso <> 'serializable' THEN
        v_weight := idem.claim_weight(claim_general.source, v_sample, v_now);
        IF v_weight > 0 THEN
            PERFORM idem.count_activity(claim_general.source, v_now, v_weight, 0);
        END IF;
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
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.claim(source text, key text, fingerprint text DEFAULT NULL::text, ttl interval DEFAULT NULL::interval, lease interval DEFAULT NULL::interval, event_type text DEFAULT NULL::text, lock_wait interval DEFAULT NULL::interval, OUT outcome text, OUT token bigint, OUT attempt integer, OUT lease_expires_at timestamp with time zone, OUT result jsonb, OUT error text, OUT first_seen timestamp with time zone, OUT expires_at timestamp with time zone, OUT lease_remaining interval)
 RETURNS record
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
DECLARE
    v_iso      text := current_setting('transaction_isolation');
    v_now      timestamptz;
    s          record;
    r          record;
    v_weight   integer;
BEGIN
    -- The short path: the key's lock free, the source's row in
    -- idem.claim_settings (its policy, its lookback, and whether it has
    -- holds or an adoption in progress, kept by triggers in the same
    -- transaction as every change of them), and then one of the two
    -- common answers: a duplicate from its settled row, or a new key
    -- inserted. Everything else is idem.claim_general's, called before
    -- anything is written: bad input, REPEATABLE READ, Citus, another claim
    -- of the key in an open transaction, a lookback to raise, a lost lease
    -- or retryable failure to take over, a hold, an adoption in progress,
    -- an expired row of the key in the current month. A new key in a
    -- SERIALIZABLE transaction stays on it, with its placeholders.
    IF v_iso = 'repeatable read'
       OR claim.source IS NULL OR claim.key IS NULL
       OR octet_length(claim.source) NOT BETWEEN 1 AND 64 OR octet_length(claim.key) NOT BETWEEN 1 AND 512
       OR btrim(claim.source, E' \t\r\n') = '' OR btrim(claim.key, E' \t\r\n') = ''
       OR claim.source ~ '[\x01-\x1f\x7f]'
       OR octet_length(claim.fingerprint) > 512 OR octet_length(claim.event_type) > 256
       OR (claim.ttl IS NOT NULL AND NOT (claim.ttl >= interval '1 minute' AND claim.ttl <= interval '10 years'))
       OR (claim.lease IS NOT NULL AND NOT (claim.lease >= interval '1 second' AND claim.lease <= interval '7 days'))
       OR (claim.lock_wait IS NOT NULL AND NOT (claim.lock_wait >= interval '0' AND claim.lock_wait <= interval '1 hour'))
       OR (current_setting('idem.citus', true) IS NOT DISTINCT FROM 'on' AND to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL)
       OR NOT pg_try_advisory_xact_lock(1768187245, hashtext(claim.source || chr(31) || claim.key)) THEN
        SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
          FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
        RETURN;
    END IF;
    -- Read after the key's lock, as claim_general reads the tables it is
    -- made from: every raise of the lookback by a write of this key is in it.
    -- A source with no row of its own yet claims with the default's.
    SELECT c.ttl, c.lease, c.duplicate_sampling, c.count_per_key, c.lookback, c.holds, c.adopting
      INTO s FROM idem.claim_settings c WHERE c.source = claim.source;
    IF NOT FOUND THEN
        SELECT c.ttl, c.lease, c.duplicate_sampling, c.count_per_key, c.lookback, false AS holds, false AS adopting
          INTO s FROM idem.claim_settings c WHERE c.source = '*';
        -- The source's own row, for its next claims (one lookup), written
        -- by a claim that can without waiting: one that holds the
        -- source's settings lock (class 1768187248) until it commits, so
        -- the others do not queue behind its uncommitted row.
        IF FOUND AND current_setting('transaction_read_only') = 'off'
           AND pg_try_advisory_xact_lock(1768187248, hashtext(claim.source)) THEN
            PERFORM idem.claim_settings_refresh(claim.source);
        END IF;
    END IF;
    v_now := idem.clock();
    IF NOT FOUND OR s.adopting
       OR coalesce(claim.lease, s.lease) > coalesce(claim.ttl, s.ttl)
       OR NOT (idem.days_at_most(greatest(coalesce(claim.ttl, s.ttl), coalesce(claim.lease, s.lease))) <= s.lookback) THEN
        SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
          FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
        RETURN;
    END IF;
    SELECT e.first_seen_month, e.status, e.attempts, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at
      INTO r FROM idem.processed_events e
     WHERE e.source = claim.source AND e.key = claim.key
       AND e.first_seen_month >= idem.window_start(v_now, s.lookback)
       AND e.first_seen_month <= idem.utc_month(v_now + interval '1 day')
       AND e.expires_at > v_now
     LIMIT 1;
    IF FOUND THEN
        outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim.fingerprint, v_now);
        IF outcome IS NULL THEN
            SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
              FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
            RETURN;
        END IF;
        attempt          := r.attempts;
        lease_expires_at := CASE WHEN outcome IN ('in_progress', 'mismatch') THEN r.lease_expires_at END;
        result           := CASE WHEN outcome = 'completed' THEN r.result END;
        error            := CASE WHEN outcome IN ('failed', 'completed') THEN r.last_error END;
        first_seen       := r.first_seen;
        expires_at       := r.expires_at;
        lease_remaining  := CASE WHEN outcome = 'in_progress' THEN greatest(r.lease_expires_at - v_now, interval '0') END;
        IF s.duplicate_sampling > 0 AND v_iso <> 'serializable' THEN
            v_weight := idem.claim_weight(claim.source, s.duplicate_sampling, v_now);
            IF v_weight > 0 THEN
                PERFORM idem.count_duplicate(claim.source, claim.key, r.first_seen_month, v_weight, s.count_per_key, v_now);
            END IF;
        END IF;
        RETURN;
    END IF;
    IF s.holds AND EXISTS (SELECT FROM idem.holds h
                            WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued') THEN
        SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
          FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
        RETURN;
    END IF;
    -- SERIALIZABLE: the placeholders that meet a claim of this key
    -- committed into another month after this transaction's snapshot
    -- (idem.serializable_placeholders), as idem.claim_general writes them.
    IF v_iso = 'serializable' THEN
        PERFORM idem.serializable_placeholders(claim.source, claim.key, v_now,
                    idem.window_start(v_now, s.lookback), idem.utc_month(v_now + interval '1 day'));
    END IF;
    token := idem.new_token();
    INSERT INTO idem.processed_events AS e
           (source, key, first_seen_month, event_type, status, attempts, token,
            lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
    VALUES (claim.source, claim.key, idem.utc_month(v_now), claim.event_type,
            'processing', 1, token, v_now + coalesce(claim.lease, s.lease), claim.fingerprint, v_now, v_now,
            v_now + greatest(coalesce(claim.ttl, s.ttl), coalesce(claim.lease, s.lease)))
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        -- An expired row of the key in the current month.
        SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
          FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
        RETURN;
    END IF;
    outcome          := 'acquired';
    attempt          := 1;
    lease_remaining  := coalesce(claim.lease, s.lease);
    lease_expires_at := v_now + lease_remaining;
    first_seen       := v_now;
    expires_at       := v_now + greatest(coalesce(claim.ttl, s.ttl), lease_remaining);
    -- Not counted in SERIALIZABLE (as idem.claim_general): every claim
    -- writing the same counters would make SSI abort them.
    IF s.duplicate_sampling > 0 AND v_iso <> 'serializable' THEN
        v_weight := idem.claim_weight(claim.source, s.duplicate_sampling, v_now);
        IF v_weight > 0 THEN
            PERFORM idem.count_activity(claim.source, v_now, v_weight, 0);
        END IF;
    END IF;
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.adopt_key(id bigint, key text, now timestamp with time zone, lo date, hi date)
 RETURNS void
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
    -- refused (idem.check_legacy, migration 14), and so is one whose read
    -- would call into an object of a role that is neither a superuser nor
    -- idem's owner (version 24: a column's type or collation changed, an
    -- index, statistics or check added since adopt_start).
    PERFORM idem.check_legacy_reads(a.legacy, a.key_column, a.at_column, a.result_column);
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
        v_at := NULL; -- a key that cannot be of the legacy key's type is not there
    END;
    -- (version 24) Checked again once read: an index or statistics object
    -- committed between the check and the read's planning (whose constant
    -- parts planning evaluates) fails the claim and undoes everything the
    -- read ran with it.
    PERFORM idem.check_legacy_reads(a.legacy, a.key_column, a.at_column, a.result_column);
    IF v_at IS NULL OR v_at + a.ttl <= adopt_key.now THEN
        RETURN; -- not processed there, or its retention is over: a new key
    END IF;
    -- A stamp in the future is taken as now, as the copy takes it.
    v_at := LEAST(v_at, adopt_key.now);
    -- In the month of this claim's clock, not of the legacy stamp: every
    -- writer of a key's row writes into the month of its clock, which is
    -- what a SERIALIZABLE claim's placeholders count on
    -- (idem.serializable_placeholders). first_seen keeps the stamp.
    INSERT INTO idem.processed_events
           (source, key, first_seen_month, status, attempts, token, result, first_seen, updated_at, completed_at, expires_at)
    VALUES (a.source, adopt_key.key, idem.utc_month(adopt_key.now), 'completed', 1, idem.new_token(), v_res, v_at, adopt_key.now, v_at, v_at + a.ttl)
    ON CONFLICT DO NOTHING;
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.adopt_batch(id bigint, batch_size integer, OUT read bigint, OUT copied bigint, OUT skipped bigint, OUT done boolean)
 RETURNS record
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
    -- refused (idem.check_legacy, migration 14), and so is one whose read
    -- would call into an object of a role that is neither a superuser nor
    -- idem's owner (version 24: a column's type or collation changed, an
    -- index, statistics or check added since adopt_start).
    PERFORM idem.check_legacy_reads(a.legacy, a.key_column, a.at_column, a.result_column);
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
        -- Into the month of the copy's clock ($4), not of the legacy
        -- stamp (first_seen keeps it): every writer of a key's row writes
        -- into the month of its clock (idem.serializable_placeholders).
        ins AS (
            INSERT INTO idem.processed_events AS p
                   (source, key, first_seen_month, status, attempts, token, result, first_seen, updated_at, completed_at, expires_at)
            SELECT $3, v.key, idem.utc_month($4), 'completed', 1, idem.new_token(), v.result, v.at, $4, v.at, v.at + $5
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
    -- (version 24) Checked again once read: an index or statistics object
    -- committed between the check and the reads' planning (whose constant
    -- parts planning evaluates) undoes the batch and everything it ran.
    PERFORM idem.check_legacy_reads(a.legacy, a.key_column, a.at_column, a.result_column);
    skipped := read - copied;
    UPDATE idem.adoptions x
       SET last_key = coalesce(v_last, x.last_key), copied = x.copied + adopt_batch.copied,
           skipped = x.skipped + adopt_batch.skipped, batches = x.batches + 1, updated_at = now(),
           future = x.future + v_future, bad_keys = x.bad_keys + v_bad + v_nulls, no_stamp = x.no_stamp + v_nostamp,
           state = CASE WHEN adopt_batch.done THEN 'done' ELSE 'copying' END,
           finished_at = CASE WHEN adopt_batch.done THEN now() END
     WHERE x.id = adopt_batch.id;
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.claim_batch(source text, keys text[], fingerprints text[] DEFAULT NULL::text[], ttl interval DEFAULT NULL::interval, lease interval DEFAULT NULL::interval, event_types text[] DEFAULT NULL::text[], lock_wait interval DEFAULT NULL::interval)
 RETURNS TABLE(ord integer, outcome text, token bigint, attempt integer, lease_expires_at timestamp with time zone, result jsonb, error text, first_seen timestamp with time zone, expires_at timestamp with time zone, lease_remaining interval)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
DECLARE
    v_iso      text := current_setting('transaction_isolation');
    v_n        integer := cardinality(claim_batch.keys);
    v_now      timestamptz;
    v_cur      date;               -- the current month: where a new key goes
    v_ttl      interval;
    v_lease    interval;
    v_max      integer;
    v_sample   integer;
    v_per_key  boolean;
    v_lookback interval;
    v_need     interval;
    v_lo       date;
    v_hi       date;
    v_until    timestamptz;
    v_adopting boolean;
    v_base     bigint;             -- the batch's token; each acquired key's is derived from it
    v_firsts   integer[];          -- every distinct key's first position
    v_ords     integer[];          -- the positions to lock (no final answer yet), in lock order
    v_hashes   integer[];          -- their lock keys
    v_locked   integer[] := '{}';  -- the positions whose key this call has locked
    v_from     integer;            -- the next position of v_ords to lock
    v_busy     integer;            -- a position of v_ords whose lock is busy
    v_gkeys    text[];             -- SERIALIZABLE: placeholders to delete
    v_sleep    double precision;
    v_gmonths  date[];
    v_slow     integer[];          -- the positions idem.claim answers
    v_i        integer;
    v_acq      integer := 0;
    v_dups     integer := 0;
    c          record;
    kr         record;             -- a key read before the locks
    ar         record;             -- a locked key's answer
    v_nfirst   integer;            -- the distinct keys
    v_open     integer[] := '{}';  -- read before the locks: the positions without a final answer
    v_weight   integer;
    a_ord      integer[] := '{}';  -- the locked keys answered by the set-based statement
    -- The duplicates' positions and months, for per-key counting.
    f_ord      integer[];
    f_month    date[];
BEGIN
    IF v_iso = 'repeatable read' THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'idem.claim_batch: REPEATABLE READ is not supported',
            DETAIL = 'A repeatable-read snapshot cannot see a claim of the same key committed in another monthly partition after the snapshot was taken, so a duplicate could run.',
            HINT = 'Claim in READ COMMITTED (the default) or SERIALIZABLE.';
    END IF;
    -- Every input check as one expression; only bad input takes the path
    -- that names the problem and the item.
    IF claim_batch.source IS NULL OR octet_length(claim_batch.source) NOT BETWEEN 1 AND 64
       OR btrim(claim_batch.source, E' \t\r\n') = '' OR claim_batch.source ~ '[\x01-\x1f\x7f]'
       OR v_n IS NULL OR v_n NOT BETWEEN 1 AND 1000
       OR array_ndims(claim_batch.keys) <> 1 OR array_lower(claim_batch.keys, 1) <> 1
       OR (claim_batch.fingerprints IS NOT NULL AND (array_ndims(claim_batch.fingerprints) <> 1
           OR array_lower(claim_batch.fingerprints, 1) <> 1 OR cardinality(claim_batch.fingerprints) <> v_n))
       OR (claim_batch.event_types IS NOT NULL AND (array_ndims(claim_batch.event_types) <> 1
           OR array_lower(claim_batch.event_types, 1) <> 1 OR cardinality(claim_batch.event_types) <> v_n))
       OR EXISTS (SELECT 1 FROM unnest(claim_batch.keys, claim_batch.fingerprints, claim_batch.event_types) x(k, f, t)
                   WHERE x.k IS NULL OR octet_length(x.k) NOT BETWEEN 1 AND 512 OR btrim(x.k, E' \t\r\n') = ''
                      OR octet_length(x.f) > 512 OR octet_length(x.t) > 256)
       OR (claim_batch.ttl IS NOT NULL AND NOT idem.valid_ttl(claim_batch.ttl))
       OR (claim_batch.lease IS NOT NULL AND NOT idem.valid_lease(claim_batch.lease))
       OR (claim_batch.lock_wait IS NOT NULL AND NOT (claim_batch.lock_wait >= interval '0' AND claim_batch.lock_wait <= interval '1 hour')) THEN
        PERFORM idem.check_batch('idem.claim_batch', claim_batch.source, v_n, claim_batch.keys, claim_batch.fingerprints);
        PERFORM idem.check_batch('idem.claim_batch', claim_batch.source, v_n, claim_batch.keys, claim_batch.event_types);
        FOR v_i IN 1 .. v_n LOOP
            -- idem.claim's own checks, naming the item.
            PERFORM idem.check_key(format('idem.claim_batch (item %s)', v_i), claim_batch.source, claim_batch.keys[v_i]);
            IF octet_length(claim_batch.fingerprints[v_i]) > 512 THEN
                RAISE EXCEPTION USING ERRCODE = '22001',
                    MESSAGE = format('idem.claim_batch (item %s): fingerprint is longer than 512 bytes', v_i),
                    HINT = 'Pass a hash of the request, not the request.';
            END IF;
            IF octet_length(claim_batch.event_types[v_i]) > 256 THEN
                RAISE EXCEPTION USING ERRCODE = '22001',
                    MESSAGE = format('idem.claim_batch (item %s): event_type is longer than 256 bytes', v_i);
            END IF;
        END LOOP;
        -- ttl, lease and lock_wait: idem.claim checks them as it checks its
        -- own (the first item's call raises).
        PERFORM idem.claim(claim_batch.source, claim_batch.keys[1], NULL, claim_batch.ttl, claim_batch.lease,
                           NULL, claim_batch.lock_wait);
        RAISE EXCEPTION USING ERRCODE = 'XX000', MESSAGE = 'idem.claim_batch: an input check disagrees with idem.claim';
    END IF;
    IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL AND idem.distributed() THEN
        RAISE EXCEPTION USING ERRCODE = 'ID006',
            MESSAGE = 'idem.claim_batch is not supported on a distributed (Citus) installation',
            DETAIL = 'The keys of a batch live on several nodes; a per-key lock excludes only the claims of the node it is taken on.',
            HINT = 'Claim each key with idem.claim, which Citus delegates to the key''s node.';
    END IF;
    v_until := clock_timestamp() + coalesce(claim_batch.lock_wait, interval '5 seconds');

    -- The source's policy, and its lookback for the window of the first
    -- read (a lookback raised meanwhile only makes that read miss a row,
    -- and a key it does not answer is read again under its lock below,
    -- with the lookback read again there, as idem.claim reads it).
    SELECT x.ttl, x.lease, x.max_attempts, x.duplicate_sampling, x.count_per_key,
           (SELECT max(l.lookback) FROM idem.lookbacks l WHERE l.source IN (claim_batch.source, '*'))
      INTO v_ttl, v_lease, v_max, v_sample, v_per_key, v_lookback
      FROM (SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
              FROM idem.policies p WHERE p.source = claim_batch.source
            UNION ALL
            SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
              FROM idem.policies p WHERE p.source = '*'
             LIMIT 1) x;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = '42704',
            MESSAGE = format('idem.claim_batch: no policy for source %L and no default policy', claim_batch.source),
            HINT = 'Insert a row for the source, or the default row with source ''*'', into idem.policies.';
    END IF;
    v_ttl := coalesce(claim_batch.ttl, v_ttl);
    v_lease := coalesce(claim_batch.lease, v_lease);
    IF v_lease > v_ttl THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('idem.claim_batch: lease %s is longer than ttl %s', v_lease, v_ttl);
    END IF;
    v_now := idem.clock();
    -- The window of the first read: the oldest month that can hold a live
    -- row of the source to the month of tomorrow. Computed once here: in a
    -- probe's condition it would be computed again for every key.
    v_lo := idem.window_start(v_now, v_lookback);
    v_hi := idem.utc_month(v_now + interval '1 day');

    -- A batch whose first key already has a final answer (completed,
    -- failed for good, a mismatch, a live lease) is most likely a
    -- redelivery: its keys are read first, before any lock, and those with
    -- a final answer answer at once, as idem.claim answers from what is
    -- committed when a key's lock is busy; a duplicate then takes no lock
    -- and writes nothing. Any other batch goes to its locks at once, and
    -- its keys are read there (a new key is then looked up once, by its
    -- insert). Both paths give each key the same answer.
    PERFORM 1
      FROM idem.processed_events x
     WHERE x.source = claim_batch.source AND x.key = claim_batch.keys[1]
       AND x.first_seen_month >= v_lo AND x.first_seen_month <= v_hi
       AND x.expires_at > v_now
       AND idem.settled_outcome(x.status, x.retryable, x.lease_expires_at, x.fingerprint,
                                claim_batch.fingerprints[1], v_now) IS NOT NULL
     LIMIT 1;
    IF NOT FOUND THEN
        -- The distinct keys (each at its first position) in the global
        -- lock order: by the lock's key, then position.
        SELECT array_agg(d.o), array_agg(d.o ORDER BY d.h, d.o), array_agg(d.h ORDER BY d.h, d.o)
          INTO v_firsts, v_ords, v_hashes
          FROM (SELECT min(u.o)::integer AS o, hashtext(claim_batch.source || chr(31) || u.k) AS h
                  FROM unnest(claim_batch.keys) WITH ORDINALITY u(k, o)
                 GROUP BY u.k) d;
        v_nfirst := cardinality(v_firsts);
    ELSE
        -- Each distinct key (at its first position) and its live row in
        -- the window, probed by its own index lookup (a lateral probe:
        -- `key = ANY(...)` under a generic plan filters every row of the
        -- source). A final answer is returned as it is read; the other keys
        -- are kept for their locks.
        v_nfirst := 0;
        FOR kr IN
            SELECT g.o, e.first_seen_month AS month, e.attempts, e.lease_expires_at, e.result, e.last_error,
                   e.first_seen, e.expires_at,
                   idem.settled_outcome(e.status, e.retryable, e.lease_expires_at, e.fingerprint,
                                        claim_batch.fingerprints[g.o], v_now) AS settled
              FROM (SELECT min(u.o)::integer AS o, u.k
                      FROM unnest(claim_batch.keys) WITH ORDINALITY u(k, o)
                     GROUP BY u.k) g
              LEFT JOIN LATERAL (
                  SELECT x.first_seen_month, x.status, x.attempts, x.lease_expires_at, x.fingerprint, x.result,
                         x.last_error, x.retryable, x.first_seen, x.expires_at
                    FROM idem.processed_events x
                   WHERE x.source = claim_batch.source AND x.key = g.k
                     AND x.first_seen_month >= v_lo AND x.first_seen_month <= v_hi
                     AND x.expires_at > v_now
                   LIMIT 1) e ON true
        LOOP
            v_nfirst := v_nfirst + 1;
            IF kr.settled IS NULL THEN
                v_open := v_open || kr.o;
                CONTINUE;
            END IF;
            ord := kr.o; outcome := kr.settled; token := NULL; attempt := kr.attempts;
            lease_expires_at := CASE WHEN kr.settled IN ('in_progress', 'mismatch') THEN kr.lease_expires_at END;
            result := CASE WHEN kr.settled = 'completed' THEN kr.result END;
            error := CASE WHEN kr.settled IN ('failed', 'completed') THEN kr.last_error END;
            first_seen := kr.first_seen; expires_at := kr.expires_at;
            lease_remaining := CASE WHEN kr.settled = 'in_progress' THEN greatest(kr.lease_expires_at - v_now, interval '0') END;
            RETURN NEXT;
            -- Every answer read from a row is a duplicate (counted below).
            v_dups := v_dups + 1;
            IF v_per_key THEN
                f_ord := f_ord || kr.o;
                f_month := f_month || kr.month;
            END IF;
        END LOOP;
        -- The keys without a final answer in the global lock order (by
        -- the lock's key, then position).
        IF cardinality(v_open) > 0 THEN
            SELECT array_agg(u.o ORDER BY u.h, u.o), array_agg(u.h ORDER BY u.h, u.o) INTO v_ords, v_hashes
              FROM (SELECT l.o, hashtext(claim_batch.source || chr(31) || claim_batch.keys[l.o]) AS h
                      FROM unnest(v_open) l(o)) u;
        END IF;
        IF v_nfirst < v_n THEN
            SELECT array_agg(g.o) INTO v_firsts
              FROM (SELECT min(u.o)::integer AS o FROM unnest(claim_batch.keys) WITH ORDINALITY u(k, o) GROUP BY u.k) g;
        END IF;
    END IF;

    -- Each remaining key's lock in that order, as idem.claim takes it: one
    -- statement tries them in order and stops at the first that another
    -- open transaction holds (LIMIT 1: the later ones are not tried). That
    -- key is answered by idem.claim at once (from what is committed when
    -- that is final, or after waiting for the lock until the batch's
    -- deadline), and the statement goes on after it: a batch never holds a
    -- later key while it waits for an earlier one.
    v_from := 1;
    WHILE v_from <= coalesce(cardinality(v_ords), 0) LOOP
        SELECT v_from + u.i::integer - 1 INTO v_busy
          FROM unnest(v_hashes[v_from:]) WITH ORDINALITY u(h, i)
         WHERE NOT pg_try_advisory_xact_lock(1768187245, u.h)
         LIMIT 1;
        IF v_busy IS NULL THEN
            v_locked := v_locked || v_ords[v_from:];
            EXIT;
        END IF;
        v_locked := v_locked || v_ords[v_from:v_busy - 1];
        -- SERIALIZABLE: the transaction's snapshot predates whatever the
        -- holder commits, which idem.claim would not see after its wait
        -- (a row in another month's partition): wait for the lock here
        -- (polling, as idem.claim does, until the batch's deadline), and
        -- the key joins the others, read under the guard below.
        IF v_iso = 'serializable' THEN
            v_sleep := 0.001;
            LOOP
                IF pg_try_advisory_xact_lock(1768187245, v_hashes[v_busy]) THEN
                    v_locked := v_locked || v_ords[v_busy];
                    EXIT;
                END IF;
                EXIT WHEN clock_timestamp() >= v_until;
                PERFORM pg_sleep(least(v_sleep, greatest(extract(epoch FROM v_until - clock_timestamp()), 0)));
                v_sleep := least(v_sleep * 2, 0.05);
            END LOOP;
            IF v_locked[cardinality(v_locked)] IS NOT DISTINCT FROM v_ords[v_busy] THEN
                v_from := v_busy + 1;
                CONTINUE;
            END IF;
        END IF;
        SELECT * INTO c FROM idem.claim(claim_batch.source, claim_batch.keys[v_ords[v_busy]], claim_batch.fingerprints[v_ords[v_busy]],
                                        claim_batch.ttl, claim_batch.lease, claim_batch.event_types[v_ords[v_busy]],
                                        greatest(v_until - clock_timestamp(), interval '0'));
        ord := v_ords[v_busy]; outcome := c.outcome; token := c.token; attempt := c.attempt;
        lease_expires_at := c.lease_expires_at; result := c.result; error := c.error;
        first_seen := c.first_seen; expires_at := c.expires_at; lease_remaining := c.lease_remaining;
        RETURN NEXT;
        v_from := v_busy + 1;
    END LOOP;

    IF cardinality(v_locked) > 0 THEN
        -- The source's lookback, read again under the keys' locks, as
        -- idem.claim reads it (a claim that held one of them may have
        -- raised it).
        SELECT max(l.lookback) INTO v_lookback FROM idem.lookbacks l WHERE l.source IN (claim_batch.source, '*');
        v_now := idem.clock();
        v_need := idem.days_at_most(greatest(v_ttl, v_lease));
        IF v_need > v_lookback THEN
            v_lookback := idem.raise_lookback(claim_batch.source, v_need);
        END IF;
        -- idem.claim's window: the oldest month that can hold a live row of
        -- the source to the month of tomorrow.
        v_lo := idem.window_start(v_now, v_lookback);
        v_hi := idem.utc_month(v_now + interval '1 day');
        v_cur := idem.utc_month(v_now);
        v_adopting := EXISTS (SELECT 1 FROM idem.adoptions a WHERE a.source = claim_batch.source AND a.state = 'copying');
        v_base := idem.new_token();

        -- SERIALIZABLE: the transaction's snapshot may predate a claim of
        -- one of these keys that committed into another month's partition
        -- before this call took the key's lock, and the probe below would
        -- not see its row. An insert meets every committed row of its
        -- partition's unique index, visible or not, and fails with a
        -- serialization failure on one it cannot see: so a placeholder of
        -- each key goes into every other month of the window, and those
        -- inserted (no row of the key there) are deleted again. A visible
        -- row there is found by the probe as usual.
        IF v_iso = 'serializable' THEN
            WITH g AS (
                INSERT INTO idem.processed_events AS e
                       (source, key, first_seen_month, status, attempts, token, first_seen, updated_at, expires_at)
                SELECT claim_batch.source, claim_batch.keys[l.o], m.m, 'processing', 1, 0, v_now, v_now, v_now
                  FROM unnest(v_locked) l(o),
                       (SELECT d::date AS m FROM generate_series(idem.serializable_floor(v_now, v_lo), v_hi, interval '1 month') d) m
                 WHERE m.m <> v_cur
                ON CONFLICT DO NOTHING
                RETURNING e.key, e.first_seen_month)
            SELECT array_agg(g.key), array_agg(g.first_seen_month) INTO v_gkeys, v_gmonths FROM g;
            IF v_gkeys IS NOT NULL THEN
                DELETE FROM idem.processed_events e
                 USING unnest(v_gkeys, v_gmonths) g(k, m)
                 WHERE e.source = claim_batch.source AND e.key = g.k AND e.first_seen_month = g.m AND e.token = 0;
            END IF;
        END IF;

        -- One statement for the locked keys' common answers, read again
        -- under their locks with a new snapshot:
        -- * p: each key's live row in the window's other months (before
        --   and after the current one, each an index lookup); a settled
        --   one answers as idem.claim answers it; for a key with none, its
        --   queue hold (a probe with LIMIT: an EXISTS may be planned as a
        --   hash of every hold of the source);
        -- * ins: a key with no row there and no hold is inserted into the
        --   current month (ON CONFLICT DO NOTHING: the unique index reads
        --   the current month for it, so it is not probed first): acquired;
        -- * cur: a key the insert met a row of, or a held key, is answered
        --   from its live row in the current month when that is settled;
        --   a held key without one is in_progress.
        -- What is left (a lost lease or a retryable failure to take over,
        -- an expired row in the current month, a key while its source's
        -- legacy table is adopted) is idem.claim's, below. Each answer is
        -- returned as the statement yields it.
        FOR ar IN
        WITH p AS MATERIALIZED (
            SELECT l.o, claim_batch.keys[l.o] AS k, e.*,
                   CASE WHEN e.status IS NULL AND NOT v_adopting THEN h.held IS NOT NULL END AS held,
                   idem.settled_outcome(e.status, e.retryable, e.lease_expires_at, e.fingerprint,
                                        claim_batch.fingerprints[l.o], v_now) AS settled
              FROM unnest(v_locked) l(o)
              LEFT JOIN LATERAL (
                  (SELECT x.first_seen_month, x.status, x.attempts, x.lease_expires_at, x.fingerprint, x.result,
                          x.last_error, x.retryable, x.first_seen, x.expires_at
                     FROM idem.processed_events x
                    WHERE x.source = claim_batch.source AND x.key = claim_batch.keys[l.o]
                      AND x.first_seen_month >= v_lo AND x.first_seen_month < v_cur
                      AND x.expires_at > v_now
                    LIMIT 1)
                  UNION ALL
                  (SELECT x.first_seen_month, x.status, x.attempts, x.lease_expires_at, x.fingerprint, x.result,
                          x.last_error, x.retryable, x.first_seen, x.expires_at
                     FROM idem.processed_events x
                    WHERE x.source = claim_batch.source AND x.key = claim_batch.keys[l.o]
                      AND x.first_seen_month >= (v_cur + interval '1 month')::date AND x.first_seen_month <= v_hi
                      AND x.expires_at > v_now
                    LIMIT 1)
                  LIMIT 1) e ON true
              LEFT JOIN LATERAL (
                  SELECT true AS held FROM idem.holds y
                   WHERE y.source = claim_batch.source AND y.key = claim_batch.keys[l.o] AND y.state = 'queued'
                   LIMIT 1) h ON e.status IS NULL AND NOT v_adopting),
        ins AS (
            INSERT INTO idem.processed_events AS e
                   (source, key, first_seen_month, event_type, status, attempts, token,
                    lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
            SELECT claim_batch.source, p.k, v_cur, claim_batch.event_types[p.o],
                   'processing', 1, greatest(v_base # (p.o::bigint * 2654435761), 1), v_now + v_lease,
                   claim_batch.fingerprints[p.o], v_now, v_now, v_now + greatest(v_ttl, v_lease)
              FROM p WHERE p.held = false
            ON CONFLICT DO NOTHING
            RETURNING e.key, e.token, e.attempts, e.lease_expires_at, e.first_seen, e.expires_at),
        cur AS MATERIALIZED (
            SELECT p.o, p.held, r.*,
                   idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint,
                                        claim_batch.fingerprints[p.o], v_now) AS settled
              FROM p
              LEFT JOIN LATERAL (
                  SELECT x.first_seen_month, x.status, x.attempts, x.lease_expires_at, x.fingerprint, x.result,
                         x.last_error, x.retryable, x.first_seen, x.expires_at
                    FROM idem.processed_events x
                   WHERE x.source = claim_batch.source AND x.key = p.k
                     AND x.first_seen_month = v_cur AND x.expires_at > v_now
                   LIMIT 1) r ON true
             WHERE p.held IS NOT NULL AND NOT EXISTS (SELECT 1 FROM ins i WHERE i.key = p.k)),
        a AS (
            SELECT p.o, p.settled AS outcome, NULL::bigint AS token, p.attempts,
                   CASE WHEN p.settled IN ('in_progress', 'mismatch') THEN p.lease_expires_at END AS lease_at,
                   CASE WHEN p.settled = 'completed' THEN p.result END AS result,
                   CASE WHEN p.settled IN ('failed', 'completed') THEN p.last_error END AS error,
                   p.first_seen, p.expires_at,
                   CASE WHEN p.settled = 'in_progress' THEN greatest(p.lease_expires_at - v_now, interval '0') END AS left_,
                   p.first_seen_month AS month
              FROM p WHERE p.settled IS NOT NULL
            UNION ALL
            SELECT r.o, r.settled, NULL, r.attempts,
                   CASE WHEN r.settled IN ('in_progress', 'mismatch') THEN r.lease_expires_at END,
                   CASE WHEN r.settled = 'completed' THEN r.result END,
                   CASE WHEN r.settled IN ('failed', 'completed') THEN r.last_error END,
                   r.first_seen, r.expires_at,
                   CASE WHEN r.settled = 'in_progress' THEN greatest(r.lease_expires_at - v_now, interval '0') END,
                   r.first_seen_month
              FROM cur r WHERE r.settled IS NOT NULL
            UNION ALL
            SELECT r.o, 'in_progress', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
              FROM cur r WHERE r.held AND r.status IS NULL
            UNION ALL
            SELECT p.o, 'acquired', i.token, i.attempts, i.lease_expires_at, NULL, NULL, i.first_seen, i.expires_at,
                   v_lease, NULL
              FROM ins i JOIN p ON p.k = i.key)
        SELECT a.o, a.outcome, a.token, a.attempts, a.lease_at, a.result, a.error, a.first_seen, a.expires_at,
               a.left_, a.month
          FROM a
        LOOP
            ord := ar.o; outcome := ar.outcome; token := ar.token; attempt := ar.attempts;
            lease_expires_at := ar.lease_at; result := ar.result; error := ar.error;
            first_seen := ar.first_seen; expires_at := ar.expires_at; lease_remaining := ar.left_;
            RETURN NEXT;
            a_ord := a_ord || ar.o;
            IF ar.outcome = 'acquired' THEN
                v_acq := v_acq + 1;
            ELSIF ar.month IS NOT NULL THEN
                -- An answer read from a row: a duplicate (counted below).
                v_dups := v_dups + 1;
                IF v_per_key THEN
                    f_ord := f_ord || ar.o;
                    f_month := f_month || ar.month;
                END IF;
            END IF;
        END LOOP;
    END IF;

    -- Counting, as idem.claim counts (not in SERIALIZABLE; v_sample 0
    -- turns it off): the acquisitions in idem.activity, every one; the
    -- duplicates (every answer read from a row, before the locks or after)
    -- as idem.count_duplicate counts them, the batch weighed as one claim
    -- (idem.claim_weight): all of them while the source's claims this
    -- minute are below idem.exact_counting_rate(); above it 1 batch in
    -- v_sample counts all of its duplicates, each as v_sample, and the
    -- others count none. A redelivered batch then mostly
    -- writes nothing, as a duplicate claim mostly writes nothing. Per key,
    -- each duplicate is sampled as idem.claim samples it.
    IF v_sample > 0 AND v_iso <> 'serializable' THEN
        IF v_acq > 0 THEN
            PERFORM idem.count_activity(claim_batch.source, v_now, v_acq, 0);
        END IF;
        IF v_dups > 0 AND NOT v_per_key THEN
            v_weight := idem.claim_weight(claim_batch.source, v_sample, v_now);
            IF v_weight > 0 THEN
                PERFORM idem.count_duplicate(claim_batch.source, NULL, NULL, v_dups * v_weight, false, v_now);
            END IF;
        ELSIF v_dups > 0 THEN
            PERFORM idem.count_duplicate(claim_batch.source, claim_batch.keys[x.o], x.month, v_sample, true, v_now)
               FROM unnest(f_ord, f_month) x(o, month)
              WHERE v_sample = 1 OR random() * v_sample < 1;
        END IF;
    END IF;

    -- The rest, by idem.claim (each key's lock is this transaction's
    -- already).
    IF coalesce(cardinality(a_ord), 0) < cardinality(v_locked) THEN
        SELECT array_agg(l.o ORDER BY l.o) INTO v_slow
          FROM unnest(v_locked) l(o) WHERE l.o <> ALL (coalesce(a_ord, '{}'));
        FOREACH v_i IN ARRAY v_slow LOOP
            SELECT * INTO c FROM idem.claim(claim_batch.source, claim_batch.keys[v_i], claim_batch.fingerprints[v_i],
                                            claim_batch.ttl, claim_batch.lease, claim_batch.event_types[v_i],
                                            greatest(v_until - clock_timestamp(), interval '0'));
            ord := v_i; outcome := c.outcome; token := c.token; attempt := c.attempt;
            lease_expires_at := c.lease_expires_at; result := c.result; error := c.error;
            first_seen := c.first_seen; expires_at := c.expires_at; lease_remaining := c.lease_remaining;
            RETURN NEXT;
        END LOOP;
    END IF;

    -- A key repeated in the batch: a duplicate of its first position,
    -- answered by idem.claim after it.
    IF v_nfirst < v_n THEN
        FOR v_i IN SELECT u.o FROM generate_subscripts(claim_batch.keys, 1) u(o)
                    WHERE u.o <> ALL (v_firsts) ORDER BY u.o LOOP
            SELECT * INTO c FROM idem.claim(claim_batch.source, claim_batch.keys[v_i], claim_batch.fingerprints[v_i],
                                            claim_batch.ttl, claim_batch.lease, claim_batch.event_types[v_i],
                                            greatest(v_until - clock_timestamp(), interval '0'));
            ord := v_i; outcome := c.outcome; token := c.token; attempt := c.attempt;
            lease_expires_at := c.lease_expires_at; result := c.result; error := c.error;
            first_seen := c.first_seen; expires_at := c.expires_at; lease_remaining := c.lease_remaining;
            RETURN NEXT;
        END LOOP;
    END IF;
END
$function$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.claim_general(source text, key text, fingerprint text DEFAULT NULL::text, ttl interval DEFAULT NULL::interval, lease interval DEFAULT NULL::interval, event_type text DEFAULT NULL::text, lock_wait interval DEFAULT NULL::interval, OUT outcome text, OUT token bigint, OUT attempt integer, OUT lease_expires_at timestamp with time zone, OUT result jsonb, OUT error text, OUT first_seen timestamp with time zone, OUT expires_at timestamp with time zone, OUT lease_remaining interval)
 RETURNS record
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
    v_placed   date[];
    v_copy     text;
    v_weight   integer;
BEGIN
    IF v_iso = 'repeatable read' THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'idem.claim: REPEATABLE READ is not supported',
            DETAIL = 'A repeatable-read snapshot cannot see a claim of the same key committed in another monthly partition after the snapshot was taken, so a duplicate could run.',
            HINT = 'Claim in READ COMMITTED (the default) or SERIALIZABLE.';
    END IF;
    -- All input checks as one expression (cheap); only bad input takes the
    -- slow path that names the problem.
    IF claim_general.source IS NULL OR claim_general.key IS NULL
       OR octet_length(claim_general.source) NOT BETWEEN 1 AND 64 OR octet_length(claim_general.key) NOT BETWEEN 1 AND 512
       OR btrim(claim_general.source, E' \t\r\n') = '' OR btrim(claim_general.key, E' \t\r\n') = ''
       OR claim_general.source ~ '[\x01-\x1f\x7f]'
       OR octet_length(claim_general.fingerprint) > 512 OR octet_length(claim_general.event_type) > 256
       OR (claim_general.ttl IS NOT NULL AND NOT (claim_general.ttl >= interval '1 minute' AND claim_general.ttl <= interval '10 years'))
       OR (claim_general.lease IS NOT NULL AND NOT (claim_general.lease >= interval '1 second' AND claim_general.lease <= interval '7 days'))
       OR (claim_general.lock_wait IS NOT NULL AND NOT (claim_general.lock_wait >= interval '0' AND claim_general.lock_wait <= interval '1 hour')) THEN
        PERFORM idem.check_key('idem.claim', claim_general.source, claim_general.key);
        IF octet_length(claim_general.fingerprint) > 512 THEN
            RAISE EXCEPTION USING ERRCODE = '22001', MESSAGE = 'idem.claim: fingerprint is longer than 512 bytes',
                HINT = 'Pass a hash of the request, not the request.';
        END IF;
        IF octet_length(claim_general.event_type) > 256 THEN
            RAISE EXCEPTION USING ERRCODE = '22001', MESSAGE = 'idem.claim: event_type is longer than 256 bytes';
        END IF;
        IF claim_general.ttl IS NOT NULL AND NOT idem.valid_ttl(claim_general.ttl) THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: ttl %s is out of range', claim_general.ttl),
                HINT = 'ttl must be between 1 minute and 10 years.';
        END IF;
        IF claim_general.lease IS NOT NULL AND NOT idem.valid_lease(claim_general.lease) THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lease %s is out of range', claim_general.lease),
                HINT = 'lease must be between 1 second and 7 days.';
        END IF;
        IF claim_general.lock_wait IS NOT NULL AND NOT (claim_general.lock_wait >= interval '0' AND claim_general.lock_wait <= interval '1 hour') THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lock_wait %s is out of range', claim_general.lock_wait),
                HINT = 'lock_wait must be between 0 and 1 hour.';
        END IF;
    END IF;

    -- (version 11) On Citus (idem.citus_setup sets idem.citus on this
    -- function) the key's lock below is the owning node's only: a claim
    -- that was not delegated to the node holding the key's shard would not
    -- exclude a delegated claim of the same key, so it is refused.
    IF current_setting('idem.citus', true) = 'on' THEN  -- (NULL elsewhere; AND would not stop at it)
        -- (version 28) '' when the key's shard is not on this node; the
        -- name of this claim's copy on the key's shard (idem.citus_shard_claims)
        -- when there is one: the claim is answered by it, its statements on
        -- the shard's tables, which PostgreSQL plans and caches without
        -- Citus; NULL without one (a shard split since): the statements
        -- below, through Citus. (In the copies this call reads NULL.)
        v_copy := idem.citus_shard_claim(claim_general.key);
        IF v_copy OPERATOR(pg_catalog.=) '' THEN
            RAISE EXCEPTION USING ERRCODE = 'ID005',
                MESSAGE = 'idem.claim ran on a node that does not hold the key''s shard',
                DETAIL = 'On Citus the per-key lock is taken on the node that owns the key; this call was not delegated there.',
                HINT = 'Call it as SELECT ... FROM idem.claim(...) with the key as a constant or parameter (as idem''s Go API does), not from another query or function.';
        END IF;
        IF v_copy IS NOT NULL THEN
            EXECUTE pg_catalog.format('SELECT * FROM %s($1, $2, $3, $4, $5, $6, $7)', v_copy)
               INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
              USING claim_general.source, claim_general.key, claim_general.fingerprint, claim_general.ttl, claim_general.lease, claim_general.event_type, claim_general.lock_wait;
            RETURN;
        END IF;
    END IF;

    -- The key's lock first: every write of a row of this key (and every
    -- raise of its source's lookback by a write) happens under it, so what
    -- is read after it (lookback, rows) includes every earlier claim of the
    -- key. Free in the common case; held by another claim of the key only
    -- while that claim's transaction is open.
    v_lockkey := hashtext(claim_general.source || chr(31) || claim_general.key);
    v_locked := pg_try_advisory_xact_lock(1768187245, v_lockkey);

    <<answer>>
    LOOP
        SELECT x.ttl, x.lease, x.max_attempts, x.duplicate_sampling, x.count_per_key,
               (SELECT max(l.lookback) FROM idem.lookbacks l WHERE l.source IN (claim_general.source, '*'))
          INTO v_ttl, v_lease, v_max, v_sample, v_per_key, v_lookback
          FROM (SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = claim_general.source
                UNION ALL
                SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = '*'
                 LIMIT 1) x;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = '42704',
                MESSAGE = format('idem.claim: no policy for source %L and no default policy', claim_general.source),
                HINT = 'Insert a row for the source, or the default row with source ''*'', into idem.policies.';
        END IF;
        v_ttl := coalesce(claim_general.ttl, v_ttl);
        v_lease := coalesce(claim_general.lease, v_lease);
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
         WHERE e.source = claim_general.source AND e.key = claim_general.key
           AND e.first_seen_month >= idem.window_start(v_now, v_lookback)
           AND e.expires_at > v_now
         LIMIT 1;
        v_found := FOUND;
        IF v_found THEN
            outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim_general.fingerprint, v_now);
            IF outcome IS NOT NULL THEN
                IF v_sample > 0 AND v_iso <> 'serializable' THEN
                    v_weight := idem.claim_weight(claim_general.source, v_sample, v_now);
                    IF v_weight > 0 THEN
                        PERFORM idem.count_duplicate(claim_general.source, claim_general.key, r.first_seen_month, v_weight, v_per_key, v_now);
                    END IF;
                END IF;
                EXIT answer;
            END IF;
        END IF;
        -- Wait for the lock at most lock_wait (default 5 seconds), polling
        -- so the wait is bounded whatever the caller's lock_timeout; past
        -- it, answer in_progress.
        v_until := clock_timestamp() + coalesce(claim_general.lock_wait, interval '5 seconds');
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
                v_lookback := idem.raise_lookback(claim_general.source, v_need);
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
             WHERE e.source = claim_general.source AND e.key = claim_general.key
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
                SELECT a.id INTO v_adopt FROM idem.adoptions a WHERE a.source = claim_general.source AND a.state = 'copying' LIMIT 1;
                IF v_adopt IS NOT NULL THEN
                    PERFORM idem.adopt_key(v_adopt, claim_general.key, v_now, v_lo, v_hi);
                    v_tries := v_tries - 1;
                    CONTINUE;
                END IF;
            END IF;
            IF NOT v_found THEN
                -- Held by the queue (its row may have expired, or sit in a
                -- month before the window): its job owns it.
                IF EXISTS (SELECT 1 FROM idem.holds h
                            WHERE h.source = claim_general.source AND h.key = claim_general.key AND h.state = 'queued') THEN
                    outcome := 'in_progress';
                    EXIT;
                END IF;
                -- SERIALIZABLE: a claim of this key committed into another
                -- month after this transaction's snapshot is not seen by
                -- the probe above. A placeholder insert into each other
                -- month of the window meets it (40001 on a committed row
                -- the snapshot cannot see); the ones that went in are
                -- deleted again. One statement for every month.
                IF v_iso = 'serializable' AND current_setting('idem.citus', true) IS DISTINCT FROM 'on' THEN
                    WITH ph AS (
                        INSERT INTO idem.processed_events AS e
                               (source, key, first_seen_month, status, attempts, token, first_seen, updated_at, expires_at)
                        SELECT claim_general.source, claim_general.key, g::date, 'processing', 1, 0, v_now, v_now, v_now
                          FROM generate_series(v_lo::timestamp, v_hi::timestamp, interval '1 month') g
                         WHERE g::date <> idem.utc_month(v_now)
                        ON CONFLICT DO NOTHING
                        RETURNING e.first_seen_month)
                    SELECT array_agg(ph.first_seen_month) INTO v_placed FROM ph;
                    IF v_placed IS NOT NULL THEN
                        DELETE FROM idem.processed_events e
                         WHERE e.source = claim_general.source AND e.key = claim_general.key
                           AND e.first_seen_month BETWEEN v_lo AND v_hi
                           AND e.first_seen_month = ANY (v_placed) AND e.token = 0;
                    END IF;
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
                VALUES (claim_general.source, claim_general.key, idem.utc_month(v_now), claim_general.event_type,
                        'processing', 1, v_token, v_now + v_lease, claim_general.fingerprint, v_now, v_now,
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
                 WHERE e.source = claim_general.source AND e.key = claim_general.key
                   AND e.first_seen_month = idem.utc_month(v_now) AND e.expires_at <= v_now;
                CONTINUE;
            END IF;
            outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim_general.fingerprint, v_now);
            IF outcome IS NOT NULL THEN
                -- A duplicate: read, not written. Counted with
                -- idem.claim_weight's weight.
                IF v_sample > 0 AND v_iso <> 'serializable' THEN
                    v_weight := idem.claim_weight(claim_general.source, v_sample, v_now);
                    IF v_weight > 0 THEN
                        PERFORM idem.count_duplicate(claim_general.source, claim_general.key, r.first_seen_month, v_weight, v_per_key, v_now);
                    END IF;
                END IF;
                EXIT;
            END IF;
            -- A lost lease or a retryable failure: take the key over, if the
            -- row is still as read (complete, fail and extend do not take
            -- the key's lock), and not held by the queue (between a job's
            -- attempts, or while a crashed worker's job waits for rescue).
            IF EXISTS (SELECT 1 FROM idem.holds h
                        WHERE h.source = claim_general.source AND h.key = claim_general.key AND h.state = 'queued') THEN
                outcome := 'in_progress';
                EXIT;
            END IF;
            IF v_max IS NOT NULL AND r.attempts >= v_max THEN
                UPDATE idem.processed_events e
                   SET status = 'failed', retryable = false, lease_expires_at = NULL, updated_at = v_now,
                       last_error = format('idem: gave up after %s attempts; last error: %s',
                                           r.attempts, coalesce(r.last_error, 'lease expired'))
                 WHERE e.source = claim_general.source AND e.key = claim_general.key AND e.first_seen_month = r.first_seen_month
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
                v_lookback := idem.raise_lookback(claim_general.source, v_need);
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
                   fingerprint = coalesce(e.fingerprint, claim_general.fingerprint),
                   event_type = coalesce(e.event_type, claim_general.event_type)
             WHERE e.source = claim_general.source AND e.key = claim_general.key AND e.first_seen_month = r.first_seen_month
               AND e.token = r.token AND e.status = r.status
            RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
            IF FOUND THEN
                outcome := 'acquired';
                EXIT;
            END IF;
        END LOOP;
    END IF;

    -- (version 19) An acquisition is counted in its minute of
    -- idem.activity (the dashboard's claims per minute) with the weight of
    -- idem.claim_weight: every one below idem.exact_counting_rate(), 1 in
    -- v_sample (as v_sample) above it.
    IF outcome = 'acquired' AND v_sample > 0 AND v_iso <> 'serializable' THEN
        v_weight := idem.claim_weight(claim_general.source, v_sample, v_now);
        IF v_weight > 0 THEN
            PERFORM idem.count_activity(claim_general.source, v_now, v_weight, 0);
        END IF;
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
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.claim(source text, key text, fingerprint text DEFAULT NULL::text, ttl interval DEFAULT NULL::interval, lease interval DEFAULT NULL::interval, event_type text DEFAULT NULL::text, lock_wait interval DEFAULT NULL::interval, OUT outcome text, OUT token bigint, OUT attempt integer, OUT lease_expires_at timestamp with time zone, OUT result jsonb, OUT error text, OUT first_seen timestamp with time zone, OUT expires_at timestamp with time zone, OUT lease_remaining interval)
 RETURNS record
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
DECLARE
    v_iso      text := current_setting('transaction_isolation');
    v_now      timestamptz;
    s          record;
    r          record;
    v_weight   integer;
BEGIN
    -- The short path: the key's lock free, the source's row in
    -- idem.claim_settings (its policy, its lookback, and whether it has
    -- holds or an adoption in progress, kept by triggers in the same
    -- transaction as every change of them), and then one of the two
    -- common answers: a duplicate from its settled row, or a new key
    -- inserted. Everything else is idem.claim_general's, called before
    -- anything is written: bad input, REPEATABLE READ, Citus, another claim
    -- of the key in an open transaction, a lookback to raise, a lost lease
    -- or retryable failure to take over, a hold, an adoption in progress,
    -- an expired row of the key in the current month, a new key in a
    -- SERIALIZABLE transaction.
    IF v_iso = 'repeatable read'
       OR claim.source IS NULL OR claim.key IS NULL
       OR octet_length(claim.source) NOT BETWEEN 1 AND 64 OR octet_length(claim.key) NOT BETWEEN 1 AND 512
       OR btrim(claim.source, E' \t\r\n') = '' OR btrim(claim.key, E' \t\r\n') = ''
       OR claim.source ~ '[\x01-\x1f\x7f]'
       OR octet_length(claim.fingerprint) > 512 OR octet_length(claim.event_type) > 256
       OR (claim.ttl IS NOT NULL AND NOT (claim.ttl >= interval '1 minute' AND claim.ttl <= interval '10 years'))
       OR (claim.lease IS NOT NULL AND NOT (claim.lease >= interval '1 second' AND claim.lease <= interval '7 days'))
       OR (claim.lock_wait IS NOT NULL AND NOT (claim.lock_wait >= interval '0' AND claim.lock_wait <= interval '1 hour'))
       OR current_setting('idem.citus', true) IS NOT DISTINCT FROM 'on'
       OR NOT pg_try_advisory_xact_lock(1768187245, hashtext(claim.source || chr(31) || claim.key)) THEN
        SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
          FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
        RETURN;
    END IF;
    -- Read after the key's lock, as claim_general reads the tables it is
    -- made from: every raise of the lookback by a write of this key is in it.
    -- A source with no row of its own yet claims with the default's.
    SELECT c.ttl, c.lease, c.duplicate_sampling, c.count_per_key, c.lookback, c.holds, c.adopting
      INTO s FROM idem.claim_settings c WHERE c.source = claim.source;
    IF NOT FOUND THEN
        SELECT c.ttl, c.lease, c.duplicate_sampling, c.count_per_key, c.lookback, false AS holds, false AS adopting
          INTO s FROM idem.claim_settings c WHERE c.source = '*';
        -- The source's own row, for its next claims (one lookup), written
        -- by a claim that can without waiting: one that holds the
        -- source's settings lock (class 1768187248) until it commits, so
        -- the others do not queue behind its uncommitted row.
        IF FOUND AND current_setting('transaction_read_only') = 'off'
           AND pg_try_advisory_xact_lock(1768187248, hashtext(claim.source)) THEN
            PERFORM idem.claim_settings_refresh(claim.source);
        END IF;
    END IF;
    v_now := idem.clock();
    IF NOT FOUND OR s.adopting
       OR coalesce(claim.lease, s.lease) > coalesce(claim.ttl, s.ttl)
       OR NOT (idem.days_at_most(greatest(coalesce(claim.ttl, s.ttl), coalesce(claim.lease, s.lease))) <= s.lookback) THEN
        SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
          FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
        RETURN;
    END IF;
    SELECT e.first_seen_month, e.status, e.attempts, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at
      INTO r FROM idem.processed_events e
     WHERE e.source = claim.source AND e.key = claim.key
       AND e.first_seen_month >= idem.window_start(v_now, s.lookback)
       AND e.first_seen_month <= idem.utc_month(v_now + interval '1 day')
       AND e.expires_at > v_now
     LIMIT 1;
    IF FOUND THEN
        outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim.fingerprint, v_now);
        IF outcome IS NULL THEN
            SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
              FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
            RETURN;
        END IF;
        attempt          := r.attempts;
        lease_expires_at := CASE WHEN outcome IN ('in_progress', 'mismatch') THEN r.lease_expires_at END;
        result           := CASE WHEN outcome = 'completed' THEN r.result END;
        error            := CASE WHEN outcome IN ('failed', 'completed') THEN r.last_error END;
        first_seen       := r.first_seen;
        expires_at       := r.expires_at;
        lease_remaining  := CASE WHEN outcome = 'in_progress' THEN greatest(r.lease_expires_at - v_now, interval '0') END;
        IF s.duplicate_sampling > 0 AND v_iso <> 'serializable' THEN
            v_weight := idem.claim_weight(claim.source, s.duplicate_sampling, v_now);
            IF v_weight > 0 THEN
                PERFORM idem.count_duplicate(claim.source, claim.key, r.first_seen_month, v_weight, s.count_per_key, v_now);
            END IF;
        END IF;
        RETURN;
    END IF;
    IF v_iso = 'serializable'
       OR (s.holds AND EXISTS (SELECT FROM idem.holds h
                                WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued')) THEN
        SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
          FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
        RETURN;
    END IF;
    token := idem.new_token();
    INSERT INTO idem.processed_events AS e
           (source, key, first_seen_month, event_type, status, attempts, token,
            lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
    VALUES (claim.source, claim.key, idem.utc_month(v_now), claim.event_type,
            'processing', 1, token, v_now + coalesce(claim.lease, s.lease), claim.fingerprint, v_now, v_now,
            v_now + greatest(coalesce(claim.ttl, s.ttl), coalesce(claim.lease, s.lease)))
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        -- An expired row of the key in the current month.
        SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
          FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
        RETURN;
    END IF;
    outcome          := 'acquired';
    attempt          := 1;
    lease_remaining  := coalesce(claim.lease, s.lease);
    lease_expires_at := v_now + lease_remaining;
    first_seen       := v_now;
    expires_at       := v_now + greatest(coalesce(claim.ttl, s.ttl), lease_remaining);
    IF s.duplicate_sampling > 0 THEN
        v_weight := idem.claim_weight(claim.source, s.duplicate_sampling, v_now);
        IF v_weight > 0 THEN
            PERFORM idem.count_activity(claim.source, v_now, v_weight, 0);
        END IF;
    END IF;
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.adopt_key(id bigint, key text, now timestamp with time zone, lo date, hi date)
 RETURNS void
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
    -- refused (idem.check_legacy, migration 14), and so is one whose read
    -- would call into an object of a role that is neither a superuser nor
    -- idem's owner (version 24: a column's type or collation changed, an
    -- index, statistics or check added since adopt_start).
    PERFORM idem.check_legacy_reads(a.legacy, a.key_column, a.at_column, a.result_column);
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
        v_at := NULL; -- a key that cannot be of the legacy key's type is not there
    END;
    -- (version 24) Checked again once read: an index or statistics object
    -- committed between the check and the read's planning (whose constant
    -- parts planning evaluates) fails the claim and undoes everything the
    -- read ran with it.
    PERFORM idem.check_legacy_reads(a.legacy, a.key_column, a.at_column, a.result_column);
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
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.adopt_batch(id bigint, batch_size integer, OUT read bigint, OUT copied bigint, OUT skipped bigint, OUT done boolean)
 RETURNS record
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
    -- refused (idem.check_legacy, migration 14), and so is one whose read
    -- would call into an object of a role that is neither a superuser nor
    -- idem's owner (version 24: a column's type or collation changed, an
    -- index, statistics or check added since adopt_start).
    PERFORM idem.check_legacy_reads(a.legacy, a.key_column, a.at_column, a.result_column);
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
    -- (version 24) Checked again once read: an index or statistics object
    -- committed between the check and the reads' planning (whose constant
    -- parts planning evaluates) undoes the batch and everything it ran.
    PERFORM idem.check_legacy_reads(a.legacy, a.key_column, a.at_column, a.result_column);
    skipped := read - copied;
    UPDATE idem.adoptions x
       SET last_key = coalesce(v_last, x.last_key), copied = x.copied + adopt_batch.copied,
           skipped = x.skipped + adopt_batch.skipped, batches = x.batches + 1, updated_at = now(),
           future = x.future + v_future, bad_keys = x.bad_keys + v_bad + v_nulls, no_stamp = x.no_stamp + v_nostamp,
           state = CASE WHEN adopt_batch.done THEN 'done' ELSE 'copying' END,
           finished_at = CASE WHEN adopt_batch.done THEN now() END
     WHERE x.id = adopt_batch.id;
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.claim_batch(source text, keys text[], fingerprints text[] DEFAULT NULL::text[], ttl interval DEFAULT NULL::interval, lease interval DEFAULT NULL::interval, event_types text[] DEFAULT NULL::text[], lock_wait interval DEFAULT NULL::interval)
 RETURNS TABLE(ord integer, outcome text, token bigint, attempt integer, lease_expires_at timestamp with time zone, result jsonb, error text, first_seen timestamp with time zone, expires_at timestamp with time zone, lease_remaining interval)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
DECLARE
    v_iso      text := current_setting('transaction_isolation');
    v_n        integer := cardinality(claim_batch.keys);
    v_now      timestamptz;
    v_cur      date;               -- the current month: where a new key goes
    v_ttl      interval;
    v_lease    interval;
    v_max      integer;
    v_sample   integer;
    v_per_key  boolean;
    v_lookback interval;
    v_need     interval;
    v_lo       date;
    v_hi       date;
    v_until    timestamptz;
    v_adopting boolean;
    v_base     bigint;             -- the batch's token; each acquired key's is derived from it
    v_firsts   integer[];          -- every distinct key's first position
    v_ords     integer[];          -- the positions to lock (no final answer yet), in lock order
    v_hashes   integer[];          -- their lock keys
    v_locked   integer[] := '{}';  -- the positions whose key this call has locked
    v_from     integer;            -- the next position of v_ords to lock
    v_busy     integer;            -- a position of v_ords whose lock is busy
    v_gkeys    text[];             -- SERIALIZABLE: placeholders to delete
    v_sleep    double precision;
    v_gmonths  date[];
    v_slow     integer[];          -- the positions idem.claim answers
    v_i        integer;
    v_acq      integer := 0;
    v_dups     integer := 0;
    c          record;
    kr         record;             -- a key read before the locks
    ar         record;             -- a locked key's answer
    v_nfirst   integer;            -- the distinct keys
    v_open     integer[] := '{}';  -- read before the locks: the positions without a final answer
    v_weight   integer;
    a_ord      integer[] := '{}';  -- the locked keys answered by the set-based statement
    -- The duplicates' positions and months, for per-key counting.
    f_ord      integer[];
    f_month    date[];
BEGIN
    IF v_iso = 'repeatable read' THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'idem.claim_batch: REPEATABLE READ is not supported',
            DETAIL = 'A repeatable-read snapshot cannot see a claim of the same key committed in another monthly partition after the snapshot was taken, so a duplicate could run.',
            HINT = 'Claim in READ COMMITTED (the default) or SERIALIZABLE.';
    END IF;
    -- Every input check as one expression; only bad input takes the path
    -- that names the problem and the item.
    IF claim_batch.source IS NULL OR octet_length(claim_batch.source) NOT BETWEEN 1 AND 64
       OR btrim(claim_batch.source, E' \t\r\n') = '' OR claim_batch.source ~ '[\x01-\x1f\x7f]'
       OR v_n IS NULL OR v_n NOT BETWEEN 1 AND 1000
       OR array_ndims(claim_batch.keys) <> 1 OR array_lower(claim_batch.keys, 1) <> 1
       OR (claim_batch.fingerprints IS NOT NULL AND (array_ndims(claim_batch.fingerprints) <> 1
           OR array_lower(claim_batch.fingerprints, 1) <> 1 OR cardinality(claim_batch.fingerprints) <> v_n))
       OR (claim_batch.event_types IS NOT NULL AND (array_ndims(claim_batch.event_types) <> 1
           OR array_lower(claim_batch.event_types, 1) <> 1 OR cardinality(claim_batch.event_types) <> v_n))
       OR EXISTS (SELECT 1 FROM unnest(claim_batch.keys, claim_batch.fingerprints, claim_batch.event_types) x(k, f, t)
                   WHERE x.k IS NULL OR octet_length(x.k) NOT BETWEEN 1 AND 512 OR btrim(x.k, E' \t\r\n') = ''
                      OR octet_length(x.f) > 512 OR octet_length(x.t) > 256)
       OR (claim_batch.ttl IS NOT NULL AND NOT idem.valid_ttl(claim_batch.ttl))
       OR (claim_batch.lease IS NOT NULL AND NOT idem.valid_lease(claim_batch.lease))
       OR (claim_batch.lock_wait IS NOT NULL AND NOT (claim_batch.lock_wait >= interval '0' AND claim_batch.lock_wait <= interval '1 hour')) THEN
        PERFORM idem.check_batch('idem.claim_batch', claim_batch.source, v_n, claim_batch.keys, claim_batch.fingerprints);
        PERFORM idem.check_batch('idem.claim_batch', claim_batch.source, v_n, claim_batch.keys, claim_batch.event_types);
        FOR v_i IN 1 .. v_n LOOP
            -- idem.claim's own checks, naming the item.
            PERFORM idem.check_key(format('idem.claim_batch (item %s)', v_i), claim_batch.source, claim_batch.keys[v_i]);
            IF octet_length(claim_batch.fingerprints[v_i]) > 512 THEN
                RAISE EXCEPTION USING ERRCODE = '22001',
                    MESSAGE = format('idem.claim_batch (item %s): fingerprint is longer than 512 bytes', v_i),
                    HINT = 'Pass a hash of the request, not the request.';
            END IF;
            IF octet_length(claim_batch.event_types[v_i]) > 256 THEN
                RAISE EXCEPTION USING ERRCODE = '22001',
                    MESSAGE = format('idem.claim_batch (item %s): event_type is longer than 256 bytes', v_i);
            END IF;
        END LOOP;
        -- ttl, lease and lock_wait: idem.claim checks them as it checks its
        -- own (the first item's call raises).
        PERFORM idem.claim(claim_batch.source, claim_batch.keys[1], NULL, claim_batch.ttl, claim_batch.lease,
                           NULL, claim_batch.lock_wait);
        RAISE EXCEPTION USING ERRCODE = 'XX000', MESSAGE = 'idem.claim_batch: an input check disagrees with idem.claim';
    END IF;
    IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL AND idem.distributed() THEN
        RAISE EXCEPTION USING ERRCODE = 'ID006',
            MESSAGE = 'idem.claim_batch is not supported on a distributed (Citus) installation',
            DETAIL = 'The keys of a batch live on several nodes; a per-key lock excludes only the claims of the node it is taken on.',
            HINT = 'Claim each key with idem.claim, which Citus delegates to the key''s node.';
    END IF;
    v_until := clock_timestamp() + coalesce(claim_batch.lock_wait, interval '5 seconds');

    -- The source's policy, and its lookback for the window of the first
    -- read (a lookback raised meanwhile only makes that read miss a row,
    -- and a key it does not answer is read again under its lock below,
    -- with the lookback read again there, as idem.claim reads it).
    SELECT x.ttl, x.lease, x.max_attempts, x.duplicate_sampling, x.count_per_key,
           (SELECT max(l.lookback) FROM idem.lookbacks l WHERE l.source IN (claim_batch.source, '*'))
      INTO v_ttl, v_lease, v_max, v_sample, v_per_key, v_lookback
      FROM (SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
              FROM idem.policies p WHERE p.source = claim_batch.source
            UNION ALL
            SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
              FROM idem.policies p WHERE p.source = '*'
             LIMIT 1) x;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = '42704',
            MESSAGE = format('idem.claim_batch: no policy for source %L and no default policy', claim_batch.source),
            HINT = 'Insert a row for the source, or the default row with source ''*'', into idem.policies.';
    END IF;
    v_ttl := coalesce(claim_batch.ttl, v_ttl);
    v_lease := coalesce(claim_batch.lease, v_lease);
    IF v_lease > v_ttl THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('idem.claim_batch: lease %s is longer than ttl %s', v_lease, v_ttl);
    END IF;
    v_now := idem.clock();
    -- The window of the first read: the oldest month that can hold a live
    -- row of the source to the month of tomorrow. Computed once here: in a
    -- probe's condition it would be computed again for every key.
    v_lo := idem.window_start(v_now, v_lookback);
    v_hi := idem.utc_month(v_now + interval '1 day');

    -- A batch whose first key already has a final answer (completed,
    -- failed for good, a mismatch, a live lease) is most likely a
    -- redelivery: its keys are read first, before any lock, and those with
    -- a final answer answer at once, as idem.claim answers from what is
    -- committed when a key's lock is busy; a duplicate then takes no lock
    -- and writes nothing. Any other batch goes to its locks at once, and
    -- its keys are read there (a new key is then looked up once, by its
    -- insert). Both paths give each key the same answer.
    PERFORM 1
      FROM idem.processed_events x
     WHERE x.source = claim_batch.source AND x.key = claim_batch.keys[1]
       AND x.first_seen_month >= v_lo AND x.first_seen_month <= v_hi
       AND x.expires_at > v_now
       AND idem.settled_outcome(x.status, x.retryable, x.lease_expires_at, x.fingerprint,
                                claim_batch.fingerprints[1], v_now) IS NOT NULL
     LIMIT 1;
    IF NOT FOUND THEN
        -- The distinct keys (each at its first position) in the global
        -- lock order: by the lock's key, then position.
        SELECT array_agg(d.o), array_agg(d.o ORDER BY d.h, d.o), array_agg(d.h ORDER BY d.h, d.o)
          INTO v_firsts, v_ords, v_hashes
          FROM (SELECT min(u.o)::integer AS o, hashtext(claim_batch.source || chr(31) || u.k) AS h
                  FROM unnest(claim_batch.keys) WITH ORDINALITY u(k, o)
                 GROUP BY u.k) d;
        v_nfirst := cardinality(v_firsts);
    ELSE
        -- Each distinct key (at its first position) and its live row in
        -- the window, probed by its own index lookup (a lateral probe:
        -- `key = ANY(...)` under a generic plan filters every row of the
        -- source). A final answer is returned as it is read; the other keys
        -- are kept for their locks.
        v_nfirst := 0;
        FOR kr IN
            SELECT g.o, e.first_seen_month AS month, e.attempts, e.lease_expires_at, e.result, e.last_error,
                   e.first_seen, e.expires_at,
                   idem.settled_outcome(e.status, e.retryable, e.lease_expires_at, e.fingerprint,
                                        claim_batch.fingerprints[g.o], v_now) AS settled
              FROM (SELECT min(u.o)::integer AS o, u.k
                      FROM unnest(claim_batch.keys) WITH ORDINALITY u(k, o)
                     GROUP BY u.k) g
              LEFT JOIN LATERAL (
                  SELECT x.first_seen_month, x.status, x.attempts, x.lease_expires_at, x.fingerprint, x.result,
                         x.last_error, x.retryable, x.first_seen, x.expires_at
                    FROM idem.processed_events x
                   WHERE x.source = claim_batch.source AND x.key = g.k
                     AND x.first_seen_month >= v_lo AND x.first_seen_month <= v_hi
                     AND x.expires_at > v_now
                   LIMIT 1) e ON true
        LOOP
            v_nfirst := v_nfirst + 1;
            IF kr.settled IS NULL THEN
                v_open := v_open || kr.o;
                CONTINUE;
            END IF;
            ord := kr.o; outcome := kr.settled; token := NULL; attempt := kr.attempts;
            lease_expires_at := CASE WHEN kr.settled IN ('in_progress', 'mismatch') THEN kr.lease_expires_at END;
            result := CASE WHEN kr.settled = 'completed' THEN kr.result END;
            error := CASE WHEN kr.settled IN ('failed', 'completed') THEN kr.last_error END;
            first_seen := kr.first_seen; expires_at := kr.expires_at;
            lease_remaining := CASE WHEN kr.settled = 'in_progress' THEN greatest(kr.lease_expires_at - v_now, interval '0') END;
            RETURN NEXT;
            -- Every answer read from a row is a duplicate (counted below).
            v_dups := v_dups + 1;
            IF v_per_key THEN
                f_ord := f_ord || kr.o;
                f_month := f_month || kr.month;
            END IF;
        END LOOP;
        -- The keys without a final answer in the global lock order (by
        -- the lock's key, then position).
        IF cardinality(v_open) > 0 THEN
            SELECT array_agg(u.o ORDER BY u.h, u.o), array_agg(u.h ORDER BY u.h, u.o) INTO v_ords, v_hashes
              FROM (SELECT l.o, hashtext(claim_batch.source || chr(31) || claim_batch.keys[l.o]) AS h
                      FROM unnest(v_open) l(o)) u;
        END IF;
        IF v_nfirst < v_n THEN
            SELECT array_agg(g.o) INTO v_firsts
              FROM (SELECT min(u.o)::integer AS o FROM unnest(claim_batch.keys) WITH ORDINALITY u(k, o) GROUP BY u.k) g;
        END IF;
    END IF;

    -- Each remaining key's lock in that order, as idem.claim takes it: one
    -- statement tries them in order and stops at the first that another
    -- open transaction holds (LIMIT 1: the later ones are not tried). That
    -- key is answered by idem.claim at once (from what is committed when
    -- that is final, or after waiting for the lock until the batch's
    -- deadline), and the statement goes on after it: a batch never holds a
    -- later key while it waits for an earlier one.
    v_from := 1;
    WHILE v_from <= coalesce(cardinality(v_ords), 0) LOOP
        SELECT v_from + u.i::integer - 1 INTO v_busy
          FROM unnest(v_hashes[v_from:]) WITH ORDINALITY u(h, i)
         WHERE NOT pg_try_advisory_xact_lock(1768187245, u.h)
         LIMIT 1;
        IF v_busy IS NULL THEN
            v_locked := v_locked || v_ords[v_from:];
            EXIT;
        END IF;
        v_locked := v_locked || v_ords[v_from:v_busy - 1];
        -- SERIALIZABLE: the transaction's snapshot predates whatever the
        -- holder commits, which idem.claim would not see after its wait
        -- (a row in another month's partition): wait for the lock here
        -- (polling, as idem.claim does, until the batch's deadline), and
        -- the key joins the others, read under the guard below.
        IF v_iso = 'serializable' THEN
            v_sleep := 0.001;
            LOOP
                IF pg_try_advisory_xact_lock(1768187245, v_hashes[v_busy]) THEN
                    v_locked := v_locked || v_ords[v_busy];
                    EXIT;
                END IF;
                EXIT WHEN clock_timestamp() >= v_until;
                PERFORM pg_sleep(least(v_sleep, greatest(extract(epoch FROM v_until - clock_timestamp()), 0)));
                v_sleep := least(v_sleep * 2, 0.05);
            END LOOP;
            IF v_locked[cardinality(v_locked)] IS NOT DISTINCT FROM v_ords[v_busy] THEN
                v_from := v_busy + 1;
                CONTINUE;
            END IF;
        END IF;
        SELECT * INTO c FROM idem.claim(claim_batch.source, claim_batch.keys[v_ords[v_busy]], claim_batch.fingerprints[v_ords[v_busy]],
                                        claim_batch.ttl, claim_batch.lease, claim_batch.event_types[v_ords[v_busy]],
                                        greatest(v_until - clock_timestamp(), interval '0'));
        ord := v_ords[v_busy]; outcome := c.outcome; token := c.token; attempt := c.attempt;
        lease_expires_at := c.lease_expires_at; result := c.result; error := c.error;
        first_seen := c.first_seen; expires_at := c.expires_at; lease_remaining := c.lease_remaining;
        RETURN NEXT;
        v_from := v_busy + 1;
    END LOOP;

    IF cardinality(v_locked) > 0 THEN
        -- The source's lookback, read again under the keys' locks, as
        -- idem.claim reads it (a claim that held one of them may have
        -- raised it).
        SELECT max(l.lookback) INTO v_lookback FROM idem.lookbacks l WHERE l.source IN (claim_batch.source, '*');
        v_now := idem.clock();
        v_need := idem.days_at_most(greatest(v_ttl, v_lease));
        IF v_need > v_lookback THEN
            v_lookback := idem.raise_lookback(claim_batch.source, v_need);
        END IF;
        -- idem.claim's window: the oldest month that can hold a live row of
        -- the source to the month of tomorrow.
        v_lo := idem.window_start(v_now, v_lookback);
        v_hi := idem.utc_month(v_now + interval '1 day');
        v_cur := idem.utc_month(v_now);
        v_adopting := EXISTS (SELECT 1 FROM idem.adoptions a WHERE a.source = claim_batch.source AND a.state = 'copying');
        v_base := idem.new_token();

        -- SERIALIZABLE: the transaction's snapshot may predate a claim of
        -- one of these keys that committed into another month's partition
        -- before this call took the key's lock, and the probe below would
        -- not see its row. An insert meets every committed row of its
        -- partition's unique index, visible or not, and fails with a
        -- serialization failure on one it cannot see: so a placeholder of
        -- each key goes into every other month of the window, and those
        -- inserted (no row of the key there) are deleted again. A visible
        -- row there is found by the probe as usual.
        IF v_iso = 'serializable' THEN
            WITH g AS (
                INSERT INTO idem.processed_events AS e
                       (source, key, first_seen_month, status, attempts, token, first_seen, updated_at, expires_at)
                SELECT claim_batch.source, claim_batch.keys[l.o], m.m, 'processing', 1, 0, v_now, v_now, v_now
                  FROM unnest(v_locked) l(o),
                       (SELECT d::date AS m FROM generate_series(v_lo, v_hi, interval '1 month') d) m
                 WHERE m.m <> v_cur
                ON CONFLICT DO NOTHING
                RETURNING e.key, e.first_seen_month)
            SELECT array_agg(g.key), array_agg(g.first_seen_month) INTO v_gkeys, v_gmonths FROM g;
            IF v_gkeys IS NOT NULL THEN
                DELETE FROM idem.processed_events e
                 USING unnest(v_gkeys, v_gmonths) g(k, m)
                 WHERE e.source = claim_batch.source AND e.key = g.k AND e.first_seen_month = g.m AND e.token = 0;
            END IF;
        END IF;

        -- One statement for the locked keys' common answers, read again
        -- under their locks with a new snapshot:
        -- * p: each key's live row in the window's other months (before
        --   and after the current one, each an index lookup); a settled
        --   one answers as idem.claim answers it; for a key with none, its
        --   queue hold (a probe with LIMIT: an EXISTS may be planned as a
        --   hash of every hold of the source);
        -- * ins: a key with no row there and no hold is inserted into the
        --   current month (ON CONFLICT DO NOTHING: the unique index reads
        --   the current month for it, so it is not probed first): acquired;
        -- * cur: a key the insert met a row of, or a held key, is answered
        --   from its live row in the current month when that is settled;
        --   a held key without one is in_progress.
        -- What is left (a lost lease or a retryable failure to take over,
        -- an expired row in the current month, a key while its source's
        -- legacy table is adopted) is idem.claim's, below. Each answer is
        -- returned as the statement yields it.
        FOR ar IN
        WITH p AS MATERIALIZED (
            SELECT l.o, claim_batch.keys[l.o] AS k, e.*,
                   CASE WHEN e.status IS NULL AND NOT v_adopting THEN h.held IS NOT NULL END AS held,
                   idem.settled_outcome(e.status, e.retryable, e.lease_expires_at, e.fingerprint,
                                        claim_batch.fingerprints[l.o], v_now) AS settled
              FROM unnest(v_locked) l(o)
              LEFT JOIN LATERAL (
                  (SELECT x.first_seen_month, x.status, x.attempts, x.lease_expires_at, x.fingerprint, x.result,
                          x.last_error, x.retryable, x.first_seen, x.expires_at
                     FROM idem.processed_events x
                    WHERE x.source = claim_batch.source AND x.key = claim_batch.keys[l.o]
                      AND x.first_seen_month >= v_lo AND x.first_seen_month < v_cur
                      AND x.expires_at > v_now
                    LIMIT 1)
                  UNION ALL
                  (SELECT x.first_seen_month, x.status, x.attempts, x.lease_expires_at, x.fingerprint, x.result,
                          x.last_error, x.retryable, x.first_seen, x.expires_at
                     FROM idem.processed_events x
                    WHERE x.source = claim_batch.source AND x.key = claim_batch.keys[l.o]
                      AND x.first_seen_month >= (v_cur + interval '1 month')::date AND x.first_seen_month <= v_hi
                      AND x.expires_at > v_now
                    LIMIT 1)
                  LIMIT 1) e ON true
              LEFT JOIN LATERAL (
                  SELECT true AS held FROM idem.holds y
                   WHERE y.source = claim_batch.source AND y.key = claim_batch.keys[l.o] AND y.state = 'queued'
                   LIMIT 1) h ON e.status IS NULL AND NOT v_adopting),
        ins AS (
            INSERT INTO idem.processed_events AS e
                   (source, key, first_seen_month, event_type, status, attempts, token,
                    lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
            SELECT claim_batch.source, p.k, v_cur, claim_batch.event_types[p.o],
                   'processing', 1, greatest(v_base # (p.o::bigint * 2654435761), 1), v_now + v_lease,
                   claim_batch.fingerprints[p.o], v_now, v_now, v_now + greatest(v_ttl, v_lease)
              FROM p WHERE p.held = false
            ON CONFLICT DO NOTHING
            RETURNING e.key, e.token, e.attempts, e.lease_expires_at, e.first_seen, e.expires_at),
        cur AS MATERIALIZED (
            SELECT p.o, p.held, r.*,
                   idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint,
                                        claim_batch.fingerprints[p.o], v_now) AS settled
              FROM p
              LEFT JOIN LATERAL (
                  SELECT x.first_seen_month, x.status, x.attempts, x.lease_expires_at, x.fingerprint, x.result,
                         x.last_error, x.retryable, x.first_seen, x.expires_at
                    FROM idem.processed_events x
                   WHERE x.source = claim_batch.source AND x.key = p.k
                     AND x.first_seen_month = v_cur AND x.expires_at > v_now
                   LIMIT 1) r ON true
             WHERE p.held IS NOT NULL AND NOT EXISTS (SELECT 1 FROM ins i WHERE i.key = p.k)),
        a AS (
            SELECT p.o, p.settled AS outcome, NULL::bigint AS token, p.attempts,
                   CASE WHEN p.settled IN ('in_progress', 'mismatch') THEN p.lease_expires_at END AS lease_at,
                   CASE WHEN p.settled = 'completed' THEN p.result END AS result,
                   CASE WHEN p.settled IN ('failed', 'completed') THEN p.last_error END AS error,
                   p.first_seen, p.expires_at,
                   CASE WHEN p.settled = 'in_progress' THEN greatest(p.lease_expires_at - v_now, interval '0') END AS left_,
                   p.first_seen_month AS month
              FROM p WHERE p.settled IS NOT NULL
            UNION ALL
            SELECT r.o, r.settled, NULL, r.attempts,
                   CASE WHEN r.settled IN ('in_progress', 'mismatch') THEN r.lease_expires_at END,
                   CASE WHEN r.settled = 'completed' THEN r.result END,
                   CASE WHEN r.settled IN ('failed', 'completed') THEN r.last_error END,
                   r.first_seen, r.expires_at,
                   CASE WHEN r.settled = 'in_progress' THEN greatest(r.lease_expires_at - v_now, interval '0') END,
                   r.first_seen_month
              FROM cur r WHERE r.settled IS NOT NULL
            UNION ALL
            SELECT r.o, 'in_progress', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
              FROM cur r WHERE r.held AND r.status IS NULL
            UNION ALL
            SELECT p.o, 'acquired', i.token, i.attempts, i.lease_expires_at, NULL, NULL, i.first_seen, i.expires_at,
                   v_lease, NULL
              FROM ins i JOIN p ON p.k = i.key)
        SELECT a.o, a.outcome, a.token, a.attempts, a.lease_at, a.result, a.error, a.first_seen, a.expires_at,
               a.left_, a.month
          FROM a
        LOOP
            ord := ar.o; outcome := ar.outcome; token := ar.token; attempt := ar.attempts;
            lease_expires_at := ar.lease_at; result := ar.result; error := ar.error;
            first_seen := ar.first_seen; expires_at := ar.expires_at; lease_remaining := ar.left_;
            RETURN NEXT;
            a_ord := a_ord || ar.o;
            IF ar.outcome = 'acquired' THEN
                v_acq := v_acq + 1;
            ELSIF ar.month IS NOT NULL THEN
                -- An answer read from a row: a duplicate (counted below).
                v_dups := v_dups + 1;
                IF v_per_key THEN
                    f_ord := f_ord || ar.o;
                    f_month := f_month || ar.month;
                END IF;
            END IF;
        END LOOP;
    END IF;

    -- Counting, as idem.claim counts (not in SERIALIZABLE; v_sample 0
    -- turns it off): the acquisitions in idem.activity, every one; the
    -- duplicates (every answer read from a row, before the locks or after)
    -- as idem.count_duplicate counts them, the batch weighed as one claim
    -- (idem.claim_weight): all of them while the source's claims this
    -- minute are below idem.exact_counting_rate(); above it 1 batch in
    -- v_sample counts all of its duplicates, each as v_sample, and the
    -- others count none. A redelivered batch then mostly
    -- writes nothing, as a duplicate claim mostly writes nothing. Per key,
    -- each duplicate is sampled as idem.claim samples it.
    IF v_sample > 0 AND v_iso <> 'serializable' THEN
        IF v_acq > 0 THEN
            PERFORM idem.count_activity(claim_batch.source, v_now, v_acq, 0);
        END IF;
        IF v_dups > 0 AND NOT v_per_key THEN
            v_weight := idem.claim_weight(claim_batch.source, v_sample, v_now);
            IF v_weight > 0 THEN
                PERFORM idem.count_duplicate(claim_batch.source, NULL, NULL, v_dups * v_weight, false, v_now);
            END IF;
        ELSIF v_dups > 0 THEN
            PERFORM idem.count_duplicate(claim_batch.source, claim_batch.keys[x.o], x.month, v_sample, true, v_now)
               FROM unnest(f_ord, f_month) x(o, month)
              WHERE v_sample = 1 OR random() * v_sample < 1;
        END IF;
    END IF;

    -- The rest, by idem.claim (each key's lock is this transaction's
    -- already).
    IF coalesce(cardinality(a_ord), 0) < cardinality(v_locked) THEN
        SELECT array_agg(l.o ORDER BY l.o) INTO v_slow
          FROM unnest(v_locked) l(o) WHERE l.o <> ALL (coalesce(a_ord, '{}'));
        FOREACH v_i IN ARRAY v_slow LOOP
            SELECT * INTO c FROM idem.claim(claim_batch.source, claim_batch.keys[v_i], claim_batch.fingerprints[v_i],
                                            claim_batch.ttl, claim_batch.lease, claim_batch.event_types[v_i],
                                            greatest(v_until - clock_timestamp(), interval '0'));
            ord := v_i; outcome := c.outcome; token := c.token; attempt := c.attempt;
            lease_expires_at := c.lease_expires_at; result := c.result; error := c.error;
            first_seen := c.first_seen; expires_at := c.expires_at; lease_remaining := c.lease_remaining;
            RETURN NEXT;
        END LOOP;
    END IF;

    -- A key repeated in the batch: a duplicate of its first position,
    -- answered by idem.claim after it.
    IF v_nfirst < v_n THEN
        FOR v_i IN SELECT u.o FROM generate_subscripts(claim_batch.keys, 1) u(o)
                    WHERE u.o <> ALL (v_firsts) ORDER BY u.o LOOP
            SELECT * INTO c FROM idem.claim(claim_batch.source, claim_batch.keys[v_i], claim_batch.fingerprints[v_i],
                                            claim_batch.ttl, claim_batch.lease, claim_batch.event_types[v_i],
                                            greatest(v_until - clock_timestamp(), interval '0'));
            ord := v_i; outcome := c.outcome; token := c.token; attempt := c.attempt;
            lease_expires_at := c.lease_expires_at; result := c.result; error := c.error;
            first_seen := c.first_seen; expires_at := c.expires_at; lease_remaining := c.lease_remaining;
            RETURN NEXT;
        END LOOP;
    END IF;
END
$function$;
-- +goose StatementEnd

DROP FUNCTION idem.serializable_placeholders(text, text, timestamp with time zone, date, date);
DROP FUNCTION idem.serializable_floor(timestamp with time zone, date);
