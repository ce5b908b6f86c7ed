-- idem 28 (Citus): a delegated claim answered on its shard's own tables,
-- planned and cached by PostgreSQL, without Citus' planner.
--
-- On a worker every statement of a delegated claim went through Citus (a
-- distributed plan per statement, executed locally on the key's shard):
-- about 3 ms of a worker's CPU per new-key claim against 0.7 ms for the
-- whole claim on a single node (docs/citus.md, "Where a delegated claim's
-- time goes"). On Citus, idem.claim (migration 27) always calls
-- idem.claim_general, the whole protocol; this migration is about it.
--
-- * idem.citus_shard_claims() (run by idem.citus_setup on the
--   coordinator): for each shard of idem.processed_events,
--   idem_shard_<shardid>.claim_general, idem.claim_general's own
--   definition (pg_get_functiondef) with idem.processed_events,
--   idem.holds, idem.policies, idem.lookbacks and idem.adoptions replaced
--   by the shard's tables (the colocated shard of holds, the one shard of
--   each reference table), and likewise .claim_batch; created on every
--   node (Citus propagates it; only the node holding the shard calls it),
--   made again whenever the definition changed (its md5 in the copy's
--   comment), so it is generated from the one claim, never written by
--   hand. Executable by its owner only. Copies of shards that are gone are
--   dropped.
-- * idem.citus_shard_claim(key): '' when the key's shard is not on this
--   node, else the copy's name when it exists, else NULL. In the copies
--   its call is replaced by NULL: a copy is only called after the check.
-- * idem.claim_general: on Citus, where version 11 checked
--   idem.key_is_local, asks idem.citus_shard_claim: '' is refused (ID005)
--   as before; a copy answers the claim (one EXECUTE); NULL (inside the
--   copy, or a shard without one) goes on as before, through Citus.
--   Nothing changes on a single node but one plpgsql variable.
--
-- * idem.claim_batch on Citus (refused with ID006 since migration 18):
--   idem.citus_batch_routes(keys) groups a batch's positions by the node
--   holding their keys, with one key of each group; idem.citus_claim_batch
--   (key, source, keys, ...), delegated by key like the claim, claims a
--   group on its node: each shard's keys by the shard's copy of
--   idem.claim_batch (made by citus_shard_claims too, its ID006 refusal
--   off), shard after shard in the order of their ids, so every batch on a
--   node locks in the order (shard, lock hash, key); a shard without a
--   copy key by key through idem.claim, in lock order. One deadline
--   (lock_wait) for the group. The application may execute both
--   (idem.rights). The Go client calls them (driver_citus.go).
-- * idem.citus_setup: delegates idem.citus_claim_batch by key, drops
--   idem.claim_settings' triggers (migration 27; idem.claim does not read
--   it on Citus), and ends with idem.citus_shard_claims().
--
-- Down restores idem.claim_general as migration 27 left it, citus_setup
-- version 11, and drops the copies and the four functions.

-- +goose Up

-- +goose StatementBegin
CREATE FUNCTION idem.citus_shard_claim(key text) RETURNS text
    LANGUAGE plpgsql STABLE
    -- (idem.claim's force_custom_plan, which idem.claim_general inherits, would plan the placement's look-up
    -- at every call)
    SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_shard bigint;
BEGIN
    v_shard := pg_catalog.get_shard_id_for_distribution_column('idem.processed_events', citus_shard_claim.key);
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_placement p, pg_catalog.pg_dist_local_group g
                    WHERE p.groupid OPERATOR(pg_catalog.=) g.groupid AND p.shardid OPERATOR(pg_catalog.=) v_shard) THEN
        RETURN '';
    END IF;
    IF pg_catalog.to_regprocedure('idem_shard_' OPERATOR(pg_catalog.||) v_shard::text
                                  OPERATOR(pg_catalog.||) '.claim_general(text, text, text, interval, interval, text, interval)') IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN 'idem_shard_' OPERATOR(pg_catalog.||) v_shard::text OPERATOR(pg_catalog.||) '.claim_general';
