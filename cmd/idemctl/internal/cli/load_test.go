package cli

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/prune"
	"github.com/idemkit/idem/internal/testdb"
)

// TestMaintenanceUnderClaimLoad: prune and rotate run again and again while
// 12 workers claim new keys and replay old ones; no claim fails and no live
// key is lost.
func TestMaintenanceUnderClaimLoad(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 24)
	now := time.Now()
	for _, m := range []int{-3, -2, -1} {
		if _, err := pool.Exec(ctx, `SELECT idem.create_partition($1)`, monthStart(now, m)); err != nil {
			t.Fatal(err)
		}
		seedRows(t, pool, fmt.Sprintf("exp%d-", -m), monthStart(now, m), 5000, true, false)
	}
	seedRows(t, pool, "cur-", monthStart(now, 0), 5000, true, false)

	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	var (
		done     = make(chan struct{})
		wg       sync.WaitGroup
		claims   atomic.Int64
		replays  atomic.Int64
		failures atomic.Int64
	)
	for w := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-done:
					return
				default:
				}
				key := fmt.Sprintf("live-w%02d-%06d", w, i)
				res, err := c.Do(ctx, "load", key, func(context.Context) (any, error) { return map[string]string{"k": key}, nil })
				if err != nil || res.Replayed {
					failures.Add(1)
					t.Errorf("claim %s: %+v %v", key, res, err)
					return
				}
				claims.Add(1)
				if i > 0 && i%3 == 0 { // a duplicate of an earlier key must replay
					old := fmt.Sprintf("live-w%02d-%06d", w, i/2)
					res, err := c.Do(ctx, "load", old, func(context.Context) (any, error) { return nil, fmt.Errorf("ran twice") })
					if err != nil || !res.Replayed || string(res.Result) != fmt.Sprintf(`{"k": "%s"}`, old) {
						failures.Add(1)
						t.Errorf("duplicate of %s: %+v %v", old, res, err)
						return
					}
					replays.Add(1)
				}
			}
		}()
	}
	var deleted int64
	var rotations int
	for round := 0; round < 3; round++ {
		pr, err := prune.Run(ctx, pool, prune.Config{BatchSize: new(1000), Sleep: new(time.Millisecond)})
		if err != nil {
			t.Fatal(err)
		}
		deleted += pr.Deleted
		if res, err := partition.Rotate(ctx, pool, partition.Config{LockTimeout: new(500 * time.Millisecond)}); err != nil {
			t.Fatalf("%v: %+v", err, res)
		}
		rotations++
	}
	time.Sleep(200 * time.Millisecond)
	close(done)
	wg.Wait()
	if deleted != 20000 {
		t.Errorf("prune deleted %d rows, want the 20000 expired ones", deleted)
	}
	if failures.Load() != 0 {
		t.Fatalf("%d claims failed", failures.Load())
	}
	var live int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE source = 'load' AND status = 'completed'`).Scan(&live); err != nil {
		t.Fatal(err)
	}
	if live != claims.Load() {
		t.Fatalf("%d live keys left, want the %d claimed during maintenance", live, claims.Load())
	}
	t.Logf("%d claims and %d replays during %d prune+rotate rounds", claims.Load(), replays.Load(), rotations)
}
