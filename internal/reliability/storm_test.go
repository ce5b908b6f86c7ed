package reliability

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/prune"
	"github.com/idemkit/idem/internal/testdb"
)

func monthStart(add int) time.Time { return testdb.MonthStart(time.Now(), add) }

// TestDuplicateStorm: 10,000 keys x 16 concurrent deliveries over 32
// connections while prune and rotation run in a loop: exactly 10,000
// acquisitions, and every delivery that got a result got the right one.
func TestDuplicateStorm(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	keys, copies := scale(10_000, 50_000), 16
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 32)
	// Work for the maintenance loop: expired rows in two past months and
	// this one.
	for _, m := range []int{-2, -1} {
		if _, err := pool.Exec(ctx, `SELECT idem.create_partition($1)`, monthStart(m)); err != nil {
			t.Fatal(err)
		}
	}
	for _, m := range []int{-2, -1, 0} {
		if _, err := pool.Exec(ctx, `
			INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, first_seen, updated_at, expires_at)
			SELECT 'old', 'old-' || $1::int || '-' || g, $2::date, 'completed', g, $2::date, now(), now() - interval '1 minute'
			  FROM generate_series(1, 20000) g`, m, monthStart(m)); err != nil {
			t.Fatal(err)
		}
	}

	stop := make(chan struct{})
	var maintWG sync.WaitGroup
	var pruned atomic.Int64
	var rotations atomic.Int64
	maintWG.Add(1)
	go func() {
		defer maintWG.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			res, err := prune.Run(ctx, pool, prune.Config{BatchSize: new(2000), Sleep: new(5 * time.Millisecond)})
			if err != nil {
				t.Errorf("prune: %v", err)
				return
			}
			pruned.Add(res.Deleted)
			if _, err := partition.Rotate(ctx, pool, partition.Config{LockTimeout: new(500 * time.Millisecond)}); err != nil && !errors.Is(err, partition.ErrIncomplete) {
				t.Errorf("rotate: %v", err)
				return
			}
			rotations.Add(1)
		}
	}()

	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	var (
		runs       sync.Map
		deliveries atomic.Int64
		waits      atomic.Int64
	)
	queue := make([]int, 0, keys*copies)
	for k := range keys {
		for range copies {
			queue = append(queue, k)
		}
	}
	rand.Shuffle(len(queue), func(i, j int) { queue[i], queue[j] = queue[j], queue[i] })
	ch := make(chan int, 1024)
	var wg sync.WaitGroup
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := range ch {
				key := fmt.Sprintf("evt-%06d", k)
				want := fmt.Sprintf(`{"key":%q,"charged":%d}`, key, k*7)
				for {
					res, err := c.Do(ctx, "storm", key, func(context.Context) (any, error) {
						n, _ := runs.LoadOrStore(key, new(atomic.Int64))
						n.(*atomic.Int64).Add(1)
						return json.RawMessage(want), nil
					})
					if errors.Is(err, idem.ErrInProgress) { // the sender retries later
						waits.Add(1)
						time.Sleep(2 * time.Millisecond)
						continue
					}
					if err != nil {
						t.Errorf("%s: %v", key, err)
						return
					}
					var got, exp any
					_ = json.Unmarshal(res.Result, &got)
					_ = json.Unmarshal([]byte(want), &exp)
					if fmt.Sprint(got) != fmt.Sprint(exp) {
						t.Errorf("%s: result %s, want %s", key, res.Result, want)
					}
					deliveries.Add(1)
					break
				}
			}
		}()
	}
	for _, k := range queue {
		ch <- k
	}
	close(ch)
	wg.Wait()
	close(stop)
	maintWG.Wait()

	acquired, dupes := 0, 0
	runs.Range(func(_, v any) bool {
		acquired++
		if v.(*atomic.Int64).Load() != 1 {
			dupes++
		}
		return true
	})
	lost := keys - count(t, pool, `SELECT count(*) FROM idem.processed_events WHERE source = 'storm' AND status = 'completed'`)
	t.Logf("storm: %d keys x %d deliveries, %d answered, %d in-flight retries, %d acquisitions, %d duplicate runs, %d keys lost; %d rows pruned in %d maintenance rounds",
		keys, copies, deliveries.Load(), waits.Load(), acquired, dupes, lost, pruned.Load(), rotations.Load())
	if acquired != keys || dupes != 0 || lost != 0 || deliveries.Load() != int64(keys*copies) {
		t.Fatalf("want %d acquisitions, no duplicate run, no lost key, every delivery answered", keys)
	}
	if pruned.Load() != 60_000 {
		t.Fatalf("maintenance pruned %d rows, want the 60000 expired ones", pruned.Load())
	}
}
