package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/stripe/stripe-go/v85/webhook"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
)

// balanced fails t unless every source's reconciliation adds up, and
// returns the one of source.
func balanced(t *testing.T, in *inbox.Inbox, source string) inbox.SourceStats {
	t.Helper()
	st, err := in.Reconcile(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var out inbox.SourceStats
	for _, s := range st {
		if !s.Balanced() || s.Unaccounted != 0 {
			t.Errorf("reconciliation: %s", s)
		}
		if s.Source == source {
			out = s
		}
	}
	return out
}

// TestDocumentedSetup: the setup exactly as README and docs/inbox.md show
// it: pgxpool.New on the URL (its default MaxConns: 4 on 2 CPUs), the
// Stripe preset in asynchronous mode, NewWorkerClient(0, nil), a handler
// that runs an Effect. 100 deliveries over real HTTP are each processed
// once, their effect run once, within a minute (waitFor's bound). And
// with a 16-connection pool (the default on 16 CPUs), the same.
func TestDocumentedSetup(t *testing.T) {
	t.Parallel()
	for _, params := range []string{"", "pool_max_conns=16"} {
		t.Run(map[string]string{"": "default pool", "pool_max_conns=16": "16 connections"}[params], func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			url, _ := setup(t)
			switch {
			case params == "":
			case strings.HasPrefix(url, "postgres://") || strings.HasPrefix(url, "postgresql://"):
				sep := "?"
				if strings.Contains(url, "?") {
					sep = "&"
				}
				url += sep + params
			default:
				url += " " + params // a key=value DSN
			}
			pool, err := pgxpool.New(ctx, url)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			c, err := idem.New(pool, nil)
			if err != nil {
				t.Fatal(err)
			}
			var effects atomic.Int64
			in, err := inbox.New(inbox.Config{Pool: pool, Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
				if _, err := c.Effect(ctx, "notify", func(ctx context.Context) (any, error) {
					effects.Add(1)
					return "sent", nil
				}); err != nil {
					return nil, err
				}
				return nil, record(ctx, tx, d)
			}})
			if err != nil {
				t.Fatal(err)
			}
			mw, err := idemhttp.New(idemhttp.Config{Client: c, Async: in}.Apply(idemhttp.Stripe("whsec_doc")))
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(mw(http.NotFoundHandler()))
			defer srv.Close()
			workers, err := in.NewWorkerClient(0, nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := workers.Start(ctx); err != nil {
				t.Fatal(err)
			}
			defer func() {
				sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				defer cancel()
				_ = workers.Stop(sctx)
			}()
			hc := &http.Client{Timeout: 10 * time.Second}
			var wg sync.WaitGroup
			for i := range 100 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					body := fmt.Sprintf(`{"id":"evt_%d","type":"invoice.paid","data":{"object":{}}}`, i)
					p := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: []byte(body), Secret: "whsec_doc", Timestamp: time.Now()})
					req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(body))
					req.Header.Set("Stripe-Signature", p.Header)
					resp, err := hc.Do(req)
					if err != nil {
						t.Error(err)
						return
					}
					resp.Body.Close()
					if resp.StatusCode != http.StatusAccepted {
						t.Errorf("evt_%d: %d", i, resp.StatusCode)
					}
				}()
			}
			wg.Wait()
			waitFor(t, "100 events processed", func() bool {
				return count(t, pool, `SELECT count(*) FROM processed`) >= 100
			})
			if n := count(t, pool, `SELECT count(DISTINCT key) FROM processed`); n != 100 || count(t, pool, `SELECT count(*) FROM processed`) != 100 {
				t.Fatalf("%d distinct events processed, %d rows; want 100 once each", n, count(t, pool, `SELECT count(*) FROM processed`))
			}
			if effects.Load() != 100 {
				t.Fatalf("the effect ran %d times, want 100", effects.Load())
			}
			if s := balanced(t, in, "stripe"); s.Accepted != 100 || s.Processed != 100 {
				t.Fatalf("reconciliation %s", s)
			}
		})
	}
}

