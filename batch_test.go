package idem_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

func batchItems(keys ...string) []idem.BatchItem {
	items := make([]idem.BatchItem, len(keys))
	for i, k := range keys {
		items[i] = idem.BatchItem{Key: k}
	}
	return items
}

// TestClaimBatchLifecycle: new keys are acquired each with its own token, a
// key repeated in the batch answers as a duplicate of its first, and after
// CompleteBatch the batch answers each key Completed with its result.
func TestClaimBatchLifecycle(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, c := setup(t)

	cls, err := c.ClaimBatch(ctx, "q", batchItems("a", "b", "a", "c"))
	if err != nil {
		t.Fatal(err)
	}
	tokens := map[int64]bool{}
	for i, want := range []idem.Outcome{idem.Acquired, idem.Acquired, idem.InProgress, idem.Acquired} {
		if cls[i].Outcome != want || cls[i].Key != []string{"a", "b", "a", "c"}[i] {
			t.Fatalf("item %d: %+v, want %s", i, cls[i], want)
		}
		if want == idem.Acquired {
			if cls[i].Token == 0 || tokens[cls[i].Token] {
				t.Fatalf("item %d: token %d not its own", i, cls[i].Token)
			}
			tokens[cls[i].Token] = true
		}
	}
	errs, err := c.CompleteBatch(ctx, "q", []idem.Completion{
		{Key: "a", Token: cls[0].Token, Result: json.RawMessage(`{"n":1}`)},
		{Key: "b", Token: cls[1].Token},
		{Key: "c", Token: cls[0].Token, Result: json.RawMessage(`1`)},
	})
	if err != nil {
		t.Fatal(err)
	}
	if errs[0] != nil || errs[1] != nil || !errors.Is(errs[2], idem.ErrStaleToken) {
		t.Fatalf("complete: %v", errs)
	}
	again, err := c.ClaimBatch(ctx, "q", batchItems("c", "b", "a"))
	if err != nil {
		t.Fatal(err)
	}
	if again[0].Outcome != idem.InProgress || again[1].Outcome != idem.Completed || again[2].Outcome != idem.Completed ||
		string(again[2].Result) != `{"n": 1}` {
		t.Fatalf("again: %+v %+v %+v", again[0], again[1], again[2])
	}
}

// TestDoBatch: the work runs once over the acquired items; a per-item error
// releases only its item, which the next batch runs again; the others are
// replayed.
func TestDoBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, c := setup(t)
	runs := 0
	work := func(ctx context.Context, acquired []*idem.Claim) ([]idem.WorkResult, error) {
		runs++
		out := make([]idem.WorkResult, len(acquired))
		for j, cl := range acquired {
			if cl.Key == "bad" && runs == 1 {
				out[j].Err = errors.New("boom")
				continue
			}
			out[j].Value = map[string]string{"k": cl.Key}
		}
		return out, nil
	}
	res, err := c.DoBatch(ctx, "q", batchItems("x", "bad", "y"), work)
	if err != nil {
		t.Fatal(err)
	}
	if res[0].Err != nil || res[2].Err != nil || res[1].Err == nil || res[0].Replayed || string(res[0].Result.Result) != `{"k": "x"}` {
		t.Fatalf("first: %+v", res)
	}
	res, err = c.DoBatch(ctx, "q", batchItems("x", "bad", "y"), work)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range res {
		if r.Err != nil || r.Replayed != (i != 1) {
			t.Fatalf("second, item %d: %+v", i, r)
		}
	}
	if runs != 2 {
		t.Fatalf("work ran %d times", runs)
	}
}

