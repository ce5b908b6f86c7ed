-- idem 18: the protocol in batches, for queue consumers that receive
-- messages ten to a thousand at a time.
--
-- * idem.claim_batch(source, keys[], fingerprints[], ttl, lease,
--   event_types[], lock_wait): claims up to 1000 keys of one source in one
--   call, one answer row per key (ord: its position in keys). Every key
--   gets the answer idem.claim gives it: the distinct keys take their
--   per-key locks in one global order (the lock's hash, then the key), so
--   batches that overlap never wait on each other in a cycle; a key
--   repeated in the batch is answered, after the first, as a duplicate of
--   it. Over 1000 keys: SQLSTATE ID009, before any lock is taken (a batch
--   holds one lock per distinct key until its transaction ends).
--   REPEATABLE READ is refused as by idem.claim; on a distributed (Citus)
--   installation the batch is refused (SQLSTATE ID006): its keys live on
--   several nodes, and a per-key lock excludes only the claims of the node
--   it is taken on.
-- * idem.complete_batch(source, keys[], tokens[], results[]) and
--   idem.fail_batch(source, keys[], tokens[], errors[], retryable[]): the
--   answer of idem.complete / idem.fail for each item, and for a completion
--   the result as stored.
--
-- New functions only; Down drops them.

-- +goose Up
-- +goose StatementBegin
CREATE FUNCTION idem.check_batch(fn text, source text, n integer, keys text[], more text[] DEFAULT NULL)
RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF keys IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = fn || ': keys must not be NULL';
    END IF;
    IF n > 1000 THEN
        RAISE EXCEPTION USING ERRCODE = 'ID009',
            MESSAGE = format('%s: %s keys, over the batch limit of 1000', fn, n),
            DETAIL = 'A batch holds one lock per distinct key until its transaction ends; the limit bounds its share of the server''s lock table.',
            HINT = 'Split the batch.';
    END IF;
    IF n = 0 OR array_ndims(keys) <> 1 OR array_lower(keys, 1) <> 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = fn || ': keys must be a one-dimensional array of 1 to 1000 keys, from index 1';
    END IF;
    IF more IS NOT NULL AND (array_ndims(more) <> 1 OR array_lower(more, 1) <> 1 OR cardinality(more) <> n) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = fn || ': every array must have one element per key, from index 1';
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION idem.claim_batch(source text, keys text[], fingerprints text[] DEFAULT NULL,
                                 ttl interval DEFAULT NULL, lease interval DEFAULT NULL,
                                 event_types text[] DEFAULT NULL, lock_wait interval DEFAULT NULL)
RETURNS TABLE (ord integer, outcome text, token bigint, attempt integer, lease_expires_at timestamptz,
               result jsonb, error text, first_seen timestamptz, expires_at timestamptz,
               lease_remaining interval)
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_n     integer := cardinality(claim_batch.keys);
    v_until timestamptz;
    v_ords  integer[];
    v_reps  integer[];
    v_i     integer;
    c       record;
BEGIN
    IF current_setting('transaction_isolation') = 'repeatable read' THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'idem.claim_batch: REPEATABLE READ is not supported',
            DETAIL = 'A repeatable-read snapshot cannot see a claim of the same key committed in another monthly partition after the snapshot was taken, so a duplicate could run.',
            HINT = 'Claim in READ COMMITTED (the default) or SERIALIZABLE.';
    END IF;
    PERFORM idem.check_batch('idem.claim_batch', claim_batch.source, v_n, claim_batch.keys, claim_batch.fingerprints);
    PERFORM idem.check_batch('idem.claim_batch', claim_batch.source, v_n, claim_batch.keys, claim_batch.event_types);
    IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL AND idem.distributed() THEN
        RAISE EXCEPTION USING ERRCODE = 'ID006',
            MESSAGE = 'idem.claim_batch is not supported on a distributed (Citus) installation',
            DETAIL = 'The keys of a batch live on several nodes; a per-key lock excludes only the claims of the node it is taken on.',
            HINT = 'Claim each key with idem.claim, which Citus delegates to the key''s node.';
    END IF;
    v_until := clock_timestamp() + coalesce(claim_batch.lock_wait, interval '5 seconds');

    -- The distinct keys (each at its first position) in the global lock
    -- order, and the positions that repeat an earlier key.
    SELECT array_agg(d.o ORDER BY d.h, d.k, d.o) FILTER (WHERE d.first),
           array_agg(d.o ORDER BY d.o) FILTER (WHERE NOT d.first)
      INTO v_ords, v_reps
      FROM (SELECT u.k, u.o::integer AS o,
                   hashtext(claim_batch.source || chr(31) || u.k) AS h,
                   row_number() OVER (PARTITION BY u.k ORDER BY u.o) = 1 AS first
              FROM unnest(claim_batch.keys) WITH ORDINALITY u(k, o)) d;

    FOREACH v_i IN ARRAY v_ords || coalesce(v_reps, '{}') LOOP
        SELECT * INTO c FROM idem.claim(claim_batch.source, claim_batch.keys[v_i], claim_batch.fingerprints[v_i],
                                        claim_batch.ttl, claim_batch.lease, claim_batch.event_types[v_i],
                                        greatest(v_until - clock_timestamp(), interval '0'));
        ord := v_i;
        outcome := c.outcome; token := c.token; attempt := c.attempt;
        lease_expires_at := c.lease_expires_at; result := c.result; error := c.error;
        first_seen := c.first_seen; expires_at := c.expires_at; lease_remaining := c.lease_remaining;
        RETURN NEXT;
    END LOOP;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION idem.complete_batch(source text, keys text[], tokens bigint[], results jsonb[])
RETURNS TABLE (ord integer, outcome text, stored text)
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_n integer := cardinality(complete_batch.keys);
    v_i integer;
BEGIN
    PERFORM idem.check_batch('idem.complete_batch', complete_batch.source, v_n, complete_batch.keys,
                             complete_batch.tokens::text[]);
    PERFORM idem.check_batch('idem.complete_batch', complete_batch.source, v_n, complete_batch.keys,
                             complete_batch.results::text[]);
    FOR v_i IN 1 .. v_n LOOP
        ord := v_i;
        outcome := idem.complete(complete_batch.source, complete_batch.keys[v_i], complete_batch.tokens[v_i],
                                 complete_batch.results[v_i]);
        stored := complete_batch.results[v_i]::text;
        RETURN NEXT;
    END LOOP;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION idem.fail_batch(source text, keys text[], tokens bigint[], errors text[], retryable boolean[])
RETURNS TABLE (ord integer, outcome text)
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_n integer := cardinality(fail_batch.keys);
    v_i integer;
BEGIN
    PERFORM idem.check_batch('idem.fail_batch', fail_batch.source, v_n, fail_batch.keys, fail_batch.tokens::text[]);
    PERFORM idem.check_batch('idem.fail_batch', fail_batch.source, v_n, fail_batch.keys, fail_batch.errors);
    PERFORM idem.check_batch('idem.fail_batch', fail_batch.source, v_n, fail_batch.keys, fail_batch.retryable::text[]);
    FOR v_i IN 1 .. v_n LOOP
        ord := v_i;
        outcome := idem.fail(fail_batch.source, fail_batch.keys[v_i], fail_batch.tokens[v_i],
                             fail_batch.errors[v_i], fail_batch.retryable[v_i]);
        RETURN NEXT;
    END LOOP;
END
$$;
-- +goose StatementEnd

INSERT INTO idem.rights (grantee, privilege, kind, object) VALUES
    ('app', 'EXECUTE', 'FUNCTION', 'idem.claim_batch(text, text[], text[], interval, interval, text[], interval)'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.complete_batch(text, text[], bigint[], jsonb[])'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.fail_batch(text, text[], bigint[], text[], boolean[])');

SELECT idem.regrant();

-- +goose StatementBegin
DO $$
BEGIN
    IF idem.distributed() THEN
        PERFORM idem.citus_setup();
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
DELETE FROM idem.rights x
 WHERE x.object IN ('idem.claim_batch(text, text[], text[], interval, interval, text[], interval)',
                    'idem.complete_batch(text, text[], bigint[], jsonb[])',
                    'idem.fail_batch(text, text[], bigint[], text[], boolean[])');
DROP FUNCTION idem.fail_batch(text, text[], bigint[], text[], boolean[]);
DROP FUNCTION idem.complete_batch(text, text[], bigint[], jsonb[]);
DROP FUNCTION idem.claim_batch(text, text[], text[], interval, interval, text[], interval);
DROP FUNCTION idem.check_batch(text, text, integer, text[], text[]);
