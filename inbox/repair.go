package inbox

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/db/pgxdb"
)

// RepairReport says what Repair did.
type RepairReport struct {
	// Requeued: events whose job had finished without completing them,
	// enqueued again with the same payload.
	Requeued int
	// DeadLettered: events whose job was gone (deleted, or removed by
	// River's cleaner), dead-lettered with that reason: the payload is
	// gone with the job, so the sender must deliver the event again.
	DeadLettered int
}

// orphanQuery selects the queued events no job will run: held for a job
// that is missing or finished (completed, discarded or cancelled) without
// completing the key. River can leave one behind when two attempts of a
// job overlap (River completes or discards the job on behalf of the
// attempt that lost the key), when another River client's leader discards
// a kind it has no worker for, or when a job row is deleted by hand.
func orphanQuery(schema string, limit bool) string {
	q := `SELECT h.source, h.key, h.token, coalesce(h.job_id, 0), j.id IS NOT NULL, coalesce(j.args, '{}'::jsonb),
	             coalesce(j.metadata, '{}'::jsonb)
	        FROM idem.holds h
	        LEFT JOIN ` + riverTable(schema, "river_job") + ` j ON j.id = h.job_id
	       WHERE h.state = 'queued' AND (j.id IS NULL OR j.state IN ('completed', 'discarded', 'cancelled'))
	       ORDER BY h.held_at`
	if limit {
		q += ` LIMIT 1000`
	}
	return q
}

// riverTable names one of River's tables in schema ("" for the search_path).
func riverTable(schema, name string) string {
	if schema == "" {
		return pgx.Identifier{name}.Sanitize()
	}
	return pgx.Identifier{schema, name}.Sanitize()
}

// Repair finds queued events that no job will run (see Reconcile's
// Unaccounted) and gives each one back to the queue: a new job with the
// same payload, or, when the payload is gone with its job, a dead letter
// saying so. An event an attempt still holds a live lease on is left
// alone. NewWorkerClient's client runs it every Config.RepairEvery; it is
// safe to run from several processes at once.
func (in *Inbox) Repair(ctx context.Context) (RepairReport, error) {
	var rep RepairReport
	if err := in.refuseCitus(ctx, in.cfg.Pool); err != nil {
		return rep, err
	}
	rows, err := in.cfg.Pool.Query(ctx, orphanQuery(in.cfg.Schema, true))
	if err != nil {
		return rep, fmt.Errorf("inbox: repair: %w", err)
	}
	type orphan struct {
		source, key string
		token, job  int64
		exists      bool
		args, meta  []byte
	}
	found, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (orphan, error) {
		var o orphan
		err := r.Scan(&o.source, &o.key, &o.token, &o.job, &o.exists, &o.args, &o.meta)
		return o, err
	})
	if err != nil {
		return rep, fmt.Errorf("inbox: repair: %w", err)
	}
	for _, o := range found {
		var out string
		err := pgx.BeginFunc(ctx, in.cfg.Pool, func(tx pgx.Tx) error {
			p := pgxdb.QueueRepairParams{Source: o.source, Key: o.key, JobToken: o.token, OldJobID: o.job}
			if o.exists {
				var j Job
				if err := json.Unmarshal(o.args, &j); err != nil {
					return fmt.Errorf("job %d: %w", o.job, err)
				}
				// The trace context of the request that accepted the event
				// is in the old job's metadata, not its args: the new job
				// carries it on, as a replay's does.
				j.Trace = jobTrace(o.meta)
				res, err := in.insert.InsertTx(ctx, tx, j, in.insertOpts(j))
				if err != nil {
					return err
				}
				p.NewJobID = &res.Job.ID
			} else {
				reason := fmt.Sprintf("the event's job (%d) is gone before it completed the event (deleted, or removed by River's cleaner); its payload went with it: have the sender deliver the event again", o.job)
				p.Reason = &reason
			}
			var err error
			if out, err = pgxdb.New(tx).QueueRepair(ctx, p); err != nil {
				return err
			}
			if out == "skipped" {
				return errSkip
			}
			return nil
		})
		switch {
		case err == errSkip:
		case err != nil:
			return rep, fmt.Errorf("inbox: repair %q/%q: %w", o.source, o.key, err)
		case out == "requeued":
			rep.Requeued++
			in.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "inbox: repair: the event's job finished without processing it; enqueued again",
				slog.String("source", o.source), slog.String("key", o.key), slog.Int64("job", o.job))
		case out == "dead":
			rep.DeadLettered++
			in.cfg.Logger.LogAttrs(ctx, slog.LevelError, "inbox: repair: the event's job is gone with its payload; dead-lettered",
				slog.String("source", o.source), slog.String("key", o.key), slog.Int64("job", o.job))
		}
	}
	return rep, nil
}

// errSkip rolls a repair's transaction back: nothing to repair after all.
var errSkip = fmt.Errorf("inbox: nothing to repair")
