-- An experiment of the bench's ceiling section, never a migration:
-- idem.claim_batch reduced to one probe of each key's live row in the
-- window, every key answered from what it reads. No input checks, no
-- policy, no counting, no repeated keys, no lock for a key without a final
-- answer: the least a redelivered batch's claim could do on this table.
CREATE OR REPLACE FUNCTION idem.claim_batch(source text, keys text[], fingerprints text[] DEFAULT NULL::text[], ttl interval DEFAULT NULL::interval, lease interval DEFAULT NULL::interval, event_types text[] DEFAULT NULL::text[], lock_wait interval DEFAULT NULL::interval)
 RETURNS TABLE(ord integer, outcome text, token bigint, attempt integer, lease_expires_at timestamp with time zone, result jsonb, error text, first_seen timestamp with time zone, expires_at timestamp with time zone, lease_remaining interval)
 LANGUAGE plpgsql SECURITY DEFINER SET search_path TO 'pg_catalog', 'pg_temp' SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
DECLARE
    v_now timestamptz := clock_timestamp();
    v_lo  date := idem.window_start(clock_timestamp(), (SELECT max(l.lookback) FROM idem.lookbacks l));
    v_hi  date := idem.utc_month(clock_timestamp() + interval '1 day');
BEGIN
    RETURN QUERY
    SELECT g.o::integer, s.settled, NULL::bigint, e.attempts,
           CASE WHEN s.settled IN ('in_progress', 'mismatch') THEN e.lease_expires_at END,
           CASE WHEN s.settled = 'completed' THEN e.result END,
           CASE WHEN s.settled IN ('failed', 'completed') THEN e.last_error END,
           e.first_seen, e.expires_at,
           CASE WHEN s.settled = 'in_progress' THEN greatest(e.lease_expires_at - v_now, interval '0') END
      FROM unnest(claim_batch.keys) WITH ORDINALITY g(k, o)
      LEFT JOIN LATERAL (
          SELECT x.status, x.attempts, x.lease_expires_at, x.fingerprint, x.result,
                 x.last_error, x.retryable, x.first_seen, x.expires_at
            FROM idem.processed_events x
           WHERE x.source = claim_batch.source AND x.key = g.k
             AND x.first_seen_month >= v_lo AND x.first_seen_month <= v_hi
             AND x.expires_at > v_now
           LIMIT 1) e ON true
      CROSS JOIN LATERAL (SELECT idem.settled_outcome(e.status, e.retryable, e.lease_expires_at, e.fingerprint,
                                                      claim_batch.fingerprints[g.o], v_now)) s(settled);
END
$function$;
