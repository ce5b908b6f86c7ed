-- idem 24: idem's code never calls into an object the application owns;
-- a standby answers long-ttl duplicates; a redelivery's hold drops the
-- dead letter's payload; the sampled-minute setting cannot be forged.
--
-- * The ownership rule: idem's functions run only code owned by a
--   superuser or by idem's owner (idem.trusted_owner). A legacy table
--   (idemctl adopt) is owned by the application, and reading it ran its
--   code: a key column of the application's DOMAIN (its CHECK runs on
--   the probe's $1::domain cast), of its enum or composite type with a
--   cast to text, a result column whose type's cast to json to_jsonb
--   calls, a collation of its own (a nondeterministic one makes 'A' and
--   'a' one key), and the expressions of its indexes and statistics
--   objects, whose constant parts the planner evaluates as it loads them,
--   as whoever plans a read (a superuser's plain SELECT included), and its
--   check constraints (read for constraint exclusion).
--   idem.check_legacy_reads refuses a legacy table any of whose read
--   columns' types (with their base, element, sub- and attribute types:
--   idem.foreign_type) or collations, or any function, operator, type or
--   collation its indexes, statistics or checks use (pg_depend:
--   idem.foreign_objects), has another owner. idem.adopt_start,
--   idem.adopt_batch and idem.adopt_key (SECURITY DEFINER, which every
--   claim of a new key calls while an adoption copies) check it before
--   each read and again after (an index committed in between fails the
--   call, undoing all it ran). Defaults, generated columns and triggers
--   run on writes only; idem never writes the table.
-- * idem.raise_lookback in a read-only transaction (a hot standby) does
--   not write the lookback: the claim looks back as far as it needs, and a
--   duplicate claimed with a ttl above the source's lookback is answered
--   from its stored result instead of failing with 25006.
-- * idem.queue_hold, taking over a dead letter for a redelivery, resets
--   its payload with its token, job, state and error: the first delivery's
--   payload was listed as kept under the new token and replayed.
-- * idem.claim_weight's session setting idem.sampled_minute is signed with
--   a secret (120 random bits in the sequences idem.sampling_key_a and _b,
--   which only idem's owner reads, read by pg_sequence_last_value, a
--   function call, not a query): a value
--   any role sets, or a pooler carries from another client, is not taken
--   unless idem set it for this minute and source.
--
-- Down restores migration 23's functions and drops what this one made.

-- +goose Up
-- +goose StatementBegin
-- The secret idem.claim_weight signs idem.sampled_minute with: 120 random
-- bits in two sequences only idem's owner may read (no grant), read with
-- pg_sequence_last_value, a function call rather than a query on the
-- claim's path.
CREATE SEQUENCE idem.sampling_key_a;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE SEQUENCE idem.sampling_key_b;
-- +goose StatementEnd
-- +goose StatementBegin
SELECT pg_catalog.setval('idem.sampling_key_a'::regclass, ('x' OPERATOR(pg_catalog.||) pg_catalog.substr(pg_catalog.md5(pg_catalog.gen_random_uuid()::text), 1, 15))::bit(60)::bigint OPERATOR(pg_catalog.+) 1),
       pg_catalog.setval('idem.sampling_key_b'::regclass, ('x' OPERATOR(pg_catalog.||) pg_catalog.substr(pg_catalog.md5(pg_catalog.gen_random_uuid()::text), 1, 15))::bit(60)::bigint OPERATOR(pg_catalog.+) 1);
-- +goose StatementEnd
-- +goose StatementBegin
REVOKE ALL ON SEQUENCE idem.sampling_key_a, idem.sampling_key_b FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION idem.trusted_owner(role oid) RETURNS boolean
    LANGUAGE plpgsql STABLE
    SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    -- A superuser, or the role that owns schema idem: the only owners
    -- whose code idem's own functions may run. (PL/pgSQL, as foreign_type
    -- and foreign_objects: a SQL function with a SET clause is planned
    -- again at every call.)
    RETURN EXISTS (SELECT 1 FROM pg_roles r
                    WHERE r.oid = trusted_owner.role
                      AND (r.rolsuper OR r.oid = (SELECT n.nspowner FROM pg_namespace n WHERE n.nspname = 'idem')));
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION idem.foreign_type(typ oid) RETURNS text
    LANGUAGE plpgsql STABLE
    SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v text;
