package cli

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// TestAdopt: a legacy processed_events table of 1,000,000 live rows (and
// 1,000 past a 30-day retention) is adopted online while a storm of
// retries of those same events, and of new events, goes through idem.Do.
// The copy is SIGKILLed mid-way and run again, and resumes. Then: no live
// legacy event was processed again (the work never ran for one), every
// new event ran once, every live legacy row is a completed key with its
// result, none twice, the expired ones are not adopted, and once done,
// claims answer without the legacy table (dropped).
func TestAdopt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 24)
	const live, expired = 1_000_000, 1_000
	if _, err := pool.Exec(ctx, `
		CREATE TABLE public.processed_events (event_id text PRIMARY KEY, processed_at timestamptz NOT NULL, result jsonb);
		INSERT INTO public.processed_events
		SELECT 'evt_' || lpad(g::text, 7, '0'), now() - (g % 20) * interval '1 day' - interval '1 hour', jsonb_build_object('n', g)
		  FROM generate_series(1, 1000000) g;
		INSERT INTO public.processed_events
		SELECT 'old_' || g, now() - interval '40 days', NULL FROM generate_series(1, 1000) g;
		ANALYZE public.processed_events`); err != nil {
		t.Fatal(err)
	}
	bin := binary(t)
	adopt := func() *exec.Cmd {
		cmd := exec.Command(bin, "adopt", "--database-url", url, "--table", "public.processed_events", "--source", "legacy",
			"--key-column", "event_id", "--at-column", "processed_at", "--result-column", "result", "--ttl", "720h", "--batch-size", "10000", "--sleep", "0")
		return cmd
	}

	// First run, in the background: SIGKILLed once some batches are in.
	first := adopt()
	var out bytes.Buffer
	first.Stdout, first.Stderr = &out, &out
	if err := first.Start(); err != nil {
		t.Fatal(err)
	}
	// The application switches to idem once the adoption has started (from
	// then on, claims consult the legacy table until the copy is done).
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(10 * time.Millisecond) {
		var n int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM idem.adoptions`).Scan(&n)
		if n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the adoption did not start: %s", out.String())
		}
	}

	// The storm: retries of live legacy events (must never run) and new
	// events (each must run once), from 8 goroutines, until told to stop.
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	var legacyRuns, newRuns, errs atomic.Int64
	var ranNew sync.Map
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				key := fmt.Sprintf("evt_%07d", 1+rand.IntN(live))
				isNew := i%10 == 0
				if isNew {
					key = fmt.Sprintf("new_%d_%d", w, i)
				}
				for range 1 + rand.IntN(2) { // a retry now and then
					_, err := c.Do(ctx, "legacy", key, func(context.Context) (any, error) {
						if isNew {
							if _, dup := ranNew.LoadOrStore(key, true); dup {
								legacyRuns.Add(1000000) // ran twice: fails below
							}
							newRuns.Add(1)
						} else {
							legacyRuns.Add(1)
						}
						return nil, nil
					})
					if err != nil {
						errs.Add(1)
					}
				}
			}
		})
	}
	defer func() { close(stop); wg.Wait() }()

	deadline := time.Now().Add(2 * time.Minute)
	for {
		var copied int64
		_ = pool.QueryRow(ctx, `SELECT coalesce(max(copied), 0) FROM idem.adoptions`).Scan(&copied)
		if copied >= 200_000 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("adopt copied %d rows in 2 minutes: %s", copied, out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	_ = first.Process.Kill()
	_ = first.Wait()
	var state string
	var copiedAtKill int64
	if err := pool.QueryRow(ctx, `SELECT state, copied FROM idem.adoptions`).Scan(&state, &copiedAtKill); err != nil || state != "copying" {
		t.Fatalf("after the kill: %s %v", state, err)
	}

	// Second run: resumes and finishes.
	start := time.Now()
	second := adopt()
	b, err := second.CombinedOutput()
	if err != nil || !strings.Contains(string(b), "claims no longer consult it") {
		t.Fatalf("adopt again: %v\n%s", err, b)
	}
	t.Logf("resumed after %d rows: %s (%v)", copiedAtKill, strings.TrimSpace(string(b)), time.Since(start).Round(time.Millisecond))
	close(stop)
	wg.Wait()
	stop = make(chan struct{})

	if n := legacyRuns.Load(); n != 0 {
		t.Fatalf("the work ran %d times for events the legacy table had processed (or a new event ran twice)", n)
	}
	if errs.Load() != 0 {
		t.Fatalf("%d claims failed during the adoption", errs.Load())
	}
	var keys, distinct, withResult, old int64
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT key), count(*) FILTER (WHERE key LIKE 'evt_%' AND result = jsonb_build_object('n', substr(key, 5)::int)),
	                                      count(*) FILTER (WHERE key LIKE 'old_%')
	                                 FROM idem.processed_events WHERE source = 'legacy' AND key NOT LIKE 'new_%'`).Scan(&keys, &distinct, &withResult, &old); err != nil {
		t.Fatal(err)
	}
	if keys != live || distinct != live || withResult != live || old != 0 {
		t.Fatalf("adopted %d keys (%d distinct, %d with their result, %d expired ones), want %d, each once with its result, none expired", keys, distinct, withResult, old, live)
	}
	// The months the live rows were processed in were made first: none
	// went to the default partition.
	var stray int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events_default`).Scan(&stray); err != nil || stray != 0 {
		t.Fatalf("%d adopted rows in the default partition (%v)", stray, err)
	}
	var ranOnce int64
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE source = 'legacy' AND key LIKE 'new_%' AND status = 'completed'`).Scan(&ranOnce)
	if ranOnce != newRuns.Load() {
		t.Fatalf("%d new events completed, %d ran", ranOnce, newRuns.Load())
	}
	// Done: the legacy table is no longer consulted.
	if _, err := pool.Exec(ctx, `DROP TABLE public.processed_events`); err != nil {
		t.Fatal(err)
	}
	cl, err := c.Claim(ctx, "legacy", "evt_0000042")
	if err != nil || cl.Outcome != idem.Completed || string(cl.Result) != `{"n": 42}` {
		t.Fatalf("after the adoption: %+v %v", cl, err)
	}
	if cl, err := c.Claim(ctx, "legacy", "brand_new"); err != nil || cl.Outcome != idem.Acquired {
		t.Fatalf("a new key after the adoption: %+v %v", cl, err)
	}
}

