-- idem 4: the protocol under faults (time zones, bounded waits, records
-- that survive the caller). See docs/design.md.
--
-- * Months are computed in UTC whatever the server's or the session's
--   TimeZone: idem.utc_month(ts). (date_trunc('month', ts, 'UTC')::date
--   casts the UTC midnight back to a date in the session's zone, so on a
--   server west of UTC every claim landed in the previous month.)
-- * idem.claim waits at most lock_wait (default 5 seconds) for another
--   claim of the same key whose transaction is still open, then answers
--   in_progress; it reports lease_remaining, by the database's clock, so a
--   client schedules its heartbeat without comparing two clocks.
-- * idem.complete_unstored marks work done when its result cannot be
--   stored, so a retry is told "completed" instead of running the work
--   again; the reason stays in last_error and claim reports it.
-- * idem.fail answers 'failed' again for a retried call with the same token.
-- * Fencing tokens are random 63-bit numbers (idem.new_token), not a
--   sequence: a role allowed to call idem.complete cannot guess another
--   worker's token from its own. Fencing is unchanged.
-- * Rotation's default premake (3 months) is made at once, so a fresh
--   install passes `idemctl check`.
--
-- Down restores every function as version 3 had it (time-zone bugs
-- included) and drops what version 4 added; grants on claim are kept.

-- +goose Up
-- +goose StatementBegin
-- The first day of ts's month in UTC, whatever the session's TimeZone.
CREATE OR REPLACE FUNCTION idem.utc_month(ts timestamptz) RETURNS date
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT pg_catalog.date_trunc('month', ts AT TIME ZONE 'UTC')::date $$;
-- +goose StatementEnd

-- +goose StatementBegin
-- A fencing token: 63 random bits from the server's strong random source
-- (gen_random_uuid, core since PostgreSQL 13), never 0. Unguessable from
-- another token; two equal tokens for one key are a 2^-63 chance.
CREATE OR REPLACE FUNCTION idem.new_token() RETURNS bigint
    LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$ SELECT greatest(('x' || pg_catalog.substr(pg_catalog.md5(pg_catalog.gen_random_uuid()::text), 1, 16))::bit(64)::bigint
                                 & 9223372036854775807, 1) $$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.new_token() FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
-- Maintainers that could read the clock can compute its month too.
REVOKE ALL ON FUNCTION idem.utc_month(timestamptz) FROM PUBLIC;
DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT a.grantee::regrole::text AS role
               FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
              WHERE p.oid = 'idem.clock()'::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION idem.utc_month(timestamptz) TO %s', r.role);
    END LOOP;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- As in version 1, with the month computed from a timestamp without time
-- zone, so no session TimeZone takes part.
CREATE OR REPLACE FUNCTION idem.create_partition(p_month date) RETURNS text
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_lo   date := date_trunc('month', p_month::timestamp)::date;
    v_hi   date := (date_trunc('month', p_month::timestamp) + interval '1 month')::date;
    v_name text := idem.partition_name(v_lo);
BEGIN
    IF p_month IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.create_partition: month must not be NULL';
    END IF;
    IF to_regclass(format('idem.%I', v_name)) IS NOT NULL THEN
        RETURN v_name;
    END IF;
    EXECUTE format('CREATE TABLE idem.%I (LIKE idem.processed_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES) WITH (fillfactor = 85)', v_name);
    LOCK TABLE idem.processed_events_default IN ACCESS EXCLUSIVE MODE;
    EXECUTE format('WITH moved AS (DELETE FROM idem.processed_events_default d
                                    WHERE d.first_seen_month >= $1 AND d.first_seen_month < $2
                                    RETURNING d.*)
                    INSERT INTO idem.%I SELECT * FROM moved', v_name)
        USING v_lo, v_hi;
    EXECUTE format('ALTER TABLE idem.processed_events ATTACH PARTITION idem.%I FOR VALUES FROM (%L) TO (%L)',
                   v_name, v_lo, v_hi);
    RETURN v_name;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.months_to_create(premake integer)
RETURNS SETOF date
    LANGUAGE sql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
    SELECT m::date FROM (
        SELECT DISTINCT d.first_seen_month AS m FROM idem.processed_events_default d
        UNION
        SELECT (idem.utc_month(idem.clock())::timestamp + make_interval(months => g))::date
          FROM generate_series(0, greatest(premake, 0)) g
    ) s
    WHERE to_regclass('idem.' || quote_ident(idem.partition_name(m::date))) IS NULL
    ORDER BY 1
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
-- As in version 1, and a retried call with the same token (the first
-- answer was lost with its connection) answers 'failed' again.
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
-- idem.complete_unstored: the work owned by token ran, but its result
-- cannot be stored (too large, not JSON, a NUL character). The key is
-- completed without a result and reason is kept in last_error (prefixed
-- 'result not stored: '), so later claims answer 'completed' (result NULL,
-- error the reason) instead of running the work again. Returns what
-- idem.complete returns.
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
REVOKE ALL ON FUNCTION idem.complete_unstored(text, text, bigint, text) FROM PUBLIC;
DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT a.grantee::regrole::text AS role
               FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
              WHERE p.oid = 'idem.complete(text, text, bigint, jsonb)'::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION idem.complete_unstored(text, text, bigint, text) TO %s', r.role);
    END LOOP;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Roles granted EXECUTE on the function being replaced get it on the new
-- one: remembered for this transaction in a setting (goose runs each
-- migration in one transaction).
SELECT pg_catalog.set_config('idem.claim_grantees', coalesce(pg_catalog.string_agg(a.grantee::regrole::text, chr(31)), ''), true)
  FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
 WHERE p.oid = 'idem.claim(text, text, text, interval, interval, text)'::regprocedure
   AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner;
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION idem.claim(text, text, text, interval, interval, text);
-- +goose StatementEnd