BEGIN
    -- The first type, among typ and every type reading a value of typ
    -- can call into (a domain's base types, an array's element type, a
    -- range's subtype, a multirange's range, a composite's attributes),
    -- whose owner is not trusted (idem.trusted_owner), with its owner;
    -- NULL when there is none. A type initdb made (an oid below
    -- FirstNormalObjectId, 16384) is the bootstrap superuser's, and so is
    -- every type it can call into: answered without the walk.
    IF foreign_type.typ < 16384 THEN
        RETURN NULL;
    END IF;
    WITH RECURSIVE ty(oid) AS (
        SELECT foreign_type.typ
        UNION
        SELECT n.x
          FROM ty JOIN pg_type t ON t.oid = ty.oid,
               LATERAL (SELECT t.typbasetype
                        UNION ALL SELECT t.typelem
                        UNION ALL SELECT r.rngsubtype FROM pg_range r WHERE r.rngtypid = t.oid
                        UNION ALL SELECT r.rngtypid FROM pg_range r WHERE r.rngmultitypid = t.oid
                        UNION ALL SELECT a.atttypid FROM pg_attribute a
                                   WHERE a.attrelid = t.typrelid AND a.attnum > 0 AND NOT a.attisdropped) n(x)
         WHERE n.x <> 0)
    SELECT format('type %s (owner %s)', t.oid::regtype, t.typowner::regrole) INTO v
      FROM ty JOIN pg_type t ON t.oid = ty.oid
     WHERE NOT idem.trusted_owner(t.typowner)
     LIMIT 1;
    RETURN v;
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION idem.foreign_objects(legacy regclass, columns text[]) RETURNS SETOF text
    LANGUAGE plpgsql STABLE
    SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    c record;
    v text;
BEGIN
    -- The columns read: their types (and every type those call into) and
    -- their collations. A key column's collation decides which keys are
    -- equal (DISTINCT ON, the probe's =): a nondeterministic one makes
    -- 'A' and 'a' one key.
    FOR c IN SELECT t.attname, t.atttypid, t.attcollation, k.ord
               FROM unnest(foreign_objects.columns) WITH ORDINALITY k(col, ord)
               JOIN pg_attribute t ON t.attrelid = foreign_objects.legacy AND t.attname = k.col
                                  AND t.attnum > 0 AND NOT t.attisdropped LOOP
        v := idem.foreign_type(c.atttypid);
        IF v IS NOT NULL THEN
            RETURN NEXT format('column %I is of %s', c.attname, v);
        END IF;
        SELECT format('column %I has collation %s (owner %s)', c.attname, c.attcollation::regcollation, o.collowner::regrole) INTO v
          FROM pg_collation o
         WHERE o.oid = c.attcollation AND (NOT idem.trusted_owner(o.collowner) OR (c.ord = 1 AND NOT o.collisdeterministic));
        IF v IS NOT NULL THEN
            RETURN NEXT v;
        END IF;
    END LOOP;
    -- What planning any read of the table runs: the expressions and
    -- predicates of its indexes and statistics objects (constant parts
    -- are evaluated as they are loaded, by whoever plans) and its check
    -- constraints (read for constraint exclusion). Every function,
    -- operator, type and collation they use (pg_depend) has a trusted
    -- owner. Defaults, generated columns and triggers run on writes only:
    -- idem never writes the table.
    RETURN QUERY
    WITH objs(classid, objid, what) AS (
        SELECT 'pg_class'::regclass, i.indexrelid, format('index %s', i.indexrelid::regclass)
          FROM pg_index i WHERE i.indrelid = foreign_objects.legacy
        UNION ALL
        SELECT 'pg_constraint'::regclass, k.oid, format('constraint %I', k.conname)
          FROM pg_constraint k WHERE k.conrelid = foreign_objects.legacy
        UNION ALL
        SELECT 'pg_statistic_ext'::regclass, s.oid, format('statistics %I', s.stxname)
          FROM pg_statistic_ext s WHERE s.stxrelid = foreign_objects.legacy)
    SELECT format('%s uses %s', o.what, x.found)
      FROM objs o
      JOIN pg_depend d ON d.classid = o.classid AND d.objid = o.objid
      CROSS JOIN LATERAL (
          SELECT format('function %s (owner %s)', p.oid::regprocedure, p.proowner::regrole)
            FROM pg_proc p WHERE d.refclassid = 'pg_proc'::regclass AND p.oid = d.refobjid AND NOT idem.trusted_owner(p.proowner)
          UNION ALL
          SELECT format('operator %s (owner %s)', p.oid::regoperator, p.oprowner::regrole)
            FROM pg_operator p WHERE d.refclassid = 'pg_operator'::regclass AND p.oid = d.refobjid AND NOT idem.trusted_owner(p.oprowner)
          UNION ALL
          SELECT format('collation %s (owner %s)', p.oid::regcollation, p.collowner::regrole)
            FROM pg_collation p WHERE d.refclassid = 'pg_collation'::regclass AND p.oid = d.refobjid AND NOT idem.trusted_owner(p.collowner)
          UNION ALL
          SELECT idem.foreign_type(d.refobjid)
           WHERE d.refclassid = 'pg_type'::regclass AND idem.foreign_type(d.refobjid) IS NOT NULL) x(found);
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION idem.check_legacy_reads(legacy regclass, key_column text, at_column text, result_column text) RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v text;
BEGIN
    PERFORM idem.check_legacy(check_legacy_reads.legacy);
    -- Nearly every legacy table is answered by this one probe (it runs
    -- twice in every claim of a new key while an adoption copies): no read
    -- column of a type or collation made after initdb (an oid below
    -- FirstNormalObjectId, 16384, is the bootstrap superuser's, and so is
    -- all it calls into; initdb's collations are deterministic), and no
    -- index, check or statistics object of the table that uses a function,
    -- operator, type or collation made after initdb. Anything else is
    -- looked at owner by owner (idem.foreign_objects).
    IF NOT EXISTS (
        SELECT 1 FROM pg_attribute t
         WHERE t.attrelid = check_legacy_reads.legacy AND t.attnum > 0 AND NOT t.attisdropped
           AND t.attname IN (check_legacy_reads.key_column, check_legacy_reads.at_column, check_legacy_reads.result_column)
           AND (t.atttypid >= 16384 OR t.attcollation >= 16384)
        UNION ALL
        SELECT 1 FROM pg_depend d
         WHERE d.refclassid IN ('pg_proc'::regclass, 'pg_operator'::regclass, 'pg_type'::regclass, 'pg_collation'::regclass)
           AND d.refobjid >= 16384
           AND ((d.classid = 'pg_class'::regclass AND d.objid IN (SELECT i.indexrelid FROM pg_index i WHERE i.indrelid = check_legacy_reads.legacy))
             OR (d.classid = 'pg_constraint'::regclass AND d.objid IN (SELECT k.oid FROM pg_constraint k WHERE k.conrelid = check_legacy_reads.legacy))
             OR (d.classid = 'pg_statistic_ext'::regclass AND d.objid IN (SELECT x.oid FROM pg_statistic_ext x WHERE x.stxrelid = check_legacy_reads.legacy)))) THEN
        RETURN;
    END IF;
    SELECT string_agg(f, '; ') INTO v
      FROM idem.foreign_objects(check_legacy_reads.legacy,
                                ARRAY[check_legacy_reads.key_column, check_legacy_reads.at_column, check_legacy_reads.result_column]) f;
    IF v IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = '42809',
            MESSAGE = format('idem.adopt: reading %s would run code of a role that is neither a superuser nor idem''s owner: %s', check_legacy_reads.legacy, v),
            HINT = 'Copy the legacy rows into a plain table of built-in types, with no index, statistics or check of the application''s (CREATE TABLE ... AS SELECT key::text, ...) as a role you trust, and adopt that.';
    END IF;
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
REVOKE ALL ON FUNCTION idem.trusted_owner(oid), idem.foreign_type(oid), idem.foreign_objects(regclass, text[]),
    idem.check_legacy_reads(regclass, text, text, text) FROM PUBLIC;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.adopt_start(source text, legacy regclass, key_column text, at_column text, result_column text DEFAULT NULL::text, ttl interval DEFAULT NULL::interval)
 RETURNS bigint
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_id   bigint;
    v_ttl  interval;
    v_col  text;
    v_min  timestamptz;
    v_m    date;
    a      idem.adoptions;
    e      record;
BEGIN
    IF adopt_start.source IS NULL OR btrim(adopt_start.source) = '' OR octet_length(adopt_start.source) > 64 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'idem.adopt_start: source must be 1 to 64 bytes, not blank';
    END IF;
    IF adopt_start.legacy IS NULL OR adopt_start.key_column IS NULL OR adopt_start.at_column IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.adopt_start: legacy, key_column and at_column are required';
    END IF;
    PERFORM idem.check_legacy(adopt_start.legacy);
    FOREACH v_col IN ARRAY ARRAY[adopt_start.key_column, adopt_start.at_column, adopt_start.result_column] LOOP
        IF v_col IS NOT NULL AND NOT EXISTS (SELECT 1 FROM pg_attribute t WHERE t.attrelid = adopt_start.legacy
                                                AND t.attname = v_col AND t.attnum > 0 AND NOT t.attisdropped) THEN
            RAISE EXCEPTION USING ERRCODE = '42703',
                MESSAGE = format('idem.adopt_start: %s has no column %I', adopt_start.legacy, v_col);
        END IF;
    END LOOP;
    IF NOT EXISTS (SELECT 1 FROM pg_attribute t WHERE t.attrelid = adopt_start.legacy AND t.attname = adopt_start.at_column
                      AND t.atttypid IN ('timestamptz'::regtype, 'timestamp'::regtype, 'date'::regtype)) THEN
        RAISE EXCEPTION USING ERRCODE = '42804',
            MESSAGE = format('idem.adopt_start: %s.%I is not a timestamp or a date', adopt_start.legacy, adopt_start.at_column);
    END IF;
    -- (version 24) Nothing reading the table calls is the application's:
    -- the columns' types and collations, its indexes', statistics' and
    -- checks' expressions (idem.check_legacy_reads).
    PERFORM idem.check_legacy_reads(adopt_start.legacy, adopt_start.key_column, adopt_start.at_column, adopt_start.result_column);
    SELECT x.id INTO v_id FROM idem.adoptions x WHERE x.source = adopt_start.source AND x.state = 'copying';
    IF FOUND THEN
        SELECT * INTO a FROM idem.adoptions x WHERE x.id = v_id;
        IF a.legacy <> adopt_start.legacy OR a.key_column <> adopt_start.key_column OR a.at_column <> adopt_start.at_column
           OR a.result_column IS DISTINCT FROM adopt_start.result_column THEN
            RAISE EXCEPTION USING ERRCODE = '55000',
                MESSAGE = format('idem.adopt_start: source %L is already adopting %s (key %I, at %I); finish it first', adopt_start.source, a.legacy, a.key_column, a.at_column);
        END IF;
        RETURN v_id; -- resumed
    END IF;
    v_ttl := coalesce(adopt_start.ttl,
                      (SELECT p.ttl FROM idem.policies p WHERE p.source IN (adopt_start.source, '*') ORDER BY p.source = '*' LIMIT 1));
    IF v_ttl IS NULL OR NOT idem.valid_ttl(v_ttl) THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('idem.adopt_start: ttl %s is out of range (1 minute to 10 years) or there is no policy', v_ttl);
    END IF;
    INSERT INTO idem.adoptions (source, legacy, key_column, at_column, result_column, ttl)
    VALUES (adopt_start.source, adopt_start.legacy, adopt_start.key_column, adopt_start.at_column, adopt_start.result_column, v_ttl)
    RETURNING * INTO a;
    -- Claims look back as far as the adopted rows' retention.
    PERFORM idem.raise_lookback(adopt_start.source, idem.days_at_most(v_ttl));
    -- The months the live legacy rows were processed in.
    SELECT * INTO e FROM idem.adopt_exprs(a);
    EXECUTE format('SELECT min(%s) FROM %s l WHERE %s > $1', e.at_expr, a.legacy, e.at_expr) INTO v_min USING idem.clock() - v_ttl;
    -- And nothing was added while it was read (see idem.adopt_key).
    PERFORM idem.check_legacy_reads(a.legacy, a.key_column, a.at_column, a.result_column);
    IF v_min IS NOT NULL THEN
        FOR v_m IN SELECT g::date FROM generate_series(idem.utc_month(v_min)::timestamp, idem.utc_month(idem.clock())::timestamp, interval '1 month') g LOOP
            PERFORM idem.create_partition(v_m);
        END LOOP;
    END IF;
    RETURN a.id;
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.adopt_batch(id bigint, batch_size integer, OUT read bigint, OUT copied bigint, OUT skipped bigint, OUT done boolean)
 RETURNS record
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    a        idem.adoptions;
    e        record;
    v_now    timestamptz := idem.clock();
    v_last   text;
    v_future bigint;
    v_bad    bigint;
    v_nostamp bigint;
    v_nulls  bigint := 0;
BEGIN
    IF adopt_batch.batch_size IS NULL OR adopt_batch.batch_size < 1 OR adopt_batch.batch_size > 1000000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('idem.adopt_batch: batch_size %s must be between 1 and 1000000', adopt_batch.batch_size);
    END IF;
    -- One copier per adoption at a time.
    SELECT * INTO a FROM idem.adoptions x WHERE x.id = adopt_batch.id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('idem.adopt_batch: no adoption %s', adopt_batch.id);
    END IF;
    IF a.state = 'done' THEN
        read := 0; copied := 0; skipped := 0; done := true;
        RETURN;
    END IF;
    SELECT * INTO e FROM idem.adopt_exprs(a);
    -- A legacy relation that would run its owner's code as this reader
    -- (made a view, given row level security since adopt_start) is
    -- refused (idem.check_legacy, migration 14), and so is one whose read
    -- would call into an object of a role that is neither a superuser nor
    -- idem's owner (version 24: a column's type or collation changed, an
    -- index, statistics or check added since adopt_start).
    PERFORM idem.check_legacy_reads(a.legacy, a.key_column, a.at_column, a.result_column);
    -- (version 15) Legacy rows as they really are: a NULL key is never
    -- paged over (counted once, at the end), a key idem cannot hold
    -- (empty, blank, over 512 bytes) or a row with no processed-at is
    -- skipped and counted, a processed-at in the future is taken as now
    -- (counted), and of several rows of one key in a batch the latest is
    -- kept.
    EXECUTE format($q$
        WITH src AS (
            SELECT %1$s AS key, l.%2$I AS ord, %3$s AS at, %4$s AS result
              FROM %5$s l
             WHERE l.%2$I IS NOT NULL AND ($1::text IS NULL OR l.%2$I > $1::%6$s)
             ORDER BY l.%2$I
             LIMIT $2),
        valid AS (
            SELECT DISTINCT ON (s.key) s.key, LEAST(s.at, $4) AS at, s.at > $4 AS future, s.result
              FROM src s
             WHERE s.at IS NOT NULL
               AND octet_length(s.key) BETWEEN 1 AND 512 AND btrim(s.key, E' \t\r\n') <> ''
             ORDER BY s.key, s.at DESC),
        ins AS (
            INSERT INTO idem.processed_events AS p
                   (source, key, first_seen_month, status, attempts, token, result, first_seen, updated_at, completed_at, expires_at)
            SELECT $3, v.key, idem.utc_month(v.at), 'completed', 1, idem.new_token(), v.result, v.at, $4, v.at, v.at + $5
              FROM valid v
             WHERE v.at + $5 > $4
               AND NOT EXISTS (SELECT 1 FROM idem.processed_events x
                                WHERE x.source = $3 AND x.key = v.key AND x.expires_at > $4)
            ON CONFLICT DO NOTHING
            RETURNING 1)
        SELECT (SELECT count(*) FROM src), (SELECT count(*) FROM ins),
               (SELECT s.ord::text FROM src s ORDER BY s.ord DESC LIMIT 1),
               (SELECT count(*) FROM valid v WHERE v.future),
               (SELECT count(*) FROM src s WHERE s.at IS NOT NULL
                   AND NOT (octet_length(s.key) BETWEEN 1 AND 512 AND btrim(s.key, E' \t\r\n') <> '')),
               (SELECT count(*) FROM src s WHERE s.at IS NULL)$q$,
        e.key_expr, a.key_column, e.at_expr, e.result_expr, a.legacy, e.key_type)
    INTO read, copied, v_last, v_future, v_bad, v_nostamp
    USING a.last_key, adopt_batch.batch_size, a.source, v_now, a.ttl;
    done := read < adopt_batch.batch_size;
    IF done THEN
        EXECUTE format('SELECT count(*) FROM %s l WHERE l.%I IS NULL', a.legacy, a.key_column) INTO v_nulls;
        read := read + v_nulls;
    END IF;
    -- (version 24) Checked again once read: an index or statistics object
    -- committed between the check and the reads' planning (whose constant
    -- parts planning evaluates) undoes the batch and everything it ran.
    PERFORM idem.check_legacy_reads(a.legacy, a.key_column, a.at_column, a.result_column);
    skipped := read - copied;
    UPDATE idem.adoptions x
       SET last_key = coalesce(v_last, x.last_key), copied = x.copied + adopt_batch.copied,
           skipped = x.skipped + adopt_batch.skipped, batches = x.batches + 1, updated_at = now(),
           future = x.future + v_future, bad_keys = x.bad_keys + v_bad + v_nulls, no_stamp = x.no_stamp + v_nostamp,
           state = CASE WHEN adopt_batch.done THEN 'done' ELSE 'copying' END,
           finished_at = CASE WHEN adopt_batch.done THEN now() END
     WHERE x.id = adopt_batch.id;
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.adopt_key(id bigint, key text, now timestamp with time zone, lo date, hi date)
 RETURNS void
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    a      idem.adoptions;
    e      record;
    v_at   timestamptz;
    v_res  jsonb;
BEGIN
    IF adopt_key.id IS NULL OR adopt_key.key IS NULL OR adopt_key.now IS NULL THEN
        RETURN;
    END IF;
    SELECT * INTO a FROM idem.adoptions x WHERE x.id = adopt_key.id;
    IF NOT FOUND OR a.state <> 'copying' THEN
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM idem.processed_events p
                WHERE p.source = a.source AND p.key = adopt_key.key
                  AND p.first_seen_month >= adopt_key.lo AND p.first_seen_month <= adopt_key.hi
                  AND p.expires_at > adopt_key.now) THEN
        RETURN;
    END IF;
    SELECT * INTO e FROM idem.adopt_exprs(a);
    -- A legacy relation that would run its owner's code as this reader
    -- (made a view, given row level security since adopt_start) is
    -- refused (idem.check_legacy, migration 14), and so is one whose read
    -- would call into an object of a role that is neither a superuser nor
    -- idem's owner (version 24: a column's type or collation changed, an
    -- index, statistics or check added since adopt_start).
    PERFORM idem.check_legacy_reads(a.legacy, a.key_column, a.at_column, a.result_column);
    -- (version 15) The legacy row is found through its key column's own
    -- type (its index), and must then read back as exactly this key, as
    -- the copy writes it: a key the type cannot hold (out of range, not of
    -- its form) is not there, and one the cast would fold into another
    -- ('01', ' 1' and '1' into integer 1, a case-insensitive type or
    -- collation, a varchar(n) truncation) is not that row: the text is
    -- compared byte for byte (COLLATE "C").
    BEGIN
        EXECUTE format('SELECT %s, %s FROM %s l WHERE l.%I = $1::%s AND (%s) COLLATE "C" = $1 ORDER BY 1 DESC NULLS LAST LIMIT 1',
                       e.at_expr, e.result_expr, a.legacy, a.key_column, e.key_type, e.key_expr)
           INTO v_at, v_res USING adopt_key.key;
    EXCEPTION WHEN data_exception THEN
        v_at := NULL; -- a key that cannot be of the legacy key's type is not there
    END;
    -- (version 24) Checked again once read: an index or statistics object
    -- committed between the check and the read's planning (whose constant
    -- parts planning evaluates) fails the claim and undoes everything the
    -- read ran with it.
    PERFORM idem.check_legacy_reads(a.legacy, a.key_column, a.at_column, a.result_column);
    IF v_at IS NULL OR v_at + a.ttl <= adopt_key.now THEN
        RETURN; -- not processed there, or its retention is over: a new key
    END IF;
    -- A stamp in the future is taken as now, as the copy takes it.
    v_at := LEAST(v_at, adopt_key.now);
    INSERT INTO idem.processed_events
           (source, key, first_seen_month, status, attempts, token, result, first_seen, updated_at, completed_at, expires_at)
    VALUES (a.source, adopt_key.key, idem.utc_month(v_at), 'completed', 1, idem.new_token(), v_res, v_at, adopt_key.now, v_at, v_at + a.ttl)
    ON CONFLICT DO NOTHING;
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.raise_lookback(p_source text, p_need interval)
 RETURNS interval
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v interval := make_interval(days => ceil(extract(epoch FROM p_need) / 86400)::int + 1);
BEGIN
    IF p_source IS NULL OR p_need IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.raise_lookback: source and need must not be NULL';
    END IF;
    -- (version 24) A read-only transaction (a hot standby, or one begun
    -- READ ONLY) cannot record it: this claim looks back as far as it
    -- needs, and a duplicate is answered from its stored result; the
    -- primary records it on its next such claim.
    IF pg_catalog.current_setting('transaction_read_only') = 'on' THEN
        RETURN greatest(v, (SELECT max(l.lookback) FROM idem.lookbacks l WHERE l.source IN (p_source, '*')));
    END IF;
    INSERT INTO idem.lookbacks AS l (source, lookback) VALUES (p_source, v)
    ON CONFLICT (source) DO UPDATE SET lookback = EXCLUDED.lookback, raised_at = now()
     WHERE l.lookback < EXCLUDED.lookback;
    RETURN (SELECT max(l.lookback) FROM idem.lookbacks l WHERE l.source IN (p_source, '*'));
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.queue_hold(source text, key text, token bigint, job_id bigint)
 RETURNS bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_state text;
    v_old   bigint;
