-- idem 20: a failure that is about the moment, not the work, releases the
-- key without counting as an attempt.
--
-- * idem.fail, version 20: retryable => NULL records a momentary failure
--   (an HTTP handler that answered 429 Too Many Requests, 503, 409...):
--   the key is released as by a retryable failure, and the attempt the
--   claim counted is taken back, so that a key rate-limited max_attempts
--   times is still run once the limit lifts, instead of failing for good.
--   Before, NULL was taken as true (a counted, retryable failure); a
--   client that passes NULL to an earlier version gets that, as before.
--   The attempts of a key never go below 0.
--
-- Replaces idem.fail(text, text, bigint, text, boolean) only; Down
-- restores the previous body (its signature, grants and comment are
-- unchanged). On a distributed installation both directions end by
-- running idem.citus_setup() again, as every migration that replaces a
-- function.

-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.fail(source text, key text, token bigint, error text DEFAULT NULL::text, retryable boolean DEFAULT true)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
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
               -- (version 20) NULL: momentary, the claim's attempt taken back.
               attempts = CASE WHEN fail.retryable IS NULL THEN greatest(e.attempts - 1, 0) ELSE e.attempts END,
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
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
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
CREATE OR REPLACE FUNCTION idem.fail(source text, key text, token bigint, error text DEFAULT NULL::text, retryable boolean DEFAULT true)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
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
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
DO $$
BEGIN
    IF idem.distributed() THEN
        PERFORM idem.citus_setup();
    END IF;
END
$$;
-- +goose StatementEnd
