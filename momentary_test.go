package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// TestMomentaryNotCounted: work that fails with an error marked Momentary
// (rate limited, a dependency briefly away) releases its key without
// counting the attempt: under max_attempts 2, five such failures still
// leave the key to run, and the sixth delivery succeeds; a plain error
// still counts (the key fails for good after two). Through pgx,
// database/sql, a role granted only idem.grant_app, and PgBouncer in
// transaction mode.
func TestMomentaryNotCounted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 4)
	if _, err := pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease, max_attempts) VALUES ('rl', '1 day', '1 minute', 2)`); err != nil {
		t.Fatal(err)
	}
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	sqlc, err := idem.NewSQL(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE ROLE momentary_app LOGIN; SELECT idem.grant_app('momentary_app')`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DROP OWNED BY momentary_app; DROP ROLE momentary_app`)
	})
	var dbname string
	if err := pool.QueryRow(ctx, `SELECT current_database()`).Scan(&dbname); err != nil {
		t.Fatal(err)
	}
	clients := map[string]*idem.Client{
		"pgx":          testdb.Client(t, pool, nil),
		"database/sql": sqlc,
		"app role":     testdb.Client(t, testdb.Pool(t, testdb.AsUser(url, "momentary_app"), 2), nil),
		"pgbouncer":    testdb.Client(t, testdb.Pool(t, testdb.PgBouncer(t, dbname), 2), nil),
	}
	limited := errors.New("429 Too Many Requests")
	for name, c := range clients {
		k := "k-" + name
		for i := range 5 {
			_, err := c.Do(ctx, "rl", k, func(context.Context) (any, error) { return nil, idem.Momentary(limited) })
			if !errors.Is(err, limited) {
				t.Fatalf("%s: momentary failure %d: %v", name, i+1, err)
			}
		}
		res, err := c.Do(ctx, "rl", k, func(context.Context) (any, error) { return "done", nil })
		if err != nil || res.Replayed {
			t.Fatalf("%s: after five momentary failures: %+v %v, want the work run", name, res, err)
		}
		k = "counted-" + name
		for range 2 {
			_, _ = c.Do(ctx, "rl", k, func(context.Context) (any, error) { return nil, limited })
		}
		if _, err := c.Do(ctx, "rl", k, func(context.Context) (any, error) { return "done", nil }); !errors.Is(err, idem.ErrFailed) {
			t.Fatalf("%s: after two counted failures: %v, want ErrFailed", name, err)
		}
	}
}

// TestDoBatchMomentaryNotCounted: DoBatch releases an item whose error is
// marked Momentary as Do releases its key, without counting the attempt:
// under max_attempts 2, five momentary failures of the whole batch (the
// work's error) and five of one item still leave both keys to run; plain
// errors still count (the keys fail for good after two).
func TestDoBatchMomentaryNotCounted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 4)
	if _, err := pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease, max_attempts) VALUES ('rl', '1 day', '1 minute', 2)`); err != nil {
		t.Fatal(err)
	}
	c := testdb.Client(t, pool, nil)
	limited := errors.New("503 Service Unavailable")
	items := []idem.BatchItem{{Key: "a"}, {Key: "b"}}
	fail := func(whole, item error) idem.BatchWork {
		return func(_ context.Context, acquired []*idem.Claim) ([]idem.WorkResult, error) {
			if whole != nil {
				return nil, whole
			}
			out := make([]idem.WorkResult, len(acquired))
			for j := range out {
				out[j].Err = item
			}
			return out, nil
		}
	}
	t.Run("momentary", func(t *testing.T) {
		for i := range 10 {
			work := fail(idem.Momentary(limited), nil)
			if i%2 == 1 {
				work = fail(nil, idem.Momentary(limited))
			}
			res, err := c.DoBatch(ctx, "rl", items, work)
			if err != nil || !errors.Is(res[0].Err, limited) || !errors.Is(res[1].Err, limited) {
				t.Fatalf("momentary failure %d: %+v %v", i+1, res, err)
			}
		}
		res, err := c.DoBatch(ctx, "rl", items, func(_ context.Context, a []*idem.Claim) ([]idem.WorkResult, error) {
			return make([]idem.WorkResult, len(a)), nil
		})
		if err != nil || res[0].Err != nil || res[1].Err != nil || res[0].Replayed || res[1].Replayed {
			t.Fatalf("after ten momentary failures: %+v %v, want the work run", res, err)
		}
	})
	t.Run("counted", func(t *testing.T) {
		items := []idem.BatchItem{{Key: "c"}, {Key: "d"}}
		for range 2 {
			_, _ = c.DoBatch(ctx, "rl", items, fail(limited, nil))
		}
		res, err := c.DoBatch(ctx, "rl", items, fail(nil, nil))
		if err != nil || !errors.Is(res[0].Err, idem.ErrFailed) || !errors.Is(res[1].Err, idem.ErrFailed) {
			t.Fatalf("after two counted failures: %+v %v, want ErrFailed", res, err)
		}
	})
}
