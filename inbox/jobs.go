package inbox

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/riverqueue/river/rivertype"

	"github.com/idemkit/idem/internal/sqlstate"
)

// JobInfo is what the operator sees of one of the inbox's River jobs:
// never its args, which hold the payload.
type JobInfo struct {
	ID          int64              `json:"id"`
	Source      string             `json:"source"`
	Key         string             `json:"key"`
	EventType   string             `json:"event_type,omitempty"`
	State       rivertype.JobState `json:"state"`
	Attempt     int                `json:"attempt"`
	MaxAttempts int                `json:"max_attempts"`
	CreatedAt   time.Time          `json:"created_at"`
	// ScheduledAt is when it runs next (a retryable job's next attempt).
	ScheduledAt time.Time `json:"scheduled_at"`
	// AttemptedAt is when its last attempt started (zero: never).
	AttemptedAt time.Time `json:"attempted_at,omitzero"`
	// FinalizedAt is when it completed, was discarded or cancelled.
	FinalizedAt time.Time `json:"finalized_at,omitzero"`
	// Errors are its failed attempts, oldest first (River's record).
	Errors []JobError `json:"errors,omitempty"`
	// Replay: enqueued by a replay (Inbox.Replay: the dead letters page,
	// idemctl inbox replay), which replaces the dead letter's job.
	Replay bool `json:"replay"`
	// ReplayOf is the job a replay's job replaced (0: not a replay, or
	// replayed by an earlier version).
	ReplayOf int64 `json:"replay_of,omitempty"`
}

// JobError is one failed attempt of a job.
type JobError struct {
	At      time.Time `json:"at"`
	Attempt int       `json:"attempt"`
	Error   string    `json:"error"`
}

// LastError is the job's last failed attempt (zero: none).
func (j JobInfo) LastError() JobError {
	if len(j.Errors) == 0 {
		return JobError{}
	}
	return j.Errors[len(j.Errors)-1]
}

// JobStates are the states Jobs lists, in the order a job goes through.
var JobStates = []rivertype.JobState{rivertype.JobStateAvailable, rivertype.JobStateScheduled, rivertype.JobStateRunning,
	rivertype.JobStateRetryable, rivertype.JobStateCompleted, rivertype.JobStateDiscarded, rivertype.JobStateCancelled}

// jobColumns are read for every JobInfo (metadata, never args).
const jobColumns = `j.id, coalesce(j.metadata->>'idem_source', ''), coalesce(j.metadata->>'idem_key', ''),
       coalesce(j.metadata->>'idem_event_type', ''), j.state::text, j.attempt, j.max_attempts,
       j.created_at, j.scheduled_at, j.attempted_at, j.finalized_at, pg_catalog.to_jsonb(coalesce(j.errors, '{}')),
       coalesce(j.metadata->>'idem_replay_of', '')`

// Jobs lists up to limit (1 to 1000) of the inbox queue's jobs in state:
// waiting and running jobs in the order River runs them, finished ones
// newest first; each read in the order of one of River's indexes.
func (in *Inbox) Jobs(ctx context.Context, state rivertype.JobState, limit int) ([]JobInfo, error) {
	if limit < 1 || limit > 1000 {
		return nil, fmt.Errorf("inbox: jobs: limit %d is not in [1, 1000]", limit)
	}
	order := "j.priority, j.scheduled_at, j.id"
	where := "j.state = $1::text::" + riverTable(in.cfg.Schema, "river_job_state") + " AND j.queue = $2"
	switch state {
	case rivertype.JobStateAvailable, rivertype.JobStateScheduled, rivertype.JobStateRunning, rivertype.JobStateRetryable, rivertype.JobStatePending:
	case rivertype.JobStateCompleted, rivertype.JobStateDiscarded, rivertype.JobStateCancelled:
		order = "j.finalized_at DESC"
		where += " AND j.finalized_at IS NOT NULL"
	default:
		return nil, fmt.Errorf("inbox: jobs: %q is not a job state", state)
	}
	table := riverTable(in.cfg.Schema, "river_job")
	return in.queryJobs(ctx, `SELECT `+jobColumns+`
	  FROM `+table+` j WHERE `+where+` ORDER BY `+order+` LIMIT $3`, string(state), in.cfg.Queue, limit)
}