BEGIN
    PERFORM idem.check_key('idem.queue_hold', queue_hold.source, queue_hold.key);
    IF queue_hold.token IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.queue_hold: token must not be NULL';
    END IF;
    PERFORM 1 FROM idem.processed_events e
     WHERE e.source = queue_hold.source AND e.key = queue_hold.key
       AND e.token = queue_hold.token AND e.status = 'processing';
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'ID003',
            MESSAGE = format('idem.queue_hold: key %L of source %L is not acquired with this token', left(queue_hold.key, 64), queue_hold.source),
            HINT = 'Hold a key in the transaction that acquired it with idem.claim.';
    END IF;
    SELECT h.state, h.job_id INTO v_state, v_old FROM idem.holds h
     WHERE h.source = queue_hold.source AND h.key = queue_hold.key FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO idem.holds (source, key, token, job_id, state, held_at)
        VALUES (queue_hold.source, queue_hold.key, queue_hold.token, queue_hold.job_id, 'queued', idem.clock());
        PERFORM idem.queue_count(queue_hold.source, 1, 0);
        RETURN NULL;
    ELSIF v_state = 'queued' THEN
        RAISE EXCEPTION USING ERRCODE = 'ID003',
            MESSAGE = format('idem.queue_hold: key %L of source %L is already held by job %s', left(queue_hold.key, 64), queue_hold.source, v_old);
    END IF;
    UPDATE idem.holds h
       SET token = queue_hold.token, job_id = queue_hold.job_id, state = 'queued', held_at = idem.clock(),
           dead_at = NULL, error = NULL,
           -- (version 24) the dead letter's payload was the delivery's it
           -- takes over; the new delivery keeps its own (queue_keep_payload)
           payload = NULL
     WHERE h.source = queue_hold.source AND h.key = queue_hold.key;
    RETURN v_old;
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.claim_weight(p_source text, p_sample integer, p_now timestamp with time zone)
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_counted bigint;
    v_minute  timestamptz;
    v_tag     text;
