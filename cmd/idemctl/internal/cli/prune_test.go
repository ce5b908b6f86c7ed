package cli

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/testdb"
)

// seedRows inserts n rows straight into processed_events for month (its
// partition must exist), expired or not, optionally under a live lease.
func seedRows(t *testing.T, pool *pgxpool.Pool, prefix string, month time.Time, n int, expired, leased bool) {
	t.Helper()
	expires := "now() + interval '30 days'"
	if expired {
		expires = "now() - interval '1 hour'"
	}
	status, lease := "'completed'", "NULL::timestamptz"
	if leased {
		status, lease = "'processing'", "now() + interval '1 hour'"
	}
	_, err := pool.Exec(context.Background(), fmt.Sprintf(`
		INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, lease_expires_at,
		                                   first_seen, updated_at, expires_at)
		SELECT 'seed', $1 || g, $2::date, %s, nextval('idem.token_seq'), %s, $2::date + interval '1 day', now(), %s
		  FROM generate_series(1, $3) g`, status, lease, expires), prefix, month, n)
	if err != nil {
		t.Fatal(err)
	}
}

var monthStart = testdb.MonthStart

// keysLeft lists the seeded keys still present, by prefix.
func keysLeft(t *testing.T, pool *pgxpool.Pool) map[string]int {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT split_part(key, '-', 1), count(*) FROM idem.processed_events GROUP BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	left := map[string]int{}
	for rows.Next() {
		var k string
		var n int
		if err := rows.Scan(&k, &n); err != nil {
			t.Fatal(err)
		}
		left[k] = n
	}
	return left
}

// threeMonths makes a database whose expired, live and leased rows spread
// over the previous, current and next month's partitions.
func threeMonths(t *testing.T) (string, *pgxpool.Pool, map[string]int) {
	t.Helper()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 4)
	now := time.Now()
	if _, err := pool.Exec(context.Background(), `SELECT idem.create_partition($1)`, monthStart(now, -1)); err != nil {
		t.Fatal(err)
	}
	for i, m := range []time.Time{monthStart(now, -1), monthStart(now, 0), monthStart(now, 1)} {
		seedRows(t, pool, fmt.Sprintf("expired%d-", i), m, 4000, true, false)
		seedRows(t, pool, fmt.Sprintf("live%d-", i), m, 300, false, false)
		seedRows(t, pool, fmt.Sprintf("leased%d-", i), m, 200, true, true) // past retention, but a worker holds it
	}
	want := map[string]int{"live0": 300, "live1": 300, "live2": 300, "leased0": 200, "leased1": 200, "leased2": 200}
	return url, pool, want
}

func sameCounts(t *testing.T, got, want map[string]int) {
	t.Helper()
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("rows left %v, want %v", got, want)
	}
}

// TestPruneDeletesExactlyTheExpired: mixed rows over three monthly
// partitions; prune deletes the expired ones and nothing else.
func TestPruneDeletesExactlyTheExpired(t *testing.T) {
	t.Parallel()
	url, pool, want := threeMonths(t)
	r := idemctl(t, context.Background(), nil, "prune", "--database-url", url, "--dry-run")
	if r.code != 0 || !strings.Contains(r.out, "would delete 12,000 expired rows") {
		t.Fatalf("dry run: %+v", r)
	}
	r = idemctl(t, context.Background(), nil, "prune", "--database-url", url, "--batch-size", "1000", "--sleep", "1ms")
	if r.code != 0 || !strings.Contains(r.out, "deleted 12,000 expired rows in 13 batches") {
		t.Fatalf("prune: %+v", r)
	}
	sameCounts(t, keysLeft(t, pool), want)
	// Idempotent: again, nothing to do.
	r = idemctl(t, context.Background(), nil, "prune", "--database-url", url)
	if r.code != 0 || !strings.Contains(r.out, "deleted 0 expired rows") {
		t.Fatalf("second prune: %+v", r)
	}
}

