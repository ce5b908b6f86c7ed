-- idem.claim of a new key (acquired) with the key as one parameter, the
-- way idem's Go API sends it: Citus delegates a call whose key is a
-- constant or a parameter (docs/citus.md), not an expression.
--   pgbench -n -M prepared -f bench/pgbench/claim_new_param.sql -c 8 -j 2 -T 15 "$DATABASE_URL"
\set k random(1, 1000000000000)
\set id :client_id * 1000000000000 + :k
SELECT outcome, token FROM idem.claim('pgbench', :id::text);