BEGIN
    IF p_sample IS NULL OR p_sample < 0 OR p_sample > 1000000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = pg_catalog.format('idem.claim_weight: sampling %s is not in [0, 1000000]', p_sample);
    END IF;
    -- A read-only transaction (a hot standby, where idem.activity, being
    -- unlogged, cannot be read) counts nothing (idem.count_duplicate).
    IF p_sample = 0 OR pg_catalog.current_setting('transaction_read_only') = 'on' THEN
        RETURN 0;
    ELSIF p_sample = 1 THEN
        RETURN 1;
    END IF;
    v_minute := idem.activity_minute(p_now);
    -- A session that found the source at or above the rate in this minute
    -- samples for the rest of it (the minute's count only grows) without
    -- reading idem.activity again: the session setting
    -- idem.sampled_minute remembers the minute and the source (one source
    -- a session; another source, or the next minute, reads again).
    -- (version 24) Any role can set a session setting, and through a
    -- transaction-mode pooler it carries to the next client: the value is
    -- the minute and the source signed with the secret in the sequences
    -- idem.sampling_key_a and _b, which only idem's owner reads (a
    -- function call each, not a query), so a value idem did not set is no
    -- value (the
    -- minute is read from idem.activity, as before). A signed value another
    -- client left is a true fact: it holds for every session. A claim
    -- delegated to a Citus worker (idem.citus = on), where the secret's
    -- sequences are not, remembers nothing and reads each time.
    IF pg_catalog.current_setting('idem.citus', true) IS DISTINCT FROM 'on' THEN
        v_tag := (EXTRACT(epoch FROM v_minute))::bigint::text OPERATOR(pg_catalog.||) '/' OPERATOR(pg_catalog.||) p_source;
        v_tag := v_tag OPERATOR(pg_catalog.||) '/' OPERATOR(pg_catalog.||) pg_catalog.md5(
                     pg_catalog.pg_sequence_last_value('idem.sampling_key_a'::regclass)::text OPERATOR(pg_catalog.||) '.' OPERATOR(pg_catalog.||)
                     pg_catalog.pg_sequence_last_value('idem.sampling_key_b'::regclass)::text OPERATOR(pg_catalog.||) '/' OPERATOR(pg_catalog.||) v_tag);
    END IF;
    IF v_tag IS NULL OR pg_catalog.current_setting('idem.sampled_minute', true) IS DISTINCT FROM v_tag THEN
        -- The source's claims counted in this minute (its slots: one per
        -- backend; idem.activity's primary key starts with minute, source).
        SELECT pg_catalog.sum(a.acquired + a.duplicates) INTO v_counted
          FROM idem.activity a
         WHERE a.minute = v_minute AND a.source = p_source;
        IF coalesce(v_counted, 0) < idem.exact_counting_rate() THEN
            RETURN 1;
        END IF;
        IF v_tag IS NOT NULL THEN
            PERFORM pg_catalog.set_config('idem.sampled_minute', v_tag, false);
        END IF;
    END IF;
    IF pg_catalog.random() * p_sample < 1 THEN
        RETURN p_sample;
    END IF;
    RETURN 0;
