-- The minimal claim and completion (bench/ceiling/floor.sql) of a new key:
-- the floor do_new.sql is compared with in the ceiling section.
\set k random(1, 1000000000000)
\set id :client_id * 1000000000000 + :k
SELECT token FROM bench_floor_claim('pgbench', :id::text) \gset
SELECT bench_floor_complete('pgbench', :id::text, :token, '{"ok": true}');
