package idem_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// counted returns the duplicates the database counted for source (every
// one: the test's policy samples 1 in 1).
func counted(t *testing.T, pool *pgxpool.Pool, source string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT coalesce(sum(duplicates), 0) FROM idem.duplicate_counts WHERE source = $1`, source).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func countEvery(t *testing.T, pool *pgxpool.Pool, source string) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), `INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling) VALUES ($1, '30 days', '2 minutes', 1)`, source); err != nil {
		t.Fatal(err)
	}
}

// cachedClient returns a client with a cache whose listener is up.
func cachedClient(t *testing.T, pool *pgxpool.Pool) *idem.Client {
	t.Helper()
	c, err := idem.New(pool, &idem.Config{Cache: &idem.CacheConfig{Size: 100, MaxAge: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// warmCache returns once c's cache answers for (source, key), completed
// with fingerprint fp: until the listener has started and tested itself,
// claims go to the database; then one more fills the cache. source counts
// every duplicate (countEvery).
func warmCache(t *testing.T, c *idem.Client, pool *pgxpool.Pool, source, key, fp string) {
	t.Helper()
	ctx := context.Background()
	work := func(context.Context) (any, error) { return map[string]int{"n": 1}, nil }
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		before := counted(t, pool, source)
		if _, err := c.Do(ctx, source, key, work, idem.WithFingerprint(fp)); err != nil {
			t.Fatal(err)
		}
		if counted(t, pool, source) == before {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the cache never answered: %d counted", counted(t, pool, source))
		}
	}
}

// TestCacheInTx: a client from WithTx answers from its parent's cache and
// fills it, but only with what another transaction committed: a key
// completed earlier in the same transaction (which then rolls back) is
// never cached, so the genuine delivery runs afterwards. (Claims refuse
// REPEATABLE READ and SERIALIZABLE; the check also says READ COMMITTED.)
func TestCacheInTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 8)
	countEvery(t, pool, "warm")
	// "tx" counts no duplicate: a duplicate's claim writes nothing.
	if _, err := pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling) VALUES ('tx', '30 days', '2 minutes', 0)`); err != nil {
		t.Fatal(err)
	}
	c := cachedClient(t, pool)
	plain, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	warmCache(t, c, pool, "warm", "k", "")
	runs := map[string]int{}
	work := func(key string) func(context.Context) (any, error) {
		return func(context.Context) (any, error) { runs[key]++; return key, nil }
	}
	inTx := func(fn func(tx pgx.Tx) error) error { return pgx.BeginFunc(ctx, pool, fn) }
	rollback := errors.New("rollback")
	// deleteByHand removes a key's row without idem.release: nothing is
	// heard, so a cached answer is told apart from the database's.
	deleteByHand := func(key string) {
		t.Helper()
		if _, err := pool.Exec(ctx, `DELETE FROM idem.processed_events WHERE source = 'tx' AND key = $1`, key); err != nil {
			t.Fatal(err)
		}
	}

	t.Run("committed elsewhere is cached", func(t *testing.T) {
		// The cache answers only while its listener was heard from within
		// 1.5 s, which a loaded machine can miss now and then: a key whose
		// put or answer fell in such a moment is tried again with another,
		// a moment later, until a deadline well past the listener's
		// reconnection (ten attempts back to back once all fell inside one
		// such moment).
		deadline := time.Now().Add(20 * time.Second)
		for attempt := 0; time.Now().Before(deadline); attempt++ {
			if attempt > 0 {
				time.Sleep(200 * time.Millisecond)
			}
			key := fmt.Sprintf("a%d", attempt)
			if _, err := plain.Do(ctx, "tx", key, work(key)); err != nil {
				t.Fatal(err)
			}
			if err := inTx(func(tx pgx.Tx) error {
				res, err := c.WithTx(tx).Do(ctx, "tx", key, work(key))
				if err == nil && !res.Replayed {
					t.Errorf("not replayed: %+v", res)
				}
				return err
			}); err != nil {
				t.Fatal(err)
			}
			deleteByHand(key)
			answered := 0
			for _, pooled := range []bool{true, false} {
				err := inTx(func(tx pgx.Tx) error {
					cl := c
					if !pooled {
						cl = c.WithTx(tx)
					}
					res, err := cl.Do(ctx, "tx", key, work(key))
					if err == nil && res.Replayed {
						answered++
					}
					return err
				})
				if err != nil {
					t.Fatal(err)
				}
			}
			if answered == 2 && runs[key] == 1 {
				return
			}
			t.Logf("attempt %d: the cache answered %d of 2, the work ran %d times", attempt, answered, runs[key])
		}
		t.Fatal("a completion cached by a WithTx client was never answered from the cache")
	})

	t.Run("own completion rolled back is not cached", func(t *testing.T) {
		err := inTx(func(tx pgx.Tx) error {
			for range 2 {
				if _, err := c.WithTx(tx).Do(ctx, "tx", "b", work("b")); err != nil {
					return err
				}
			}
			return rollback
		})
		if !errors.Is(err, rollback) || runs["b"] != 1 {
			t.Fatalf("%v, %d runs", err, runs["b"])
		}
		res, err := c.Do(ctx, "tx", "b", work("b"))
		if err != nil || res.Replayed || runs["b"] != 2 {
			t.Fatalf("the genuine delivery after the rollback: %+v %v, %d runs", res, err, runs["b"])
		}
	})

}