END
$function$;

-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.adopt_start(source text, legacy regclass, key_column text, at_column text, result_column text DEFAULT NULL::text, ttl interval DEFAULT NULL::interval)
 RETURNS bigint
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_id   bigint;
    v_ttl  interval;
    v_col  text;
    v_min  timestamptz;
    v_m    date;
    a      idem.adoptions;
    e      record;
BEGIN
    IF adopt_start.source IS NULL OR btrim(adopt_start.source) = '' OR octet_length(adopt_start.source) > 64 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'idem.adopt_start: source must be 1 to 64 bytes, not blank';
    END IF;
    IF adopt_start.legacy IS NULL OR adopt_start.key_column IS NULL OR adopt_start.at_column IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.adopt_start: legacy, key_column and at_column are required';
    END IF;
    PERFORM idem.check_legacy(adopt_start.legacy);
    FOREACH v_col IN ARRAY ARRAY[adopt_start.key_column, adopt_start.at_column, adopt_start.result_column] LOOP
        IF v_col IS NOT NULL AND NOT EXISTS (SELECT 1 FROM pg_attribute t WHERE t.attrelid = adopt_start.legacy
                                                AND t.attname = v_col AND t.attnum > 0 AND NOT t.attisdropped) THEN
            RAISE EXCEPTION USING ERRCODE = '42703',
                MESSAGE = format('idem.adopt_start: %s has no column %I', adopt_start.legacy, v_col);
        END IF;
    END LOOP;
    IF NOT EXISTS (SELECT 1 FROM pg_attribute t WHERE t.attrelid = adopt_start.legacy AND t.attname = adopt_start.at_column
                      AND t.atttypid IN ('timestamptz'::regtype, 'timestamp'::regtype, 'date'::regtype)) THEN
        RAISE EXCEPTION USING ERRCODE = '42804',
            MESSAGE = format('idem.adopt_start: %s.%I is not a timestamp or a date', adopt_start.legacy, adopt_start.at_column);
    END IF;
    SELECT x.id INTO v_id FROM idem.adoptions x WHERE x.source = adopt_start.source AND x.state = 'copying';
    IF FOUND THEN
        SELECT * INTO a FROM idem.adoptions x WHERE x.id = v_id;
        IF a.legacy <> adopt_start.legacy OR a.key_column <> adopt_start.key_column OR a.at_column <> adopt_start.at_column
           OR a.result_column IS DISTINCT FROM adopt_start.result_column THEN
            RAISE EXCEPTION USING ERRCODE = '55000',
                MESSAGE = format('idem.adopt_start: source %L is already adopting %s (key %I, at %I); finish it first', adopt_start.source, a.legacy, a.key_column, a.at_column);
        END IF;
        RETURN v_id; -- resumed
    END IF;
    v_ttl := coalesce(adopt_start.ttl,
                      (SELECT p.ttl FROM idem.policies p WHERE p.source IN (adopt_start.source, '*') ORDER BY p.source = '*' LIMIT 1));
    IF v_ttl IS NULL OR NOT idem.valid_ttl(v_ttl) THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('idem.adopt_start: ttl %s is out of range (1 minute to 10 years) or there is no policy', v_ttl);
    END IF;
    INSERT INTO idem.adoptions (source, legacy, key_column, at_column, result_column, ttl)
    VALUES (adopt_start.source, adopt_start.legacy, adopt_start.key_column, adopt_start.at_column, adopt_start.result_column, v_ttl)
    RETURNING * INTO a;
    -- Claims look back as far as the adopted rows' retention.
    PERFORM idem.raise_lookback(adopt_start.source, idem.days_at_most(v_ttl));
    -- The months the live legacy rows were processed in.
    SELECT * INTO e FROM idem.adopt_exprs(a);
    EXECUTE format('SELECT min(%s) FROM %s l WHERE %s > $1', e.at_expr, a.legacy, e.at_expr) INTO v_min USING idem.clock() - v_ttl;
    IF v_min IS NOT NULL THEN
        FOR v_m IN SELECT g::date FROM generate_series(idem.utc_month(v_min)::timestamp, idem.utc_month(idem.clock())::timestamp, interval '1 month') g LOOP
            PERFORM idem.create_partition(v_m);
        END LOOP;
    END IF;
    RETURN a.id;
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.adopt_batch(id bigint, batch_size integer, OUT read bigint, OUT copied bigint, OUT skipped bigint, OUT done boolean)
 RETURNS record
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    a        idem.adoptions;
    e        record;
    v_now    timestamptz := idem.clock();
    v_last   text;
    v_future bigint;
    v_bad    bigint;
    v_nostamp bigint;
    v_nulls  bigint := 0;
