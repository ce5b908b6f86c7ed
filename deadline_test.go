package idem_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestWaitDeadlineMidClaim: a waiting duplicate whose original failed
// claims the key again; that claim waits for the key's lock (another
// transaction holds it) while the wait's deadline passes, and commits once
// the lock is free. The claim is allowed to finish: the duplicate runs the
// work, and the key is not left held by a claim no one knows of (before,
// Do answered ErrInProgress and the committed claim ran nothing until its
// lease ended).
func TestWaitDeadlineMidClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, c := setup(t)

	orig, err := c.Claim(ctx, "wd", "k")
	if err != nil || orig.Outcome != idem.Acquired {
		t.Fatalf("%+v %v", orig, err)
	}
	const wait = 1500 * time.Millisecond
	start := time.Now()
	var runs atomic.Int32
	type answer struct {
		res *idem.Result
		err error
	}
	done := make(chan answer, 1)
	go func() {
		res, err := c.Do(ctx, "wd", "k", func(context.Context) (any, error) {
			runs.Add(1)
			return map[string]int{"n": 1}, nil
		}, idem.WithWait(wait))
		done <- answer{res, err}
	}()
	// The duplicate waits; another transaction's claim takes the key's
	// lock (answering in progress), then the original fails.
	time.Sleep(100 * time.Millisecond)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if cl, err := c.WithTx(tx).Claim(ctx, "wd", "k"); err != nil || cl.Outcome != idem.InProgress {
		t.Fatalf("%+v %v", cl, err)
	}
	if err := c.Fail(ctx, "wd", "k", orig.Token, "try again", true); err != nil {
		t.Fatal(err)
	}
	// The duplicate's claim now waits for the lock; its wait's deadline
	// passes meanwhile.
	deadline := time.Now().Add(10 * time.Second)
	for {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*)::int FROM pg_stat_activity
		    WHERE datname = current_database() AND state = 'active' AND query LIKE '%idem.claim(%' AND pid <> pg_backend_pid()`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the duplicate never claimed again")
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(time.Until(start.Add(wait + 500*time.Millisecond))) // past the wait's deadline
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	a := <-done
	if a.err != nil || runs.Load() != 1 {
		t.Fatalf("Do: %+v %v; the work ran %d times", a.res, a.err, runs.Load())
	}
	cl, err := c.Claim(ctx, "wd", "k")
	if err != nil || cl.Outcome != idem.Completed {
		t.Fatalf("after: %+v %v", cl, err)
	}
	if errors.Is(a.err, idem.ErrInProgress) {
		t.Fatal("in progress")
	}
}