-- +goose StatementBegin
-- idem.claim, version 4. As version 1, plus: lock_wait bounds the wait for
-- another claim of the same key (default 5 seconds; then in_progress);
-- lease_remaining is the lease granted (acquired) or left (in_progress) by
-- the database's clock; for a completed key whose result was not stored,
-- error says why; months are UTC whatever the TimeZone.
CREATE FUNCTION idem.claim(
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
REVOKE ALL ON FUNCTION idem.claim(text, text, text, interval, interval, text, interval) FROM PUBLIC;
DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT role FROM pg_catalog.unnest(pg_catalog.string_to_array(
                 nullif(pg_catalog.current_setting('idem.claim_grantees', true), ''), chr(31))) AS role LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION idem.claim(text, text, text, interval, interval, text, interval) TO %s', r.role);
    END LOOP;
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
        idem.prunable_rows() TO %s', role);
    EXECUTE format('GRANT EXECUTE ON PROCEDURE idem.prune(integer, integer), idem.rotate(integer, boolean, interval) TO %s', role);
    -- Reading for stats and check; no writes.
    EXECUTE format('GRANT SELECT ON idem.processed_events, idem.processed_events_default, idem.policies, idem.maintenance_locks TO %s', role);
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Make the months rotation premakes by default (3), as `idemctl check`
-- expects of a healthy install.
SELECT idem.create_partition(m) FROM idem.months_to_create(3) AS m;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.complete_unstored(text, text, bigint, text);
-- +goose StatementEnd

-- +goose StatementBegin
-- Roles granted EXECUTE on the function being replaced get it on the new
-- one: remembered for this transaction in a setting (goose runs each
-- migration in one transaction).
SELECT pg_catalog.set_config('idem.claim_grantees', coalesce(pg_catalog.string_agg(a.grantee::regrole::text, chr(31)), ''), true)
  FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
 WHERE p.oid = 'idem.claim(text, text, text, interval, interval, text, interval)'::regprocedure
   AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner;
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION idem.claim(text, text, text, interval, interval, text, interval);
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION idem.claim(
    source      text,
    key         text,
    fingerprint text     DEFAULT NULL,
    ttl         interval DEFAULT NULL,
    lease       interval DEFAULT NULL,
    event_type  text     DEFAULT NULL,
    OUT outcome          text,
    OUT token            bigint,
    OUT attempt          integer,
    OUT lease_expires_at timestamptz,
    OUT result           jsonb,
    OUT error            text,
    OUT first_seen       timestamptz,
    OUT expires_at       timestamptz)
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
       OR (claim.lease IS NOT NULL AND NOT (claim.lease >= interval '1 second' AND claim.lease <= interval '7 days')) THEN
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
            PERFORM pg_advisory_xact_lock(1768187245, hashtext(claim.source || chr(31) || claim.key));
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
                       token = nextval('idem.token_seq'),
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
            VALUES (claim.source, claim.key, date_trunc('month', v_now, 'UTC')::date, claim.event_type,
                    'processing', 1, nextval('idem.token_seq'), v_now + v_lease, claim.fingerprint, v_now, v_now,
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
    error            := CASE WHEN outcome IN ('failed', 'acquired') THEN r.last_error END;
    first_seen       := r.first_seen;
    expires_at       := r.expires_at;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.claim(text, text, text, interval, interval, text) FROM PUBLIC;
DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT role FROM pg_catalog.unnest(pg_catalog.string_to_array(
                 nullif(pg_catalog.current_setting('idem.claim_grantees', true), ''), chr(31))) AS role LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION idem.claim(text, text, text, interval, interval, text) TO %s', r.role);
    END LOOP;
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
        idem.claim(text, text, text, interval, interval, text),
        idem.complete(text, text, bigint, jsonb),
        idem.fail(text, text, bigint, text, boolean),
        idem.extend(text, text, bigint, interval) TO %s', role);
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.create_partition(p_month date) RETURNS text
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_lo   date := date_trunc('month', p_month)::date;
    v_hi   date := (date_trunc('month', p_month) + interval '1 month')::date;
    v_name text := idem.partition_name(v_lo);
BEGIN
    IF p_month IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.create_partition: month must not be NULL';
    END IF;
    IF to_regclass(format('idem.%I', v_name)) IS NOT NULL THEN
        RETURN v_name;
    END IF;
    EXECUTE format('CREATE TABLE idem.%I (LIKE idem.processed_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES) WITH (fillfactor = 85)', v_name);
    -- Nothing may land in the default partition for this month between
    -- moving its rows out and the attach.
    LOCK TABLE idem.processed_events_default IN ACCESS EXCLUSIVE MODE;
    EXECUTE format('WITH moved AS (DELETE FROM idem.processed_events_default d
                                    WHERE d.first_seen_month >= $1 AND d.first_seen_month < $2
                                    RETURNING d.*)
                    INSERT INTO idem.%I SELECT * FROM moved', v_name)
        USING v_lo, v_hi;
    EXECUTE format('ALTER TABLE idem.processed_events ATTACH PARTITION idem.%I FOR VALUES FROM (%L) TO (%L)',
                   v_name, v_lo, v_hi);
    RETURN v_name;
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
    v_now timestamptz;
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
    PERFORM 1 FROM idem.processed_events e WHERE e.source = fail.source AND e.key = fail.key;
    IF NOT FOUND THEN
        RETURN 'not_found';
    END IF;
    RETURN 'stale_token';
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
CREATE OR REPLACE FUNCTION idem.months_to_create(premake integer)
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
DROP FUNCTION IF EXISTS idem.utc_month(timestamptz);
-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.new_token();
-- +goose StatementEnd
