-- idem 30 (Citus): a batch's keys claimed on their node as one batch.
--
-- On Citus a batch of 100 keys touches about 3 keys of each of the 32
-- shards, and migration 28's idem.citus_claim_batch claimed each shard's
-- keys with the shard's copy of idem.claim_batch: per node a batch was
-- about 16 small batches, each with its input checks, policy read, lock
-- statement, window, probe, counting (an upsert of idem.activity) and the
-- custom plans of the dispatch around it (docs/citus.md, "Batches"). Now:
--
-- * idem.citus_shard_claims() also makes idem_shard_<shard>.claim_locked:
--   idem.claim_batch's one statement that answers its locked keys (the
--   probe of their rows, the insert of new ones, the answer from the
--   current month), cut out of idem.claim_batch's own definition and put
--   on the shard's tables, its variables made parameters (so it is
--   generated from the one batch, never written by hand). The statement
--   is what stands between the comments "-- <claim_locked>" and
--   "-- </claim_locked>" in idem.claim_batch (migration 29 put them
--   there; a body keeps its comments), and claim_locked's columns are
--   those of idem.claim_batch's loop over it (the answer's, and the month
--   of the row an answer was read from):
--   idem.citus_claim_locked_definition(schema) makes the definition, or
--   NULL when the markers are not there once each or the statement names
--   a variable that is not a parameter; then none is made, and
--   idem.citus_shard_claims() says so (migrate.Citus and idemctl migrate
--   up --citus print it).
-- * idem.citus_on_shard(definition, shard, holds shard): a definition with
--   idem's distributed and reference tables replaced by the shard's
--   tables, as citus_shard_claims did inline for its copies.
-- * idem.citus_batch_routes computes each key's shard once (it was
--   computed again for every placement in the join's condition: about
--   10 ms of the coordinator's time for a batch of 100 keys).
-- * idem.citus_claim_batch, in READ COMMITTED (read-write) with good
--   input and every shard's claim_locked made, claims the node's keys as
--   one batch: idem.claim_batch's steps once (policy, the locks of every
--   key in the node's order (shard, lock hash, key), the window,
--   counting, idem.claim for a busy key and the rest), and per shard only
--   claim_locked. Else (SERIALIZABLE, a read-only transaction, bad input
--   the copies name, a shard without claim_locked) as in migration 28,
--   shard by shard through the copies of idem.claim_batch. Same answers;
--   the same lock order on the node, so both paths' batches never wait on
--   each other in a cycle.
--
-- Nothing changes on a single node (idem.citus_shard_claims returns at
-- once there; idem.citus_claim_batch is only called on Citus). Down
-- restores migration 28's three functions and drops the new ones.

-- +goose Up

-- +goose StatementBegin
CREATE FUNCTION idem.citus_on_shard(def text, shard bigint, holds_shard bigint) RETURNS text
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    def := regexp_replace(def, 'idem\.processed_events\M', 'idem.processed_events_' || shard, 'g');
    def := regexp_replace(def, 'idem\.holds\M', 'idem.holds_' || holds_shard, 'g');
    def := regexp_replace(def, 'idem\.policies\M',
                          'idem.policies_' || (SELECT d.shardid FROM pg_dist_shard d WHERE d.logicalrelid = 'idem.policies'::regclass), 'g');
    def := regexp_replace(def, 'idem\.lookbacks\M',
                          'idem.lookbacks_' || (SELECT d.shardid FROM pg_dist_shard d WHERE d.logicalrelid = 'idem.lookbacks'::regclass), 'g');
    def := regexp_replace(def, 'idem\.adoptions\M',
                          'idem.adoptions_' || (SELECT d.shardid FROM pg_dist_shard d WHERE d.logicalrelid = 'idem.adoptions'::regclass), 'g');
    RETURN def;
END
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.citus_on_shard(text, bigint, bigint) FROM PUBLIC;
COMMENT ON FUNCTION idem.citus_on_shard(text, bigint, bigint) IS 'On Citus (idem.citus_shard_claims): a function definition with idem.processed_events, idem.holds and the reference tables replaced by the given shard''s tables.';