END
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.citus_shard_claim(text) FROM PUBLIC;
COMMENT ON FUNCTION idem.citus_shard_claim(text) IS 'On Citus, for idem.claim_general on the node it runs on: '''' when the key''s shard is not placed here (ID005), the name of the claim''s copy for the key''s shard when there is one (idem.citus_shard_claims), NULL otherwise.';

-- +goose StatementBegin
CREATE FUNCTION idem.citus_shard_claims() RETURNS SETOF text
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_fns    constant regprocedure[] := ARRAY[
        'idem.claim_general(text, text, text, interval, interval, text, interval)'::regprocedure,
        'idem.claim_batch(text, text[], text[], interval, interval, text[], interval)'::regprocedure];
    v_f      regprocedure;
    v_name   text;
    v_args   text;
    v_def    text;
    v_sum    text;
    v_ref    text;
    v_schema text;
    v_fn     text;
    v_made   integer := 0;
    v_gone   integer := 0;
    s        record;
BEGIN
    IF NOT idem.distributed() THEN
        RETURN;
    END IF;
    FOREACH v_f IN ARRAY v_fns LOOP
        SELECT p.proname, '(' || oidvectortypes(p.proargtypes) || ')' INTO v_name, v_args
          FROM pg_proc p WHERE p.oid = v_f;
        v_def := pg_get_functiondef(v_f);
        v_sum := md5(v_def);
        FOR s IN SELECT pe.shardid, h.shardid AS holds_shard
                   FROM pg_dist_shard pe
                   JOIN pg_dist_shard h ON h.logicalrelid = 'idem.holds'::regclass AND h.shardminvalue = pe.shardminvalue
                  WHERE pe.logicalrelid = 'idem.processed_events'::regclass
                  ORDER BY pe.shardid LOOP
            v_schema := 'idem_shard_' || s.shardid;
            v_fn := v_schema || '.' || v_name || v_args;
            CONTINUE WHEN to_regprocedure(v_fn) IS NOT NULL
                      AND obj_description(to_regprocedure(v_fn), 'pg_proc') = 'idem: ' || v_name || ' ' || v_sum;
            -- The function's definition with its tables replaced by this
            -- shard's (and the reference tables' one shard each); the name
            -- stays, in a schema of the shard's, so that its body's
            -- <function>.<parameter> still names its parameters.
            v_ref := regexp_replace(v_def, '^CREATE OR REPLACE FUNCTION idem\.' || v_name || '\(',
                                    'CREATE OR REPLACE FUNCTION ' || v_schema || '.' || v_name || '(');
            v_ref := regexp_replace(v_ref, 'idem\.processed_events\M', 'idem.processed_events_' || s.shardid, 'g');
            v_ref := regexp_replace(v_ref, 'idem\.holds\M', 'idem.holds_' || s.holds_shard, 'g');
            v_ref := regexp_replace(v_ref, 'idem\.policies\M',
                                    'idem.policies_' || (SELECT d.shardid FROM pg_dist_shard d WHERE d.logicalrelid = 'idem.policies'::regclass), 'g');
            v_ref := regexp_replace(v_ref, 'idem\.lookbacks\M',
                                    'idem.lookbacks_' || (SELECT d.shardid FROM pg_dist_shard d WHERE d.logicalrelid = 'idem.lookbacks'::regclass), 'g');
            v_ref := regexp_replace(v_ref, 'idem\.adoptions\M',
                                    'idem.adoptions_' || (SELECT d.shardid FROM pg_dist_shard d WHERE d.logicalrelid = 'idem.adoptions'::regclass), 'g');
            -- A copy is only called after its keys were found on this
            -- node: it asks nothing (claim), refuses nothing (the batch's
            -- refusal of a distributed installation).
            v_ref := replace(v_ref, 'idem.citus_shard_claim(claim_general.key)', 'NULL::text');
            v_ref := replace(v_ref, 'IF to_regclass(''pg_catalog.pg_dist_partition'') IS NOT NULL AND idem.distributed() THEN', 'IF false THEN');
            EXECUTE format('CREATE SCHEMA IF NOT EXISTS %I', v_schema);
            EXECUTE v_ref;
            -- PostgreSQL's own plans, cached (as on a single node);
            -- callable by idem's functions (their owner) only: a copy
            -- writes the shard without asking whose key it is.
            EXECUTE format('ALTER FUNCTION %s SET plan_cache_mode = force_generic_plan', v_fn);
            -- On Citus (idem.claim_weight: the secret that signs its
            -- sampled minute is not on the workers).
            EXECUTE format('ALTER FUNCTION %s SET idem.citus = on', v_fn);
            EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', v_fn);
            EXECUTE format('COMMENT ON FUNCTION %s IS %L', v_fn, 'idem: ' || v_name || ' ' || v_sum);
            v_made := v_made + 1;
        END LOOP;
    END LOOP;
    -- Copies of shards that are gone (a shard split, idem distributed again).
    FOR v_schema IN SELECT n.nspname FROM pg_namespace n
                     WHERE n.nspname ~ '^idem_shard_[0-9]+$'
                       AND NOT EXISTS (SELECT 1 FROM pg_dist_shard d
                                        WHERE d.logicalrelid = 'idem.processed_events'::regclass
                                          AND n.nspname = 'idem_shard_' || d.shardid) LOOP
        EXECUTE format('DROP SCHEMA %I CASCADE', v_schema);
        v_gone := v_gone + 1;
    END LOOP;
    IF v_made > 0 THEN
        RETURN NEXT format('made %s copies of claim and claim_batch on the shards (schemas idem_shard_<shard>)', v_made);
    END IF;
    IF v_gone > 0 THEN
        RETURN NEXT format('dropped the copies of %s shards that are gone', v_gone);
    END IF;
END
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.citus_shard_claims() FROM PUBLIC;
COMMENT ON FUNCTION idem.citus_shard_claims() IS 'On Citus (run by idem.citus_setup): for each shard of idem.processed_events, idem_shard_<shard>.claim_general and .claim_batch, idem.claim_general''s and idem.claim_batch''s definitions on that shard''s tables, made again when they changed; the schemas of shards that are gone are dropped.';

-- +goose StatementBegin
CREATE FUNCTION idem.citus_batch_routes(keys text[])
RETURNS TABLE (key text, ords integer[])
    LANGUAGE plpgsql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT idem.distributed() THEN
        RAISE EXCEPTION USING ERRCODE = 'ID006',
            MESSAGE = 'idem.citus_batch_routes: idem is not distributed (Citus) here',
            HINT = 'Claim the batch with idem.claim_batch.';
    END IF;
    -- The batch's positions by the node that holds their key, and one of
    -- the node's keys: the call of idem.citus_claim_batch with it as its
    -- key is delegated to that node.
    RETURN QUERY
    SELECT min(u.k), array_agg(u.o::integer ORDER BY u.o)
      FROM unnest(citus_batch_routes.keys) WITH ORDINALITY u(k, o)
      JOIN pg_dist_placement p ON p.shardid = get_shard_id_for_distribution_column('idem.processed_events', u.k)
     GROUP BY p.groupid
     ORDER BY p.groupid;
END
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.citus_batch_routes(text[]) FROM PUBLIC;
COMMENT ON FUNCTION idem.citus_batch_routes(text[]) IS 'On Citus: a batch''s positions (1-based) grouped by the node holding their keys, each group with one of its keys, which routes its idem.citus_claim_batch call there.';

-- +goose StatementBegin
CREATE FUNCTION idem.citus_claim_batch(key text, source text, keys text[], fingerprints text[] DEFAULT NULL::text[], ttl interval DEFAULT NULL::interval, lease interval DEFAULT NULL::interval, event_types text[] DEFAULT NULL::text[], lock_wait interval DEFAULT NULL::interval)
RETURNS TABLE(ord integer, outcome text, token bigint, attempt integer, lease_expires_at timestamp with time zone, result jsonb, error text, first_seen timestamp with time zone, expires_at timestamp with time zone, lease_remaining interval)
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_until timestamptz := clock_timestamp() + coalesce(citus_claim_batch.lock_wait, interval '5 seconds');
    v_n     integer := cardinality(citus_claim_batch.keys);
    v_copy  text;
    g       record;
    r       record;
    v_i     integer;
BEGIN
    IF v_n IS NULL OR v_n > 1000 OR citus_claim_batch.key IS NULL OR NOT (citus_claim_batch.key = ANY (citus_claim_batch.keys)) THEN
        -- The batch's own checks name the problem (ID009 over 1000).
        PERFORM idem.check_batch('idem.claim_batch', citus_claim_batch.source, v_n, citus_claim_batch.keys);
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'idem.citus_claim_batch: key must be one of keys (it routes the call to the node holding them)';
    END IF;
    -- Each shard's keys (on this node: every shard must be), shard after
    -- shard in the order of their ids, each claimed by the shard's copy of
    -- idem.claim_batch: its keys locked in its global order. Every batch on
    -- this node locks in the order (shard, lock hash, key): no two wait on
    -- each other in a cycle. One deadline for the whole batch.
    FOR g IN SELECT s.shard, array_agg(s.o ORDER BY s.o) AS ords
               FROM (SELECT get_shard_id_for_distribution_column('idem.processed_events', u.k) AS shard, u.o::integer AS o
                       FROM unnest(citus_claim_batch.keys) WITH ORDINALITY u(k, o)) s
              GROUP BY s.shard ORDER BY s.shard LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_dist_placement p, pg_dist_local_group l
                        WHERE p.groupid = l.groupid AND p.shardid = g.shard) THEN
            RAISE EXCEPTION USING ERRCODE = 'ID005',
                MESSAGE = 'idem.citus_claim_batch ran on a node that does not hold the shard of some of its keys',
                DETAIL = 'On Citus the per-key lock is taken on the node that owns the key; group the keys with idem.citus_batch_routes.',
                HINT = 'Call it as SELECT ... FROM idem.citus_claim_batch($1, ...) with one of the group''s keys, as idem''s Go API does.';
        END IF;
        v_copy := 'idem_shard_' || g.shard || '.claim_batch';
        IF to_regprocedure(v_copy || '(text, text[], text[], interval, interval, text[], interval)') IS NOT NULL THEN
            FOR r IN EXECUTE format('SELECT * FROM %s($1, $2, $3, $4, $5, $6, $7)', v_copy)
                       USING citus_claim_batch.source,
                             (SELECT array_agg(citus_claim_batch.keys[o] ORDER BY i) FROM unnest(g.ords) WITH ORDINALITY x(o, i)),
                             (SELECT array_agg(citus_claim_batch.fingerprints[o] ORDER BY i) FROM unnest(g.ords) WITH ORDINALITY x(o, i)),
                             citus_claim_batch.ttl, citus_claim_batch.lease,
                             (SELECT array_agg(citus_claim_batch.event_types[o] ORDER BY i) FROM unnest(g.ords) WITH ORDINALITY x(o, i)),
                             greatest(v_until - clock_timestamp(), interval '0') LOOP
                ord := g.ords[r.ord];
                outcome := r.outcome; token := r.token; attempt := r.attempt; lease_expires_at := r.lease_expires_at;
                result := r.result; error := r.error; first_seen := r.first_seen; expires_at := r.expires_at;
                lease_remaining := r.lease_remaining;
                RETURN NEXT;
            END LOOP;
        ELSE
            -- A shard without copies (split since): its keys one by one, in
            -- lock order, through idem.claim.
            FOR v_i IN SELECT o FROM unnest(g.ords) o
                        ORDER BY hashtext(citus_claim_batch.source || chr(31) || citus_claim_batch.keys[o]), citus_claim_batch.keys[o], o LOOP
                SELECT * INTO r FROM idem.claim(citus_claim_batch.source, citus_claim_batch.keys[v_i], citus_claim_batch.fingerprints[v_i],
                                                citus_claim_batch.ttl, citus_claim_batch.lease, citus_claim_batch.event_types[v_i],
                                                greatest(v_until - clock_timestamp(), interval '0'));
                ord := v_i;
                outcome := r.outcome; token := r.token; attempt := r.attempt; lease_expires_at := r.lease_expires_at;
                result := r.result; error := r.error; first_seen := r.first_seen; expires_at := r.expires_at;
                lease_remaining := r.lease_remaining;
                RETURN NEXT;
            END LOOP;
        END IF;
    END LOOP;
END
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.citus_claim_batch(text, text, text[], text[], interval, interval, text[], interval) FROM PUBLIC;
COMMENT ON FUNCTION idem.citus_claim_batch(text, text, text[], text[], interval, interval, text[], interval) IS 'On Citus: idem.claim_batch of the keys of one node, delegated there by key (one of them): each shard''s keys by the shard''s copy of idem.claim_batch, shard after shard.';

INSERT INTO idem.rights (grantee, privilege, kind, object) VALUES
    ('app', 'EXECUTE', 'FUNCTION', 'idem.citus_batch_routes(text[])'),
    ('app', 'EXECUTE', 'FUNCTION', 'idem.citus_claim_batch(text, text, text[], text[], interval, interval, text[], interval)');
SELECT idem.regrant();

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.claim_general(source text, key text, fingerprint text DEFAULT NULL::text, ttl interval DEFAULT NULL::interval, lease interval DEFAULT NULL::interval, event_type text DEFAULT NULL::text, lock_wait interval DEFAULT NULL::interval, OUT outcome text, OUT token bigint, OUT attempt integer, OUT lease_expires_at timestamp with time zone, OUT result jsonb, OUT error text, OUT first_seen timestamp with time zone, OUT expires_at timestamp with time zone, OUT lease_remaining interval)
 RETURNS record
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_iso      text := current_setting('transaction_isolation');
    v_lockkey  integer;
    v_locked   boolean;
    v_now      timestamptz;
    v_ttl      interval;
    v_lease    interval;
    v_max      integer;
    v_sample   integer;
    v_per_key  boolean;
    v_lookback interval;
    v_need     interval;
    v_lo       date;
    v_hi       date;
    r          record;
    v_found    boolean := false;
    v_until    timestamptz;
    v_sleep    double precision := 0.001;
    v_tries    integer := 0;
    v_adopt    bigint;
    v_adopt_seen boolean := false;
    v_token    bigint;
    v_placed   date[];
    v_copy     text;
    v_weight   integer;
BEGIN
    IF v_iso = 'repeatable read' THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'idem.claim: REPEATABLE READ is not supported',
            DETAIL = 'A repeatable-read snapshot cannot see a claim of the same key committed in another monthly partition after the snapshot was taken, so a duplicate could run.',
            HINT = 'Claim in READ COMMITTED (the default) or SERIALIZABLE.';
    END IF;
    -- All input checks as one expression (cheap); only bad input takes the
    -- slow path that names the problem.
    IF claim_general.source IS NULL OR claim_general.key IS NULL
       OR octet_length(claim_general.source) NOT BETWEEN 1 AND 64 OR octet_length(claim_general.key) NOT BETWEEN 1 AND 512
       OR btrim(claim_general.source, E' \t\r\n') = '' OR btrim(claim_general.key, E' \t\r\n') = ''
       OR claim_general.source ~ '[\x01-\x1f\x7f]'
       OR octet_length(claim_general.fingerprint) > 512 OR octet_length(claim_general.event_type) > 256
       OR (claim_general.ttl IS NOT NULL AND NOT (claim_general.ttl >= interval '1 minute' AND claim_general.ttl <= interval '10 years'))
       OR (claim_general.lease IS NOT NULL AND NOT (claim_general.lease >= interval '1 second' AND claim_general.lease <= interval '7 days'))
       OR (claim_general.lock_wait IS NOT NULL AND NOT (claim_general.lock_wait >= interval '0' AND claim_general.lock_wait <= interval '1 hour')) THEN
        PERFORM idem.check_key('idem.claim', claim_general.source, claim_general.key);
        IF octet_length(claim_general.fingerprint) > 512 THEN
            RAISE EXCEPTION USING ERRCODE = '22001', MESSAGE = 'idem.claim: fingerprint is longer than 512 bytes',
                HINT = 'Pass a hash of the request, not the request.';
        END IF;
        IF octet_length(claim_general.event_type) > 256 THEN
            RAISE EXCEPTION USING ERRCODE = '22001', MESSAGE = 'idem.claim: event_type is longer than 256 bytes';
        END IF;
        IF claim_general.ttl IS NOT NULL AND NOT idem.valid_ttl(claim_general.ttl) THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: ttl %s is out of range', claim_general.ttl),
                HINT = 'ttl must be between 1 minute and 10 years.';
        END IF;
        IF claim_general.lease IS NOT NULL AND NOT idem.valid_lease(claim_general.lease) THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lease %s is out of range', claim_general.lease),
                HINT = 'lease must be between 1 second and 7 days.';
        END IF;
        IF claim_general.lock_wait IS NOT NULL AND NOT (claim_general.lock_wait >= interval '0' AND claim_general.lock_wait <= interval '1 hour') THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lock_wait %s is out of range', claim_general.lock_wait),
                HINT = 'lock_wait must be between 0 and 1 hour.';
        END IF;
    END IF;

    -- (version 11) On Citus (idem.citus_setup sets idem.citus on this
    -- function) the key's lock below is the owning node's only: a claim
    -- that was not delegated to the node holding the key's shard would not
    -- exclude a delegated claim of the same key, so it is refused.
    IF current_setting('idem.citus', true) = 'on' THEN  -- (NULL elsewhere; AND would not stop at it)
        -- (version 28) '' when the key's shard is not on this node; the
        -- name of this claim's copy on the key's shard (idem.citus_shard_claims)
        -- when there is one: the claim is answered by it, its statements on
        -- the shard's tables, which PostgreSQL plans and caches without
        -- Citus; NULL without one (a shard split since): the statements
        -- below, through Citus. (In the copies this call reads NULL.)
        v_copy := idem.citus_shard_claim(claim_general.key);
        IF v_copy OPERATOR(pg_catalog.=) '' THEN
            RAISE EXCEPTION USING ERRCODE = 'ID005',
                MESSAGE = 'idem.claim ran on a node that does not hold the key''s shard',
                DETAIL = 'On Citus the per-key lock is taken on the node that owns the key; this call was not delegated there.',
                HINT = 'Call it as SELECT ... FROM idem.claim(...) with the key as a constant or parameter (as idem''s Go API does), not from another query or function.';
        END IF;
        IF v_copy IS NOT NULL THEN
            EXECUTE pg_catalog.format('SELECT * FROM %s($1, $2, $3, $4, $5, $6, $7)', v_copy)
               INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
              USING claim_general.source, claim_general.key, claim_general.fingerprint, claim_general.ttl, claim_general.lease, claim_general.event_type, claim_general.lock_wait;
            RETURN;
        END IF;
    END IF;

    -- The key's lock first: every write of a row of this key (and every
    -- raise of its source's lookback by a write) happens under it, so what
    -- is read after it (lookback, rows) includes every earlier claim of the
    -- key. Free in the common case; held by another claim of the key only
    -- while that claim's transaction is open.
    v_lockkey := hashtext(claim_general.source || chr(31) || claim_general.key);
    v_locked := pg_try_advisory_xact_lock(1768187245, v_lockkey);

    <<answer>>
    LOOP
        SELECT x.ttl, x.lease, x.max_attempts, x.duplicate_sampling, x.count_per_key,
               (SELECT max(l.lookback) FROM idem.lookbacks l WHERE l.source IN (claim_general.source, '*'))
          INTO v_ttl, v_lease, v_max, v_sample, v_per_key, v_lookback
          FROM (SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = claim_general.source
                UNION ALL
                SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = '*'
                 LIMIT 1) x;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = '42704',
                MESSAGE = format('idem.claim: no policy for source %L and no default policy', claim_general.source),
                HINT = 'Insert a row for the source, or the default row with source ''*'', into idem.policies.';
        END IF;
        v_ttl := coalesce(claim_general.ttl, v_ttl);
        v_lease := coalesce(claim_general.lease, v_lease);
        IF v_lease > v_ttl THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lease %s is longer than ttl %s', v_lease, v_ttl);
        END IF;
        EXIT answer WHEN v_locked;

        -- Another claim of this key is in an open transaction. Answer from
        -- what is committed when that is final (completed, failed, a
        -- mismatch, a live lease), without waiting.
        v_now := idem.clock();
        SELECT e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r FROM idem.processed_events e
         WHERE e.source = claim_general.source AND e.key = claim_general.key
           AND e.first_seen_month >= idem.window_start(v_now, v_lookback)
           AND e.expires_at > v_now
         LIMIT 1;
        v_found := FOUND;
        IF v_found THEN
            outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim_general.fingerprint, v_now);
            IF outcome IS NOT NULL THEN
                IF v_sample > 0 AND v_iso <> 'serializable' THEN
                    v_weight := idem.claim_weight(claim_general.source, v_sample, v_now);
                    IF v_weight > 0 THEN
                        PERFORM idem.count_duplicate(claim_general.source, claim_general.key, r.first_seen_month, v_weight, v_per_key, v_now);
                    END IF;
                END IF;
                EXIT answer;
            END IF;
        END IF;
        -- Wait for the lock at most lock_wait (default 5 seconds), polling
        -- so the wait is bounded whatever the caller's lock_timeout; past
        -- it, answer in_progress.
        v_until := clock_timestamp() + coalesce(claim_general.lock_wait, interval '5 seconds');
        LOOP
            IF clock_timestamp() >= v_until THEN
                outcome := 'in_progress';
                v_now := idem.clock();
                EXIT answer;
            END IF;
            PERFORM pg_sleep(least(v_sleep, greatest(extract(epoch FROM v_until - clock_timestamp()), 0)));
            v_sleep := least(v_sleep * 2, 0.05);
            EXIT WHEN pg_try_advisory_xact_lock(1768187245, v_lockkey);
        END LOOP;
        -- Locked now: read the policy and lookback again (the holder may
        -- have raised it) and go on as if the lock had been free.
        v_locked := true;
    END LOOP;

    IF outcome IS NULL THEN
        LOOP
            v_tries := v_tries + 1;
            IF v_tries > 5 THEN
                RAISE EXCEPTION USING ERRCODE = '40001',
                    MESSAGE = 'idem.claim: the key kept changing under the claim',
                    HINT = 'Retry the transaction.';
            END IF;
            v_now := idem.clock();
            v_need := idem.days_at_most(greatest(v_ttl, v_lease));
            IF v_need > v_lookback THEN
                v_lookback := idem.raise_lookback(claim_general.source, v_need);
            END IF;
            -- The window: from the oldest month that can hold a live row of
            -- this source to the month of tomorrow. A claim that committed
            -- before this one took the lock read the clock before this one
            -- did, so its month is not later than this one's; the day of
            -- margin covers a clock stepped back across a month's end.
            v_lo := idem.window_start(v_now, v_lookback);
            v_hi := idem.utc_month(v_now + interval '1 day');
            -- While a legacy table is being adopted (idemctl adopt), a key
            -- that is not in idem yet but processed in the legacy table is
            -- adopted now, under the key's lock, and answered below as the
            -- completed key it is.
            -- The live row in the window, if there is one: a duplicate is
            -- answered from it without preparing an insert.
            SELECT e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at
              INTO r FROM idem.processed_events e
             WHERE e.source = claim_general.source AND e.key = claim_general.key
               AND e.first_seen_month >= v_lo AND e.first_seen_month <= v_hi
               AND e.expires_at > v_now
             LIMIT 1;
            v_found := FOUND;
            IF NOT v_found AND NOT v_adopt_seen THEN
                -- While a legacy table is being adopted (idemctl adopt), a
                -- key that is not in idem yet but processed in the legacy
                -- table is adopted now, under the key's lock, and answered
                -- as the completed key it is (read again). Looked up once,
                -- and only for a key with no live row.
                v_adopt_seen := true;
                SELECT a.id INTO v_adopt FROM idem.adoptions a WHERE a.source = claim_general.source AND a.state = 'copying' LIMIT 1;
                IF v_adopt IS NOT NULL THEN
                    PERFORM idem.adopt_key(v_adopt, claim_general.key, v_now, v_lo, v_hi);
                    v_tries := v_tries - 1;
                    CONTINUE;
                END IF;
            END IF;
            IF NOT v_found THEN
                -- Held by the queue (its row may have expired, or sit in a
                -- month before the window): its job owns it.
                IF EXISTS (SELECT 1 FROM idem.holds h
                            WHERE h.source = claim_general.source AND h.key = claim_general.key AND h.state = 'queued') THEN
                    outcome := 'in_progress';
                    EXIT;
                END IF;
                -- SERIALIZABLE: a claim of this key committed into another
                -- month after this transaction's snapshot is not seen by
                -- the probe above. A placeholder insert into each other
                -- month of the window meets it (40001 on a committed row
                -- the snapshot cannot see); the ones that went in are
                -- deleted again. One statement for every month.
                IF v_iso = 'serializable' AND current_setting('idem.citus', true) IS DISTINCT FROM 'on' THEN
                    WITH ph AS (
                        INSERT INTO idem.processed_events AS e
                               (source, key, first_seen_month, status, attempts, token, first_seen, updated_at, expires_at)
                        SELECT claim_general.source, claim_general.key, g::date, 'processing', 1, 0, v_now, v_now, v_now
                          FROM generate_series(v_lo::timestamp, v_hi::timestamp, interval '1 month') g
                         WHERE g::date <> idem.utc_month(v_now)
                        ON CONFLICT DO NOTHING
                        RETURNING e.first_seen_month)
                    SELECT array_agg(ph.first_seen_month) INTO v_placed FROM ph;
                    IF v_placed IS NOT NULL THEN
                        DELETE FROM idem.processed_events e
                         WHERE e.source = claim_general.source AND e.key = claim_general.key
                           AND e.first_seen_month BETWEEN v_lo AND v_hi
                           AND e.first_seen_month = ANY (v_placed) AND e.token = 0;
                    END IF;
                END IF;
                -- None: a new row in the current month (under the key's
                -- lock no other claim of the key writes meanwhile). (version
                -- 13) VALUES, and the token read first: Citus can neither
                -- run an INSERT .. SELECT .. ON CONFLICT DO NOTHING
                -- RETURNING that meets a conflict inside a function, nor
                -- a volatile function in a statement on a distributed table.
                v_token := idem.new_token();
                INSERT INTO idem.processed_events AS e
                       (source, key, first_seen_month, event_type, status, attempts, token,
                        lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
                VALUES (claim_general.source, claim_general.key, idem.utc_month(v_now), claim_general.event_type,
                        'processing', 1, v_token, v_now + v_lease, claim_general.fingerprint, v_now, v_now,
                        v_now + greatest(v_ttl, v_lease))
                ON CONFLICT DO NOTHING
                RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
                v_found := FOUND;
                IF v_found THEN
                    outcome := 'acquired';
                    EXIT;
                END IF;
                -- No live row, and the insert met a row of this key in the
                -- current month: an expired one. Remove it and insert again.
                DELETE FROM idem.processed_events e
                 WHERE e.source = claim_general.source AND e.key = claim_general.key
                   AND e.first_seen_month = idem.utc_month(v_now) AND e.expires_at <= v_now;
                CONTINUE;
            END IF;
            outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim_general.fingerprint, v_now);
            IF outcome IS NOT NULL THEN
                -- A duplicate: read, not written. Counted with
                -- idem.claim_weight's weight.
                IF v_sample > 0 AND v_iso <> 'serializable' THEN
                    v_weight := idem.claim_weight(claim_general.source, v_sample, v_now);
                    IF v_weight > 0 THEN
                        PERFORM idem.count_duplicate(claim_general.source, claim_general.key, r.first_seen_month, v_weight, v_per_key, v_now);
                    END IF;
                END IF;
                EXIT;
            END IF;
            -- A lost lease or a retryable failure: take the key over, if the
            -- row is still as read (complete, fail and extend do not take
            -- the key's lock), and not held by the queue (between a job's
            -- attempts, or while a crashed worker's job waits for rescue).
            IF EXISTS (SELECT 1 FROM idem.holds h
                        WHERE h.source = claim_general.source AND h.key = claim_general.key AND h.state = 'queued') THEN
                outcome := 'in_progress';
                EXIT;
            END IF;
            IF v_max IS NOT NULL AND r.attempts >= v_max THEN
                UPDATE idem.processed_events e
                   SET status = 'failed', retryable = false, lease_expires_at = NULL, updated_at = v_now,
                       last_error = format('idem: gave up after %s attempts; last error: %s',
                                           r.attempts, coalesce(r.last_error, 'lease expired'))
                 WHERE e.source = claim_general.source AND e.key = claim_general.key AND e.first_seen_month = r.first_seen_month
                   AND e.token = r.token AND e.status = r.status
                RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
                IF FOUND THEN
                    outcome := 'failed';
                    EXIT;
                END IF;
                CONTINUE;
            END IF;
            v_need := greatest(r.expires_at, v_now + v_lease) - idem.row_anchor(r.first_seen, r.first_seen_month);
            IF v_need > v_lookback THEN
                v_lookback := idem.raise_lookback(claim_general.source, v_need);
            END IF;
            v_token := idem.new_token();  -- (version 13) not in the UPDATE: Citus refuses volatile functions there
            UPDATE idem.processed_events e
               SET status = 'processing',
                   attempts = e.attempts + 1,
                   token = v_token,
                   lease_expires_at = v_now + v_lease,
                   retryable = NULL,
                   updated_at = v_now,
                   expires_at = greatest(e.expires_at, v_now + v_lease),
                   fingerprint = coalesce(e.fingerprint, claim_general.fingerprint),
                   event_type = coalesce(e.event_type, claim_general.event_type)
             WHERE e.source = claim_general.source AND e.key = claim_general.key AND e.first_seen_month = r.first_seen_month
               AND e.token = r.token AND e.status = r.status
            RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
            IF FOUND THEN
                outcome := 'acquired';
                EXIT;
            END IF;
        END LOOP;
    END IF;

    -- (version 19) An acquisition is counted in its minute of
    -- idem.activity (the dashboard's claims per minute) with the weight of
    -- idem.claim_weight: every one below idem.exact_counting_rate(), 1 in
    -- v_sample (as v_sample) above it.
    IF outcome = 'acquired' AND v_sample > 0 AND v_iso <> 'serializable' THEN
        v_weight := idem.claim_weight(claim_general.source, v_sample, v_now);
        IF v_weight > 0 THEN
            PERFORM idem.count_activity(claim_general.source, v_now, v_weight, 0);
        END IF;
    END IF;
    IF v_found THEN
        token            := CASE WHEN outcome = 'acquired' THEN r.token END;
        attempt          := r.attempts;
        lease_expires_at := CASE WHEN outcome IN ('acquired', 'in_progress', 'mismatch') THEN r.lease_expires_at END;
        result           := CASE WHEN outcome = 'completed' THEN r.result END;
        error            := CASE WHEN outcome IN ('failed', 'acquired', 'completed') THEN r.last_error END;
        first_seen       := r.first_seen;
        expires_at       := r.expires_at;
        lease_remaining  := CASE WHEN outcome = 'acquired' THEN v_lease
                                 WHEN outcome = 'in_progress' THEN greatest(r.lease_expires_at - v_now, interval '0') END;
    END IF;
END
$function$;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.citus_setup()
 RETURNS SETOF text
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_group integer;
    v_now   timestamptz := now();
    v_fn    regprocedure;
    v_ddl   text;
    t       text;
BEGIN
    IF to_regproc('pg_catalog.create_distributed_table') IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'idem.citus_setup: Citus is not installed in this database',
            HINT = 'CREATE EXTENSION citus on the coordinator and every worker, add the workers (citus_add_node), then run idemctl migrate up --citus on the coordinator (docs/citus.md).';
    END IF;
    EXECUTE 'SELECT groupid FROM pg_catalog.pg_dist_local_group' INTO v_group;
    IF v_group IS DISTINCT FROM 0 THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'idem.citus_setup: this is a Citus worker, not the coordinator',
            HINT = 'Run idemctl migrate up --citus against the coordinator.';
    END IF;

    -- Function DDL after a parallel multi-shard operation in one
    -- transaction is refused: run shard operations one connection a node.
    PERFORM set_config('citus.multi_shard_modify_mode', 'sequential', true);

    IF EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'idem.policies'::regclass AND tgname = 'policies_raise_lookback') THEN
        DROP TRIGGER policies_raise_lookback ON idem.policies;
        RETURN NEXT 'dropped trigger policies_raise_lookback (lookback of * set to 11 years)';
    END IF;
    IF EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'idem.processed_events'::regclass AND tgname = 'processed_events_done') THEN
        DROP TRIGGER processed_events_done ON idem.processed_events;
        RETURN NEXT 'dropped trigger processed_events_done (waiting duplicates poll)';
    END IF;
    -- (version 28) idem.claim_settings' triggers (migration 27): on Citus
    -- idem.claim always takes idem.claim_general, which reads the tables.
    FOR t IN SELECT unnest(ARRAY['policies', 'lookbacks', 'adoptions', 'holds']) LOOP
        IF EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = ('idem.' || t)::regclass AND tgname = 'claim_settings_' || t) THEN
            EXECUTE format('DROP TRIGGER %I ON idem.%I', 'claim_settings_' || t, t);
            RETURN NEXT format('dropped trigger claim_settings_%s (on Citus idem.claim takes idem.claim_general)', t);
        END IF;
    END LOOP;
    -- (Citus refuses a non-IMMUTABLE function in an upsert's DO UPDATE on
    -- a reference table: the time is a parameter.)
    UPDATE idem.lookbacks l SET lookback = interval '11 years', raised_at = v_now
     WHERE l.source = '*' AND l.lookback < interval '11 years';
    INSERT INTO idem.lookbacks (source, lookback, raised_at) VALUES ('*', interval '11 years', v_now)
        ON CONFLICT (source) DO NOTHING;

    IF NOT idem.distributed() THEN
        PERFORM create_distributed_table('idem.processed_events', 'key');
        RETURN NEXT 'distributed idem.processed_events by key';
    END IF;
    FOR t IN SELECT unnest(ARRAY['idem.holds']) LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = t::regclass) THEN
            PERFORM create_distributed_table(t, 'key', colocate_with => 'idem.processed_events');
            RETURN NEXT format('distributed %s by key, colocated with idem.processed_events', t);
        END IF;
    END LOOP;
    FOR t IN SELECT unnest(ARRAY['idem.policies', 'idem.lookbacks', 'idem.adoptions']) LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = t::regclass) THEN
            PERFORM create_reference_table(t);
            RETURN NEXT format('made %s a reference table', t);
        END IF;
    END LOOP;
    FOR t IN SELECT unnest(ARRAY['idem.duplicate_counts', 'idem.activity']) LOOP
        SELECT string_agg(d, '; ') INTO v_ddl FROM master_get_table_ddl_events(t) d;
        IF EXISTS (SELECT 1 FROM run_command_on_workers(format(
                       'SELECT to_regclass(%L) IS NULL', t)) r WHERE r.success AND r.result = 't') THEN
            PERFORM run_command_on_workers(format(
                'DO $do$ BEGIN IF to_regclass(%L) IS NULL THEN %s; END IF; END $do$', t, v_ddl));
            RETURN NEXT format('created %s on the workers (a table of their own on each)', t);
        END IF;
    END LOOP;

    FOR v_fn IN SELECT p.oid::regprocedure FROM pg_proc p
                 WHERE p.pronamespace = 'idem'::regnamespace AND p.prokind = 'f'
                 ORDER BY p.oid LOOP
        IF v_fn::text ~ '^idem\.(claim|complete|complete_stored|complete_unstored|fail|extend|peek|citus_claim_batch)\(' THEN
            EXECUTE format('ALTER FUNCTION %s SET plan_cache_mode = force_custom_plan', v_fn);
            IF v_fn::text ~ '^idem\.claim\(' THEN
                EXECUTE format('ALTER FUNCTION %s SET idem.citus = on', v_fn);
            END IF;
            IF NOT EXISTS (SELECT 1 FROM pg_dist_object o
                            WHERE o.classid = 'pg_proc'::regclass AND o.objid = v_fn
                              AND o.distribution_argument_index IS NOT NULL AND o.force_delegation) THEN
                PERFORM create_distributed_function(v_fn, 'key', colocate_with => 'idem.processed_events', force_delegation => true);
                RETURN NEXT format('delegated %s to the node holding its key', v_fn);
            END IF;
        ELSIF NOT EXISTS (SELECT 1 FROM pg_dist_object o WHERE o.classid = 'pg_proc'::regclass AND o.objid = v_fn) THEN
            PERFORM create_distributed_function(v_fn);
        END IF;
    END LOOP;
    -- (version 28) The claim's copy on each shard, made again when the
    -- claim changed.
    RETURN QUERY SELECT s FROM idem.citus_shard_claims() s;
END
$function$;
-- +goose StatementEnd

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
-- +goose StatementBegin
DO $$
DECLARE
    v_schema text;
BEGIN
    FOR v_schema IN SELECT n.nspname FROM pg_catalog.pg_namespace n WHERE n.nspname ~ '^idem_shard_[0-9]+$' LOOP
        EXECUTE pg_catalog.format('DROP SCHEMA %I CASCADE', v_schema);
    END LOOP;
END
$$;
-- +goose StatementEnd
-- idem.claim_general as migration 27 left it; idem.citus_setup as migration 11.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.claim_general(source text, key text, fingerprint text DEFAULT NULL::text, ttl interval DEFAULT NULL::interval, lease interval DEFAULT NULL::interval, event_type text DEFAULT NULL::text, lock_wait interval DEFAULT NULL::interval, OUT outcome text, OUT token bigint, OUT attempt integer, OUT lease_expires_at timestamp with time zone, OUT result jsonb, OUT error text, OUT first_seen timestamp with time zone, OUT expires_at timestamp with time zone, OUT lease_remaining interval)
 RETURNS record
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_iso      text := current_setting('transaction_isolation');
    v_lockkey  integer;
    v_locked   boolean;
    v_now      timestamptz;
    v_ttl      interval;
    v_lease    interval;
    v_max      integer;
    v_sample   integer;
    v_per_key  boolean;
    v_lookback interval;
    v_need     interval;
    v_lo       date;
    v_hi       date;
    r          record;
    v_found    boolean := false;
    v_until    timestamptz;
    v_sleep    double precision := 0.001;
    v_tries    integer := 0;
    v_adopt    bigint;
    v_adopt_seen boolean := false;
    v_token    bigint;
    v_placed   date[];
    v_weight   integer;
BEGIN
    IF v_iso = 'repeatable read' THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'idem.claim: REPEATABLE READ is not supported',
            DETAIL = 'A repeatable-read snapshot cannot see a claim of the same key committed in another monthly partition after the snapshot was taken, so a duplicate could run.',
            HINT = 'Claim in READ COMMITTED (the default) or SERIALIZABLE.';
    END IF;
    -- All input checks as one expression (cheap); only bad input takes the
    -- slow path that names the problem.
    IF claim_general.source IS NULL OR claim_general.key IS NULL
       OR octet_length(claim_general.source) NOT BETWEEN 1 AND 64 OR octet_length(claim_general.key) NOT BETWEEN 1 AND 512
       OR btrim(claim_general.source, E' \t\r\n') = '' OR btrim(claim_general.key, E' \t\r\n') = ''
       OR claim_general.source ~ '[\x01-\x1f\x7f]'
       OR octet_length(claim_general.fingerprint) > 512 OR octet_length(claim_general.event_type) > 256
       OR (claim_general.ttl IS NOT NULL AND NOT (claim_general.ttl >= interval '1 minute' AND claim_general.ttl <= interval '10 years'))
       OR (claim_general.lease IS NOT NULL AND NOT (claim_general.lease >= interval '1 second' AND claim_general.lease <= interval '7 days'))
       OR (claim_general.lock_wait IS NOT NULL AND NOT (claim_general.lock_wait >= interval '0' AND claim_general.lock_wait <= interval '1 hour')) THEN
        PERFORM idem.check_key('idem.claim', claim_general.source, claim_general.key);
        IF octet_length(claim_general.fingerprint) > 512 THEN
            RAISE EXCEPTION USING ERRCODE = '22001', MESSAGE = 'idem.claim: fingerprint is longer than 512 bytes',
                HINT = 'Pass a hash of the request, not the request.';
        END IF;
        IF octet_length(claim_general.event_type) > 256 THEN
            RAISE EXCEPTION USING ERRCODE = '22001', MESSAGE = 'idem.claim: event_type is longer than 256 bytes';
        END IF;
        IF claim_general.ttl IS NOT NULL AND NOT idem.valid_ttl(claim_general.ttl) THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: ttl %s is out of range', claim_general.ttl),
                HINT = 'ttl must be between 1 minute and 10 years.';
        END IF;
        IF claim_general.lease IS NOT NULL AND NOT idem.valid_lease(claim_general.lease) THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lease %s is out of range', claim_general.lease),
                HINT = 'lease must be between 1 second and 7 days.';
        END IF;
        IF claim_general.lock_wait IS NOT NULL AND NOT (claim_general.lock_wait >= interval '0' AND claim_general.lock_wait <= interval '1 hour') THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lock_wait %s is out of range', claim_general.lock_wait),
                HINT = 'lock_wait must be between 0 and 1 hour.';
        END IF;
    END IF;

    -- (version 11) On Citus (idem.citus_setup sets idem.citus on this
    -- function) the key's lock below is the owning node's only: a claim
    -- that was not delegated to the node holding the key's shard would not
    -- exclude a delegated claim of the same key, so it is refused.
    IF current_setting('idem.citus', true) = 'on' THEN  -- (NULL elsewhere; AND would not stop at it)
        IF NOT idem.key_is_local(claim_general.key) THEN
            RAISE EXCEPTION USING ERRCODE = 'ID005',
                MESSAGE = 'idem.claim ran on a node that does not hold the key''s shard',
                DETAIL = 'On Citus the per-key lock is taken on the node that owns the key; this call was not delegated there.',
                HINT = 'Call it as SELECT ... FROM idem.claim(...) with the key as a constant or parameter (as idem''s Go API does), not from another query or function.';
        END IF;
    END IF;

    -- The key's lock first: every write of a row of this key (and every
    -- raise of its source's lookback by a write) happens under it, so what
    -- is read after it (lookback, rows) includes every earlier claim of the
    -- key. Free in the common case; held by another claim of the key only
    -- while that claim's transaction is open.
    v_lockkey := hashtext(claim_general.source || chr(31) || claim_general.key);
    v_locked := pg_try_advisory_xact_lock(1768187245, v_lockkey);

    <<answer>>
    LOOP
        SELECT x.ttl, x.lease, x.max_attempts, x.duplicate_sampling, x.count_per_key,
               (SELECT max(l.lookback) FROM idem.lookbacks l WHERE l.source IN (claim_general.source, '*'))
          INTO v_ttl, v_lease, v_max, v_sample, v_per_key, v_lookback
          FROM (SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = claim_general.source
                UNION ALL
                SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = '*'
                 LIMIT 1) x;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = '42704',
                MESSAGE = format('idem.claim: no policy for source %L and no default policy', claim_general.source),
                HINT = 'Insert a row for the source, or the default row with source ''*'', into idem.policies.';
        END IF;
        v_ttl := coalesce(claim_general.ttl, v_ttl);
        v_lease := coalesce(claim_general.lease, v_lease);
        IF v_lease > v_ttl THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lease %s is longer than ttl %s', v_lease, v_ttl);
        END IF;
        EXIT answer WHEN v_locked;

        -- Another claim of this key is in an open transaction. Answer from
        -- what is committed when that is final (completed, failed, a
        -- mismatch, a live lease), without waiting.
        v_now := idem.clock();
        SELECT e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r FROM idem.processed_events e
         WHERE e.source = claim_general.source AND e.key = claim_general.key
           AND e.first_seen_month >= idem.window_start(v_now, v_lookback)
           AND e.expires_at > v_now
         LIMIT 1;
        v_found := FOUND;
        IF v_found THEN
            outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim_general.fingerprint, v_now);
            IF outcome IS NOT NULL THEN
                IF v_sample > 0 AND v_iso <> 'serializable' THEN
                    v_weight := idem.claim_weight(claim_general.source, v_sample, v_now);
                    IF v_weight > 0 THEN
                        PERFORM idem.count_duplicate(claim_general.source, claim_general.key, r.first_seen_month, v_weight, v_per_key, v_now);
                    END IF;
                END IF;
                EXIT answer;
            END IF;
        END IF;
        -- Wait for the lock at most lock_wait (default 5 seconds), polling
        -- so the wait is bounded whatever the caller's lock_timeout; past
        -- it, answer in_progress.
        v_until := clock_timestamp() + coalesce(claim_general.lock_wait, interval '5 seconds');
        LOOP
            IF clock_timestamp() >= v_until THEN
                outcome := 'in_progress';
                v_now := idem.clock();
                EXIT answer;
            END IF;
            PERFORM pg_sleep(least(v_sleep, greatest(extract(epoch FROM v_until - clock_timestamp()), 0)));
            v_sleep := least(v_sleep * 2, 0.05);
            EXIT WHEN pg_try_advisory_xact_lock(1768187245, v_lockkey);
        END LOOP;
        -- Locked now: read the policy and lookback again (the holder may
        -- have raised it) and go on as if the lock had been free.
        v_locked := true;
    END LOOP;

    IF outcome IS NULL THEN
        LOOP
            v_tries := v_tries + 1;
            IF v_tries > 5 THEN
                RAISE EXCEPTION USING ERRCODE = '40001',
                    MESSAGE = 'idem.claim: the key kept changing under the claim',
                    HINT = 'Retry the transaction.';
            END IF;
            v_now := idem.clock();
            v_need := idem.days_at_most(greatest(v_ttl, v_lease));
            IF v_need > v_lookback THEN
                v_lookback := idem.raise_lookback(claim_general.source, v_need);
            END IF;
            -- The window: from the oldest month that can hold a live row of
            -- this source to the month of tomorrow. A claim that committed
            -- before this one took the lock read the clock before this one
            -- did, so its month is not later than this one's; the day of
            -- margin covers a clock stepped back across a month's end.
            v_lo := idem.window_start(v_now, v_lookback);
            v_hi := idem.utc_month(v_now + interval '1 day');
            -- While a legacy table is being adopted (idemctl adopt), a key
            -- that is not in idem yet but processed in the legacy table is
            -- adopted now, under the key's lock, and answered below as the
            -- completed key it is.
            -- The live row in the window, if there is one: a duplicate is
            -- answered from it without preparing an insert.
            SELECT e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at
              INTO r FROM idem.processed_events e
             WHERE e.source = claim_general.source AND e.key = claim_general.key
               AND e.first_seen_month >= v_lo AND e.first_seen_month <= v_hi
               AND e.expires_at > v_now
             LIMIT 1;
            v_found := FOUND;
            IF NOT v_found AND NOT v_adopt_seen THEN
                -- While a legacy table is being adopted (idemctl adopt), a
                -- key that is not in idem yet but processed in the legacy
                -- table is adopted now, under the key's lock, and answered
                -- as the completed key it is (read again). Looked up once,
                -- and only for a key with no live row.
                v_adopt_seen := true;
                SELECT a.id INTO v_adopt FROM idem.adoptions a WHERE a.source = claim_general.source AND a.state = 'copying' LIMIT 1;
                IF v_adopt IS NOT NULL THEN
                    PERFORM idem.adopt_key(v_adopt, claim_general.key, v_now, v_lo, v_hi);
                    v_tries := v_tries - 1;
                    CONTINUE;
                END IF;
            END IF;
            IF NOT v_found THEN
                -- Held by the queue (its row may have expired, or sit in a
                -- month before the window): its job owns it.
                IF EXISTS (SELECT 1 FROM idem.holds h
                            WHERE h.source = claim_general.source AND h.key = claim_general.key AND h.state = 'queued') THEN
                    outcome := 'in_progress';
                    EXIT;
                END IF;
                -- SERIALIZABLE: a claim of this key committed into another
                -- month after this transaction's snapshot is not seen by
                -- the probe above. A placeholder insert into each other
                -- month of the window meets it (40001 on a committed row
                -- the snapshot cannot see); the ones that went in are
                -- deleted again. One statement for every month.
                IF v_iso = 'serializable' AND current_setting('idem.citus', true) IS DISTINCT FROM 'on' THEN
                    WITH ph AS (
                        INSERT INTO idem.processed_events AS e
                               (source, key, first_seen_month, status, attempts, token, first_seen, updated_at, expires_at)
                        SELECT claim_general.source, claim_general.key, g::date, 'processing', 1, 0, v_now, v_now, v_now
                          FROM generate_series(v_lo::timestamp, v_hi::timestamp, interval '1 month') g
                         WHERE g::date <> idem.utc_month(v_now)
                        ON CONFLICT DO NOTHING
                        RETURNING e.first_seen_month)
                    SELECT array_agg(ph.first_seen_month) INTO v_placed FROM ph;
                    IF v_placed IS NOT NULL THEN
                        DELETE FROM idem.processed_events e
                         WHERE e.source = claim_general.source AND e.key = claim_general.key
                           AND e.first_seen_month BETWEEN v_lo AND v_hi
                           AND e.first_seen_month = ANY (v_placed) AND e.token = 0;
                    END IF;
                END IF;
                -- None: a new row in the current month (under the key's
                -- lock no other claim of the key writes meanwhile). (version
                -- 13) VALUES, and the token read first: Citus can neither
                -- run an INSERT .. SELECT .. ON CONFLICT DO NOTHING
                -- RETURNING that meets a conflict inside a function, nor
                -- a volatile function in a statement on a distributed table.
                v_token := idem.new_token();
                INSERT INTO idem.processed_events AS e
                       (source, key, first_seen_month, event_type, status, attempts, token,
                        lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
                VALUES (claim_general.source, claim_general.key, idem.utc_month(v_now), claim_general.event_type,
                        'processing', 1, v_token, v_now + v_lease, claim_general.fingerprint, v_now, v_now,
                        v_now + greatest(v_ttl, v_lease))
                ON CONFLICT DO NOTHING
                RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
                v_found := FOUND;
                IF v_found THEN
                    outcome := 'acquired';
                    EXIT;
                END IF;
                -- No live row, and the insert met a row of this key in the
                -- current month: an expired one. Remove it and insert again.
                DELETE FROM idem.processed_events e
                 WHERE e.source = claim_general.source AND e.key = claim_general.key
                   AND e.first_seen_month = idem.utc_month(v_now) AND e.expires_at <= v_now;
                CONTINUE;
            END IF;
            outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim_general.fingerprint, v_now);
            IF outcome IS NOT NULL THEN
                -- A duplicate: read, not written. Counted with
                -- idem.claim_weight's weight.
                IF v_sample > 0 AND v_iso <> 'serializable' THEN
                    v_weight := idem.claim_weight(claim_general.source, v_sample, v_now);
                    IF v_weight > 0 THEN
                        PERFORM idem.count_duplicate(claim_general.source, claim_general.key, r.first_seen_month, v_weight, v_per_key, v_now);
                    END IF;
                END IF;
                EXIT;
            END IF;
            -- A lost lease or a retryable failure: take the key over, if the
            -- row is still as read (complete, fail and extend do not take
            -- the key's lock), and not held by the queue (between a job's
            -- attempts, or while a crashed worker's job waits for rescue).
            IF EXISTS (SELECT 1 FROM idem.holds h
                        WHERE h.source = claim_general.source AND h.key = claim_general.key AND h.state = 'queued') THEN
                outcome := 'in_progress';
                EXIT;
            END IF;
            IF v_max IS NOT NULL AND r.attempts >= v_max THEN
                UPDATE idem.processed_events e
                   SET status = 'failed', retryable = false, lease_expires_at = NULL, updated_at = v_now,
                       last_error = format('idem: gave up after %s attempts; last error: %s',
                                           r.attempts, coalesce(r.last_error, 'lease expired'))
                 WHERE e.source = claim_general.source AND e.key = claim_general.key AND e.first_seen_month = r.first_seen_month
                   AND e.token = r.token AND e.status = r.status
                RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
                IF FOUND THEN
                    outcome := 'failed';
                    EXIT;
                END IF;
                CONTINUE;
            END IF;
            v_need := greatest(r.expires_at, v_now + v_lease) - idem.row_anchor(r.first_seen, r.first_seen_month);
            IF v_need > v_lookback THEN
                v_lookback := idem.raise_lookback(claim_general.source, v_need);
            END IF;
            v_token := idem.new_token();  -- (version 13) not in the UPDATE: Citus refuses volatile functions there
            UPDATE idem.processed_events e
               SET status = 'processing',
                   attempts = e.attempts + 1,
                   token = v_token,
                   lease_expires_at = v_now + v_lease,
                   retryable = NULL,
                   updated_at = v_now,
                   expires_at = greatest(e.expires_at, v_now + v_lease),
                   fingerprint = coalesce(e.fingerprint, claim_general.fingerprint),
                   event_type = coalesce(e.event_type, claim_general.event_type)
             WHERE e.source = claim_general.source AND e.key = claim_general.key AND e.first_seen_month = r.first_seen_month
               AND e.token = r.token AND e.status = r.status
            RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
            IF FOUND THEN
                outcome := 'acquired';
                EXIT;
            END IF;
        END LOOP;
    END IF;

    -- (version 19) An acquisition is counted in its minute of
    -- idem.activity (the dashboard's claims per minute) with the weight of
    -- idem.claim_weight: every one below idem.exact_counting_rate(), 1 in
    -- v_sample (as v_sample) above it.
    IF outcome = 'acquired' AND v_sample > 0 AND v_iso <> 'serializable' THEN
        v_weight := idem.claim_weight(claim_general.source, v_sample, v_now);
        IF v_weight > 0 THEN
            PERFORM idem.count_activity(claim_general.source, v_now, v_weight, 0);
        END IF;
    END IF;
    IF v_found THEN
        token            := CASE WHEN outcome = 'acquired' THEN r.token END;
        attempt          := r.attempts;
        lease_expires_at := CASE WHEN outcome IN ('acquired', 'in_progress', 'mismatch') THEN r.lease_expires_at END;
        result           := CASE WHEN outcome = 'completed' THEN r.result END;
        error            := CASE WHEN outcome IN ('failed', 'acquired', 'completed') THEN r.last_error END;
        first_seen       := r.first_seen;
        expires_at       := r.expires_at;
        lease_remaining  := CASE WHEN outcome = 'acquired' THEN v_lease
                                 WHEN outcome = 'in_progress' THEN greatest(r.lease_expires_at - v_now, interval '0') END;
    END IF;
END
$function$;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.citus_setup()
 RETURNS SETOF text
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_group integer;
    v_now   timestamptz := now();
    v_fn    regprocedure;
    v_ddl   text;
    t       text;
BEGIN
    IF to_regproc('pg_catalog.create_distributed_table') IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'idem.citus_setup: Citus is not installed in this database',
            HINT = 'CREATE EXTENSION citus on the coordinator and every worker, add the workers (citus_add_node), then run idemctl migrate up --citus on the coordinator (docs/citus.md).';
    END IF;
    EXECUTE 'SELECT groupid FROM pg_catalog.pg_dist_local_group' INTO v_group;
    IF v_group IS DISTINCT FROM 0 THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'idem.citus_setup: this is a Citus worker, not the coordinator',
            HINT = 'Run idemctl migrate up --citus against the coordinator.';
    END IF;

    -- Function DDL after a parallel multi-shard operation in one
    -- transaction is refused: run shard operations one connection a node.
    PERFORM set_config('citus.multi_shard_modify_mode', 'sequential', true);

    IF EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'idem.policies'::regclass AND tgname = 'policies_raise_lookback') THEN
        DROP TRIGGER policies_raise_lookback ON idem.policies;
        RETURN NEXT 'dropped trigger policies_raise_lookback (lookback of * set to 11 years)';
    END IF;
    IF EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'idem.processed_events'::regclass AND tgname = 'processed_events_done') THEN
        DROP TRIGGER processed_events_done ON idem.processed_events;
        RETURN NEXT 'dropped trigger processed_events_done (waiting duplicates poll)';
    END IF;
    -- (Citus refuses a non-IMMUTABLE function in an upsert's DO UPDATE on
    -- a reference table: the time is a parameter.)
    UPDATE idem.lookbacks l SET lookback = interval '11 years', raised_at = v_now
     WHERE l.source = '*' AND l.lookback < interval '11 years';
    INSERT INTO idem.lookbacks (source, lookback, raised_at) VALUES ('*', interval '11 years', v_now)
        ON CONFLICT (source) DO NOTHING;

    IF NOT idem.distributed() THEN
        PERFORM create_distributed_table('idem.processed_events', 'key');
        RETURN NEXT 'distributed idem.processed_events by key';
    END IF;
    FOR t IN SELECT unnest(ARRAY['idem.holds']) LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = t::regclass) THEN
            PERFORM create_distributed_table(t, 'key', colocate_with => 'idem.processed_events');
            RETURN NEXT format('distributed %s by key, colocated with idem.processed_events', t);
        END IF;
    END LOOP;
    FOR t IN SELECT unnest(ARRAY['idem.policies', 'idem.lookbacks', 'idem.adoptions']) LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = t::regclass) THEN
            PERFORM create_reference_table(t);
            RETURN NEXT format('made %s a reference table', t);
        END IF;
    END LOOP;
    FOR t IN SELECT unnest(ARRAY['idem.duplicate_counts', 'idem.activity']) LOOP
        SELECT string_agg(d, '; ') INTO v_ddl FROM master_get_table_ddl_events(t) d;
        IF EXISTS (SELECT 1 FROM run_command_on_workers(format(
                       'SELECT to_regclass(%L) IS NULL', t)) r WHERE r.success AND r.result = 't') THEN
            PERFORM run_command_on_workers(format(
                'DO $do$ BEGIN IF to_regclass(%L) IS NULL THEN %s; END IF; END $do$', t, v_ddl));
            RETURN NEXT format('created %s on the workers (a table of their own on each)', t);
        END IF;
    END LOOP;

    FOR v_fn IN SELECT p.oid::regprocedure FROM pg_proc p
                 WHERE p.pronamespace = 'idem'::regnamespace AND p.prokind = 'f'
                 ORDER BY p.oid LOOP
        IF v_fn::text ~ '^idem\.(claim|complete|complete_stored|complete_unstored|fail|extend|peek)\(' THEN
            EXECUTE format('ALTER FUNCTION %s SET plan_cache_mode = force_custom_plan', v_fn);
            IF v_fn::text ~ '^idem\.claim\(' THEN
                EXECUTE format('ALTER FUNCTION %s SET idem.citus = on', v_fn);
            END IF;
            IF NOT EXISTS (SELECT 1 FROM pg_dist_object o
                            WHERE o.classid = 'pg_proc'::regclass AND o.objid = v_fn
                              AND o.distribution_argument_index IS NOT NULL AND o.force_delegation) THEN
                PERFORM create_distributed_function(v_fn, 'key', colocate_with => 'idem.processed_events', force_delegation => true);
                RETURN NEXT format('delegated %s to the node holding its key', v_fn);
            END IF;
        ELSIF NOT EXISTS (SELECT 1 FROM pg_dist_object o WHERE o.classid = 'pg_proc'::regclass AND o.objid = v_fn) THEN
            PERFORM create_distributed_function(v_fn);
        END IF;
    END LOOP;
END
$function$;
-- +goose StatementEnd
DELETE FROM idem.rights x
 WHERE x.object IN ('idem.citus_batch_routes(text[])', 'idem.citus_claim_batch(text, text, text[], text[], interval, interval, text[], interval)');
DROP FUNCTION idem.citus_claim_batch(text, text, text[], text[], interval, interval, text[], interval);
DROP FUNCTION idem.citus_batch_routes(text[]);
DROP FUNCTION idem.citus_shard_claims();
DROP FUNCTION idem.citus_shard_claim(text);

-- +goose StatementBegin
DO $$
BEGIN
    IF idem.distributed() THEN
        PERFORM idem.citus_setup();
    END IF;
END
$$;
-- +goose StatementEnd
