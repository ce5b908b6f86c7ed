-- The baseline of claim_dup.sql: the conflict path of INSERT ... ON CONFLICT.
\set k random(1, 10000)
INSERT INTO bench_raw (source, key, first_seen_month, status, token, first_seen, updated_at, expires_at)
VALUES ('pgbench-dup', 'dup-' || :k, date_trunc('month', now())::date, 'processing', 1, now(), now(), now() + interval '30 days')
ON CONFLICT DO NOTHING RETURNING token;
