package main

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"sync"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem"
)

// benchWait: 50 concurrent duplicates of a request whose work takes
// 300 ms, each with idem.WithWait: how long after the original's work ended
// the duplicates got its answer, woken by LISTEN/NOTIFY (a pgx pool's
// client) against polling idem.peek with backoff (a database/sql client,
// as behind a transaction pooler). Information: latency, not a ratio.
func benchWait(ctx context.Context, e *env, o options, t *table) error {
	db, err := sql.Open("pgx", e.url)
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(16)
	notified, err := idem.New(e.pool, nil)
	if err != nil {
		return err
	}
	polling, err := idem.NewSQL(db, nil)
	if err != nil {
		return err
	}
	clients := map[string]*idem.Client{"notified": notified, "polling": polling}
	lags := map[string][]time.Duration{}
	for round := range o.rounds {
		for _, mode := range []string{"notified", "polling"} {
			c := clients[mode]
			key := fmt.Sprintf("%s-%d-%s", mode, round, newKey())
			var ended time.Time
			answered := make([]time.Time, 50)
			var wg sync.WaitGroup
			var mu sync.Mutex
			errs := 0
			for i := range answered {
				wg.Go(func() {
					res, err := c.Do(ctx, "bench-wait", key, func(context.Context) (any, error) {
						time.Sleep(300 * time.Millisecond)
						mu.Lock()
						ended = time.Now()
						mu.Unlock()
						return "done", nil
					}, idem.WithWait(10*time.Second))
					if err != nil || (res.Replayed && string(res.Result) != `"done"`) {
						mu.Lock()
						errs++
						mu.Unlock()
						return
					}
					if res.Replayed {
						answered[i] = time.Now()
					}
				})
			}
			wg.Wait()
			if errs > 0 {
				return fmt.Errorf("wait (%s): %d of 50 calls did not get the original's answer", mode, errs)
			}
			for _, at := range answered {
				if !at.IsZero() {
					lags[mode] = append(lags[mode], at.Sub(ended))
				}
			}
		}
	}
	pct := func(xs []time.Duration, p int) time.Duration {
		slices.Sort(xs)
		return xs[min(len(xs)-1, len(xs)*p/100)]
	}
	n, p := lags["notified"], lags["polling"]
	t.add(row{section: "wait", metric: fmt.Sprintf("49 duplicates waiting (WithWait) for a 300 ms original, %d rounds: their answer after the original's", o.rounds),
		idem:     fmt.Sprintf("notified: p50 %.1f ms, p99 %.1f ms", ms(pct(n, 50)), ms(pct(n, 99))),
		baseline: fmt.Sprintf("polling: p50 %.1f ms, p99 %.1f ms", ms(pct(p, 50)), ms(pct(p, 99))),
		ratio:    float64(pct(n, 99)) / float64(pct(p, 99)), spread: "-", target: "information (ratio of p99)"})
	return nil
}