// TestCache: completed outcomes are answered from the cache (not counted
// again by the database: no round trip) once the listener is up; a first
// delivery, a key in progress and another fingerprint go to the database
// (which answers Mismatch); the answers are the database's, byte for byte.
func TestCache(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 8)
	countEvery(t, pool, "c")
	c := cachedClient(t, pool)
	work := func(context.Context) (any, error) { return map[string]int{"n": 1}, nil }
	first, err := c.Do(ctx, "c", "k", work, idem.WithFingerprint("fp"))
	if err != nil {
		t.Fatal(err)
	}
	warmCache(t, c, pool, "c", "k", "fp")
	before := counted(t, pool, "c")
	for range 50 {
		res, err := c.Do(ctx, "c", "k", func(context.Context) (any, error) { t.Fatal("ran again"); return nil, nil }, idem.WithFingerprint("fp"))
		if err != nil || !res.Replayed || string(res.Result) != string(first.Result) {
			t.Fatalf("%+v %v", res, err)
		}
	}
	if after := counted(t, pool, "c"); after != before {
		t.Fatalf("%d of 50 duplicates went to the database, want 0", after-before)
	}
	// Another fingerprint: the database answers (Mismatch), not the cache.
	if _, err := c.Do(ctx, "c", "k", work, idem.WithFingerprint("other")); !errors.Is(err, idem.ErrMismatch) {
		t.Fatalf("another fingerprint: %v", err)
	}
	// A key in progress is never cached.
	_, _ = c.Claim(ctx, "c", "busy")
	for range 3 {
		if cl, err := c.Claim(ctx, "c", "busy"); err != nil || cl.Outcome != idem.InProgress {
			t.Fatalf("%+v %v", cl, err)
		}
	}
}

// TestCacheRefused: a cache only on a pool client, sizes in range.
func TestCacheRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	for _, cfg := range []idem.CacheConfig{{Size: -1}, {Size: 20_000_000}, {MaxAge: -time.Second}, {MaxAge: 6 * time.Minute}} {
		if err := (&idem.Config{Cache: &cfg}).Validate(); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("%+v: %v", cfg, err)
		}
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := idem.New(conn, &idem.Config{Cache: &idem.CacheConfig{}}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Errorf("a cache on a single connection: %v", err)
	}
}

// TestCacheBehindPgBouncer: LISTEN gets nothing through a transaction
// pooler, so the cache never answers: every duplicate is the database's.
func TestCacheBehindPgBouncer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct := testdb.Pool(t, testdb.New(t), 2)
	countEvery(t, direct, "b")
	var db string
	_ = direct.QueryRow(ctx, `SELECT current_database()`).Scan(&db)
	pool := testdb.Pool(t, testdb.PgBouncer(t, db), 4)
	c := cachedClient(t, pool)
	if _, err := c.Do(ctx, "b", "k", func(context.Context) (any, error) { return 1, nil }); err != nil {
		t.Fatal(err)
	}
	sent := 0
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if _, err := c.Do(ctx, "b", "k", func(context.Context) (any, error) { return 1, nil }); err != nil {
			t.Fatal(err)
		}
		sent++
	}
	var claims int
	if err := direct.QueryRow(ctx, `SELECT coalesce(sum(duplicates), 0) FROM idem.duplicate_counts WHERE source = 'b'`).Scan(&claims); err != nil || claims != sent {
		t.Fatalf("%d duplicates reached the database, want every one of the %d sent (%v)", claims, sent, err)
	}
}

const cacheChildEnv = "IDEM_CACHE_CHILD"

// cacheChild is the second process of TestCacheReleaseAcrossProcesses: a
// cached client that answers "claim KEY" lines on stdin with the outcome
// and whether the database counted it.
func cacheChild() int {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("CHILD_URL"))
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	defer pool.Close()
	c, err := idem.New(pool, &idem.Config{Cache: &idem.CacheConfig{MaxAge: time.Minute}})
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	defer c.Close()
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		key := strings.TrimPrefix(in.Text(), "claim ")
		cl, err := c.Claim(ctx, "x", key)
		if err != nil {
			fmt.Println("error", err)
			continue
		}
		fmt.Println(cl.Outcome)
	}
	return 0
}

