-- idem 11: idem on Citus (issue 26): idemctl migrate up --citus, or
-- migrate.Citus, runs idem.citus_setup() on the coordinator after the
-- migrations. Nothing here changes a single-node installation's behaviour:
--
-- * idem.distributed(): whether idem.processed_events is a Citus
--   distributed table (false without Citus).
-- * idem.key_is_local(key): whether this node holds the shard of key's
--   rows (Citus only).
-- * idem.claim, version 11: where idem.citus_setup has set idem.citus on
--   it, a claim that runs on a node not holding the key's shard (not
--   delegated: its per-key advisory lock would not exclude the owning
--   node's claims) is refused with SQLSTATE ID005. Elsewhere one
--   current_setting more per claim.
-- * idem.complete_stored: complete returning the stored result, called as
--   one function (Do's completion; Citus can delegate it); grant_app,
--   version 11, grants it, and roles granted before get it.
-- * idem.prune_batch, version 11: on a distributed table, batches by
--   primary key (Citus plans neither ctid lists nor FOR UPDATE there).
-- * idem.months_to_create, version 11: plpgsql, the default partition's
--   months read first (Citus could not plan version 4's UNION).
-- * idem.citus_collect_counts() (Citus only) and
--   idem.compact_duplicate_counts, version 11: on a distributed
--   installation, compaction (run by every prune) first moves the
--   duplicate counts and activity the workers' claims wrote on their own
--   node into the coordinator's tables, which stats and the dashboard read.
-- * idem.citus_setup(): distributes idem's tables and functions (see its
--   comment and docs/citus.md); idempotent, safe to re-run, and re-run by
--   migrate after every migration on a distributed installation.
--
-- Down restores versions 10 and 7 and drops the new functions; it is
-- refused on a distributed installation.

-- +goose Up
-- +goose StatementBegin
CREATE FUNCTION idem.distributed() RETURNS boolean
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v boolean := false;
BEGIN
    IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        EXECUTE 'SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_partition
                                 WHERE logicalrelid = ''idem.processed_events''::regclass)' INTO v;
    END IF;
    RETURN v;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Citus only (its catalog): called by claim where idem.citus is on, which
-- pins search_path.
CREATE FUNCTION idem.key_is_local(key text) RETURNS boolean
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM pg_catalog.pg_dist_placement p, pg_catalog.pg_dist_local_group g
                    WHERE p.groupid = g.groupid
                      AND p.shardid = pg_catalog.get_shard_id_for_distribution_column('idem.processed_events', key_is_local.key));
END
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.distributed(), idem.key_is_local(text) FROM PUBLIC;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.claim(
    source      text,
    key         text,
    fingerprint text     DEFAULT NULL,
    ttl         interval DEFAULT NULL,
    lease       interval DEFAULT NULL,
    event_type  text     DEFAULT NULL,
    lock_wait   interval DEFAULT NULL,
    OUT outcome          text,
    OUT token            bigint,
    OUT attempt          integer,
    OUT lease_expires_at timestamptz,
    OUT result           jsonb,
    OUT error            text,
    OUT first_seen       timestamptz,
    OUT expires_at       timestamptz,
    OUT lease_remaining  interval)
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    -- Run-time partition pruning on a cached plan; a custom plan would be
    -- replanned on every call (several times slower).
    SET plan_cache_mode = force_generic_plan
