package inbox

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river/rivertype"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/db/pgxdb"
)

// RepairReport says what Repair did.
type RepairReport struct {
	// Requeued: events whose job had completed without completing them
	// (two attempts of a job overlapped), enqueued again with the same
	// payload.
	Requeued int
	// Discarded: events whose job River gave up on (discarded past its
	// attempts, by a failure, a rescue of a worker that crashed or hung,
	// or a timeout; or cancelled) without the worker recording it: each
	// is a dead letter with its payload and that reason, never enqueued
	// again with fresh attempts.
	Discarded int
	// DeadLettered: events whose job was gone (deleted, or removed by
	// River's cleaner), dead-lettered with that reason: the payload is
	// gone with the job, so the sender must deliver the event again.
	DeadLettered int
}

// orphanQuery selects one page of the queued events no job will run, after
// the keyset cursor ($1 held_at, $2 source, $3 key; $4 false for the first
// page), $5 at a time: held for a job that is missing or finished
// (completed, discarded or cancelled) without completing the key. River
// can leave one behind when two attempts of a job overlap (River completes
// or discards the job on behalf of the attempt that lost the key), when
// its rescuer discards the job of a worker that crashed on each attempt,
// when another River client's leader discards a kind it has no worker for,
// or when a job row is deleted by hand.
func orphanQuery(schema string) string {
	return `SELECT h.source, h.key, h.token, coalesce(h.job_id, 0), h.held_at, j.id IS NOT NULL, coalesce(j.state::text, ''),
	             coalesce(j.attempt, 0), coalesce(j.args, '{}'::jsonb), coalesce(j.metadata, '{}'::jsonb),
	             coalesce(j.errors[pg_catalog.array_length(j.errors, 1)]->>'error', '')
	        FROM idem.holds h
	        LEFT JOIN ` + riverTable(schema, "river_job") + ` j ON j.id = h.job_id
	       WHERE h.state = 'queued' AND (j.id IS NULL OR j.state IN ('completed', 'discarded', 'cancelled'))
	         AND (NOT $4::boolean OR (h.held_at, h.source, h.key) > ($1::timestamptz, $2::text, $3::text))
	       ORDER BY h.held_at, h.source, h.key
	       LIMIT $5`
}

// repairPage is how many orphans each page of a Repair reads.
const repairPage = 500

// rescuedError is the error River's rescuer records on a job it rescued:
// its worker crashed or hung past RescueStuckJobsAfter.
const rescuedError = "Stuck job rescued by JobRescuer"

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
	var cursor orphan
	for paged := false; ; paged = true {
		rows, err := in.cfg.Pool.Query(ctx, orphanQuery(in.cfg.Schema), cursor.heldAt, cursor.source, cursor.key, paged, repairPage)
		if err != nil {
			return rep, fmt.Errorf("inbox: repair: %w", err)
		}
		found, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (orphan, error) {
			var o orphan
			err := r.Scan(&o.source, &o.key, &o.token, &o.job, &o.heldAt, &o.exists, &o.state, &o.attempt, &o.args, &o.meta, &o.lastError)
			return o, err
		})
		if err != nil {
			return rep, fmt.Errorf("inbox: repair: %w", err)
		}
		if len(found) == 0 {
			return rep, nil
		}
		cursor = found[len(found)-1]
		for _, o := range found {
			if err := in.repairOne(ctx, o, &rep); err != nil {
				return rep, err
			}
		}
	}
}

// orphan is one row of orphanQuery.
type orphan struct {
	source, key string
	token, job  int64
	heldAt      time.Time
	exists      bool
	state       string
	attempt     int
	args, meta  []byte
	lastError   string
}