// TestAdoptRefused: bad flags are usage errors; a table or column that
// does not exist is an error naming it, and nothing is started.
func TestAdoptRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 2)
	if _, err := pool.Exec(ctx, `CREATE TABLE legacy (id text PRIMARY KEY, at timestamptz, note text)`); err != nil {
		t.Fatal(err)
	}
	base := []string{"adopt", "--database-url", url, "--source", "s"}
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"--table", "legacy"}, ExitUsage, "needs --table, --source, --key-column and --at-column"},
		{[]string{"--table", "legacy", "--key-column", "id", "--at-column", "at", "--batch-size", "0"}, ExitUsage, "--batch-size 0"},
		{[]string{"--table", "legacy", "--key-column", "id", "--at-column", "at", "--ttl", "1s"}, ExitUsage, "--ttl 1s"},
		{[]string{"--table", "nope", "--key-column", "id", "--at-column", "at"}, ExitError, `relation "nope" does not exist`},
		{[]string{"--table", "legacy", "--key-column", "missing", "--at-column", "at"}, ExitError, `has no column missing`},
		{[]string{"--table", "legacy", "--key-column", "id", "--at-column", "note"}, ExitError, `is not a timestamp or a date`},
	} {
		r := idemctl(t, ctx, nil, append(base, tc.args...)...)
		if r.code != tc.code || !strings.Contains(r.errout, tc.want) {
			t.Errorf("%v: exit %d, want %d with %q\n%s", tc.args, r.code, tc.code, tc.want, r.errout)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.adoptions`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d adoptions started (%v)", n, err)
	}
}

// TestAdoptHostileLegacy: legacy data as it really is: an integer key
// column, NULL keys filling whole batches, a row stamped a year in the
// future, a row with no processed-at. The adoption ends (it re-read the
// NULL keys forever), says what it skipped and why, and afterwards the
// retry of the future-stamped event is answered as done (it ran again:
// its row sat in a month claims never look at), while '01', ' 1' and a
// key past the integer range are new events, claimed without error, not
// legacy row 1.
func TestAdoptHostileLegacy(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 4)
	if _, err := pool.Exec(ctx, `
		CREATE TABLE legacy (id bigint, processed_at timestamptz, result jsonb);
		INSERT INTO legacy SELECT NULL, now() - interval '1 day', NULL FROM generate_series(1, 12);
		INSERT INTO legacy VALUES (1, now() - interval '1 day', '{"legacy": 1}'), (7, now() + interval '1 year', '{"legacy": 7}'), (8, NULL, NULL)`); err != nil {
		t.Fatal(err)
	}
	// Claims consult the legacy table while the copy runs: a key the
	// integer type cannot hold is a new key, not an error.
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `SELECT idem.adopt_start('legacy', 'legacy'::regclass, 'id', 'processed_at', 'result', '30 days')`); err != nil {
		t.Fatal(err)
	}
	if cl, err := c.Claim(ctx, "legacy", "99999999999999999999"); err != nil || cl.Outcome != idem.Acquired {
		t.Fatalf("while copying, a key past the integer range: %+v %v", cl, err)
	}
	r := idemctl(t, ctx, nil, "adopt", "--database-url", url, "--table", "legacy", "--source", "legacy",
		"--key-column", "id", "--at-column", "processed_at", "--result-column", "result", "--ttl", "720h", "--batch-size", "5", "--sleep", "0")
	if r.code != 0 {
		t.Fatalf("adopt: exit %d\n%s%s", r.code, r.out, r.errout)
	}
	for _, want := range []string{"12 with a NULL, empty, blank or over-512-byte key", "1 with no processed-at", "1 rows stamped in the future"} {
		if !strings.Contains(r.out, want) {
			t.Errorf("the report does not say %q:\n%s", want, r.out)
		}
	}
	ran := 0
	for key, replayed := range map[string]bool{"7": true, "1": true, "01": false, " 1": false} {
		res, err := c.Do(ctx, "legacy", key, func(context.Context) (any, error) { ran++; return nil, nil })
		if err != nil || res.Replayed != replayed {
			t.Errorf("key %q after the adoption: %+v %v, want replayed %v", key, res, err, replayed)
		}
	}
	if ran != 2 {
		t.Errorf("the work ran %d times, want twice (01 and ' 1')", ran)
	}
}
