package idem_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// TestCrashedWorkerLosesKey: a worker acquires and never completes (it
// died). After its lease the next delivery re-acquires, exactly once among
// racing deliveries, and the dead worker's late complete is fenced off.
func TestCrashedWorkerLosesKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	now := time.Now()
	dead, err := idem.New(testdb.PoolAt(t, url, 2, now), nil)
	if err != nil {
		t.Fatal(err)
	}
	first, err := dead.Claim(ctx, "queue", "job-1", idem.WithLease(30*time.Second))
	if err != nil || first.Outcome != idem.Acquired {
		t.Fatalf("claim: %+v %v", first, err)
	}

	// Still within the lease: everyone else is told to wait.
	during, err := idem.New(testdb.PoolAt(t, url, 2, now.Add(29*time.Second)), nil)
	if err != nil {
		t.Fatal(err)
	}
	if cl, err := during.Claim(ctx, "queue", "job-1"); err != nil || cl.Outcome != idem.InProgress {
		t.Fatalf("claim within the lease: %+v %v, want in_progress", cl, err)
	}

	// After the lease: 16 deliveries race for the key; one wins.
	after, err := idem.New(testdb.PoolAt(t, url, 16, now.Add(31*time.Second)), nil)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu     sync.Mutex
		winner *idem.Claim
		wins   int
		wg     sync.WaitGroup
	)
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cl, err := after.Claim(ctx, "queue", "job-1")
			if err != nil {
				t.Error(err)
				return
			}
			if cl.Outcome == idem.Acquired {
				mu.Lock()
				winner, wins = cl, wins+1
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if wins != 1 {
		t.Fatalf("%d deliveries re-acquired the lapsed key, want exactly 1", wins)
	}
	if winner.Attempt != 2 || winner.Token == first.Token {
		t.Fatalf("re-acquired claim %+v: want attempt 2 and a new token", winner)
	}

	// The dead worker wakes up: all its calls are fenced off.
	if err := dead.Complete(ctx, "queue", "job-1", first.Token, []byte(`{"late":true}`)); !errors.Is(err, idem.ErrStaleToken) {
		t.Fatalf("late complete: %v, want ErrStaleToken", err)
	}
	if err := dead.Fail(ctx, "queue", "job-1", first.Token, "late", true); !errors.Is(err, idem.ErrStaleToken) {
		t.Fatalf("late fail: %v, want ErrStaleToken", err)
	}
	if _, err := dead.Extend(ctx, "queue", "job-1", first.Token, time.Minute); !errors.Is(err, idem.ErrStaleToken) {
		t.Fatalf("late extend: %v, want ErrStaleToken", err)
	}
	if err := after.Complete(ctx, "queue", "job-1", winner.Token, []byte(`{"by":"second"}`)); err != nil {
		t.Fatal(err)
	}
	cl, err := after.Claim(ctx, "queue", "job-1")
	if err != nil || cl.Outcome != idem.Completed || string(cl.Result) != `{"by": "second"}` {
		t.Fatalf("after completion: %+v %v", cl, err)
	}
}

// TestWorkerDiesInsideTransaction: the worker's connection is killed while
// its transaction holds the claim; the claim rolls back with it and the
// key is free at once, not after the lease.
func TestWorkerDiesInsideTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 4)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	cl, err := c.WithTx(tx).Claim(ctx, "queue", "job-2")
	if err != nil || cl.Outcome != idem.Acquired {
		t.Fatalf("claim: %+v %v", cl, err)
	}
	var pid int
	if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	// A duplicate delivery now waits on the claim's transaction...
	got := make(chan *idem.Claim, 1)
	go func() {
		cl, err := c.Claim(ctx, "queue", "job-2")
		if err != nil {
			t.Error(err)
		}
		got <- cl
	}()
	time.Sleep(200 * time.Millisecond)
	// ...until the worker's backend is killed mid-transaction.
	if _, err := pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	if dup := <-got; dup == nil || dup.Outcome != idem.Acquired || dup.Attempt != 1 {
		t.Fatalf("delivery after the worker died: %+v, want a fresh acquisition", dup)
	}
	_ = tx.Rollback(ctx)
}

