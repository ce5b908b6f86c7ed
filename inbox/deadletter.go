package inbox

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/riverqueue/river/rivertype"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/internal/sqlstate"
)

// Filter selects dead letters: all of them when empty.
type Filter struct {
	Source string    // only this source
	Key    string    // only this key (with Source)
	Since  time.Time // only those dead-lettered at or after this time
	Until  time.Time // only those dead-lettered before this time (zero: no bound)
	// ErrorContains: only those whose last error contains this text,
	// case-insensitively ("": any).
	ErrorContains string
	// Limit: at most this many (0: every one the filter selects; the
	// listing and the replay read them page by page, so there is no
	// limit of their own).
	Limit int
	// Newest lists newest first (by when they were dead-lettered);
	// otherwise oldest first. Replay goes the same way.
	Newest bool
}

// params are the filter's bounds as the queries take them.
func (f Filter) params() (since, until pgtype.Timestamptz, err error) {
	if f.Key != "" && f.Source == "" {
		return since, until, fmt.Errorf("%w: a key needs its source", ErrInvalidConfig)
	}
	if f.Limit < 0 {
		return since, until, fmt.Errorf("%w: Limit %d must not be negative (0: every one)", ErrInvalidConfig, f.Limit)
	}
	if !f.Since.IsZero() && !f.Until.IsZero() && !f.Until.After(f.Since) {
		return since, until, fmt.Errorf("%w: Until (%s) must be after Since (%s)", ErrInvalidConfig,
			f.Until.Format(time.RFC3339), f.Since.Format(time.RFC3339))
	}
	since = pgtype.Timestamptz{Time: time.Unix(0, 0), Valid: true}
	if !f.Since.IsZero() {
		since.Time = f.Since
	}
	until = pgtype.Timestamptz{InfinityModifier: pgtype.Infinity, Valid: true}
	if !f.Until.IsZero() {
		until = pgtype.Timestamptz{Time: f.Until, Valid: true}
	}
	return since, until, nil
}

// CountDeadLetters says how many dead letters f selects, whatever its
// Limit: what a Replay of f would go through (a dry run).
func (in *Inbox) CountDeadLetters(ctx context.Context, f Filter) (int64, error) {
	since, until, err := f.params()
	if err != nil {
		return 0, err
	}
	n, err := pgxdb.New(in.cfg.Pool).QueueDeadCount(ctx, pgxdb.QueueDeadCountParams{Source: f.Source, Key: f.Key,
		Since: since, Until: until, ErrorContains: f.ErrorContains})
	if err != nil {
		return 0, fmt.Errorf("inbox: count dead letters: %w", err)
	}
	return n, nil
}

// DeadLetter is an event whose job gave up on it: past its last attempt,
// at once for an error marked idem.Permanent, or because its key or its
// job was gone. idem keeps it (idem.holds) until it is replayed or the
// sender delivers it again; its payload is in its River job and, since
// migration 17, kept on its hold too.
type DeadLetter struct {
	JobID     int64  `json:"job_id"`
	Source    string `json:"source"`
	Key       string `json:"key"`
	EventType string `json:"event_type,omitempty"`
	Attempts  int    `json:"attempts"`
	// LastError is the reason it was dead-lettered: the handler's last
	// error, or what was gone.
	LastError  string    `json:"last_error"`
	AcceptedAt time.Time `json:"accepted_at"`
	FailedAt   time.Time `json:"failed_at"`
	// State is the River job's (discarded, cancelled, ...), "" when the
	// job is gone (River deletes discarded and cancelled jobs past its
	// retention): then replay uses the payload kept on the hold, and
	// where none was kept (dead-lettered before migration 17, or because
	// its job was gone) the payload is lost (PayloadLost) and only the
	// sender can deliver the event again.
	State       rivertype.JobState `json:"state"`
	PayloadLost bool               `json:"payload_lost"`
	token       int64
}

// deadJob is what a dead letter shows of its River job: never its args,
// which hold the payload (up to the body limit), except the event type and
// acceptance time of jobs enqueued before they were in its metadata.
type deadJob struct {
	attempt    int
	state      rivertype.JobState
	eventType  string
	acceptedAt time.Time
}

