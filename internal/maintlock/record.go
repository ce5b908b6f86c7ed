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
	// (SafeError(Err) is recorded with it; Err's text is logged).
	Outcome string
	Figures map[string]any
	Err     error
	Holder  string
}

// Record writes r into idem.runs (its error as SafeError has it, the
// error itself to log): best effort, on a context of its own (a
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
		// idem.runs is shown on the dashboard: what the operator can act
		// on, no part of the connection; the driver's text to the log.
		p.Error = new(SafeError(r.Err))
		log.LogAttrs(ctx, slog.LevelWarn, "the "+r.Job+" run failed", slog.String("outcome", r.Outcome), slog.Any("error", r.Err))
	}
	if _, err := q.RecordRun(ctx, p); err != nil {
		log.LogAttrs(ctx, slog.LevelWarn, "could not record the "+r.Job+" run in idem.runs", slog.Any("error", err))
	}
}
