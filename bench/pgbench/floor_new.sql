-- The minimal claim (bench/ceiling/floor.sql) of a new key: the floor
-- claim_new.sql is compared with in the ceiling section.
\set k random(1, 1000000000000)
SELECT outcome, token FROM bench_floor_claim('pgbench', 'new-' || :client_id || '-' || :k);