// TestCacheReleaseAcrossProcesses: another process caches a completed key;
// idem.release in this one. The release takes effect at one moment for
// the database and every cache: right after it the database still answers
// completed, as the other process's cache may (before, the database
// answered acquired while that cache answered completed: 30 of 50
// immediate re-deliveries in one trial); ReleaseGrace later that process
// answers the key from the database (acquired: the work runs again),
// never from its cache.
func TestCacheReleaseAcrossProcesses(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 4)
	countEvery(t, pool, "x")
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Do(ctx, "x", "evt_1", func(context.Context) (any, error) { return "done", nil }); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), cacheChildEnv+"=1", "CHILD_URL="+url)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stdin.Close(); _ = cmd.Wait() })
	out := bufio.NewScanner(stdout)
	claim := func(key string) string {
		t.Helper()
		if _, err := io.WriteString(stdin, "claim "+key+"\n"); err != nil {
			t.Fatal(err)
		}
		if !out.Scan() {
			t.Fatalf("the child process stopped: %v", out.Err())
		}
		return out.Text()
	}
	// Fill the child's cache: claims until the database stops counting them.
	deadline := time.Now().Add(15 * time.Second)
	for {
		before := counted(t, pool, "x")
		if o := claim("evt_1"); o != "completed" {
			t.Fatalf("child: %s", o)
		}
		if counted(t, pool, "x") == before {
			break // answered from the cache
		}
		if time.Now().After(deadline) {
			t.Fatal("the child's cache never answered")
		}
		time.Sleep(100 * time.Millisecond)
	}
	var n int64
	var right string
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, `SELECT idem.release('x', 'evt_1')`).Scan(&n); err != nil {
			return err
		}
		// The moment after the release, by the database's clock.
		return tx.QueryRow(ctx, `SELECT outcome FROM idem.claim('x', 'evt_1')`).Scan(&right)
	})
	if err != nil || n != 1 || right != "completed" {
		t.Fatalf("release: %d %v; the database answered %q right after it, want completed as a cache may", n, err, right)
	}
	time.Sleep(idem.ReleaseGrace)
	if o := claim("evt_1"); o != "acquired" {
		t.Fatalf("the child answered %s after the release, want acquired (from the database)", o)
	}
}

// TestRelease: idem.release refuses a key in progress under a live lease
// (ID004); releases a completed key, which runs again once the release
// has taken effect (ReleaseGrace).
func TestRelease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, c := setup(t)
	_, _ = c.Claim(ctx, "r", "busy")
	_, err := pool.Exec(ctx, `SELECT idem.release('r', 'busy')`)
	var state interface{ SQLState() string }
	if !errors.As(err, &state) || state.SQLState() != "ID004" {
		t.Fatalf("release of a key in progress: %v", err)
	}
	runs := 0
	work := func(context.Context) (any, error) { runs++; return nil, nil }
	_, _ = c.Do(ctx, "r", "done", work)
	if _, err := pool.Exec(ctx, `SELECT idem.release('r', 'done')`); err != nil {
		t.Fatal(err)
	}
	time.Sleep(idem.ReleaseGrace) // when a release takes effect
	_, _ = c.Do(ctx, "r", "done", work)
	if runs != 2 {
		t.Fatalf("runs %d, want 2 (released in between)", runs)
	}
}

