package cli

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testdb"
)

// TestSIGTERMAtRandomMoments: as the year section runs maintenance, two
// hosts each run idemctl prune and idemctl partitions rotate (real
// processes) at once, and every one of them is sent SIGTERM at a random
// moment of its first 300 ms (before its lock, during its try, its steps or
// batches, its release). Once they have all exited no maintenance lock is
// left: a SIGTERMed run releases what it took. Each round has work to do:
// three months ahead to create, last month to retire, expired rows to
// delete.
func TestSIGTERMAtRandomMoments(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 2)
	bin := binary(t)
	rnd := rand.New(rand.NewPCG(56, uint64(time.Now().UnixNano())))
	const rounds = 15
	for round := range rounds {
		now := time.Now()
		for i := 1; i <= 3; i++ {
			if _, err := pool.Exec(ctx, `DROP TABLE IF EXISTS idem.processed_events_`+pname(monthStart(now, i))); err != nil {
				t.Fatal(err)
			}
		}
		// Last month, to retire (unless a rotation stopped between its
		// detach and its drop left it for the next one to drop).
		if _, err := pool.Exec(ctx, `SELECT idem.make_month((date_trunc('month', now() AT TIME ZONE 'UTC') - interval '1 month')::date)
			WHERE to_regclass($1) IS NULL`, "idem.processed_events_"+pname(monthStart(now, -1))); err != nil {
			t.Fatal(err)
		}
		// Expired rows of this month, for prune.
		if _, err := pool.Exec(ctx, `INSERT INTO idem.processed_events (source, key, first_seen_month, status, token,
			                                   first_seen, updated_at, expires_at)
			SELECT 'sigterm', 'r' || $1::int || '-' || g, date_trunc('month', now() AT TIME ZONE 'UTC')::date, 'completed',
			       nextval('idem.token_seq'), now() - interval '2 minutes', now(), now() - interval '1 minute'
			  FROM generate_series(1, 3000) g`, round); err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		var mu sync.Mutex
		var runs []string
		for host := range 2 {
			for _, args := range [][]string{{"partitions", "rotate"}, {"prune", "--batch-size", "500"}} {
				delay := time.Duration(rnd.IntN(300)) * time.Millisecond
				wg.Add(1)
				go func() {
					defer wg.Done()
					cmd := exec.Command(bin, append(args, "--database-url", url, "--log-format", "json")...)
					var out testdb.Buffer
					cmd.Stdout, cmd.Stderr = &out, &out
					if err := cmd.Start(); err != nil {
						t.Error(err)
						return
					}
					timer := time.AfterFunc(delay, func() { _ = cmd.Process.Signal(syscall.SIGTERM) })
					err := cmd.Wait()
					timer.Stop()
					mu.Lock()
					defer mu.Unlock()
					runs = append(runs, fmt.Sprintf("host %d: %s (pid %d, SIGTERM after %s): %v\n%s",
						host, strings.Join(args, " "), cmd.Process.Pid, delay, err, out.String()))
				}()
			}
		}
		wg.Wait()
		rows, err := pool.Query(ctx, `SELECT name || ' held by ' || holder || ' until ' || expires_at FROM idem.maintenance_locks ORDER BY name`)
		if err != nil {
			t.Fatal(err)
		}
		var held []string
		for rows.Next() {
			var s string
			if err := rows.Scan(&s); err != nil {
				t.Fatal(err)
			}
			held = append(held, s)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		if len(held) > 0 {
			t.Fatalf("round %d: maintenance locks left by SIGTERMed runs: %v\n%s", round, held, strings.Join(runs, "\n"))
		}
	}
}

// TestRotateSIGTERMFinishesTheStep: idemctl partitions rotate (a real
// process) is sent SIGTERM while a step waits for its lock (attaching a
// month ahead, behind an application transaction that reads the default
// partition). As docs/idemctl.md promises, the step in flight finishes:
// once the transaction ends the month is attached; then the run stops,
// releases the rotate lock and is recorded as interrupted. Before, the
// step's statement ran on the run's context: SIGTERM closed its connection
// under it and the server rolled the step back.
func TestRotateSIGTERMFinishesTheStep(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	month := "idem.processed_events_" + pname(monthStart(time.Now(), 3))
	end := blockedRotation(t, ctx, url) // drops that month, holds the default partition
	defer end()
	cmd := exec.Command(binary(t), "partitions", "rotate", "--database-url", url, "--lock-timeout", "1m", "--retries", "0")
	var out testdb.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() { _ = cmd.Process.Kill() }()
	pool := testdb.Pool(t, url, 1)
	waitFor(t, func() bool {
		var n int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE NOT l.granted AND a.application_name = 'idemctl' AND a.datname = current_database()`).Scan(&n)
		return n > 0
	})
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// Let the signal land while the step waits (before, it cut the
	// statement at once); the outcome must not depend on this pause.
	time.Sleep(time.Second)
	end()
	select {
	case <-exited:
	case <-time.After(time.Minute):
		t.Fatalf("rotate still running a minute after SIGTERM:\n%s", out.String())
	}
	var attached bool
	var locks, interrupted int
	if err := pool.QueryRow(ctx, `SELECT
		EXISTS (SELECT FROM pg_partition_tree('idem.processed_events') WHERE relid = to_regclass($1)),
		(SELECT count(*) FROM idem.maintenance_locks WHERE name = 'rotate'),
		(SELECT count(*) FROM idem.runs WHERE job = 'rotate' AND outcome = 'interrupted')`, month).Scan(&attached, &locks, &interrupted); err != nil {
		t.Fatal(err)
	}
	if !attached || locks != 0 || interrupted != 1 {
		t.Fatalf("after SIGTERM during the step attaching %s: attached %v, %d rotate locks held, %d runs recorded interrupted; want true, 0, 1\n%s",
			month, attached, locks, interrupted, out.String())
	}
}