BEGIN
    IF adopt_batch.batch_size IS NULL OR adopt_batch.batch_size < 1 OR adopt_batch.batch_size > 1000000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('idem.adopt_batch: batch_size %s must be between 1 and 1000000', adopt_batch.batch_size);
    END IF;
    -- One copier per adoption at a time.
    SELECT * INTO a FROM idem.adoptions x WHERE x.id = adopt_batch.id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('idem.adopt_batch: no adoption %s', adopt_batch.id);
    END IF;
    IF a.state = 'done' THEN
        read := 0; copied := 0; skipped := 0; done := true;
        RETURN;
    END IF;
    SELECT * INTO e FROM idem.adopt_exprs(a);
    -- A legacy relation that would run its owner's code as this reader
    -- (made a view, given row level security since adopt_start) is
    -- refused (idem.check_legacy, migration 14).
    PERFORM idem.check_legacy(a.legacy);
    -- (version 15) Legacy rows as they really are: a NULL key is never
    -- paged over (counted once, at the end), a key idem cannot hold
    -- (empty, blank, over 512 bytes) or a row with no processed-at is
    -- skipped and counted, a processed-at in the future is taken as now
    -- (counted), and of several rows of one key in a batch the latest is
    -- kept.
    EXECUTE format($q$
        WITH src AS (
            SELECT %1$s AS key, l.%2$I AS ord, %3$s AS at, %4$s AS result
              FROM %5$s l
             WHERE l.%2$I IS NOT NULL AND ($1::text IS NULL OR l.%2$I > $1::%6$s)
             ORDER BY l.%2$I
             LIMIT $2),
        valid AS (
            SELECT DISTINCT ON (s.key) s.key, LEAST(s.at, $4) AS at, s.at > $4 AS future, s.result
              FROM src s
             WHERE s.at IS NOT NULL
               AND octet_length(s.key) BETWEEN 1 AND 512 AND btrim(s.key, E' \t\r\n') <> ''
             ORDER BY s.key, s.at DESC),
        ins AS (
            INSERT INTO idem.processed_events AS p
                   (source, key, first_seen_month, status, attempts, token, result, first_seen, updated_at, completed_at, expires_at)
            SELECT $3, v.key, idem.utc_month(v.at), 'completed', 1, idem.new_token(), v.result, v.at, $4, v.at, v.at + $5
              FROM valid v
             WHERE v.at + $5 > $4
               AND NOT EXISTS (SELECT 1 FROM idem.processed_events x
                                WHERE x.source = $3 AND x.key = v.key AND x.expires_at > $4)
            ON CONFLICT DO NOTHING
            RETURNING 1)
        SELECT (SELECT count(*) FROM src), (SELECT count(*) FROM ins),
               (SELECT s.ord::text FROM src s ORDER BY s.ord DESC LIMIT 1),
               (SELECT count(*) FROM valid v WHERE v.future),
               (SELECT count(*) FROM src s WHERE s.at IS NOT NULL
                   AND NOT (octet_length(s.key) BETWEEN 1 AND 512 AND btrim(s.key, E' \t\r\n') <> '')),
               (SELECT count(*) FROM src s WHERE s.at IS NULL)$q$,
        e.key_expr, a.key_column, e.at_expr, e.result_expr, a.legacy, e.key_type)
    INTO read, copied, v_last, v_future, v_bad, v_nostamp
    USING a.last_key, adopt_batch.batch_size, a.source, v_now, a.ttl;
    done := read < adopt_batch.batch_size;
    IF done THEN
        EXECUTE format('SELECT count(*) FROM %s l WHERE l.%I IS NULL', a.legacy, a.key_column) INTO v_nulls;
        read := read + v_nulls;
    END IF;
    skipped := read - copied;
    UPDATE idem.adoptions x
       SET last_key = coalesce(v_last, x.last_key), copied = x.copied + adopt_batch.copied,
           skipped = x.skipped + adopt_batch.skipped, batches = x.batches + 1, updated_at = now(),
           future = x.future + v_future, bad_keys = x.bad_keys + v_bad + v_nulls, no_stamp = x.no_stamp + v_nostamp,
           state = CASE WHEN adopt_batch.done THEN 'done' ELSE 'copying' END,
           finished_at = CASE WHEN adopt_batch.done THEN now() END
     WHERE x.id = adopt_batch.id;
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.adopt_key(id bigint, key text, now timestamp with time zone, lo date, hi date)
 RETURNS void
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    a      idem.adoptions;
    e      record;
    v_at   timestamptz;
    v_res  jsonb;
