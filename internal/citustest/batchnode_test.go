package citustest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/sqlstate"
	"github.com/idemkit/idem/migrate"
)

// shardCalls returns the calls of the shards' function fn (claim_locked,
// claim_batch) on the workers since trackFunctions, once they reach want
// or 40 s have passed (statistics are flushed when a backend is idle).
func shardCalls(t *testing.T, pool *pgxpool.Pool, fn string, want int64) int64 {
	t.Helper()
	ctx := context.Background()
	var got int64
	for deadline := time.Now().Add(40 * time.Second); ; time.Sleep(time.Second) {
		if err := pool.QueryRow(ctx, `SELECT coalesce(sum(nullif(result, '')::bigint), 0) FROM run_command_on_workers(format(
			$$SELECT coalesce(sum(calls), 0) FROM pg_stat_user_functions WHERE schemaname ~ '^idem_shard_' AND funcname = %L$$, $1::text))`, fn).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got >= want || time.Now().After(deadline) {
			return got
		}
	}
}

// batchStates puts keys prefix+"-"+state in every state a batch answers
// differently and returns the batch over them (a key twice), and a
// transaction holding the lock of prefix+"-held" (a new key claimed in
// it), to roll back after the batch.
func batchStates(t *testing.T, pool *pgxpool.Pool, c *idem.Client, prefix string) ([]idem.BatchItem, pgx.Tx) {
	t.Helper()
	ctx := context.Background()
	k := func(s string) string { return prefix + "-" + s }
	claim := func(key string, opts ...idem.ClaimOption) *idem.Claim {
		cl, err := c.Claim(ctx, "c", key, opts...)
		if err != nil || cl.Outcome != idem.Acquired {
			t.Fatalf("claim %s: %+v %v", key, cl, err)
		}
		return cl
	}
	cl := claim(k("done"))
	if err := c.Complete(ctx, "c", cl.Key, cl.Token, json.RawMessage(`{"r":1}`)); err != nil {
		t.Fatal(err)
	}
	cl = claim(k("retry"))
	if err := c.Fail(ctx, "c", cl.Key, cl.Token, "try again", true); err != nil {
		t.Fatal(err)
	}
	cl = claim(k("gaveup"))
	if err := c.Fail(ctx, "c", cl.Key, cl.Token, "no", false); err != nil {
		t.Fatal(err)
	}
	claim(k("running"), idem.WithLease(time.Hour))
	cl = claim(k("fp"), idem.WithFingerprint("a"))
	if err := c.Complete(ctx, "c", cl.Key, cl.Token, json.RawMessage(`2`)); err != nil {
		t.Fatal(err)
	}
	claim(k("lapsed"), idem.WithLease(time.Second))
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if cl, err := c.WithTx(tx).Claim(ctx, "c", k("held")); err != nil || cl.Outcome != idem.Acquired {
		t.Fatalf("claim in an open transaction: %+v %v", cl, err)
	}
	items := []idem.BatchItem{{Key: k("new")}, {Key: k("done")}, {Key: k("retry")}, {Key: k("gaveup")},
		{Key: k("running")}, {Key: k("fp"), Fingerprint: "b"}, {Key: k("lapsed")}, {Key: k("held")}, {Key: k("new")}}
	for i := range 40 {
		items = append(items, idem.BatchItem{Key: k(fmt.Sprint("more", i))})
	}
	return items, tx
}

// answer is what a batch answers for an item, but its token (new for each
// acquisition).
func answer(cl *idem.Claim) string {
	return fmt.Sprintf("%s attempt=%d result=%s error=%q token=%v lease=%v", cl.Outcome, cl.Attempt, cl.Result, cl.Error,
		cl.Token != 0, cl.LeaseRemaining > 0)
}

