package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/prune"
)

var keySeq atomic.Int64

// newKey returns a key no other call of this process returns: its sequence
// number and a random suffix, separated (without the "-", sequence 1 with
// suffix "ab" and sequence 46 ("1a") with suffix "b" would be one key).
func newKey() string {
	return "k" + strconv.FormatInt(keySeq.Add(1), 36) + "-" + strconv.FormatUint(rand.Uint64()%1e6, 36)
}

const rawInsert = `INSERT INTO bench_raw (source, key, first_seen_month, status, token, lease_expires_at, first_seen, updated_at, expires_at)
VALUES ($1, $2, date_trunc('month', now())::date, 'processing', 1, now() + interval '2 minutes', now(), now(), now() + interval '30 days')
ON CONFLICT DO NOTHING RETURNING token`

const rawComplete = `UPDATE bench_raw SET status = 'completed', result = $3, completed_at = now(), updated_at = now(), lease_expires_at = NULL
WHERE source = $1 AND key = $2`

func claimSQL(pool *pgxpool.Pool, source string) op {
	return func(ctx context.Context, _ int, _ int64) error {
		var outcome string
		var token int64
		return pool.QueryRow(ctx, `SELECT outcome, token FROM idem.claim($1, $2)`, source, newKey()).Scan(&outcome, &token)
	}
}

// benchComplete: a whole unit of work (claim + complete) against INSERT +
// UPDATE, through pgx from Go (the claim alone is in the claim section).
func benchComplete(ctx context.Context, e *env, o options, t *table) error {
	result := []byte(`{"ok": true}`)
	for _, clients := range o.clients {
		both := func(ctx context.Context, _ int, _ int64) error {
			k := newKey()
			var token int64
			var outcome, done string
			if err := e.pool.QueryRow(ctx, `SELECT outcome, token FROM idem.claim('bench', $1)`, k).Scan(&outcome, &token); err != nil {
				return err
			}
			return e.pool.QueryRow(ctx, `SELECT idem.complete('bench', $1, $2, $3)`, k, token, result).Scan(&done)
		}
		rawBoth := func(ctx context.Context, _ int, _ int64) error {
			k := newKey()
			var token int64
			if err := e.pool.QueryRow(ctx, rawInsert, "bench", k).Scan(&token); err != nil {
				return err
			}
			_, err := e.pool.Exec(ctx, rawComplete, "bench", k, result)
			return err
		}
		c, err := interleave(ctx, o.rounds, clients, o.duration, both, rawBoth)
		if err != nil {
			return err
		}
		t.throughputRow("claim + complete", fmt.Sprintf("claim + complete vs INSERT + UPDATE, %d clients", clients), c, "information")
	}
	return nil
}

// benchDuplicates: claims of completed keys against the conflict path.
func benchDuplicates(ctx context.Context, e *env, o options, t *table) error {
	dup := func(ctx context.Context, _ int, _ int64) error {
		var outcome string
		var result []byte
		return e.pool.QueryRow(ctx, `SELECT outcome, result FROM idem.claim('pgbench-dup', $1)`, "dup-"+strconv.Itoa(1+rand.IntN(10000))).Scan(&outcome, &result)
	}
	rawDup := func(ctx context.Context, _ int, _ int64) error {
		_, err := e.pool.Exec(ctx, rawInsert, "pgbench-dup", "dup-"+strconv.Itoa(1+rand.IntN(10000)))
		return err
	}
	for _, sampling := range []int{8, 0, 1} {
		if _, err := e.pool.Exec(ctx, `UPDATE idem.policies SET duplicate_sampling = $1 WHERE source = '*'`, sampling); err != nil {
			return err
		}
		name := map[int]string{8: "duplicates, 1 in 8 counted (default)", 0: "duplicates, none counted (duplicate_sampling 0)",
			1: "duplicates, all counted (duplicate_sampling 1)"}[sampling]
		for _, clients := range o.clients {
			c, err := interleave(ctx, o.rounds, clients, o.duration, dup, rawDup)
			if err != nil {
				return err
			}
			t.throughputRow("duplicates", fmt.Sprintf("%s, %d clients", name, clients), c, "information: the cost of sampling")
		}
	}
	_, err := e.pool.Exec(ctx, `UPDATE idem.policies SET duplicate_sampling = 8 WHERE source = '*'`)
	return err
}