// TestPruneSIGKILLThenRerun: killing prune mid-run and running it again
// ends in the same state as one clean run.
func TestPruneSIGKILLThenRerun(t *testing.T) {
	t.Parallel()
	url, pool, want := threeMonths(t)
	bin := binary(t)
	cmd := exec.Command(bin, "prune", "--database-url", url, "--batch-size", "200", "--sleep", "40ms", "--lock-ttl", "1s")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Wait until it has deleted something, then kill it without warning.
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM idem.processed_events`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n < 13500 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("prune deleted nothing in 30s: %s", out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	var mid int
	_ = pool.QueryRow(context.Background(), `SELECT count(*) FROM idem.processed_events`).Scan(&mid)
	if mid == 1800 {
		t.Fatal("prune finished before it was killed; the test proves nothing")
	}
	// The dead prune's lease (1s) must end before the next run can go.
	time.Sleep(1100 * time.Millisecond)
	r := idemctl(t, context.Background(), nil, "prune", "--database-url", url, "--batch-size", "1000", "--sleep", "1ms")
	if r.code != 0 || !strings.Contains(r.out, "deleted") || strings.Contains(r.out, "skipped") {
		t.Fatalf("rerun: %+v", r)
	}
	sameCounts(t, keysLeft(t, pool), want)
}

// startTogether starts two prune processes at once against url and returns
// their outputs.
func startTogether(t *testing.T, url string) [2]string {
	t.Helper()
	bin := binary(t)
	var outs [2]bytes.Buffer
	var cmds [2]*exec.Cmd
	for i := range cmds {
		cmds[i] = exec.Command(bin, "prune", "--database-url", url, "--batch-size", "500", "--sleep", "20ms")
		cmds[i].Stdout, cmds[i].Stderr = &outs[i], &outs[i]
	}
	for _, c := range cmds {
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
	}
	for i, c := range cmds {
		if err := c.Wait(); err != nil {
			t.Fatalf("prune %d: %v\n%s", i, err, outs[i].String())
		}
	}
	return [2]string{outs[0].String(), outs[1].String()}
}

func requireOneDeletedOneSkipped(t *testing.T, outs [2]string, total int) {
	t.Helper()
	deleted, skipped := 0, 0
	for _, o := range outs {
		switch {
		case strings.Contains(o, "deleted "+human(int64(total))+" expired rows"):
			deleted++
		case strings.Contains(o, "skipped: another prune"):
			skipped++
		}
	}
	if deleted != 1 || skipped != 1 {
		t.Fatalf("want exactly one prune to delete all %d rows and one to skip; got:\n1: %s\n2: %s", total, outs[0], outs[1])
	}
}

func TestPruneTwoInstances(t *testing.T) {
	t.Parallel()
	t.Run("direct", func(t *testing.T) {
		t.Parallel()
		url, pool, want := threeMonths(t)
		requireOneDeletedOneSkipped(t, startTogether(t, url), 12000)
		sameCounts(t, keysLeft(t, pool), want)
	})
	t.Run("through PgBouncer in transaction pooling", func(t *testing.T) {
		t.Parallel()
		_, pool, want := threeMonths(t)
		var db string
		if err := pool.QueryRow(context.Background(), `SELECT current_database()`).Scan(&db); err != nil {
			t.Fatal(err)
		}
		bouncer := testdb.PgBouncer(t, db) + testdb.ExecMode
		requireOneDeletedOneSkipped(t, startTogether(t, bouncer), 12000)
		sameCounts(t, keysLeft(t, pool), want)
		// And the skip is quick and clean through PgBouncer too: a second
		// round finds nothing, and nothing is left locked.
		r := idemctl(t, context.Background(), nil, "prune", "--database-url", bouncer, "--fail-if-locked")
		if r.code != 0 || !strings.Contains(r.out, "deleted 0 expired rows") {
			t.Fatalf("prune through PgBouncer after the race: %+v", r)
		}
	})
	t.Run("fail-if-locked", func(t *testing.T) {
		t.Parallel()
		url, pool, _ := threeMonths(t)
		if _, err := pool.Exec(context.Background(), `SELECT idem.try_lock('prune', 'someone-else', '1 minute')`); err != nil {
			t.Fatal(err)
		}
		r := idemctl(t, context.Background(), nil, "prune", "--database-url", url)
		if r.code != ExitOK || !strings.Contains(r.out, "skipped: another prune (someone-else)") {
			t.Fatalf("default skip: %+v", r)
		}
		r = idemctl(t, context.Background(), nil, "prune", "--database-url", url, "--fail-if-locked")
		if r.code != ExitLocked {
			t.Fatalf("--fail-if-locked: exit %d, want %d: %+v", r.code, ExitLocked, r)
		}
		oneLine(t, r.errout, "another prune (someone-else) holds the lock")
	})
}
