// Package citustest is the opt-in suite of idem on Citus (docs/citus.md):
// it runs when IDEM_TEST_CITUS_URL points at a Citus coordinator's
// database whose workers are added (citus_add_node), and says it did not
// run, and why, otherwise. Each test drops schema idem there and migrates
// again with migrate.Citus, so the tests run one after another.
package citustest_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/prune"
	"github.com/idemkit/idem/internal/sqlstate"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
)

// setup gives t a freshly migrated, distributed idem on the Citus
// coordinator and a pool on it.
func setup(t *testing.T) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	url := testdb.Citus(t)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 24
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if _, err := pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling) VALUES ('c', '1 day', '1 minute', 1)`); err != nil {
		t.Fatal(err)
	}
	return pool
}

// callsByNode returns idem.claim's calls on each worker since setup, from
// the workers' pg_stat_user_functions (track_functions is turned on for
// them), once they add up to want (statistics are flushed late) or 40 s
// have passed.
func callsByNode(t *testing.T, pool *pgxpool.Pool, fn string, want int64) map[string]int64 {
	t.Helper()
	ctx := context.Background()
	read := func() map[string]int64 {
		rows, err := pool.Query(ctx, `SELECT nodeport::text, coalesce(nullif(result, ''), '0')::bigint
		  FROM run_command_on_workers(format($$SELECT coalesce(sum(calls), 0) FROM pg_stat_user_functions WHERE schemaname = 'idem' AND funcname = %L$$, $1::text))`, fn)
		if err != nil {
			t.Fatal(err)
		}
		m, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (kv [2]any, err error) {
			var port string
			var n int64
			err = r.Scan(&port, &n)
			return [2]any{port, n}, err
		})
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]int64{}
		for _, kv := range m {
			out["worker:"+kv[0].(string)] = kv[1].(int64)
		}
		var local int64
		if err := pool.QueryRow(ctx, `SELECT coalesce(sum(calls), 0) FROM pg_stat_user_functions WHERE schemaname = 'idem' AND funcname = $1`, fn).Scan(&local); err != nil {
			t.Fatal(err)
		}
		out["coordinator"] = local
		return out
	}
	// Backends flush their statistics when idle, within 10 s.
	deadline := time.Now().Add(40 * time.Second)
	for {
		cur := read()
		var sum int64
		for _, n := range cur {
			sum += n
		}
		if sum >= want || time.Now().After(deadline) {
			return cur
		}
		time.Sleep(time.Second)
	}
}

func trackFunctions(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	for _, q := range []string{
		`SELECT run_command_on_workers('ALTER SYSTEM SET track_functions = ''pl''')`,
		`SELECT run_command_on_workers('SELECT pg_reload_conf()')`,
		`SELECT run_command_on_workers('SELECT pg_stat_reset()')`,
		`ALTER SYSTEM SET track_functions = 'pl'`,
		`SELECT pg_reload_conf()`,
		`SELECT pg_stat_reset()`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	// Citus keeps connections to the workers: new settings reach them
	// after a reload, at their next transaction.
	time.Sleep(500 * time.Millisecond)
}

// TestCitusDelegated: claims and completions through idem's Go API,
// outside and inside the application's transaction, and the failures of
// failed work, run on the worker that holds their key, none on the
// coordinator; every worker runs some.
func TestCitusDelegated(t *testing.T) {
	pool := setup(t)
	trackFunctions(t, pool)
	ctx := context.Background()
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	const n = 400
	for i := range n {
		key := "k" + strconv.Itoa(i)
		work := func(context.Context) (any, error) { return key, nil }
		if i%2 == 0 {
			if _, err := c.Do(ctx, "c", key, work); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := c.WithTx(tx).Do(ctx, "c", key, work)
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	calls := callsByNode(t, pool, "claim", n)
	t.Logf("idem.claim calls by node: %v", calls)
	var workers int64
	for node, k := range calls {
		if node == "coordinator" {
			if k != 0 {
				t.Errorf("the coordinator ran %d claims, want 0", k)
			}
			continue
		}
		if k == 0 {
			t.Errorf("%s ran no claim", node)
		}
		workers += k
	}
	if workers != n {
		t.Errorf("the workers ran %d claims, want %d", workers, n)
	}
	// Do's completion (idem.complete_stored, which calls idem.complete
	// there) runs on the key's worker too.
	completes := callsByNode(t, pool, "complete_stored", n)
	t.Logf("idem.complete_stored calls by node: %v", completes)
	var onWorkers int64
	for node, k := range completes {
		if node != "coordinator" {
			onWorkers += k
		}
	}
	if completes["coordinator"] != 0 || onWorkers != n {
		t.Errorf("completions by node %v: want all %d on the workers", completes, n)
	}

	// A failed Do records its failure (idem.fail) on the key's worker too.
	const failing = 20
	for i := range failing {
		_, err := c.Do(ctx, "c", "fails"+strconv.Itoa(i), func(context.Context) (any, error) { return nil, errors.New("boom") })
		if err == nil {
			t.Fatal("a failing Do returned no error")
		}
	}
	fails := callsByNode(t, pool, "fail", failing)
	t.Logf("idem.fail calls by node: %v", fails)
	if fails["coordinator"] != 0 {
		t.Errorf("the coordinator ran %d failures, want 0", fails["coordinator"])
	}

	// A claim Citus does not delegate (its key comes from another query)
	// is refused, never run with a lock the owning node does not see.
	_, err = pool.Exec(ctx, `SELECT (idem.claim('c', v.k)).outcome FROM (VALUES ('undelegated')) v(k)`)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != sqlstate.NotDelegated {
		t.Fatalf("an undelegated claim: %v, want SQLSTATE %s", err, sqlstate.NotDelegated)
	}
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE key = 'undelegated'`).Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("%d rows, %v", rows, err)
	}
}