// TestWorkerPoolSizing: NewWorkerClient never runs more handlers than the
// pool can serve: 0 runs what the pool serves, and more than that is
// refused with the pool_max_conns to set (never lowered with only a log
// line); it refuses a pool too small for one, and a JobTimeout that turns
// River's rescue off.
func TestWorkerPoolSizing(t *testing.T) {
	t.Parallel()
	url, _ := setup(t)
	handler := func(context.Context, pgx.Tx, *inbox.Delivery) (any, error) { return nil, nil }
	for conns, want := range map[int32]int{3: 0, 4: 1, 5: 1, 10: 4, 16: 7} {
		if got := inbox.WorkerCapacity(conns); got != want {
			t.Errorf("WorkerCapacity(%d) = %d, want %d", conns, got, want)
		}
	}
	small := testdb.Pool(t, url, 3)
	in, _ := inbox.New(inbox.Config{Pool: small, Handler: handler})
	if _, err := in.NewWorkerClient(1, nil); !errors.Is(err, inbox.ErrPoolTooSmall) || !strings.Contains(err.Error(), "pool_max_conns=4") {
		t.Errorf("a pool of 3: %v, want ErrPoolTooSmall naming the size", err)
	}
	var logs testdb.Buffer
	pool := testdb.Pool(t, url, 6)
	in, _ = inbox.New(inbox.Config{Pool: pool, Handler: handler, Logger: slogTo(&logs)})
	// More handlers than the pool serves: refused, with the exact setting
	// (never lowered with only a log line).
	if _, err := in.NewWorkerClient(50, nil); !errors.Is(err, inbox.ErrPoolTooSmall) || !strings.Contains(err.Error(), "set pool_max_conns=102") ||
		!strings.Contains(err.Error(), "the pool has 6") || !strings.Contains(err.Error(), "ask for at most 2") {
		t.Errorf("50 handlers on a pool of 6: %v, want ErrPoolTooSmall naming pool_max_conns=102", err)
	}
	// 0: what the pool serves, said with the numbers.
	if _, err := in.NewWorkerClient(0, nil); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs.String(), "running 2 handlers at once, what a pool of 6 connections serves") {
		t.Errorf("no log naming the numbers: %q", logs.String())
	}
	if _, err := in.NewWorkerClient(2, nil); err != nil {
		t.Errorf("2 handlers on a pool of 6: %v", err)
	}
	if _, err := in.NewWorkerClient(1, &river.Config{JobTimeout: -1}); !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "never rescues") {
		t.Errorf("JobTimeout -1: %v, want it refused", err)
	}
	if _, err := in.NewWorkerClient(-1, nil); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("-1 workers: %v", err)
	}
}

