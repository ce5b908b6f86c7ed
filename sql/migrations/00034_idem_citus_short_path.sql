-- idem 34 (Citus): a delegated claim answered by the short path on its
-- shard; Citus' serialization failure at commit is retryable in Go.
--
-- On Citus idem.claim always called idem.claim_general, whose copy on the
-- key's shard (migration 28) ran the whole protocol: the policy and
-- lookback read (a union and an aggregate), the adoption and hold checks,
-- behind two plpgsql calls (idem.claim, idem.claim_general) and the copy's.
-- Migration 27's short path (one row of idem.claim_settings, then the
-- probe and the insert) was for single nodes only: the workers keep no
-- idem.claim_settings. A delegated claim cost 3-6 times a local one
-- (docs/citus.md, "Where a delegated claim's time goes"). Now:
--
-- * idem.claim: the same claim, its Citus part moved into one block at its
--   start between the comments "-- <citus_dispatch>" and
--   "-- </citus_dispatch>": on Citus, the short path's copy on the key's
--   shard, by idem.citus_claim_local (one expression, no EXECUTE); a key
--   not on this node (ID005) or a shard without a copy, idem.claim_general
--   as before.
--   Its read of idem.claim_settings stands between "-- <claim_settings>"
--   and "-- </claim_settings>". A SERIALIZABLE claim's placeholders are
--   not written on Citus (as idem.claim_general). On a single node the
--   statements run are the same.
-- * idem.citus_claim_short_definition(schema, general): idem.claim's own
--   definition (pg_get_functiondef) as <schema>.claim, without the Citus
--   block, its idem.claim_general calls to <general>, and in place of the
--   claim_settings block the same settings read from the tables they are
--   derived from (the source's policy or '*', the larger lookback, an
--   adoption in progress; every source looks for a hold: holds are
--   distributed, so no node knows which sources have them), as
--   idem.claim_general reads them: a change of a policy, a lookback or
--   an adoption is seen by the very next claim, as before. NULL when a
--   block is not there once each. So the short path has one
--   implementation.
-- * idem.citus_shard_claims() makes idem_shard_<shard>.claim from it on the
--   shard's tables (idem.citus_on_shard) for every shard, again when
--   idem.claim or the cut changed (their md5 in its comment); says so when
--   none can be made. The copy has no SET clause and is not SECURITY
--   DEFINER: it runs with idem.claim's settings and owner (each SET cost
--   a claim 0.06-0.1 ms of a worker's CPU).
-- * idem.citus_claim_local(claim's arguments), made by
--   idem.citus_shard_claims from idem.citus_claim_local_definition(shards)
--   (a stub here, for a single node): when the key's shard is placed on
--   this node and has a copy, the copy's answer, by a branch per shard
--   that calls it as one plpgsql expression; else no outcome.
--
-- Tests: migrate.TestClaimShortCut (the copy answers every state as
-- idem.claim does, sees policy changes and adoptions, on a single node),
-- migrate.TestUpgradeToCitusShort, migrate.TestUpgradeFrom32EveryState
-- (keys in every state answer the same after the upgrade),
-- citustest.TestCitusShortPath (claims on Citus run the short path's
-- copies; a policy change and a hold are seen by the next claim),
-- citustest.TestCitusShardClaims.
-- Down restores migration 32's idem.claim and migration 30's
-- idem.citus_shard_claims, drops the copies and the new functions.

-- +goose Up

-- +goose StatementBegin
CREATE FUNCTION idem.citus_claim_local_definition(shards bigint[]) RETURNS text
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
AS $def$
DECLARE
    v_calls text;
BEGIN
    -- One branch per shard with a copy, each calling it as one expression
    -- (a plpgsql simple expression: evaluated without a statement's
    -- planning or executor, unlike an EXECUTE of the copy's name).
    SELECT string_agg(format(E'    %s v_shard OPERATOR(pg_catalog.=) %s THEN\n        r := idem_shard_%s.claim(citus_claim_local.source, citus_claim_local.key, citus_claim_local.fingerprint, citus_claim_local.ttl, citus_claim_local.lease, citus_claim_local.event_type, citus_claim_local.lock_wait);\n',
                             CASE WHEN o = 1 THEN 'IF' ELSE 'ELSIF' END, s, s), '' ORDER BY o)
      INTO v_calls FROM unnest(shards) WITH ORDINALITY u(s, o);
    RETURN $f$CREATE OR REPLACE FUNCTION idem.citus_claim_local(source text, key text, fingerprint text, ttl interval, lease interval, event_type text, lock_wait interval, OUT outcome text, OUT token bigint, OUT attempt integer, OUT lease_expires_at timestamp with time zone, OUT result jsonb, OUT error text, OUT first_seen timestamp with time zone, OUT expires_at timestamp with time zone, OUT lease_remaining interval)
 RETURNS record
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $body$
DECLARE
    v_shard bigint;
    r       record;
BEGIN
    -- (Made by idem.citus_shard_claims, migration 34.) On Citus, for
    -- idem.claim: the claim by the short path's copy on the key's shard
    -- when the shard is placed on this node and has one, else no outcome
    -- (idem.claim then calls idem.claim_general, which refuses a key of
    -- another node with ID005). Called by idem.claim only (its owner).
    -- (Citus refuses a NULL distribution value: idem.claim_general names
    -- the bad input.)
    IF citus_claim_local.key IS NULL THEN
        RETURN;
    END IF;
    v_shard := pg_catalog.get_shard_id_for_distribution_column('idem.processed_events', citus_claim_local.key);
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_placement p, pg_catalog.pg_dist_local_group g
                    WHERE p.groupid OPERATOR(pg_catalog.=) g.groupid AND p.shardid OPERATOR(pg_catalog.=) v_shard)
       OR pg_catalog.to_regproc('idem_shard_' OPERATOR(pg_catalog.||) v_shard::pg_catalog.text OPERATOR(pg_catalog.||) '.claim') IS NULL THEN
        RETURN;
    END IF;
$f$ || CASE WHEN v_calls IS NULL THEN E'    RETURN;\n' ELSE v_calls || E'    ELSE\n        RETURN;\n    END IF;\n' END || $f$    outcome := r.outcome; token := r.token; attempt := r.attempt; lease_expires_at := r.lease_expires_at;
    result := r.result; error := r.error; first_seen := r.first_seen; expires_at := r.expires_at;
    lease_remaining := r.lease_remaining;
END
$body$$f$;
END
$def$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.citus_claim_local_definition(bigint[]) FROM PUBLIC;
COMMENT ON FUNCTION idem.citus_claim_local_definition(bigint[]) IS 'The definition of idem.citus_claim_local with a branch for each given shard (idem.citus_shard_claims makes it with the shards that have a copy of the short path).';

-- A node with no shard's copy (a single node; on Citus idem.citus_shard_claims makes it again).
-- +goose StatementBegin
DO $$
BEGIN
    EXECUTE idem.citus_claim_local_definition('{}');
END
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.citus_claim_local(text, text, text, interval, interval, text, interval) FROM PUBLIC;
COMMENT ON FUNCTION idem.citus_claim_local(text, text, text, interval, interval, text, interval) IS 'On Citus, for idem.claim on the node it runs on: the claim by the short path''s copy on the key''s shard (idem_shard_<shard>.claim) when the shard is placed here and has one, else no outcome. Made by idem.citus_shard_claims (idem.citus_claim_local_definition).';

-- +goose StatementBegin
CREATE FUNCTION idem.citus_claim_short_definition(schema text, general text) RETURNS text
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_def   text := pg_get_functiondef('idem.claim(text, text, text, interval, interval, text, interval)'::regprocedure);
    -- What the short path reads of idem.claim_settings, from the tables
    -- idem.claim_settings_refresh derives it from, as idem.claim_general
    -- reads them (after the key's lock, with its own snapshot): the
    -- source's policy or else '*''s, the larger of its and '*''s lookback
    -- (none: no row, idem.claim_general), an adoption in progress. Holds:
    -- always looked for (one probe of the key's shard).
    v_settings constant text := $s$SELECT x.ttl, x.lease, x.duplicate_sampling, x.count_per_key, x.lookback, true AS holds,
           EXISTS (SELECT FROM idem.adoptions a WHERE a.source = claim.source AND a.state = 'copying') AS adopting
      INTO s
      FROM (SELECT p.ttl, p.lease, p.duplicate_sampling, p.count_per_key,
                   (SELECT max(l.lookback) FROM idem.lookbacks l WHERE l.source IN (claim.source, '*')) AS lookback
              FROM idem.policies p WHERE p.source IN (claim.source, '*')
             ORDER BY p.source = '*' LIMIT 1) x
     WHERE x.lookback IS NOT NULL;
$s$;
    b       record;
    v_from  integer;
    v_to    integer;
BEGIN
    -- Each block: the lines from its opening comment to its closing one,
    -- each there once, in that order (a body keeps its comments).
    FOR b IN SELECT * FROM (VALUES ('citus_dispatch', ''), ('claim_settings', v_settings)) v(name, repl) LOOP
        v_from := strpos(v_def, '-- <' || b.name || E'>\n');
        v_to := strpos(v_def, '-- </' || b.name || E'>\n');
        IF v_from = 0 OR v_to < v_from
           OR strpos(substr(v_def, v_from + 1), '-- <' || b.name || E'>\n') > 0
           OR strpos(substr(v_def, v_to + 1), '-- </' || b.name || E'>\n') > 0 THEN
            RETURN NULL;
        END IF;
        v_def := substr(v_def, 1, v_from - 1) || b.repl || substr(v_def, v_to + length('-- </' || b.name || E'>\n'));
    END LOOP;
    -- Nothing of the dispatch or of idem.claim_settings may be left.
    IF v_def ~ 'citus_claim_local|claim_settings_refresh|\mFROM\s+idem\.claim_settings\M' THEN
        RETURN NULL;
    END IF;
    v_def := replace(v_def, 'idem.claim_general(', general || '(');
    RETURN regexp_replace(v_def, '^CREATE OR REPLACE FUNCTION idem\.claim\(',
                          'CREATE OR REPLACE FUNCTION ' || quote_ident(schema) || '.claim(');
END
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.citus_claim_short_definition(text, text) FROM PUBLIC;
COMMENT ON FUNCTION idem.citus_claim_short_definition(text, text) IS 'The definition of <schema>.claim (on Citus, each shard''s, made by idem.citus_shard_claims on the shard''s tables): idem.claim''s own definition without its -- <citus_dispatch> block, its -- <claim_settings> block reading the settings from idem.policies, idem.lookbacks and idem.adoptions (holds always looked for), its idem.claim_general calls to <general>; NULL when a block is not there once each.';

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.claim(source text, key text, fingerprint text DEFAULT NULL::text, ttl interval DEFAULT NULL::interval, lease interval DEFAULT NULL::interval, event_type text DEFAULT NULL::text, lock_wait interval DEFAULT NULL::interval, OUT outcome text, OUT token bigint, OUT attempt integer, OUT lease_expires_at timestamp with time zone, OUT result jsonb, OUT error text, OUT first_seen timestamp with time zone, OUT expires_at timestamp with time zone, OUT lease_remaining interval)
 RETURNS record
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
DECLARE
    v_iso      text := current_setting('transaction_isolation');
    v_now      timestamptz;
    s          record;
    r          record;
    v_weight   integer;
BEGIN
    -- <citus_dispatch>
    -- (migration 34) On Citus (idem.citus_setup sets idem.citus on this
    -- function; a session's own idem.citus is not Citus: without Citus'
    -- catalog it is ignored): the claim of the key's shard by this
    -- function's copy there (idem_shard_<shard>.claim, made by
    -- idem.citus_shard_claims from this definition: everything below on the
    -- shard's tables, what idem.claim_settings says read from this node's
    -- copies of the tables it is derived from), called by
    -- idem.citus_claim_local (one expression, no statement planned). A key
    -- whose shard is not on this node (refused there, ID005) or has no
    -- copy: no outcome, and idem.claim_general. The copy is made without
    -- this block.
    IF current_setting('idem.citus', true) IS NOT DISTINCT FROM 'on' AND to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        r := idem.citus_claim_local(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
        IF r.outcome IS NOT NULL THEN
            outcome := r.outcome; token := r.token; attempt := r.attempt; lease_expires_at := r.lease_expires_at;
            result := r.result; error := r.error; first_seen := r.first_seen; expires_at := r.expires_at;
            lease_remaining := r.lease_remaining;
            RETURN;
        END IF;
        SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
          FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
        RETURN;
    END IF;
    -- </citus_dispatch>
    -- The short path: the key's lock free, the source's row in
    -- idem.claim_settings (its policy, its lookback, and whether it has
    -- holds or an adoption in progress, kept by triggers in the same
    -- transaction as every change of them), and then one of the two
    -- common answers: a duplicate from its settled row, or a new key
    -- inserted. Everything else is idem.claim_general's, called before
    -- anything is written: bad input, REPEATABLE READ, another claim
    -- of the key in an open transaction, a lookback to raise, a lost lease
    -- or retryable failure to take over, a hold, an adoption in progress,
    -- an expired row of the key in the current month. A new key in a
    -- SERIALIZABLE transaction stays on it, with its placeholders.
    IF v_iso = 'repeatable read'
       OR claim.source IS NULL OR claim.key IS NULL
       OR octet_length(claim.source) NOT BETWEEN 1 AND 64 OR octet_length(claim.key) NOT BETWEEN 1 AND 512
       OR btrim(claim.source, E' \t\r\n') = '' OR btrim(claim.key, E' \t\r\n') = ''
       OR claim.source ~ '[\x01-\x1f\x7f]'
       OR octet_length(claim.fingerprint) > 512 OR octet_length(claim.event_type) > 256
       OR (claim.ttl IS NOT NULL AND NOT (claim.ttl >= interval '1 minute' AND claim.ttl <= interval '10 years'))
       OR (claim.lease IS NOT NULL AND NOT (claim.lease >= interval '1 second' AND claim.lease <= interval '7 days'))
       OR (claim.lock_wait IS NOT NULL AND NOT (claim.lock_wait >= interval '0' AND claim.lock_wait <= interval '1 hour'))
       OR NOT pg_try_advisory_xact_lock(1768187245, hashtext(claim.source || chr(31) || claim.key)) THEN
        SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
          FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
        RETURN;
    END IF;
    -- Read after the key's lock, as claim_general reads the tables it is
    -- made from: every raise of the lookback by a write of this key is in it.
    -- A source with no row of its own yet claims with the default's.
    -- (The shards' copies on Citus read what stands between these markers
    -- from the tables it is derived from: idem.citus_claim_short_definition.)
    -- <claim_settings>
    SELECT c.ttl, c.lease, c.duplicate_sampling, c.count_per_key, c.lookback, c.holds, c.adopting
      INTO s FROM idem.claim_settings c WHERE c.source = claim.source;
    IF NOT FOUND THEN
        SELECT c.ttl, c.lease, c.duplicate_sampling, c.count_per_key, c.lookback, false AS holds, false AS adopting
          INTO s FROM idem.claim_settings c WHERE c.source = '*';
        -- The source's own row, for its next claims (one lookup), written
        -- by a claim that can without waiting: one that holds the
        -- source's settings lock (class 1768187248) until it commits, so
        -- the others do not queue behind its uncommitted row.
        IF FOUND AND current_setting('transaction_read_only') = 'off'
           AND pg_try_advisory_xact_lock(1768187248, hashtext(claim.source)) THEN
            PERFORM idem.claim_settings_refresh(claim.source);
        END IF;
    END IF;
    -- </claim_settings>
    v_now := idem.clock();
    IF NOT FOUND OR s.adopting
       OR coalesce(claim.lease, s.lease) > coalesce(claim.ttl, s.ttl)
       OR NOT (idem.days_at_most(greatest(coalesce(claim.ttl, s.ttl), coalesce(claim.lease, s.lease))) <= s.lookback) THEN
        SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
          FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
        RETURN;
    END IF;
    SELECT e.first_seen_month, e.status, e.attempts, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at
      INTO r FROM idem.processed_events e
     WHERE e.source = claim.source AND e.key = claim.key
       AND e.first_seen_month >= idem.window_start(v_now, s.lookback)
       AND e.first_seen_month <= idem.utc_month(v_now + interval '1 day')
       AND e.expires_at > v_now
     LIMIT 1;
    IF FOUND THEN
        outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim.fingerprint, v_now);
        IF outcome IS NULL THEN
            SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
              FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
            RETURN;
        END IF;
        attempt          := r.attempts;
        lease_expires_at := CASE WHEN outcome IN ('in_progress', 'mismatch') THEN r.lease_expires_at END;
        result           := CASE WHEN outcome = 'completed' THEN r.result END;
        error            := CASE WHEN outcome IN ('failed', 'completed') THEN r.last_error END;
        first_seen       := r.first_seen;
        expires_at       := r.expires_at;
        lease_remaining  := CASE WHEN outcome = 'in_progress' THEN greatest(r.lease_expires_at - v_now, interval '0') END;
        IF s.duplicate_sampling > 0 AND v_iso <> 'serializable' THEN
            v_weight := idem.claim_weight(claim.source, s.duplicate_sampling, v_now);
            IF v_weight > 0 THEN
                PERFORM idem.count_duplicate(claim.source, claim.key, r.first_seen_month, v_weight, s.count_per_key, v_now);
            END IF;
        END IF;
        RETURN;
    END IF;
    IF s.holds AND EXISTS (SELECT FROM idem.holds h
                            WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued') THEN
        SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
          FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
        RETURN;
    END IF;
    -- SERIALIZABLE: the placeholders that meet a claim of this key
    -- committed into another month after this transaction's snapshot
    -- (idem.serializable_placeholders), as idem.claim_general writes them
    -- (not on Citus, as idem.claim_general: the copies run with idem.citus on).
    IF v_iso = 'serializable' AND (current_setting('idem.citus', true) IS DISTINCT FROM 'on' OR to_regclass('pg_catalog.pg_dist_partition') IS NULL) THEN
        PERFORM idem.serializable_placeholders(claim.source, claim.key, v_now,
                    idem.window_start(v_now, s.lookback), idem.utc_month(v_now + interval '1 day'));
    END IF;
    token := idem.new_token();
    INSERT INTO idem.processed_events AS e
           (source, key, first_seen_month, event_type, status, attempts, token,
            lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
    VALUES (claim.source, claim.key, idem.utc_month(v_now), claim.event_type,
            'processing', 1, token, v_now + coalesce(claim.lease, s.lease), claim.fingerprint, v_now, v_now,
            v_now + greatest(coalesce(claim.ttl, s.ttl), coalesce(claim.lease, s.lease)))
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        -- An expired row of the key in the current month.
        SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
          FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
        RETURN;
    END IF;
    outcome          := 'acquired';
    attempt          := 1;
    lease_remaining  := coalesce(claim.lease, s.lease);
    lease_expires_at := v_now + lease_remaining;
    first_seen       := v_now;
    expires_at       := v_now + greatest(coalesce(claim.ttl, s.ttl), lease_remaining);
    -- Not counted in SERIALIZABLE (as idem.claim_general): every claim
    -- writing the same counters would make SSI abort them.
    IF s.duplicate_sampling > 0 AND v_iso <> 'serializable' THEN
        v_weight := idem.claim_weight(claim.source, s.duplicate_sampling, v_now);
        IF v_weight > 0 THEN
            PERFORM idem.count_activity(claim.source, v_now, v_weight, 0);
        END IF;
    END IF;
END
$function$;
-- +goose StatementEnd

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
    -- (migration 34) idem_shard_<shard>.claim: idem.claim's own definition
    -- (its short path) without its Citus dispatch, what it reads from
    -- idem.claim_settings read from this node's copies of the tables that
    -- are derived into it, its idem.claim_general the shard's copy, on the
    -- shard's tables (idem.citus_claim_short_definition). idem.claim calls it
    -- on the node holding the key's shard. Made again when idem.claim (or
    -- the cut) changed; when it cannot be cut (a marker gone or there
    -- twice), none is made (and the old ones are dropped), and this says so:
    -- claims then go through the copies of idem.claim_general, as before.
    v_sum := md5(pg_get_functiondef('idem.claim(text, text, text, interval, interval, text, interval)'::regprocedure)
                 || pg_get_functiondef('idem.citus_claim_short_definition(text, text)'::regprocedure));
    v_stmt := idem.citus_claim_short_definition('idem', 'idem.claim_general');
    IF v_stmt IS NULL THEN
        RETURN NEXT 'made no copy of claim on the shards: idem.claim has not its -- <citus_dispatch> and -- <claim_settings> blocks once each; claims go through the shards'' copies of claim_general';
    END IF;
    FOR s IN SELECT pe.shardid, h.shardid AS holds_shard
               FROM pg_dist_shard pe
               JOIN pg_dist_shard h ON h.logicalrelid = 'idem.holds'::regclass AND h.shardminvalue = pe.shardminvalue
              WHERE pe.logicalrelid = 'idem.processed_events'::regclass
              ORDER BY pe.shardid LOOP
        v_schema := 'idem_shard_' || s.shardid;
        v_fn := v_schema || '.claim(text, text, text, interval, interval, text, interval)';
        IF v_stmt IS NULL THEN
            IF to_regprocedure(v_fn) IS NOT NULL THEN
                EXECUTE format('DROP FUNCTION %s', v_fn);
            END IF;
            CONTINUE;
        END IF;
        CONTINUE WHEN to_regprocedure(v_fn) IS NOT NULL
                  AND obj_description(to_regprocedure(v_fn), 'pg_proc') = 'idem: claim ' || v_sum;
        EXECUTE format('CREATE SCHEMA IF NOT EXISTS %I', v_schema);
        EXECUTE idem.citus_on_shard(idem.citus_claim_short_definition(v_schema, v_schema || '.claim_general'),
                                    s.shardid, s.holds_shard);
        -- Its owner's only, and called only by idem.citus_claim_local,
        -- called only by idem.claim, whose settings it runs with: idem.claim's
        -- search_path and idem.citus (on: idem.claim_weight, no
        -- SERIALIZABLE placeholders, as the copy of idem.claim_general),
        -- idem.citus_claim_local's plan_cache_mode (PostgreSQL's plans,
        -- cached), idem.claim's owner. So no SET clause and no SECURITY
        -- DEFINER of its own: each cost a claim about 0.06-0.1 ms of a
        -- worker's CPU (a changed search_path has every cached plan
        -- checked again).
        EXECUTE format('ALTER FUNCTION %s RESET ALL', v_fn);
        EXECUTE format('ALTER FUNCTION %s SECURITY INVOKER', v_fn);
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', v_fn);
        EXECUTE format('COMMENT ON FUNCTION %s IS %L', v_fn, 'idem: claim ' || v_sum);
        v_made := v_made + 1;
    END LOOP;
    -- idem.citus_claim_local, which calls them, with a branch for each
    -- shard that has one (none when none is made), made again when that
    -- changed (its definition's md5 in its comment).
    v_stmt := idem.citus_claim_local_definition(ARRAY(
        SELECT pe.shardid FROM pg_dist_shard pe
         WHERE pe.logicalrelid = 'idem.processed_events'::regclass
           AND to_regprocedure('idem_shard_' || pe.shardid || '.claim(text, text, text, interval, interval, text, interval)') IS NOT NULL
         ORDER BY pe.shardid));
    IF obj_description('idem.citus_claim_local(text, text, text, interval, interval, text, interval)'::regprocedure, 'pg_proc')
       IS DISTINCT FROM 'idem: citus_claim_local ' || md5(v_stmt) THEN
        EXECUTE v_stmt;
        EXECUTE format('COMMENT ON FUNCTION idem.citus_claim_local(text, text, text, interval, interval, text, interval) IS %L',
                       'idem: citus_claim_local ' || md5(v_stmt));
    END IF;
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
        RETURN NEXT format('made %s copies of claim, claim_general, claim_batch and claim_locked on the shards (schemas idem_shard_<shard>)', v_made);
    END IF;
    IF v_gone > 0 THEN
        RETURN NEXT format('dropped the copies of %s shards that are gone', v_gone);
    END IF;
END
$$;
-- +goose StatementEnd
COMMENT ON FUNCTION idem.citus_shard_claims() IS 'On Citus (run by idem.citus_setup): for each shard of idem.processed_events, idem_shard_<shard>.claim_general and .claim_batch, idem.claim_general''s and idem.claim_batch''s definitions on that shard''s tables, .claim_locked, idem.claim_batch''s statement that answers its locked keys, and .claim, idem.claim''s short path (idem.citus_claim_short_definition), made again when they changed; the schemas of shards that are gone are dropped; idem.citus_claim_batch set to run with idem.citus on.';

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
    v_fn text;
BEGIN
    FOR v_fn IN SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) p.pronamespace
                 WHERE n.nspname OPERATOR(pg_catalog.~) '^idem_shard_[0-9]+$' AND p.proname OPERATOR(pg_catalog.=) 'claim' LOOP
        EXECUTE pg_catalog.format('DROP FUNCTION %s', v_fn);
    END LOOP;
END
$$;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.claim(source text, key text, fingerprint text DEFAULT NULL::text, ttl interval DEFAULT NULL::interval, lease interval DEFAULT NULL::interval, event_type text DEFAULT NULL::text, lock_wait interval DEFAULT NULL::interval, OUT outcome text, OUT token bigint, OUT attempt integer, OUT lease_expires_at timestamp with time zone, OUT result jsonb, OUT error text, OUT first_seen timestamp with time zone, OUT expires_at timestamp with time zone, OUT lease_remaining interval)
 RETURNS record
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
DECLARE
    v_iso      text := current_setting('transaction_isolation');
    v_now      timestamptz;
    s          record;
    r          record;
    v_weight   integer;
BEGIN
    -- The short path: the key's lock free, the source's row in
    -- idem.claim_settings (its policy, its lookback, and whether it has
    -- holds or an adoption in progress, kept by triggers in the same
    -- transaction as every change of them), and then one of the two
    -- common answers: a duplicate from its settled row, or a new key
    -- inserted. Everything else is idem.claim_general's, called before
    -- anything is written: bad input, REPEATABLE READ, Citus, another claim
    -- of the key in an open transaction, a lookback to raise, a lost lease
    -- or retryable failure to take over, a hold, an adoption in progress,
    -- an expired row of the key in the current month. A new key in a
    -- SERIALIZABLE transaction stays on it, with its placeholders.
    IF v_iso = 'repeatable read'
       OR claim.source IS NULL OR claim.key IS NULL
       OR octet_length(claim.source) NOT BETWEEN 1 AND 64 OR octet_length(claim.key) NOT BETWEEN 1 AND 512
       OR btrim(claim.source, E' \t\r\n') = '' OR btrim(claim.key, E' \t\r\n') = ''
       OR claim.source ~ '[\x01-\x1f\x7f]'
       OR octet_length(claim.fingerprint) > 512 OR octet_length(claim.event_type) > 256
       OR (claim.ttl IS NOT NULL AND NOT (claim.ttl >= interval '1 minute' AND claim.ttl <= interval '10 years'))
       OR (claim.lease IS NOT NULL AND NOT (claim.lease >= interval '1 second' AND claim.lease <= interval '7 days'))
       OR (claim.lock_wait IS NOT NULL AND NOT (claim.lock_wait >= interval '0' AND claim.lock_wait <= interval '1 hour'))
       OR (current_setting('idem.citus', true) IS NOT DISTINCT FROM 'on' AND to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL)
       OR NOT pg_try_advisory_xact_lock(1768187245, hashtext(claim.source || chr(31) || claim.key)) THEN
        SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
          FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
        RETURN;
    END IF;
    -- Read after the key's lock, as claim_general reads the tables it is
    -- made from: every raise of the lookback by a write of this key is in it.
    -- A source with no row of its own yet claims with the default's.
    SELECT c.ttl, c.lease, c.duplicate_sampling, c.count_per_key, c.lookback, c.holds, c.adopting
      INTO s FROM idem.claim_settings c WHERE c.source = claim.source;
    IF NOT FOUND THEN
        SELECT c.ttl, c.lease, c.duplicate_sampling, c.count_per_key, c.lookback, false AS holds, false AS adopting
          INTO s FROM idem.claim_settings c WHERE c.source = '*';
        -- The source's own row, for its next claims (one lookup), written
        -- by a claim that can without waiting: one that holds the
        -- source's settings lock (class 1768187248) until it commits, so
        -- the others do not queue behind its uncommitted row.
        IF FOUND AND current_setting('transaction_read_only') = 'off'
           AND pg_try_advisory_xact_lock(1768187248, hashtext(claim.source)) THEN
            PERFORM idem.claim_settings_refresh(claim.source);
        END IF;
    END IF;
    v_now := idem.clock();
    IF NOT FOUND OR s.adopting
       OR coalesce(claim.lease, s.lease) > coalesce(claim.ttl, s.ttl)
       OR NOT (idem.days_at_most(greatest(coalesce(claim.ttl, s.ttl), coalesce(claim.lease, s.lease))) <= s.lookback) THEN
        SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
          FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
        RETURN;
    END IF;
    SELECT e.first_seen_month, e.status, e.attempts, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at
      INTO r FROM idem.processed_events e
     WHERE e.source = claim.source AND e.key = claim.key
       AND e.first_seen_month >= idem.window_start(v_now, s.lookback)
       AND e.first_seen_month <= idem.utc_month(v_now + interval '1 day')
       AND e.expires_at > v_now
     LIMIT 1;
    IF FOUND THEN
        outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim.fingerprint, v_now);
        IF outcome IS NULL THEN
            SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
              FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
            RETURN;
        END IF;
        attempt          := r.attempts;
        lease_expires_at := CASE WHEN outcome IN ('in_progress', 'mismatch') THEN r.lease_expires_at END;
        result           := CASE WHEN outcome = 'completed' THEN r.result END;
        error            := CASE WHEN outcome IN ('failed', 'completed') THEN r.last_error END;
        first_seen       := r.first_seen;
        expires_at       := r.expires_at;
        lease_remaining  := CASE WHEN outcome = 'in_progress' THEN greatest(r.lease_expires_at - v_now, interval '0') END;
        IF s.duplicate_sampling > 0 AND v_iso <> 'serializable' THEN
            v_weight := idem.claim_weight(claim.source, s.duplicate_sampling, v_now);
            IF v_weight > 0 THEN
                PERFORM idem.count_duplicate(claim.source, claim.key, r.first_seen_month, v_weight, s.count_per_key, v_now);
            END IF;
        END IF;
        RETURN;
    END IF;
    IF s.holds AND EXISTS (SELECT FROM idem.holds h
                            WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued') THEN
        SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
          FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
        RETURN;
    END IF;
    -- SERIALIZABLE: the placeholders that meet a claim of this key
    -- committed into another month after this transaction's snapshot
    -- (idem.serializable_placeholders), as idem.claim_general writes them.
    IF v_iso = 'serializable' THEN
        PERFORM idem.serializable_placeholders(claim.source, claim.key, v_now,
                    idem.window_start(v_now, s.lookback), idem.utc_month(v_now + interval '1 day'));
    END IF;
    token := idem.new_token();
    INSERT INTO idem.processed_events AS e
           (source, key, first_seen_month, event_type, status, attempts, token,
            lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
    VALUES (claim.source, claim.key, idem.utc_month(v_now), claim.event_type,
            'processing', 1, token, v_now + coalesce(claim.lease, s.lease), claim.fingerprint, v_now, v_now,
            v_now + greatest(coalesce(claim.ttl, s.ttl), coalesce(claim.lease, s.lease)))
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        -- An expired row of the key in the current month.
        SELECT * INTO outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining
          FROM idem.claim_general(claim.source, claim.key, claim.fingerprint, claim.ttl, claim.lease, claim.event_type, claim.lock_wait);
        RETURN;
    END IF;
    outcome          := 'acquired';
    attempt          := 1;
    lease_remaining  := coalesce(claim.lease, s.lease);
    lease_expires_at := v_now + lease_remaining;
    first_seen       := v_now;
    expires_at       := v_now + greatest(coalesce(claim.ttl, s.ttl), lease_remaining);
    -- Not counted in SERIALIZABLE (as idem.claim_general): every claim
    -- writing the same counters would make SSI abort them.
    IF s.duplicate_sampling > 0 AND v_iso <> 'serializable' THEN
        v_weight := idem.claim_weight(claim.source, s.duplicate_sampling, v_now);
        IF v_weight > 0 THEN
            PERFORM idem.count_activity(claim.source, v_now, v_weight, 0);
        END IF;
    END IF;
END
$function$;
-- +goose StatementEnd

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
DROP FUNCTION idem.citus_claim_short_definition(text, text);
DROP FUNCTION idem.citus_claim_local(text, text, text, interval, interval, text, interval);
DROP FUNCTION idem.citus_claim_local_definition(bigint[]);

-- +goose StatementBegin
DO $$
BEGIN
    IF idem.distributed() THEN
        PERFORM idem.citus_setup();
    END IF;
END
$$;
-- +goose StatementEnd
