package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// TestDatabaseSQLThroughPgBouncer: NewSQL over pgx's stdlib driver with its
// defaults (the statement cache: named prepared statements, which
// PgBouncer 1.18 in transaction mode does not keep) through a real
// PgBouncer: 300 keys x 2 concurrent deliveries, each key's work runs once
// and is completed, none is left processing. Before, most calls failed with
// 42P05 and keys whose work ran were left processing (19-35 of 300).
func TestDatabaseSQLThroughPgBouncer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := setup(t)
	var dbname string
	if err := pool.QueryRow(ctx, `SELECT current_database()`).Scan(&dbname); err != nil {
		t.Fatal(err)
	}
	db, err := sql.Open("pgx", testdb.PgBouncer(t, dbname))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	db.SetMaxOpenConns(24)
	var logs testdb.Buffer
	c := testdb.SQLClient(t, db, &idem.Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	var runs sync.Map
	var wg sync.WaitGroup
	const keys = 300
	for k := range keys {
		for range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				key := fmt.Sprintf("sql-%03d", k)
				for {
					_, err := c.Do(ctx, "bouncer", key, func(context.Context) (any, error) {
						n, _ := runs.LoadOrStore(key, new(atomic.Int64))
						n.(*atomic.Int64).Add(1)
						return 1, nil
					})
					if errors.Is(err, idem.ErrInProgress) {
						time.Sleep(5 * time.Millisecond)
						continue
					}
					if err != nil {
						t.Error(err)
					}
					return
				}
			}()
		}
	}
	wg.Wait()
	n := 0
	runs.Range(func(k, v any) bool {
		n++
		if v.(*atomic.Int64).Load() != 1 {
			t.Errorf("%s ran %d times through PgBouncer", k, v.(*atomic.Int64).Load())
		}
		return true
	})
	var processing, completed int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 'processing')::int, count(*) FILTER (WHERE status = 'completed')::int
	    FROM idem.processed_events WHERE source = 'bouncer'`).Scan(&processing, &completed); err != nil {
		t.Fatal(err)
	}
	if n != keys || processing != 0 || completed != keys {
		t.Fatalf("%d keys ran, %d processing, %d completed; want %d, 0, %d", n, processing, completed, keys, keys)
	}

	// In the caller's transaction: a refused statement fails that one
	// transaction (the client has switched by now), and a retry commits.
	for k := range 50 {
		key := fmt.Sprintf("sqltx-%03d", k)
		for attempt := 1; ; attempt++ {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			_, err = c.WithSQLTx(tx).Do(ctx, "bouncer", key, func(context.Context) (any, error) { return 1, nil })
			if err == nil {
				err = tx.Commit()
			} else {
				_ = tx.Rollback()
			}
			if err == nil {
				break
			}
			if attempt == 3 {
				t.Fatalf("%s: %v", key, err)
			}
		}
	}
}
