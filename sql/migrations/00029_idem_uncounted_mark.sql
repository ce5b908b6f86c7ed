-- A duplicate is counted unless its own transaction says otherwise.
--
-- A waiting duplicate's second claim (WithWait) runs in a transaction that
-- sets idem.uncounted, so idem.count_duplicate does not count the duplicate
-- twice. The mark was 'on': set at session level (any role can, and a
-- transaction-mode pooler carries it to the next client of the server
-- connection), it made every duplicate of every later client of that
-- connection uncounted, hiding a storm of redeliveries from the dashboard
-- and `idemctl stats`. The mark is now the transaction's start time as text
-- (the Go API sets it to now()::text in the same transaction); any other
-- value is no mark. A client of an older version still sets 'on' and its
-- waited duplicates are counted twice until it is upgraded: counting errs
-- upwards, never hides.
--
-- Tests: idem_test.TestSessionSettingsCarriedOver,
-- idem_test.TestWaitCountedOnce, migrate.TestUpgradeToUncountedMark.

-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.count_duplicate(p_source text, p_key text, p_month date, p_weight integer, p_per_key boolean, p_now timestamp with time zone)
 RETURNS void
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    -- A read-only transaction (a hot standby) answers the duplicate
    -- without counting it.
    IF pg_catalog.current_setting('transaction_read_only') = 'on' THEN
        RETURN;
    END IF;
    -- A waiting duplicate's claim after its wait (WithWait) runs in a
    -- transaction marked idem.uncounted: its first claim, which found the
    -- key in progress, counted it already. The mark is the transaction's
    -- start time, so a value left in the session (any role can set one, and
    -- a transaction-mode pooler carries it to the next client) marks no
    -- other transaction.
    IF pg_catalog.current_setting('idem.uncounted', true) OPERATOR(pg_catalog.=) pg_catalog.now()::pg_catalog.text THEN
        RETURN;
    END IF;
    INSERT INTO idem.duplicate_counts AS d (source, slot, duplicates, since, last_seen_at)
    VALUES (p_source, pg_backend_pid(), p_weight, p_now, p_now)
    ON CONFLICT (source, slot) DO UPDATE
       SET duplicates = d.duplicates + EXCLUDED.duplicates, last_seen_at = EXCLUDED.last_seen_at;
    -- (version 10) and in its minute of idem.activity.
    PERFORM idem.count_activity(p_source, p_now, 0, p_weight);
    IF p_per_key THEN
        UPDATE idem.processed_events e
           SET duplicates = e.duplicates + p_weight, last_seen_at = p_now
          FROM (SELECT l.first_seen_month FROM idem.processed_events l
                 WHERE l.source = p_source AND l.key = p_key AND l.first_seen_month = p_month
                   FOR UPDATE SKIP LOCKED) l
         WHERE e.source = p_source AND e.key = p_key AND e.first_seen_month = l.first_seen_month;
    END IF;
END
$function$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.count_duplicate(p_source text, p_key text, p_month date, p_weight integer, p_per_key boolean, p_now timestamp with time zone)
 RETURNS void
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    -- A read-only transaction (a hot standby) answers the duplicate
    -- without counting it.
    IF pg_catalog.current_setting('transaction_read_only') = 'on' THEN
        RETURN;
    END IF;
    -- (version 15) A waiting duplicate's claim after its wait (WithWait)
    -- runs in a transaction marked idem.uncounted: its first claim, which
    -- found the key in progress, counted it already.
    IF pg_catalog.current_setting('idem.uncounted', true) = 'on' THEN
        RETURN;
    END IF;
    INSERT INTO idem.duplicate_counts AS d (source, slot, duplicates, since, last_seen_at)
    VALUES (p_source, pg_backend_pid(), p_weight, p_now, p_now)
    ON CONFLICT (source, slot) DO UPDATE
       SET duplicates = d.duplicates + EXCLUDED.duplicates, last_seen_at = EXCLUDED.last_seen_at;
    -- (version 10) and in its minute of idem.activity.
    PERFORM idem.count_activity(p_source, p_now, 0, p_weight);
    IF p_per_key THEN
        UPDATE idem.processed_events e
           SET duplicates = e.duplicates + p_weight, last_seen_at = p_now
          FROM (SELECT l.first_seen_month FROM idem.processed_events l
                 WHERE l.source = p_source AND l.key = p_key AND l.first_seen_month = p_month
                   FOR UPDATE SKIP LOCKED) l
         WHERE e.source = p_source AND e.key = p_key AND e.first_seen_month = l.first_seen_month;
    END IF;
END
$function$;
-- +goose StatementEnd