BEGIN
    IF adopt_key.id IS NULL OR adopt_key.key IS NULL OR adopt_key.now IS NULL THEN
        RETURN;
    END IF;
    SELECT * INTO a FROM idem.adoptions x WHERE x.id = adopt_key.id;
    IF NOT FOUND OR a.state <> 'copying' THEN
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM idem.processed_events p
                WHERE p.source = a.source AND p.key = adopt_key.key
                  AND p.first_seen_month >= adopt_key.lo AND p.first_seen_month <= adopt_key.hi
                  AND p.expires_at > adopt_key.now) THEN
        RETURN;
    END IF;
    SELECT * INTO e FROM idem.adopt_exprs(a);
    -- A legacy relation that would run its owner's code as this reader
    -- (made a view, given row level security since adopt_start) is
    -- refused (idem.check_legacy, migration 14).
    PERFORM idem.check_legacy(a.legacy);
    -- (version 15) The legacy row is found through its key column's own
    -- type (its index), and must then read back as exactly this key, as
    -- the copy writes it: a key the type cannot hold (out of range, not of
    -- its form) is not there, and one the cast would fold into another
    -- ('01', ' 1' and '1' into integer 1, a case-insensitive type or
    -- collation, a varchar(n) truncation) is not that row: the text is
    -- compared byte for byte (COLLATE "C").
    BEGIN
        EXECUTE format('SELECT %s, %s FROM %s l WHERE l.%I = $1::%s AND (%s) COLLATE "C" = $1 ORDER BY 1 DESC NULLS LAST LIMIT 1',
                       e.at_expr, e.result_expr, a.legacy, a.key_column, e.key_type, e.key_expr)
           INTO v_at, v_res USING adopt_key.key;
    EXCEPTION WHEN data_exception THEN
        RETURN; -- a key that cannot be of the legacy key's type is not there
    END;
    IF v_at IS NULL OR v_at + a.ttl <= adopt_key.now THEN
        RETURN; -- not processed there, or its retention is over: a new key
    END IF;
    -- A stamp in the future is taken as now, as the copy takes it.
    v_at := LEAST(v_at, adopt_key.now);
    INSERT INTO idem.processed_events
           (source, key, first_seen_month, status, attempts, token, result, first_seen, updated_at, completed_at, expires_at)
    VALUES (a.source, adopt_key.key, idem.utc_month(v_at), 'completed', 1, idem.new_token(), v_res, v_at, adopt_key.now, v_at, v_at + a.ttl)
    ON CONFLICT DO NOTHING;
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.raise_lookback(p_source text, p_need interval)
 RETURNS interval
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v interval := make_interval(days => ceil(extract(epoch FROM p_need) / 86400)::int + 1);
BEGIN
    IF p_source IS NULL OR p_need IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.raise_lookback: source and need must not be NULL';
    END IF;
    INSERT INTO idem.lookbacks AS l (source, lookback) VALUES (p_source, v)
    ON CONFLICT (source) DO UPDATE SET lookback = EXCLUDED.lookback, raised_at = now()
     WHERE l.lookback < EXCLUDED.lookback;
    RETURN (SELECT max(l.lookback) FROM idem.lookbacks l WHERE l.source IN (p_source, '*'));
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.queue_hold(source text, key text, token bigint, job_id bigint)
 RETURNS bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_state text;
    v_old   bigint;
