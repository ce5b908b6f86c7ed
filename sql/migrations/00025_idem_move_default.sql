-- idem 25: rows that landed in the default partition can be moved into
-- their month, so that the month gets its partition again.
--
-- Claims land in the default partition when their month has no partition
-- (rotation was not running when the month began). idem.make_month keeps
-- such a month without a partition for as long as the default partition
-- holds rows of it, so every later claim of that month lands there too,
-- and idem_default_partition_rows (the IdemDefaultPartitionRows alert)
-- stays above zero until prune deletes the last of them: the alert could
-- not be cleared by any operator action.
--
-- * idem.move_default_month(month, max_rows): in one transaction, under an
--   ACCESS EXCLUSIVE lock of the default partition (which every claim of
--   a month without a partition needs, so the caller's lock_timeout bounds
--   the wait for it and claims wait behind it as long as the move takes),
--   deletes the month's rows from the default partition, makes the
--   month's partition (idem.make_month, which finds the month free now),
--   and inserts the rows into it, as they were. A key is in exactly one
--   place at every moment any other transaction can see. The move holds
--   the lock for as long as it takes to copy the month's rows, so a month
--   with more than max_rows of them is refused (ID010) before anything is
--   moved: prune deletes them as they expire, or the operator raises the
--   bound for a quiet hour. Refused on a distributed (Citus)
--   installation (ID006), as make_month's callers there are.
-- * idem.default_months(): the months that have rows in the default
--   partition, and how many each.
--
-- Both are the maintainer's (idem.rights). Down drops them.

-- +goose Up
-- +goose StatementBegin
CREATE FUNCTION idem.default_months()
RETURNS TABLE (month date, row_count bigint)
    LANGUAGE sql STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
    SELECT d.first_seen_month, count(*)
      FROM idem.processed_events_default d
     GROUP BY d.first_seen_month
     ORDER BY d.first_seen_month
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION idem.move_default_month(month date, max_rows bigint)
RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    SET "DateStyle" = 'ISO, YMD'
AS $$
DECLARE
    v_lo    date;
    v_hi    date;
    v_n     bigint;
    v_made  text;
    v_moved bigint;
BEGIN
    IF move_default_month.month IS NULL OR move_default_month.max_rows IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.move_default_month: month and max_rows must not be NULL';
    END IF;
    IF move_default_month.max_rows OPERATOR(pg_catalog.<) 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('idem.move_default_month: max_rows %s is below 1', move_default_month.max_rows);
    END IF;
    IF idem.distributed() THEN
        RAISE EXCEPTION USING ERRCODE = 'ID006',
            MESSAGE = 'idem.move_default_month does not run on a distributed (Citus) installation';
    END IF;
    v_lo := date_trunc('month', move_default_month.month::timestamp)::date;
    v_hi := (v_lo::timestamp OPERATOR(pg_catalog.+) interval '1 month')::date;

    -- Every claim of a month without a partition reads and writes the
    -- default partition: from here to the commit none is half-way.
    LOCK TABLE idem.processed_events_default IN ACCESS EXCLUSIVE MODE;
    SELECT count(*) INTO v_n
      FROM idem.processed_events_default d
     WHERE d.first_seen_month OPERATOR(pg_catalog.>=) v_lo AND d.first_seen_month OPERATOR(pg_catalog.<) v_hi;
    IF v_n OPERATOR(pg_catalog.>) move_default_month.max_rows THEN
        RAISE EXCEPTION USING ERRCODE = 'ID010',
            MESSAGE = format('idem.move_default_month: %s rows of %s are in the default partition, more than max_rows (%s)',
                             v_n, to_char(v_lo, 'YYYY-MM'), move_default_month.max_rows),
            DETAIL = 'The move holds the default partition''s lock, which claims of months without a partition wait for, as long as copying the rows takes.',
            HINT = 'Raise the bound (idemctl partitions move-default --max-rows) at a quiet hour, or let prune delete the rows as they expire.';
    END IF;

    CREATE TEMPORARY TABLE idem_moving (LIKE idem.processed_events) ON COMMIT DROP;
    WITH moved AS (
        DELETE FROM idem.processed_events_default d
         WHERE d.first_seen_month OPERATOR(pg_catalog.>=) v_lo AND d.first_seen_month OPERATOR(pg_catalog.<) v_hi
        RETURNING d.*)
    INSERT INTO pg_temp.idem_moving SELECT * FROM moved;
    v_made := idem.make_month(v_lo);
    IF v_made NOT IN ('created', 'exists') THEN
        RAISE EXCEPTION USING ERRCODE = 'ID007',
            MESSAGE = format('idem.move_default_month: the partition of %s could not be made: %s', to_char(v_lo, 'YYYY-MM'), v_made);
    END IF;
    INSERT INTO idem.processed_events SELECT * FROM pg_temp.idem_moving;
    GET DIAGNOSTICS v_moved = ROW_COUNT;
    DROP TABLE pg_temp.idem_moving;
    RETURN v_moved;
END
$$;
-- +goose StatementEnd

REVOKE ALL ON FUNCTION idem.default_months(), idem.move_default_month(date, bigint) FROM PUBLIC;

INSERT INTO idem.rights (grantee, privilege, kind, object) VALUES
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.default_months()'),
    ('maintainer', 'EXECUTE', 'FUNCTION', 'idem.move_default_month(date, bigint)');

SELECT idem.regrant();

-- +goose Down
DELETE FROM idem.rights x
 WHERE x.object IN ('idem.default_months()', 'idem.move_default_month(date, bigint)');
DROP FUNCTION idem.move_default_month(date, bigint);
DROP FUNCTION idem.default_months();