// TestCitusBatchByNode (migration 30): in READ COMMITTED a node's keys are
// claimed as one batch: every shard's locked keys by the shard's
// claim_locked, none by the shards' copies of idem.claim_batch. Keys in
// every state (new, completed, failed for a retry and for good, running, a
// fingerprint mismatch, a lapsed lease, locked by an open transaction, a
// key twice) get the same answers there as through the copies (every
// claim_locked dropped: migration 28's path), and migrate.Citus makes
// them again; a SERIALIZABLE batch goes through the copies, and so does a
// redelivery in a read-only transaction (answered, nothing written); batches of
// both paths over the same keys, with the node's lock order, acquire each
// key once, without a deadlock; an undelegated call is refused (ID005).
func TestCitusBatchByNode(t *testing.T) {
	pool := setup(t)
	trackFunctions(t, pool)
	ctx := context.Background()
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	claimBoth := func(prefix string) []string {
		items, tx := batchStates(t, pool, c, prefix)
		defer tx.Rollback(ctx)
		time.Sleep(1100 * time.Millisecond) // the lapsed lease
		cls, err := c.ClaimBatch(ctx, "c", items, idem.WithLockWait(0))
		if err != nil {
			t.Fatalf("batch %s: %v", prefix, err)
		}
		out := make([]string, len(cls))
		for i, cl := range cls {
			if cl.Key != items[i].Key {
				t.Fatalf("batch %s item %d: key %s", prefix, i, cl.Key)
			}
			out[i] = strings.TrimPrefix(cl.Key, prefix) + ": " + answer(cl)
		}
		return out
	}

	node := claimBoth("n")
	if got := shardCalls(t, pool, "claim_locked", 1); got == 0 {
		t.Fatal("the batch ran no shard's claim_locked")
	}
	if got := shardCalls(t, pool, "claim_batch", 0); got != 0 {
		t.Fatalf("the batch in READ COMMITTED ran %d shards' copies of claim_batch, want 0", got)
	}

	if _, err := pool.Exec(ctx, `DO $$ DECLARE f regprocedure; BEGIN
		FOR f IN SELECT p.oid::regprocedure FROM pg_proc p WHERE p.proname = 'claim_locked' LOOP EXECUTE 'DROP FUNCTION ' || f; END LOOP; END $$`); err != nil {
		t.Fatal(err)
	}
	copies := claimBoth("c")
	if got := shardCalls(t, pool, "claim_batch", 1); got == 0 {
		t.Fatal("without claim_locked, the batch ran no shard's copy of claim_batch")
	}
	for i := range node {
		if node[i] != copies[i] {
			t.Errorf("item %d: %s by node, %s through the copies", i, node[i], copies[i])
		}
	}
	t.Logf("answers: %q", node[:9])
	var shards int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_dist_shard WHERE logicalrelid = 'idem.processed_events'::regclass`).Scan(&shards); err != nil {
		t.Fatal(err)
	}
	done, err := migrate.Citus(ctx, stdlib.OpenDBFromPool(pool))
	if err != nil || len(done) != 1 || !strings.Contains(done[0], fmt.Sprintf("made %d copies", shards)) {
		t.Fatalf("migrate.Citus after claim_locked was dropped: %q %v", done, err)
	}

	// SERIALIZABLE: through the copies.
	trackFunctions(t, pool)
	ser := pgx.TxOptions{IsoLevel: pgx.Serializable}
	if err := pgx.BeginTxFunc(ctx, pool, ser, func(tx pgx.Tx) error {
		cls, err := c.WithTx(tx).ClaimBatch(ctx, "c", []idem.BatchItem{{Key: "s1"}, {Key: "s2"}, {Key: "s3"}})
		for _, cl := range cls {
			if err == nil && cl.Outcome != idem.Acquired {
				err = fmt.Errorf("%s: %s", cl.Key, cl.Outcome)
			}
		}
		return err
	}); err != nil {
		t.Fatalf("a batch in SERIALIZABLE: %v", err)
	}
	if got := shardCalls(t, pool, "claim_batch", 1); got == 0 {
		t.Fatal("the SERIALIZABLE batch ran no shard's copy of claim_batch")
	}

	// A redelivery in a read-only transaction (as on a standby): answered
	// through the copies, which write nothing for it.
	if err := pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		cls, err := c.WithTx(tx).ClaimBatch(ctx, "c", []idem.BatchItem{{Key: "n-done"}, {Key: "c-done"}, {Key: "n-gaveup"}})
		if err == nil && (cls[0].Outcome != idem.Completed || cls[1].Outcome != idem.Completed || cls[2].Outcome != idem.Failed) {
			err = fmt.Errorf("answered %s, %s, %s", cls[0].Outcome, cls[1].Outcome, cls[2].Outcome)
		}
		return err
	}); err != nil {
		t.Fatalf("a redelivered batch in a read-only transaction: %v", err)
	}

	// Undelegated (the key from a subquery: the call runs on the
	// coordinator, which holds none of the shards).
	_, err = pool.Exec(ctx, `SELECT * FROM idem.citus_claim_batch((SELECT 'u1'), 'c', ARRAY['u1', 'u2'])`)
	if codeOf(err) != sqlstate.NotDelegated {
		t.Fatalf("an undelegated batch: %v, want %s", err, sqlstate.NotDelegated)
	}

	// Both paths at once over the same 300 keys, each client's batches in
	// another order: every key acquired once, no deadlock (a SERIALIZABLE
	// transaction that fails is retried; its acquisitions did not happen).
	all := keys("mix", 300)
	var mu sync.Mutex
	acquired := map[string]int{}
	var wg sync.WaitGroup
	errs := make(chan error, 6)
	for g := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for round := range 5 {
				items := make([]idem.BatchItem, 0, 100)
				for i := range 100 {
					items = append(items, idem.BatchItem{Key: all[(g*37+round*50+i*(g+1))%len(all)]})
				}
				var got []*idem.Claim
				for try := 0; ; try++ {
					opts := pgx.TxOptions{}
					if g%2 == 1 {
						opts = ser
					}
					err := pgx.BeginTxFunc(ctx, pool, opts, func(tx pgx.Tx) error {
						var err error
						got, err = c.WithTx(tx).ClaimBatch(ctx, "c", items)
						return err
					})
					if err == nil {
						break
					}
					if g%2 == 0 || try == 20 {
						errs <- err
						return
					}
				}
				mu.Lock()
				for _, cl := range got {
					if cl.Outcome == idem.Acquired {
						acquired[cl.Key]++
					}
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("a batch of the mix: %v", err)
	}
	for k, n := range acquired {
		if n != 1 {
			t.Errorf("key %s acquired %d times", k, n)
		}
	}
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE source = 'c' AND key = ANY($1)`, all).Scan(&rows); err != nil || rows != len(acquired) {
		t.Fatalf("%d rows for %d acquired keys (%v)", rows, len(acquired), err)
	}
	t.Logf("%d of the 300 keys acquired by the mixed batches", len(acquired))
}
