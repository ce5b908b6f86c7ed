-- idem 29: a batch that pays only for what its source uses.
--
-- Migration 27 gave idem.claim a short path (one row of idem.claim_settings
-- instead of the policy, lookback, adoption and hold reads; docs/design.md,
-- "The short path"); idem.claim_batch kept reading the tables, looked for
-- an inbox hold of every new key, ordered its keys with an aggregate, and
-- answered its new keys through a five-part statement and a loop step of
-- ten assignments per key. Server CPU per batch of 100 and end to end:
-- docs/performance.md, "DoBatch's short path (migration 29)".
--
-- idem.claim_batch, at READ COMMITTED and off Citus:
-- * reads its source's row of idem.claim_settings (or the default's, and
--   writes the source's own when it can without waiting, as idem.claim
--   does) instead of idem.policies and idem.lookbacks, and under the keys'
--   locks the row again instead of idem.lookbacks and idem.adoptions; it
--   looks for inbox holds only for a source that has had one. A source
--   whose legacy table is being adopted reads the tables, as before.
-- * a batch whose first key has no final answer (new keys, mostly) takes
--   every key's lock in the global order in one statement that stops at
--   the first busy one; all taken, one statement inserts the keys with no
--   live row in the window's other months (and no hold) and yields their
--   answers. Per key, not per batch: the positions it did not insert (a
--   row in the window, a hold, an expired row in the current month, a
--   repeated key) are answered by the statement that answers locked keys,
--   as before; a batch that met a busy lock goes on exactly as before.
-- Every loop over a statement's rows fetches straight into the answer's
-- columns (the statements compute them) instead of assigning ten of them
-- one by one. Everything else is as at version 23: the redelivered batch
-- read before the locks, the lock loop that answers a busy key by
-- idem.claim, SERIALIZABLE, counting, repeated keys. One function: the
-- short path shares every step it does not replace.
--
-- Citus: idem_shard_<shard>.claim_batch, the shards' copies that
-- idem.citus_shard_claims() makes from this function's definition (version
-- 28; what is copied is unchanged), run with idem.citus on, so they never
-- take the short path: they contain it, unreachable, and answer as version
-- 23's copies did. The copies are made again (their definition changed)
-- when idem.citus_setup runs, at the end of this migration on a
-- distributed installation, as migration 28 did. On the coordinator
-- idem.claim_batch still refuses a distributed installation (ID006)
-- before any of it. The statement that answers locked keys stands between
-- two marker comments, "-- <claim_locked>" and "-- </claim_locked>":
-- migration 30 cuts it out there for the shards' claim_locked (one
-- implementation of it, found by its markers, not by its formatting).
--
-- Down restores migration 23's idem.claim_batch.

-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.claim_batch(source text, keys text[], fingerprints text[] DEFAULT NULL::text[], ttl interval DEFAULT NULL::interval, lease interval DEFAULT NULL::interval, event_types text[] DEFAULT NULL::text[], lock_wait interval DEFAULT NULL::interval)
 RETURNS TABLE(ord integer, outcome text, token bigint, attempt integer, lease_expires_at timestamp with time zone, result jsonb, error text, first_seen timestamp with time zone, expires_at timestamp with time zone, lease_remaining interval)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
DECLARE
    v_iso      text := current_setting('transaction_isolation');
    v_n        integer := cardinality(claim_batch.keys);
    v_now      timestamptz;
    v_cur      date;               -- the current month: where a new key goes
    v_ttl      interval;
    v_lease    interval;
    v_max      integer;
    v_sample   integer;
    v_per_key  boolean;
    v_lookback interval;
    v_need     interval;
    v_lo       date;
    v_hi       date;
    v_until    timestamptz;
    v_adopting boolean;
    v_base     bigint;             -- the batch's token; each acquired key's is derived from it
    v_firsts   integer[];          -- every distinct key's first position
    v_ords     integer[];          -- the positions to lock (no final answer yet), in lock order
    v_hashes   integer[];          -- their lock keys
    v_locked   integer[] := '{}';  -- the positions whose key this call has locked
    v_from     integer;            -- the next position of v_ords to lock
    v_busy     integer;            -- a position of v_ords whose lock is busy
    v_gkeys    text[];             -- SERIALIZABLE: placeholders to delete
    v_sleep    double precision;
    v_gmonths  date[];
    v_slow     integer[];          -- the positions idem.claim answers
    v_i        integer;
    v_acq      integer := 0;
    v_dups     integer := 0;
    c          record;
    v_nfirst   integer;            -- the distinct keys
    v_open     integer[] := '{}';  -- read before the locks: the positions without a final answer
    v_weight   integer;
    a_ord      integer[] := '{}';  -- the locked keys answered by the set-based statement
    -- The duplicates' positions and months, for per-key counting.
    f_ord      integer[];
    f_month    date[];
    -- (version 29) The short path.
    s          record;             -- the source's row of idem.claim_settings
    v_short    boolean := false;   -- the batch's settings are that row's
    v_holds    boolean := true;    -- the source may have inbox holds: they are looked for
    v_lean     boolean := false;   -- every key locked at once: the new keys inserted by one statement
    v_rest     integer[] := '{}';  -- the positions that statement did not insert
    v_month    date;               -- the month of the row an answer was read from