// benchLibrary: the public Go API against the same statement in raw pgx.
func benchLibrary(ctx context.Context, e *env, o options, t *table) error {
	c, err := idem.New(e.pool, nil)
	if err != nil {
		return err
	}
	lib := func(ctx context.Context, _ int, _ int64) error {
		_, err := c.Claim(ctx, "bench-lib", newKey())
		return err
	}
	raw := func(ctx context.Context, _ int, _ int64) error {
		var (
			outcome, errText      string
			token                 int64
			attempt               int32
			lease, first, expires *time.Time
			result                []byte
		)
		return e.pool.QueryRow(ctx, `SELECT outcome, coalesce(token, 0), attempt, lease_expires_at, result, coalesce(error, ''), first_seen, expires_at
			FROM idem.claim($1, $2)`, "bench-lib", newKey()).Scan(&outcome, &token, &attempt, &lease, &result, &errText, &first, &expires)
	}
	cmp, err := interleave(ctx, o.rounds, 8, o.duration, lib, raw)
	if err != nil {
		return err
	}
	t.throughputRow("Go library", "Client.Claim vs raw pgx QueryRow of idem.claim, 8 clients", cmp, "~1.00x")
	return nil
}

// seedExpired writes n expired completed rows for month straight into the table.
func seedExpired(ctx context.Context, pool *pgxpool.Pool, source string, month time.Time, n int) error {
	const chunk = 200_000
	for done := 0; done < n; done += chunk {
		m := min(chunk, n-done)
		if _, err := pool.Exec(ctx, `
			INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, first_seen, updated_at, expires_at, result)
			SELECT $1, $2 || g, $3::date, 'completed', g, $3::date + interval '1 day', now(), now() - interval '1 minute', '{"ok": true}'
			  FROM generate_series($4::int, $5::int) g`, source, source+"-", month, done+1, done+m); err != nil {
			return err
		}
	}
	return nil
}

func monthStart(add int) time.Time {
	n := time.Now().UTC()
	return time.Date(n.Year(), n.Month()+time.Month(add), 1, 0, 0, 0, 0, time.UTC)
}

// benchMaintenance: claim p99 while prune works through a backlog, against
// the idle p99 measured right before (rotation: the claim section).
func benchMaintenance(ctx context.Context, e *env, o options, t *table) error {
	claims := claimSQL(e.pool, "bench-maint")
	var idle, duringPrune []sample
	var pruneRates []float64
	for r := 0; r < o.rounds; r++ {
		if err := seedExpired(ctx, e.pool, fmt.Sprintf("backlog%d", r), monthStart(0), o.backlog); err != nil {
			return err
		}
		if _, err := e.pool.Exec(ctx, `ANALYZE idem.processed_events`); err != nil {
			return err
		}
		s, err := measure(ctx, 8, o.duration, claims)
		if err != nil {
			return err
		}
		idle = append(idle, s)

		var pr *prune.Result
		s, err = during(ctx, o.duration, claims, func() (err error) {
			pr, err = prune.Run(ctx, e.pool, prune.Config{BatchSize: new(5000), Sleep: new(10 * time.Millisecond)})
			return err
		})
		if err != nil {
			return err
		}
		duringPrune = append(duringPrune, s)
		pruneRates = append(pruneRates, pr.Rate())

	}
	t.latencyRow("under maintenance", "claim during prune of the backlog vs idle, 8 clients", comparison{a: duringPrune, b: idle}, "p99 <= 2x idle")
	t.add(row{section: "under maintenance", metric: "prune rate while claims run", idem: fmt.Sprintf("%.0f rows/s", median(pruneRates)),
		baseline: "-", ratio: 0, spread: spread(pruneRates), note: "information"})
	return nil
}