// TestClaimBatchRefusals: what is refused, for the whole batch, with which
// error: over MaxBatch in Go (ErrBatchTooLarge) and in SQL (SQLSTATE
// ID009, converted to it), an empty batch, a NUL byte or invalid UTF-8 in
// a key or fingerprint (caught before the server, naming the item), a
// blank or oversized key (the server's check, naming the item), WithWait,
// REPEATABLE READ (ErrIsolationNotSupported). Nothing is claimed.
func TestClaimBatchRefusals(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, c := setup(t)
	many := make([]idem.BatchItem, idem.MaxBatch+1)
	for i := range many {
		many[i].Key = fmt.Sprint("k", i)
	}
	if _, err := c.ClaimBatch(ctx, "q", many); !errors.Is(err, idem.ErrBatchTooLarge) {
		t.Fatalf("%d items: %v", len(many), err)
	}
	if _, err := c.ClaimBatch(ctx, "q", many[:idem.MaxBatch]); err != nil {
		t.Fatalf("MaxBatch items: %v", err)
	}
	_, err := pool.Exec(ctx, `SELECT * FROM idem.claim_batch('q', (SELECT array_agg('s' || g) FROM generate_series(1, 1001) g))`)
	var e *idem.Error
	if !errors.As(idem.ConvertForTest("claim", "q", "", err), &e) || !errors.Is(e, idem.ErrBatchTooLarge) || e.SQLState() != "ID009" {
		t.Fatalf("1001 keys in SQL: %v", err)
	}
	for _, bad := range []struct {
		name  string
		items []idem.BatchItem
		want  error
		item  string
	}{
		{"empty", nil, idem.ErrInvalidInput, ""},
		{"NUL in a key", batchItems("ok", "a\x00b"), idem.ErrInvalidInput, "item 1"},
		{"bad UTF-8 in a key", batchItems("ok", "ok2", "\xff\xfe"), idem.ErrInvalidInput, "item 2"},
		{"NUL in a fingerprint", []idem.BatchItem{{Key: "ok"}, {Key: "x", Fingerprint: "f\x00"}}, idem.ErrInvalidInput, "item 1"},
		{"blank key", batchItems("ok", " \t"), idem.ErrInvalidInput, "item 2"}, // the server's, counted from 1
		{"key over 512 bytes", batchItems(strings.Repeat("k", 513)), idem.ErrInvalidInput, "item 1"},
	} {
		_, err := c.ClaimBatch(ctx, "q", bad.items)
		if !errors.Is(err, bad.want) || !strings.Contains(err.Error(), bad.item) {
			t.Errorf("%s: %v, want %v naming %q", bad.name, err, bad.want, bad.item)
		}
	}
	if _, err := c.ClaimBatch(ctx, "q", batchItems("w"), idem.WithWait(time.Second)); !errors.Is(err, idem.ErrInvalidInput) {
		t.Errorf("WithWait: %v", err)
	}
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := c.WithTx(tx).ClaimBatch(ctx, "q", batchItems("rr")); !errors.Is(err, idem.ErrIsolationNotSupported) {
		t.Errorf("REPEATABLE READ: %v", err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE key IN ('ok', 'ok2', 'x', 'w', 'rr')`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d keys claimed by refused batches (%v)", n, err)
	}
}

// TestClaimBatchStorm: batches of overlapping keys, each a random subset in
// random order with some keys twice, race from many connections, in
// autocommit and inside transactions, half of them with their clock a
// millisecond either side of a month boundary; once with READ COMMITTED
// transactions, once with SERIALIZABLE ones among them (retried on a
// serialization failure). Every key is acquired exactly once, and no batch
// meets a deadlock or a lock-table error. (A SERIALIZABLE claim whose
// snapshot predates another claim's commit in the other month's partition
// would not see that row: the batch meets it through a placeholder insert
// in each other month of its window, a serialization failure. Without that
// guard the serializable run acquires some keys twice.)
func TestClaimBatchStorm(t *testing.T) {
	t.Parallel()
	t.Run("read committed", func(t *testing.T) { batchStorm(t, pgx.ReadCommitted) })
	t.Run("serializable", func(t *testing.T) { batchStorm(t, pgx.Serializable) })
}

func batchStorm(t *testing.T, iso pgx.TxIsoLevel) {
	ctx := context.Background()
	url := testdb.New(t)
	boundary := testdb.MonthStart(time.Now(), 0)
	admin := testdb.Pool(t, url, 2)
	if _, err := admin.Exec(ctx, `SELECT idem.create_partition($1)`, boundary.AddDate(0, -1, 0)); err != nil {
		t.Fatal(err)
	}
	const (
		keys    = 600
		workers = 16
		batches = 30 // per worker
		size    = 60
	)
	pools := []*pgxpool.Pool{
		testdb.PoolAt(t, url, workers/2, boundary.Add(-time.Millisecond)),
		testdb.PoolAt(t, url, workers/2, boundary.Add(time.Millisecond)),
	}
	var acquired tally
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pool := pools[w%2]
			c, err := idem.New(pool, &idem.Config{LockWait: 30 * time.Second})
			if err != nil {
				errs <- err
				return
			}
			r := rand.New(rand.NewPCG(uint64(w), 1))
			for b := range batches {
				items := make([]idem.BatchItem, size)
				for i := range items {
					items[i].Key = fmt.Sprintf("k%04d", r.IntN(keys))
				}
				var cls []*idem.Claim
				switch b % 3 {
				case 0:
					cls, err = c.ClaimBatch(ctx, "storm", items)
				default:
					iso := map[int]pgx.TxIsoLevel{1: pgx.ReadCommitted, 2: iso}[b%3]
					for {
						err = pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: iso}, func(tx pgx.Tx) (err error) {
							cls, err = c.WithTx(tx).ClaimBatch(ctx, "storm", items)
							return err
						})
						if !errors.Is(err, idem.ErrSerialization) && !isSerialization(err) {
							break
						}
					}
				}
				if err != nil {
					errs <- fmt.Errorf("worker %d batch %d: %w", w, b, err)
					return
				}
				for _, cl := range cls {
					if cl.Outcome == idem.Acquired {
						acquired.add(cl.Key)
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	var rows int
	if err := admin.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE source = 'storm'`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	acquired.requireOnceEach(t, rows)
	if rows < keys/2 {
		t.Fatalf("only %d keys claimed", rows)
	}
}

// TestDoBatchLostLease: an item whose lease lapses while the batch's work
// runs, and which another worker acquires meanwhile, is not completed: its
// result is ErrLeaseLost; the other items are completed. The work waits
// for the takeover (a condition, not a duration).
func TestDoBatchLostLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 4)
	c := testdb.Client(t, pool, &idem.Config{HeartbeatFraction: -1})
	other := testdb.Client(t, pool, nil)
	res, err := c.DoBatch(ctx, "q", batchItems("keep", "lose"), func(ctx context.Context, acquired []*idem.Claim) ([]idem.WorkResult, error) {
		for {
			cl, err := other.Claim(ctx, "q", "lose")
			if err != nil {
				return nil, err
			}
			if cl.Outcome == idem.Acquired {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		return []idem.WorkResult{{Value: 1}, {Value: 2}}, nil
	}, idem.WithLease(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if res[0].Err != nil || string(res[0].Result.Result) != "1" {
		t.Fatalf("kept: %+v", res[0])
	}
	if !errors.Is(res[1].Err, idem.ErrLeaseLost) {
		t.Fatalf("lost: %+v", res[1])
	}
}

// TestDoBatchInCallersTransaction: over database/sql and pgx, inside the
// caller's transaction, the claims, the work's writes and the records
// commit together; rolled back, nothing is left and the next batch runs
// the work again. A permanent per-item error fails only its item; a
// panic fails every acquired item (released for a retry).
func TestDoBatchInCallersTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 4)
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { db.Close() })
	if _, err := pool.Exec(ctx, `CREATE TABLE public.effects (key text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	sc := testdb.SQLClient(t, db, nil)
	pc := testdb.Client(t, pool, nil)
	work := func(exec func(string, ...any) error) idem.BatchWork {
		return func(ctx context.Context, acquired []*idem.Claim) ([]idem.WorkResult, error) {
			out := make([]idem.WorkResult, len(acquired))
			for j, cl := range acquired {
				if strings.HasPrefix(cl.Key, "perm") {
					out[j].Err = idem.Permanent(errors.New("bad message"))
					continue
				}
				if err := exec(`INSERT INTO public.effects VALUES ($1)`, cl.Key); err != nil {
					return nil, err
				}
				out[j].Value = cl.Key
			}
			return out, nil
		}
	}
	for _, via := range []string{"database/sql", "pgx"} {
		p := via[:3]
		items := batchItems(p+"a", "perm"+p, p+"b")
		run := func(commit bool) []idem.BatchResult {
			t.Helper()
			var res []idem.BatchResult
			var err error
			if via == "pgx" {
				tx, _ := pool.Begin(ctx)
				res, err = pc.WithTx(tx).DoBatch(ctx, "q", items, work(func(q string, a ...any) error { _, err := tx.Exec(ctx, q, a...); return err }))
				if commit {
					_ = tx.Commit(ctx)
				} else {
					_ = tx.Rollback(ctx)
				}
			} else {
				tx, _ := db.BeginTx(ctx, nil)
				res, err = sc.WithSQLTx(tx).DoBatch(ctx, "q", items, work(func(q string, a ...any) error { _, err := tx.ExecContext(ctx, q, a...); return err }))
				if commit {
					_ = tx.Commit()
				} else {
					_ = tx.Rollback()
				}
			}
			if err != nil {
				t.Fatalf("%s: %v", via, err)
			}
			return res
		}
		run(false)
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE key LIKE '%'||$1||'%'`, p).Scan(&n); err != nil || n != 0 {
			t.Fatalf("%s: %d rows after a rollback (%v)", via, n, err)
		}
		res := run(true)
		if res[0].Err != nil || res[2].Err != nil || !idem.IsPermanent(res[1].Err) || res[0].Replayed {
			t.Fatalf("%s first: %+v", via, res)
		}
		res = run(true)
		if !res[0].Replayed || !res[2].Replayed || string(res[2].Result.Result) != `"`+p+`b"` || !errors.Is(res[1].Err, idem.ErrFailed) {
			t.Fatalf("%s again: %+v", via, res)
		}
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM public.effects WHERE key LIKE $1||'%'`, p).Scan(&n); err != nil || n != 2 {
			t.Fatalf("%s: %d effects, want 2 (%v)", via, n, err)
		}
	}
	// A panic: every acquired item released, retried by the next batch.
	res, err := pc.DoBatch(ctx, "q", batchItems("p1", "p2"), func(context.Context, []*idem.Claim) ([]idem.WorkResult, error) { panic("boom") })
	var pe *idem.PanicError
	if err != nil || !errors.As(res[0].Err, &pe) || !errors.As(res[1].Err, &pe) {
		t.Fatalf("panic: %+v %v", res, err)
	}
	res, err = pc.DoBatch(ctx, "q", batchItems("p1", "p2"), func(_ context.Context, a []*idem.Claim) ([]idem.WorkResult, error) {
		return make([]idem.WorkResult, len(a)), nil
	})
	if err != nil || res[0].Err != nil || res[0].Claim.Attempt != 2 {
		t.Fatalf("after the panic: %+v %v", res, err)
	}
}

type batchObserver struct {
	mu  sync.Mutex
	obs []idem.ClaimObservation
}

func (o *batchObserver) ObserveClaim(x idem.ClaimObservation) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.obs = append(o.obs, x)
}

// TestClaimBatchCacheAndObserver: with Config.Cache, a batch answers the
// completed keys the cache holds without the database (only the others
// are claimed, and counted), fills the cache with what it read, and the
// observer is told each item, with its batch's size.
func TestClaimBatchCacheAndObserver(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 8)
	countEvery(t, pool, "c")
	obs := &batchObserver{}
	c, err := idem.New(pool, &idem.Config{Observer: obs, Cache: &idem.CacheConfig{Size: 100, MaxAge: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	warmCache(t, c, pool, "c", "warm", "")
	work := func(_ context.Context, a []*idem.Claim) ([]idem.WorkResult, error) {
		out := make([]idem.WorkResult, len(a))
		for j := range out {
			out[j].Value = j
		}
		return out, nil
	}
	if _, err := c.DoBatch(ctx, "c", batchItems("a", "b"), work); err != nil {
		t.Fatal(err)
	}
	// A batch of duplicates answered by the database fills the cache; the
	// next is answered by it (tried until the listener is heard from: on a
	// loaded machine its self-test can time out, and then the client polls
	// for a minute before it listens again: two such minutes fit).
	for deadline := time.Now().Add(150 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the cache never answered a batch")
		}
		if _, err := c.ClaimBatch(ctx, "c", batchItems("a", "b")); err != nil {
			t.Fatal(err)
		}
		before := counted(t, pool, "c")
		cls, err := c.ClaimBatch(ctx, "c", batchItems("a", "new", "b"))
		if err != nil {
			t.Fatal(err)
		}
		if cls[0].Outcome != idem.Completed || cls[2].Outcome != idem.Completed || string(cls[2].Result) != "1" {
			t.Fatalf("%+v %+v", cls[0], cls[2])
		}
		if counted(t, pool, "c") == before {
			break // a and b from the cache; new (acquired the first time) from the database
		}
	}
	obs.mu.Lock()
	defer obs.mu.Unlock()
	last := obs.obs[len(obs.obs)-3:]
	for i, o := range last {
		if o.Batch != 3 || o.Source != "c" || o.Err != nil || o.Outcome != []idem.Outcome{idem.Completed, idem.InProgress, idem.Completed}[i] &&
			!(i == 1 && o.Outcome == idem.Acquired) {
			t.Fatalf("observation %d: %+v", i, o)
		}
	}
}

// TestClaimBatchLeastPrivilege: the application role (idem.grant_app) runs
// every batch call, with look-alike operators and functions planted in
// public by itself, and none of them runs inside idem's functions; it
// cannot call the batch's internal helper nor write idem's tables. With
// look-alikes of the exact signatures the SERIALIZABLE placeholders
// (pg_control_checkpoint(), pg_current_snapshot(), migration 32) and the
// uncounted mark (now(), current_setting, set_config, migration 31) call
// added, SERIALIZABLE claims and batches and a waiting duplicate run none
// of them as idem's owner.
func TestClaimBatchLeastPrivilege(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 2)
	role := fmt.Sprintf("batch_app_%d", time.Now().UnixNano()%1e9)
	if _, err := admin.Exec(ctx, `CREATE ROLE `+role+` NOLOGIN; SELECT idem.grant_app('`+role+`')`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role)
	})
	plant := testdb.PlantLookalikes(t, url, role)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = "public, pg_catalog"
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, "SET ROLE "+role)
		return err
	}
	app, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(app.Close)
	c := testdb.Client(t, app, nil)
	res, err := c.DoBatch(ctx, "s", []idem.BatchItem{{Key: "a", Fingerprint: "f"}, {Key: "b"}, {Key: "a"}}, func(_ context.Context, a []*idem.Claim) ([]idem.WorkResult, error) {
		return []idem.WorkResult{{Value: "A"}, {Err: errors.New("retry b")}}, nil
	})
	if err != nil || res[0].Err != nil || res[1].Err == nil || !errors.Is(res[2].Err, idem.ErrInProgress) {
		t.Fatalf("as the app role: %+v %v", res, err)
	}
	if cls, err := c.ClaimBatch(ctx, "s", []idem.BatchItem{{Key: "a", Fingerprint: "g"}, {Key: "b"}}); err != nil ||
		cls[0].Outcome != idem.Mismatch || cls[1].Outcome != idem.Acquired {
		t.Fatalf("again: %+v %v", cls, err)
	}
	// Redelivered batches of a busy source (above the exact-counting rate):
	// their duplicates weighed as one claim's (idem.claim_weight, then
	// idem.count_duplicate one time in 8), with the look-alikes planted.
	// (The superuser's own statement runs with pg_catalog first, or the
	// look-alikes planted in public would fire as it.)
	if err := pgx.BeginFunc(ctx, admin, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `SET LOCAL search_path = pg_catalog, pg_temp;
			INSERT INTO idem.activity (minute, source, slot, acquired, duplicates)
			SELECT idem.activity_minute(now() + m * interval '1 minute'), 's', 0, 100000, 0 FROM generate_series(0, 1) m`)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 24; i++ {
		if cls, err := c.ClaimBatch(ctx, "s", []idem.BatchItem{{Key: "a", Fingerprint: "f"}, {Key: "a", Fingerprint: "f"}}); err != nil ||
			cls[0].Outcome != idem.Completed || cls[1].Outcome != idem.Completed {
			t.Fatalf("redelivered, %d: %+v %v", i, cls, err)
		}
	}
	// SERIALIZABLE (migration 32: idem.serializable_floor reads
	// pg_control_checkpoint() and the snapshot's xmin) and a waiting
	// duplicate (migration 31's mark), with look-alikes of the exact
	// signatures those paths call planted too: a claim of a new key with a
	// 400-day ttl, a batch, and WithWait on a key in progress.
	if _, err := app.Exec(ctx, exactLookalikes); err != nil {
		t.Fatal(err)
	}
	// They are what the app's own unqualified calls now reach.
	if _, err := app.Exec(ctx, `SELECT now(), pg_control_checkpoint(), 'a' = 'b'`); err != nil {
		t.Fatal(err)
	}
	if f := strings.Join(plant.Fired(t), "; "); !strings.Contains(f, "now() as "+role) || !strings.Contains(f, "pg_control_checkpoint() as "+role) ||
		!strings.Contains(f, "text = text as "+role) {
		t.Fatalf("the exact look-alikes are not on the app's path: %s", f)
	}
	for _, key := range []string{"ser-1", "ser-2"} {
		if err := pgx.BeginTxFunc(ctx, app, pgx.TxOptions{IsoLevel: pgx.Serializable}, func(tx pgx.Tx) error {
			cl, err := c.WithTx(tx).Claim(ctx, "s", key, idem.WithTTL(400*24*time.Hour))
			if err == nil && cl.Outcome != idem.Acquired {
				err = fmt.Errorf("SERIALIZABLE claim of %s: %s", key, cl.Outcome)
			}
			if err != nil {
				return err
			}
			cls, err := c.WithTx(tx).ClaimBatch(ctx, "s", []idem.BatchItem{{Key: key + "-b1"}, {Key: key}})
			if err == nil && (cls[0].Outcome != idem.Acquired || cls[1].Outcome != idem.InProgress) {
				err = fmt.Errorf("SERIALIZABLE batch: %s %s", cls[0].Outcome, cls[1].Outcome)
			}
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	held, err := c.Claim(ctx, "s", "waited")
	if err != nil || held.Outcome != idem.Acquired {
		t.Fatalf("%+v %v", held, err)
	}
	go func() {
		time.Sleep(200 * time.Millisecond)
		_ = c.Complete(context.Background(), "s", "waited", held.Token, json.RawMessage(`1`))
	}()
	if w, err := c.Claim(ctx, "s", "waited", idem.WithWait(time.Minute)); err != nil || w.Outcome != idem.Completed {
		t.Fatalf("a waiting duplicate: %+v %v", w, err)
	}
	// The app's own statements may run its own look-alikes (as itself:
	// no privilege gained); none may run as anyone else, as idem's
	// functions, which run as idem's owner, would run them.
	for _, f := range plant.Fired(t) {
		if !strings.HasSuffix(f, " as "+role) {
			t.Errorf("a look-alike ran as another role: %s", f)
		}
	}
	for _, sql := range []string{
		`SELECT idem.check_batch('x', 's', 1, ARRAY['k'])`,
		`INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, first_seen, updated_at, expires_at) VALUES ('s', 'z', now(), 'completed', 1, now(), now(), now())`,
		`UPDATE idem.processed_events SET status = 'completed'`,
	} {
		var pg *pgconn.PgError
		if _, err := app.Exec(ctx, sql); !errors.As(err, &pg) || pg.Code != "42501" {
			t.Errorf("app role: %s: %v, want permission denied", sql, err)
		}
	}
}

// TestClaimBatchBusyKey: a key whose claim is inside another open
// transaction is answered as idem.claim answers it: InProgress once the
// batch's lock wait has passed (0 here), or, when that transaction commits
// its completion within the wait, Completed with its result; the other
// keys of the batch are acquired either way; and so in a redelivered batch
// (its first key completed), whose completed keys answer without a lock.
func TestClaimBatchBusyKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, c := setup(t)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	held, err := c.WithTx(tx).Claim(ctx, "q", "busy")
	if err != nil || held.Outcome != idem.Acquired {
		t.Fatalf("%+v %v", held, err)
	}
	cls, err := c.ClaimBatch(ctx, "q", batchItems("a1", "busy", "a2"), idem.WithLockWait(0))
	if err != nil {
		t.Fatal(err)
	}
	if cls[0].Outcome != idem.Acquired || cls[1].Outcome != idem.InProgress || cls[2].Outcome != idem.Acquired {
		t.Fatalf("no wait: %+v %+v %+v", cls[0], cls[1], cls[2])
	}
	done := make(chan []*idem.Claim, 1)
	go func() {
		cls, err := c.ClaimBatch(ctx, "q", batchItems("b1", "busy", "b2"), idem.WithLockWait(time.Minute))
		if err != nil {
			t.Error(err)
		}
		done <- cls
	}()
	// The batch waits for the key's lock (seen in pg_locks), then the
	// holder completes and commits.
	for {
		var waiting bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE query LIKE '%claim_batch%' AND wait_event = 'PgSleep' AND datname = current_database())`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := c.WithTx(tx).Complete(ctx, "q", "busy", held.Token, json.RawMessage(`"done"`)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	cls = <-done
	if cls[0].Outcome != idem.Acquired || cls[1].Outcome != idem.Completed || string(cls[1].Result) != `"done"` || cls[2].Outcome != idem.Acquired {
		t.Fatalf("waited: %+v %+v %+v", cls[0], cls[1], cls[2])
	}

	// A redelivery (its first key completed: read before any lock) that
	// meets a key inside another open transaction: the completed key
	// answers from its row, the busy one as above, the new one is acquired.
	tx2, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx2.Rollback(ctx)
	if cl, err := c.WithTx(tx2).Claim(ctx, "q", "busy2"); err != nil || cl.Outcome != idem.Acquired {
		t.Fatalf("%+v %v", cl, err)
	}
	cls, err = c.ClaimBatch(ctx, "q", batchItems("busy", "busy2", "c1", "busy"), idem.WithLockWait(0))
	if err != nil {
		t.Fatal(err)
	}
	if cls[0].Outcome != idem.Completed || string(cls[0].Result) != `"done"` || cls[1].Outcome != idem.InProgress ||
		cls[2].Outcome != idem.Acquired || cls[3].Outcome != idem.Completed {
		t.Fatalf("redelivery: %+v %+v %+v %+v", cls[0], cls[1], cls[2], cls[3])
	}
}

// TestDoBatchThroughPgBouncer: DoBatch through a real PgBouncer in
// transaction mode, over pgx's default pool configuration (the statement
// cache) and database/sql over pgx's stdlib driver with its defaults:
// concurrent batches of overlapping keys from 8 goroutines, each key's
// work runs once and is completed; the first prepared statement the pooler
// refuses is sent again in exec mode.
func TestDoBatchThroughPgBouncer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := setup(t)
	var dbname string
	if err := pool.QueryRow(ctx, `SELECT current_database()`).Scan(&dbname); err != nil {
		t.Fatal(err)
	}
	url := testdb.PgBouncer(t, dbname)
	bpool := testdb.Pool(t, url, 8)
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	db.SetMaxOpenConns(8)
	clients := []*idem.Client{testdb.Client(t, bpool, nil), testdb.SQLClient(t, db, nil)}
	var runs sync.Map
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := clients[w%2]
			for b := range 10 {
				items := make([]idem.BatchItem, 20)
				for i := range items {
					items[i].Key = fmt.Sprintf("k%03d", (w*7+b*13+i*3)%120)
				}
				res, err := c.DoBatch(ctx, "bouncer", items, func(_ context.Context, a []*idem.Claim) ([]idem.WorkResult, error) {
					out := make([]idem.WorkResult, len(a))
					for j, cl := range a {
						n, _ := runs.LoadOrStore(cl.Key, new(atomic.Int64))
						n.(*atomic.Int64).Add(1)
						out[j].Value = cl.Key
					}
					return out, nil
				})
				if err != nil {
					errs <- err
					return
				}
				for _, r := range res {
					if r.Err != nil && !errors.Is(r.Err, idem.ErrInProgress) {
						errs <- r.Err
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	runs.Range(func(k, v any) bool {
		if n := v.(*atomic.Int64).Load(); n != 1 {
			t.Errorf("key %v: the work ran %d times", k, n)
		}
		return true
	})
	var processing int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE source = 'bouncer' AND status <> 'completed'`).Scan(&processing); err != nil || processing != 0 {
		t.Fatalf("%d keys not completed (%v)", processing, err)
	}
}

// TestDoBatchHeartbeat: while a batch's work runs past its keys' lease, one
// goroutine extends every acquired key (the work returns once both keys'
// leases have moved past the first expiry, read from the table), so no
// duplicate takes them over and both complete.
func TestDoBatchHeartbeat(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, c := setup(t)
	var first time.Time
	res, err := c.DoBatch(ctx, "hb", batchItems("h1", "h2"), func(ctx context.Context, a []*idem.Claim) ([]idem.WorkResult, error) {
		first = a[0].LeaseExpiresAt
		for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
			var extended int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE source = 'hb' AND lease_expires_at > $1`, first).Scan(&extended); err != nil {
				return nil, err
			}
			if extended == 2 {
				break
			}
			if time.Now().After(deadline) {
				return nil, errors.New("the leases were never extended")
			}
		}
		if cl, err := c.Claim(ctx, "hb", "h2"); err != nil || cl.Outcome != idem.InProgress {
			return nil, fmt.Errorf("a duplicate during the work: %+v %v", cl, err)
		}
		return []idem.WorkResult{{Value: 1}, {Value: 2}}, nil
	}, idem.WithLease(time.Second))
	if err != nil || res[0].Err != nil || res[1].Err != nil {
		t.Fatalf("%+v %v", res, err)
	}
}

