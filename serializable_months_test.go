package idem_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// TestSerializableClaimsAcrossMonths: single-key claims race inside
// transactions, READ COMMITTED and SERIALIZABLE mixed, from clients whose
// clocks are a millisecond either side of a month boundary; each
// SERIALIZABLE transaction takes its snapshot before its claim. A claim
// whose snapshot predates another claim's commit into the other month's
// partition cannot see that row; migration 21 makes it fail with a
// serialization failure (retried here, as a caller does) instead of
// inserting the key again. Every key's acquisition commits exactly once
// (before 21: a few keys twice in a run this size).
func TestSerializableClaimsAcrossMonths(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	boundary := testdb.MonthStart(time.Now(), 0)
	admin := testdb.Pool(t, url, 2)
	if _, err := admin.Exec(ctx, `SELECT idem.create_partition($1)`, boundary.AddDate(0, -1, 0)); err != nil {
		t.Fatal(err)
	}
	const (
		keys    = 200
		workers = 16
		claims  = 120 // per worker
	)
	pools := []*pgxpool.Pool{
		testdb.PoolAt(t, url, workers/2, boundary.Add(-time.Millisecond)),
		testdb.PoolAt(t, url, workers/2, boundary.Add(time.Millisecond)),
	}
	var acquired tally
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			pool := pools[w%2]
			c, err := idem.New(pool, &idem.Config{LockWait: 30 * time.Second})
			if err != nil {
				errs <- err
				return
			}
			r := rand.New(rand.NewPCG(uint64(w), 21))
			for i := range claims {
				key := fmt.Sprintf("k%04d", r.IntN(keys))
				iso := pgx.ReadCommitted
				if (w+i)%2 == 0 {
					iso = pgx.Serializable
				}
				for {
					var cl *idem.Claim
					err = pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: iso}, func(tx pgx.Tx) (err error) {
						// The snapshot first, as a transaction that did
						// other work before its claim.
						if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
							return err
						}
						time.Sleep(time.Duration(r.IntN(500)) * time.Microsecond)
						cl, err = c.WithTx(tx).Claim(ctx, "months", key)
						return err
					})
					if errors.Is(err, idem.ErrSerialization) || isSerialization(err) {
						continue
					}
					if err != nil {
						errs <- fmt.Errorf("worker %d claim %d: %w", w, i, err)
						return
					}
					if cl.Outcome == idem.Acquired {
						acquired.add(key)
					}
					break
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	var rows int
	if err := admin.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE source = 'months'`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	acquired.requireOnceEach(t, rows)
}
