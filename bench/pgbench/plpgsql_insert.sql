-- The ladder's third rung: a plpgsql function that only inserts into the
-- partitioned parent (bench_insert_only, from ladder.sql).
\set k random(1, 1000000000000)
SELECT bench_insert_only('ladder', 'new-' || :client_id || '-' || :k);
