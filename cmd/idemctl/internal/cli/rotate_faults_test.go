package cli

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testdb"
)

// lastMonth makes the partition of last month, empty (its rows all
// expired), so that the next rotation retires it, and returns its name.
func lastMonth(t *testing.T, ctx context.Context, url string) string {
	t.Helper()
	pool := testdb.Pool(t, url, 1)
	var made string
	if err := pool.QueryRow(ctx, `SELECT idem.make_month((date_trunc('month', now() AT TIME ZONE 'UTC') - interval '1 month')::date)`).Scan(&made); err != nil || made != "created" {
		t.Fatalf("make last month: %q %v", made, err)
	}
	return "idem.processed_events_" + pname(monthStart(time.Now(), -1))
}

// TestRotateDropsWhatItDetached: a rotation detaches last month and its
// DROP gives up on a lock (a reader, as pg_dump is, took the detached
// table right after the detach). The table is listed as a drop pending,
// idemctl check reports it, and the next rotation drops it; a month
// detached with --keep-detached is never taken for one.
func TestRotateDropsWhatItDetached(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	part := lastMonth(t, ctx, url)

	// A reader (pg_dump, say) asks for the month while the rotation's
	// detach waits for it: it is queued behind the detach, gets the table
	// as soon as the detach commits, and holds it through the DROP's tries.
	// B holds the month first so that the detach waits and the reader's
	// request queues behind it, in that order.
	admin := testdb.Pool(t, url, 4)
	b, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Exec(ctx, `LOCK TABLE `+part+` IN ACCESS SHARE MODE`); err != nil {
		t.Fatal(err)
	}
	waiting := func(mode string) bool {
		var n int
		_ = admin.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE relation = $1::regclass AND mode = $2 AND NOT granted`, part, mode).Scan(&n)
		return n > 0
	}
	rotated := make(chan result, 1)
	go func() {
		rotated <- idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url, "--lock-timeout", "3s", "--retries", "1", "--backoff", "10ms")
	}()
	waitFor(t, func() bool { return waiting("AccessExclusiveLock") })
	reader, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Rollback(ctx)
	locked := make(chan error, 1)
	go func() {
		_, err := reader.Exec(ctx, `LOCK TABLE `+part+` IN ACCESS SHARE MODE`)
		locked <- err
	}()
	waitFor(t, func() bool { return waiting("AccessShareLock") })
	_ = b.Rollback(ctx)
	if err := <-locked; err != nil {
		t.Fatal(err)
	}
	r := <-rotated
	if !strings.Contains(r.out, part) || !strings.Contains(r.out, "gave up") {
		t.Fatalf("rotate with the detached month held: %+v", r)
	}
	if r := idemctl(t, ctx, nil, "partitions", "list", "--database-url", url); !strings.Contains(r.out, "(detached, drop pending)") {
		t.Errorf("partitions list does not show the detached month: %+v", r)
	}
	if r := idemctl(t, ctx, nil, "check", "--database-url", url); r.code != ExitUnhealthy || !strings.Contains(r.errout, part) {
		t.Errorf("check with a detached month left behind: %+v", r)
	}
	_ = reader.Rollback(ctx)

	r = idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url)
	if r.code != 0 || !strings.Contains(strings.Join(strings.Fields(r.out), " "), "drop "+part+" dropped") {
		t.Fatalf("the next rotation: %+v", r)
	}
	pool := admin
	var left bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, part).Scan(&left); err != nil || left {
		t.Fatalf("%s still exists after the next rotation (%v)", part, err)
	}
	if r := idemctl(t, ctx, nil, "check", "--database-url", url); r.code != 0 {
		t.Fatalf("check after the drop: %+v", r)
	}

	// Kept on purpose: never dropped by a later rotation.
	kept := lastMonth(t, ctx, url)
	if r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url, "--keep-detached"); r.code != 0 || !strings.Contains(r.out, "detached") {
		t.Fatalf("rotate --keep-detached: %+v", r)
	}
	if r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url); r.code != 0 {
		t.Fatalf("rotate after --keep-detached: %+v", r)
	}
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, kept).Scan(&left); err != nil || !left {
		t.Fatalf("the month kept with --keep-detached was dropped (%v)", err)
	}
}

// blockedRotation drops a month ahead and holds the default partition in
// an application transaction, so that the rotation's attach of that month
// retries behind it; it returns a func that ends the transaction.
func blockedRotation(t *testing.T, ctx context.Context, url string) (end func()) {
	t.Helper()
	pool := testdb.Pool(t, url, 2)
	if _, err := pool.Exec(ctx, `DROP TABLE idem.processed_events_`+pname(monthStart(time.Now(), 3))); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `LOCK TABLE idem.processed_events_default IN ACCESS SHARE MODE`); err != nil {
		t.Fatal(err)
	}
	return func() { _ = tx.Rollback(ctx) }
}

// TestRotateLease: a rotation whose steps retry behind an application
// transaction for longer than its --lock-ttl renews its lease before each
// try, so a second host's rotation is skipped (exit 4 with
// --fail-if-locked) instead of running the same steps; when the lease is
// taken from it all the same (the process stalled past it), the rotation
// stops before its next step with exit 4, not a raw error.
func TestRotateLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	end := blockedRotation(t, ctx, url)
	first := make(chan result, 1)
	go func() {
		first <- idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url,
			"--lock-ttl", "1s", "--lock-timeout", "100ms", "--retries", "100", "--backoff", "10ms")
	}()
	pool := testdb.Pool(t, url, 1)
	waitFor(t, func() bool {
		var n int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM idem.maintenance_locks WHERE name = 'rotate'`).Scan(&n)
		return n == 1
	})
	time.Sleep(2500 * time.Millisecond) // past the first holder's 1 s lease, had it not been renewed
	if r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url, "--fail-if-locked"); r.code != ExitLocked {
		t.Errorf("a second rotation while the first retries past its lease: %+v, want exit %d", r, ExitLocked)
	}
	// The lease taken from it: the first stops before its next step.
	if _, err := pool.Exec(ctx, `UPDATE idem.maintenance_locks SET holder = 'thief', expires_at = now() + interval '1 hour' WHERE name = 'rotate'`); err != nil {
		t.Fatal(err)
	}
	r := <-first
	end()
	if r.code != ExitLocked || !strings.Contains(r.errout, "lost the rotate lock mid-run") || !strings.Contains(r.errout, "thief") {
		t.Fatalf("the first rotation after its lease was taken: %+v, want exit %d", r, ExitLocked)
	}
}