// race runs every key's work through Do from clients goroutines, half of
// them in their own transaction (WithTx), until stop, and returns how many
// times each key's work ran.
func race(t *testing.T, pool *pgxpool.Pool, keys []string, clients int, stop <-chan struct{}) map[string]int {
	t.Helper()
	ctx := context.Background()
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	runs := map[string]int{}
	var calls atomic.Int64
	var wg sync.WaitGroup
	for g := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Every goroutine goes over every key at least once, each
			// starting at another place.
			for i := 0; ; i++ {
				select {
				case <-stop:
					if i >= len(keys) {
						return
					}
				default:
				}
				key := keys[(g*len(keys)/clients+i)%len(keys)]
				work := func(context.Context) (any, error) {
					mu.Lock()
					runs[key]++
					mu.Unlock()
					return "ran", nil
				}
				var err error
				if g%2 == 0 {
					_, err = c.Do(ctx, "c", key, work)
				} else {
					err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
						_, err := c.WithTx(tx).Do(ctx, "c", key, work)
						return err
					})
				}
				calls.Add(1)
				if err != nil && !errors.Is(err, idem.ErrInProgress) && !errors.Is(err, idem.ErrSerialization) {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	t.Logf("%d calls of Do over %d keys", calls.Load(), len(keys))
	return runs
}

func keys(prefix string, n int) []string {
	ks := make([]string, n)
	for i := range ks {
		ks[i] = prefix + strconv.Itoa(i)
	}
	return ks
}

