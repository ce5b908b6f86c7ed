package main

import (
	"context"
	"fmt"
	"time"
)

// benchAdopt: idemctl adopt's batches (idem.adopt_batch, 10000 rows each)
// copying a legacy table of n processed events into idem, against one
// INSERT .. SELECT of the same rows into a plain copy of idem's table.
func benchAdopt(ctx context.Context, e *env, o options, t *table) error {
	n := 200_000
	if o.full {
		n = 1_000_000
	}
	if _, err := e.pool.Exec(ctx, fmt.Sprintf(`
		DROP TABLE IF EXISTS bench_legacy, bench_adopt_raw;
		CREATE TABLE bench_legacy (event_id text PRIMARY KEY, processed_at timestamptz NOT NULL, result jsonb);
		INSERT INTO bench_legacy SELECT 'evt_' || lpad(g::text, 8, '0'), now() - (g %% 20) * interval '1 day', jsonb_build_object('n', g)
		  FROM generate_series(1, %d) g;
		ANALYZE bench_legacy;
		CREATE TABLE bench_adopt_raw (LIKE idem.processed_events INCLUDING DEFAULTS, PRIMARY KEY (source, key, first_seen_month))`, n)); err != nil {
		return err
	}
	var rates, raws, ratios []float64
	for round := range o.rounds {
		source := fmt.Sprintf("bench-adopt-%d", round)
		var id int64
		start := time.Now()
		if err := e.pool.QueryRow(ctx, `SELECT idem.adopt_start($1, 'bench_legacy', 'event_id', 'processed_at', 'result', '30 days')`, source).Scan(&id); err != nil {
			return err
		}
		for done := false; !done; {
			if err := e.pool.QueryRow(ctx, `SELECT done FROM idem.adopt_batch($1, 10000)`, id).Scan(&done); err != nil {
				return err
			}
		}
		rate := float64(n) / time.Since(start).Seconds()
		start = time.Now()
		if _, err := e.pool.Exec(ctx, `
			INSERT INTO bench_adopt_raw (source, key, first_seen_month, status, attempts, token, result, first_seen, updated_at, completed_at, expires_at)
			SELECT $1, l.event_id, date_trunc('month', l.processed_at AT TIME ZONE 'UTC')::date, 'completed', 1, 1, l.result, l.processed_at, now(), l.processed_at, l.processed_at + interval '30 days'
			  FROM bench_legacy l`, source); err != nil {
			return err
		}
		raw := float64(n) / time.Since(start).Seconds()
		rates, raws, ratios = append(rates, rate), append(raws, raw), append(ratios, rate/raw)
	}
	t.add(row{section: "adopt", metric: fmt.Sprintf("adopt %d legacy rows in batches of 10000 (resumable, online) vs one INSERT .. SELECT into a plain table", n),
		idem: fmt.Sprintf("%.0f rows/s", median(rates)), baseline: fmt.Sprintf("%.0f rows/s", median(raws)),
		ratio: median(ratios), spread: spread(ratios), target: "information"})
	_, err := e.pool.Exec(ctx, `DROP TABLE IF EXISTS bench_legacy, bench_adopt_raw`)
	return err
}