-- +goose StatementBegin
CREATE FUNCTION idem.citus_claim_locked_definition(schema text) RETURNS text
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_def   text := pg_get_functiondef('idem.claim_batch(text, text[], text[], interval, interval, text[], interval)'::regprocedure);
    v_open  constant text := E'-- <claim_locked>\n';
    v_close constant text := E'-- </claim_locked>\n';
    v_from  integer;
    v_to    integer;
    v_stmt  text;
BEGIN
    -- idem.claim_batch's statement that answers its locked keys: the lines
    -- between its two marker comments (each there once, in that order; a
    -- body keeps its comments, so the cut does not depend on how the
    -- statement or the loop around it is written).
    v_from := strpos(v_def, v_open);
    v_to := strpos(v_def, v_close);
    IF v_from = 0 OR v_to < v_from OR strpos(substr(v_def, v_from + 1), v_open) > 0
       OR strpos(substr(v_def, v_to + 1), v_close) > 0 THEN
        RETURN NULL;
    END IF;
    v_stmt := rtrim(substr(v_def, v_from + length(v_open), v_to - v_from - length(v_open)), E' \t\n');
    -- It may name only claim_locked's parameters: claim_batch's source,
    -- keys, fingerprints and event_types, and the variables below.
    IF btrim(v_stmt, E' \t\n') = ''
       OR EXISTS (SELECT 1 FROM regexp_matches(v_stmt, '\m(v_[a-z0-9_]+)', 'g') m
                   WHERE m[1] <> ALL (ARRAY['v_locked', 'v_now', 'v_lo', 'v_hi', 'v_cur', 'v_ttl', 'v_lease',
                                            'v_adopting', 'v_holds', 'v_base']))
       OR EXISTS (SELECT 1 FROM regexp_matches(v_stmt, '\mclaim_batch\.([a-z0-9_]+)', 'g') m
                   WHERE m[1] <> ALL (ARRAY['source', 'keys', 'fingerprints', 'event_types'])) THEN
        RETURN NULL;
    END IF;
    -- Its columns are those of claim_batch's loop over it: the answer's,
    -- and the month of the row an answer was read from.
    RETURN format($f$CREATE OR REPLACE FUNCTION %I.claim_locked(source text, keys text[], fingerprints text[], event_types text[],
    v_locked integer[], v_now timestamptz, v_lo date, v_hi date, v_cur date, v_ttl interval, v_lease interval,
    v_adopting boolean, v_holds boolean, v_base bigint)
RETURNS TABLE (ord integer, outcome text, token bigint, attempt integer, lease_expires_at timestamptz, result jsonb,
               error text, first_seen timestamptz, expires_at timestamptz, lease_remaining interval, month date)
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan
AS %L$f$, schema,
        E'\n#variable_conflict use_column\nBEGIN\n    RETURN QUERY\n'
        || regexp_replace(v_stmt, '\mclaim_batch\.', 'claim_locked.', 'g')
        || E';\nEND\n');
END
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.citus_claim_locked_definition(text) FROM PUBLIC;
COMMENT ON FUNCTION idem.citus_claim_locked_definition(text) IS 'The definition of <schema>.claim_locked (on Citus, each shard''s, made by idem.citus_shard_claims on the shard''s tables): idem.claim_batch''s statement that answers its locked keys, cut out between its -- <claim_locked> and -- </claim_locked> comments, its variables made parameters; NULL when the markers are not there once each or the statement names a variable that is not a parameter.';

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.citus_shard_claims() RETURNS SETOF text
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
    v_stmt   text;
    v_bad    text;
    v_locked_args constant text := 'text, text[], text[], text[], integer[], timestamp with time zone, date, date, date, interval, interval, boolean, boolean, bigint';
    s        record;
