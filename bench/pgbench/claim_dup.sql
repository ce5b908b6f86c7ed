-- idem.claim of a key completed before (outcome completed, stored result back).
\set k random(1, 10000)
SELECT outcome, result FROM idem.claim('pgbench-dup', 'dup-' || :k);