// seedRetirable creates the four monthly partitions from first months ago
// to first+3 and fills each with rows expired rows, for rotation to retire.
func seedRetirable(ctx context.Context, pool *pgxpool.Pool, prefix string, first, rows int) error {
	for m := first; m <= first+3; m++ {
		if _, err := pool.Exec(ctx, `SELECT idem.create_partition($1)`, monthStart(m)); err != nil {
			return err
		}
		if err := seedExpired(ctx, pool, fmt.Sprintf("%s-%d", prefix, m), monthStart(m), rows); err != nil {
			return err
		}
	}
	return nil
}

// during runs fn from 8 clients while job runs (started a quarter of d in,
// followed by a quarter of d) and returns the calls that overlapped job.
func during(ctx context.Context, d time.Duration, fn op, job func() error) (sample, error) {
	var from, to time.Time
	var jerr error
	done := make(chan struct{})
	go func() {
		defer close(done)
		time.Sleep(d / 4)
		from = time.Now()
		jerr = job()
		to = time.Now()
		time.Sleep(d / 4)
	}()
	s, err := measureUntil(ctx, 8, done, fn)
	if err == nil {
		err = jerr
	}
	return s.within(from, to), err
}

// measureUntil runs fn until done is closed.
func measureUntil(ctx context.Context, clients int, done <-chan struct{}, fn op) (sample, error) {
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		select {
		case <-done:
		case <-ctx.Done():
		}
		cancel()
	}()
	return measure(ctx, clients, time.Hour, fn)
}

// benchRetention: retiring a month by rotation against DELETE + VACUUM,
// and batched prune against one naive DELETE.
func benchRetention(ctx context.Context, e *env, o options, t *table) error {
	var dropT, deleteT, pruneR, naiveR []float64
	for r := 0; r < max(1, o.rounds/2); r++ {
		a, b := monthStart(-20-2*r), monthStart(-21-2*r)
		for _, m := range []time.Time{a, b} {
			if _, err := e.pool.Exec(ctx, `SELECT idem.create_partition($1)`, m); err != nil {
				return err
			}
			if err := seedExpired(ctx, e.pool, "ret"+m.Format("200601"), m, o.retireRows); err != nil {
				return err
			}
		}
		_, _ = e.pool.Exec(ctx, `VACUUM ANALYZE idem.processed_events`)
		start := time.Now()
		var res string
		if err := e.pool.QueryRow(ctx, `SELECT idem.retire_partition(('idem.' || idem.partition_name($1))::regclass)`, a).Scan(&res); err != nil || res != "dropped" {
			return fmt.Errorf("retire: %q %v", res, err)
		}
		dropT = append(dropT, time.Since(start).Seconds())
		part := pgx.Identifier{"idem", "processed_events_p" + b.Format("2006_01")}.Sanitize()
		start = time.Now()
		if _, err := e.pool.Exec(ctx, `DELETE FROM `+part+` WHERE expires_at < now()`); err != nil {
			return err
		}
		if _, err := e.pool.Exec(ctx, `VACUUM `+part); err != nil {
			return err
		}
		deleteT = append(deleteT, time.Since(start).Seconds())
		if _, err := e.pool.Exec(ctx, `DROP TABLE `+part); err != nil {
			return err
		}

		// Prune throughput vs one DELETE of the same number of rows.
		if err := seedExpired(ctx, e.pool, fmt.Sprintf("pr%d", r), monthStart(0), o.retireRows); err != nil {
			return err
		}
		pr, err := prune.Run(ctx, e.pool, prune.Config{BatchSize: new(5000), Sleep: new(time.Millisecond)})
		if err != nil {
			return err
		}
		pruneR = append(pruneR, pr.Rate())
		if err := seedExpired(ctx, e.pool, fmt.Sprintf("nv%d", r), monthStart(0), o.retireRows); err != nil {
			return err
		}
		start = time.Now()
		tag, err := e.pool.Exec(ctx, `DELETE FROM idem.processed_events WHERE expires_at < now()`)
		if err != nil {
			return err
		}
		naiveR = append(naiveR, float64(tag.RowsAffected())/time.Since(start).Seconds())
	}
	var speedups, rates []float64
	for i := range dropT {
		speedups = append(speedups, deleteT[i]/dropT[i])
		rates = append(rates, pruneR[i]/naiveR[i])
	}
	t.add(row{section: "retention", metric: fmt.Sprintf("retire a month of %d expired rows: rotation (DROP) vs DELETE + VACUUM", o.retireRows),
		idem: fmt.Sprintf("%.3f s", median(dropT)), baseline: fmt.Sprintf("%.2f s", median(deleteT)),
		ratio: median(speedups), spread: spread(speedups), target: ">= 10x faster", note: "speedup"})
	t.add(row{section: "retention", metric: fmt.Sprintf("batched prune (5000/batch) vs one DELETE, %d rows", o.retireRows),
		idem: fmt.Sprintf("%.0f rows/s", median(pruneR)), baseline: fmt.Sprintf("%.0f rows/s", median(naiveR)),
		ratio: median(rates), spread: spread(rates), target: "information: prune trades speed for short locks"})
	return nil
}