// TestHeldWhileWorkersDown: 20 events accepted last month, with a
// retention of one minute and a lease of five seconds, while no worker
// runs. Long past their retention and their lease, prune (CALL
// idem.prune()) deletes none of them and rotation (CALL idem.rotate())
// keeps their month; a redelivery is a duplicate. When the workers start,
// each is processed once. A key deleted by hand before its job ran is a
// dead letter saying so, never a silent completion, and its replay
// processes it once.
func TestHeldWhileWorkersDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool := setup(t)
	then := testdb.MonthStart(time.Now(), -1).Add(36 * time.Hour)
	if _, err := pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease) VALUES ('short', '1 minute', '5 seconds')`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `SELECT idem.create_partition($1)`, then); err != nil {
		t.Fatal(err)
	}
	var ran atomic.Int64
	handler := func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
		ran.Add(1)
		return nil, record(ctx, tx, d)
	}
	past, err := inbox.New(inbox.Config{Pool: testdb.PoolAt(t, url, 4, then)})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		if a, err := past.Accept(ctx, &inbox.Delivery{Source: "short", Key: fmt.Sprint("k", i), Payload: []byte(`{}`)}); err != nil || a.Duplicate {
			t.Fatalf("accept: %+v %v", a, err)
		}
	}
	if _, err := pool.Exec(ctx, `CALL idem.prune()`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CALL idem.rotate()`); err != nil {
		t.Fatal(err)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem.processed_events WHERE source = 'short'`); n != 20 {
		t.Fatalf("prune or rotation removed %d held keys", 20-n)
	}
	if n := count(t, pool, `SELECT idem.prunable_rows()`); n != 0 {
		t.Fatalf("prunable_rows counts %d held keys", n)
	}
	var why string
	if err := pool.QueryRow(ctx, `SELECT idem.retire_partition(p.partition) FROM idem.partition_months() p WHERE p.month_from = $1`,
		testdb.MonthStart(then, 0)).Scan(&why); err != nil || !strings.Contains(why, "held by a queue") {
		t.Fatalf("retire last month: %q %v", why, err)
	}
	in, err := inbox.New(inbox.Config{Pool: pool, Handler: handler})
	if err != nil {
		t.Fatal(err)
	}
	// A redelivery now is a duplicate: the job will process it.
	if a, err := in.Accept(ctx, &inbox.Delivery{Source: "short", Key: "k3", Payload: []byte(`{}`)}); err != nil || !a.Duplicate {
		t.Fatalf("redelivery of a held key: %+v %v", a, err)
	}
	// An operator deletes one key by hand.
	if _, err := pool.Exec(ctx, `DELETE FROM idem.processed_events WHERE source = 'short' AND key = 'k7'`); err != nil {
		t.Fatal(err)
	}
	start(t, in, 4, nil)
	waitFor(t, "19 processed and one dead letter", func() bool {
		d, _ := in.DeadLetters(ctx, inbox.Filter{Source: "short"})
		return count(t, pool, `SELECT count(*) FROM processed`) == 19 && len(d) == 1
	})
	dead, _ := in.DeadLetters(ctx, inbox.Filter{Source: "short"})
	if dead[0].Key != "k7" || !strings.Contains(dead[0].LastError, "gone") {
		t.Fatalf("dead letter %+v", dead[0])
	}
	if s := balanced(t, in, "short"); s.Accepted != 20 || s.Processed != 19 || s.Dead != 1 {
		t.Fatalf("reconciliation %s", s)
	}
	res, err := in.Replay(ctx, inbox.Filter{Source: "short"})
	if err != nil || len(res) != 1 || res[0].Outcome != "replayed" {
		t.Fatalf("replay: %+v %v", res, err)
	}
	waitFor(t, "k7 processed", func() bool { return count(t, pool, `SELECT count(*) FROM processed WHERE key = 'k7'`) == 1 })
	time.Sleep(200 * time.Millisecond)
	if n := count(t, pool, `SELECT count(*) FROM processed`); n != 20 || ran.Load() != 20 {
		t.Fatalf("%d rows, %d runs; want each of 20 events once", n, ran.Load())
	}
	if s := balanced(t, in, "short"); s.Accepted != 20 || s.Processed != 20 || s.Dead != 0 || s.Queued != 0 {
		t.Fatalf("reconciliation %s", s)
	}
}

// TestRescueRace: River runs a second attempt of a job while the first
// still runs (what its rescuer does to a job that ran past
// RescueStuckJobsAfter: made to happen here by setting the job available
// again, as the rescuer does). Each attempt takes the key with a token of
// its own: the second runs the handler, whose effect is replayed, not
// redone, and commits; the first, released afterwards, cannot complete
// the key, and its transaction rolls back. Then the opposite order: an
// attempt that starts after another completed the key does nothing. The
// in-transaction write and the effect happen once.
func TestRescueRace(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	var effects, commits atomic.Int64
	firstIn := make(chan int64, 1)
	release := make(chan struct{})
	in, err := inbox.New(inbox.Config{Pool: pool, Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
		if _, err := c.Effect(ctx, "charge", func(ctx context.Context) (any, error) {
			effects.Add(1)
			return nil, nil
		}); err != nil {
			return nil, err
		}
		if err := record(ctx, tx, d); err != nil {
			return nil, err
		}
		if d.Attempt == 1 && d.Key == "race" {
			firstIn <- 1
			<-release // ignores its context: a handler that runs on
		}
		commits.Add(1) // reached the end; the commit may still be refused
		return map[string]int{"attempt": d.Attempt}, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	a, err := in.Accept(ctx, &inbox.Delivery{Source: "s", Key: "race", Payload: []byte(`{}`)})
	if err != nil {
		t.Fatal(err)
	}
	start(t, in, 2, nil)
	<-firstIn
	// The rescuer's move: the job is runnable again while attempt 1 runs.
	if _, err := pool.Exec(ctx, `UPDATE river_job SET state = 'available', scheduled_at = now() WHERE id = $1`, a.JobID); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "attempt 2 completes the key", func() bool {
		return count(t, pool, `SELECT count(*) FROM idem.processed_events WHERE key = 'race' AND status = 'completed'`) == 1
	})
	close(release)
	waitFor(t, "attempt 1 returns", func() bool { return commits.Load() == 2 })
	time.Sleep(300 * time.Millisecond)
	var result string
	if err := pool.QueryRow(ctx, `SELECT result::text FROM idem.processed_events WHERE key = 'race'`).Scan(&result); err != nil || result != `{"attempt": 2}` {
		t.Fatalf("stored result %s (%v), want attempt 2's", result, err)
	}
	if n := count(t, pool, `SELECT count(*) FROM processed WHERE key = 'race'`); n != 1 || effects.Load() != 1 {
		t.Fatalf("%d writes committed, the effect ran %d times; want once each", n, effects.Load())
	}

	// The other order: the job is runnable again after it completed.
	b, err := in.Accept(ctx, &inbox.Delivery{Source: "s", Key: "after", Payload: []byte(`{}`)})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "after processed", func() bool {
		return count(t, pool, `SELECT count(*) FROM river_job WHERE id = $1 AND state = 'completed'`, b.JobID) == 1
	})
	if _, err := pool.Exec(ctx, `UPDATE river_job SET state = 'available', scheduled_at = now(), finalized_at = NULL WHERE id = $1`, b.JobID); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the second run finishes", func() bool {
		return count(t, pool, `SELECT count(*) FROM river_job WHERE id = $1 AND state = 'completed' AND attempt = 2`, b.JobID) == 1
	})
	if n := count(t, pool, `SELECT count(*) FROM processed WHERE key = 'after'`); n != 1 || effects.Load() != 2 {
		t.Fatalf("after: %d writes, %d effects in all; want one more of each", n, effects.Load())
	}
	balanced(t, in, "s")
}

// TestLargeResult: a handler whose result is over idem's 1 MiB limit (2
// MiB) completes the event like Do does: processed once, the result not
// stored, the reason on the key.
func TestLargeResult(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	var ran atomic.Int64
	var logs testdb.Buffer
	in, err := inbox.New(inbox.Config{Pool: pool, Logger: slogTo(&logs), Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
		ran.Add(1)
		return map[string]string{"blob": strings.Repeat("x", 2<<20)}, record(ctx, tx, d)
	}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := in.Accept(ctx, &inbox.Delivery{Source: "s", Key: "big", Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	start(t, in, 1, nil)
	waitFor(t, "the event completed", func() bool {
		return count(t, pool, `SELECT count(*) FROM idem.processed_events WHERE key = 'big' AND status = 'completed'`) == 1
	})
	var stored bool
	var reason string
	if err := pool.QueryRow(ctx, `SELECT result IS NOT NULL, last_error FROM idem.processed_events WHERE key = 'big'`).Scan(&stored, &reason); err != nil {
		t.Fatal(err)
	}
	if stored || !strings.Contains(reason, "result not stored") || !strings.Contains(reason, "1 MiB") {
		t.Fatalf("stored %v, reason %q", stored, reason)
	}
	if ran.Load() != 1 || count(t, pool, `SELECT count(*) FROM processed`) != 1 {
		t.Fatalf("ran %d times", ran.Load())
	}
	if !strings.Contains(logs.String(), "the result was not stored") {
		t.Fatalf("no log line: %q", logs.String())
	}
	if s := balanced(t, in, "s"); s.Processed != 1 {
		t.Fatalf("reconciliation %s", s)
	}
	// A duplicate is answered as done.
	if a, err := in.Accept(ctx, &inbox.Delivery{Source: "s", Key: "big", Payload: []byte(`{}`)}); err != nil || a.Outcome != idem.Completed {
		t.Fatalf("duplicate: %+v %v", a, err)
	}
}

// TestAsyncRetention: asynchronous mode honours the same retention and
// lease as synchronous mode: the Stripe preset's 7 days, idemhttp's Lease
// for each attempt; and a source whose retention (1 minute) is shorter
// than an hour accepts (before, the inbox's 1-hour queue lease made every
// accept fail).
func TestAsyncRetention(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	if _, err := pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease) VALUES ('brief', '1 minute', '30 seconds')`); err != nil {
		t.Fatal(err)
	}
	leases := make(chan time.Duration, 4)
	in, err := inbox.New(inbox.Config{Pool: pool, Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
		cl, _ := idem.EventFrom(ctx)
		leases <- cl.LeaseRemaining
		return nil, record(ctx, tx, d)
	}})
	if err != nil {
		t.Fatal(err)
	}
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	mw, err := idemhttp.New(idemhttp.Config{Client: c, Async: in, Lease: 45 * time.Second}.Apply(idemhttp.Stripe("whsec_r")))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.NotFoundHandler()))
	defer srv.Close()
	body := `{"id":"evt_ttl","type":"x","data":{"object":{}}}`
	p := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: []byte(body), Secret: "whsec_r", Timestamp: time.Now()})
	req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(body))
	req.Header.Set("Stripe-Signature", p.Header)
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 202 {
		t.Fatalf("%v %v", resp, err)
	}
	resp.Body.Close()
	var days float64
	if err := pool.QueryRow(ctx, `SELECT extract(epoch FROM expires_at - first_seen) / 86400 FROM idem.processed_events WHERE key = 'evt_ttl'`).Scan(&days); err != nil || days != 7 {
		t.Fatalf("async retention %v days (%v), want the preset's 7", days, err)
	}
	if a, err := in.Accept(ctx, &inbox.Delivery{Source: "brief", Key: "b1", Payload: []byte(`{}`)}); err != nil || a.Duplicate {
		t.Fatalf("a source with a 1-minute retention: %+v %v", a, err)
	}
	start(t, in, 1, nil)
	got := map[time.Duration]bool{<-leases: true, <-leases: true}
	if !got[45*time.Second] || !got[inbox.DefaultRunLease] {
		t.Fatalf("attempt leases %v, want idemhttp's 45s and the default run lease", got)
	}
}

// slogTo is a logger writing text to w.
func slogTo(w io.Writer) *slog.Logger { return slog.New(slog.NewTextHandler(w, nil)) }
