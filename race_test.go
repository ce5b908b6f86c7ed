package idem_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

const (
	raceKeys       = 1000 // distinct keys
	raceDeliveries = 8    // concurrent deliveries of each key
	raceConns      = 24   // connections (>= 16)
)

// delivery is one arrival of a key at some worker.
type delivery struct{ key string }

// storm delivers every key raceDeliveries times, shuffled, from raceConns
// goroutines at once, and calls handle for each delivery.
func storm(t *testing.T, keys int, handle func(ctx context.Context, worker int, d delivery) error) {
	t.Helper()
	ds := make([]delivery, 0, keys*raceDeliveries)
	for k := range keys {
		for range raceDeliveries {
			ds = append(ds, delivery{key: fmt.Sprintf("evt_%05d", k)})
		}
	}
	rand.Shuffle(len(ds), func(i, j int) { ds[i], ds[j] = ds[j], ds[i] })
	ch := make(chan delivery)
	var wg sync.WaitGroup
	errs := make(chan error, raceConns)
	start := make(chan struct{})
	for w := range raceConns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for d := range ch {
				if err := handle(context.Background(), w, d); err != nil {
					errs <- err
					for range ch { // drain so the feeder ends
					}
					return
				}
			}
		}()
	}
	close(start)
	for _, d := range ds {
		ch <- d
	}
	close(ch)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// tally counts acquisitions per key.
type tally struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *tally) add(key string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[key]++
}

func (c *tally) requireOnceEach(t *testing.T, keys int) {
	t.Helper()
	if len(c.n) != keys {
		t.Errorf("%d keys acquired, want %d", len(c.n), keys)
	}
	for k, n := range c.n {
		if n != 1 {
			t.Errorf("key %s acquired %d times, want exactly once", k, n)
		}
	}
}

// warm makes sure the pool really has its connections open, so the storm
// runs over many connections at once.
func warm(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	var conns []*pgxpool.Conn
	for range pool.Config().MaxConns {
		c, err := pool.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}
}

func TestRaceExactlyOneAcquirePerKey(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, testdb.New(t), raceConns)
	warm(t, pool)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	var acquired tally
	var outcomes sync.Map
	storm(t, raceKeys, func(ctx context.Context, _ int, d delivery) error {
		cl, err := c.Claim(ctx, "stripe", d.key)
		if err != nil {
			return err
		}
		n, _ := outcomes.LoadOrStore(cl.Outcome, new(atomic.Int64))
		n.(*atomic.Int64).Add(1)
		if cl.Outcome == idem.Acquired {
			acquired.add(d.key)
			return c.Complete(ctx, "stripe", d.key, cl.Token, []byte(`{"ok":true}`))
		}
		return nil
	})
	acquired.requireOnceEach(t, raceKeys)
	outcomes.Range(func(k, v any) bool {
		t.Logf("%s: %d", k, v.(*atomic.Int64).Load())
		return true
	})
	var rows int
	if err := pool.QueryRow(context.Background(),
		`SELECT count(*) FROM idem.processed_events WHERE status = 'completed'`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != raceKeys {
		t.Fatalf("%d completed rows, want %d", rows, raceKeys)
	}
}