// repairReason is the dead letter's reason for an event whose job River
// gave up on.
func (o orphan) repairReason() string {
	switch {
	case o.state == string(rivertype.JobStateCancelled):
		return fmt.Sprintf("River cancelled the event's job (%d) before it completed the event; last error: %s", o.job, o.lastError)
	case strings.Contains(o.lastError, rescuedError):
		return fmt.Sprintf("the event's worker crashed or hung on its last attempt (attempt %d of job %d), and River's rescuer gave the job up: the handler may kill its process (out of memory, a crash in cgo, a panic in a goroutine of its own); replay it once that is fixed", o.attempt, o.job)
	case o.lastError == "":
		return fmt.Sprintf("River discarded the event's job (%d) after %d attempts without its worker recording a failure", o.job, o.attempt)
	}
	return fmt.Sprintf("River discarded the event's job (%d) after %d attempts; last error: %s", o.job, o.attempt, o.lastError)
}

// repairOne gives one orphan back to the queue, or dead-letters it, in a
// transaction of its own.
func (in *Inbox) repairOne(ctx context.Context, o orphan, rep *RepairReport) error {
	var out string
	gaveUp := o.exists && (o.state == string(rivertype.JobStateDiscarded) || o.state == string(rivertype.JobStateCancelled))
	err := pgx.BeginFunc(ctx, in.cfg.Pool, func(tx pgx.Tx) error {
		tx = pooled(tx)
		p := pgxdb.QueueRepairParams{Source: o.source, Key: o.key, JobToken: o.token, OldJobID: o.job}
		switch {
		case gaveUp:
			// River gave up on the job: the event ends as a dead letter
			// with its payload and why, as if its worker had recorded it.
			reason := idem.StorableText(o.repairReason())
			p.Reason = &reason
		case o.exists:
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
		default:
			reason := fmt.Sprintf("the event's job (%d) is gone before it completed the event (deleted, or removed by River's cleaner); its payload went with it: have the sender deliver the event again", o.job)
			p.Reason = &reason
		}
		var err error
		if gaveUp {
			// Before any attempt took the key (River discarded the job at
			// once, or it was cancelled), the key is still in processing
			// under the accept's claim: fail it as its worker would have,
			// so that a replay claims it at once rather than after the
			// accept's lease. Once an attempt took it, the key is that
			// attempt's (stale_token here), and queue_repair waits for its
			// lease to end.
			out, err = pgxdb.New(tx).QueueFail(ctx, pgxdb.QueueFailParams{Source: o.source, Key: o.key,
				JobToken: o.token, Token: o.token, Error: *p.Reason, Dead: true})
			if err != nil {
				return err
			}
		}
		if out != "dead" {
			if out, err = pgxdb.New(tx).QueueRepair(ctx, p); err != nil {
				return err
			}
		}
		switch {
		case out == "skipped":
			return errSkip
		case out == "dead" && gaveUp:
			// Its payload, kept on the hold with the dead letter, in the
			// same transaction: River's cleaner may delete the job later.
			kept, err := pgxdb.New(tx).QueueKeepPayload(ctx, pgxdb.QueueKeepPayloadParams{Source: o.source, Key: o.key, JobToken: o.token, Payload: o.args})
			if err != nil {
				return fmt.Errorf("keep the payload: %w", err)
			}
			if !kept {
				return fmt.Errorf("keep the payload: the dead letter is not the job's")
			}
		}
		return nil
	})
	log := func(level slog.Level, msg string) {
		in.cfg.Logger.LogAttrs(ctx, level, msg, slog.String("source", o.source), slog.String("key", o.key), slog.Int64("job", o.job))
	}
	switch {
	case err == errSkip:
	case err != nil:
		return fmt.Errorf("inbox: repair %q/%q: %w", o.source, o.key, err)
	case out == "requeued":
		rep.Requeued++
		log(slog.LevelWarn, "inbox: repair: the event's job finished without processing it; enqueued again")
	case out == "dead" && gaveUp:
		rep.Discarded++
		log(slog.LevelError, "inbox: repair: River gave up on the event's job; dead-lettered with its payload: "+o.repairReason())
	case out == "dead":
		rep.DeadLettered++
		log(slog.LevelError, "inbox: repair: the event's job is gone with its payload; dead-lettered")
	}
	return nil
}

// errSkip rolls a repair's transaction back: nothing to repair after all.
var errSkip = fmt.Errorf("inbox: nothing to repair")