// once checks that every key's work ran once and that each key has one
// completed row.
func once(t *testing.T, pool *pgxpool.Pool, ks []string, runs map[string]int) {
	t.Helper()
	for _, k := range ks {
		if runs[k] != 1 {
			t.Errorf("key %s ran %d times, want 1", k, runs[k])
		}
	}
	var bad int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM (
		SELECT key FROM idem.processed_events WHERE source = 'c' AND key = ANY($1)
		 GROUP BY key HAVING count(*) <> 1 OR bool_or(status <> 'completed')) x`, ks).Scan(&bad); err != nil {
		t.Fatal(err)
	}
	if bad != 0 {
		t.Errorf("%d keys without exactly one completed row", bad)
	}
}

// TestCitusRace: 16 clients, half in their own transactions (delegated by
// force_delegation) and half not, race over the same 300 keys: each key's
// work runs once; the next prune brings the workers' counts to the
// coordinator.
func TestCitusRace(t *testing.T) {
	pool := setup(t)
	ks := keys("r", 300)
	stop := make(chan struct{})
	time.AfterFunc(5*time.Second, func() { close(stop) })
	runs := race(t, pool, ks, 16, stop)
	once(t, pool, ks, runs)

	// The counts the workers' claims wrote on their own node reach the
	// coordinator's tables at the next prune (compaction collects them):
	// every acquisition (sampling 1 for source c: exact), and as many
	// duplicates as the workers counted.
	ctx := context.Background()
	var onWorkers int64
	if err := pool.QueryRow(ctx, `SELECT coalesce(sum(nullif(result, '')::bigint), 0) FROM run_command_on_workers(
		$$SELECT coalesce(sum(duplicates), 0) FROM idem.duplicate_counts WHERE source = 'c'$$)`).Scan(&onWorkers); err != nil {
		t.Fatal(err)
	}
	if _, err := prune.Run(ctx, pool, prune.Config{}); err != nil {
		t.Fatal(err)
	}
	var dups, acquired int64
	if err := pool.QueryRow(ctx, `SELECT (SELECT coalesce(sum(duplicates), 0) FROM idem.duplicate_counts WHERE source = 'c'),
		(SELECT coalesce(sum(acquired), 0) FROM idem.activity WHERE source = 'c')`).Scan(&dups, &acquired); err != nil {
		t.Fatal(err)
	}
	t.Logf("after prune, the coordinator counts %d duplicates (the workers had %d) and %d acquisitions", dups, onWorkers, acquired)
	if onWorkers == 0 || dups != onWorkers || acquired != int64(len(ks)) {
		t.Errorf("collected %d duplicates of the workers' %d, %d acquisitions of %d", dups, onWorkers, acquired, len(ks))
	}
}

// TestCitusMonthBoundary: the database's clock (idem.clock(), replaced on
// every node) crosses into the next month while 16 clients race over the
// same 1,000 keys: each key runs once and has one row, in one month, and
// the keys are in both months.
func TestCitusMonthBoundary(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	now := time.Now().UTC()
	next := time.Date(now.Year(), now.Month()+1, 1, 0, 0, 0, 0, time.UTC)
	// 300 ms before the next month starts, from now on: the first claims
	// of the 1,000 keys take longer than that, so they fall on both sides,
	// and so do their duplicates.
	offset := next.Add(-300 * time.Millisecond).Sub(now)
	if _, err := pool.Exec(ctx, fmt.Sprintf(`CREATE OR REPLACE FUNCTION idem.clock() RETURNS timestamptz
		LANGUAGE sql VOLATILE PARALLEL SAFE
		AS $$ SELECT pg_catalog.clock_timestamp() + interval '%d milliseconds' $$`, offset.Milliseconds())); err != nil {
		t.Fatal(err)
	}
	ks := keys("m", 1000)
	stop := make(chan struct{})
	time.AfterFunc(4*time.Second, func() { close(stop) })
	runs := race(t, pool, ks, 16, stop)
	once(t, pool, ks, runs)
	var months int
	if err := pool.QueryRow(ctx, `SELECT count(DISTINCT first_seen_month) FROM idem.processed_events WHERE source = 'c'`).Scan(&months); err != nil {
		t.Fatal(err)
	}
	if months != 2 {
		t.Errorf("the keys are in %d months, want 2 (the race did not cross the boundary)", months)
	}
}

// TestCitusMaintenance: prune and rotation run again and again during a
// race: expired rows go, every live key stays and runs once, rotation
// creates the months ahead.
func TestCitusMaintenance(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	// 2,000 expired rows in this month, across every shard.
	if _, err := pool.Exec(ctx, `INSERT INTO idem.processed_events
		(source, key, first_seen_month, status, attempts, token, first_seen, updated_at, expires_at, completed_at)
		SELECT 'c', 'old' || g, idem.utc_month(now()), 'completed', 1, g, now() - interval '2 days', now() - interval '2 days',
		       now() - interval '1 day', now() - interval '2 days'
		  FROM generate_series(1, 2000) g`); err != nil {
		t.Fatal(err)
	}
	ks := keys("p", 300)
	stop := make(chan struct{})
	var pruned atomic.Int64
	var rotations atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		batch, sleep := 100, 10*time.Millisecond
		for {
			select {
			case <-stop:
				return
			default:
			}
			res, err := prune.Run(ctx, pool, prune.Config{BatchSize: &batch, Sleep: &sleep})
			if err != nil {
				t.Error("prune:", err)
				return
			}
			pruned.Add(res.Deleted)
			if res.Deleted > 0 {
				t.Logf("prune: %d rows in %d batches in %v", res.Deleted, res.Batches, res.Elapsed)
			}
			premake := 4
			if _, err := partition.Rotate(ctx, pool, partition.Config{Premake: &premake}); err != nil {
				t.Error("rotate:", err)
				return
			}
			rotations.Add(1)
		}
	}()
	time.AfterFunc(6*time.Second, func() { close(stop) })
	runs := race(t, pool, ks, 12, stop)
	wg.Wait()
	once(t, pool, ks, runs)
	t.Logf("pruned %d rows in %d rounds of prune and rotation", pruned.Load(), rotations.Load())
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE key LIKE 'old%'`).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 || pruned.Load() != 2000 {
		t.Errorf("%d expired rows left, %d pruned; want 0 and 2000", left, pruned.Load())
	}
	parts, err := partition.List(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	var distributed int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_dist_partition WHERE logicalrelid::text LIKE 'idem.processed_events_p%'`).Scan(&distributed); err != nil {
		t.Fatal(err)
	}
	if distributed < 5 || distributed != len(parts)-1 { // parts has the default partition too
		t.Errorf("%d months distributed, %d partitions listed; want current + 4 ahead, all distributed", distributed, len(parts))
	}
}

// TestCitusEveryAcquisition: each way a claim acquires a key works on
// Citus (claim version 13): a retry after a retryable failure through Do
// (its work runs again, once), the take-over of a lost lease, a key whose
// expired row is in the current month (version 11 failed on the last two
// and on the retry); idem.release is refused there (ID006), writing
// nothing.
func TestCitusEveryAcquisition(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	claim := func(key string) (outcome string, attempt int) {
		t.Helper()
		if err := pool.QueryRow(ctx, `SELECT outcome, coalesce(attempt, 0) FROM idem.claim('c', $1)`, key).Scan(&outcome, &attempt); err != nil {
			t.Fatalf("claim %s: %v", key, err)
		}
		return outcome, attempt
	}
	exec := func(q string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, q, args...); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}

	t.Run("retry after a retryable failure, through Do", func(t *testing.T) {
		runs := 0
		work := func(context.Context) (any, error) {
			runs++
			if runs == 1 {
				return nil, errors.New("transient")
			}
			return "done", nil
		}
		if _, err := c.Do(ctx, "c", "retry", work); err == nil {
			t.Fatal("the failing first run returned no error")
		}
		r, err := c.Do(ctx, "c", "retry", work)
		if err != nil || r.Replayed || string(r.Result) != `"done"` || runs != 2 {
			t.Fatalf("the retry: %+v %v after %d runs", r, err, runs)
		}
		if r, err := c.Do(ctx, "c", "retry", work); err != nil || !r.Replayed || runs != 2 {
			t.Fatalf("a duplicate after the retry: %+v %v after %d runs", r, err, runs)
		}
	})
	t.Run("lost lease", func(t *testing.T) {
		claim("lease")
		exec(`UPDATE idem.processed_events SET lease_expires_at = now() - interval '1 second' WHERE source = 'c' AND key = 'lease'`)
		if o, a := claim("lease"); o != "acquired" || a != 2 {
			t.Fatalf("the take-over of a lost lease: %s, attempt %d", o, a)
		}
	})
	t.Run("expired row in the current month", func(t *testing.T) {
		claim("expired")
		exec(`UPDATE idem.processed_events SET status = 'completed', lease_expires_at = NULL, expires_at = now() - interval '1 hour' WHERE source = 'c' AND key = 'expired'`)
		if o, a := claim("expired"); o != "acquired" || a != 1 {
			t.Fatalf("a key whose row expired: %s, attempt %d", o, a)
		}
	})
	t.Run("release refused", func(t *testing.T) {
		exec(`UPDATE idem.processed_events SET status = 'completed', lease_expires_at = NULL WHERE source = 'c' AND key = 'expired'`)
		_, err := pool.Exec(ctx, `SELECT idem.release('c', 'expired')`)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "ID006" {
			t.Fatalf("idem.release on Citus: %v, want SQLSTATE ID006", err)
		}
		var rows int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE source = 'c' AND key = 'expired'`).Scan(&rows); err != nil || rows != 1 {
			t.Fatalf("after the refused release: %d rows (%v), want 1", rows, err)
		}
	})
}

