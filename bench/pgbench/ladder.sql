-- For the ladder rows of docs/performance.md: the cost of a plpgsql function
-- call alone, with the same insert as raw_parent.sql and nothing else (no
-- lock, no policy, no probe).
CREATE OR REPLACE FUNCTION bench_insert_only(p_source text, p_key text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE v bigint;
BEGIN
    INSERT INTO idem.processed_events AS e (source, key, first_seen_month, status, token, lease_expires_at, first_seen, updated_at, expires_at)
    VALUES (p_source, p_key, date_trunc('month', now() AT TIME ZONE 'UTC')::date, 'processing', 1,
            now() + interval '2 minutes', now(), now(), now() + interval '30 days')
    ON CONFLICT DO NOTHING RETURNING e.token INTO v;
    RETURN v;
END $$;
