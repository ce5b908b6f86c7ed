-- idem 27: a claim that pays only for what its source uses.
--
-- A claim of a new key cost about twice the hand-written insert, and a
-- duplicate about four times the raw conflict path, while a minimal claim
-- over the same table (the key's lock, the probe of the window, the
-- insert) costs 1.35x. The difference was not one expensive step but the
-- statements every claim ran for features its source might not use: the
-- policy and lookback read (a union, an aggregate and a bitmap scan over
-- two tables), the look for an adoption in progress and for an inbox hold
-- (two more tables), each statement's executor set-up and locks. (Profile:
-- docs/performance.md.)
--
-- * idem.claim_settings: per source, the policy in force, the lookback,
--   and whether the source has had an inbox hold or has an adoption in
--   progress, in one row; a source's first claim that can take its
--   settings lock without waiting writes its row (until then it claims
--   with the row of '*'). Triggers on idem.policies, idem.lookbacks,
--   idem.holds and idem.adoptions recompute it in the same transaction as
--   each change, so the next claim after that commit reads it (after the
--   key's lock, with its own snapshot, as claims read those tables).
-- * idem.claim: one lookup of that row, the probe of the window and, for a
--   new key, the insert; it looks for a hold only for a source that has
--   had one. Every other case (bad input, REPEATABLE READ, Citus, a key
--   another claim holds the lock of, a lookback to raise, a lease or
--   retryable failure to take over, an adoption in progress, a hold, an
--   expired row in the current month, a new key in a SERIALIZABLE
--   transaction) goes to idem.claim_general before anything is written.
-- * idem.claim_general: the claim of version 26, unchanged but for the
--   SERIALIZABLE placeholders (one statement for every other month of the
--   window, and one delete, instead of two statements a month).
--   It takes plan_cache_mode from idem.claim (generic here, custom on
--   Citus, as idem.citus_setup sets it).
--
-- * idem.peek answers for a live row only (an expired key, which a claim
--   takes as new, reads as no row), as Client.Peek has always said.
--
-- On Citus (idem.distributed()) the triggers are not created and the table
-- stays empty: idem.claim always takes idem.claim_general there.
-- Down restores version 26's idem.claim and drops the rest.

-- +goose Up
CREATE TABLE idem.claim_settings (
    source             text PRIMARY KEY,
    ttl                interval NOT NULL,
    lease              interval NOT NULL,
    max_attempts       integer,
    duplicate_sampling integer NOT NULL,
    count_per_key      boolean NOT NULL,
    lookback           interval NOT NULL,
    holds              boolean NOT NULL DEFAULT false,
    adopting           boolean NOT NULL DEFAULT false
);
COMMENT ON TABLE idem.claim_settings IS 'Per source, what idem.claim''s short path reads in one lookup: the policy in force (its own or ''*''), the lookback (the larger of its own and ''*''), whether the source has ever had an inbox hold and whether an adoption of it is in progress. Derived from idem.policies, idem.lookbacks, idem.holds and idem.adoptions by triggers, in the same transaction as each change; managed by idem.';
REVOKE ALL ON idem.claim_settings FROM PUBLIC;

-- +goose StatementBegin
CREATE FUNCTION idem.claim_settings_refresh(p_source text)
 RETURNS void
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    -- One source, or (NULL or '*', whose policy and lookback every source
    -- without its own inherits) every source that has a row, a policy, a
    -- lookback or an adoption. A source left with no policy at all loses
    -- its row: idem.claim_general names the missing policy.
    INSERT INTO idem.claim_settings AS c
           (source, ttl, lease, max_attempts, duplicate_sampling, count_per_key, lookback, holds, adopting)
    SELECT x.source, p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key,
           (SELECT pg_catalog.max(l.lookback) FROM idem.lookbacks l WHERE l.source OPERATOR(pg_catalog.=) ANY (ARRAY[x.source, '*'])),
           EXISTS (SELECT FROM idem.holds h WHERE h.source OPERATOR(pg_catalog.=) x.source),
           EXISTS (SELECT FROM idem.adoptions a WHERE a.source OPERATOR(pg_catalog.=) x.source AND a.state OPERATOR(pg_catalog.=) 'copying')
      FROM (SELECT p_source AS source WHERE p_source IS NOT NULL AND p_source OPERATOR(pg_catalog.<>) '*'
            UNION
            SELECT s.source FROM (SELECT c.source FROM idem.claim_settings c
                                  UNION SELECT p.source FROM idem.policies p
                                  UNION SELECT l.source FROM idem.lookbacks l
                                  UNION SELECT a.source FROM idem.adoptions a) s
             WHERE p_source IS NULL OR p_source OPERATOR(pg_catalog.=) '*') x
     CROSS JOIN LATERAL (
            SELECT q.ttl, q.lease, q.max_attempts, q.duplicate_sampling, q.count_per_key
              FROM (SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key, 0 AS o
                      FROM idem.policies p WHERE p.source OPERATOR(pg_catalog.=) x.source
                    UNION ALL
                    SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key, 1
                      FROM idem.policies p WHERE p.source OPERATOR(pg_catalog.=) '*') q
             ORDER BY q.o LIMIT 1) p
     WHERE (SELECT pg_catalog.max(l.lookback) FROM idem.lookbacks l WHERE l.source OPERATOR(pg_catalog.=) ANY (ARRAY[x.source, '*'])) IS NOT NULL
    ON CONFLICT (source) DO UPDATE
       SET ttl = EXCLUDED.ttl, lease = EXCLUDED.lease, max_attempts = EXCLUDED.max_attempts,
           duplicate_sampling = EXCLUDED.duplicate_sampling, count_per_key = EXCLUDED.count_per_key,
           lookback = EXCLUDED.lookback, holds = c.holds OR EXCLUDED.holds, adopting = EXCLUDED.adopting;
    DELETE FROM idem.claim_settings c
     WHERE (p_source IS NULL OR p_source OPERATOR(pg_catalog.=) '*' OR c.source OPERATOR(pg_catalog.=) p_source)
       AND NOT EXISTS (SELECT FROM idem.policies p WHERE p.source OPERATOR(pg_catalog.=) ANY (ARRAY[c.source, '*']));
END
$function$;
-- +goose StatementEnd
COMMENT ON FUNCTION idem.claim_settings_refresh(text) IS 'Recomputes idem.claim_settings for one source (NULL or ''*'': every source) from idem.policies, idem.lookbacks, idem.holds and idem.adoptions. Called by their triggers.';
REVOKE ALL ON FUNCTION idem.claim_settings_refresh(text) FROM PUBLIC;

-- +goose StatementBegin
CREATE FUNCTION idem.claim_settings_changed()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF TG_OP OPERATOR(pg_catalog.=) 'DELETE' THEN
        PERFORM idem.claim_settings_refresh(OLD.source);
    ELSIF TG_OP OPERATOR(pg_catalog.=) 'UPDATE' AND OLD.source IS DISTINCT FROM NEW.source THEN
        PERFORM idem.claim_settings_refresh(OLD.source);
        PERFORM idem.claim_settings_refresh(NEW.source);
    ELSE
        PERFORM idem.claim_settings_refresh(NEW.source);
    END IF;
    RETURN NULL;
END
$function$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.claim_settings_changed() FROM PUBLIC;

-- +goose StatementBegin
CREATE FUNCTION idem.claim_settings_held()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    -- A source's first hold turns its claims' look for holds on (for good:
    -- an inbox that held keys once holds them again).
    UPDATE idem.claim_settings c SET holds = true
     WHERE c.source OPERATOR(pg_catalog.=) NEW.source AND NOT c.holds;
    -- No row that says so yet (none, or one another transaction is
    -- inserting): the refresh's upsert waits for that one and sees this
    -- hold.
    IF NOT FOUND AND NOT EXISTS (SELECT FROM idem.claim_settings c
                                  WHERE c.source OPERATOR(pg_catalog.=) NEW.source AND c.holds) THEN
        PERFORM idem.claim_settings_refresh(NEW.source);
    END IF;
    RETURN NULL;
END
$function$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.claim_settings_held() FROM PUBLIC;


-- +goose StatementBegin
DO $do$
BEGIN
    IF NOT idem.distributed() THEN
        PERFORM idem.claim_settings_refresh(NULL);
        CREATE TRIGGER claim_settings_policies AFTER INSERT OR UPDATE OR DELETE ON idem.policies
            FOR EACH ROW EXECUTE FUNCTION idem.claim_settings_changed();
        CREATE TRIGGER claim_settings_lookbacks AFTER INSERT OR UPDATE OR DELETE ON idem.lookbacks
            FOR EACH ROW EXECUTE FUNCTION idem.claim_settings_changed();
        CREATE TRIGGER claim_settings_adoptions AFTER INSERT OR UPDATE OR DELETE ON idem.adoptions
            FOR EACH ROW EXECUTE FUNCTION idem.claim_settings_changed();
        CREATE TRIGGER claim_settings_holds AFTER INSERT ON idem.holds
            FOR EACH ROW EXECUTE FUNCTION idem.claim_settings_held();
    END IF;
END
$do$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION idem.claim_general(source text, key text, fingerprint text DEFAULT NULL::text, ttl interval DEFAULT NULL::interval, lease interval DEFAULT NULL::interval, event_type text DEFAULT NULL::text, lock_wait interval DEFAULT NULL::interval, OUT outcome text, OUT token bigint, OUT attempt integer, OUT lease_expires_at timestamp with time zone, OUT result jsonb, OUT error text, OUT first_seen timestamp with time zone, OUT expires_at timestamp with time zone, OUT lease_remaining interval)
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
        IF NOT idem.key_is_local(claim_general.key) THEN
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

COMMENT ON FUNCTION idem.claim_general(text, text, text, interval, interval, text, interval) IS 'idem.claim in every case its short path does not take (bad input, a held lock, a lookback to raise, a take-over, a hold, an adoption, SERIALIZABLE new keys, Citus). Called by idem.claim only.';
REVOKE ALL ON FUNCTION idem.claim_general(text, text, text, interval, interval, text, interval) FROM PUBLIC;

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

-- idem.peek answers for a live row only, as Client.Peek says: an expired
-- key is one a claim takes as new.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.peek(source text, key text, OUT status text, OUT lease_remaining_ms bigint)
 RETURNS record
 LANGUAGE sql
 STABLE SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
SELECT e.status,
       CASE WHEN e.status = 'processing'
            THEN (extract(epoch FROM e.lease_expires_at - idem.clock()) * 1000)::bigint END
  FROM idem.processed_events e
 WHERE e.source = peek.source AND e.key = peek.key
   AND e.expires_at > idem.clock()
 ORDER BY e.first_seen_month DESC
 LIMIT 1
$function$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.peek(source text, key text, OUT status text, OUT lease_remaining_ms bigint)
 RETURNS record
 LANGUAGE sql
 STABLE SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
SELECT e.status,
       CASE WHEN e.status = 'processing'
            THEN (extract(epoch FROM e.lease_expires_at - idem.clock()) * 1000)::bigint END
  FROM idem.processed_events e
 WHERE e.source = peek.source AND e.key = peek.key
 ORDER BY e.first_seen_month DESC
 LIMIT 1
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
    v_m        date;
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
                IF v_sample > 0 AND v_iso <> 'serializable' THEN
                    v_weight := idem.claim_weight(claim.source, v_sample, v_now);
                    IF v_weight > 0 THEN
                        PERFORM idem.count_duplicate(claim.source, claim.key, r.first_seen_month, v_weight, v_per_key, v_now);
                    END IF;
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
                -- (version 21) SERIALIZABLE: a claim of this key committed
                -- into another month after this transaction's snapshot is
                -- not seen by the probe above. A placeholder insert into
                -- each other month of the window meets it (40001 on a
                -- committed row the snapshot cannot see); one that went in
                -- is deleted again.
                IF v_iso = 'serializable' AND current_setting('idem.citus', true) IS DISTINCT FROM 'on' THEN
                    FOR v_m IN SELECT g::date FROM generate_series(v_lo::timestamp, v_hi::timestamp, interval '1 month') g LOOP
                        CONTINUE WHEN v_m = idem.utc_month(v_now);
                        INSERT INTO idem.processed_events AS e
                               (source, key, first_seen_month, status, attempts, token, first_seen, updated_at, expires_at)
                        VALUES (claim.source, claim.key, v_m, 'processing', 1, 0, v_now, v_now, v_now)
                        ON CONFLICT DO NOTHING;
                        IF FOUND THEN
                            DELETE FROM idem.processed_events e
                             WHERE e.source = claim.source AND e.key = claim.key AND e.first_seen_month = v_m AND e.token = 0;
                        END IF;
                    END LOOP;
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
                -- A duplicate: read, not written. Counted with
                -- idem.claim_weight's weight.
                IF v_sample > 0 AND v_iso <> 'serializable' THEN
                    v_weight := idem.claim_weight(claim.source, v_sample, v_now);
                    IF v_weight > 0 THEN
                        PERFORM idem.count_duplicate(claim.source, claim.key, r.first_seen_month, v_weight, v_per_key, v_now);
                    END IF;
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

    -- (version 19) An acquisition is counted in its minute of
    -- idem.activity (the dashboard's claims per minute) with the weight of
    -- idem.claim_weight: every one below idem.exact_counting_rate(), 1 in
    -- v_sample (as v_sample) above it.
    IF outcome = 'acquired' AND v_sample > 0 AND v_iso <> 'serializable' THEN
        v_weight := idem.claim_weight(claim.source, v_sample, v_now);
        IF v_weight > 0 THEN
            PERFORM idem.count_activity(claim.source, v_now, v_weight, 0);
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
-- (Citus refuses a DROP TRIGGER on its tables even when there is none.)
-- +goose StatementBegin
DO $do$
DECLARE
    t text;
BEGIN
    FOR t IN SELECT unnest(ARRAY['policies', 'lookbacks', 'adoptions', 'holds']) LOOP
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_trigger g
                    WHERE g.tgrelid = ('idem.' || t)::regclass AND g.tgname = 'claim_settings_' || t) THEN
            EXECUTE pg_catalog.format('DROP TRIGGER %I ON idem.%I', 'claim_settings_' || t, t);
        END IF;
    END LOOP;
END
$do$;
-- +goose StatementEnd
DROP FUNCTION idem.claim_general(text, text, text, interval, interval, text, interval);
DROP FUNCTION idem.claim_settings_held();
DROP FUNCTION idem.claim_settings_changed();
DROP FUNCTION idem.claim_settings_refresh(text);
DROP TABLE idem.claim_settings;
