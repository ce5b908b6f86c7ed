package idem_test

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

func TestDoRunsOncePerKeyUnderRace(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, testdb.New(t), raceConns)
	warm(t, pool)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	const keys = 300
	var runs sync.Map
	storm(t, keys, func(ctx context.Context, _ int, d delivery) error {
		res, err := c.Do(ctx, "svix", d.key, func(ctx context.Context) (any, error) {
			n, _ := runs.LoadOrStore(d.key, new(atomic.Int64))
			n.(*atomic.Int64).Add(1)
			time.Sleep(time.Millisecond)
			return map[string]string{"key": d.key}, nil
		})
		switch {
		case errors.Is(err, idem.ErrInProgress):
			return nil
		case err != nil:
			return err
		}
		var got map[string]string
		if err := json.Unmarshal(res.Result, &got); err != nil || got["key"] != d.key {
			return fmt.Errorf("result for %s: %s (%v)", d.key, res.Result, err)
		}
		return nil
	})
	count := 0
	runs.Range(func(k, v any) bool {
		count++
		if n := v.(*atomic.Int64).Load(); n != 1 {
			t.Errorf("work for %s ran %d times", k, n)
		}
		return true
	})
	if count != keys {
		t.Fatalf("work ran for %d keys, want %d", count, keys)
	}
}

func TestDoOutcomes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, c := setup(t)

	t.Run("replay", func(t *testing.T) {
		runs := 0
		work := func(context.Context) (any, error) { runs++; return map[string]int{"n": 42}, nil }
		first, err := c.Do(ctx, "s", "replay", work)
		if err != nil || first.Replayed || string(first.Result) != `{"n": 42}` {
			t.Fatalf("first: %+v %v", first, err)
		}
		second, err := c.Do(ctx, "s", "replay", work)
		if err != nil || !second.Replayed || string(second.Result) != `{"n": 42}` || runs != 1 {
			t.Fatalf("second: %+v %v runs=%d", second, err, runs)
		}
	})
	t.Run("error releases for retry", func(t *testing.T) {
		boom := errors.New("upstream down")
		_, err := c.Do(ctx, "s", "retry", func(context.Context) (any, error) { return nil, boom })
		if !errors.Is(err, boom) {
			t.Fatalf("got %v, want the work's error", err)
		}
		res, err := c.Do(ctx, "s", "retry", func(context.Context) (any, error) { return "ok", nil })
		if err != nil || res.Replayed || res.Claim.Attempt != 2 {
			t.Fatalf("retry: %+v %v", res, err)
		}
	})
	t.Run("permanent", func(t *testing.T) {
		_, err := c.Do(ctx, "s", "perm", func(context.Context) (any, error) {
			return nil, idem.Permanent(errors.New("card declined"))
		})
		if err == nil {
			t.Fatal("want the work's error")
		}
		_, err = c.Do(ctx, "s", "perm", func(context.Context) (any, error) { t.Error("ran again"); return nil, nil })
		var fe *idem.FailedError
		if !errors.Is(err, idem.ErrFailed) || !errors.As(err, &fe) || fe.Message != "card declined" {
			t.Fatalf("got %v, want FailedError(card declined)", err)
		}
	})
	t.Run("panic is recovered and released", func(t *testing.T) {
		_, err := c.Do(ctx, "s", "panic", func(context.Context) (any, error) { panic("nil map") })
		var pe *idem.PanicError
		if !errors.As(err, &pe) || pe.Value != "nil map" || len(pe.Stack) == 0 {
			t.Fatalf("got %v, want a *PanicError", err)
		}
		res, err := c.Do(ctx, "s", "panic", func(context.Context) (any, error) { return 1, nil })
		if err != nil || res.Claim.Attempt != 2 {
			t.Fatalf("after the panic: %+v %v", res, err)
		}
	})
	t.Run("in progress", func(t *testing.T) {
		cl, _ := c.Claim(ctx, "s", "busy")
		res, err := c.Do(ctx, "s", "busy", func(context.Context) (any, error) { t.Error("ran"); return nil, nil })
		if !errors.Is(err, idem.ErrInProgress) || res.Claim.LeaseExpiresAt.Before(time.Now()) {
			t.Fatalf("got %+v %v, want ErrInProgress with the lease end", res, err)
		}
		_ = c.Complete(ctx, "s", "busy", cl.Token, nil)
	})
	t.Run("mismatch", func(t *testing.T) {
		_, _ = c.Do(ctx, "s", "fp", func(context.Context) (any, error) { return 1, nil }, idem.WithFingerprint("a"))
		_, err := c.Do(ctx, "s", "fp", func(context.Context) (any, error) { return 1, nil }, idem.WithFingerprint("b"))
		if !errors.Is(err, idem.ErrMismatch) {
			t.Fatalf("got %v, want ErrMismatch", err)
		}
	})
}