// TestCitusUpgradeKeepsDelegation: a migration that replaces claim on a
// distributed installation (13) delegates it again in its own transaction,
// so right after goose applied it, with no migrate.Citus run, a claim is
// delegated and an undelegated one is still refused (ID005).
func TestCitusUpgradeKeepsDelegation(t *testing.T) {
	pool := setup(t) // fully migrated and distributed; go back to 12
	ctx := context.Background()
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	p, err := migrate.NewProvider(db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.DownTo(ctx, 12); err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, 13); err != nil { // goose alone: no migrate.Citus after it
		t.Fatal(err)
	}
	var cfg []string
	if err := pool.QueryRow(ctx, `SELECT proconfig FROM pg_proc WHERE oid = 'idem.claim(text, text, text, interval, interval, text, interval)'::regprocedure`).Scan(&cfg); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(cfg, "idem.citus=on") {
		t.Fatalf("claim's settings after migration 13 on Citus: %v, want idem.citus=on", cfg)
	}
	var outcome string
	if err := pool.QueryRow(ctx, `SELECT outcome FROM idem.claim('c', 'after-13')`).Scan(&outcome); err != nil || outcome != "acquired" {
		t.Fatalf("a claim after migration 13: %q %v", outcome, err)
	}
	_, err = pool.Exec(ctx, `SELECT (idem.claim('c', v.k)).outcome FROM (VALUES ('undelegated-13')) v(k)`)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != sqlstate.NotDelegated {
		t.Fatalf("an undelegated claim after migration 13: %v, want SQLSTATE %s", err, sqlstate.NotDelegated)
	}
}
