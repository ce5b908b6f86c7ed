-- The ladder's second rung: raw INSERT ... ON CONFLICT DO NOTHING into the
-- partitioned parent (tuple routing, the month's primary key), no function.
\set k random(1, 1000000000000)
INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, lease_expires_at, first_seen, updated_at, expires_at)
VALUES ('ladder', 'new-' || :client_id || '-' || :k, date_trunc('month', now() AT TIME ZONE 'UTC')::date, 'processing', 1,
        now() + interval '2 minutes', now(), now(), now() + interval '30 days')
ON CONFLICT DO NOTHING RETURNING token;