BEGIN
    IF NOT idem.distributed() THEN
        RETURN;
    END IF;
    -- (migration 30) idem.citus_claim_batch counts its node's duplicates
    -- itself, so it runs with idem.citus on (idem.claim_weight: the secret
    -- that signs its sampled minute is not on the workers), as the copies
    -- do. Set here, on Citus only, not in its CREATE FUNCTION: there
    -- PostgreSQL 15 refuses a custom parameter to a migrator that is not
    -- a superuser ("permission denied to set parameter", on every
    -- installation, single nodes included), and a single node never calls
    -- it.
    IF NOT EXISTS (SELECT 1 FROM pg_proc p
                    WHERE p.oid = 'idem.citus_claim_batch(text, text, text[], text[], interval, interval, text[], interval)'::regprocedure
                      AND 'idem.citus=on' = ANY (p.proconfig)) THEN
        ALTER FUNCTION idem.citus_claim_batch(text, text, text[], text[], interval, interval, text[], interval) SET idem.citus = on;
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
            v_ref := idem.citus_on_shard(v_ref, s.shardid, s.holds_shard);
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
    -- (migration 30) idem_shard_<shard>.claim_locked: the one statement
    -- of idem.claim_batch that answers its locked keys (its probe of their
    -- rows, the insert of the new ones, the answer from the current
    -- month), cut out of idem.claim_batch's own definition between its
    -- claim_locked markers (idem.citus_claim_locked_definition) and put on
    -- the shard's tables, its variables made parameters.
    -- idem.citus_claim_batch calls it for each shard of a node's keys
    -- after taking all their locks, once it has read the policy and the
    -- window for all of them. Made again when idem.claim_batch changed.
    -- When the statement cannot be cut (its markers gone, or it names a
    -- variable that is not a parameter), none is made (and those of an
    -- older definition are dropped), and this says so:
    -- idem.citus_claim_batch then claims each shard's keys with the
    -- shard's copy of idem.claim_batch (the same answers, more slowly).
    v_sum := md5(pg_get_functiondef('idem.claim_batch(text, text[], text[], interval, interval, text[], interval)'::regprocedure));
    v_stmt := idem.citus_claim_locked_definition('idem');
    IF v_stmt IS NULL THEN
        RETURN NEXT 'made no claim_locked: idem.claim_batch has no statement between its -- <claim_locked> and -- </claim_locked> comments that names only claim_locked''s parameters; batches claim through the shards'' copies of claim_batch';
    END IF;
    FOR s IN SELECT pe.shardid, h.shardid AS holds_shard
               FROM pg_dist_shard pe
               JOIN pg_dist_shard h ON h.logicalrelid = 'idem.holds'::regclass AND h.shardminvalue = pe.shardminvalue
              WHERE pe.logicalrelid = 'idem.processed_events'::regclass
              ORDER BY pe.shardid LOOP
        v_schema := 'idem_shard_' || s.shardid;
        v_fn := v_schema || '.claim_locked(' || v_locked_args || ')';
        -- A claim_locked with other parameters, or any when none is made.
        FOR v_bad IN SELECT p.oid::regprocedure::text FROM pg_proc p
                      WHERE p.pronamespace = to_regnamespace(v_schema) AND p.proname = 'claim_locked'
                        AND (v_stmt IS NULL OR p.oid IS DISTINCT FROM to_regprocedure(v_fn)) LOOP
            EXECUTE format('DROP FUNCTION %s', v_bad);
        END LOOP;
        CONTINUE WHEN v_stmt IS NULL;
        CONTINUE WHEN to_regprocedure(v_fn) IS NOT NULL
                  AND obj_description(to_regprocedure(v_fn), 'pg_proc') = 'idem: claim_locked ' || v_sum;
        EXECUTE format('CREATE SCHEMA IF NOT EXISTS %I', v_schema);
        EXECUTE idem.citus_on_shard(idem.citus_claim_locked_definition(v_schema), s.shardid, s.holds_shard);
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', v_fn);
        EXECUTE format('COMMENT ON FUNCTION %s IS %L', v_fn, 'idem: claim_locked ' || v_sum);
        v_made := v_made + 1;
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
        RETURN NEXT format('made %s copies of claim, claim_batch and claim_locked on the shards (schemas idem_shard_<shard>)', v_made);
    END IF;
    IF v_gone > 0 THEN
        RETURN NEXT format('dropped the copies of %s shards that are gone', v_gone);
    END IF;
