package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
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
	url := testdb.New(t)
	acquired, rows := raceAcrossMonths(t, url)
	acquired.requireOnceEach(t, rows)
}

// TestSerializableClaimsAcrossMonthsNegativeControl: the same race with
// idem.serializable_placeholders made a no-op (the guard of idem.claim's
// short path and of idem.claim_general) acquires some key twice, or the
// race is not strong enough to prove anything.
func TestSerializableClaimsAcrossMonthsNegativeControl(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 1)
	if _, err := admin.Exec(ctx, `CREATE OR REPLACE FUNCTION idem.serializable_placeholders(p_source text, p_key text, p_now timestamptz, p_lo date, p_hi date)
		RETURNS void LANGUAGE sql AS 'SELECT'`); err != nil {
		t.Fatal(err)
	}
	for range 20 {
		acquired, _ := raceAcrossMonths(t, url)
		for _, n := range acquired.n {
			if n > 1 {
				return
			}
		}
	}
	t.Fatal("twenty races without the placeholders acquired no key twice: the race proves nothing")
}

// raceAcrossMonths runs the race on the database at url (its own source
// "months", after what an earlier run left) and returns what was acquired
// and the rows of the source.
func raceAcrossMonths(t *testing.T, url string) (*tally, int) {
	t.Helper()
	ctx := context.Background()
	boundary := testdb.MonthStart(time.Now(), 0)
	admin := testdb.Pool(t, url, 2)
	if _, err := admin.Exec(ctx, `SELECT idem.create_partition($1)`, boundary.AddDate(0, -1, 0)); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `DELETE FROM idem.processed_events WHERE source = 'months'`); err != nil {
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
	acquired := &tally{}
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
	return acquired, rows
}

// TestSerializablePlaceholdersOldTransaction: a SERIALIZABLE claim puts
// its placeholders only in the months a claim committed after its snapshot
// can have written, unless a transaction that took its id before the last
// checkpoint is still open. Here such a transaction (an RC claim whose
// clock reads 40 days ago, as if it had read it then) claims a key of a
// 400-day source after the SERIALIZABLE transaction took its snapshot, and
// commits; the SERIALIZABLE claim of the key then fails with a
// serialization failure instead of acquiring it again. The negative
// control: the same old clock in a transaction that took its id after the
// checkpoint (outside the day of margin the design allows for a writer's
// clock) is not met, and the key is acquired twice, so the first case
// proves the old transaction is what widened the placeholders. On a
// server of its own (autovacuum off): any transaction of another test
// open across the checkpoint would widen them too (as it should), and the
// control would prove nothing. A checkpoint that begins after the
// snapshot, with a writer's id taken in between, widens them too.
func TestSerializablePlaceholdersOldTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster, err := pgcluster.Start(ctx, pgcluster.Setting("autovacuum", "off"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Stop)
	url := cluster.URL("postgres")
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	if _, err := migrate.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, pgcluster.ClockOverrideSQL); err != nil {
		t.Fatal(err)
	}
	admin := testdb.Pool(t, url, 2)
	then := time.Now().Add(-40 * 24 * time.Hour)
	if _, err := admin.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease) VALUES ('ledger', '400 days', '1 minute')`); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `SELECT idem.create_partition(date_trunc('month', $1::timestamptz AT TIME ZONE 'UTC')::date)`, then); err != nil {
		t.Fatal(err)
	}
	race := func(t *testing.T, key string, idFirst bool) (outcome string, err error) {
		t.Helper()
		old, err := admin.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = old.Rollback(ctx) }()
		if idFirst {
			if _, err := old.Exec(ctx, `SELECT pg_current_xact_id()`); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := admin.Exec(ctx, `CHECKPOINT`); err != nil {
			t.Fatal(err)
		}
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		ser, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = ser.Rollback(ctx) }()
		if _, err := ser.Exec(ctx, `SELECT 1`); err != nil { // the snapshot
			t.Fatal(err)
		}
		var first string
		if err := old.QueryRow(ctx, `SELECT c.outcome FROM (SELECT set_config('idem.test_now', $1, true)) s, idem.claim('ledger', $2) c`,
			then.Format(time.RFC3339Nano), key).Scan(&first); err != nil || first != "acquired" {
			t.Fatalf("the old transaction's claim: %q %v", first, err)
		}
		if err := old.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		err = ser.QueryRow(ctx, `SELECT outcome FROM idem.claim('ledger', $1)`, key).Scan(&outcome)
		if err == nil {
			err = ser.Commit(ctx)
		}
		return outcome, err
	}
	t.Run("an old transaction widens the placeholders", func(t *testing.T) {
		outcome, err := race(t, "k-old", true)
		if !isSerialization(err) {
			t.Fatalf("the SERIALIZABLE claim of a key committed into a month 40 days back by a transaction older than the checkpoint: %q %v, want a serialization failure", outcome, err)
		}
	})
	// A checkpoint racing the claim: it begins after the SERIALIZABLE
	// snapshot, and a writer took its id between the two (so the snapshot
	// cannot see its commit, and the checkpoint's next_xid is past the
	// snapshot's xmin). The floor read after the checkpoint is then the
	// window's first month, for a single claim and for a batch, and each
	// meets the writer's row.
	t.Run("a checkpoint after the snapshot", func(t *testing.T) {
		for _, batch := range []bool{false, true} {
			key := fmt.Sprintf("k-ckpt-%t", batch)
			conn, err := pgx.Connect(ctx, url)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close(ctx)
			ser, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = ser.Rollback(ctx) }()
			if _, err := ser.Exec(ctx, `SELECT 1`); err != nil { // the snapshot
				t.Fatal(err)
			}
			old, err := admin.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = old.Rollback(ctx) }()
			if _, err := old.Exec(ctx, `SELECT pg_current_xact_id()`); err != nil {
				t.Fatal(err)
			}
			if _, err := admin.Exec(ctx, `CHECKPOINT`); err != nil {
				t.Fatal(err)
			}
			var first string
			if err := old.QueryRow(ctx, `SELECT c.outcome FROM (SELECT set_config('idem.test_now', $1, true)) s, idem.claim('ledger', $2) c`,
				then.Format(time.RFC3339Nano), key).Scan(&first); err != nil || first != "acquired" {
				t.Fatalf("the writer's claim: %q %v", first, err)
			}
			if err := old.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			var outcome string
			q := `SELECT outcome FROM idem.claim('ledger', $1)`
			if batch {
				q = `SELECT outcome FROM idem.claim_batch('ledger', ARRAY['k-ckpt-other', $1]) WHERE ord = 2`
			}
			err = ser.QueryRow(ctx, q, key).Scan(&outcome)
			if err == nil {
				err = ser.Commit(ctx)
			}
			if !isSerialization(err) {
				t.Fatalf("batch %t: the SERIALIZABLE claim of a key committed 40 days back by a writer whose id precedes a checkpoint begun after the snapshot: %q %v, want a serialization failure", batch, outcome, err)
			}
		}
	})
	t.Run("negative control: a young transaction with an old clock", func(t *testing.T) {
		outcome, err := race(t, "k-young", false)
		if err != nil || outcome != "acquired" {
			t.Fatalf("outside the design's day of margin the narrow placeholders should miss the row (the control proves nothing otherwise): %q %v", outcome, err)
		}
	})
}