// TestDoHeartbeat: work that outlives its lease keeps the key because Do
// extends the lease; duplicates meanwhile are told it is in progress.
func TestDoHeartbeat(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, c := setup(t)
	started := make(chan struct{})
	done := make(chan error)
	go func() {
		_, err := c.Do(ctx, "s", "slow", func(ctx context.Context) (any, error) {
			close(started)
			select {
			case <-time.After(3 * time.Second): // three leases long
				return "done", nil
			case <-ctx.Done():
				return nil, context.Cause(ctx)
			}
		}, idem.WithLease(time.Second))
		done <- err
	}()
	<-started
	deadline := time.Now().Add(2800 * time.Millisecond)
	for time.Now().Before(deadline) {
		cl, err := c.Claim(ctx, "s", "slow")
		if err != nil || cl.Outcome != idem.InProgress {
			t.Fatalf("duplicate during slow work: %+v %v, want in_progress", cl, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestDatabaseSQL runs the protocol through database/sql, alone and inside
// a *sql.Tx.
func TestDatabaseSQL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := sql.Open("pgx", testdb.New(t))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	c, err := idem.NewSQL(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	cl, err := c.Claim(ctx, "stripe", "evt_sql", idem.WithTTL(72*time.Hour), idem.WithEventType("invoice.paid"))
	if err != nil || cl.Outcome != idem.Acquired || cl.LeaseExpiresAt.IsZero() || cl.Result != nil {
		t.Fatalf("claim: %+v %v", cl, err)
	}
	if until, err := c.Extend(ctx, "stripe", "evt_sql", cl.Token, time.Minute); err != nil || until.IsZero() {
		t.Fatalf("extend: %v %v", until, err)
	}
	if err := c.Complete(ctx, "stripe", "evt_sql", cl.Token, []byte(`{"a": 1}`)); err != nil {
		t.Fatal(err)
	}
	dup, err := c.Claim(ctx, "stripe", "evt_sql")
	if err != nil || dup.Outcome != idem.Completed || string(dup.Result) != `{"a": 1}` || !dup.LeaseExpiresAt.IsZero() {
		t.Fatalf("duplicate: %+v %v", dup, err)
	}

	if _, err := db.ExecContext(ctx, `CREATE TABLE ledger (event_id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	res, err := c.WithSQLTx(tx).Do(ctx, "stripe", "evt_tx", func(ctx context.Context) (any, error) {
		_, err := tx.ExecContext(ctx, `INSERT INTO ledger VALUES ('evt_tx')`)
		return "booked", err
	})
	if err != nil || string(res.Result) != `"booked"` {
		t.Fatalf("Do in *sql.Tx: %+v %v", res, err)
	}
	// Rolled back: neither the claim nor the ledger row happened.
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	again, err := c.Claim(ctx, "stripe", "evt_tx")
	if err != nil || again.Outcome != idem.Acquired || again.Attempt != 1 {
		t.Fatalf("after rollback: %+v %v, want a fresh acquisition", again, err)
	}
	var n int
	_ = db.QueryRowContext(ctx, `SELECT count(*) FROM ledger`).Scan(&n)
	if n != 0 {
		t.Fatalf("ledger has %d rows after rollback", n)
	}
}

// TestResultReplayedByteForByte: every duplicate gets the same bytes, and
// a result given in jsonb's normal form (keys by length, then bytes; one
// space after ':' and ',') comes back exactly as given.
func TestResultReplayedByteForByte(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, c := setup(t)
	results := []string{
		`{"x": null, "note": "naïve ☕ \"quoted\" \\ back\nslash", "tags": ["a", "b"], "amount": 12345678901234567890.1234567890, "currency": "eur"}`,
		`"just a string with \u0001 control"`,
		`[1, 2.50, -1, 1e+100]`,
	}
	for i, want := range results {
		key := fmt.Sprintf("evt_%d", i)
		cl, _ := c.Claim(ctx, "stripe", key)
		if err := c.Complete(ctx, "stripe", key, cl.Token, json.RawMessage(want)); err != nil {
			t.Fatal(err)
		}
		var first []byte
		for d := range 5 {
			dup, err := c.Claim(ctx, "stripe", key)
			if err != nil || dup.Outcome != idem.Completed {
				t.Fatalf("%+v %v", dup, err)
			}
			if d == 0 {
				first = dup.Result
			} else if string(dup.Result) != string(first) {
				t.Fatalf("duplicate %d got %s, earlier %s", d, dup.Result, first)
			}
		}
		var a, b any
		_ = json.Unmarshal(first, &a)
		_ = json.Unmarshal([]byte(want), &b)
		if fmt.Sprint(a) != fmt.Sprint(b) {
			t.Fatalf("replayed %s, stored %s", first, want)
		}
		if i == 0 && string(first) != want {
			t.Fatalf("normal-form result changed:\n got %s\nwant %s", first, want)
		}
	}
}

// TestDoSameBytes: Do gives the call whose work ran the very bytes its
// duplicates get (the stored, jsonb form), for a value, a json.RawMessage
// in another form, and nil, on a pool, in a pgx.Tx and through
// database/sql (alone and in a *sql.Tx); DoValue decodes the same value
// for both.
func TestDoSameBytes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 4)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	type invoice struct {
		ID     string   `json:"id"`
		Amount int      `json:"amount"`
		Tags   []string `json:"tags"`
	}
	values := map[string]any{
		"struct": invoice{ID: "in_1", Amount: 4200, Tags: []string{"b", "a"}},
		"raw":    json.RawMessage(`{ "zz":1,"a" : [1,2.50],"a":"dup" }`),
		"nil":    nil,
	}
	modes := map[string]func(t *testing.T) (*idem.Client, func()){
		"pool": func(*testing.T) (*idem.Client, func()) { return c, func() {} },
		"pgx.Tx": func(t *testing.T) (*idem.Client, func()) {
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			return c.WithTx(tx), func() { _ = tx.Commit(ctx) }
		},
		"sql.DB": func(t *testing.T) (*idem.Client, func()) {
			c, err := idem.NewSQL(db, nil)
			if err != nil {
				t.Fatal(err)
			}
			return c, func() {}
		},
		"sql.Tx": func(t *testing.T) (*idem.Client, func()) {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			c, err := idem.NewSQL(db, nil)
			if err != nil {
				t.Fatal(err)
			}
			return c.WithSQLTx(tx), func() { _ = tx.Commit() }
		},
	}
	for mode, open := range modes {
		for name, v := range values {
			t.Run(mode+"/"+name, func(t *testing.T) {
				key := mode + "/" + name
				cc, commit := open(t)
				first, err := cc.Do(ctx, "same", key, func(context.Context) (any, error) { return v, nil })
				commit()
				if err != nil {
					t.Fatal(err)
				}
				dup, err := c.Do(ctx, "same", key, func(context.Context) (any, error) { t.Fatal("ran twice"); return nil, nil })
				if err != nil || !dup.Replayed {
					t.Fatalf("duplicate: %+v %v", dup, err)
				}
				if !bytes.Equal(first.Result, dup.Result) || (v == nil) != (first.Result == nil) {
					t.Fatalf("first caller got %q, duplicates %q", first.Result, dup.Result)
				}
			})
		}
	}
	// DoValue: the same value for the first call and for a duplicate.
	want := invoice{ID: "in_2", Amount: 1, Tags: []string{"x"}}
	for i := range 2 {
		got, err := idem.DoValue(ctx, c, "same", "typed", func(context.Context) (invoice, error) { return want, nil })
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Fatalf("DoValue call %d: %+v %v", i+1, got, err)
		}
	}
	// A result too large to store: the first call and its duplicates say so.
	big := func(context.Context) (string, error) { return strings.Repeat("x", 2<<20), nil }
	for i := range 2 {
		if got, err := idem.DoValue(ctx, c, "same", "big", big); !errors.Is(err, idem.ErrResultNotStored) || got != "" {
			t.Fatalf("DoValue of an unstorable result, call %d: %q… %v", i+1, got[:min(len(got), 8)], err)
		}
	}
	// A stored result that is not a T.
	if _, err := idem.DoValue(ctx, c, "same", "typed", func(context.Context) (int, error) { return 0, nil }); err == nil || !strings.Contains(err.Error(), "decode the stored result") {
		t.Fatalf("DoValue into the wrong type: %v", err)
	}
}
