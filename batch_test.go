package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"

	"github.com/idemkit/idem"
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
	_ = fmt.Sprint
}
