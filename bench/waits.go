package main

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// waitNotes are what the wait-event samplers found, printed at the end of
// the results ("What the statements wait on").
var waitNotes []string

// waitSampler samples pg_stat_activity of the pool's database every 5 ms:
// for each active backend, what its statement is (claim, complete, the
// hand-written pattern, River, other) and what it waits on (no wait
// event: on the CPU, or runnable).
type waitSampler struct {
	mu     sync.Mutex
	counts map[string]map[string]int
	cancel context.CancelFunc
	done   chan struct{}
}

func sampleWaits(ctx context.Context, pool *pgxpool.Pool) *waitSampler {
	ctx, cancel := context.WithCancel(ctx)
	w := &waitSampler{counts: map[string]map[string]int{}, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(w.done)
		t := time.NewTicker(5 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			rows, err := pool.Query(ctx, `
				SELECT CASE WHEN query LIKE '%idem.claim%' THEN 'claim'
				            WHEN query LIKE '%idem.complete%' THEN 'complete'
				            WHEN query LIKE '%hw_events%' THEN 'hand-written'
				            WHEN query LIKE '%river_job%' THEN 'river'
				            WHEN query LIKE '%retire_partition%' OR query LIKE '%create_partition%' OR query LIKE '%DETACH%' THEN 'rotation'
				            ELSE 'other' END,
				       coalesce(wait_event_type || ':' || wait_event, 'CPU')
				  FROM pg_catalog.pg_stat_activity
				 WHERE datname = current_database() AND state = 'active' AND pid <> pg_backend_pid()`)
			if err != nil {
				continue
			}
			w.mu.Lock()
			for rows.Next() {
				var class, wait string
				if rows.Scan(&class, &wait) == nil {
					if w.counts[class] == nil {
						w.counts[class] = map[string]int{}
					}
					w.counts[class][wait]++
				}
			}
			w.mu.Unlock()
			rows.Close()
		}
	}()
	return w
}

// stop ends the sampling and notes, for each class of statement, its top
// waits as shares of its samples.
func (w *waitSampler) stop(what string) {
	w.cancel()
	<-w.done
	w.mu.Lock()
	defer w.mu.Unlock()
	var classes []string
	for c := range w.counts {
		classes = append(classes, c)
	}
	slices.Sort(classes)
	var parts []string
	for _, c := range classes {
		total := 0
		type kv struct {
			k string
			n int
		}
		var kvs []kv
		for k, n := range w.counts[c] {
			total += n
			kvs = append(kvs, kv{k, n})
		}
		slices.SortFunc(kvs, func(a, b kv) int { return b.n - a.n })
		var top []string
		for i, e := range kvs {
			if i == 4 {
				break
			}
			top = append(top, fmt.Sprintf("%s %.0f%%", e.k, 100*float64(e.n)/float64(total)))
		}
		parts = append(parts, fmt.Sprintf("%s (%d samples): %s", c, total, strings.Join(top, ", ")))
	}
	waitNotes = append(waitNotes, fmt.Sprintf("- %s: %s", what, strings.Join(parts, "; ")))
}
