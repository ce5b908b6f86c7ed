-- An experiment of the bench's ceiling section, never a migration:
-- idem.claim_batch reduced to each key's advisory lock (in the global
-- order, waited for) and one insert into the current month, every inserted key
-- acquired. No input checks, no policy (the default's lease and ttl), no
-- probe of the window's other months, no holds, no counting: the least a
-- new batch's claim could do on this table.
CREATE OR REPLACE FUNCTION idem.claim_batch(source text, keys text[], fingerprints text[] DEFAULT NULL::text[], ttl interval DEFAULT NULL::interval, lease interval DEFAULT NULL::interval, event_types text[] DEFAULT NULL::text[], lock_wait interval DEFAULT NULL::interval)
 RETURNS TABLE(ord integer, outcome text, token bigint, attempt integer, lease_expires_at timestamp with time zone, result jsonb, error text, first_seen timestamp with time zone, expires_at timestamp with time zone, lease_remaining interval)
 LANGUAGE plpgsql SECURITY DEFINER SET search_path TO 'pg_catalog', 'pg_temp' SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
DECLARE
    v_now  timestamptz := clock_timestamp();
    v_cur  date := idem.utc_month(clock_timestamp());
    v_base bigint := idem.new_token();
BEGIN
    RETURN QUERY
    WITH l AS MATERIALIZED (
        -- Each lock waited for, in the lock keys' order (so two batches
        -- never deadlock): no answer for a busy key but its own.
        SELECT s.k, s.o, pg_advisory_xact_lock(1768187245, s.h)::text AS locked
          FROM (SELECT u.k, u.o, hashtext(claim_batch.source || chr(31) || u.k) AS h
                  FROM unnest(claim_batch.keys) WITH ORDINALITY u(k, o)
                 ORDER BY 3, 2) s),
    ins AS (
        INSERT INTO idem.processed_events AS e
               (source, key, first_seen_month, status, attempts, token, lease_expires_at, first_seen, updated_at, expires_at)
        SELECT claim_batch.source, l.k, v_cur, 'processing', 1, greatest(v_base # (l.o::bigint * 2654435761), 1),
               v_now + interval '2 minutes', v_now, v_now, v_now + interval '30 days'
          FROM l
        ON CONFLICT DO NOTHING
        RETURNING e.key, e.token, e.attempts, e.lease_expires_at, e.first_seen, e.expires_at)
    SELECT l.o::integer, 'acquired'::text, i.token, i.attempts, i.lease_expires_at, NULL::jsonb, NULL::text,
           i.first_seen, i.expires_at, interval '2 minutes'
      FROM ins i JOIN l ON l.k = i.key;
END
$function$;
