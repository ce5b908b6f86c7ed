-- SERIALIZABLE claims when the last checkpoint cannot be read.
--
-- idem.serializable_floor (migration 32) reads pg_catalog.
-- pg_control_checkpoint() as idem's owner. Where that function is not
-- executable by idem's owner (REVOKE ... FROM PUBLIC by a hardened or
-- hosted setup, an owner that is not a superuser) or not supported, the
-- read raised, and with it every SERIALIZABLE claim of a new key and every
-- SERIALIZABLE batch: claims that worked at version 31 failed with 42501.
-- The function's own comment promised the fallback ("or no checkpoint can
-- be read: every month of the window"); it now keeps it: an error reading
-- the checkpoint makes the placeholders go into every month of the window,
-- as before migration 32.
--
-- Tests: idem_test.TestSerializableCheckpointUnreadable,
-- migrate.TestUpgradeToCheckpointUnreadable.
-- Down restores migration 32's idem.serializable_floor.

-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.serializable_floor(p_now timestamp with time zone, p_lo date)
 RETURNS date
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_ckpt record;
BEGIN
    -- The first month a SERIALIZABLE claim's placeholders go into (the
    -- last is a day ahead of now; the window's p_lo at the earliest).
    --
    -- A SERIALIZABLE claim's snapshot cannot see a claim of the same key
    -- committed after it into another month's partition. A placeholder
    -- insert of the key into such a month meets every committed row of the
    -- unique index, visible or not, and on one the snapshot cannot see it
    -- fails with 40001 (the caller retries with a snapshot that sees it).
    -- Every writer of a key's row puts it in the month of its own clock,
    -- read just before it writes (a claim, a batch, an adoption; a
    -- take-over updates the row where it is, which the snapshot sees and
    -- the update meets). A transaction that commits after this snapshot was
    -- running when it was taken, or began after. If no transaction running
    -- then had taken its transaction id before the last checkpoint began
    -- (the snapshot's xmin is not older than the checkpoint's next xid),
    -- every such writer took its id, and so read its clock, after the
    -- checkpoint's start less the day of margin the design allows for a
    -- clock stepped back or a writer stalled between its clock and its
    -- insert: the months from then on are enough. Otherwise (a transaction
    -- older than the checkpoint is still open, or no checkpoint can be
    -- read) every month of the window.
    -- (version 33) A checkpoint that cannot be read (pg_control_checkpoint
    -- revoked from PUBLIC, as some hosted services do, or not supported
    -- there) is no checkpoint: every month of the window, as for a
    -- transaction older than the checkpoint. Before, the claim failed
    -- (42501), so every SERIALIZABLE claim of a new key did.
    BEGIN
        SELECT c.checkpoint_time, c.next_xid INTO v_ckpt FROM pg_catalog.pg_control_checkpoint() c;
    EXCEPTION WHEN OTHERS THEN
        RETURN p_lo;
    END;
    IF v_ckpt.next_xid OPERATOR(pg_catalog.~) '^[0-9]+:[0-9]+$' AND v_ckpt.checkpoint_time IS NOT NULL
       AND pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot())::pg_catalog.text::pg_catalog.numeric
           OPERATOR(pg_catalog.>=) ((pg_catalog.split_part(v_ckpt.next_xid, ':', 1)::pg_catalog.numeric OPERATOR(pg_catalog.*) 4294967296)
                                    OPERATOR(pg_catalog.+) pg_catalog.split_part(v_ckpt.next_xid, ':', 2)::pg_catalog.numeric) THEN
        RETURN GREATEST(p_lo, idem.utc_month(LEAST(v_ckpt.checkpoint_time, p_now) OPERATOR(pg_catalog.-) interval '1 day'));
    END IF;
    RETURN p_lo;
END
$function$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem.serializable_floor(p_now timestamp with time zone, p_lo date)
 RETURNS date
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_ckpt record;
BEGIN
    -- The first month a SERIALIZABLE claim's placeholders go into (the
    -- last is a day ahead of now; the window's p_lo at the earliest).
    --
    -- A SERIALIZABLE claim's snapshot cannot see a claim of the same key
    -- committed after it into another month's partition. A placeholder
    -- insert of the key into such a month meets every committed row of the
    -- unique index, visible or not, and on one the snapshot cannot see it
    -- fails with 40001 (the caller retries with a snapshot that sees it).
    -- Every writer of a key's row puts it in the month of its own clock,
    -- read just before it writes (a claim, a batch, an adoption; a
    -- take-over updates the row where it is, which the snapshot sees and
    -- the update meets). A transaction that commits after this snapshot was
    -- running when it was taken, or began after. If no transaction running
    -- then had taken its transaction id before the last checkpoint began
    -- (the snapshot's xmin is not older than the checkpoint's next xid),
    -- every such writer took its id, and so read its clock, after the
    -- checkpoint's start less the day of margin the design allows for a
    -- clock stepped back or a writer stalled between its clock and its
    -- insert: the months from then on are enough. Otherwise (a transaction
    -- older than the checkpoint is still open, or no checkpoint can be
    -- read) every month of the window.
    SELECT c.checkpoint_time, c.next_xid INTO v_ckpt FROM pg_catalog.pg_control_checkpoint() c;
    IF v_ckpt.next_xid OPERATOR(pg_catalog.~) '^[0-9]+:[0-9]+$' AND v_ckpt.checkpoint_time IS NOT NULL
       AND pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot())::pg_catalog.text::pg_catalog.numeric
           OPERATOR(pg_catalog.>=) ((pg_catalog.split_part(v_ckpt.next_xid, ':', 1)::pg_catalog.numeric OPERATOR(pg_catalog.*) 4294967296)
                                    OPERATOR(pg_catalog.+) pg_catalog.split_part(v_ckpt.next_xid, ':', 2)::pg_catalog.numeric) THEN
        RETURN GREATEST(p_lo, idem.utc_month(LEAST(v_ckpt.checkpoint_time, p_now) OPERATOR(pg_catalog.-) interval '1 day'));
    END IF;
    RETURN p_lo;
END
$function$;
-- +goose StatementEnd
