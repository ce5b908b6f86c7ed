-- What Do sends for a new key (autocommit): the claim, then the completion
-- with the claim's token, both prepared (-M prepared) as pgx sends them.
-- Its baseline is hand_new.sql. For the profile in docs/performance.md:
--   pgbench -n -M prepared -f bench/pgbench/do_new.sql -c 8 -j 2 -T 15 "$DATABASE_URL"
\set k random(1, 1000000000000)
\set id :client_id * 1000000000000 + :k
SELECT token FROM idem.claim('pgbench', :id::text) \gset
SELECT outcome, stored FROM idem.complete_stored('pgbench', :id::text, :token, '{"ok": true}');
