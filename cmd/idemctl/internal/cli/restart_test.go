package cli

import (
	"context"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

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
	cl, url := ownMigratedServer(t, ctx, "restarts")
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

// TestSIGTERMWhileDatabaseDown: idemctl partitions rotate (a real
// process) is sent SIGTERM while the database is down (a restart, a
// failover; the year section met it when a kill landed during its
// database restart). It holds the rotate lock and cannot release it until
// the database is back: it keeps trying after the signal, within a grace
// (maintlock's releaseGrace), and exits once the lock is released, so the
// next scheduled rotation is not skipped. Before, SIGTERM ended the
// release's retries after one try that failed with the connection, and
// the lock stayed held for its 10-minute lease.
func TestSIGTERMWhileDatabaseDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cl, url := ownMigratedServer(t, ctx, "stops")
	end := blockedRotation(t, ctx, url)
	defer end()

	cmd := exec.Command(binary(t), "partitions", "rotate", "--database-url", url,
		"--lock-timeout", "200ms", "--retries", "100", "--backoff", "10ms")
	var out testdb.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() { _ = cmd.Process.Kill() }()
	rotateLocks := func() int { // on a connection of its own: the database restarts
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			return -1
		}
		defer conn.Close(ctx)
		var n int
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM idem.maintenance_locks WHERE name = 'rotate'`).Scan(&n); err != nil {
			return -1
		}
		return n
	}
	waitFor(t, func() bool { return rotateLocks() == 1 })

	cl.Down()
	select {
	case err := <-exited:
		t.Fatalf("rotate exited (%v) before SIGTERM with the database down (its release should wait for it):\n%s", err, out.String())
	default:
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	up := time.Now()
	if err := cl.Up(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("the database was back %v after SIGTERM", time.Since(up).Round(time.Millisecond))
	select {
	case <-exited:
	case <-time.After(60 * time.Second):
		t.Fatalf("rotate still running a minute after SIGTERM:\n%s", out.String())
	}
	if n := rotateLocks(); n != 0 {
		t.Fatalf("%d rotate locks held after the SIGTERMed rotation exited (its lease is 10 minutes):\n%s", n, out.String())
	}
	end()
	if r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url, "--fail-if-locked"); r.code != 0 {
		t.Fatalf("the next rotation: %+v\nthe SIGTERMed one:\n%s", r, out.String())
	}
}

// ownMigratedServer starts a throwaway server for a test that restarts or
// stops it (what names that), migrated by idemctl; it is stopped when the
// test ends.
func ownMigratedServer(t *testing.T, ctx context.Context, what string) (*pgcluster.Cluster, string) {
	t.Helper()
	cl, err := pgcluster.Start(ctx)
	if err != nil {
		t.Fatalf("this test %s a server of its own and needs the PostgreSQL server binaries: %v (%s)", what, err, pgcluster.InstallHint)
	}
	t.Cleanup(cl.Stop)
	url := cl.URL("postgres")
	if r := idemctl(t, ctx, nil, "migrate", "up", "--database-url", url, "--river=false"); r.code != 0 {
		t.Fatalf("migrate up: %+v", r)
	}
	return cl, url
}
