-- The baseline of claim_new.sql: INSERT ... ON CONFLICT DO NOTHING RETURNING.
\set k random(1, 1000000000000)
INSERT INTO bench_raw (source, key, first_seen_month, status, token, lease_expires_at, first_seen, updated_at, expires_at)
VALUES ('pgbench', 'new-' || :client_id || '-' || :k, date_trunc('month', now())::date, 'processing', 1,
        now() + interval '2 minutes', now(), now(), now() + interval '30 days')
ON CONFLICT DO NOTHING RETURNING token;
