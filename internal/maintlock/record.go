package maintlock

import (
	"context"
	"encoding/json"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/idem/db/pgxdb"
)

// Run is one maintenance run to record in idem.runs (migration 10), where
// the dashboard shows the last runs of each job.
type Run struct {
	Job     string // "prune", "rotate" or "snapshot"
	Started time.Time
	// Outcome: "ok", "skipped", "interrupted", "incomplete" or "error"
	// (Err's text is recorded with it).
	Outcome string
	Figures map[string]any
	Err     error
	Holder  string
}

// Record writes r into idem.runs: best effort, on a context of its own (a
// run cancelled by SIGTERM is recorded as interrupted), a failure logged
// and never returned: recording must not turn a done run into a failed one.
func Record(ctx context.Context, q *pgxdb.Queries, log *slog.Logger, r Run) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	figures, err := json.Marshal(r.Figures)
	if err != nil || r.Figures == nil {
		figures = []byte("{}")
	}
	p := pgxdb.RecordRunParams{Job: r.Job, StartedAt: pgtype.Timestamptz{Time: r.Started, Valid: true}, Outcome: r.Outcome, Figures: string(figures), RunBy: r.Holder}
	if r.Err != nil {
		p.Error = new(r.Err.Error())
	}
	if _, err := q.RecordRun(ctx, p); err != nil {
		log.LogAttrs(ctx, slog.LevelWarn, "could not record the "+r.Job+" run in idem.runs", slog.Any("error", err))
	}
}