BEGIN
    IF v_iso = 'repeatable read' THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'idem.claim_batch: REPEATABLE READ is not supported',
            DETAIL = 'A repeatable-read snapshot cannot see a claim of the same key committed in another monthly partition after the snapshot was taken, so a duplicate could run.',
            HINT = 'Claim in READ COMMITTED (the default) or SERIALIZABLE.';
    END IF;
    -- Every input check as one expression; only bad input takes the path
    -- that names the problem and the item.
    IF claim_batch.source IS NULL OR octet_length(claim_batch.source) NOT BETWEEN 1 AND 64
       OR btrim(claim_batch.source, E' \t\r\n') = '' OR claim_batch.source ~ '[\x01-\x1f\x7f]'
       OR v_n IS NULL OR v_n NOT BETWEEN 1 AND 1000
       OR array_ndims(claim_batch.keys) <> 1 OR array_lower(claim_batch.keys, 1) <> 1
       OR (claim_batch.fingerprints IS NOT NULL AND (array_ndims(claim_batch.fingerprints) <> 1
           OR array_lower(claim_batch.fingerprints, 1) <> 1 OR cardinality(claim_batch.fingerprints) <> v_n))
       OR (claim_batch.event_types IS NOT NULL AND (array_ndims(claim_batch.event_types) <> 1
           OR array_lower(claim_batch.event_types, 1) <> 1 OR cardinality(claim_batch.event_types) <> v_n))
       OR EXISTS (SELECT 1 FROM unnest(claim_batch.keys, claim_batch.fingerprints, claim_batch.event_types) x(k, f, t)
                   WHERE x.k IS NULL OR octet_length(x.k) NOT BETWEEN 1 AND 512 OR btrim(x.k, E' \t\r\n') = ''
                      OR octet_length(x.f) > 512 OR octet_length(x.t) > 256)
       OR (claim_batch.ttl IS NOT NULL AND NOT idem.valid_ttl(claim_batch.ttl))
       OR (claim_batch.lease IS NOT NULL AND NOT idem.valid_lease(claim_batch.lease))
       OR (claim_batch.lock_wait IS NOT NULL AND NOT (claim_batch.lock_wait >= interval '0' AND claim_batch.lock_wait <= interval '1 hour')) THEN
        PERFORM idem.check_batch('idem.claim_batch', claim_batch.source, v_n, claim_batch.keys, claim_batch.fingerprints);
        PERFORM idem.check_batch('idem.claim_batch', claim_batch.source, v_n, claim_batch.keys, claim_batch.event_types);
        FOR v_i IN 1 .. v_n LOOP
            -- idem.claim's own checks, naming the item.
            PERFORM idem.check_key(format('idem.claim_batch (item %s)', v_i), claim_batch.source, claim_batch.keys[v_i]);
            IF octet_length(claim_batch.fingerprints[v_i]) > 512 THEN
                RAISE EXCEPTION USING ERRCODE = '22001',
                    MESSAGE = format('idem.claim_batch (item %s): fingerprint is longer than 512 bytes', v_i),
                    HINT = 'Pass a hash of the request, not the request.';
            END IF;
            IF octet_length(claim_batch.event_types[v_i]) > 256 THEN
                RAISE EXCEPTION USING ERRCODE = '22001',
                    MESSAGE = format('idem.claim_batch (item %s): event_type is longer than 256 bytes', v_i);
            END IF;
        END LOOP;
        -- ttl, lease and lock_wait: idem.claim checks them as it checks its
        -- own (the first item's call raises).
        PERFORM idem.claim(claim_batch.source, claim_batch.keys[1], NULL, claim_batch.ttl, claim_batch.lease,
                           NULL, claim_batch.lock_wait);
        RAISE EXCEPTION USING ERRCODE = 'XX000', MESSAGE = 'idem.claim_batch: an input check disagrees with idem.claim';
    END IF;
    IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL AND idem.distributed() THEN
        RAISE EXCEPTION USING ERRCODE = 'ID006',
            MESSAGE = 'idem.claim_batch is not supported on a distributed (Citus) installation',
            DETAIL = 'The keys of a batch live on several nodes; a per-key lock excludes only the claims of the node it is taken on.',
            HINT = 'Claim each key with idem.claim, which Citus delegates to the key''s node.';
    END IF;
    v_until := clock_timestamp() + coalesce(claim_batch.lock_wait, interval '5 seconds');

    -- (version 29) The short path, as idem.claim's (migration 27): at
    -- READ COMMITTED, off Citus, the source's policy, lookback and whether
    -- it has had an inbox hold or has an adoption in progress are one row
    -- of idem.claim_settings (kept by triggers in the same transaction as
    -- every change of them; a source with no row of its own yet claims with
    -- the default's, and writes its own when it can without waiting). A
    -- source whose legacy table is being adopted, and every batch in
    -- SERIALIZABLE or on Citus (where idem.citus is on: the shards' copies of
    -- this function), read the tables, as before.
    IF v_iso = 'read committed' AND current_setting('idem.citus', true) IS DISTINCT FROM 'on' THEN
        SELECT c.ttl, c.lease, c.max_attempts, c.duplicate_sampling, c.count_per_key, c.lookback, c.holds, c.adopting
          INTO s FROM idem.claim_settings c WHERE c.source = claim_batch.source;
        IF NOT FOUND THEN
            SELECT c.ttl, c.lease, c.max_attempts, c.duplicate_sampling, c.count_per_key, c.lookback,
                   false AS holds, false AS adopting
              INTO s FROM idem.claim_settings c WHERE c.source = '*';
            v_short := FOUND;
            IF v_short AND current_setting('transaction_read_only') = 'off'
               AND pg_try_advisory_xact_lock(1768187248, hashtext(claim_batch.source)) THEN
                PERFORM idem.claim_settings_refresh(claim_batch.source);
            END IF;
        ELSE
            v_short := true;
        END IF;
        v_short := v_short AND NOT s.adopting;
    END IF;
    IF v_short THEN
        v_ttl := s.ttl; v_lease := s.lease; v_max := s.max_attempts; v_sample := s.duplicate_sampling;
        v_per_key := s.count_per_key; v_lookback := s.lookback; v_holds := s.holds;
    ELSE
        -- The source's policy, and its lookback for the window of the first
        -- read (a lookback raised meanwhile only makes that read miss a row,
        -- and a key it does not answer is read again under its lock below,
        -- with the lookback read again there, as idem.claim reads it).
        SELECT x.ttl, x.lease, x.max_attempts, x.duplicate_sampling, x.count_per_key,
               (SELECT max(l.lookback) FROM idem.lookbacks l WHERE l.source IN (claim_batch.source, '*'))
          INTO v_ttl, v_lease, v_max, v_sample, v_per_key, v_lookback
          FROM (SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = claim_batch.source
                UNION ALL
                SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
                  FROM idem.policies p WHERE p.source = '*'
                 LIMIT 1) x;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = '42704',
                MESSAGE = format('idem.claim_batch: no policy for source %L and no default policy', claim_batch.source),
                HINT = 'Insert a row for the source, or the default row with source ''*'', into idem.policies.';
        END IF;
    END IF;
    v_ttl := coalesce(claim_batch.ttl, v_ttl);
    v_lease := coalesce(claim_batch.lease, v_lease);
    IF v_lease > v_ttl THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('idem.claim_batch: lease %s is longer than ttl %s', v_lease, v_ttl);
    END IF;
    v_now := idem.clock();
    -- The window of the first read: the oldest month that can hold a live
    -- row of the source to the month of tomorrow. Computed once here: in a
    -- probe's condition it would be computed again for every key.
    v_lo := idem.window_start(v_now, v_lookback);
    v_hi := idem.utc_month(v_now + interval '1 day');

    -- A batch whose first key already has a final answer (completed,
    -- failed for good, a mismatch, a live lease) is most likely a
    -- redelivery: its keys are read first, before any lock, and those with
    -- a final answer answer at once, as idem.claim answers from what is
    -- committed when a key's lock is busy; a duplicate then takes no lock
    -- and writes nothing. Any other batch goes to its locks at once, and
    -- its keys are read there (a new key is then looked up once, by its
    -- insert). Both paths give each key the same answer.
    PERFORM 1
      FROM idem.processed_events x
     WHERE x.source = claim_batch.source AND x.key = claim_batch.keys[1]
       AND x.first_seen_month >= v_lo AND x.first_seen_month <= v_hi
       AND x.expires_at > v_now
       AND idem.settled_outcome(x.status, x.retryable, x.lease_expires_at, x.fingerprint,
                                claim_batch.fingerprints[1], v_now) IS NOT NULL
     LIMIT 1;
    IF NOT FOUND THEN
        IF v_short THEN
            -- (version 29) The short path: every key's lock in the global
            -- order (by the lock's key, then position; a repeated key's lock
            -- is taken again), one statement that stops at the first busy
            -- one (LIMIT 1: the later ones are not tried). All taken: the
            -- new keys are inserted at once below. One busy: the batch goes
            -- on as below, trying the same order again (the locks it holds
            -- are a prefix of it), so it never holds a later key while it
            -- waits for an earlier one. (OFFSET 0: the lock's condition is
            -- not pushed below the sort, where it would take the locks in
            -- the batch's order.)
            PERFORM 1
              FROM (SELECT hashtext(claim_batch.source || chr(31) || u.k) AS h, u.o
                      FROM unnest(claim_batch.keys) WITH ORDINALITY u(k, o)
                     ORDER BY 1, 2 OFFSET 0) l
             WHERE NOT pg_try_advisory_xact_lock(1768187245, l.h)
             LIMIT 1;
            v_lean := NOT FOUND;
        END IF;
        IF NOT v_lean THEN
            -- The distinct keys (each at its first position) in the global
            -- lock order: by the lock's key, then position.
            SELECT array_agg(d.o), array_agg(d.o ORDER BY d.h, d.o), array_agg(d.h ORDER BY d.h, d.o)
              INTO v_firsts, v_ords, v_hashes
              FROM (SELECT min(u.o)::integer AS o, hashtext(claim_batch.source || chr(31) || u.k) AS h
                      FROM unnest(claim_batch.keys) WITH ORDINALITY u(k, o)
                     GROUP BY u.k) d;
            v_nfirst := cardinality(v_firsts);
        END IF;
    ELSE
        -- Each distinct key (at its first position) and its live row in
        -- the window, probed by its own index lookup (a lateral probe:
        -- `key = ANY(...)` under a generic plan filters every row of the
        -- source). A final answer is returned as it is read; the other keys
        -- are kept for their locks.
        v_nfirst := 0;
        FOR ord, outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining, v_month IN
            SELECT g.o, e.settled, NULL::bigint, e.attempts,
                   CASE WHEN e.settled IN ('in_progress', 'mismatch') THEN e.lease_expires_at END,
                   CASE WHEN e.settled = 'completed' THEN e.result END,
                   CASE WHEN e.settled IN ('failed', 'completed') THEN e.last_error END,
                   e.first_seen, e.expires_at,
                   CASE WHEN e.settled = 'in_progress' THEN greatest(e.lease_expires_at - v_now, interval '0') END,
                   e.first_seen_month
              FROM (SELECT min(u.o)::integer AS o, u.k
                      FROM unnest(claim_batch.keys) WITH ORDINALITY u(k, o)
                     GROUP BY u.k) g
              LEFT JOIN LATERAL (
                  SELECT x.first_seen_month, x.attempts, x.lease_expires_at, x.result, x.last_error, x.first_seen, x.expires_at,
                         idem.settled_outcome(x.status, x.retryable, x.lease_expires_at, x.fingerprint,
                                              claim_batch.fingerprints[g.o], v_now) AS settled
                    FROM idem.processed_events x
                   WHERE x.source = claim_batch.source AND x.key = g.k
                     AND x.first_seen_month >= v_lo AND x.first_seen_month <= v_hi
                     AND x.expires_at > v_now
                   LIMIT 1) e ON true
        LOOP
            -- (version 29) Each answer straight into the answer's columns.
            v_nfirst := v_nfirst + 1;
            IF outcome IS NULL THEN
                v_open := v_open || ord;
                CONTINUE;
            END IF;
            RETURN NEXT;
            -- Every answer read from a row is a duplicate (counted below).
            v_dups := v_dups + 1;
            IF v_per_key THEN
                f_ord := f_ord || ord;
                f_month := f_month || v_month;
            END IF;
        END LOOP;
        -- The keys without a final answer in the global lock order (by
        -- the lock's key, then position).
        IF cardinality(v_open) > 0 THEN
            SELECT array_agg(u.o ORDER BY u.h, u.o), array_agg(u.h ORDER BY u.h, u.o) INTO v_ords, v_hashes
              FROM (SELECT l.o, hashtext(claim_batch.source || chr(31) || claim_batch.keys[l.o]) AS h
                      FROM unnest(v_open) l(o)) u;
        END IF;
        IF v_nfirst < v_n THEN
            SELECT array_agg(g.o) INTO v_firsts
              FROM (SELECT min(u.o)::integer AS o FROM unnest(claim_batch.keys) WITH ORDINALITY u(k, o) GROUP BY u.k) g;
        END IF;
    END IF;

    -- Each remaining key's lock in that order, as idem.claim takes it: one
    -- statement tries them in order and stops at the first that another
    -- open transaction holds (LIMIT 1: the later ones are not tried). That
    -- key is answered by idem.claim at once (from what is committed when
    -- that is final, or after waiting for the lock until the batch's
    -- deadline), and the statement goes on after it: a batch never holds a
    -- later key while it waits for an earlier one.
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
        -- SERIALIZABLE: the transaction's snapshot predates whatever the
        -- holder commits, which idem.claim would not see after its wait
        -- (a row in another month's partition): wait for the lock here
        -- (polling, as idem.claim does, until the batch's deadline), and
        -- the key joins the others, read under the guard below.
        IF v_iso = 'serializable' THEN
            v_sleep := 0.001;
            LOOP
                IF pg_try_advisory_xact_lock(1768187245, v_hashes[v_busy]) THEN
                    v_locked := v_locked || v_ords[v_busy];
                    EXIT;
                END IF;
                EXIT WHEN clock_timestamp() >= v_until;
                PERFORM pg_sleep(least(v_sleep, greatest(extract(epoch FROM v_until - clock_timestamp()), 0)));
                v_sleep := least(v_sleep * 2, 0.05);
            END LOOP;
            IF v_locked[cardinality(v_locked)] IS NOT DISTINCT FROM v_ords[v_busy] THEN
                v_from := v_busy + 1;
                CONTINUE;
            END IF;
        END IF;
        SELECT * INTO c FROM idem.claim(claim_batch.source, claim_batch.keys[v_ords[v_busy]], claim_batch.fingerprints[v_ords[v_busy]],
                                        claim_batch.ttl, claim_batch.lease, claim_batch.event_types[v_ords[v_busy]],
                                        greatest(v_until - clock_timestamp(), interval '0'));
        ord := v_ords[v_busy]; outcome := c.outcome; token := c.token; attempt := c.attempt;
        lease_expires_at := c.lease_expires_at; result := c.result; error := c.error;
        first_seen := c.first_seen; expires_at := c.expires_at; lease_remaining := c.lease_remaining;
        RETURN NEXT;
        v_from := v_busy + 1;
    END LOOP;

    IF v_lean OR cardinality(v_locked) > 0 THEN
        -- The source's lookback, read again under the keys' locks, as
        -- idem.claim reads it (a claim that held one of them may have
        -- raised it); on the short path with whether the source has had a
        -- hold or has an adoption in progress.
        IF v_short THEN
            SELECT c.lookback, c.holds AND c.source <> '*', c.adopting AND c.source <> '*'
              INTO v_lookback, v_holds, v_adopting
              FROM idem.claim_settings c WHERE c.source IN (claim_batch.source, '*')
             ORDER BY c.source = '*' LIMIT 1;
            v_short := FOUND;
        END IF;
        IF NOT v_short THEN
            SELECT max(l.lookback) INTO v_lookback FROM idem.lookbacks l WHERE l.source IN (claim_batch.source, '*');
            v_adopting := EXISTS (SELECT 1 FROM idem.adoptions a WHERE a.source = claim_batch.source AND a.state = 'copying');
            v_holds := true;
        END IF;
        v_now := idem.clock();
        v_need := idem.days_at_most(greatest(v_ttl, v_lease));
        IF v_need > v_lookback THEN
            v_lookback := idem.raise_lookback(claim_batch.source, v_need);
        END IF;
        -- idem.claim's window: the oldest month that can hold a live row of
        -- the source to the month of tomorrow.
        v_lo := idem.window_start(v_now, v_lookback);
        v_hi := idem.utc_month(v_now + interval '1 day');
        v_cur := idem.utc_month(v_now);
        v_base := idem.new_token();

        -- SERIALIZABLE: the transaction's snapshot may predate a claim of
        -- one of these keys that committed into another month's partition
        -- before this call took the key's lock, and the probe below would
        -- not see its row. An insert meets every committed row of its
        -- partition's unique index, visible or not, and fails with a
        -- serialization failure on one it cannot see: so a placeholder of
        -- each key goes into every other month of the window, and those
        -- inserted (no row of the key there) are deleted again. A visible
        -- row there is found by the probe as usual.
        IF v_iso = 'serializable' THEN
            WITH g AS (
                INSERT INTO idem.processed_events AS e
                       (source, key, first_seen_month, status, attempts, token, first_seen, updated_at, expires_at)
                SELECT claim_batch.source, claim_batch.keys[l.o], m.m, 'processing', 1, 0, v_now, v_now, v_now
                  FROM unnest(v_locked) l(o),
                       (SELECT d::date AS m FROM generate_series(v_lo, v_hi, interval '1 month') d) m
                 WHERE m.m <> v_cur
                ON CONFLICT DO NOTHING
                RETURNING e.key, e.first_seen_month)
            SELECT array_agg(g.key), array_agg(g.first_seen_month) INTO v_gkeys, v_gmonths FROM g;
            IF v_gkeys IS NOT NULL THEN
                DELETE FROM idem.processed_events e
                 USING unnest(v_gkeys, v_gmonths) g(k, m)
                 WHERE e.source = claim_batch.source AND e.key = g.k AND e.first_seen_month = g.m AND e.token = 0;
            END IF;
        END IF;

        -- (version 29) The short path, every key locked at once: one
        -- statement inserts into the current month, in position order, the
        -- keys with no live row in the window's other months (each an index
        -- lookup, as below) and, for a source that has had holds, no queue
        -- hold, and answers each position as it yields it (into the
        -- answer's columns: no step per field): an inserted key acquired, a
        -- key with a settled live row in the window (a duplicate, in this
        -- month or another) from that row. A batch of new keys, or of new
        -- keys and duplicates, ends here. The positions without an answer
        -- (a lost lease or retryable failure to take over, a hold, an
        -- expired row in the current month, a repeated new key's later
        -- positions, which meet its first; all of them if an adoption
        -- started meanwhile) go on as below: each distinct key at its first
        -- position by the statement that answers locked keys, the repeated
        -- ones at the end.
        IF v_lean THEN
            IF NOT v_adopting THEN
                FOR ord, outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining, v_month IN
                WITH ins AS (
                    INSERT INTO idem.processed_events AS e
                           (source, key, first_seen_month, event_type, status, attempts, token,
                            lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
                    SELECT claim_batch.source, u.k, v_cur, claim_batch.event_types[u.o],
                           'processing', 1, greatest(v_base # (u.o * 2654435761), 1), v_now + v_lease,
                           claim_batch.fingerprints[u.o], v_now, v_now, v_now + greatest(v_ttl, v_lease)
                      FROM unnest(claim_batch.keys) WITH ORDINALITY u(k, o)
                      LEFT JOIN LATERAL (
                          (SELECT 1 FROM idem.processed_events x
                            WHERE x.source = claim_batch.source AND x.key = u.k
                              AND x.first_seen_month >= v_lo AND x.first_seen_month < v_cur
                              AND x.expires_at > v_now
                            LIMIT 1)
                          UNION ALL
                          (SELECT 1 FROM idem.processed_events x
                            WHERE x.source = claim_batch.source AND x.key = u.k
                              AND x.first_seen_month >= (v_cur + interval '1 month')::date AND x.first_seen_month <= v_hi
                              AND x.expires_at > v_now
                            LIMIT 1)
                          LIMIT 1) w(found) ON true
                      LEFT JOIN LATERAL (
                          SELECT true FROM idem.holds y
                           WHERE v_holds AND y.source = claim_batch.source AND y.key = u.k AND y.state = 'queued'
                           LIMIT 1) h(held) ON true
                     WHERE w.found IS NULL AND h.held IS NULL
                     ORDER BY u.o
                    ON CONFLICT DO NOTHING
                    RETURNING e.key, e.token, e.attempts, e.lease_expires_at, e.first_seen, e.expires_at)
                SELECT u.o::integer, coalesce(CASE WHEN i.key IS NOT NULL THEN 'acquired' END, r.settled),
                       i.token, coalesce(i.attempts, r.attempts),
                       CASE WHEN i.key IS NOT NULL THEN i.lease_expires_at
                            WHEN r.settled IN ('in_progress', 'mismatch') THEN r.lease_expires_at END,
                       CASE WHEN r.settled = 'completed' THEN r.result END,
                       CASE WHEN r.settled IN ('failed', 'completed') THEN r.last_error END,
                       coalesce(i.first_seen, r.first_seen), coalesce(i.expires_at, r.expires_at),
                       CASE WHEN i.key IS NOT NULL THEN v_lease
                            WHEN r.settled = 'in_progress' THEN greatest(r.lease_expires_at - v_now, interval '0') END,
                       r.first_seen_month
                  FROM unnest(claim_batch.keys) WITH ORDINALITY u(k, o)
                  LEFT JOIN ins i ON i.key = u.k AND i.token = greatest(v_base # (u.o * 2654435761), 1)
                  -- A key not inserted: its live row in the window (as the
                  -- statement's snapshot has it, without the rows the
                  -- statement inserts), answered when settled.
                  LEFT JOIN LATERAL (
                      SELECT x.first_seen_month, x.attempts, x.lease_expires_at, x.result, x.last_error, x.first_seen, x.expires_at,
                             idem.settled_outcome(x.status, x.retryable, x.lease_expires_at, x.fingerprint,
                                                  claim_batch.fingerprints[u.o], v_now) AS settled
                        FROM idem.processed_events x
                       WHERE i.key IS NULL AND x.source = claim_batch.source AND x.key = u.k
                         AND x.first_seen_month >= v_lo AND x.first_seen_month <= v_hi
                         AND x.expires_at > v_now
                       LIMIT 1) r ON true
                LOOP
                    IF outcome IS NULL THEN
                        v_rest := v_rest || ord;
                        CONTINUE;
                    END IF;
                    RETURN NEXT;
                    IF outcome = 'acquired' THEN
                        v_acq := v_acq + 1;
                    ELSE
                        -- An answer read from a row: a duplicate (counted below).
                        v_dups := v_dups + 1;
                        IF v_per_key THEN
                            f_ord := f_ord || ord;
                            f_month := f_month || v_month;
                        END IF;
                    END IF;
                END LOOP;
            END IF;
            IF cardinality(v_rest) = 0 AND NOT v_adopting THEN
                v_nfirst := v_n;
            ELSE
                -- The positions without an answer (all of them when an
                -- adoption started between the two reads of the settings):
                -- each distinct key's first one is answered below as a
                -- locked key, a repeated key's later ones at the end (every
                -- position answered already counts as a first: the end
                -- skips it).
                SELECT coalesce(array_agg(g.o) FILTER (WHERE g.o = g.f AND (v_adopting OR g.o = ANY (v_rest))), '{}'),
                       array_agg(g.o) FILTER (WHERE g.o = g.f OR NOT (v_adopting OR g.o = ANY (v_rest)))
                  INTO v_locked, v_firsts
                  FROM (SELECT u.o::integer AS o, min(u.o) OVER (PARTITION BY u.k)::integer AS f
                          FROM unnest(claim_batch.keys) WITH ORDINALITY u(k, o)) g;
                v_nfirst := cardinality(v_firsts);
            END IF;
        END IF;

        IF cardinality(v_locked) > 0 THEN
            -- One statement for the locked keys' common answers, read again
            -- under their locks with a new snapshot:
            -- * p: each key's live row in the window's other months (before
            --   and after the current one, each an index lookup); a settled
            --   one answers as idem.claim answers it; for a key with none, its
            --   queue hold (a probe with LIMIT: an EXISTS may be planned as a
            --   hash of every hold of the source);
            -- * ins: a key with no row there and no hold is inserted into the
            --   current month (ON CONFLICT DO NOTHING: the unique index reads
            --   the current month for it, so it is not probed first): acquired;
            -- * cur: a key the insert met a row of, or a held key, is answered
            --   from its live row in the current month when that is settled;
            --   a held key without one is in_progress.
            -- What is left (a lost lease or a retryable failure to take over,
            -- an expired row in the current month, a key while its source's
            -- legacy table is adopted) is idem.claim's, below. Each answer is
            -- returned as the statement yields it.
            -- On Citus the statement is also each shard's claim_locked
            -- (migration 30): idem.citus_claim_locked_definition cuts out
            -- the lines between the two claim_locked markers below (keep
            -- them around the whole statement, and nowhere else). It may
            -- use only claim_batch.source, .keys, .fingerprints and
            -- .event_types and the variables v_locked, v_now, v_lo, v_hi,
            -- v_cur, v_ttl, v_lease, v_adopting, v_holds and v_base (else no
            -- claim_locked is made), and its columns are those of this
            -- loop's targets (claim_locked returns them).
            FOR ord, outcome, token, attempt, lease_expires_at, result, error, first_seen, expires_at, lease_remaining, v_month IN
            -- <claim_locked>
            WITH p AS MATERIALIZED (
                SELECT l.o, claim_batch.keys[l.o] AS k, e.*,
                       CASE WHEN e.status IS NULL AND NOT v_adopting THEN h.held IS NOT NULL END AS held,
                       idem.settled_outcome(e.status, e.retryable, e.lease_expires_at, e.fingerprint,
                                            claim_batch.fingerprints[l.o], v_now) AS settled
                  FROM unnest(v_locked) l(o)
                  LEFT JOIN LATERAL (
                      (SELECT x.first_seen_month, x.status, x.attempts, x.lease_expires_at, x.fingerprint, x.result,
                              x.last_error, x.retryable, x.first_seen, x.expires_at
                         FROM idem.processed_events x
                        WHERE x.source = claim_batch.source AND x.key = claim_batch.keys[l.o]
                          AND x.first_seen_month >= v_lo AND x.first_seen_month < v_cur
                          AND x.expires_at > v_now
                        LIMIT 1)
                      UNION ALL
                      (SELECT x.first_seen_month, x.status, x.attempts, x.lease_expires_at, x.fingerprint, x.result,
                              x.last_error, x.retryable, x.first_seen, x.expires_at
                         FROM idem.processed_events x
                        WHERE x.source = claim_batch.source AND x.key = claim_batch.keys[l.o]
                          AND x.first_seen_month >= (v_cur + interval '1 month')::date AND x.first_seen_month <= v_hi
                          AND x.expires_at > v_now
                        LIMIT 1)
                      LIMIT 1) e ON true
                  LEFT JOIN LATERAL (
                      SELECT true AS held FROM idem.holds y
                       WHERE v_holds AND y.source = claim_batch.source AND y.key = claim_batch.keys[l.o] AND y.state = 'queued'
                       LIMIT 1) h ON e.status IS NULL AND NOT v_adopting),
            ins AS (
                INSERT INTO idem.processed_events AS e
                       (source, key, first_seen_month, event_type, status, attempts, token,
                        lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
                SELECT claim_batch.source, p.k, v_cur, claim_batch.event_types[p.o],
                       'processing', 1, greatest(v_base # (p.o::bigint * 2654435761), 1), v_now + v_lease,
                       claim_batch.fingerprints[p.o], v_now, v_now, v_now + greatest(v_ttl, v_lease)
                  FROM p WHERE p.held = false
                ON CONFLICT DO NOTHING
                RETURNING e.key, e.token, e.attempts, e.lease_expires_at, e.first_seen, e.expires_at),
            cur AS MATERIALIZED (
                SELECT p.o, p.held, r.*,
                       idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint,
                                            claim_batch.fingerprints[p.o], v_now) AS settled
                  FROM p
                  LEFT JOIN LATERAL (
                      SELECT x.first_seen_month, x.status, x.attempts, x.lease_expires_at, x.fingerprint, x.result,
                             x.last_error, x.retryable, x.first_seen, x.expires_at
                        FROM idem.processed_events x
                       WHERE x.source = claim_batch.source AND x.key = p.k
                         AND x.first_seen_month = v_cur AND x.expires_at > v_now
                       LIMIT 1) r ON true
                 WHERE p.held IS NOT NULL AND NOT EXISTS (SELECT 1 FROM ins i WHERE i.key = p.k)),
            a AS (
                SELECT p.o, p.settled AS outcome, NULL::bigint AS token, p.attempts,
                       CASE WHEN p.settled IN ('in_progress', 'mismatch') THEN p.lease_expires_at END AS lease_at,
                       CASE WHEN p.settled = 'completed' THEN p.result END AS result,
                       CASE WHEN p.settled IN ('failed', 'completed') THEN p.last_error END AS error,
                       p.first_seen, p.expires_at,
                       CASE WHEN p.settled = 'in_progress' THEN greatest(p.lease_expires_at - v_now, interval '0') END AS left_,
                       p.first_seen_month AS month
                  FROM p WHERE p.settled IS NOT NULL
                UNION ALL
                SELECT r.o, r.settled, NULL, r.attempts,
                       CASE WHEN r.settled IN ('in_progress', 'mismatch') THEN r.lease_expires_at END,
                       CASE WHEN r.settled = 'completed' THEN r.result END,
                       CASE WHEN r.settled IN ('failed', 'completed') THEN r.last_error END,
                       r.first_seen, r.expires_at,
                       CASE WHEN r.settled = 'in_progress' THEN greatest(r.lease_expires_at - v_now, interval '0') END,
                       r.first_seen_month
                  FROM cur r WHERE r.settled IS NOT NULL
                UNION ALL
                SELECT r.o, 'in_progress', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
                  FROM cur r WHERE r.held AND r.status IS NULL
                UNION ALL
                SELECT p.o, 'acquired', i.token, i.attempts, i.lease_expires_at, NULL, NULL, i.first_seen, i.expires_at,
                       v_lease, NULL
                  FROM ins i JOIN p ON p.k = i.key)
            SELECT a.o, a.outcome, a.token, a.attempts, a.lease_at, a.result, a.error, a.first_seen, a.expires_at,
                   a.left_, a.month
              FROM a
            -- </claim_locked>
            LOOP
                RETURN NEXT;
                a_ord := a_ord || ord;
                IF outcome = 'acquired' THEN
                    v_acq := v_acq + 1;
                ELSIF v_month IS NOT NULL THEN
                    -- An answer read from a row: a duplicate (counted below).
                    v_dups := v_dups + 1;
                    IF v_per_key THEN
                        f_ord := f_ord || ord;
                        f_month := f_month || v_month;
                    END IF;
                END IF;
            END LOOP;
        END IF;
    END IF;

    -- Counting, as idem.claim counts (not in SERIALIZABLE; v_sample 0
    -- turns it off): the acquisitions in idem.activity, every one; the
    -- duplicates (every answer read from a row, before the locks or after)
    -- as idem.count_duplicate counts them, the batch weighed as one claim
    -- (idem.claim_weight): all of them while the source's claims this
    -- minute are below idem.exact_counting_rate(); above it 1 batch in
    -- v_sample counts all of its duplicates, each as v_sample, and the
    -- others count none. A redelivered batch then mostly
    -- writes nothing, as a duplicate claim mostly writes nothing. Per key,
    -- each duplicate is sampled as idem.claim samples it.
    IF v_sample > 0 AND v_iso <> 'serializable' THEN
        IF v_acq > 0 THEN
            PERFORM idem.count_activity(claim_batch.source, v_now, v_acq, 0);
        END IF;
        IF v_dups > 0 AND NOT v_per_key THEN
            v_weight := idem.claim_weight(claim_batch.source, v_sample, v_now);
            IF v_weight > 0 THEN
                PERFORM idem.count_duplicate(claim_batch.source, NULL, NULL, v_dups * v_weight, false, v_now);
            END IF;
        ELSIF v_dups > 0 THEN
            PERFORM idem.count_duplicate(claim_batch.source, claim_batch.keys[x.o], x.month, v_sample, true, v_now)
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
            SELECT * INTO c FROM idem.claim(claim_batch.source, claim_batch.keys[v_i], claim_batch.fingerprints[v_i],
                                            claim_batch.ttl, claim_batch.lease, claim_batch.event_types[v_i],
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
        FOR v_i IN SELECT u.o FROM generate_subscripts(claim_batch.keys, 1) u(o)
                    WHERE u.o <> ALL (v_firsts) ORDER BY u.o LOOP
            SELECT * INTO c FROM idem.claim(claim_batch.source, claim_batch.keys[v_i], claim_batch.fingerprints[v_i],
                                            claim_batch.ttl, claim_batch.lease, claim_batch.event_types[v_i],
                                            greatest(v_until - clock_timestamp(), interval '0'));
            ord := v_i; outcome := c.outcome; token := c.token; attempt := c.attempt;
            lease_expires_at := c.lease_expires_at; result := c.result; error := c.error;
            first_seen := c.first_seen; expires_at := c.expires_at; lease_remaining := c.lease_remaining;
            RETURN NEXT;
        END LOOP;
    END IF;
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
CREATE OR REPLACE FUNCTION idem.claim_batch(source text, keys text[], fingerprints text[] DEFAULT NULL::text[], ttl interval DEFAULT NULL::interval, lease interval DEFAULT NULL::interval, event_types text[] DEFAULT NULL::text[], lock_wait interval DEFAULT NULL::interval)
 RETURNS TABLE(ord integer, outcome text, token bigint, attempt integer, lease_expires_at timestamp with time zone, result jsonb, error text, first_seen timestamp with time zone, expires_at timestamp with time zone, lease_remaining interval)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
DECLARE
    v_iso      text := current_setting('transaction_isolation');
    v_n        integer := cardinality(claim_batch.keys);
    v_now      timestamptz;
    v_cur      date;               -- the current month: where a new key goes
    v_ttl      interval;
    v_lease    interval;
    v_max      integer;
    v_sample   integer;
    v_per_key  boolean;
    v_lookback interval;
    v_need     interval;
    v_lo       date;
    v_hi       date;
    v_until    timestamptz;
    v_adopting boolean;
    v_base     bigint;             -- the batch's token; each acquired key's is derived from it
    v_firsts   integer[];          -- every distinct key's first position
    v_ords     integer[];          -- the positions to lock (no final answer yet), in lock order
    v_hashes   integer[];          -- their lock keys
    v_locked   integer[] := '{}';  -- the positions whose key this call has locked
    v_from     integer;            -- the next position of v_ords to lock
    v_busy     integer;            -- a position of v_ords whose lock is busy
    v_gkeys    text[];             -- SERIALIZABLE: placeholders to delete
    v_sleep    double precision;
    v_gmonths  date[];
    v_slow     integer[];          -- the positions idem.claim answers
    v_i        integer;
    v_acq      integer := 0;
    v_dups     integer := 0;
    c          record;
    kr         record;             -- a key read before the locks
    ar         record;             -- a locked key's answer
    v_nfirst   integer;            -- the distinct keys
    v_open     integer[] := '{}';  -- read before the locks: the positions without a final answer
    v_weight   integer;
    a_ord      integer[] := '{}';  -- the locked keys answered by the set-based statement
    -- The duplicates' positions and months, for per-key counting.
    f_ord      integer[];
    f_month    date[];
BEGIN
    IF v_iso = 'repeatable read' THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'idem.claim_batch: REPEATABLE READ is not supported',
            DETAIL = 'A repeatable-read snapshot cannot see a claim of the same key committed in another monthly partition after the snapshot was taken, so a duplicate could run.',
            HINT = 'Claim in READ COMMITTED (the default) or SERIALIZABLE.';
    END IF;
    -- Every input check as one expression; only bad input takes the path
    -- that names the problem and the item.
    IF claim_batch.source IS NULL OR octet_length(claim_batch.source) NOT BETWEEN 1 AND 64
       OR btrim(claim_batch.source, E' \t\r\n') = '' OR claim_batch.source ~ '[\x01-\x1f\x7f]'
       OR v_n IS NULL OR v_n NOT BETWEEN 1 AND 1000
       OR array_ndims(claim_batch.keys) <> 1 OR array_lower(claim_batch.keys, 1) <> 1
       OR (claim_batch.fingerprints IS NOT NULL AND (array_ndims(claim_batch.fingerprints) <> 1
           OR array_lower(claim_batch.fingerprints, 1) <> 1 OR cardinality(claim_batch.fingerprints) <> v_n))
       OR (claim_batch.event_types IS NOT NULL AND (array_ndims(claim_batch.event_types) <> 1
           OR array_lower(claim_batch.event_types, 1) <> 1 OR cardinality(claim_batch.event_types) <> v_n))
       OR EXISTS (SELECT 1 FROM unnest(claim_batch.keys, claim_batch.fingerprints, claim_batch.event_types) x(k, f, t)
                   WHERE x.k IS NULL OR octet_length(x.k) NOT BETWEEN 1 AND 512 OR btrim(x.k, E' \t\r\n') = ''
                      OR octet_length(x.f) > 512 OR octet_length(x.t) > 256)
       OR (claim_batch.ttl IS NOT NULL AND NOT idem.valid_ttl(claim_batch.ttl))
       OR (claim_batch.lease IS NOT NULL AND NOT idem.valid_lease(claim_batch.lease))
       OR (claim_batch.lock_wait IS NOT NULL AND NOT (claim_batch.lock_wait >= interval '0' AND claim_batch.lock_wait <= interval '1 hour')) THEN
        PERFORM idem.check_batch('idem.claim_batch', claim_batch.source, v_n, claim_batch.keys, claim_batch.fingerprints);
        PERFORM idem.check_batch('idem.claim_batch', claim_batch.source, v_n, claim_batch.keys, claim_batch.event_types);
        FOR v_i IN 1 .. v_n LOOP
            -- idem.claim's own checks, naming the item.
            PERFORM idem.check_key(format('idem.claim_batch (item %s)', v_i), claim_batch.source, claim_batch.keys[v_i]);
            IF octet_length(claim_batch.fingerprints[v_i]) > 512 THEN
                RAISE EXCEPTION USING ERRCODE = '22001',
                    MESSAGE = format('idem.claim_batch (item %s): fingerprint is longer than 512 bytes', v_i),
                    HINT = 'Pass a hash of the request, not the request.';
            END IF;
            IF octet_length(claim_batch.event_types[v_i]) > 256 THEN
                RAISE EXCEPTION USING ERRCODE = '22001',
                    MESSAGE = format('idem.claim_batch (item %s): event_type is longer than 256 bytes', v_i);
            END IF;
        END LOOP;
        -- ttl, lease and lock_wait: idem.claim checks them as it checks its
        -- own (the first item's call raises).
        PERFORM idem.claim(claim_batch.source, claim_batch.keys[1], NULL, claim_batch.ttl, claim_batch.lease,
                           NULL, claim_batch.lock_wait);
        RAISE EXCEPTION USING ERRCODE = 'XX000', MESSAGE = 'idem.claim_batch: an input check disagrees with idem.claim';
    END IF;
    IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL AND idem.distributed() THEN
        RAISE EXCEPTION USING ERRCODE = 'ID006',
            MESSAGE = 'idem.claim_batch is not supported on a distributed (Citus) installation',
            DETAIL = 'The keys of a batch live on several nodes; a per-key lock excludes only the claims of the node it is taken on.',
            HINT = 'Claim each key with idem.claim, which Citus delegates to the key''s node.';
    END IF;
    v_until := clock_timestamp() + coalesce(claim_batch.lock_wait, interval '5 seconds');

    -- The source's policy, and its lookback for the window of the first
    -- read (a lookback raised meanwhile only makes that read miss a row,
    -- and a key it does not answer is read again under its lock below,
    -- with the lookback read again there, as idem.claim reads it).
    SELECT x.ttl, x.lease, x.max_attempts, x.duplicate_sampling, x.count_per_key,
           (SELECT max(l.lookback) FROM idem.lookbacks l WHERE l.source IN (claim_batch.source, '*'))
      INTO v_ttl, v_lease, v_max, v_sample, v_per_key, v_lookback
      FROM (SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
              FROM idem.policies p WHERE p.source = claim_batch.source
            UNION ALL
            SELECT p.ttl, p.lease, p.max_attempts, p.duplicate_sampling, p.count_per_key
              FROM idem.policies p WHERE p.source = '*'
             LIMIT 1) x;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = '42704',
            MESSAGE = format('idem.claim_batch: no policy for source %L and no default policy', claim_batch.source),
            HINT = 'Insert a row for the source, or the default row with source ''*'', into idem.policies.';
    END IF;
    v_ttl := coalesce(claim_batch.ttl, v_ttl);
    v_lease := coalesce(claim_batch.lease, v_lease);
    IF v_lease > v_ttl THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('idem.claim_batch: lease %s is longer than ttl %s', v_lease, v_ttl);
    END IF;
    v_now := idem.clock();
    -- The window of the first read: the oldest month that can hold a live
    -- row of the source to the month of tomorrow. Computed once here: in a
    -- probe's condition it would be computed again for every key.
    v_lo := idem.window_start(v_now, v_lookback);
    v_hi := idem.utc_month(v_now + interval '1 day');

    -- A batch whose first key already has a final answer (completed,
    -- failed for good, a mismatch, a live lease) is most likely a
    -- redelivery: its keys are read first, before any lock, and those with
    -- a final answer answer at once, as idem.claim answers from what is
    -- committed when a key's lock is busy; a duplicate then takes no lock
    -- and writes nothing. Any other batch goes to its locks at once, and
    -- its keys are read there (a new key is then looked up once, by its
    -- insert). Both paths give each key the same answer.
    PERFORM 1
      FROM idem.processed_events x
     WHERE x.source = claim_batch.source AND x.key = claim_batch.keys[1]
       AND x.first_seen_month >= v_lo AND x.first_seen_month <= v_hi
       AND x.expires_at > v_now
       AND idem.settled_outcome(x.status, x.retryable, x.lease_expires_at, x.fingerprint,
                                claim_batch.fingerprints[1], v_now) IS NOT NULL
     LIMIT 1;
    IF NOT FOUND THEN
        -- The distinct keys (each at its first position) in the global
        -- lock order: by the lock's key, then position.
        SELECT array_agg(d.o), array_agg(d.o ORDER BY d.h, d.o), array_agg(d.h ORDER BY d.h, d.o)
          INTO v_firsts, v_ords, v_hashes
          FROM (SELECT min(u.o)::integer AS o, hashtext(claim_batch.source || chr(31) || u.k) AS h
                  FROM unnest(claim_batch.keys) WITH ORDINALITY u(k, o)
                 GROUP BY u.k) d;
        v_nfirst := cardinality(v_firsts);
    ELSE
        -- Each distinct key (at its first position) and its live row in
        -- the window, probed by its own index lookup (a lateral probe:
        -- `key = ANY(...)` under a generic plan filters every row of the
        -- source). A final answer is returned as it is read; the other keys
        -- are kept for their locks.
        v_nfirst := 0;
        FOR kr IN
            SELECT g.o, e.first_seen_month AS month, e.attempts, e.lease_expires_at, e.result, e.last_error,
                   e.first_seen, e.expires_at,
                   idem.settled_outcome(e.status, e.retryable, e.lease_expires_at, e.fingerprint,
                                        claim_batch.fingerprints[g.o], v_now) AS settled
              FROM (SELECT min(u.o)::integer AS o, u.k
                      FROM unnest(claim_batch.keys) WITH ORDINALITY u(k, o)
                     GROUP BY u.k) g
              LEFT JOIN LATERAL (
                  SELECT x.first_seen_month, x.status, x.attempts, x.lease_expires_at, x.fingerprint, x.result,
                         x.last_error, x.retryable, x.first_seen, x.expires_at
                    FROM idem.processed_events x
                   WHERE x.source = claim_batch.source AND x.key = g.k
                     AND x.first_seen_month >= v_lo AND x.first_seen_month <= v_hi
                     AND x.expires_at > v_now
                   LIMIT 1) e ON true
        LOOP
            v_nfirst := v_nfirst + 1;
            IF kr.settled IS NULL THEN
                v_open := v_open || kr.o;
                CONTINUE;
            END IF;
            ord := kr.o; outcome := kr.settled; token := NULL; attempt := kr.attempts;
            lease_expires_at := CASE WHEN kr.settled IN ('in_progress', 'mismatch') THEN kr.lease_expires_at END;
            result := CASE WHEN kr.settled = 'completed' THEN kr.result END;
            error := CASE WHEN kr.settled IN ('failed', 'completed') THEN kr.last_error END;
            first_seen := kr.first_seen; expires_at := kr.expires_at;
            lease_remaining := CASE WHEN kr.settled = 'in_progress' THEN greatest(kr.lease_expires_at - v_now, interval '0') END;
            RETURN NEXT;
            -- Every answer read from a row is a duplicate (counted below).
            v_dups := v_dups + 1;
            IF v_per_key THEN
                f_ord := f_ord || kr.o;
                f_month := f_month || kr.month;
            END IF;
        END LOOP;
        -- The keys without a final answer in the global lock order (by
        -- the lock's key, then position).
        IF cardinality(v_open) > 0 THEN
            SELECT array_agg(u.o ORDER BY u.h, u.o), array_agg(u.h ORDER BY u.h, u.o) INTO v_ords, v_hashes
              FROM (SELECT l.o, hashtext(claim_batch.source || chr(31) || claim_batch.keys[l.o]) AS h
                      FROM unnest(v_open) l(o)) u;
        END IF;
        IF v_nfirst < v_n THEN
            SELECT array_agg(g.o) INTO v_firsts
              FROM (SELECT min(u.o)::integer AS o FROM unnest(claim_batch.keys) WITH ORDINALITY u(k, o) GROUP BY u.k) g;
        END IF;
    END IF;

    -- Each remaining key's lock in that order, as idem.claim takes it: one
    -- statement tries them in order and stops at the first that another
    -- open transaction holds (LIMIT 1: the later ones are not tried). That
    -- key is answered by idem.claim at once (from what is committed when
    -- that is final, or after waiting for the lock until the batch's
    -- deadline), and the statement goes on after it: a batch never holds a
    -- later key while it waits for an earlier one.
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
        -- SERIALIZABLE: the transaction's snapshot predates whatever the
        -- holder commits, which idem.claim would not see after its wait
        -- (a row in another month's partition): wait for the lock here
        -- (polling, as idem.claim does, until the batch's deadline), and
        -- the key joins the others, read under the guard below.
        IF v_iso = 'serializable' THEN
            v_sleep := 0.001;
            LOOP
                IF pg_try_advisory_xact_lock(1768187245, v_hashes[v_busy]) THEN
                    v_locked := v_locked || v_ords[v_busy];
                    EXIT;
                END IF;
                EXIT WHEN clock_timestamp() >= v_until;
                PERFORM pg_sleep(least(v_sleep, greatest(extract(epoch FROM v_until - clock_timestamp()), 0)));
                v_sleep := least(v_sleep * 2, 0.05);
            END LOOP;
            IF v_locked[cardinality(v_locked)] IS NOT DISTINCT FROM v_ords[v_busy] THEN
                v_from := v_busy + 1;
                CONTINUE;
            END IF;
        END IF;
        SELECT * INTO c FROM idem.claim(claim_batch.source, claim_batch.keys[v_ords[v_busy]], claim_batch.fingerprints[v_ords[v_busy]],
                                        claim_batch.ttl, claim_batch.lease, claim_batch.event_types[v_ords[v_busy]],
                                        greatest(v_until - clock_timestamp(), interval '0'));
        ord := v_ords[v_busy]; outcome := c.outcome; token := c.token; attempt := c.attempt;
        lease_expires_at := c.lease_expires_at; result := c.result; error := c.error;
        first_seen := c.first_seen; expires_at := c.expires_at; lease_remaining := c.lease_remaining;
        RETURN NEXT;
        v_from := v_busy + 1;
    END LOOP;

    IF cardinality(v_locked) > 0 THEN
        -- The source's lookback, read again under the keys' locks, as
        -- idem.claim reads it (a claim that held one of them may have
        -- raised it).
        SELECT max(l.lookback) INTO v_lookback FROM idem.lookbacks l WHERE l.source IN (claim_batch.source, '*');
        v_now := idem.clock();
        v_need := idem.days_at_most(greatest(v_ttl, v_lease));
        IF v_need > v_lookback THEN
            v_lookback := idem.raise_lookback(claim_batch.source, v_need);
        END IF;
        -- idem.claim's window: the oldest month that can hold a live row of
        -- the source to the month of tomorrow.
        v_lo := idem.window_start(v_now, v_lookback);
        v_hi := idem.utc_month(v_now + interval '1 day');
        v_cur := idem.utc_month(v_now);
        v_adopting := EXISTS (SELECT 1 FROM idem.adoptions a WHERE a.source = claim_batch.source AND a.state = 'copying');
        v_base := idem.new_token();

        -- SERIALIZABLE: the transaction's snapshot may predate a claim of
        -- one of these keys that committed into another month's partition
        -- before this call took the key's lock, and the probe below would
        -- not see its row. An insert meets every committed row of its
        -- partition's unique index, visible or not, and fails with a
        -- serialization failure on one it cannot see: so a placeholder of
        -- each key goes into every other month of the window, and those
        -- inserted (no row of the key there) are deleted again. A visible
        -- row there is found by the probe as usual.
        IF v_iso = 'serializable' THEN
            WITH g AS (
                INSERT INTO idem.processed_events AS e
                       (source, key, first_seen_month, status, attempts, token, first_seen, updated_at, expires_at)
                SELECT claim_batch.source, claim_batch.keys[l.o], m.m, 'processing', 1, 0, v_now, v_now, v_now
                  FROM unnest(v_locked) l(o),
                       (SELECT d::date AS m FROM generate_series(v_lo, v_hi, interval '1 month') d) m
                 WHERE m.m <> v_cur
                ON CONFLICT DO NOTHING
                RETURNING e.key, e.first_seen_month)
            SELECT array_agg(g.key), array_agg(g.first_seen_month) INTO v_gkeys, v_gmonths FROM g;
            IF v_gkeys IS NOT NULL THEN
                DELETE FROM idem.processed_events e
                 USING unnest(v_gkeys, v_gmonths) g(k, m)
                 WHERE e.source = claim_batch.source AND e.key = g.k AND e.first_seen_month = g.m AND e.token = 0;
            END IF;
        END IF;

        -- One statement for the locked keys' common answers, read again
        -- under their locks with a new snapshot:
        -- * p: each key's live row in the window's other months (before
        --   and after the current one, each an index lookup); a settled
        --   one answers as idem.claim answers it; for a key with none, its
        --   queue hold (a probe with LIMIT: an EXISTS may be planned as a
        --   hash of every hold of the source);
        -- * ins: a key with no row there and no hold is inserted into the
        --   current month (ON CONFLICT DO NOTHING: the unique index reads
        --   the current month for it, so it is not probed first): acquired;
        -- * cur: a key the insert met a row of, or a held key, is answered
        --   from its live row in the current month when that is settled;
        --   a held key without one is in_progress.
        -- What is left (a lost lease or a retryable failure to take over,
        -- an expired row in the current month, a key while its source's
        -- legacy table is adopted) is idem.claim's, below. Each answer is
        -- returned as the statement yields it.
        FOR ar IN
        WITH p AS MATERIALIZED (
            SELECT l.o, claim_batch.keys[l.o] AS k, e.*,
                   CASE WHEN e.status IS NULL AND NOT v_adopting THEN h.held IS NOT NULL END AS held,
                   idem.settled_outcome(e.status, e.retryable, e.lease_expires_at, e.fingerprint,
                                        claim_batch.fingerprints[l.o], v_now) AS settled
              FROM unnest(v_locked) l(o)
              LEFT JOIN LATERAL (
                  (SELECT x.first_seen_month, x.status, x.attempts, x.lease_expires_at, x.fingerprint, x.result,
                          x.last_error, x.retryable, x.first_seen, x.expires_at
                     FROM idem.processed_events x
                    WHERE x.source = claim_batch.source AND x.key = claim_batch.keys[l.o]
                      AND x.first_seen_month >= v_lo AND x.first_seen_month < v_cur
                      AND x.expires_at > v_now
                    LIMIT 1)
                  UNION ALL
                  (SELECT x.first_seen_month, x.status, x.attempts, x.lease_expires_at, x.fingerprint, x.result,
                          x.last_error, x.retryable, x.first_seen, x.expires_at
                     FROM idem.processed_events x
                    WHERE x.source = claim_batch.source AND x.key = claim_batch.keys[l.o]
                      AND x.first_seen_month >= (v_cur + interval '1 month')::date AND x.first_seen_month <= v_hi
                      AND x.expires_at > v_now
                    LIMIT 1)
                  LIMIT 1) e ON true
              LEFT JOIN LATERAL (
                  SELECT true AS held FROM idem.holds y
                   WHERE y.source = claim_batch.source AND y.key = claim_batch.keys[l.o] AND y.state = 'queued'
                   LIMIT 1) h ON e.status IS NULL AND NOT v_adopting),
        ins AS (
            INSERT INTO idem.processed_events AS e
                   (source, key, first_seen_month, event_type, status, attempts, token,
                    lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
            SELECT claim_batch.source, p.k, v_cur, claim_batch.event_types[p.o],
                   'processing', 1, greatest(v_base # (p.o::bigint * 2654435761), 1), v_now + v_lease,
                   claim_batch.fingerprints[p.o], v_now, v_now, v_now + greatest(v_ttl, v_lease)
              FROM p WHERE p.held = false
            ON CONFLICT DO NOTHING
            RETURNING e.key, e.token, e.attempts, e.lease_expires_at, e.first_seen, e.expires_at),
        cur AS MATERIALIZED (
            SELECT p.o, p.held, r.*,
                   idem.settled_outcome(r.status, r.retryable, r.lease_expires_at, r.fingerprint,
                                        claim_batch.fingerprints[p.o], v_now) AS settled
              FROM p
              LEFT JOIN LATERAL (
                  SELECT x.first_seen_month, x.status, x.attempts, x.lease_expires_at, x.fingerprint, x.result,
                         x.last_error, x.retryable, x.first_seen, x.expires_at
                    FROM idem.processed_events x
                   WHERE x.source = claim_batch.source AND x.key = p.k
                     AND x.first_seen_month = v_cur AND x.expires_at > v_now
                   LIMIT 1) r ON true
             WHERE p.held IS NOT NULL AND NOT EXISTS (SELECT 1 FROM ins i WHERE i.key = p.k)),
        a AS (
            SELECT p.o, p.settled AS outcome, NULL::bigint AS token, p.attempts,
                   CASE WHEN p.settled IN ('in_progress', 'mismatch') THEN p.lease_expires_at END AS lease_at,
                   CASE WHEN p.settled = 'completed' THEN p.result END AS result,
                   CASE WHEN p.settled IN ('failed', 'completed') THEN p.last_error END AS error,
                   p.first_seen, p.expires_at,
                   CASE WHEN p.settled = 'in_progress' THEN greatest(p.lease_expires_at - v_now, interval '0') END AS left_,
                   p.first_seen_month AS month
              FROM p WHERE p.settled IS NOT NULL
            UNION ALL
            SELECT r.o, r.settled, NULL, r.attempts,
                   CASE WHEN r.settled IN ('in_progress', 'mismatch') THEN r.lease_expires_at END,
                   CASE WHEN r.settled = 'completed' THEN r.result END,
                   CASE WHEN r.settled IN ('failed', 'completed') THEN r.last_error END,
                   r.first_seen, r.expires_at,
                   CASE WHEN r.settled = 'in_progress' THEN greatest(r.lease_expires_at - v_now, interval '0') END,
                   r.first_seen_month
              FROM cur r WHERE r.settled IS NOT NULL
            UNION ALL
            SELECT r.o, 'in_progress', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
              FROM cur r WHERE r.held AND r.status IS NULL
            UNION ALL
            SELECT p.o, 'acquired', i.token, i.attempts, i.lease_expires_at, NULL, NULL, i.first_seen, i.expires_at,
                   v_lease, NULL
              FROM ins i JOIN p ON p.k = i.key)
        SELECT a.o, a.outcome, a.token, a.attempts, a.lease_at, a.result, a.error, a.first_seen, a.expires_at,
               a.left_, a.month
          FROM a
        LOOP
            ord := ar.o; outcome := ar.outcome; token := ar.token; attempt := ar.attempts;
            lease_expires_at := ar.lease_at; result := ar.result; error := ar.error;
            first_seen := ar.first_seen; expires_at := ar.expires_at; lease_remaining := ar.left_;
            RETURN NEXT;
            a_ord := a_ord || ar.o;
            IF ar.outcome = 'acquired' THEN
                v_acq := v_acq + 1;
            ELSIF ar.month IS NOT NULL THEN
                -- An answer read from a row: a duplicate (counted below).
                v_dups := v_dups + 1;
                IF v_per_key THEN
                    f_ord := f_ord || ar.o;
                    f_month := f_month || ar.month;
                END IF;
            END IF;
        END LOOP;
    END IF;

    -- Counting, as idem.claim counts (not in SERIALIZABLE; v_sample 0
    -- turns it off): the acquisitions in idem.activity, every one; the
    -- duplicates (every answer read from a row, before the locks or after)
    -- as idem.count_duplicate counts them, the batch weighed as one claim
    -- (idem.claim_weight): all of them while the source's claims this
    -- minute are below idem.exact_counting_rate(); above it 1 batch in
    -- v_sample counts all of its duplicates, each as v_sample, and the
    -- others count none. A redelivered batch then mostly
    -- writes nothing, as a duplicate claim mostly writes nothing. Per key,
    -- each duplicate is sampled as idem.claim samples it.
    IF v_sample > 0 AND v_iso <> 'serializable' THEN
        IF v_acq > 0 THEN
            PERFORM idem.count_activity(claim_batch.source, v_now, v_acq, 0);
        END IF;
        IF v_dups > 0 AND NOT v_per_key THEN
            v_weight := idem.claim_weight(claim_batch.source, v_sample, v_now);
            IF v_weight > 0 THEN
                PERFORM idem.count_duplicate(claim_batch.source, NULL, NULL, v_dups * v_weight, false, v_now);
            END IF;
        ELSIF v_dups > 0 THEN
            PERFORM idem.count_duplicate(claim_batch.source, claim_batch.keys[x.o], x.month, v_sample, true, v_now)
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
            SELECT * INTO c FROM idem.claim(claim_batch.source, claim_batch.keys[v_i], claim_batch.fingerprints[v_i],
                                            claim_batch.ttl, claim_batch.lease, claim_batch.event_types[v_i],
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
        FOR v_i IN SELECT u.o FROM generate_subscripts(claim_batch.keys, 1) u(o)
                    WHERE u.o <> ALL (v_firsts) ORDER BY u.o LOOP
            SELECT * INTO c FROM idem.claim(claim_batch.source, claim_batch.keys[v_i], claim_batch.fingerprints[v_i],
                                            claim_batch.ttl, claim_batch.lease, claim_batch.event_types[v_i],
                                            greatest(v_until - clock_timestamp(), interval '0'));
            ord := v_i; outcome := c.outcome; token := c.token; attempt := c.attempt;
            lease_expires_at := c.lease_expires_at; result := c.result; error := c.error;
            first_seen := c.first_seen; expires_at := c.expires_at; lease_remaining := c.lease_remaining;
            RETURN NEXT;
        END LOOP;
    END IF;
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