AS $$
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
BEGIN
    IF v_iso = 'repeatable read' THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'idem.claim: REPEATABLE READ is not supported',
            DETAIL = 'A repeatable-read snapshot cannot see a claim of the same key committed in another monthly partition after the snapshot was taken, so a duplicate could run.',
            HINT = 'Claim in READ COMMITTED (the default) or SERIALIZABLE.';
    END IF;
    -- All input checks as one expression (cheap); only bad input takes the
    -- slow path that names the problem.
    IF claim.source IS NULL OR claim.key IS NULL
       OR octet_length(claim.source) NOT BETWEEN 1 AND 64 OR octet_length(claim.key) NOT BETWEEN 1 AND 512
       OR btrim(claim.source, E' \t\r\n') = '' OR btrim(claim.key, E' \t\r\n') = ''
       OR octet_length(claim.fingerprint) > 512 OR octet_length(claim.event_type) > 256
       OR (claim.ttl IS NOT NULL AND NOT (claim.ttl >= interval '1 minute' AND claim.ttl <= interval '10 years'))
       OR (claim.lease IS NOT NULL AND NOT (claim.lease >= interval '1 second' AND claim.lease <= interval '7 days'))
       OR (claim.lock_wait IS NOT NULL AND NOT (claim.lock_wait >= interval '0' AND claim.lock_wait <= interval '1 hour')) THEN
        PERFORM idem.check_key('idem.claim', claim.source, claim.key);
        IF octet_length(claim.fingerprint) > 512 THEN
            RAISE EXCEPTION USING ERRCODE = '22001', MESSAGE = 'idem.claim: fingerprint is longer than 512 bytes',
                HINT = 'Pass a hash of the request, not the request.';
        END IF;
        IF octet_length(claim.event_type) > 256 THEN
            RAISE EXCEPTION USING ERRCODE = '22001', MESSAGE = 'idem.claim: event_type is longer than 256 bytes';
        END IF;
        IF claim.ttl IS NOT NULL AND NOT idem.valid_ttl(claim.ttl) THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: ttl %s is out of range', claim.ttl),
                HINT = 'ttl must be between 1 minute and 10 years.';
        END IF;
        IF claim.lease IS NOT NULL AND NOT idem.valid_lease(claim.lease) THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lease %s is out of range', claim.lease),
                HINT = 'lease must be between 1 second and 7 days.';
        END IF;
        IF claim.lock_wait IS NOT NULL AND NOT (claim.lock_wait >= interval '0' AND claim.lock_wait <= interval '1 hour') THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lock_wait %s is out of range', claim.lock_wait),
                HINT = 'lock_wait must be between 0 and 1 hour.';
        END IF;
    END IF;

    -- (version 11) On Citus (idem.citus_setup sets idem.citus on this
    -- function) the key's lock below is the owning node's only: a claim
    -- that was not delegated to the node holding the key's shard would not
    -- exclude a delegated claim of the same key, so it is refused.
    IF current_setting('idem.citus', true) = 'on' THEN  -- (NULL elsewhere; AND would not stop at it)
        IF NOT idem.key_is_local(claim.key) THEN
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
    v_lockkey := hashtext(claim.source || chr(31) || claim.key);
    v_locked := pg_try_advisory_xact_lock(1768187245, v_lockkey);

    <<answer>>
    LOOP
        SELECT x.ttl, x.lease, x.max_attempts, x.duplicate_sampling, x.count_per_key,
               (SELECT max(l.lookback) FROM idem.lookbacks l WHERE l.source IN (claim.source, '*'))
          INTO v_ttl, v_lease, v_max, v_sample, v_per_key, v_lookback
          FROM (SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = claim.source
                UNION ALL
                SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = '*'
                 LIMIT 1) x;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = '42704',
                MESSAGE = format('idem.claim: no policy for source %L and no default policy', claim.source),
                HINT = 'Insert a row for the source, or the default row with source ''*'', into idem.policies.';
        END IF;
        v_ttl := coalesce(claim.ttl, v_ttl);
        v_lease := coalesce(claim.lease, v_lease);
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
         WHERE e.source = claim.source AND e.key = claim.key
           AND e.first_seen_month >= idem.window_start(v_now, v_lookback)
           AND e.expires_at > v_now
         LIMIT 1;
        v_found := FOUND;
        IF v_found THEN
            outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim.fingerprint, v_now);
            IF outcome IS NOT NULL THEN
                IF v_sample > 0 AND v_iso <> 'serializable' AND (v_sample = 1 OR random() * v_sample < 1) THEN
                    PERFORM idem.count_duplicate(claim.source, claim.key, r.first_seen_month, v_sample, v_per_key, v_now);
                END IF;
                EXIT answer;
            END IF;
        END IF;
        -- Wait for the lock at most lock_wait (default 5 seconds), polling
        -- so the wait is bounded whatever the caller's lock_timeout; past
        -- it, answer in_progress.
        v_until := clock_timestamp() + coalesce(claim.lock_wait, interval '5 seconds');
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
                v_lookback := idem.raise_lookback(claim.source, v_need);
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
             WHERE e.source = claim.source AND e.key = claim.key
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
                SELECT a.id INTO v_adopt FROM idem.adoptions a WHERE a.source = claim.source AND a.state = 'copying' LIMIT 1;
                IF v_adopt IS NOT NULL THEN
                    PERFORM idem.adopt_key(v_adopt, claim.key, v_now, v_lo, v_hi);
                    v_tries := v_tries - 1;
                    CONTINUE;
                END IF;
            END IF;
            IF NOT v_found THEN
                -- None: a new row in the current month (under the key's
                -- lock no other claim of the key writes meanwhile).
                INSERT INTO idem.processed_events AS e
                       (source, key, first_seen_month, event_type, status, attempts, token,
                        lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
                SELECT claim.source, claim.key, idem.utc_month(v_now), claim.event_type,
                       'processing', 1, idem.new_token(), v_now + v_lease, claim.fingerprint, v_now, v_now,
                       v_now + greatest(v_ttl, v_lease)
                 WHERE NOT EXISTS (SELECT 1 FROM idem.holds h
                                    WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued')
                ON CONFLICT DO NOTHING
                RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
                v_found := FOUND;
                IF v_found THEN
                    outcome := 'acquired';
                    EXIT;
                END IF;
            END IF;
            IF NOT v_found THEN
                -- Held by the queue (its row may have expired, or sit in a
                -- month before the window): its job owns it.
                IF EXISTS (SELECT 1 FROM idem.holds h
                            WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued') THEN
                    outcome := 'in_progress';
                    EXIT;
                END IF;
                -- No live row, and the insert met a row of this key in the
                -- current month: an expired one. Remove it and insert again.
                DELETE FROM idem.processed_events e
                 WHERE e.source = claim.source AND e.key = claim.key
                   AND e.first_seen_month = idem.utc_month(v_now) AND e.expires_at <= v_now;
                CONTINUE;
            END IF;
            outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim.fingerprint, v_now);
            IF outcome IS NOT NULL THEN
                -- A duplicate: read, not written. Count one in v_sample.
                IF v_sample > 0 AND v_iso <> 'serializable' AND (v_sample = 1 OR random() * v_sample < 1) THEN
                    PERFORM idem.count_duplicate(claim.source, claim.key, r.first_seen_month, v_sample, v_per_key, v_now);
                END IF;
                EXIT;
            END IF;
            -- A lost lease or a retryable failure: take the key over, if the
            -- row is still as read (complete, fail and extend do not take
            -- the key's lock), and not held by the queue (between a job's
            -- attempts, or while a crashed worker's job waits for rescue).
            IF EXISTS (SELECT 1 FROM idem.holds h
                        WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued') THEN
                outcome := 'in_progress';
                EXIT;
            END IF;
            IF v_max IS NOT NULL AND r.attempts >= v_max THEN
                UPDATE idem.processed_events e
                   SET status = 'failed', retryable = false, lease_expires_at = NULL, updated_at = v_now,
                       last_error = format('idem: gave up after %s attempts; last error: %s',
                                           r.attempts, coalesce(r.last_error, 'lease expired'))
                 WHERE e.source = claim.source AND e.key = claim.key AND e.first_seen_month = r.first_seen_month
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
                v_lookback := idem.raise_lookback(claim.source, v_need);
            END IF;
            UPDATE idem.processed_events e
               SET status = 'processing',
                   attempts = e.attempts + 1,
                   token = idem.new_token(),
                   lease_expires_at = v_now + v_lease,
                   retryable = NULL,
                   updated_at = v_now,
                   expires_at = greatest(e.expires_at, v_now + v_lease),
                   fingerprint = coalesce(e.fingerprint, claim.fingerprint),
                   event_type = coalesce(e.event_type, claim.event_type)
             WHERE e.source = claim.source AND e.key = claim.key AND e.first_seen_month = r.first_seen_month
               AND e.token = r.token AND e.status = r.status
            RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
            IF FOUND THEN
                outcome := 'acquired';
                EXIT;
            END IF;
        END LOOP;
    END IF;

    -- (version 10) One acquisition in v_sample is counted, as v_sample, in
    -- its minute of idem.activity: the dashboard's claims per minute.
    IF outcome = 'acquired' AND v_sample > 0 AND v_iso <> 'serializable' AND (v_sample = 1 OR random() * v_sample < 1) THEN
        PERFORM idem.count_activity(claim.source, v_now, v_sample, 0);
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
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Completes the key as idem.complete does and returns the result as stored
-- (jsonb's text form), which Do gives its first caller so that it has the
-- bytes every duplicate gets. One call of a function in FROM: the form
-- Citus delegates to the key's node (version 10's query completed from a
-- subquery, which Citus ran on the coordinator).
CREATE FUNCTION idem.complete_stored(source text, key text, token bigint, result jsonb,
                                     OUT outcome text, OUT stored text)
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    outcome := idem.complete(complete_stored.source, complete_stored.key, complete_stored.token, complete_stored.result);
    stored := complete_stored.result::text;
END
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.complete_stored(text, text, bigint, jsonb) FROM PUBLIC;

-- +goose StatementBegin
-- grant_app, version 11: complete_stored too.
CREATE OR REPLACE FUNCTION idem.grant_app(role regrole) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF role IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.grant_app: role must not be NULL';
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA idem TO %s', role);
    EXECUTE format('GRANT EXECUTE ON FUNCTION
        idem.claim(text, text, text, interval, interval, text, interval),
        idem.complete(text, text, bigint, jsonb),
        idem.complete_stored(text, text, bigint, jsonb),
        idem.complete_unstored(text, text, bigint, text),
        idem.fail(text, text, bigint, text, boolean),
        idem.extend(text, text, bigint, interval),
        idem.queue_hold(text, text, bigint, bigint),
        idem.queue_take(text, text, bigint, bigint, interval),
        idem.queue_complete(text, text, bigint, bigint, jsonb, text),
        idem.queue_fail(text, text, bigint, bigint, text, boolean),
        idem.queue_repair(text, text, bigint, bigint, bigint, text),
        idem.queue_replay(text, text, bigint, interval),
        idem.queue_forget(text, text, bigint),
        idem.wait_begin(text, text, interval),
        idem.wait_end(bigint),
        idem.peek(text, text) TO %s', role);
    -- The inbox's reconciliation and dead letters (keys and errors, no
    -- results, no payloads).
    EXECUTE format('GRANT SELECT ON idem.holds, idem.queue_counts TO %s', role);
    -- The schema's version, for a program to tell it is behind.
    IF to_regclass('idem.goose_db_version') IS NOT NULL THEN
        EXECUTE format('GRANT SELECT ON idem.goose_db_version TO %s', role);
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Roles granted before get complete_stored.
DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT a.grantee::regrole::text AS role
               FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
              WHERE p.oid = 'idem.complete(text, text, bigint, jsonb)'::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        PERFORM idem.grant_app(r.role::regrole);
    END LOOP;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.prune_batch(holder text, batch_size integer DEFAULT 5000)
RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now     timestamptz;
    v_left    integer := prune_batch.batch_size;
    v_deleted bigint := 0;
    v_n       bigint;
    v_part    regclass;
    v_citus   boolean;
BEGIN
    IF v_left IS NULL OR v_left < 1 OR v_left > 1000000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('idem.prune_batch: batch_size %s is out of range (1 to 1000000)', v_left);
    END IF;
    PERFORM pg_advisory_xact_lock(1768187247, hashtext('prune'));
    IF NOT EXISTS (SELECT 1 FROM idem.maintenance_locks l
                    WHERE l.name = 'prune' AND l.holder = prune_batch.holder AND l.expires_at > clock_timestamp()) THEN
        RAISE EXCEPTION USING ERRCODE = 'ID001',
            MESSAGE = format('idem.prune_batch: %s does not hold the prune lock', prune_batch.holder),
            HINT = 'Take it with idem.try_lock(''prune'', holder, NULL) first; it may have expired.';
    END IF;
    v_now := idem.clock();
    v_citus := idem.distributed();
    FOR v_part IN SELECT p.partition FROM idem.partition_months() p LOOP
        IF v_citus THEN
            -- (version 11) Citus plans neither ctid lists nor FOR UPDATE on
            -- a distributed table: the batch is addressed by primary key,
            -- and the outer DELETE checks the conditions again, so a row a
            -- claim replaced meanwhile (same key and month) is kept.
            EXECUTE format(
                'DELETE FROM %1$s d
                  WHERE (d.source, d.key, d.first_seen_month) IN (
                         SELECT x.source, x.key, x.first_seen_month FROM %1$s x
                          WHERE x.expires_at < $1
                            AND (x.status <> ''processing'' OR x.lease_expires_at IS NULL OR x.lease_expires_at < $1)
                          LIMIT $2)
                    AND d.expires_at < $1
                    AND (d.status <> ''processing'' OR d.lease_expires_at IS NULL OR d.lease_expires_at < $1)
                    AND NOT EXISTS (SELECT 1 FROM idem.holds h
                                     WHERE h.source = d.source AND h.key = d.key AND h.state = ''queued'')', v_part)
                USING v_now, v_left;
        ELSE
            EXECUTE format(
                'DELETE FROM %1$s d WHERE d.ctid = ANY (ARRAY(
                     SELECT x.ctid FROM %1$s x
                      WHERE x.expires_at < $1
                        AND (x.status <> ''processing'' OR x.lease_expires_at IS NULL OR x.lease_expires_at < $1)
                        AND NOT EXISTS (SELECT 1 FROM idem.holds h
                                         WHERE h.source = x.source AND h.key = x.key AND h.state = ''queued'')
                      LIMIT $2
                      FOR UPDATE SKIP LOCKED))', v_part)
                USING v_now, v_left;
        END IF;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_deleted := v_deleted + v_n;
        v_left := v_left - v_n;
        EXIT WHEN v_left <= 0;
    END LOOP;
    RETURN v_deleted;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- (version 11) The default partition's months are read by a statement of
-- their own: Citus plans no UNION of a distributed table with a series
-- built from a SQL function's parameter.
CREATE OR REPLACE FUNCTION idem.months_to_create(premake integer)
RETURNS SETOF date
    LANGUAGE plpgsql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_default date[];
BEGIN
    SELECT array_agg(DISTINCT d.first_seen_month) INTO v_default FROM idem.processed_events_default d;
    RETURN QUERY
    SELECT m::date FROM (
        SELECT unnest(coalesce(v_default, '{}')) AS m
        UNION
        SELECT (idem.utc_month(idem.clock())::timestamp + make_interval(months => g))::date
          FROM generate_series(0, greatest(months_to_create.premake, 0)) g
    ) s
    WHERE to_regclass('idem.' || quote_ident(idem.partition_name(m::date))) IS NULL
    ORDER BY 1;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Citus only: moves the counts the workers' claims wrote in their own
-- idem.duplicate_counts and idem.activity into the coordinator's, as slot
-- -(the worker's group id), where compaction folds them and stats, the
-- dashboard and the alerts read them. Each worker's rows are deleted in a
-- transaction of its own (run_command_on_workers): counts moved while the
-- coordinator's transaction then fails are lost (statistics, like the
-- UNLOGGED tables they live in). Returns the rows moved.
CREATE FUNCTION idem.citus_collect_counts() RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    r   record;
    v_n bigint := 0;
    v_m bigint;
BEGIN
    FOR r IN SELECT -n.groupid AS slot, w.result::json AS rows
               FROM run_command_on_workers($q$WITH d AS (DELETE FROM idem.duplicate_counts
                                                      RETURNING source, duplicates, since, last_seen_at)
                                             SELECT coalesce(json_agg(d), '[]') FROM d$q$) w
               JOIN pg_dist_node n ON n.nodename = w.nodename AND n.nodeport = w.nodeport
              WHERE w.success LOOP
        INSERT INTO idem.duplicate_counts AS d (source, slot, duplicates, since, last_seen_at)
        SELECT x.source, r.slot, sum(x.duplicates), min(x.since), max(x.last_seen_at)
          FROM json_to_recordset(r.rows) AS x(source text, duplicates bigint, since timestamptz, last_seen_at timestamptz)
         GROUP BY x.source
        ON CONFLICT (source, slot) DO UPDATE
           SET duplicates = d.duplicates + EXCLUDED.duplicates,
               since = least(d.since, EXCLUDED.since),
               last_seen_at = greatest(d.last_seen_at, EXCLUDED.last_seen_at);
        GET DIAGNOSTICS v_m = ROW_COUNT;
        v_n := v_n + v_m;
    END LOOP;
    FOR r IN SELECT -n.groupid AS slot, w.result::json AS rows
               FROM run_command_on_workers($q$WITH d AS (DELETE FROM idem.activity
                                                      RETURNING minute, source, acquired, duplicates)
                                             SELECT coalesce(json_agg(d), '[]') FROM d$q$) w
               JOIN pg_dist_node n ON n.nodename = w.nodename AND n.nodeport = w.nodeport
              WHERE w.success LOOP
        INSERT INTO idem.activity AS d (minute, source, slot, acquired, duplicates)
        SELECT x.minute, x.source, r.slot, sum(x.acquired), sum(x.duplicates)
          FROM json_to_recordset(r.rows) AS x(minute timestamptz, source text, acquired bigint, duplicates bigint)
         GROUP BY x.minute, x.source
        ON CONFLICT (minute, source, slot) DO UPDATE
           SET acquired = d.acquired + EXCLUDED.acquired, duplicates = d.duplicates + EXCLUDED.duplicates;
        GET DIAGNOSTICS v_m = ROW_COUNT;
        v_n := v_n + v_m;
    END LOOP;
    RETURN v_n;
END
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.citus_collect_counts() FROM PUBLIC;

-- +goose StatementBegin
-- (version 11) On Citus, the workers' counts are collected first.
CREATE OR REPLACE FUNCTION idem.compact_duplicate_counts() RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_n bigint;
BEGIN
    IF idem.distributed() THEN
        PERFORM idem.citus_collect_counts();
    END IF;
    WITH moved AS (
        DELETE FROM idem.duplicate_counts d
         WHERE d.slot <> 0
           AND (d.source, d.slot) IN (SELECT x.source, x.slot FROM idem.duplicate_counts x
                                       WHERE x.slot <> 0 FOR UPDATE SKIP LOCKED)
        RETURNING d.*),
    sums AS (
        SELECT m.source, sum(m.duplicates) AS duplicates, min(m.since) AS since, max(m.last_seen_at) AS last_seen_at,
               count(*) AS n
          FROM moved m GROUP BY m.source),
    ins AS (
        INSERT INTO idem.duplicate_counts AS d (source, slot, duplicates, since, last_seen_at)
        SELECT s.source, 0, s.duplicates, s.since, s.last_seen_at FROM sums s
        ON CONFLICT (source, slot) DO UPDATE
           SET duplicates = d.duplicates + EXCLUDED.duplicates,
               since = least(d.since, EXCLUDED.since),
               last_seen_at = greatest(d.last_seen_at, EXCLUDED.last_seen_at))
    SELECT coalesce(sum(n), 0) INTO v_n FROM sums;
    -- The inbox's counts, the same way (version 7).
    WITH moved AS (
        DELETE FROM idem.queue_counts d
         WHERE d.slot <> 0
           AND (d.source, d.slot) IN (SELECT x.source, x.slot FROM idem.queue_counts x
                                       WHERE x.slot <> 0 FOR UPDATE SKIP LOCKED)
        RETURNING d.*),
    sums AS (
        SELECT m.source, sum(m.accepted) AS accepted, sum(m.processed) AS processed, min(m.since) AS since,
               count(*) AS n
          FROM moved m GROUP BY m.source),
    ins AS (
        INSERT INTO idem.queue_counts AS d (source, slot, accepted, processed, since)
        SELECT s.source, 0, s.accepted, s.processed, s.since FROM sums s
        ON CONFLICT (source, slot) DO UPDATE
           SET accepted = d.accepted + EXCLUDED.accepted,
               processed = d.processed + EXCLUDED.processed,
               since = least(d.since, EXCLUDED.since))
    SELECT v_n + coalesce(sum(n), 0) INTO v_n FROM sums;
    -- (version 10) idem.activity: the slots of each finished minute folded
    -- into slot 0, and minutes older than 8 days deleted.
    DELETE FROM idem.activity a WHERE a.minute < idem.clock() - interval '8 days';
    WITH moved AS (
        DELETE FROM idem.activity d
         WHERE d.slot <> 0 AND d.minute < idem.activity_minute(idem.clock())
           AND (d.minute, d.source, d.slot) IN (SELECT x.minute, x.source, x.slot FROM idem.activity x
                                                 WHERE x.slot <> 0 AND x.minute < idem.activity_minute(idem.clock())
                                                   FOR UPDATE SKIP LOCKED)
        RETURNING d.*),
    sums AS (
        SELECT m.minute, m.source, sum(m.acquired) AS acquired, sum(m.duplicates) AS duplicates, count(*) AS n
          FROM moved m GROUP BY m.minute, m.source),
    ins AS (
        INSERT INTO idem.activity AS d (minute, source, slot, acquired, duplicates)
        SELECT s.minute, s.source, 0, s.acquired, s.duplicates FROM sums s
        ON CONFLICT (minute, source, slot) DO UPDATE
           SET acquired = d.acquired + EXCLUDED.acquired, duplicates = d.duplicates + EXCLUDED.duplicates)
    SELECT v_n + coalesce(sum(n), 0) INTO v_n FROM sums;
    RETURN v_n;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- Makes this database's idem a distributed one, on a Citus coordinator
-- (docs/citus.md). Each step looks first, so running it again changes
-- nothing, and migrate runs it again after every migration on a
-- distributed installation (CREATE OR REPLACE FUNCTION resets the
-- settings it gives the per-key functions). Returns what it did.
--
-- * processed_events (with its months) and holds: distributed by key,
--   colocated, so every row of a key is on one node.
-- * policies, lookbacks, adoptions: reference tables (a copy on every
--   node), read by claims on every node. The lookback of '*' is set to
--   11 years (beyond the longest ttl and lease) and the trigger that
--   raised it dropped: a claim would otherwise write a reference table
--   from a worker. Claims then look at every month there is (rotation
--   keeps them few).
-- * duplicate_counts and activity (written by claims): a table of their
--   own on every node, not distributed; the coordinator's stay what stats
--   read (docs/citus.md says what that means).
-- * The waiters' notification trigger is dropped: a completion on a
--   worker would notify there, where no client listens; a waiting
--   duplicate polls (at most every second).
-- * Every idem function exists on every node. claim, complete,
--   complete_unstored, fail, extend and peek are delegated to the node
--   that holds their key (colocated with processed_events by key, forced
--   inside transactions too), with a custom plan per statement (Citus
--   routes a generic plan's INSERT .. SELECT nowhere), and claim gets
--   idem.citus = on (version 11 refuses a claim not delegated).
CREATE FUNCTION idem.citus_setup() RETURNS SETOF text
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
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
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION idem.citus_setup() FROM PUBLIC;

-- +goose Down
-- +goose StatementBegin
DO $$
BEGIN
    IF idem.distributed() THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'idem: migrating below version 11 is not supported on a distributed (Citus) installation';
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- claim, version 10.
CREATE OR REPLACE FUNCTION idem.claim(
    source      text,
    key         text,
    fingerprint text     DEFAULT NULL,
    ttl         interval DEFAULT NULL,
    lease       interval DEFAULT NULL,
    event_type  text     DEFAULT NULL,
    lock_wait   interval DEFAULT NULL,
    OUT outcome          text,
    OUT token            bigint,
    OUT attempt          integer,
    OUT lease_expires_at timestamptz,
    OUT result           jsonb,
    OUT error            text,
    OUT first_seen       timestamptz,
    OUT expires_at       timestamptz,
    OUT lease_remaining  interval)
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    -- Run-time partition pruning on a cached plan; a custom plan would be
    -- replanned on every call (several times slower).
    SET plan_cache_mode = force_generic_plan
AS $$
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
BEGIN
    IF v_iso = 'repeatable read' THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'idem.claim: REPEATABLE READ is not supported',
            DETAIL = 'A repeatable-read snapshot cannot see a claim of the same key committed in another monthly partition after the snapshot was taken, so a duplicate could run.',
            HINT = 'Claim in READ COMMITTED (the default) or SERIALIZABLE.';
    END IF;
    -- All input checks as one expression (cheap); only bad input takes the
    -- slow path that names the problem.
    IF claim.source IS NULL OR claim.key IS NULL
       OR octet_length(claim.source) NOT BETWEEN 1 AND 64 OR octet_length(claim.key) NOT BETWEEN 1 AND 512
       OR btrim(claim.source, E' \t\r\n') = '' OR btrim(claim.key, E' \t\r\n') = ''
       OR octet_length(claim.fingerprint) > 512 OR octet_length(claim.event_type) > 256
       OR (claim.ttl IS NOT NULL AND NOT (claim.ttl >= interval '1 minute' AND claim.ttl <= interval '10 years'))
       OR (claim.lease IS NOT NULL AND NOT (claim.lease >= interval '1 second' AND claim.lease <= interval '7 days'))
       OR (claim.lock_wait IS NOT NULL AND NOT (claim.lock_wait >= interval '0' AND claim.lock_wait <= interval '1 hour')) THEN
        PERFORM idem.check_key('idem.claim', claim.source, claim.key);
        IF octet_length(claim.fingerprint) > 512 THEN
            RAISE EXCEPTION USING ERRCODE = '22001', MESSAGE = 'idem.claim: fingerprint is longer than 512 bytes',
                HINT = 'Pass a hash of the request, not the request.';
        END IF;
        IF octet_length(claim.event_type) > 256 THEN
            RAISE EXCEPTION USING ERRCODE = '22001', MESSAGE = 'idem.claim: event_type is longer than 256 bytes';
        END IF;
        IF claim.ttl IS NOT NULL AND NOT idem.valid_ttl(claim.ttl) THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: ttl %s is out of range', claim.ttl),
                HINT = 'ttl must be between 1 minute and 10 years.';
        END IF;
        IF claim.lease IS NOT NULL AND NOT idem.valid_lease(claim.lease) THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lease %s is out of range', claim.lease),
                HINT = 'lease must be between 1 second and 7 days.';
        END IF;
        IF claim.lock_wait IS NOT NULL AND NOT (claim.lock_wait >= interval '0' AND claim.lock_wait <= interval '1 hour') THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('idem.claim: lock_wait %s is out of range', claim.lock_wait),
                HINT = 'lock_wait must be between 0 and 1 hour.';
        END IF;
    END IF;

    -- The key's lock first: every write of a row of this key (and every
    -- raise of its source's lookback by a write) happens under it, so what
    -- is read after it (lookback, rows) includes every earlier claim of the
    -- key. Free in the common case; held by another claim of the key only
    -- while that claim's transaction is open.
    v_lockkey := hashtext(claim.source || chr(31) || claim.key);
    v_locked := pg_try_advisory_xact_lock(1768187245, v_lockkey);

    <<answer>>
    LOOP
        SELECT x.ttl, x.lease, x.max_attempts, x.duplicate_sampling, x.count_per_key,
               (SELECT max(l.lookback) FROM idem.lookbacks l WHERE l.source IN (claim.source, '*'))
          INTO v_ttl, v_lease, v_max, v_sample, v_per_key, v_lookback
          FROM (SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = claim.source
                UNION ALL
                SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = '*'
                 LIMIT 1) x;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = '42704',
                MESSAGE = format('idem.claim: no policy for source %L and no default policy', claim.source),
                HINT = 'Insert a row for the source, or the default row with source ''*'', into idem.policies.';
        END IF;
        v_ttl := coalesce(claim.ttl, v_ttl);
        v_lease := coalesce(claim.lease, v_lease);
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
         WHERE e.source = claim.source AND e.key = claim.key
           AND e.first_seen_month >= idem.window_start(v_now, v_lookback)
           AND e.expires_at > v_now
         LIMIT 1;
        v_found := FOUND;
        IF v_found THEN
            outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim.fingerprint, v_now);
            IF outcome IS NOT NULL THEN
                IF v_sample > 0 AND v_iso <> 'serializable' AND (v_sample = 1 OR random() * v_sample < 1) THEN
                    PERFORM idem.count_duplicate(claim.source, claim.key, r.first_seen_month, v_sample, v_per_key, v_now);
                END IF;
                EXIT answer;
            END IF;
        END IF;
        -- Wait for the lock at most lock_wait (default 5 seconds), polling
        -- so the wait is bounded whatever the caller's lock_timeout; past
        -- it, answer in_progress.
        v_until := clock_timestamp() + coalesce(claim.lock_wait, interval '5 seconds');
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
                v_lookback := idem.raise_lookback(claim.source, v_need);
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
             WHERE e.source = claim.source AND e.key = claim.key
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
                SELECT a.id INTO v_adopt FROM idem.adoptions a WHERE a.source = claim.source AND a.state = 'copying' LIMIT 1;
                IF v_adopt IS NOT NULL THEN
                    PERFORM idem.adopt_key(v_adopt, claim.key, v_now, v_lo, v_hi);
                    v_tries := v_tries - 1;
                    CONTINUE;
                END IF;
            END IF;
            IF NOT v_found THEN
                -- None: a new row in the current month (under the key's
                -- lock no other claim of the key writes meanwhile).
                INSERT INTO idem.processed_events AS e
                       (source, key, first_seen_month, event_type, status, attempts, token,
                        lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
                SELECT claim.source, claim.key, idem.utc_month(v_now), claim.event_type,
                       'processing', 1, idem.new_token(), v_now + v_lease, claim.fingerprint, v_now, v_now,
                       v_now + greatest(v_ttl, v_lease)
                 WHERE NOT EXISTS (SELECT 1 FROM idem.holds h
                                    WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued')
                ON CONFLICT DO NOTHING
                RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
                v_found := FOUND;
                IF v_found THEN
                    outcome := 'acquired';
                    EXIT;
                END IF;
            END IF;
            IF NOT v_found THEN
                -- Held by the queue (its row may have expired, or sit in a
                -- month before the window): its job owns it.
                IF EXISTS (SELECT 1 FROM idem.holds h
                            WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued') THEN
                    outcome := 'in_progress';
                    EXIT;
                END IF;
                -- No live row, and the insert met a row of this key in the
                -- current month: an expired one. Remove it and insert again.
                DELETE FROM idem.processed_events e
                 WHERE e.source = claim.source AND e.key = claim.key
                   AND e.first_seen_month = idem.utc_month(v_now) AND e.expires_at <= v_now;
                CONTINUE;
            END IF;
            outcome := idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint, claim.fingerprint, v_now);
            IF outcome IS NOT NULL THEN
                -- A duplicate: read, not written. Count one in v_sample.
                IF v_sample > 0 AND v_iso <> 'serializable' AND (v_sample = 1 OR random() * v_sample < 1) THEN
                    PERFORM idem.count_duplicate(claim.source, claim.key, r.first_seen_month, v_sample, v_per_key, v_now);
                END IF;
                EXIT;
            END IF;
            -- A lost lease or a retryable failure: take the key over, if the
            -- row is still as read (complete, fail and extend do not take
            -- the key's lock), and not held by the queue (between a job's
            -- attempts, or while a crashed worker's job waits for rescue).
            IF EXISTS (SELECT 1 FROM idem.holds h
                        WHERE h.source = claim.source AND h.key = claim.key AND h.state = 'queued') THEN
                outcome := 'in_progress';
                EXIT;
            END IF;
            IF v_max IS NOT NULL AND r.attempts >= v_max THEN
                UPDATE idem.processed_events e
                   SET status = 'failed', retryable = false, lease_expires_at = NULL, updated_at = v_now,
                       last_error = format('idem: gave up after %s attempts; last error: %s',
                                           r.attempts, coalesce(r.last_error, 'lease expired'))
                 WHERE e.source = claim.source AND e.key = claim.key AND e.first_seen_month = r.first_seen_month
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
                v_lookback := idem.raise_lookback(claim.source, v_need);
            END IF;
            UPDATE idem.processed_events e
               SET status = 'processing',
                   attempts = e.attempts + 1,
                   token = idem.new_token(),
                   lease_expires_at = v_now + v_lease,
                   retryable = NULL,
                   updated_at = v_now,
                   expires_at = greatest(e.expires_at, v_now + v_lease),
                   fingerprint = coalesce(e.fingerprint, claim.fingerprint),
                   event_type = coalesce(e.event_type, claim.event_type)
             WHERE e.source = claim.source AND e.key = claim.key AND e.first_seen_month = r.first_seen_month
               AND e.token = r.token AND e.status = r.status
            RETURNING e.first_seen_month, e.status, e.attempts, e.token, e.lease_expires_at, e.fingerprint, e.result, e.last_error, e.retryable, e.first_seen, e.expires_at INTO r;
            IF FOUND THEN
                outcome := 'acquired';
                EXIT;
            END IF;
        END LOOP;
    END IF;

    -- (version 10) One acquisition in v_sample is counted, as v_sample, in
    -- its minute of idem.activity: the dashboard's claims per minute.
    IF outcome = 'acquired' AND v_sample > 0 AND v_iso <> 'serializable' AND (v_sample = 1 OR random() * v_sample < 1) THEN
        PERFORM idem.count_activity(claim.source, v_now, v_sample, 0);
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
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- prune_batch, version 7.
CREATE OR REPLACE FUNCTION idem.prune_batch(holder text, batch_size integer DEFAULT 5000)
RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now     timestamptz;
    v_left    integer := prune_batch.batch_size;
    v_deleted bigint := 0;
    v_n       bigint;
    v_part    regclass;
BEGIN
    IF v_left IS NULL OR v_left < 1 OR v_left > 1000000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('idem.prune_batch: batch_size %s is out of range (1 to 1000000)', v_left);
    END IF;
    PERFORM pg_advisory_xact_lock(1768187247, hashtext('prune'));
    IF NOT EXISTS (SELECT 1 FROM idem.maintenance_locks l
                    WHERE l.name = 'prune' AND l.holder = prune_batch.holder AND l.expires_at > clock_timestamp()) THEN
        RAISE EXCEPTION USING ERRCODE = 'ID001',
            MESSAGE = format('idem.prune_batch: %s does not hold the prune lock', prune_batch.holder),
            HINT = 'Take it with idem.try_lock(''prune'', holder, NULL) first; it may have expired.';
    END IF;
    v_now := idem.clock();
    FOR v_part IN SELECT p.partition FROM idem.partition_months() p LOOP
        EXECUTE format(
            'DELETE FROM %1$s d WHERE d.ctid = ANY (ARRAY(
                 SELECT x.ctid FROM %1$s x
                  WHERE x.expires_at < $1
                    AND (x.status <> ''processing'' OR x.lease_expires_at IS NULL OR x.lease_expires_at < $1)
                    AND NOT EXISTS (SELECT 1 FROM idem.holds h
                                     WHERE h.source = x.source AND h.key = x.key AND h.state = ''queued'')
                  LIMIT $2
                  FOR UPDATE SKIP LOCKED))', v_part)
            USING v_now, v_left;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_deleted := v_deleted + v_n;
        v_left := v_left - v_n;
        EXIT WHEN v_left <= 0;
    END LOOP;
    RETURN v_deleted;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- months_to_create, version 4 (a SQL function again).
CREATE OR REPLACE FUNCTION idem.months_to_create(premake integer)
RETURNS SETOF date
    LANGUAGE sql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
    SELECT m::date FROM (
        SELECT DISTINCT d.first_seen_month AS m FROM idem.processed_events_default d
        UNION
        SELECT (idem.utc_month(idem.clock())::timestamp + make_interval(months => g))::date
          FROM generate_series(0, greatest(premake, 0)) g
    ) s
    WHERE to_regclass('idem.' || quote_ident(idem.partition_name(m::date))) IS NULL
    ORDER BY 1
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- compact_duplicate_counts, version 10.
CREATE OR REPLACE FUNCTION idem.compact_duplicate_counts() RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_n bigint;
BEGIN
    WITH moved AS (
        DELETE FROM idem.duplicate_counts d
         WHERE d.slot <> 0
           AND (d.source, d.slot) IN (SELECT x.source, x.slot FROM idem.duplicate_counts x
                                       WHERE x.slot <> 0 FOR UPDATE SKIP LOCKED)
        RETURNING d.*),
    sums AS (
        SELECT m.source, sum(m.duplicates) AS duplicates, min(m.since) AS since, max(m.last_seen_at) AS last_seen_at,
               count(*) AS n
          FROM moved m GROUP BY m.source),
    ins AS (
        INSERT INTO idem.duplicate_counts AS d (source, slot, duplicates, since, last_seen_at)
        SELECT s.source, 0, s.duplicates, s.since, s.last_seen_at FROM sums s
        ON CONFLICT (source, slot) DO UPDATE
           SET duplicates = d.duplicates + EXCLUDED.duplicates,
               since = least(d.since, EXCLUDED.since),
               last_seen_at = greatest(d.last_seen_at, EXCLUDED.last_seen_at))
    SELECT coalesce(sum(n), 0) INTO v_n FROM sums;
    -- The inbox's counts, the same way (version 7).
    WITH moved AS (
        DELETE FROM idem.queue_counts d
         WHERE d.slot <> 0
           AND (d.source, d.slot) IN (SELECT x.source, x.slot FROM idem.queue_counts x
                                       WHERE x.slot <> 0 FOR UPDATE SKIP LOCKED)
        RETURNING d.*),
    sums AS (
        SELECT m.source, sum(m.accepted) AS accepted, sum(m.processed) AS processed, min(m.since) AS since,
               count(*) AS n
          FROM moved m GROUP BY m.source),
    ins AS (
        INSERT INTO idem.queue_counts AS d (source, slot, accepted, processed, since)
        SELECT s.source, 0, s.accepted, s.processed, s.since FROM sums s
        ON CONFLICT (source, slot) DO UPDATE
           SET accepted = d.accepted + EXCLUDED.accepted,
               processed = d.processed + EXCLUDED.processed,
               since = least(d.since, EXCLUDED.since))
    SELECT v_n + coalesce(sum(n), 0) INTO v_n FROM sums;
    -- (version 10) idem.activity: the slots of each finished minute folded
    -- into slot 0, and minutes older than 8 days deleted.
    DELETE FROM idem.activity a WHERE a.minute < idem.clock() - interval '8 days';
    WITH moved AS (
        DELETE FROM idem.activity d
         WHERE d.slot <> 0 AND d.minute < idem.activity_minute(idem.clock())
           AND (d.minute, d.source, d.slot) IN (SELECT x.minute, x.source, x.slot FROM idem.activity x
                                                 WHERE x.slot <> 0 AND x.minute < idem.activity_minute(idem.clock())
                                                   FOR UPDATE SKIP LOCKED)
        RETURNING d.*),
    sums AS (
        SELECT m.minute, m.source, sum(m.acquired) AS acquired, sum(m.duplicates) AS duplicates, count(*) AS n
          FROM moved m GROUP BY m.minute, m.source),
    ins AS (
        INSERT INTO idem.activity AS d (minute, source, slot, acquired, duplicates)
        SELECT s.minute, s.source, 0, s.acquired, s.duplicates FROM sums s
        ON CONFLICT (minute, source, slot) DO UPDATE
           SET acquired = d.acquired + EXCLUDED.acquired, duplicates = d.duplicates + EXCLUDED.duplicates)
    SELECT v_n + coalesce(sum(n), 0) INTO v_n FROM sums;
    RETURN v_n;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- grant_app, version 8.
CREATE OR REPLACE FUNCTION idem.grant_app(role regrole) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF role IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.grant_app: role must not be NULL';
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA idem TO %s', role);
    EXECUTE format('GRANT EXECUTE ON FUNCTION
        idem.claim(text, text, text, interval, interval, text, interval),
        idem.complete(text, text, bigint, jsonb),
        idem.complete_unstored(text, text, bigint, text),
        idem.fail(text, text, bigint, text, boolean),
        idem.extend(text, text, bigint, interval),
        idem.queue_hold(text, text, bigint, bigint),
        idem.queue_take(text, text, bigint, bigint, interval),
        idem.queue_complete(text, text, bigint, bigint, jsonb, text),
        idem.queue_fail(text, text, bigint, bigint, text, boolean),
        idem.queue_repair(text, text, bigint, bigint, bigint, text),
        idem.queue_replay(text, text, bigint, interval),
        idem.queue_forget(text, text, bigint),
        idem.wait_begin(text, text, interval),
        idem.wait_end(bigint),
        idem.peek(text, text) TO %s', role);
    -- The inbox's reconciliation and dead letters (keys and errors, no
    -- results, no payloads).
    EXECUTE format('GRANT SELECT ON idem.holds, idem.queue_counts TO %s', role);
    -- The schema's version, for a program to tell it is behind.
    IF to_regclass('idem.goose_db_version') IS NOT NULL THEN
        EXECUTE format('GRANT SELECT ON idem.goose_db_version TO %s', role);
    END IF;
END
$$;
-- +goose StatementEnd

DROP FUNCTION idem.complete_stored(text, text, bigint, jsonb);
DROP FUNCTION idem.citus_collect_counts();
DROP FUNCTION idem.citus_setup();
DROP FUNCTION idem.key_is_local(text);
DROP FUNCTION idem.distributed();
