-- idem.claim of a new key (acquired), the way a handler claims.
--   pgbench -n -f bench/pgbench/claim_new.sql -c 8 -j 2 -T 30 "$DATABASE_URL"
\set k random(1, 1000000000000)
SELECT outcome, token FROM idem.claim('pgbench', 'new-' || :client_id || '-' || :k);