// TestRunStartupSIGTERM: SIGTERM while idemctl run's start-up rotation
// retries a step: the daemon waits for the step in flight, releases the
// rotate lock and records the run as interrupted, and starts none of the
// jobs after it; a cron rotate right after is not skipped.
func TestRunStartupSIGTERM(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	end := blockedRotation(t, context.Background(), url)
	defer end()
	ctx, cancel := context.WithCancel(context.Background())
	var out, errw testdb.Buffer
	code := make(chan int, 1)
	go func() {
		code <- Main(ctx, []string{"run", "--database-url", url, "--prune-schedule", "@monthly", "--rotate-schedule", "@monthly",
			"--stats-schedule", "@monthly", "--lock-timeout", "200ms", "--retries", "100", "--backoff", "10ms"},
			&out, &errw, func(string) string { return "" })
	}()
	pool := testdb.Pool(t, url, 1)
	waitFor(t, func() bool {
		var n int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM idem.maintenance_locks WHERE name = 'rotate'`).Scan(&n)
		return n == 1
	})
	cancel() // SIGTERM
	if c := <-code; c != 0 {
		t.Fatalf("exit %d after SIGTERM: %s", c, errw.String())
	}
	var locks, interrupted, prunes int
	if err := pool.QueryRow(context.Background(), `SELECT
		(SELECT count(*) FROM idem.maintenance_locks WHERE name = 'rotate'),
		(SELECT count(*) FROM idem.runs WHERE job = 'rotate' AND outcome = 'interrupted'),
		(SELECT count(*) FROM idem.runs WHERE job = 'prune')`).Scan(&locks, &interrupted, &prunes); err != nil {
		t.Fatal(err)
	}
	if locks != 0 || interrupted != 1 || prunes != 0 {
		t.Fatalf("after SIGTERM: %d rotate locks held, %d rotate runs recorded interrupted, %d prune runs started; want 0, 1, 0\n%s", locks, interrupted, prunes, errw.String())
	}
	end()
	if r := idemctl(t, context.Background(), nil, "partitions", "rotate", "--database-url", url, "--fail-if-locked"); r.code != 0 {
		t.Fatalf("the next rotate: %+v", r)
	}
}

// waitFor polls cond for up to 30 s.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached in 30 s")
		}
		time.Sleep(20 * time.Millisecond)
	}
}
