-- idem 17: a dead letter keeps its payload in idem.
--
-- A dead letter's payload (the request the inbox accepted) lived only in
-- its River job. River deletes discarded and cancelled jobs after
-- DiscardedJobRetentionPeriod / CancelledJobRetentionPeriod (7 days by
-- default); the inbox's own worker client turns that off, but an
-- application that runs its own River client (inbox.AddWorker) keeps the
-- default, and its dead letters' payloads vanished a week later:
-- `idemctl inbox replay` then answered "payload lost".
--
-- * idem.holds.payload (jsonb, NULL): the dead job's encoded args, written
--   when the hold becomes a dead letter; it goes with the hold (a replay
--   or a completed redelivery removes the row).
-- * idem.queue_keep_payload(source, key, job_token, payload): stores it
--   on the dead hold of that job token only; false when the hold is not
--   (or no longer) that job's dead letter. The inbox's worker calls it
--   right after idem.queue_fail answered 'dead'; replay reads the payload
--   from the hold when the job is gone.
--
-- Replaces nothing; Down drops the function and the column. The app role
-- gets EXECUTE through idem.rights (it already reads idem.holds, and the
-- same payloads in River's jobs).

-- +goose Up
ALTER TABLE idem.holds ADD COLUMN payload jsonb;

-- +goose StatementBegin
CREATE FUNCTION idem.queue_keep_payload(source text, key text, job_token bigint, payload jsonb) RETURNS boolean
    LANGUAGE plpgsql VOLATILE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    PERFORM idem.check_key('idem.queue_keep_payload', queue_keep_payload.source, queue_keep_payload.key);
    IF queue_keep_payload.job_token IS NULL OR queue_keep_payload.payload IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'idem.queue_keep_payload: job_token and payload must not be NULL';
    END IF;
    IF pg_catalog.jsonb_typeof(queue_keep_payload.payload) OPERATOR(pg_catalog.<>) 'object' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'idem.queue_keep_payload: payload must be a JSON object (a job''s encoded args)';
    END IF;
    IF pg_catalog.pg_column_size(queue_keep_payload.payload) OPERATOR(pg_catalog.>) 67108864 THEN
        RAISE EXCEPTION USING ERRCODE = '54000', MESSAGE = format('idem.queue_keep_payload: payload is %s bytes; at most 64 MiB',
            pg_catalog.pg_column_size(queue_keep_payload.payload));
    END IF;
    UPDATE idem.holds h
       SET payload = queue_keep_payload.payload
     WHERE h.source OPERATOR(pg_catalog.=) queue_keep_payload.source
       AND h.key OPERATOR(pg_catalog.=) queue_keep_payload.key
       AND h.token OPERATOR(pg_catalog.=) queue_keep_payload.job_token
       AND h.state OPERATOR(pg_catalog.=) 'dead';
    RETURN FOUND;
END
$$;
-- +goose StatementEnd

REVOKE ALL ON FUNCTION idem.queue_keep_payload(text, text, bigint, jsonb) FROM PUBLIC;

INSERT INTO idem.rights (grantee, privilege, kind, object) VALUES
    ('app', 'EXECUTE', 'FUNCTION', 'idem.queue_keep_payload(text, text, bigint, jsonb)');

SELECT idem.regrant();

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
DELETE FROM idem.rights x WHERE x.object = 'idem.queue_keep_payload(text, text, bigint, jsonb)';
DROP FUNCTION idem.queue_keep_payload(text, text, bigint, jsonb);
ALTER TABLE idem.holds DROP COLUMN payload;
