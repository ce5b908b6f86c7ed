package inbox

import (
	"context"
	"fmt"

	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/internal/sqlstate"
)

// SourceStats is one source's reconciliation: every event the inbox
// accepted is processed, dead-lettered, or still queued, so
// Accepted = Processed + Dead + Queued (Balanced). Accepted and Processed
// are running totals (an event accepted again after its key expired counts
// again); Dead and Queued are now.
type SourceStats struct {
	Source    string `json:"source"`
	Accepted  int64  `json:"accepted"`
	Processed int64  `json:"processed"`
	// Dead: dead letters, waiting for a replay or the sender's redelivery.
	Dead int64 `json:"dead_lettered"`
	// Queued: accepted and not processed yet, whatever their job's state;
	// Running and Retrying say how many of them have a job running, or
	// waiting for a retry (River's side; -1 when River's tables cannot be
	// read).
	Queued   int64 `json:"queued"`
	Running  int64 `json:"running"`
	Retrying int64 `json:"retrying"`
	// Unaccounted: queued events no job will run (the job is gone, or
	// finished without processing the event). Repair enqueues them again
	// or dead-letters them; idemctl check fails while there are any.
	Unaccounted int64 `json:"unaccounted"`
	// Crashing: queued events whose job River's rescuer has rescued (its
	// worker crashed or hung mid-attempt: killed, out of memory, a crash
	// in cgo) and that are not finished: each takes a worker down once
	// per rescue until its attempts run out and it is dead-lettered.
	// CrashingKeys names the first three, oldest first. -1 when River's
	// tables cannot be read.
	Crashing     int64    `json:"crashing"`
	CrashingKeys []string `json:"crashing_keys,omitempty"`
}

// Balanced reports whether the source's events add up.
func (s SourceStats) Balanced() bool { return s.Accepted == s.Processed+s.Dead+s.Queued }

// String is the reconciliation line idemctl stats and the demo print.
func (s SourceStats) String() string {
	sign := "="
	if !s.Balanced() {
		sign = "≠"
	}
	return fmt.Sprintf("%s: accepted %d %s processed %d + dead-lettered %d + queued %d (running %d, retrying %d); unaccounted %d",
		s.Source, s.Accepted, sign, s.Processed, s.Dead, s.Queued, s.Running, s.Retrying, s.Unaccounted)
}

// Reconcile returns the inbox's reconciliation per source.
func (in *Inbox) Reconcile(ctx context.Context) ([]SourceStats, error) {
	return Reconcile(ctx, in.cfg.Pool, in.cfg.Schema)
}

// Stats is Reconcile.
func (in *Inbox) Stats(ctx context.Context) ([]SourceStats, error) { return in.Reconcile(ctx) }

// Reconcile returns the reconciliation per source of the inbox whose
// River tables are in schema ("" for the search_path), read from idem's
// tables (the counts and the holds) and River's (the jobs' states). It is
// empty when the inbox was never used. Without River's tables (or the
// right to read them), Running, Retrying and Unaccounted are -1 and the
// error says why; the counts from idem's own tables are still returned.
func Reconcile(ctx context.Context, db pgxdb.DBTX, schema string) ([]SourceStats, error) {
	rows, err := pgxdb.New(db).QueueCounts(ctx)
	if err != nil {
		if sqlstate.Of(err) == sqlstate.UndefinedTable {
			return nil, nil // idem older than version 7
		}
		return nil, fmt.Errorf("inbox: reconcile: %w", err)
	}
	out := make([]SourceStats, 0, len(rows))
	idx := map[string]int{}
	for _, r := range rows {
		idx[r.Source] = len(out)
		out = append(out, SourceStats{Source: r.Source, Accepted: r.Accepted, Processed: r.Processed, Dead: r.Dead, Queued: r.Queued,
			Running: -1, Retrying: -1, Unaccounted: -1, Crashing: -1})
	}
	if len(out) == 0 {
		return out, nil
	}
	q := `SELECT h.source,
	             count(*) FILTER (WHERE j.state = 'running'),
	             count(*) FILTER (WHERE j.state = 'retryable'),
	             count(*) FILTER (WHERE j.id IS NULL OR j.state IN ('completed', 'discarded', 'cancelled')),
	             count(*) FILTER (WHERE r.rescued),
	             coalesce((pg_catalog.array_agg(h.key ORDER BY h.held_at, h.key) FILTER (WHERE r.rescued))[1:3], '{}')
	        FROM idem.holds h
	        LEFT JOIN ` + riverTable(schema, "river_job") + ` j ON j.id = h.job_id
	        LEFT JOIN LATERAL (SELECT j.state NOT IN ('completed', 'discarded', 'cancelled')
	                                  AND EXISTS (SELECT 1 FROM pg_catalog.unnest(j.errors) e WHERE e->>'error' = '` + rescuedError + `') AS rescued) r ON true
	       WHERE h.state = 'queued'
	       GROUP BY h.source`
	jr, err := db.Query(ctx, q)
	if err != nil {
		return out, fmt.Errorf("inbox: reconcile with River's jobs: %w", err)
	}
	defer jr.Close()
	for i := range out {
		out[i].Running, out[i].Retrying, out[i].Unaccounted, out[i].Crashing = 0, 0, 0, 0
	}
	for jr.Next() {
		var src string
		var run, retry, lost, crashing int64
		var crashingKeys []string
		if err := jr.Scan(&src, &run, &retry, &lost, &crashing, &crashingKeys); err != nil {
			return out, fmt.Errorf("inbox: reconcile: %w", err)
		}
		if i, ok := idx[src]; ok {
			out[i].Running, out[i].Retrying, out[i].Unaccounted = run, retry, lost
			out[i].Crashing, out[i].CrashingKeys = crashing, crashingKeys
		}
	}
	if err := jr.Err(); err != nil {
		return out, fmt.Errorf("inbox: reconcile with River's jobs: %w", err)
	}
	return out, nil
}
