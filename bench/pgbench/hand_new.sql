-- The field notes' insert-first pattern for a new key (autocommit), the
-- baseline of do_new.sql: the insert, then the update with the result, on
-- a plain table with idem's columns and indexes (bench_raw, setup.sql).
\set k random(1, 1000000000000)
\set id :client_id * 1000000000000 + :k
INSERT INTO bench_raw (source, key, first_seen_month, status, token, lease_expires_at, first_seen, updated_at, expires_at)
VALUES ('pgbench', :id::text, date_trunc('month', now())::date, 'processing', 1,
        now() + interval '2 minutes', now(), now(), now() + interval '30 days')
ON CONFLICT DO NOTHING RETURNING token;
UPDATE bench_raw SET status = 'completed', result = '{"ok": true}', completed_at = now(), updated_at = now(), lease_expires_at = NULL
 WHERE source = 'pgbench' AND key = :id::text AND first_seen_month = date_trunc('month', now())::date;
