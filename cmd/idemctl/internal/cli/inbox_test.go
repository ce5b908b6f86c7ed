package cli

import (
	"context"
	"errors"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
)

// TestInboxCommands: migrate up applies River's migrations; a poison event
// is dead-lettered, counted by stats, listed with its error, replayed after
// the fix and processed once; replaying it again does nothing. Bad flags
// are usage errors.
func TestInboxCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.NewEmpty(t)
	env := map[string]string{"DATABASE_URL": url}
	if r := idemctl(t, ctx, env, "migrate", "up"); r.code != 0 || !strings.Contains(r.out, "applied River migrations") {
		t.Fatalf("migrate up: %d\n%s%s", r.code, r.out, r.errout)
	}
	if r := idemctl(t, ctx, env, "migrate", "up"); r.code != 0 || !strings.Contains(r.out, "River schema is up to date") {
		t.Fatalf("migrate up again: %d\n%s%s", r.code, r.out, r.errout)
	}
	pool := testdb.Pool(t, url, 8)
	var fixed atomic.Bool
	var ran atomic.Int64
	in, err := inbox.New(inbox.Config{Pool: pool, MaxAttempts: map[string]int{"shop": 1}, Handler: func(ctx context.Context, _ pgx.Tx, d *inbox.Delivery) (any, error) {
		if !fixed.Load() {
			return nil, errors.New("no such product: sku-42")
		}
		ran.Add(1)
		return nil, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: "order-1", EventType: "orders/create", Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	rc, err := in.NewWorkerClient(2, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer rc.Stop(ctx)
	wait := func(what string, cond func() bool) {
		for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
		}
	}
	wait("the dead letter", func() bool { d, _ := in.DeadLetters(ctx, inbox.Filter{}); return len(d) == 1 })

	if r := idemctl(t, ctx, env, "stats"); r.code != 0 || !strings.Contains(r.out, "INBOX SOURCE") || !regexpLine(r.out, `^shop\s+1\s+0\s+1\s+0\s+0\s+0\s+0\s+true\s*$`) {
		t.Fatalf("stats: %d\n%s", r.code, r.out)
	}
	r := idemctl(t, ctx, env, "inbox", "list", "--source", "shop")
	if r.code != 0 || !strings.Contains(r.out, "order-1") || !strings.Contains(r.out, "no such product: sku-42") || !strings.Contains(r.out, "orders/create") {
		t.Fatalf("inbox list: %d\n%s%s", r.code, r.out, r.errout)
	}
	if r := idemctl(t, ctx, env, "inbox", "list", "--since", "1h", "--json"); r.code != 0 || !strings.Contains(r.out, `"key": "order-1"`) {
		t.Fatalf("inbox list --since --json: %d\n%s%s", r.code, r.out, r.errout)
	}
	if r := idemctl(t, ctx, env, "inbox", "replay", "--source", "shop", "--dry-run"); r.code != 0 || !strings.Contains(r.out, "would replay 1") {
		t.Fatalf("replay --dry-run: %d\n%s%s", r.code, r.out, r.errout)
	}
	fixed.Store(true)
	if r := idemctl(t, ctx, env, "inbox", "replay", "--source", "shop", "--key", "order-1"); r.code != 0 || !strings.HasPrefix(r.out, "replayed shop/order-1") {
		t.Fatalf("replay: %d\n%s%s", r.code, r.out, r.errout)
	}
	wait("the replay processed", func() bool { return ran.Load() == 1 })
	if r := idemctl(t, ctx, env, "inbox", "replay", "--source", "shop", "--key", "order-1"); r.code != 0 || !strings.Contains(r.out, "no dead letters to replay") {
		t.Fatalf("second replay: %d\n%s%s", r.code, r.out, r.errout)
	}
	time.Sleep(100 * time.Millisecond)
	if ran.Load() != 1 {
		t.Fatalf("processed %d times", ran.Load())
	}

	for _, args := range [][]string{
		{"inbox"},
		{"inbox", "purge"},
		{"inbox", "replay"},
		{"inbox", "list", "--key", "k"},
		{"inbox", "list", "--since", "yesterday"},
		{"inbox", "list", "--since", "-1h"},
		{"inbox", "list", "extra"},
	} {
		if r := idemctl(t, ctx, env, args...); r.code != ExitUsage {
			t.Errorf("%v: exit %d, want %d\n%s", args, r.code, ExitUsage, r.errout)
		}
	}
}

// regexpLine reports whether a line of out matches re.
func regexpLine(out, re string) bool {
	return regexp.MustCompile(`(?m)` + re).MatchString(out)
}
