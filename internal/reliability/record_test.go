package reliability

import (
	"context"
	"encoding/json"
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

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/testdb"
)

// TestSenderHangsUpMidHandler is the most common real fault: the sender
// times out and hangs up while a slow handler (that ignores its context)
// is still working, then retries during the work, after the lease would
// have ended, and after the work is done. The side effect must run once and
// the late retries get the stored answer. A real server, a real client with
// a timeout.
func TestSenderHangsUpMidHandler(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, testdb.New(t), 8)
	var effects atomic.Int64
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(3 * time.Second) // longer than the lease, and it ignores r.Context()
		effects.Add(1)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"paid":true}`)
	})
	mw, err := idemhttp.New(idemhttp.Config{Client: testdb.Client(t, pool, nil), Source: "sender", Lease: 2 * time.Second, Scope: idemhttp.Unscoped})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(handler))
	t.Cleanup(srv.Close)
	sender := &http.Client{Timeout: 500 * time.Millisecond}

	deliver := func() (int, string, http.Header, error) {
		req, _ := http.NewRequest("POST", srv.URL+"/hook", strings.NewReader(`{"id":"evt_1"}`))
		req.Header.Set("Idempotency-Key", `"evt_1"`)
		resp, err := sender.Do(req)
		if err != nil {
			return 0, "", nil, err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b), resp.Header, nil
	}

	start := time.Now()
	if _, _, _, err := deliver(); err == nil || !strings.Contains(err.Error(), "Timeout") {
		t.Fatalf("first delivery: want the sender to time out, got %v", err)
	}
	// Retries: during the work, after the 2s lease would have lapsed while
	// the handler still runs, and after the work is done.
	for i, at := range []time.Duration{700 * time.Millisecond, 2500 * time.Millisecond, 4500 * time.Millisecond, 6 * time.Second} {
		time.Sleep(time.Until(start.Add(at)))
		status, body, header, err := deliver()
		switch {
		case err != nil:
			t.Fatalf("retry %d at +%v: %v", i, at, err)
		case time.Since(start) < 3*time.Second && status != http.StatusConflict:
			t.Fatalf("retry %d at +%v while the work runs: %d %s, want 409", i, at, status, body)
		case time.Since(start) >= 3500*time.Millisecond && (status != 200 || body != `{"paid":true}` || header.Get(idemhttp.ReplayedHeader) != "true"):
			t.Fatalf("retry %d at +%v after the work: %d %q replayed=%q, want the stored 200", i, at, status, body, header.Get(idemhttp.ReplayedHeader))
		}
	}
	if n := effects.Load(); n != 1 {
		t.Fatalf("the side effect ran %d times, want 1", n)
	}
	t.Logf("sender timed out at 0.5s during 3s of work (lease 2s); 4 retries: 2 answered 409, 2 the stored 200; side effect ran once")
	if n := count(t, pool, `SELECT count(*) FROM idem.processed_events WHERE status <> 'completed'`); n != 0 {
		t.Fatalf("%d keys not completed", n)
	}
}

// TestRecordingFailures: each way recording the outcome can fail after the
// work ran. The work never runs twice and the key is never left
// processing once the work returned.
func TestRecordingFailures(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 8)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()

	// check runs the key again and asserts it is done and was not re-run.
	check := func(t *testing.T, key string, runs *atomic.Int64) *idem.Result {
		t.Helper()
		var status string
		if err := pool.QueryRow(ctx, `SELECT status FROM idem.processed_events WHERE source = 'rec' AND key = $1`, key).Scan(&status); err != nil {
			t.Fatal(err)
		}
		if status != "completed" {
			t.Fatalf("%s is %s after its work returned, want completed", key, status)
		}
		res, err := c.Do(ctx, "rec", key, func(context.Context) (any, error) {
			runs.Add(1)
			return "again", nil
		})
		if err != nil || !res.Replayed {
			t.Fatalf("retry of %s: %+v %v, want a replay", key, res, err)
		}
		if runs.Load() != 1 {
			t.Fatalf("%s ran %d times", key, runs.Load())
		}
		return res
	}

	t.Run("caller cancels during the work", func(t *testing.T) {
		var runs atomic.Int64
		cctx, cancel := context.WithCancel(ctx)
		_, err := c.Do(cctx, "rec", "cancelled", func(context.Context) (any, error) {
			cancel() // the sender hung up
			time.Sleep(100 * time.Millisecond)
			runs.Add(1)
			return "done", nil
		})
		if err != nil {
			t.Fatalf("Do: %v (the work ran; its outcome must be recorded)", err)
		}
		check(t, "cancelled", &runs)
	})
	t.Run("caller's deadline passes during the work", func(t *testing.T) {
		var runs atomic.Int64
		dctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		_, err := c.Do(dctx, "rec", "deadline", func(context.Context) (any, error) {
			time.Sleep(300 * time.Millisecond)
			runs.Add(1)
			return "done", nil
		})
		if err != nil {
			t.Fatalf("Do: %v", err)
		}
		check(t, "deadline", &runs)
	})
	t.Run("a failure is recorded after the caller cancelled", func(t *testing.T) {
		cctx, cancel := context.WithCancel(ctx)
		_, err := c.Do(cctx, "rec", "failed-cancelled", func(context.Context) (any, error) {
			cancel()
			return nil, idem.Permanent(errors.New("card declined"))
		})
		if err == nil || !strings.Contains(err.Error(), "card declined") {
			t.Fatalf("Do: %v", err)
		}
		if _, err := c.Do(ctx, "rec", "failed-cancelled", func(context.Context) (any, error) { return nil, nil }); !errors.Is(err, idem.ErrFailed) {
			t.Fatalf("after a permanent failure: %v, want ErrFailed", err)
		}
	})

	unstorable := map[string]any{
		"over 1 MiB":      map[string]string{"blob": strings.Repeat("x", 2<<20)},
		"a NUL character": json.RawMessage(`{"note":"a\u0000b"}`),
		"not JSON":        []byte("plain text, not JSON"),
		"unmarshalable":   map[string]any{"ch": make(chan int)},
	}
	for name, result := range unstorable {
		t.Run("result "+name, func(t *testing.T) {
			var runs atomic.Int64
			key := "unstorable-" + strings.ReplaceAll(name, " ", "-")
			_, err := c.Do(ctx, "rec", key, func(context.Context) (any, error) {
				runs.Add(1)
				return result, nil
			})
			if !errors.Is(err, idem.ErrResultNotStored) {
				t.Fatalf("Do: %v, want ErrResultNotStored", err)
			}
			res := check(t, key, &runs)
			if res.Result != nil || !strings.HasPrefix(res.NotStored, "result not stored: ") {
				t.Fatalf("replay: result %q, NotStored %q", res.Result, res.NotStored)
			}
		})
	}

	t.Run("connection terminated between the work and the record", func(t *testing.T) {
		cfg, err := pgxpool.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		cfg.ConnConfig.RuntimeParams["application_name"] = "idem-victim"
		cfg.MaxConns = 2
		victim, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer victim.Close()
		vc, err := idem.New(victim, &idem.Config{HeartbeatFraction: -1})
		if err != nil {
			t.Fatal(err)
		}
		n := scale(10, 200)
		for i := range n {
			var runs atomic.Int64
			key := fmt.Sprintf("terminated-%d", i)
			_, err := vc.Do(ctx, "rec", key, func(context.Context) (any, error) {
				runs.Add(1)
				if n := count(t, pool, `SELECT count(pg_terminate_backend(pid))::int FROM pg_stat_activity WHERE application_name = 'idem-victim'`); n == 0 {
					t.Error("no connection was terminated")
				}
				return "done", nil
			})
			if err != nil {
				t.Fatalf("Do: %v", err)
			}
			check(t, key, &runs)
		}
		t.Logf("terminated the connections between the work and the record %d times: each key ran once and was completed", n)
	})

	t.Run("PgBouncer transaction mode with pgx's default configuration", func(t *testing.T) {
		var db string
		if err := pool.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
			t.Fatal(err)
		}
		// pgx's own default, the statement cache.
		bouncer := testdb.PgBouncer(t, db)
		if strings.Contains(bouncer, "exec_mode") {
			t.Fatalf("bouncer URL still sets an exec mode: %s", bouncer)
		}
		bp := testdb.Pool(t, bouncer, 24)
		var logs testdb.Buffer
		bc, err := idem.New(bp, &idem.Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		var runs sync.Map
		var wg sync.WaitGroup
		keys := scale(300, 3000)
		for k := range keys {
			for range 2 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					key := fmt.Sprintf("bouncer-%03d", k)
					for {
						_, err := bc.Do(ctx, "rec", key, func(context.Context) (any, error) {
							n, _ := runs.LoadOrStore(key, new(atomic.Int64))
							n.(*atomic.Int64).Add(1)
							return map[string]int{"k": k}, nil
						})
						if errors.Is(err, idem.ErrInProgress) {
							time.Sleep(5 * time.Millisecond)
							continue
						}
						if err != nil {
							t.Errorf("%s: %v", key, err)
						}
						return
					}
				}()
			}
		}
		wg.Wait()
		ran := 0
		runs.Range(func(k, v any) bool {
			ran++
			if v.(*atomic.Int64).Load() != 1 {
				t.Errorf("%s ran %d times through PgBouncer", k, v.(*atomic.Int64).Load())
			}
			return true
		})
		if ran != keys {
			t.Errorf("%d of %d keys ran", ran, keys)
		}
		if n := count(t, pool, `SELECT count(*)::int FROM idem.processed_events WHERE key LIKE 'bouncer-%' AND status <> 'completed'`); n != 0 {
			t.Fatalf("%d keys left not completed after their work ran", n)
		}
		// PgBouncer 1.21+ with max_prepared_statements keeps prepared
		// statements; before it, the client must have met the pooler's
		// refusal and switched to exec mode.
		switched := strings.Contains(logs.String(), "this client now uses pgx's exec mode")
		t.Logf("PgBouncer (transaction mode, pgx defaults): %d keys x 2 concurrent deliveries, each ran once, none left processing; switched to exec mode: %v", keys, switched)
	})
}

// TestClockSkew: the database's clock is 10 seconds ahead of or behind
// this process's. A 3-second lease (the source's policy) heartbeated while
// 7 seconds of work run must never lapse: a duplicate polling all along
// never acquires the key.
func TestClockSkew(t *testing.T) {
	t.Parallel()
	for name, skew := range map[string]string{"database ahead": "10 seconds", "database behind": "-10 seconds"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := testdb.Pool(t, testdb.New(t), 8)
			if _, err := pool.Exec(ctx, `
				CREATE OR REPLACE FUNCTION idem.clock() RETURNS timestamptz LANGUAGE sql VOLATILE
				AS $$ SELECT pg_catalog.clock_timestamp() + interval '`+skew+`' $$;
				INSERT INTO idem.policies (source, ttl, lease) VALUES ('skew', interval '1 hour', interval '3 seconds')`); err != nil {
				t.Fatal(err)
			}
			c, err := idem.New(pool, nil)
			if err != nil {
				t.Fatal(err)
			}
			var runs, stolen atomic.Int64
			done := make(chan struct{})
			var wg sync.WaitGroup
			wg.Add(1)
			other := testdb.Client(t, pool, nil)
			go func() { // the duplicate
				defer wg.Done()
				for {
					select {
					case <-done:
						return
					case <-time.After(200 * time.Millisecond):
					}
					cl, err := other.Claim(ctx, "skew", "evt")
					if err != nil {
						t.Error(err)
						return
					}
					if cl.Outcome == idem.Acquired {
						stolen.Add(1)
					}
				}
			}()
			_, err = c.Do(ctx, "skew", "evt", func(context.Context) (any, error) {
				runs.Add(1)
				time.Sleep(7 * time.Second)
				return "ok", nil
			})
			close(done)
			wg.Wait()
			if err != nil {
				t.Fatalf("Do: %v", err)
			}
			if stolen.Load() != 0 || runs.Load() != 1 {
				t.Fatalf("the lease lapsed: the duplicate acquired %d times, the work ran %d times", stolen.Load(), runs.Load())
			}
			t.Logf("clock %s: 7s of work under a 3s lease, duplicate polled every 200ms, acquired 0 times", skew)
		})
	}
}

// TestDuplicateBehindOpenTransaction: a duplicate of a key claimed inside
// a transaction that stays open waits at most its lock wait, then answers
// in progress; it never hangs on the transaction.
func TestDuplicateBehindOpenTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 8)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	held, err := c.WithTx(tx).Claim(ctx, "tx", "evt")
	if err != nil || held.Outcome != idem.Acquired {
		t.Fatalf("claim in the transaction: %+v %v", held, err)
	}
	for _, tc := range []struct {
		name   string
		client *idem.Client
		opts   []idem.ClaimOption
		bound  time.Duration
	}{
		{"default lock wait (5s)", c, nil, 5 * time.Second},
		{"Config.LockWait", testdb.Client(t, pool, &idem.Config{LockWait: 300 * time.Millisecond}), nil, 300 * time.Millisecond},
		{"WithLockWait(0)", c, []idem.ClaimOption{idem.WithLockWait(0)}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// A deadline far past the bound: a hang fails here, not by
			// timing the answer.
			cctx, cancel := context.WithTimeout(ctx, 60*time.Second)
			defer cancel()
			start := time.Now()
			cl, err := tc.client.Claim(cctx, "tx", "evt", tc.opts...)
			if err != nil || cl.Outcome != idem.InProgress {
				t.Fatalf("duplicate: %+v %v, want in_progress", cl, err)
			}
			if waited := time.Since(start); waited < tc.bound {
				t.Fatalf("answered after %v: it did not wait its lock wait %v", waited, tc.bound)
			}
		})
	}
	if err := c.WithTx(tx).Complete(ctx, "tx", "evt", held.Token, json.RawMessage(`1`)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if cl, err := c.Claim(ctx, "tx", "evt"); err != nil || cl.Outcome != idem.Completed {
		t.Fatalf("after commit: %+v %v, want completed", cl, err)
	}
}