// deadJobs reads the River jobs ids, in one query.
func (in *Inbox) deadJobs(ctx context.Context, ids []int64) (map[int64]deadJob, error) {
	out := make(map[int64]deadJob, len(ids))
	if len(ids) == 0 {
		return out, nil
	}
	rows, err := in.cfg.Pool.Query(ctx, `SELECT id, attempt, state::text,
	       coalesce(metadata->>'idem_event_type', CASE WHEN NOT metadata ? 'idem_accepted_at' THEN args->>'event_type' END, ''),
	       coalesce(metadata->>'idem_accepted_at', args->>'accepted_at', '')
	  FROM `+riverTable(in.cfg.Schema, "river_job")+` WHERE id = ANY($1)`, ids)
	if err != nil {
		if sqlstate.Of(err) == sqlstate.UndefinedTable {
			return nil, errNotMigrated
		}
		return nil, fmt.Errorf("inbox: the dead letters' jobs: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id int64
		var j deadJob
		var state, at string
		if err := rows.Scan(&id, &j.attempt, &state, &j.eventType, &at); err != nil {
			return nil, fmt.Errorf("inbox: the dead letters' jobs: %w", err)
		}
		j.state = rivertype.JobState(state)
		j.acceptedAt, _ = time.Parse(time.RFC3339Nano, at)
		out[id] = j
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("inbox: the dead letters' jobs: %w", err)
	}
	return out, nil
}

// stillDead: (source, key) is still the dead letter of job with token.
func (in *Inbox) stillDead(ctx context.Context, source, key string, job, token int64) (bool, error) {
	since, until, _ := Filter{}.params()
	again, err := pgxdb.New(in.cfg.Pool).QueueDeadOldest(ctx, pgxdb.QueueDeadOldestParams{Source: source, Key: key,
		Since: since, Until: until, MaxRows: 1})
	if err != nil {
		return false, fmt.Errorf("inbox: list dead letters: %w", err)
	}
	return len(again) == 1 && again[0].JobID == job && again[0].Token == token, nil
}

// deadPage is how many dead letters each page of a listing or a replay
// reads: the pages follow one another by keyset (when they were
// dead-lettered, then source and key), never by offset.
const deadPage = 500

// deadPageAfter reads the page of holds after cursor (nil: the first).
func (in *Inbox) deadPageAfter(ctx context.Context, f Filter, cursor *pgxdb.QueueDeadOldestRow, n int) ([]pgxdb.QueueDeadOldestRow, error) {
	since, until, err := f.params()
	if err != nil {
		return nil, err
	}
	p := pgxdb.QueueDeadOldestParams{Source: f.Source, Key: f.Key, Since: since, Until: until,
		ErrorContains: f.ErrorContains, MaxRows: int32(n)}
	if cursor != nil {
		p.Paged, p.AfterAt, p.AfterSource, p.AfterKey = true, cursor.DeadAt, cursor.Source, cursor.Key
	}
	q := pgxdb.New(in.cfg.Pool)
	if !f.Newest {
		return q.QueueDeadOldest(ctx, p)
	}
	rows, err := q.QueueDeadNewest(ctx, pgxdb.QueueDeadNewestParams(p))
	out := make([]pgxdb.QueueDeadOldestRow, len(rows))
	for i, r := range rows {
		out[i] = pgxdb.QueueDeadOldestRow(r)
	}
	return out, err
}

// EachDeadLetter calls fn with every dead letter f selects (up to
// f.Limit when it is set), in f's order, reading them page by page: fn
// may replay or remove the ones it is given, and every one behind them is
// still reached. An error from fn stops it and is returned.
func (in *Inbox) EachDeadLetter(ctx context.Context, f Filter, fn func(DeadLetter) error) error {
	if _, _, err := f.params(); err != nil {
		return err
	}
	var cursor *pgxdb.QueueDeadOldestRow
	for seen := 0; ; {
		holds, err := in.deadPageAfter(ctx, f, cursor, deadPage)
		if err != nil {
			return fmt.Errorf("inbox: list dead letters: %w", err)
		}
		if len(holds) == 0 {
			return nil
		}
		cursor = &holds[len(holds)-1]
		ids := make([]int64, 0, len(holds))
		for _, h := range holds {
			if h.JobID != 0 {
				ids = append(ids, h.JobID)
			}
		}
		jobs, err := in.deadJobs(ctx, ids)
		if err != nil {
			return err
		}
		for _, h := range holds {
			d := DeadLetter{JobID: h.JobID, Source: h.Source, Key: h.Key, LastError: h.Error, AcceptedAt: h.HeldAt.Time, token: h.Token, PayloadLost: true}
			if h.DeadAt.Valid {
				d.FailedAt = h.DeadAt.Time
			}
			if j, ok := jobs[h.JobID]; ok {
				d.EventType, d.Attempts, d.State, d.PayloadLost = j.eventType, j.attempt, j.state, false
				if !j.acceptedAt.IsZero() {
					d.AcceptedAt = j.acceptedAt
				}
			} else if h.JobID != 0 {
				// The job is gone (River deleted it past its retention):
				// the payload is the one kept on the hold, if any. Unless
				// a replay (or a redelivery) took the event over meanwhile
				// and removed the dead job, when it is no longer a dead
				// letter.
				still, err := in.stillDead(ctx, h.Source, h.Key, h.JobID, h.Token)
				if err != nil {
					return err
				}
				if !still {
					continue
				}
				if err := in.keptShown(ctx, &d); err != nil {
					return err
				}
			}
			if err := fn(d); err != nil {
				return err
			}
			if seen++; f.Limit > 0 && seen >= f.Limit {
				return nil
			}
		}
	}
}

// DeadLetters lists the dead-lettered events f selects: every one, oldest
// first (f.Newest: newest first), or the first f.Limit.
func (in *Inbox) DeadLetters(ctx context.Context, f Filter) ([]DeadLetter, error) {
	var out []DeadLetter
	err := in.EachDeadLetter(ctx, f, func(d DeadLetter) error {
		out = append(out, d)
		return nil
	})
	if err != nil {
		return nil, err
	}
	if out == nil {
		out = []DeadLetter{}
	}
	return out, nil
}

// ReplayResult says what Replay did with one dead letter.
type ReplayResult struct {
	DeadLetter
	// Outcome: "replayed" (claimed again and a new job enqueued: NewJobID),
	// "already processed" (the event's key is completed: nothing runs, and
	// the dead letter is removed), "in progress" (a redelivery holds the
	// key; left as it is), "failed" (the key failed for good, e.g. past
	// its policy's max_attempts; left as it is, with Error), or "payload
	// lost" (its job is gone: only the sender can deliver it again).
	Outcome  string `json:"outcome"`
	NewJobID int64  `json:"new_job_id,omitempty"`
	Error    string `json:"error,omitempty"`
}

// Outcomes of a replay (ReplayResult.Outcome).
const (
	ReplayReplayed         = "replayed"
	ReplayAlreadyProcessed = "already processed"
	ReplayInProgress       = "in progress"
	ReplayFailed           = "failed"
	ReplayPayloadLost      = "payload lost"
)

// Left reports whether the replay left the dead letter as it is: its key
// failed for good ("failed") or its payload is gone ("payload lost"). An
// event "in progress" is another holder's (a redelivery, another
// replay's) to finish.
func (r ReplayResult) Left() bool {
	return r.Outcome == ReplayFailed || r.Outcome == ReplayPayloadLost
}

// Replay re-enqueues the dead letters f selects through the same claim as
// a delivery: each key is claimed again and, when acquired, a new job with
// the same payload replaces the dead one, in one transaction. An event
// whose key is already completed is not run again. It goes through every
// dead letter f selects (up to f.Limit when set), page by page: the ones
// it leaves as they are (Left) never hide the ones behind them. The
// results are every one's, in order; on an error, the ones before it.
func (in *Inbox) Replay(ctx context.Context, f Filter) ([]ReplayResult, error) {
	var out []ReplayResult
	err := in.ReplayEach(ctx, f, func(r ReplayResult) error {
		out = append(out, r)
		return nil
	})
	return out, err
}

// ReplayEach is Replay, handing each result to fn as it is done (an error
// from fn stops it), for a replay of more dead letters than one wants in
// memory at once.
func (in *Inbox) ReplayEach(ctx context.Context, f Filter, fn func(ReplayResult) error) error {
	if err := in.refuseCitus(ctx, in.cfg.Pool); err != nil {
		return err
	}
	if _, _, err := f.params(); err != nil {
		return err
	}
	// The dead letters there are when it starts: an event it replays that
	// fails for good again while it runs is a dead letter newer than all
	// of them, which this run must not reach (a handler that fails at once
	// would keep it going, oldest first, for ever).
	var newest pgtype.Timestamptz
	if err := in.cfg.Pool.QueryRow(ctx, `SELECT max(h.dead_at) FROM idem.holds h WHERE h.state = 'dead'`).Scan(&newest); err != nil {
		return fmt.Errorf("inbox: replay: %w", err)
	}
	if !newest.Valid {
		return nil // no dead letters
	}
	if bound := newest.Time.Add(time.Microsecond); f.Until.IsZero() || bound.Before(f.Until) {
		f.Until = bound
	}
	if !f.Since.IsZero() && !f.Until.After(f.Since) {
		return nil // none since
	}
	return in.EachDeadLetter(ctx, f, func(d DeadLetter) error {
		r, err := in.replayOne(ctx, d)
		if err != nil {
			return err
		}
		return fn(r)
	})
}

// replayOne replays one dead letter.
func (in *Inbox) replayOne(ctx context.Context, d DeadLetter) (ReplayResult, error) {
	r := ReplayResult{DeadLetter: d}
	if d.PayloadLost {
		r.Outcome, r.Error = ReplayPayloadLost, "the job and its payload are gone; have the sender deliver the event again"
		return r, nil
	}
	var j Job
	row, err := in.insert.JobGet(ctx, d.JobID)
	switch {
	case err == nil:
		if err := json.Unmarshal(row.EncodedArgs, &j); err != nil {
			return r, fmt.Errorf("inbox: job %d: %w", row.ID, err)
		}
		if j.MaxAttempts < 1 { // accepted by an earlier version: its job's
			j.MaxAttempts = row.MaxAttempts
		}
		j.Trace = jobTrace(row.Metadata) // the replay links to the request that accepted the event
	case errorsIsNotFound(err):
		// Gone: the payload kept on the hold, if it is still this
		// job's dead letter; else replayed meanwhile.
		kj, kept, err := in.keptPayload(ctx, d.Source, d.Key, d.token)
		if err != nil {
			return r, err
		}
		if !kept {
			still, err := in.stillDead(ctx, d.Source, d.Key, d.JobID, d.token)
			if err != nil {
				return r, err
			}
			r.Outcome = ReplayInProgress
			if still {
				r.Outcome, r.Error = ReplayPayloadLost, "the job and its payload are gone; have the sender deliver the event again"
			}
			return r, nil
		}
		j = kj
		if j.MaxAttempts < 1 {
			j.MaxAttempts = in.maxAttempts(d.Source)
		}
	default:
		return r, fmt.Errorf("inbox: job %d: %w", d.JobID, err)
	}
	err = pgx.BeginFunc(ctx, in.cfg.Pool, func(tx pgx.Tx) error {
		tx = pooled(tx)
		p := pgxdb.QueueReplayParams{Source: d.Source, Key: d.Key, JobToken: d.token}
		if ttl := j.TTLMillis; ttl > 0 {
			p.TtlMs = &ttl
		} else if in.cfg.TTL > 0 {
			ms := in.cfg.TTL.Milliseconds()
			p.TtlMs = &ms
		}
		cl, err := pgxdb.New(tx).QueueReplay(ctx, p)
		if err != nil {
			return err
		}
		switch idem.Outcome(cl.Outcome) {
		case idem.Acquired:
			j.replayOf = d.JobID
			r.NewJobID, err = in.enqueue(ctx, tx, &idem.Claim{Token: cl.Token, FirstSeen: cl.FirstSeen.Time, ExpiresAt: cl.ExpiresAt.Time}, j)
			r.Outcome = ReplayReplayed
			return err
		case idem.Completed:
			r.Outcome = ReplayAlreadyProcessed
			if _, err := pgxdb.New(tx).QueueForget(ctx, pgxdb.QueueForgetParams{Source: d.Source, Key: d.Key, JobToken: d.token}); err != nil {
				return err
			}
			if _, err := in.insert.JobDeleteTx(ctx, tx, d.JobID); err != nil && !errorsIsNotFound(err) {
				return err
			}
		case idem.InProgress:
			r.Outcome = ReplayInProgress
		case "not_dead":
			r.Outcome = ReplayInProgress // replayed or redelivered meanwhile
		default:
			r.Outcome, r.Error = ReplayFailed, cl.Error
		}
		return nil
	})
	if err != nil {
		return r, fmt.Errorf("inbox: replay %q/%q (job %d): %w", d.Source, d.Key, d.JobID, err)
	}
	return r, nil
}
