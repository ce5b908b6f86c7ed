package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/inbox"
)

func init() {
	register(command{name: "check", summary: "health check: premade partitions, default-partition rows, expired backlog, stuck leases (exit 5 when unhealthy)", run: runCheck})
}

type checkConfig struct {
	minPremade int
	maxExpired int64
	maxStuck   int64
	stuckGrace time.Duration
	// riverSchema: where River's tables are, for the inbox's reconciliation.
	riverSchema string
}

// health is what check measured and what it concluded.
type health struct {
	MonthsAhead int   `json:"months_ahead"`
	DefaultRows int64 `json:"default_partition_rows"`
	Expired     int64 `json:"expired_rows"`
	Stuck       int64 `json:"stuck_leases"`
	// Inbox: the inbox's reconciliation per source (when it is used).
	Inbox    []inbox.SourceStats `json:"inbox,omitempty"`
	Problems []string            `json:"problems"`
}

func runCheck(ctx context.Context, io IO, g *globals, args []string) error {
	fs := newFlagSet("check", io, g)
	var c checkConfig
	fs.IntVar(&c.minPremade, "min-premade", 2, "unhealthy when fewer months after the current one have a partition")
	fs.Int64Var(&c.maxExpired, "max-expired", 1_000_000, "unhealthy when more expired rows wait for prune")
	fs.Int64Var(&c.maxStuck, "max-stuck", 0, "unhealthy when more keys are stuck in processing")
	fs.DurationVar(&c.stuckGrace, "stuck-grace", 10*time.Minute, "a key is stuck when its lease ended this long ago and nobody re-acquired it")
	fs.StringVar(&c.riverSchema, "river-schema", "", "the schema of River's tables, for the inbox's reconciliation (default: the search_path)")
	asJSON := fs.Bool("json", false, "print JSON")
	if err := fs.parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usageErr("check takes no arguments, got %q", fs.Args())
	}
	if c.minPremade < 0 || c.maxExpired < 0 || c.maxStuck < 0 || c.stuckGrace < 0 {
		return usageErr("check thresholds must not be negative")
	}
	if _, err := g.logger(io.Err); err != nil {
		return err
	}
	pool, err := g.connectMigrated(ctx, io.Env, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	h, err := measure(ctx, pool, c)
	if err != nil {
		return err
	}
	if *asJSON {
		enc := json.NewEncoder(io.Out)
		enc.SetIndent("", "  ")
		if err := enc.Encode(h); err != nil {
			return err
		}
	} else if len(h.Problems) == 0 {
		fmt.Fprintf(io.Out, "healthy: %d months premade, %d rows in the default partition, %d expired rows waiting, %d stuck leases\n",
			h.MonthsAhead, h.DefaultRows, h.Expired, h.Stuck)
	}
	if len(h.Problems) > 0 {
		return withCode(ExitUnhealthy, errors.New("unhealthy: "+strings.Join(h.Problems, "; ")))
	}
	return nil
}

func measure(ctx context.Context, pool *pgxpool.Pool, c checkConfig) (*health, error) {
	q := pgxdb.New(pool)
	h := &health{Problems: []string{}}
	hasCurrent, ahead, err := monthsAhead(ctx, q)
	if err != nil {
		return nil, err
	}
	h.MonthsAhead = ahead
	if h.DefaultRows, err = q.DefaultPartitionRows(ctx); err != nil {
		return nil, err
	}
	// Rows in the default partition stay there until prune deletes them
	// (claims find them there); a month with rows there gets no partition
	// meanwhile, so only a month rotation can make is a problem.
	if !hasCurrent {
		current, err := q.CurrentMonth(ctx)
		if err != nil {
			return nil, err
		}
		inDefault, err := q.MonthInDefault(ctx, current)
		if err != nil {
			return nil, err
		}
		if !inDefault {
			h.Problems = append(h.Problems, "the current month has no partition (claims go to the default partition): run `idemctl partitions rotate`")
		}
	}
	if h.MonthsAhead < c.minPremade {
		h.Problems = append(h.Problems, fmt.Sprintf("only %d months after this one have a partition, want %d: run `idemctl partitions rotate`", h.MonthsAhead, c.minPremade))
	}
	if h.Expired, err = q.PrunableRows(ctx); err != nil {
		return nil, err
	}
	if h.Expired > c.maxExpired {
		h.Problems = append(h.Problems, fmt.Sprintf("%d expired rows wait for prune (threshold %d): is `idemctl prune` scheduled?", h.Expired, c.maxExpired))
	}
	if h.Stuck, err = q.StuckLeases(ctx, c.stuckGrace.Milliseconds()); err != nil {
		return nil, err
	}
	if h.Stuck > c.maxStuck {
		h.Problems = append(h.Problems, fmt.Sprintf("%d keys stuck in processing more than %s past their lease (threshold %d): workers died and no redelivery came", h.Stuck, c.stuckGrace, c.maxStuck))
	}
	// Every event the inbox accepted is processed, dead-lettered, or
	// queued with a job that will run it.
	ib, err := inbox.Reconcile(ctx, pool, c.riverSchema)
	h.Inbox = ib
	if err != nil && len(ib) > 0 {
		h.Problems = append(h.Problems, fmt.Sprintf("the inbox's jobs cannot be read: %v", err))
	}
	for _, s := range ib {
		switch {
		case !s.Balanced():
			h.Problems = append(h.Problems, fmt.Sprintf("inbox %s: %d accepted events are unaccounted for (%s)", s.Source, s.Accepted-s.Processed-s.Dead-s.Queued, s))
		case s.Unaccounted > 0:
			h.Problems = append(h.Problems, fmt.Sprintf("inbox %s: %d accepted events have no job that will run them: a worker client repairs them (inbox.Repair), or replay after it dead-letters them", s.Source, s.Unaccounted))
		}
	}
	// Who may do what: a role that is both, CREATE on schema idem for
	// others, a table posing as a month, a half-made month.
	audit, err := q.Audit(ctx)
	if err != nil {
		return nil, err
	}
	for _, a := range audit {
		h.Problems = append(h.Problems, a.Problem+": "+a.Fix)
	}
	public, err := q.PublicRoutines(ctx)
	if err != nil {
		return nil, err
	}
	if len(public) > 0 {
		h.Problems = append(h.Problems, fmt.Sprintf("PUBLIC may execute %d routines of schema idem (%s): run `idemctl migrate up`, or REVOKE ALL ON ALL ROUTINES IN SCHEMA idem FROM PUBLIC",
			len(public), strings.Join(public, ", ")))
	}
	return h, nil
}

// monthsAhead reports whether the current month (by the database's clock)
// has a partition, and how many consecutive months after it have one.
func monthsAhead(ctx context.Context, q *pgxdb.Queries) (hasCurrent bool, ahead int, err error) {
	parts, err := q.PartitionMonths(ctx) // every scrape of /metrics: no row counts
	if err != nil {
		return false, 0, err
	}
	now, err := q.CurrentMonth(ctx)
	if err != nil {
		return false, 0, err
	}
	have := map[string]bool{}
	for _, p := range parts {
		if p.MonthFrom.Valid {
			have[p.MonthFrom.Time.Format("2006-01")] = true
		}
	}
	for m := now.Time.AddDate(0, 1, 0); have[m.Format("2006-01")]; m = m.AddDate(0, 1, 0) {
		ahead++
	}
	return have[now.Time.Format("2006-01")], ahead, nil
}
