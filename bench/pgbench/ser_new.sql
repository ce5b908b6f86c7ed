-- idem.claim of a new key inside a SERIALIZABLE transaction, the claim
-- alone (issue 55's target: >= 0.80x of rc_new.sql, <= 5% retried). The
-- ttl in days comes from -D ttl=N (0: the source's policy, the default
-- 30 days); each ttl has a source of its own, since a claim with a longer
-- ttl raises its source's lookback for good. pgbench retries the
-- serialization failures:
--   pgbench -n -f bench/pgbench/ser_new.sql -D ttl=0 --max-tries=100 -c 8 -j 2 -T 15 "$DATABASE_URL"
\set k random(1, 1000000000000)
BEGIN ISOLATION LEVEL SERIALIZABLE;
SELECT outcome, token FROM idem.claim('pgbench-iso-' || :ttl, 'new-' || :client_id || '-' || :k,
                                      ttl => nullif(:ttl, 0) * interval '1 day');
COMMIT;