END
$$;
-- +goose StatementEnd
COMMENT ON FUNCTION idem.citus_shard_claims() IS 'On Citus (run by idem.citus_setup): for each shard of idem.processed_events, idem_shard_<shard>.claim_general and .claim_batch, idem.claim_general''s and idem.claim_batch''s definitions on that shard''s tables, and .claim_locked, idem.claim_batch''s statement that answers its locked keys, made again when they changed; the schemas of shards that are gone are dropped; idem.citus_claim_batch set to run with idem.citus on.';

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.citus_claim_batch(key text, source text, keys text[], fingerprints text[] DEFAULT NULL::text[], ttl interval DEFAULT NULL::interval, lease interval DEFAULT NULL::interval, event_types text[] DEFAULT NULL::text[], lock_wait interval DEFAULT NULL::interval)
RETURNS TABLE(ord integer, outcome text, token bigint, attempt integer, lease_expires_at timestamp with time zone, result jsonb, error text, first_seen timestamp with time zone, expires_at timestamp with time zone, lease_remaining interval)
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    -- (On Citus, idem.citus_shard_claims() adds SET idem.citus = on, for
    -- idem.claim_weight when it counts duplicates.)
AS $$
#variable_conflict use_column
DECLARE
    v_iso      text := current_setting('transaction_isolation');
    v_until    timestamptz := clock_timestamp() + coalesce(citus_claim_batch.lock_wait, interval '5 seconds');
    v_n        integer := cardinality(citus_claim_batch.keys);
    v_copy     text;
    g          record;
    r          record;
    v_i        integer;
    -- The node's path (below): the distinct keys' first positions in lock
    -- order, their lock keys and shards; what idem.claim_batch keeps.
    v_ords     integer[];
    v_hashes   integer[];
    v_shards   bigint[];
    v_firsts   integer[];
    v_nfirst   integer;
    v_away     integer;
    v_nocore   integer;
    v_locked   integer[] := '{}';
    v_from     integer;
    v_busy     integer;
    v_now      timestamptz;
    v_cur      date;
    v_ttl      interval;
    v_lease    interval;
    v_max      integer;
    v_sample   integer;
    v_per_key  boolean;
    v_lookback interval;
    v_need     interval;
    v_lo       date;
    v_hi       date;
    v_adopting boolean;
    v_base     bigint;
    v_acq      integer := 0;
    v_dups     integer := 0;
    v_weight   integer;
    v_slow     integer[];
    a_ord      integer[] := '{}';
    f_ord      integer[];
    f_month    date[];
    c          record;
    v_month    date;               -- the month of the row an answer was read from
