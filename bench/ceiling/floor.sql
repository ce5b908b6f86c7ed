-- The floor of the bench's ceiling section, never a migration: the least a
-- single-key claim and completion can do on idem.processed_events itself,
-- kept so that every run compares the shipped idem.claim and idem.complete
-- with it (issue 55). Functions of their own (bench_floor_claim,
-- bench_floor_complete) beside idem's, which they leave as shipped.
--
-- The claim: the key's advisory lock (waited for), one probe of the
-- window's months (the default policy's: a constant 30-day ttl, 31 days of
-- lookback, up to the month of tomorrow), and on no live row one insert
-- into the current month with the columns the shipped claim writes for a
-- new key. Nothing else: no input checks, no policy or lookback read, no
-- holds, no adoption, no counting, no placeholders, no expired row taken
-- over, no lost lease retried (a row still processing is in_progress).
-- SECURITY DEFINER with a pinned search_path, as every protocol function
-- of idem must be.
CREATE OR REPLACE FUNCTION bench_floor_claim(source text, key text, OUT outcome text, OUT token bigint, OUT result jsonb)
 LANGUAGE plpgsql SECURITY DEFINER SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_now timestamptz := clock_timestamp();
    r     record;
BEGIN
    PERFORM pg_advisory_xact_lock(1768187245, hashtext(bench_floor_claim.source || chr(31) || bench_floor_claim.key));
    SELECT e.status, e.result INTO r FROM idem.processed_events e
     WHERE e.source = bench_floor_claim.source AND e.key = bench_floor_claim.key
       AND e.first_seen_month >= idem.window_start(v_now, interval '31 days')
       AND e.first_seen_month <= idem.utc_month(v_now + interval '1 day')
       AND e.expires_at > v_now
     LIMIT 1;
    IF FOUND THEN
        outcome := CASE r.status WHEN 'processing' THEN 'in_progress' ELSE r.status END;
        result := r.result;
        RETURN;
    END IF;
    INSERT INTO idem.processed_events AS e
           (source, key, first_seen_month, event_type, status, attempts, token,
            lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
    VALUES (bench_floor_claim.source, bench_floor_claim.key, idem.utc_month(v_now), NULL,
            'processing', 1, idem.new_token(), v_now + interval '2 minutes', NULL, v_now, v_now,
            v_now + interval '30 days')
    ON CONFLICT DO NOTHING
    RETURNING e.token INTO token;
    outcome := CASE WHEN FOUND THEN 'acquired' ELSE 'in_progress' END;
END
$function$;

-- The completion: one UPDATE of the key's row in the months a key being
-- worked on is in (the previous, current and next), with the columns the
-- shipped completion writes. No input checks, no search of older months,
-- no answer for a stale token beyond 'stale_token'. The completion trigger
-- (waiters' notification) is a feature: ceilingFloor disables it in the
-- floor's database.
CREATE OR REPLACE FUNCTION bench_floor_complete(source text, key text, token bigint, result jsonb)
 RETURNS text
 LANGUAGE plpgsql SECURITY DEFINER SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_now   timestamptz := clock_timestamp();
    v_month date := idem.utc_month(clock_timestamp());
BEGIN
    UPDATE idem.processed_events e
       SET status = 'completed', result = bench_floor_complete.result, completed_at = v_now, updated_at = v_now,
           lease_expires_at = NULL, retryable = NULL, last_error = NULL
     WHERE e.source = bench_floor_complete.source AND e.key = bench_floor_complete.key
       AND e.first_seen_month >= (v_month - interval '1 month')::date
       AND e.first_seen_month <= (v_month + interval '1 month')::date
       AND e.token = bench_floor_complete.token AND e.status = 'processing';
    RETURN CASE WHEN FOUND THEN 'completed' ELSE 'stale_token' END;
END
$function$;
