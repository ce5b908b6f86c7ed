package cli

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
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

// TestInboxReplayEveryDeadLetter (issue 52): after an outage that left
// 1,200 dead letters, one `idemctl inbox replay` replays all 1,200 (it
// stopped at the 1,000 oldest and exited 0), and --dry-run says 1,200. A
// dead letter replay must leave as it is (its payload gone) is counted
// with its reason, and the run exits 8 (ExitLeft). list shows every one,
// newest first, and with --limit says how many it did not show.
func TestInboxReplayEveryDeadLetter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.NewEmpty(t)
	env := map[string]string{"DATABASE_URL": url}
	if r := idemctl(t, ctx, env, "migrate", "up"); r.code != 0 {
		t.Fatalf("migrate up: %d\n%s%s", r.code, r.out, r.errout)
	}
	pool := testdb.Pool(t, url, 20)
	in, err := inbox.New(inbox.Config{Pool: pool, Handler: func(context.Context, pgx.Tx, *inbox.Delivery) (any, error) {
		return nil, idem.Permanent(errors.New("no such customer"))
	}})
	if err != nil {
		t.Fatal(err)
	}
	const n = 1200
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := w; i < n; i += 8 {
				if _, err := in.Accept(ctx, &inbox.Delivery{Source: "outage", Key: fmt.Sprintf("evt-%04d", i), Payload: []byte(`{}`)}); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if _, err := in.Accept(ctx, &inbox.Delivery{Source: "outage", Key: "evt-lost", Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	rc, err := in.NewWorkerClient(8, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.Start(ctx); err != nil {
		t.Fatal(err)
	}
	deadCount := func() int64 {
		n, err := in.CountDeadLetters(ctx, inbox.Filter{Source: "outage"})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	for deadline := time.Now().Add(2 * time.Minute); deadCount() != n+1; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d dead letters, want %d", deadCount(), n+1)
		}
	}
	if err := rc.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	// One event's job and kept payload are gone (deleted by hand).
	if _, err := pool.Exec(ctx, `UPDATE idem.holds SET payload = NULL WHERE key = 'evt-lost';
		DELETE FROM river_job WHERE metadata->>'idem_key' = 'evt-lost'`); err != nil {
		t.Fatal(err)
	}

	r := idemctl(t, ctx, env, "inbox", "list", "--source", "outage")
	if lines := strings.Count(r.out, "\n"); r.code != 0 || lines != n+2 || strings.Contains(r.errout, "not shown") {
		t.Fatalf("list: exit %d, %d lines, want %d\n%s", r.code, lines, n+2, r.errout)
	}
	var newest string
	if err := pool.QueryRow(ctx, `SELECT key FROM idem.holds WHERE state = 'dead' ORDER BY dead_at DESC, key DESC LIMIT 1`).Scan(&newest); err != nil {
		t.Fatal(err)
	}
	if first := strings.SplitN(r.out, "\n", 3)[1]; !strings.Contains(first, " "+newest+" ") {
		t.Fatalf("list is not newest first: %q, the newest is %s", first, newest)
	}
	r = idemctl(t, ctx, env, "inbox", "list", "--source", "outage", "--limit", "5")
	if lines := strings.Count(r.out, "\n"); r.code != 0 || lines != 6 || !strings.Contains(r.errout, "5 of 1,201 dead letter(s) shown, newest first; 1,196 older not shown") {
		t.Fatalf("list --limit 5: exit %d, %d lines\n%s", r.code, lines, r.errout)
	}
	if r := idemctl(t, ctx, env, "inbox", "replay", "--source", "outage", "--dry-run"); r.code != 0 || !strings.Contains(r.out, "would replay 1,201 dead letter(s)") ||
		strings.Count(r.out, "\n") != n+3 {
		t.Fatalf("replay --dry-run: %d\n%.300s", r.code, r.out)
	}
	r = idemctl(t, ctx, env, "inbox", "replay", "--source", "outage")
	if r.code != ExitLeft || strings.Count("\n"+r.out, "\nreplayed outage/evt-") != n || !strings.Contains(r.out, "1,201 dead letter(s): replayed 1,200, payload lost 1") ||
		!strings.Contains(r.errout, "1 dead letter(s) left as they are (failed 0: ") {
		t.Fatalf("replay: exit %d\n%s\n%s", r.code, r.out[max(0, len(r.out)-400):], r.errout)
	}
	if left := deadCount(); left != 1 {
		t.Fatalf("%d dead letters left, want the lost one", left)
	}
	var q int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.holds WHERE source = 'outage' AND state = 'queued'`).Scan(&q); err != nil || q != n {
		t.Fatalf("%d events queued again, want %d (%v)", q, n, err)
	}
}

// TestCheckCrashingEvent (issue 52): an inbox event whose job River's
// rescuer has rescued (its worker crashed or hung mid-attempt) and that
// is still to run is a problem check names (exit 5), with its key, until
// it is processed or dead-lettered; stats' JSON counts it.
func TestCheckCrashingEvent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.NewEmpty(t)
	env := map[string]string{"DATABASE_URL": url}
	if r := idemctl(t, ctx, env, "migrate", "up"); r.code != 0 {
		t.Fatalf("migrate up: %d\n%s%s", r.code, r.out, r.errout)
	}
	pool := testdb.Pool(t, url, 4)
	in, err := inbox.New(inbox.Config{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	a, err := in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: "order-oom", Payload: []byte(`{}`)})
	if err != nil {
		t.Fatal(err)
	}
	if r := idemctl(t, ctx, env, "check"); r.code != 0 {
		t.Fatalf("check with a queued event: %d\n%s%s", r.code, r.out, r.errout)
	}
	// River's rescuer found its attempt stuck (the worker died) and
	// scheduled a retry, as it does.
	if _, err := pool.Exec(ctx, `UPDATE river_job SET state = 'retryable', attempt = 1, attempted_at = now() - interval '2 minutes', scheduled_at = now() + interval '1 hour',
		errors = ARRAY['{"at":"2026-11-28T00:00:00Z","attempt":1,"error":"Stuck job rescued by JobRescuer"}'::jsonb] WHERE id = $1`, a.JobID); err != nil {
		t.Fatal(err)
	}
	r := idemctl(t, ctx, env, "check")
	if r.code != ExitUnhealthy || !strings.Contains(r.errout, "inbox shop: 1 event crashed or hung its worker mid-attempt (River rescued its job) and will run again (order-oom)") {
		t.Fatalf("check with a crashing event: %d\n%s%s", r.code, r.out, r.errout)
	}
	if r := idemctl(t, ctx, env, "check", "--json"); r.code != ExitUnhealthy || !strings.Contains(r.out, `"crashing": 1`) || !strings.Contains(r.out, `"order-oom"`) {
		t.Fatalf("check --json: %d\n%s%s", r.code, r.out, r.errout)
	}
}
