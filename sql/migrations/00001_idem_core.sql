-- idem core schema: partitioned processed_events, retention policies and the
-- claim protocol (idem.claim / complete / fail / extend).
--
-- Everything lives in schema idem. The schema itself is created by the
-- migrator before goose runs (goose keeps its own version table,
-- idem.goose_db_version, inside it), and the Down section leaves the schema
-- in place for the same reason. See docs/design.md for the reasoning.

-- +goose Up
-- +goose StatementBegin
CREATE SCHEMA IF NOT EXISTS idem;
-- +goose StatementEnd

-- +goose StatementBegin
-- idem.clock() is the one place the protocol reads the time. It is a
-- separate function so that tests (in their own throwaway database) can
-- replace it with a controllable clock; production never pays for that.
CREATE FUNCTION idem.clock() RETURNS timestamptz
    LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$ SELECT pg_catalog.clock_timestamp() $$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Limits shared by the table checks and the protocol functions.
CREATE FUNCTION idem.valid_ttl(ttl interval) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT ttl >= interval '1 minute' AND ttl <= interval '10 years' $$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION idem.valid_lease(lease interval) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT lease >= interval '1 second' AND lease <= interval '7 days' $$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Per-source retention and lease policy. The row with source '*' is the
-- default for every source without a row of its own.
CREATE TABLE idem.policies (
    source       text PRIMARY KEY
                 CONSTRAINT policies_source_check
                 CHECK (source = '*' OR (btrim(source) <> '' AND octet_length(source) <= 64)),
    ttl          interval NOT NULL CONSTRAINT policies_ttl_check CHECK (idem.valid_ttl(ttl)),
    lease        interval NOT NULL CONSTRAINT policies_lease_check CHECK (idem.valid_lease(lease)),
    max_attempts integer CONSTRAINT policies_max_attempts_check CHECK (max_attempts IS NULL OR max_attempts >= 1),
    -- Duplicate counting (processed_events.duplicates, for stats): one
    -- duplicate in duplicate_sampling is counted, as duplicate_sampling, so
    -- the duplicate path writes (a row update and its WAL) only that often.
    -- 1 counts every duplicate, 0 none. Counting never waits for a locked
    -- row and is skipped in SERIALIZABLE transactions: an estimate.
    duplicate_sampling integer NOT NULL DEFAULT 8
                 CONSTRAINT policies_duplicate_sampling_check CHECK (duplicate_sampling BETWEEN 0 AND 1000000),
    description  text,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT policies_lease_within_ttl CHECK (lease <= ttl)
);
-- +goose StatementEnd

-- +goose StatementBegin
INSERT INTO idem.policies (source, ttl, lease, max_attempts, description)
VALUES ('*', interval '30 days', interval '2 minutes', 25,
        'default: outlasts every common sender retry window (Stripe 3 days, Shopify 48 hours, Svix about 5 days)');
-- +goose StatementEnd

-- +goose StatementBegin
-- Fencing tokens. Globally unique, so a token from an expired, pruned and
-- re-created row can never complete its successor.
CREATE SEQUENCE idem.token_seq AS bigint;
-- +goose StatementEnd

-- +goose StatementBegin
-- One row per (source, key). Range-partitioned by the UTC month of
-- first_seen; first_seen_month is that month, stored so that the primary key
-- can include the partition key.
CREATE TABLE idem.processed_events (
    source           text        NOT NULL,
    key              text        NOT NULL,
    first_seen_month date        NOT NULL,
    event_type       text,
    status           text        NOT NULL
                     CONSTRAINT processed_events_status_check
                     CHECK (status IN ('processing', 'completed', 'failed')),
    attempts         integer     NOT NULL DEFAULT 1,
    token            bigint      NOT NULL,
    lease_expires_at timestamptz,
    fingerprint      text,
    result           jsonb,
    last_error       text,
    retryable        boolean,
    first_seen       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    completed_at     timestamptz,
    expires_at       timestamptz NOT NULL,
    duplicates       integer     NOT NULL DEFAULT 0,
    last_seen_at     timestamptz,
    PRIMARY KEY (source, key, first_seen_month)
) PARTITION BY RANGE (first_seen_month);
-- +goose StatementEnd

-- +goose StatementBegin
CREATE INDEX processed_events_expires_at_idx ON idem.processed_events (expires_at);
-- +goose StatementEnd

