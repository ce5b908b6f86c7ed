package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// setup returns a pool on a fresh migrated database and a client over it.
func setup(t *testing.T) (*pgxpool.Pool, *idem.Client) {
	t.Helper()
	pool := testdb.Pool(t, testdb.New(t), 0)
	return pool, testdb.Client(t, pool, nil)
}

func TestClaimLifecycle(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, c := setup(t)

	first, err := c.Claim(ctx, "stripe", "evt_1")
	if err != nil {
		t.Fatal(err)
	}
	if first.Outcome != idem.Acquired || first.Token == 0 || first.Attempt != 1 {
		t.Fatalf("first claim = %+v, want acquired with a token", first)
	}
	dup, err := c.Claim(ctx, "stripe", "evt_1")
	if err != nil {
		t.Fatal(err)
	}
	if dup.Outcome != idem.InProgress || dup.Token != 0 {
		t.Fatalf("duplicate while in flight = %+v, want in_progress without a token", dup)
	}
	result := json.RawMessage(`{"charged": 4200,   "currency":"eur", "z":[1, 2.50]}`)
	if err := c.Complete(ctx, "stripe", "evt_1", first.Token, result); err != nil {
		t.Fatal(err)
	}
	done, err := c.Claim(ctx, "stripe", "evt_1")
	if err != nil {
		t.Fatal(err)
	}
	if done.Outcome != idem.Completed {
		t.Fatalf("after complete = %+v, want completed", done)
	}
	var got, want any
	_ = json.Unmarshal(done.Result, &got)
	_ = json.Unmarshal(result, &want)
	if string(mustJSON(t, got)) != string(mustJSON(t, want)) {
		t.Fatalf("replayed result %s, want %s", done.Result, result)
	}
	// Completing again with the same token is a no-op success.
	if err := c.Complete(ctx, "stripe", "evt_1", first.Token, result); err != nil {
		t.Fatalf("second complete with the same token: %v", err)
	}
	if err := c.Complete(ctx, "stripe", "evt_1", first.Token+1000, result); !errors.Is(err, idem.ErrStaleToken) {
		t.Fatalf("complete with another token: %v, want ErrStaleToken", err)
	}
	if err := c.Complete(ctx, "stripe", "nope", 1, nil); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("complete of an unknown key: %v, want ErrNotFound", err)
	}
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
