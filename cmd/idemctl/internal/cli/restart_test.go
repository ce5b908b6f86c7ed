package cli

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/internal/testdb"
)

// TestRunDatabaseRestartFreesLock: PostgreSQL restarts while idemctl
// run's rotation retries a step behind an application transaction. The
// step fails with the connection, and the daemon gives the rotate lock back
// as soon as the database is up again, not when its 10-minute lease ends:
// a cron rotation from another host right after is not skipped.
func TestRunDatabaseRestartFreesLock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cl, err := pgcluster.Start(ctx)
	if err != nil {
		t.Fatalf("this test restarts a server of its own and needs the PostgreSQL server binaries: %v (%s)", err, pgcluster.InstallHint)
	}
	defer cl.Stop()
	url := cl.URL("postgres")
	if r := idemctl(t, ctx, nil, "migrate", "up", "--database-url", url, "--river=false"); r.code != 0 {
		t.Fatalf("migrate up: %+v", r)
	}
	end := blockedRotation(t, ctx, url)
	defer end()

	dctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var out, errw testdb.Buffer
	code := make(chan int, 1)
	go func() {
		code <- Main(dctx, []string{"run", "--database-url", url, "--listen", "", "--prune-schedule", "@monthly", "--rotate-schedule", "@monthly",
			"--stats-schedule", "@monthly", "--lock-timeout", "200ms", "--retries", "100", "--backoff", "10ms"},
			&out, &errw, func(string) string { return "" })
	}()
	pool := testdb.Pool(t, url, 1)
	rotateLocks := func() int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.maintenance_locks WHERE name = 'rotate'`).Scan(&n); err != nil {
			return -1
		}
		return n
	}
	waitFor(t, func() bool {
		select {
		case c := <-code:
			t.Fatalf("the daemon exited with %d: %s", c, errw.String())
		default:
		}
		return rotateLocks() == 1
	})

	if err := cl.Restart(ctx); err != nil {
		t.Fatal(err)
	}
	// The rotate lock's lease is 10 minutes; the database is back in
	// seconds. waitFor gives up after 30 s.
	deadline := time.Now().Add(30 * time.Second)
	for rotateLocks() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the rotate lock is still held 30 s after the restart (its lease is 10 minutes)\ndaemon:\n%s", errw.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The run is recorded after its lock is released: wait for it.
	var failed int
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.runs WHERE job = 'rotate' AND outcome = 'error'`).Scan(&failed)
		if err == nil && failed == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("the rotation cut by the restart is recorded %d times as failed (%v), want 1", failed, err)
			break
		}
	}
	if r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url, "--fail-if-locked"); r.code != 0 {
		t.Fatalf("a cron rotation after the restart: %+v\ndaemon:\n%s", r, errw.String())
	}
	cancel()
	select {
	case c := <-code:
		if c != 0 {
			t.Fatalf("daemon exit %d: %s", c, errw.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the daemon did not stop")
	}
}