// TestCacheListenerKilled: the cache's listening connection is terminated
// (a failover, an operator's pg_terminate_backend): once the freshness
// window (1.5 s) has passed, the next duplicate is the database's answer
// (releases may have gone unheard), and the cache refills after the
// listener is back.
func TestCacheListenerKilled(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 8)
	countEvery(t, pool, "kill")
	c := cachedClient(t, pool)
	if _, err := c.Do(ctx, "kill", "k", func(context.Context) (any, error) { return 1, nil }); err != nil {
		t.Fatal(err)
	}
	fromCache := func() bool {
		before := counted(t, pool, "kill")
		if cl, err := c.Claim(ctx, "kill", "k"); err != nil || cl.Outcome != idem.Completed {
			t.Fatalf("%+v %v", cl, err)
		}
		return counted(t, pool, "kill") == before
	}
	for deadline := time.Now().Add(10 * time.Second); !fromCache(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the cache never answered")
		}
	}
	var killed int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity a, pg_terminate_backend(a.pid) WHERE a.datname = current_database() AND a.application_name = $1`, idem.ListenerApplicationName).Scan(&killed); err != nil || killed != 1 {
		t.Fatalf("terminated %d listeners (%v)", killed, err)
	}
	time.Sleep(1600 * time.Millisecond)
	if fromCache() {
		t.Fatal("the cache answered 1.6 s after its listener was killed, from before")
	}
	for deadline := time.Now().Add(10 * time.Second); !fromCache(); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the cache did not come back after the listener reconnected")
		}
	}
}

// TestCacheKeysCannotCollide: a source may not hold the separator idem
// joins a source and a key with (0x1F, nor any ASCII control character):
// the client refuses it before the cache or the server, and so does
// idem.check_key; a key may hold it. Entries are found by the exact
// (source, key): a completed key cached, a never-seen key of the same
// source whose text differs only after the separator is acquired.
func TestCacheKeysCannotCollide(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 4)
	countEvery(t, pool, "a")
	c := cachedClient(t, pool)
	if _, err := c.Claim(ctx, "a\x1fb", "c"); !errors.Is(err, idem.ErrInvalidInput) {
		t.Fatalf("a source holding 0x1F: %v, want ErrInvalidInput", err)
	}
	var code string
	if _, err := pool.Exec(ctx, `SELECT idem.claim('a' || chr(31) || 'b', 'c')`); err != nil {
		var pg *pgconn.PgError
		if errors.As(err, &pg) {
			code = pg.Code
		}
	}
	if code != "22023" {
		t.Fatalf("idem.claim with a source holding chr(31): SQLSTATE %q, want 22023", code)
	}
	warmCache(t, c, pool, "a", "b\x1fc", "")
	for range 3 { // the listener is up: these fill the cache
		if cl, err := c.Claim(ctx, "a", "b\x1fc"); err != nil || cl.Outcome != idem.Completed {
			t.Fatalf("%+v %v", cl, err)
		}
	}
	cl, err := c.Claim(ctx, "a", "b\x1fd")
	if err != nil || cl.Outcome != idem.Acquired {
		t.Fatalf("a never-seen key answered %+v %v (the cache confused it with another key)", cl, err)
	}
}

// TestSourceRuleIsOneRule: the client and idem.check_key refuse exactly
// the same sources: every ASCII control character, and nothing else of
// these (C1 controls, other Unicode, spaces inside a name are allowed).
func TestSourceRuleIsOneRule(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 2)
	c := testdb.Client(t, pool, nil)
	var sources []string
	for b := 1; b < 0x80; b++ {
		sources = append(sources, "src"+string(rune(b))+"x")
	}
	sources = append(sources, "src\u0085x", "src\u00a0x", "stripe", "shop ify", "ünïcødé", "src\u2028x")
	for _, src := range sources {
		_, goErr := c.Claim(ctx, src, "k")
		_, sqlErr := pool.Exec(ctx, `SELECT idem.check_key('test', $1, 'k')`, src)
		goRefused, sqlRefused := errors.Is(goErr, idem.ErrInvalidInput), sqlErr != nil
		if goRefused != sqlRefused {
			t.Errorf("source %q: the client refused it: %v (%v); check_key refused it: %v (%v)", src, goRefused, goErr, sqlRefused, sqlErr)
		}
	}
}

// TestCacheOwnCopy: the duplicate whose claim filled the cache gets bytes
// of its own: masking a field of its Result in place does not change what
// later duplicates are answered. Before, the cache kept the very slice it
// handed to that caller.
func TestCacheOwnCopy(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := setup(t)
	countEvery(t, pool, "own")
	c := cachedClient(t, pool)
	warmCache(t, c, pool, "own", "warm", "")
	work := func(context.Context) (any, error) { return map[string]string{"card": "4242"}, nil }
	// A duplicate answered by the database fills the cache, the next one
	// is answered by the cache: tried on fresh keys until both happen in
	// a row (the cache answers only while its listener is heard from).
	for i := 0; ; i++ {
		if i == 50 {
			t.Fatal("never a database answer then a cache answer")
		}
		key := fmt.Sprintf("k%d", i)
		if _, err := c.Do(ctx, "own", key, work); err != nil {
			t.Fatal(err)
		}
		before := counted(t, pool, "own")
		filled, err := c.Do(ctx, "own", key, work)
		if err != nil || !filled.Replayed {
			t.Fatalf("%+v %v", filled, err)
		}
		if counted(t, pool, "own") == before {
			continue // answered by the cache: it filled nothing
		}
		want := string(filled.Result)
		copy(filled.Result[bytes.Index(filled.Result, []byte("4242")):], "****")
		before = counted(t, pool, "own")
		again, err := c.Do(ctx, "own", key, work)
		if err != nil {
			t.Fatal(err)
		}
		if counted(t, pool, "own") != before {
			continue // not answered by the cache
		}
		if string(again.Result) != want {
			t.Fatalf("the cache answered %s after the first duplicate masked its copy; want %s", again.Result, want)
		}
		return
	}
}