// TestClaimBatchLockOrder: a batch never holds a later key's lock (in the
// global order: by the lock's key, then position) while it waits for an
// earlier one. One key of a batch of new keys (and repeated keys) is held
// by another open transaction; while the batch waits for it, the locks the
// batch's backend holds (pg_locks) are exactly its keys before the busy
// one in that order. (Migration 29's short path takes every lock of a
// batch in one statement: a lock tried in the batch's own order, or
// after a busy one, shows here.) Then the holder commits, and every key is
// answered.
func TestClaimBatchLockOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, c := setup(t)
	keys := make([]string, 0, 41)
	for i := range 40 {
		keys = append(keys, fmt.Sprintf("order-%d", i))
	}
	keys = append(keys, "order-3", "order-30") // repeated keys
	// The busy key: the one in the middle of the lock order.
	var busy string
	if err := pool.QueryRow(ctx, `SELECT k FROM unnest($1::text[]) k ORDER BY hashtext('lo' || chr(31) || k), k OFFSET 20 LIMIT 1`, keys).Scan(&busy); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	held, err := c.WithTx(tx).Claim(ctx, "lo", busy)
	if err != nil || held.Outcome != idem.Acquired {
		t.Fatalf("%+v %v", held, err)
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	var pid int
	if err := conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	var outcomes []string
	go func() {
		rows, err := conn.Query(ctx, `SELECT outcome FROM idem.claim_batch('lo', $1, lock_wait => '1 minute') ORDER BY ord`, keys)
		if err == nil {
			outcomes, err = pgx.CollectRows(rows, pgx.RowTo[string])
		}
		done <- err
	}()
	for {
		var waiting bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event = 'PgSleep')`, pid).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The batch's advisory locks of idem's key class (pg_locks shows a
	// lock key as an oid), against the keys before the busy one.
	var got, want []string
	if err := pool.QueryRow(ctx, `
		WITH k AS (SELECT DISTINCT u.k, ((hashtext('lo' || chr(31) || u.k)::bigint + 4294967296) % 4294967296)::text AS lk,
		                  hashtext('lo' || chr(31) || u.k) AS h
		             FROM unnest($1::text[]) u(k))
		SELECT coalesce((SELECT array_agg(k.k ORDER BY k.k) FROM pg_locks l JOIN k ON l.objid::text = k.lk
		                  WHERE l.pid = $2 AND l.locktype = 'advisory' AND l.classid::bigint = 1768187245 AND l.granted), '{}'),
		       coalesce((SELECT array_agg(k.k ORDER BY k.k) FROM k, k b
		                  WHERE b.k = $3 AND (k.h, k.k) < (b.h, b.k)), '{}')`, keys, pid, busy).Scan(&got, &want); err != nil {
		t.Fatal(err)
	}
	if strings.Join(got, ",") != strings.Join(want, ",") || len(want) == 0 {
		t.Errorf("while waiting for %s the batch holds the locks of\n%v\nwant the keys before it in the lock order\n%v", busy, got, want)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	for i, o := range outcomes {
		want := "acquired"
		if i >= 40 {
			want = "in_progress" // a repeated key: a duplicate of its first position, acquired by this transaction
		}
		if keys[i] == busy {
			want = "in_progress" // the holder's lease
		}
		if o != want {
			t.Errorf("%s (item %d): %s, want %s", keys[i], i, o, want)
		}
	}
}

// exactLookalikes plants, in public, look-alikes of the exact signatures
// of the functions and operators the SERIALIZABLE and uncounted paths call
// (PlantLookalikes plants only those that beat pg_catalog's through a
// cast): with "public, pg_catalog" as the search_path, an unqualified call
// of any of them in a function running as idem's owner would run them.
const exactLookalikes = `
CREATE FUNCTION public.idem_fire(what text) RETURNS void LANGUAGE sql SET search_path = pg_catalog, pg_temp
    AS $$ INSERT INTO public.idem_fired (what, by_role) VALUES (what, current_user::text) $$;
CREATE FUNCTION public.pg_control_checkpoint(OUT checkpoint_lsn pg_lsn, OUT redo_lsn pg_lsn, OUT redo_wal_file text,
    OUT timeline_id integer, OUT prev_timeline_id integer, OUT full_page_writes boolean, OUT next_xid text, OUT next_oid oid,
    OUT next_multixact_id xid, OUT next_multi_offset xid, OUT oldest_xid xid, OUT oldest_xid_dbid oid,
    OUT oldest_active_xid xid, OUT oldest_multi_xid xid, OUT oldest_multi_dbid oid, OUT oldest_commit_ts_xid xid,
    OUT newest_commit_ts_xid xid, OUT checkpoint_time timestamp with time zone)
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    AS $$ BEGIN PERFORM public.idem_fire('pg_control_checkpoint()'); SELECT * INTO checkpoint_lsn, redo_lsn, redo_wal_file, timeline_id,
        prev_timeline_id, full_page_writes, next_xid, next_oid, next_multixact_id, next_multi_offset, oldest_xid, oldest_xid_dbid,
        oldest_active_xid, oldest_multi_xid, oldest_multi_dbid, oldest_commit_ts_xid, newest_commit_ts_xid, checkpoint_time
        FROM pg_catalog.pg_control_checkpoint(); END $$;
CREATE FUNCTION public.pg_current_snapshot() RETURNS pg_snapshot LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    AS $$ BEGIN PERFORM public.idem_fire('pg_current_snapshot()'); RETURN pg_catalog.pg_current_snapshot(); END $$;
CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    AS $$ BEGIN PERFORM public.idem_fire('now()'); RETURN pg_catalog.now(); END $$;
CREATE FUNCTION public.current_setting(text, boolean) RETURNS text LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    AS $$ BEGIN PERFORM public.idem_fire('current_setting(text, boolean)'); RETURN pg_catalog.current_setting($1, $2); END $$;
CREATE FUNCTION public.current_setting(text) RETURNS text LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    AS $$ BEGIN PERFORM public.idem_fire('current_setting(text)'); RETURN pg_catalog.current_setting($1); END $$;
CREATE FUNCTION public.set_config(text, text, boolean) RETURNS text LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    AS $$ BEGIN PERFORM public.idem_fire('set_config(text, text, boolean)'); RETURN pg_catalog.set_config($1, $2, $3); END $$;
CREATE FUNCTION public.md5(text) RETURNS text LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    AS $$ BEGIN PERFORM public.idem_fire('md5(text)'); RETURN pg_catalog.md5($1); END $$;
CREATE FUNCTION public.hashtext(text) RETURNS integer LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    AS $$ BEGIN PERFORM public.idem_fire('hashtext(text)'); RETURN pg_catalog.hashtext($1); END $$;
CREATE FUNCTION public.to_regclass(text) RETURNS regclass LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    AS $$ BEGIN PERFORM public.idem_fire('to_regclass(text)'); RETURN pg_catalog.to_regclass($1); END $$;
CREATE FUNCTION public.pg_try_advisory_xact_lock(integer, integer) RETURNS boolean LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    AS $$ BEGIN PERFORM public.idem_fire('pg_try_advisory_xact_lock(integer, integer)'); RETURN pg_catalog.pg_try_advisory_xact_lock($1, $2); END $$;
CREATE FUNCTION public.idem_texteq(text, text) RETURNS boolean LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    AS $$ BEGIN PERFORM public.idem_fire('text = text'); RETURN $1 OPERATOR(pg_catalog.=) $2; END $$;
CREATE OPERATOR public.= (LEFTARG = text, RIGHTARG = text, FUNCTION = public.idem_texteq);
CREATE FUNCTION public.idem_textcat(text, text) RETURNS text LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    AS $$ BEGIN PERFORM public.idem_fire('text || text'); RETURN $1 OPERATOR(pg_catalog.||) $2; END $$;
CREATE OPERATOR public.|| (LEFTARG = text, RIGHTARG = text, FUNCTION = public.idem_textcat);
`
