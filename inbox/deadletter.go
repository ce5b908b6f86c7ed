package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/sqlstate"
)

// Filter selects dead letters: all of them when empty.
type Filter struct {
	Source string    // only this source
	Key    string    // only this key (with Source)
	Since  time.Time // only those dead-lettered at or after this time
	Limit  int       // at most this many (0: 1000)
}

// DeadLetter is an event whose job River discarded after its last attempt
// (or cancelled, for an error marked idem.Permanent).
type DeadLetter struct {
	JobID                  int64
	Source, Key, EventType string
	Attempts               int
	LastError              string
	AcceptedAt, FailedAt   time.Time
	State                  rivertype.JobState // discarded or cancelled
	job                    Job
}

var deadStates = []rivertype.JobState{rivertype.JobStateDiscarded, rivertype.JobStateCancelled}

// DeadLetters lists dead-lettered events, oldest first.
func (in *Inbox) DeadLetters(ctx context.Context, f Filter) ([]DeadLetter, error) {
	if f.Key != "" && f.Source == "" {
		return nil, fmt.Errorf("%w: a key needs its source", ErrInvalidConfig)
	}
	limit := f.Limit
	if limit <= 0 {
		limit = 1000
	}
	p := river.NewJobListParams().Kinds(Kind).Queues(in.cfg.Queue).States(deadStates...).First(limit).
		OrderBy(river.JobListOrderByID, river.SortOrderAsc)
	if f.Source != "" {
		meta := map[string]string{"idem_source": f.Source}
		if f.Key != "" {
			meta["idem_key"] = f.Key
		}
		b, _ := json.Marshal(meta)
		p = p.Metadata(string(b))
	}
	if !f.Since.IsZero() {
		p = p.Where("finalized_at >= @since", river.NamedArgs{"since": f.Since})
	}
	res, err := in.insert.JobList(ctx, p)
	if err != nil {
		if sqlstate.Of(err) == sqlstate.UndefinedTable {
			return nil, errNotMigrated
		}
		return nil, fmt.Errorf("inbox: list dead letters: %w", err)
	}
	out := make([]DeadLetter, 0, len(res.Jobs))
	for _, row := range res.Jobs {
		var j Job
		if err := json.Unmarshal(row.EncodedArgs, &j); err != nil {
			return nil, fmt.Errorf("inbox: job %d: %w", row.ID, err)
		}
		d := DeadLetter{JobID: row.ID, Source: j.Source, Key: j.Key, EventType: j.EventType, Attempts: row.Attempt,
			AcceptedAt: j.AcceptedAt, State: row.State, job: j}
		if n := len(row.Errors); n > 0 {
			d.LastError = row.Errors[n-1].Error
		}
		if row.FinalizedAt != nil {
			d.FailedAt = *row.FinalizedAt
		}
		out = append(out, d)
	}
	return out, nil
}

// ReplayResult says what Replay did with one dead letter.
type ReplayResult struct {
	DeadLetter
	// Outcome: "replayed" (claimed again and a new job enqueued: NewJobID),
	// "already processed" (the event's key is completed: nothing runs, and
	// the dead letter is removed), "in progress" (a redelivery holds the
	// key; left as it is), or "failed" (the key failed for good, e.g. past
	// its policy's max_attempts; left as it is, with Error).
	Outcome  string
	NewJobID int64
	Error    string
}

// Replay re-enqueues the dead letters f selects through the same claim as
// a delivery: each key is claimed again and, when acquired, a new job with
// the same payload replaces the dead one in one transaction. An event
// whose key is already completed is not run again.
func (in *Inbox) Replay(ctx context.Context, f Filter) ([]ReplayResult, error) {
	dead, err := in.DeadLetters(ctx, f)
	if err != nil {
		return nil, err
	}
	out := make([]ReplayResult, 0, len(dead))
	for _, d := range dead {
		r := ReplayResult{DeadLetter: d}
		err := pgx.BeginFunc(ctx, in.cfg.Pool, func(tx pgx.Tx) error {
			cl, err := in.idem.WithTx(tx).Claim(ctx, d.Source, d.Key, in.claimOptions("", d.EventType)...)
			if err != nil {
				return err
			}
			switch cl.Outcome {
			case idem.Acquired:
				j := d.job
				j.Token, j.FirstSeen, j.ExpiresAt = cl.Token, cl.FirstSeen, cl.ExpiresAt
				if r.NewJobID, err = in.insertJob(ctx, tx, j); err != nil {
					return err
				}
				r.Outcome = "replayed"
			case idem.Completed:
				r.Outcome = "already processed"
			case idem.InProgress:
				r.Outcome = "in progress"
				return nil
			default:
				r.Outcome, r.Error = "failed", cl.Error
				return nil
			}
			_, err = in.insert.JobDeleteTx(ctx, tx, d.JobID)
			if errors.Is(err, river.ErrNotFound) {
				err = nil // removed by someone else meanwhile
			}
			return err
		})
		if err != nil {
			return out, fmt.Errorf("inbox: replay %q/%q (job %d): %w", d.Source, d.Key, d.JobID, err)
		}
		out = append(out, r)
	}
	return out, nil
}

// SourceStats counts a source's inbox jobs by state.
type SourceStats struct {
	Source                    string
	Queued, Running, Retrying int64
	Dead                      int64 // dead letters: discarded or cancelled
}

// Stats counts the inbox's jobs per source. Completed jobs are not
// counted (River cleans them up after a day).
func (in *Inbox) Stats(ctx context.Context) ([]SourceStats, error) {
	return Stats(ctx, in.cfg.Pool, in.cfg.Schema)
}

// Stats counts inbox jobs per source in the River tables of schema (""
// for the search_path); none when River is not migrated.
func Stats(ctx context.Context, db interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
	QueryRow(context.Context, string, ...any) pgx.Row
}, schema string) ([]SourceStats, error) {
	table := pgx.Identifier{"river_job"}
	if schema != "" {
		table = pgx.Identifier{schema, "river_job"}
	}
	var exists bool
	if err := db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table.Sanitize()).Scan(&exists); err != nil || !exists {
		return nil, err
	}
	rows, err := db.Query(ctx, `
		SELECT metadata->>'idem_source' AS source,
		       count(*) FILTER (WHERE state IN ('available', 'scheduled', 'pending')),
		       count(*) FILTER (WHERE state = 'running'),
		       count(*) FILTER (WHERE state = 'retryable'),
		       count(*) FILTER (WHERE state IN ('discarded', 'cancelled'))
		  FROM `+table.Sanitize()+`
		 WHERE kind = $1
		 GROUP BY 1 ORDER BY 1`, Kind)
	if err != nil {
		return nil, fmt.Errorf("inbox: stats: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (SourceStats, error) {
		var s SourceStats
		err := r.Scan(&s.Source, &s.Queued, &s.Running, &s.Retrying, &s.Dead)
		return s, err
	})
}