// TestRetryableAndPermanentFailures covers idem.fail and max_attempts.
func TestRetryableAndPermanentFailures(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, c := setup(t)

	cl, _ := c.Claim(ctx, "shopify", "order-1")
	if err := c.Fail(ctx, "shopify", "order-1", cl.Token, "upstream 503", true); err != nil {
		t.Fatal(err)
	}
	again, err := c.Claim(ctx, "shopify", "order-1")
	if err != nil || again.Outcome != idem.Acquired || again.Attempt != 2 || again.Error != "upstream 503" {
		t.Fatalf("after a retryable failure: %+v %v, want acquired, attempt 2, previous error", again, err)
	}
	if err := c.Fail(ctx, "shopify", "order-1", again.Token, "card declined", false); err != nil {
		t.Fatal(err)
	}
	final, err := c.Claim(ctx, "shopify", "order-1")
	if err != nil || final.Outcome != idem.Failed || final.Error != "card declined" {
		t.Fatalf("after a permanent failure: %+v %v", final, err)
	}

	// A poison key: after max_attempts the key fails for good.
	if _, err := pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease, max_attempts) VALUES ('poison', '1 day', '1 minute', 3)`); err != nil {
		t.Fatal(err)
	}
	for attempt := 1; attempt <= 3; attempt++ {
		cl, err := c.Claim(ctx, "poison", "msg")
		if err != nil || cl.Outcome != idem.Acquired || cl.Attempt != attempt {
			t.Fatalf("attempt %d: %+v %v", attempt, cl, err)
		}
		if err := c.Fail(ctx, "poison", "msg", cl.Token, fmt.Sprintf("boom %d", attempt), true); err != nil {
			t.Fatal(err)
		}
	}
	gaveUp, err := c.Claim(ctx, "poison", "msg")
	if err != nil || gaveUp.Outcome != idem.Failed || gaveUp.Error != "idem: gave up after 3 attempts; last error: boom 3" {
		t.Fatalf("after max_attempts: %+v %v", gaveUp, err)
	}
}

// TestExtendKeepsLease: a heartbeat pushes the lease so a slow worker keeps
// its key.
func TestExtendKeepsLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	now := time.Now()
	w, err := idem.New(testdb.PoolAt(t, url, 2, now), nil)
	if err != nil {
		t.Fatal(err)
	}
	cl, _ := w.Claim(ctx, "queue", "slow", idem.WithLease(10*time.Second))
	later, err := idem.New(testdb.PoolAt(t, url, 2, now.Add(8*time.Second)), nil)
	if err != nil {
		t.Fatal(err)
	}
	until, err := later.Extend(ctx, "queue", "slow", cl.Token, 10*time.Second)
	if err != nil || !until.After(now.Add(17*time.Second)) {
		t.Fatalf("extend: %v %v", until, err)
	}
	past, err := idem.New(testdb.PoolAt(t, url, 2, now.Add(15*time.Second)), nil)
	if err != nil {
		t.Fatal(err)
	}
	if dup, err := past.Claim(ctx, "queue", "slow"); err != nil || dup.Outcome != idem.InProgress {
		t.Fatalf("claim after the original lease but within the extension: %+v %v", dup, err)
	}
	if _, err := later.Extend(ctx, "queue", "nope", cl.Token, 0); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("extend unknown key: %v", err)
	}
}

// TestExpiredKeyIsNewAgain: once a key's retention has passed it is
// claimable as new, in the current month's partition.
func TestExpiredKeyIsNewAgain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	now := time.Now()
	old, err := idem.New(testdb.PoolAt(t, url, 2, now.Add(-2*time.Hour)), nil)
	if err != nil {
		t.Fatal(err)
	}
	cl, _ := old.Claim(ctx, "forms", "submit-1", idem.WithTTL(time.Hour), idem.WithLease(time.Minute))
	if err := old.Complete(ctx, "forms", "submit-1", cl.Token, []byte(`1`)); err != nil {
		t.Fatal(err)
	}
	c, err := idem.New(testdb.PoolAt(t, url, 2, now), nil)
	if err != nil {
		t.Fatal(err)
	}
	fresh, err := c.Claim(ctx, "forms", "submit-1")
	if err != nil || fresh.Outcome != idem.Acquired || fresh.Attempt != 1 || fresh.Token == cl.Token {
		t.Fatalf("claim after expiry: %+v %v, want a fresh acquisition", fresh, err)
	}
	// The stale token of the expired incarnation cannot touch the new one.
	if err := c.Complete(ctx, "forms", "submit-1", cl.Token, nil); !errors.Is(err, idem.ErrStaleToken) {
		t.Fatalf("complete with the expired incarnation's token: %v", err)
	}
}

func TestFingerprintMismatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, c := setup(t)
	fp1 := idem.Fingerprint([]byte("POST"), []byte("/orders"), []byte(`{"qty":1}`))
	fp2 := idem.Fingerprint([]byte("POST"), []byte("/orders"), []byte(`{"qty":2}`))
	cl, _ := c.Claim(ctx, "api", "idem-key-1", idem.WithFingerprint(fp1))
	if cl.Outcome != idem.Acquired {
		t.Fatalf("%+v", cl)
	}
	if got, _ := c.Claim(ctx, "api", "idem-key-1", idem.WithFingerprint(fp2)); got.Outcome != idem.Mismatch {
		t.Fatalf("different fingerprint while in flight: %s, want mismatch", got.Outcome)
	}
	if err := c.Complete(ctx, "api", "idem-key-1", cl.Token, []byte(`{"order":7}`)); err != nil {
		t.Fatal(err)
	}
	if got, _ := c.Claim(ctx, "api", "idem-key-1", idem.WithFingerprint(fp2)); got.Outcome != idem.Mismatch {
		t.Fatalf("different fingerprint after completion: %s, want mismatch", got.Outcome)
	}
	if got, _ := c.Claim(ctx, "api", "idem-key-1", idem.WithFingerprint(fp1)); got.Outcome != idem.Completed {
		t.Fatalf("same fingerprint after completion: %s, want completed", got.Outcome)
	}
}

// TestLeaseLostIsReported: while Do's work runs, its lease lapses (here a
// worker whose clock is an hour ahead sees it lapsed) and another worker
// takes the key over. The heartbeat's extend then fails, the work's context
// is cancelled with ErrLeaseLost as its cause, and Do returns ErrLeaseLost,
// whether the work stops when told or ignores its context and returns a
// result that can no longer be recorded. The other worker's run is the one
// that counts.
func TestLeaseLostIsReported(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	first, err := idem.New(testdb.Pool(t, url, 4), nil)
	if err != nil {
		t.Fatal(err)
	}
	later, err := idem.New(testdb.PoolAt(t, url, 4, time.Now().Add(time.Hour)), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, honoursCtx := range []bool{true, false} {
		t.Run(fmt.Sprintf("work honours ctx %v", honoursCtx), func(t *testing.T) {
			t.Parallel()
			key := fmt.Sprintf("job-%v", honoursCtx)
			takenOver := make(chan struct{})
			var cause error
			_, err := first.Do(ctx, "queue", key, func(ctx context.Context) (any, error) {
				cl, err := later.Claim(context.Background(), "queue", key)
				if err != nil || cl.Outcome != idem.Acquired {
					t.Errorf("the other worker's claim: %+v %v", cl, err)
				}
				close(takenOver)
				if honoursCtx {
					select {
					case <-ctx.Done():
						cause = context.Cause(ctx)
						return nil, ctx.Err()
					case <-time.After(10 * time.Second):
						return nil, errors.New("the heartbeat never noticed the lease was lost")
					}
				}
				time.Sleep(1500 * time.Millisecond) // past a heartbeat
				return "done anyway", nil
			}, idem.WithLease(time.Second))
			<-takenOver
			if !errors.Is(err, idem.ErrLeaseLost) {
				t.Fatalf("Do after a lost lease: %v, want ErrLeaseLost", err)
			}
			if honoursCtx && !errors.Is(cause, idem.ErrLeaseLost) {
				t.Fatalf("the work's context cause: %v, want ErrLeaseLost", cause)
			}
			// The other worker's claim holds the key: this run recorded nothing.
			cl, err := later.Claim(ctx, "queue", key)
			if err != nil || cl.Outcome != idem.InProgress {
				t.Fatalf("after the lost run: %+v %v, want the other worker's lease in progress", cl, err)
			}
		})
	}
}