BEGIN
    PERFORM idem.check_key('idem.queue_hold', queue_hold.source, queue_hold.key);
    IF queue_hold.token IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.queue_hold: token must not be NULL';
    END IF;
    PERFORM 1 FROM idem.processed_events e
     WHERE e.source = queue_hold.source AND e.key = queue_hold.key
       AND e.token = queue_hold.token AND e.status = 'processing';
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'ID003',
            MESSAGE = format('idem.queue_hold: key %L of source %L is not acquired with this token', left(queue_hold.key, 64), queue_hold.source),
            HINT = 'Hold a key in the transaction that acquired it with idem.claim.';
    END IF;
    SELECT h.state, h.job_id INTO v_state, v_old FROM idem.holds h
     WHERE h.source = queue_hold.source AND h.key = queue_hold.key FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO idem.holds (source, key, token, job_id, state, held_at)
        VALUES (queue_hold.source, queue_hold.key, queue_hold.token, queue_hold.job_id, 'queued', idem.clock());
        PERFORM idem.queue_count(queue_hold.source, 1, 0);
        RETURN NULL;
    ELSIF v_state = 'queued' THEN
        RAISE EXCEPTION USING ERRCODE = 'ID003',
            MESSAGE = format('idem.queue_hold: key %L of source %L is already held by job %s', left(queue_hold.key, 64), queue_hold.source, v_old);
    END IF;
    UPDATE idem.holds h
       SET token = queue_hold.token, job_id = queue_hold.job_id, state = 'queued', held_at = idem.clock(),
           dead_at = NULL, error = NULL
     WHERE h.source = queue_hold.source AND h.key = queue_hold.key;
    RETURN v_old;
END
$function$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.claim_weight(p_source text, p_sample integer, p_now timestamp with time zone)
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_counted bigint;
    v_minute  timestamptz;
    v_tag     text;
BEGIN
    IF p_sample IS NULL OR p_sample < 0 OR p_sample > 1000000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = pg_catalog.format('idem.claim_weight: sampling %s is not in [0, 1000000]', p_sample);
    END IF;
    -- A read-only transaction (a hot standby, where idem.activity, being
    -- unlogged, cannot be read) counts nothing (idem.count_duplicate).
    IF p_sample = 0 OR pg_catalog.current_setting('transaction_read_only') = 'on' THEN
        RETURN 0;
    ELSIF p_sample = 1 THEN
        RETURN 1;
    END IF;
    v_minute := idem.activity_minute(p_now);
    -- A session that found the source at or above the rate in this minute
    -- samples for the rest of it (the minute's count only grows) without
    -- reading idem.activity again: the session setting
    -- idem.sampled_minute remembers the minute and the source (one source
    -- a session; another source, or the next minute, reads again). It is
    -- only a cache of a fact every session would read the same.
    v_tag := (EXTRACT(epoch FROM v_minute))::bigint::text OPERATOR(pg_catalog.||) '/' OPERATOR(pg_catalog.||) p_source;
    IF pg_catalog.current_setting('idem.sampled_minute', true) IS DISTINCT FROM v_tag THEN
        -- The source's claims counted in this minute (its slots: one per
        -- backend; idem.activity's primary key starts with minute, source).
        SELECT pg_catalog.sum(a.acquired + a.duplicates) INTO v_counted
          FROM idem.activity a
         WHERE a.minute = v_minute AND a.source = p_source;
        IF coalesce(v_counted, 0) < idem.exact_counting_rate() THEN
            RETURN 1;
        END IF;
        PERFORM pg_catalog.set_config('idem.sampled_minute', v_tag, false);
    END IF;
    IF pg_catalog.random() * p_sample < 1 THEN
        RETURN p_sample;
    END IF;
    RETURN 0;
END
$function$;

-- +goose StatementEnd

-- +goose StatementBegin
DROP FUNCTION idem.check_legacy_reads(regclass, text, text, text);
-- +goose StatementEnd
-- +goose StatementBegin
DROP FUNCTION idem.foreign_objects(regclass, text[]);
-- +goose StatementEnd
-- +goose StatementBegin
DROP FUNCTION idem.foreign_type(oid);
-- +goose StatementEnd
-- +goose StatementBegin
DROP FUNCTION idem.trusted_owner(oid);
-- +goose StatementEnd
-- +goose StatementBegin
DROP SEQUENCE idem.sampling_key_a, idem.sampling_key_b;
-- +goose StatementEnd