// benchScale: claim latency on a table with few rows against one with many,
// in two databases, interleaved.
func benchScale(ctx context.Context, e *env, o options, t *table) error {
	pools := make([]*pgxpool.Pool, 2)
	for i, n := range []int{o.scaleSmall, o.scaleLarge} {
		name := fmt.Sprintf("idem_bench_scale_%d", i)
		if _, err := e.pool.Exec(ctx, `DROP DATABASE IF EXISTS `+pgx.Identifier{name}.Sanitize()+` WITH (FORCE)`); err != nil {
			return err
		}
		if _, err := e.pool.Exec(ctx, `CREATE DATABASE `+pgx.Identifier{name}.Sanitize()); err != nil {
			return fmt.Errorf("create database %s (the role needs CREATEDB): %w", name, err)
		}
		cfg, err := pgxpool.ParseConfig(e.url)
		if err != nil {
			return err
		}
		cfg.ConnConfig.Database = name
		cfg.MaxConns = 16
		p, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			return err
		}
		defer p.Close()
		defer e.pool.Exec(context.WithoutCancel(ctx), `DROP DATABASE IF EXISTS `+pgx.Identifier{name}.Sanitize()+` WITH (FORCE)`)
		if err := migrateURL(ctx, p); err != nil {
			return err
		}
		// Spread over the previous, current and next month, live rows.
		if _, err := p.Exec(ctx, `SELECT idem.create_partition($1)`, monthStart(-1)); err != nil {
			return err
		}
		for part, m := range []time.Time{monthStart(-1), monthStart(0), monthStart(1)} {
			per := n / 3
			for done := 0; done < per; done += 500_000 {
				k := min(500_000, per-done)
				if _, err := p.Exec(ctx, `
					INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, first_seen, updated_at, expires_at, result)
					SELECT 'scale', md5(g::text || $1::int::text), $2::date, 'completed', g, $2::date + interval '1 day', now(), now() + interval '60 days', '{"ok": true}'
					  FROM generate_series($3::int, $4::int) g`, part, m, done+1, done+k); err != nil {
					return err
				}
			}
		}
		if _, err := p.Exec(ctx, `VACUUM ANALYZE idem.processed_events`); err != nil {
			return err
		}
		pools[i] = p
	}
	c, err := interleave(ctx, o.rounds, 8, o.duration, claimSQL(pools[1], "bench"), claimSQL(pools[0], "bench"))
	if err != nil {
		return err
	}
	t.latencyRow("scale", fmt.Sprintf("claim with %d rows (idem) vs %d rows (baseline), 8 clients", o.scaleLarge, o.scaleSmall), c, "<= 1.3x")
	dup := func(p *pgxpool.Pool) op {
		return func(ctx context.Context, _ int, _ int64) error {
			var outcome string
			return p.QueryRow(ctx, `SELECT outcome FROM idem.claim('scale', md5($1::int::text || '1'))`, 1+rand.IntN(o.scaleSmall/3)).Scan(&outcome)
		}
	}
	c, err = interleave(ctx, o.rounds, 8, o.duration, dup(pools[1]), dup(pools[0]))
	if err != nil {
		return err
	}
	t.latencyRow("scale", fmt.Sprintf("duplicate claim with %d rows vs %d rows, 8 clients", o.scaleLarge, o.scaleSmall), c, "<= 1.3x")
	return nil
}