func TestRaceAcrossMonthBoundary(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	boundary := testdb.MonthStart(time.Now(), 0) // partitions exist for this month and the next
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 2)
	// The month before the boundary has no partition yet: make it, as
	// rotation would have.
	if _, err := admin.Exec(ctx, `SELECT idem.create_partition($1)`, boundary.AddDate(0, -1, 0)); err != nil {
		t.Fatal(err)
	}

	t.Run("original in the previous month", func(t *testing.T) {
		// Keys first seen an hour before the boundary, in the previous
		// month's partition: a third completed, a third still in flight
		// under a live lease, a third whose worker died (lease lapsed).
		before, err := idem.New(testdb.PoolAt(t, url, 4, boundary.Add(-time.Hour)), nil)
		if err != nil {
			t.Fatal(err)
		}
		kind := func(k int) int { return k % 3 }
		for k := range raceKeys {
			key := fmt.Sprintf("evt_%05d", k)
			lease := []time.Duration{time.Minute, 2 * time.Hour, time.Minute}[kind(k)]
			cl, err := before.Claim(ctx, "stripe", key, idem.WithLease(lease))
			if err != nil || cl.Outcome != idem.Acquired {
				t.Fatalf("seed claim: %+v %v", cl, err)
			}
			if kind(k) == 0 {
				if err := before.Complete(ctx, "stripe", key, cl.Token, []byte(`{"month":"previous"}`)); err != nil {
					t.Fatal(err)
				}
			}
		}
		after := testdb.PoolAt(t, url, raceConns, boundary.Add(time.Second))
		warm(t, after)
		c, err := idem.New(after, nil)
		if err != nil {
			t.Fatal(err)
		}
		var reacquired tally
		storm(t, raceKeys, func(ctx context.Context, _ int, d delivery) error {
			cl, err := c.Claim(ctx, "stripe", d.key, idem.WithLease(2*time.Hour))
			if err != nil {
				return err
			}
			var k int
			fmt.Sscanf(d.key, "evt_%d", &k)
			switch {
			case kind(k) == 0 && cl.Outcome == idem.Completed && string(cl.Result) == `{"month": "previous"}`:
			case kind(k) == 1 && cl.Outcome == idem.InProgress:
			case kind(k) == 2 && cl.Outcome == idem.InProgress:
			case kind(k) == 2 && cl.Outcome == idem.Acquired && cl.Attempt == 2:
				reacquired.add(d.key)
			default:
				return fmt.Errorf("key %s (kind %d) after the boundary: %+v", d.key, kind(k), cl)
			}
			return nil
		})
		if len(reacquired.n) != raceKeys/3 {
			t.Errorf("%d lapsed keys re-acquired, want %d", len(reacquired.n), raceKeys/3)
		}
		reacquired.requireOnceEach(t, len(reacquired.n))
		var newRows int
		if err := admin.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE first_seen_month = $1`,
			boundary).Scan(&newRows); err != nil {
			t.Fatal(err)
		}
		if newRows != 0 {
			t.Fatalf("%d rows were created in the new month's partition for keys of the previous month", newRows)
		}
	})

	t.Run("first deliveries straddle the boundary", func(t *testing.T) {
		// Half the connections live just before midnight, half just after:
		// the same key races into two different partitions.
		early, err := idem.New(testdb.PoolAt(t, url, raceConns/2, boundary.Add(-time.Millisecond)), nil)
		if err != nil {
			t.Fatal(err)
		}
		late, err := idem.New(testdb.PoolAt(t, url, raceConns/2, boundary.Add(time.Millisecond)), nil)
		if err != nil {
			t.Fatal(err)
		}
		var acquired tally
		storm(t, raceKeys, func(ctx context.Context, w int, d delivery) error {
			c := early
			if w%2 == 1 {
				c = late
			}
			cl, err := c.Claim(ctx, "github", d.key)
			if err != nil {
				return err
			}
			if cl.Outcome == idem.Acquired {
				acquired.add(d.key)
			}
			return nil
		})
		acquired.requireOnceEach(t, raceKeys)
		var months int
		if err := admin.QueryRow(ctx, `SELECT count(DISTINCT first_seen_month) FROM idem.processed_events WHERE source = 'github'`).Scan(&months); err != nil {
			t.Fatal(err)
		}
		if months != 2 {
			t.Fatalf("keys landed in %d partitions, want both sides of the boundary", months)
		}
	})
}

// TestRaceInsideAppTransactions claims, writes a business row and completes
// in one application transaction, at each isolation level.
func TestRaceInsideAppTransactions(t *testing.T) {
	t.Parallel()
	for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.Serializable} {
		t.Run(string(iso), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := testdb.Pool(t, testdb.New(t), raceConns)
			if _, err := pool.Exec(ctx, `CREATE TABLE payments (event_id text NOT NULL, amount int NOT NULL)`); err != nil {
				t.Fatal(err)
			}
			warm(t, pool)
			c, err := idem.New(pool, nil)
			if err != nil {
				t.Fatal(err)
			}
			var acquired tally
			var retries atomic.Int64
			storm(t, raceKeys, func(ctx context.Context, _ int, d delivery) error {
				for {
					won, err := claimAndPay(ctx, pool, c, iso, d.key)
					if errors.Is(err, idem.ErrSerialization) || isSerialization(err) {
						retries.Add(1)
						continue
					}
					if err != nil {
						return err
					}
					if won {
						acquired.add(d.key)
					}
					return nil
				}
			})
			t.Logf("%s: %d serialization retries", iso, retries.Load())
			acquired.requireOnceEach(t, raceKeys)
			var dupes int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT event_id FROM payments GROUP BY event_id HAVING count(*) > 1) d`).Scan(&dupes); err != nil {
				t.Fatal(err)
			}
			var total int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM payments`).Scan(&total); err != nil {
				t.Fatal(err)
			}
			if dupes != 0 || total != raceKeys {
				t.Fatalf("payments: %d rows, %d keys paid twice; want %d rows, none twice", total, dupes, raceKeys)
			}
		})
	}
	t.Run("repeatable read is refused", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		pool := testdb.Pool(t, testdb.New(t), 2)
		tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		_, err = testdb.Client(t, pool, nil).WithTx(tx).Claim(ctx, "stripe", "evt_rr")
		if !errors.Is(err, idem.ErrIsolationNotSupported) {
			t.Fatalf("claim at REPEATABLE READ: %v, want ErrIsolationNotSupported", err)
		}
		var ie *idem.Error
		if !errors.As(err, &ie) || ie.SQLState() != "0A000" {
			t.Fatalf("error %v: want an *idem.Error with SQLSTATE 0A000", err)
		}
	})
}

// claimAndPay is a handler that wants an exactly-once database effect.
func claimAndPay(ctx context.Context, pool *pgxpool.Pool, c *idem.Client, iso pgx.TxIsoLevel, key string) (bool, error) {
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
	if err != nil {
		return false, err
	}
	defer tx.Rollback(ctx)
	ct := c.WithTx(tx)
	cl, err := ct.Claim(ctx, "stripe", key)
	if err != nil {
		return false, err
	}
	if cl.Outcome != idem.Acquired {
		return false, tx.Commit(ctx)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO payments (event_id, amount) VALUES ($1, 4200)`, key); err != nil {
		return false, err
	}
	if err := ct.Complete(ctx, "stripe", key, cl.Token, []byte(`{"paid":4200}`)); err != nil {
		return false, err
	}
	return true, tx.Commit(ctx)
}
