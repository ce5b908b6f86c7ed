-- The minimal claim (bench/ceiling/floor.sql) of a key completed before:
-- the floor claim_dup.sql is compared with in the ceiling section.
\set k random(1, 10000)
SELECT outcome, result FROM bench_floor_claim('pgbench-dup', 'dup-' || :k);