// KeyJobs lists every job River still has of one event (source, key),
// oldest first (found by the jobs' metadata, on River's index of it): a
// replay replaces the dead letter's job, so a replayed event has the
// replay's job. There is no limit: an event has a job per acceptance,
// repair and replay that River still keeps.
func (in *Inbox) KeyJobs(ctx context.Context, source, key string) ([]JobInfo, error) {
	table := riverTable(in.cfg.Schema, "river_job")
	return in.queryJobs(ctx, `SELECT `+jobColumns+`
	  FROM `+table+` j WHERE j.metadata @> pg_catalog.jsonb_build_object('idem_source', $1::text, 'idem_key', $2::text)
	 ORDER BY j.id`, source, key)
}

// JobCounts counts the inbox queue's jobs in each of JobStates, each up to
// limit (then limit+1 says "more").
func (in *Inbox) JobCounts(ctx context.Context, limit int) (map[rivertype.JobState]int64, error) {
	states := make([]string, len(JobStates))
	for i, s := range JobStates {
		states[i] = string(s)
	}
	rows, err := in.cfg.Pool.Query(ctx, `SELECT s, (SELECT count(*) FROM (SELECT 1 FROM `+riverTable(in.cfg.Schema, "river_job")+` j
	     WHERE j.state = s::`+riverTable(in.cfg.Schema, "river_job_state")+` AND j.queue = $2 LIMIT $3) x)
	  FROM pg_catalog.unnest($1::text[]) s`, states, in.cfg.Queue, limit+1)
	if err != nil {
		return nil, jobsErr(err)
	}
	out := map[rivertype.JobState]int64{}
	for rows.Next() {
		var s string
		var n int64
		if err := rows.Scan(&s, &n); err != nil {
			return nil, jobsErr(err)
		}
		out[rivertype.JobState(s)] = n
	}
	return out, jobsErr(rows.Err())
}

func (in *Inbox) queryJobs(ctx context.Context, sql string, args ...any) ([]JobInfo, error) {
	rows, err := in.cfg.Pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, jobsErr(err)
	}
	defer rows.Close()
	var out []JobInfo
	for rows.Next() {
		var j JobInfo
		var state string
		var attempted, finalized *time.Time
		var errs []byte
		var replayOf string
		if err := rows.Scan(&j.ID, &j.Source, &j.Key, &j.EventType, &state, &j.Attempt, &j.MaxAttempts,
			&j.CreatedAt, &j.ScheduledAt, &attempted, &finalized, &errs, &replayOf); err != nil {
			return nil, jobsErr(err)
		}
		if replayOf != "" {
			j.Replay = true
			j.ReplayOf, _ = strconv.ParseInt(replayOf, 10, 64)
		}
		j.State = rivertype.JobState(state)
		if attempted != nil {
			j.AttemptedAt = *attempted
		}
		if finalized != nil {
			j.FinalizedAt = *finalized
		}
		var raw []struct {
			At      time.Time `json:"at"`
			Attempt int       `json:"attempt"`
			Error   string    `json:"error"`
		}
		if err := json.Unmarshal(errs, &raw); err == nil {
			for _, e := range raw {
				j.Errors = append(j.Errors, JobError(e))
			}
		}
		out = append(out, j)
	}
	return out, jobsErr(rows.Err())
}

func jobsErr(err error) error {
	switch {
	case err == nil:
		return nil
	case sqlstate.Of(err) == sqlstate.UndefinedTable:
		return errNotMigrated
	}
	return fmt.Errorf("inbox: jobs: %w", err)
}
