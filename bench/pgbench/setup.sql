-- The raw baseline for the pgbench scripts: a plain, unpartitioned table with
-- the same columns and indexes as idem.processed_events. Run once:
--   psql "$DATABASE_URL" -f bench/pgbench/setup.sql
CREATE TABLE IF NOT EXISTS bench_raw (LIKE idem.processed_events INCLUDING DEFAULTS);
DO $$ BEGIN
    ALTER TABLE bench_raw ADD PRIMARY KEY (source, key);
EXCEPTION WHEN invalid_table_definition THEN NULL; -- already has one
END $$;
CREATE INDEX IF NOT EXISTS bench_raw_expires_at_idx ON bench_raw (expires_at);
-- Keys that already exist, for the duplicate scripts (both sides).
INSERT INTO bench_raw (source, key, first_seen_month, status, token, first_seen, updated_at, expires_at, result)
SELECT 'pgbench-dup', 'dup-' || g, date_trunc('month', now())::date, 'completed', g, now(), now(), now() + interval '30 days', '{"ok": true}'
  FROM generate_series(1, 10000) g
ON CONFLICT DO NOTHING;
-- The same keys, completed, in idem (written directly: claiming 10000 keys
-- in one statement would hold 10000 advisory locks in one transaction).
INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, first_seen, updated_at, completed_at, expires_at, result)
SELECT 'pgbench-dup', 'dup-' || g, date_trunc('month', now() AT TIME ZONE 'UTC')::date, 'completed', nextval('idem.token_seq'),
       now(), now(), now(), now() + interval '30 days', '{"ok": true}'
  FROM generate_series(1, 10000) g
ON CONFLICT DO NOTHING;
