-- idem 16: duplicates are answered in a read-only transaction (a hot
-- standby, or BEGIN READ ONLY), where the sampled duplicate counter cannot
-- write.
--
-- * idem.count_duplicate, version 16: returns without counting when the
--   transaction is read-only. Before, a claim of a completed key on a
--   standby failed with 25006 (cannot execute INSERT in a read-only
--   transaction) whenever the counter's sample came up (one duplicate in
--   eight by default), although its answer needs no write. The counts are
--   statistics; a duplicate answered read-only is not counted.
--
-- Replaces idem.count_duplicate(text, text, date, integer, boolean,
-- timestamptz) only (version 15's, which skips a transaction marked
-- idem.uncounted); Down restores version 15's body. On a
-- distributed installation both directions end by running
-- idem.citus_setup() again, as every migration that replaces a function.

-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.count_duplicate(p_source text, p_key text, p_month date, p_weight integer,
                                     p_per_key boolean, p_now timestamptz) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
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
-- idem.count_duplicate, version 10: the duplicate is also counted in its
-- minute of idem.activity.
CREATE OR REPLACE FUNCTION idem.count_duplicate(p_source text, p_key text, p_month date, p_weight integer,
                                     p_per_key boolean, p_now timestamptz) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
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
