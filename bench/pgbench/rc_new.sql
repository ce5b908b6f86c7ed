-- The baseline of ser_new.sql: the same claim in a READ COMMITTED
-- transaction of its own (-D ttl=N the same way).
\set k random(1, 1000000000000)
BEGIN ISOLATION LEVEL READ COMMITTED;
SELECT outcome, token FROM idem.claim('pgbench-iso-' || :ttl, 'new-' || :client_id || '-' || :k,
                                      ttl => nullif(:ttl, 0) * interval '1 day');
COMMIT;
