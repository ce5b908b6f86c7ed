-- An experiment of the bench's ceiling section, never a migration:
-- idem.complete_batch reduced to one UPDATE .. FROM unnest of the current
-- month's rows. No input checks, no other months, no answer for a stale
-- token: the least a batch's completion could do on this table.
CREATE OR REPLACE FUNCTION idem.complete_batch(source text, keys text[], tokens bigint[], results jsonb[])
 RETURNS TABLE(ord integer, outcome text, stored text)
 LANGUAGE plpgsql SECURITY DEFINER SET search_path TO 'pg_catalog', 'pg_temp' SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
DECLARE
    v_now   timestamptz := clock_timestamp();
    v_month date := idem.utc_month(clock_timestamp());
BEGIN
    RETURN QUERY
    WITH u AS (
        UPDATE idem.processed_events e
           SET status = 'completed', result = x.r, completed_at = v_now, updated_at = v_now,
               lease_expires_at = NULL, retryable = NULL, last_error = NULL
          FROM unnest(complete_batch.keys, complete_batch.tokens, complete_batch.results) WITH ORDINALITY x(k, t, r, o)
         WHERE e.source = complete_batch.source AND e.key = x.k AND e.first_seen_month = v_month
           AND e.token = x.t AND e.status = 'processing'
        RETURNING x.o, x.r)
    SELECT u.o::integer, 'completed'::text, u.r::text FROM u;
END
$function$;