-- +goose StatementBegin
-- Rows whose month has no partition land here instead of failing the claim;
-- idem.create_partition moves them out when their month's partition is made.
CREATE TABLE idem.processed_events_default PARTITION OF idem.processed_events DEFAULT;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION idem.partition_name(month date) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 'processed_events_p' || pg_catalog.to_char(month, 'YYYY_MM') $$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Creates the partition for the month containing p_month, idempotently.
-- Rows of that month already sitting in the default partition are moved
-- into the new partition in the same transaction, so creating a partition
-- never fails because of them (the pg_partman default-partition trap).
--
-- The table is made on its own and then ATTACHed: ATTACH takes only SHARE
-- UPDATE EXCLUSIVE on processed_events, which claims do not conflict with,
-- while CREATE TABLE ... PARTITION OF would take ACCESS EXCLUSIVE on it
-- after locking the default partition, a lock order that deadlocks with
-- claims. The default partition is locked (ACCESS EXCLUSIVE) for the few
-- milliseconds this takes. Callers should SET lock_timeout.
CREATE FUNCTION idem.create_partition(p_month date) RETURNS text
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
SELECT idem.create_partition(date_trunc('month', now() AT TIME ZONE 'UTC')::date);
-- +goose StatementEnd

-- +goose StatementBegin
SELECT idem.create_partition((date_trunc('month', now() AT TIME ZONE 'UTC') + interval '1 month')::date);
-- +goose StatementEnd

-- +goose StatementBegin
-- Input checks shared by the protocol functions. SQLSTATEs are stable API:
--   22004 null_value_not_allowed       NULL source or key
--   22023 invalid_parameter_value      empty/blank source or key, bad ttl/lease
--   22001 string_data_right_truncation source > 64 bytes, key > 512 bytes,
--                                      fingerprint > 512 bytes, event type > 256 bytes
-- It has no SET search_path of its own (a SET costs a GUC save and restore
-- on every call): it runs as the caller and only ever inside the protocol
-- functions, whose search_path is pinned.
CREATE FUNCTION idem.check_key(fn text, source text, key text) RETURNS void
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
-- idem.claim: the entry point of the protocol. See docs/design.md.
--
-- outcome     meaning
-- acquired    the caller owns the work; token is its fencing token
-- completed   done before; result is the stored result
-- in_progress another worker holds a live lease; retry later
-- mismatch    same key, different request fingerprint
-- failed      a permanent failure was recorded; error says why
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
-- idem.complete: records the result of the work owned by token.
-- Returns 'completed', 'already_completed' (same token, done before),
-- 'stale_token' (another worker owns or finished the key) or 'not_found'.
-- Results are capped at 1 MiB (SQLSTATE 54000).
CREATE FUNCTION idem.complete(source text, key text, token bigint, result jsonb DEFAULT NULL)
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
-- idem.fail: records a failure of the work owned by token. A retryable
-- failure releases the key at once (the next claim re-acquires it); a
-- permanent one is answered with outcome 'failed' until the key expires.
-- Returns 'failed', 'stale_token' or 'not_found'. Errors over 8 KiB are cut.
CREATE FUNCTION idem.fail(source text, key text, token bigint, error text DEFAULT NULL, retryable boolean DEFAULT true)
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
-- idem.extend: heartbeat. Pushes the lease of the work owned by token to
-- now + lease (the source's policy lease when NULL). Returns 'extended' with
-- the new lease expiry, or 'stale_token' / 'not_found' and NULL.
CREATE FUNCTION idem.extend(source text, key text, token bigint, lease interval DEFAULT NULL)
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

-- +goose Down
-- +goose StatementBegin
DROP FUNCTION IF EXISTS idem.extend(text, text, bigint, interval);
DROP FUNCTION IF EXISTS idem.fail(text, text, bigint, text, boolean);
DROP FUNCTION IF EXISTS idem.complete(text, text, bigint, jsonb);
DROP FUNCTION IF EXISTS idem.claim(text, text, text, interval, interval, text);
DROP FUNCTION IF EXISTS idem.check_key(text, text, text);
DROP FUNCTION IF EXISTS idem.create_partition(date);
DROP TABLE IF EXISTS idem.processed_events;
DROP FUNCTION IF EXISTS idem.partition_name(date);
DROP SEQUENCE IF EXISTS idem.token_seq;
DROP TABLE IF EXISTS idem.policies;
DROP FUNCTION IF EXISTS idem.valid_lease(interval);
DROP FUNCTION IF EXISTS idem.valid_ttl(interval);
DROP FUNCTION IF EXISTS idem.clock();
-- +goose StatementEnd
