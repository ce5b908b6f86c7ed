package inbox

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"time"

	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/internal/sqlstate"
)

// A dead letter's payload is kept on its hold (idem.holds.payload,
// migration 17) as well as in its River job, so that River deleting the
// job (an application's own River client keeps River's 7-day retention of
// discarded jobs) does not lose it: DeadLetters and Replay read it from
// the hold when the job is gone.

// keepPayload stores args, the dead job's encoded args, on its hold. A
// failure is logged and leaves the payload in the job alone (as before
// migration 17, which a database not yet migrated lacks).
func (in *Inbox) keepPayload(ctx context.Context, log *slog.Logger, a Job, args []byte) {
	kept, err := pgxdb.New(in.cfg.Pool).QueueKeepPayload(ctx, pgxdb.QueueKeepPayloadParams{
		Source: a.Source, Key: a.Key, JobToken: a.Token, Payload: args})
	switch {
	case err != nil && sqlstate.Of(err) == sqlstate.UndefinedFunction:
		log.LogAttrs(ctx, slog.LevelWarn, "inbox: the dead letter's payload is only in its River job (run idemctl migrate up to keep it in idem)")
	case err != nil:
		log.LogAttrs(ctx, slog.LevelWarn, "inbox: could not keep the dead letter's payload in idem; it stays in its River job", slog.Any("error", err))
	case !kept:
		log.LogAttrs(ctx, slog.LevelInfo, "inbox: the dead letter was taken over before its payload was kept")
	}
}

// keptPayload reads the payload kept on the dead hold of (source, key) for
// the job token: kept is false when there is none (not kept, not that
// job's dead letter any more, or a database before migration 17).
func (in *Inbox) keptPayload(ctx context.Context, source, key string, token int64) (j Job, kept bool, err error) {
	rows, err := pgxdb.New(in.cfg.Pool).QueueDeadPayload(ctx, pgxdb.QueueDeadPayloadParams{Source: source, Key: key, JobToken: token})
	if err != nil {
		if sqlstate.Of(err) == sqlstate.UndefinedColumn {
			return j, false, nil
		}
		return j, false, fmt.Errorf("inbox: the dead letter's kept payload: %w", err)
	}
	if len(rows) == 0 || rows[0] == nil {
		return j, false, nil
	}
	if err := json.Unmarshal(rows[0], &j); err != nil {
		return j, false, fmt.Errorf("inbox: the dead letter's kept payload of %q/%q: %w", source, key, err)
	}
	return j, true, nil
}

// keptShown fills what d's listing shows from the payload kept on its
// hold, when its job is gone, without reading the payload itself.
func (in *Inbox) keptShown(ctx context.Context, d *DeadLetter) error {
	rows, err := pgxdb.New(in.cfg.Pool).QueueDeadKept(ctx, pgxdb.QueueDeadKeptParams{Source: d.Source, Key: d.Key, JobToken: d.token})
	if err != nil {
		if sqlstate.Of(err) == sqlstate.UndefinedColumn {
			return nil
		}
		return fmt.Errorf("inbox: the dead letter's kept payload: %w", err)
	}
	if len(rows) == 0 {
		return nil
	}
	d.EventType, d.PayloadLost = rows[0].EventType, false
	if at, err := time.Parse(time.RFC3339Nano, rows[0].AcceptedAt); err == nil {
		d.AcceptedAt = at
	}
	return nil
}