BEGIN
    IF v_n IS NULL OR v_n > 1000 OR citus_claim_batch.key IS NULL OR NOT (citus_claim_batch.key = ANY (citus_claim_batch.keys)) THEN
        -- The batch's own checks name the problem (ID009 over 1000).
        PERFORM idem.check_batch('idem.claim_batch', citus_claim_batch.source, v_n, citus_claim_batch.keys);
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'idem.citus_claim_batch: key must be one of keys (it routes the call to the node holding them)';
    END IF;

    -- (migration 30) The node's keys as one batch: in READ COMMITTED, with
    -- good input and every shard's claim_locked made, this call does once
    -- for all of them what idem.claim_batch does once for its batch (the
    -- policy, the locks, the window, the counting), and runs per shard
    -- only the statement that answers the shard's locked keys
    -- (idem_shard_<shard>.claim_locked, idem.claim_batch's own statement
    -- on the shard's tables). It goes to its locks at once, as
    -- idem.claim_batch does for a batch whose first key has no final
    -- answer; a key with a final answer is answered from its row under
    -- its lock, as there. The rest (SERIALIZABLE; a read-only
    -- transaction, whose redelivered batch idem.claim_batch answers
    -- without a write, where this path's insert statement is refused; bad
    -- input that the batch names; a shard without claim_locked) goes shard
    -- by shard through the shards' copies of idem.claim_batch, below.
    IF v_iso = 'read committed' AND current_setting('transaction_read_only') = 'off'
       AND NOT (citus_claim_batch.source IS NULL OR octet_length(citus_claim_batch.source) NOT BETWEEN 1 AND 64
       OR btrim(citus_claim_batch.source, E' \t\r\n') = '' OR citus_claim_batch.source ~ '[\x01-\x1f\x7f]'
       OR v_n NOT BETWEEN 1 AND 1000
       OR array_ndims(citus_claim_batch.keys) <> 1 OR array_lower(citus_claim_batch.keys, 1) <> 1
       OR (citus_claim_batch.fingerprints IS NOT NULL AND (array_ndims(citus_claim_batch.fingerprints) <> 1
           OR array_lower(citus_claim_batch.fingerprints, 1) <> 1 OR cardinality(citus_claim_batch.fingerprints) <> v_n))
       OR (citus_claim_batch.event_types IS NOT NULL AND (array_ndims(citus_claim_batch.event_types) <> 1
           OR array_lower(citus_claim_batch.event_types, 1) <> 1 OR cardinality(citus_claim_batch.event_types) <> v_n))
       OR EXISTS (SELECT 1 FROM unnest(citus_claim_batch.keys, citus_claim_batch.fingerprints, citus_claim_batch.event_types) x(k, f, t)
                   WHERE x.k IS NULL OR octet_length(x.k) NOT BETWEEN 1 AND 512 OR btrim(x.k, E' \t\r\n') = ''
                      OR octet_length(x.f) > 512 OR octet_length(x.t) > 256)
       OR (citus_claim_batch.ttl IS NOT NULL AND NOT idem.valid_ttl(citus_claim_batch.ttl))
       OR (citus_claim_batch.lease IS NOT NULL AND NOT idem.valid_lease(citus_claim_batch.lease))
       OR (citus_claim_batch.lock_wait IS NOT NULL AND NOT (citus_claim_batch.lock_wait >= interval '0' AND citus_claim_batch.lock_wait <= interval '1 hour'))) THEN
        -- The distinct keys (each at its first position) in the node's
        -- global lock order: by shard, then lock key, then position (every
        -- batch on this node, this path's or the copies', locks in it).
        SELECT array_agg(d.o), array_agg(d.o ORDER BY d.s, d.h, d.o), array_agg(d.h ORDER BY d.s, d.h, d.o),
               array_agg(d.s ORDER BY d.s, d.h, d.o)
          INTO v_firsts, v_ords, v_hashes, v_shards
          FROM (SELECT min(u.o)::integer AS o, hashtext(citus_claim_batch.source || chr(31) || u.k) AS h,
                       get_shard_id_for_distribution_column('idem.processed_events', u.k) AS s
                  FROM unnest(citus_claim_batch.keys) WITH ORDINALITY u(k, o)
                 GROUP BY u.k) d;
        v_nfirst := cardinality(v_firsts);
        SELECT count(*) FILTER (WHERE NOT EXISTS (SELECT 1 FROM pg_dist_placement p, pg_dist_local_group l
                                                   WHERE p.groupid = l.groupid AND p.shardid = x.s)),
               count(*) FILTER (WHERE to_regprocedure('idem_shard_' || x.s || '.claim_locked(text, text[], text[], text[], integer[], timestamp with time zone, date, date, date, interval, interval, boolean, boolean, bigint)') IS NULL)
          INTO v_away, v_nocore
          FROM (SELECT DISTINCT y.s FROM unnest(v_shards) y(s)) x;
        IF v_away > 0 THEN
            RAISE EXCEPTION USING ERRCODE = 'ID005',
                MESSAGE = 'idem.citus_claim_batch ran on a node that does not hold the shard of some of its keys',
                DETAIL = 'On Citus the per-key lock is taken on the node that owns the key; group the keys with idem.citus_batch_routes.',
                HINT = 'Call it as SELECT ... FROM idem.citus_claim_batch($1, ...) with one of the group''s keys, as idem''s Go API does.';
        END IF;
    END IF;
    IF v_nocore = 0 THEN
        -- The source's policy (as idem.claim_batch reads it).
        SELECT x.ttl, x.lease, x.max_attempts, x.duplicate_sampling, x.count_per_key
          INTO v_ttl, v_lease, v_max, v_sample, v_per_key
          FROM (SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = citus_claim_batch.source
                UNION ALL
                SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = '*'
                 LIMIT 1) x;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = '42704',
                MESSAGE = format('idem.claim_batch: no policy for source %L and no default policy', citus_claim_batch.source),
                HINT = 'Insert a row for the source, or the default row with source ''*'', into idem.policies.';
        END IF;
        v_ttl := coalesce(citus_claim_batch.ttl, v_ttl);
        v_lease := coalesce(citus_claim_batch.lease, v_lease);
        IF v_lease > v_ttl THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim_batch: lease %s is longer than ttl %s', v_lease, v_ttl);
        END IF;

        -- Each key's lock in that order, as idem.claim_batch takes them:
        -- one statement tries them in order and stops at the first that
        -- another open transaction holds; that key is answered by
        -- idem.claim at once (from what is committed when that is final,
        -- or after waiting for the lock until the batch's deadline), and
        -- the statement goes on after it.
        v_from := 1;
        WHILE v_from <= coalesce(cardinality(v_ords), 0) LOOP
            SELECT v_from + u.i::integer - 1 INTO v_busy
              FROM unnest(v_hashes[v_from:]) WITH ORDINALITY u(h, i)
             WHERE NOT pg_try_advisory_xact_lock(1768187245, u.h)
             LIMIT 1;
            IF v_busy IS NULL THEN
                v_locked := v_locked || v_ords[v_from:];
                EXIT;
            END IF;
            v_locked := v_locked || v_ords[v_from:v_busy - 1];
            SELECT * INTO c FROM idem.claim(citus_claim_batch.source, citus_claim_batch.keys[v_ords[v_busy]],
                                            citus_claim_batch.fingerprints[v_ords[v_busy]],
                                            citus_claim_batch.ttl, citus_claim_batch.lease, citus_claim_batch.event_types[v_ords[v_busy]],
                                            greatest(v_until - clock_timestamp(), interval '0'));
            ord := v_ords[v_busy]; outcome := c.outcome; token := c.token; attempt := c.attempt;
            lease_expires_at := c.lease_expires_at; result := c.result; error := c.error;
            first_seen := c.first_seen; expires_at := c.expires_at; lease_remaining := c.lease_remaining;
            RETURN NEXT;
            v_from := v_busy + 1;
        END LOOP;

        IF cardinality(v_locked) > 0 THEN
            -- The window, read under the keys' locks (as idem.claim_batch).
            SELECT max(l.lookback) INTO v_lookback FROM idem.lookbacks l WHERE l.source IN (citus_claim_batch.source, '*');
            v_now := idem.clock();
            v_need := idem.days_at_most(greatest(v_ttl, v_lease));
            IF v_need > v_lookback THEN
                v_lookback := idem.raise_lookback(citus_claim_batch.source, v_need);
            END IF;
            v_lo := idem.window_start(v_now, v_lookback);
            v_hi := idem.utc_month(v_now + interval '1 day');
            v_cur := idem.utc_month(v_now);
            v_adopting := EXISTS (SELECT 1 FROM idem.adoptions a WHERE a.source = citus_claim_batch.source AND a.state = 'copying');
            v_base := idem.new_token();
            -- Each shard's locked keys by the shard's claim_locked, shard
            -- after shard (all the node's locks are held already), each
            -- answer straight into the answer's columns, as idem.claim_batch
            -- reads its statement (claim_locked's columns are its loop's).
            -- Holds are looked for (v_holds), as the copies look for them.
            FOR g IN SELECT x.s AS shard, array_agg(x.o ORDER BY x.i) AS ords
                       FROM unnest(v_shards, v_ords) WITH ORDINALITY x(s, o, i)
                      WHERE x.o = ANY (v_locked)
                      GROUP BY x.s ORDER BY x.s LOOP
                FOR ord, outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining, v_month IN
                    EXECUTE format('SELECT * FROM idem_shard_%s.claim_locked($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)', g.shard)
                      USING citus_claim_batch.source, citus_claim_batch.keys, citus_claim_batch.fingerprints,
                            citus_claim_batch.event_types, g.ords, v_now, v_lo, v_hi, v_cur, v_ttl, v_lease,
                            v_adopting, true, v_base LOOP
                    RETURN NEXT;
                    a_ord := a_ord || ord;
                    IF outcome = 'acquired' THEN
                        v_acq := v_acq + 1;
                    ELSIF v_month IS NOT NULL THEN
                        v_dups := v_dups + 1;
                        IF v_per_key THEN
                            f_ord := f_ord || ord;
                            f_month := f_month || v_month;
                        END IF;
                    END IF;
                END LOOP;
            END LOOP;
        END IF;

        -- Counting, as idem.claim_batch counts, the node's keys as one
        -- batch.
        IF v_sample > 0 THEN
            IF v_acq > 0 THEN
                PERFORM idem.count_activity(citus_claim_batch.source, v_now, v_acq, 0);
            END IF;
            IF v_dups > 0 AND NOT v_per_key THEN
                v_weight := idem.claim_weight(citus_claim_batch.source, v_sample, v_now);
                IF v_weight > 0 THEN
                    PERFORM idem.count_duplicate(citus_claim_batch.source, NULL, NULL, v_dups * v_weight, false, v_now);
                END IF;
            ELSIF v_dups > 0 THEN
                PERFORM idem.count_duplicate(citus_claim_batch.source, citus_claim_batch.keys[x.o], x.month, v_sample, true, v_now)
                   FROM unnest(f_ord, f_month) x(o, month)
                  WHERE v_sample = 1 OR random() * v_sample < 1;
            END IF;
        END IF;

        -- The rest, by idem.claim (each key's lock is this transaction's
        -- already).
        IF coalesce(cardinality(a_ord), 0) < cardinality(v_locked) THEN
            SELECT array_agg(l.o ORDER BY l.o) INTO v_slow
              FROM unnest(v_locked) l(o) WHERE l.o <> ALL (coalesce(a_ord, '{}'));
            FOREACH v_i IN ARRAY v_slow LOOP
                SELECT * INTO c FROM idem.claim(citus_claim_batch.source, citus_claim_batch.keys[v_i], citus_claim_batch.fingerprints[v_i],
                                                citus_claim_batch.ttl, citus_claim_batch.lease, citus_claim_batch.event_types[v_i],
                                                greatest(v_until - clock_timestamp(), interval '0'));
                ord := v_i; outcome := c.outcome; token := c.token; attempt := c.attempt;
                lease_expires_at := c.lease_expires_at; result := c.result; error := c.error;
                first_seen := c.first_seen; expires_at := c.expires_at; lease_remaining := c.lease_remaining;
                RETURN NEXT;
            END LOOP;
        END IF;

        -- A key repeated in the batch: a duplicate of its first position,
        -- answered by idem.claim after it.
        IF v_nfirst < v_n THEN
            FOR v_i IN SELECT u.o FROM generate_subscripts(citus_claim_batch.keys, 1) u(o)
                        WHERE u.o <> ALL (v_firsts) ORDER BY u.o LOOP
                SELECT * INTO c FROM idem.claim(citus_claim_batch.source, citus_claim_batch.keys[v_i], citus_claim_batch.fingerprints[v_i],
                                                citus_claim_batch.ttl, citus_claim_batch.lease, citus_claim_batch.event_types[v_i],
                                                greatest(v_until - clock_timestamp(), interval '0'));
                ord := v_i; outcome := c.outcome; token := c.token; attempt := c.attempt;
                lease_expires_at := c.lease_expires_at; result := c.result; error := c.error;
                first_seen := c.first_seen; expires_at := c.expires_at; lease_remaining := c.lease_remaining;
                RETURN NEXT;
            END LOOP;
        END IF;
        RETURN;
    END IF;

    -- Otherwise each shard's keys (on this node: every shard must be), shard after
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
COMMENT ON FUNCTION idem.citus_claim_batch(text, text, text[], text[], interval, interval, text[], interval) IS 'On Citus: idem.claim_batch of the keys of one node, delegated there by key (one of them): in READ COMMITTED the node''s keys as one batch, each shard''s locked keys answered by the shard''s claim_locked; otherwise each shard''s keys by the shard''s copy of idem.claim_batch, shard after shard.';

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.citus_batch_routes(keys text[])
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
    -- key is delegated to that node. (migration 30) Each key's shard is
    -- computed once, then joined: in the join's condition it was computed
    -- again for every placement of every table (a batch of 100 keys cost
    -- the coordinator about 10 ms with 233 placements).
    RETURN QUERY
    WITH k AS MATERIALIZED (
        SELECT u.k, u.o, get_shard_id_for_distribution_column('idem.processed_events', u.k) AS s
          FROM unnest(citus_batch_routes.keys) WITH ORDINALITY u(k, o))
    SELECT min(k.k), array_agg(k.o::integer ORDER BY k.o)
      FROM k JOIN pg_dist_placement p ON p.shardid = k.s
     GROUP BY p.groupid
     ORDER BY p.groupid;
END
$$;
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
    v_fn regprocedure;
BEGIN
    FOR v_fn IN SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) p.pronamespace
                 WHERE n.nspname OPERATOR(pg_catalog.~) '^idem_shard_[0-9]+$' AND p.proname OPERATOR(pg_catalog.=) 'claim_locked' LOOP
        EXECUTE pg_catalog.format('DROP FUNCTION %s', v_fn);
    END LOOP;
END
$$;
-- +goose StatementEnd
DROP FUNCTION idem.citus_claim_locked_definition(text);
-- idem.citus_shard_claims, idem.citus_claim_batch and idem.citus_batch_routes as migration 28 made them.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.citus_shard_claims() RETURNS SETOF text
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
COMMENT ON FUNCTION idem.citus_shard_claims() IS 'On Citus (run by idem.citus_setup): for each shard of idem.processed_events, idem_shard_<shard>.claim_general and .claim_batch, idem.claim_general''s and idem.claim_batch''s definitions on that shard''s tables, made again when they changed; the schemas of shards that are gone are dropped.';

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.citus_claim_batch(key text, source text, keys text[], fingerprints text[] DEFAULT NULL::text[], ttl interval DEFAULT NULL::interval, lease interval DEFAULT NULL::interval, event_types text[] DEFAULT NULL::text[], lock_wait interval DEFAULT NULL::interval)
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
COMMENT ON FUNCTION idem.citus_claim_batch(text, text, text[], text[], interval, interval, text[], interval) IS 'On Citus: idem.claim_batch of the keys of one node, delegated there by key (one of them): each shard''s keys by the shard''s copy of idem.claim_batch, shard after shard.';
DROP FUNCTION idem.citus_on_shard(text, bigint, bigint);

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.citus_batch_routes(keys text[])
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

-- +goose StatementBegin
DO $$
BEGIN
    IF idem.distributed() THEN
        PERFORM idem.citus_setup();
    END IF;
END
$$;
-- +goose StatementEnd
