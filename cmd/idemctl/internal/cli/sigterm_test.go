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
