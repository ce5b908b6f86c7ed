package cli

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
)

// TestProbesUnderPageStorm: 24 readers load the dead letters page over
// 30,000 dead letters, over and over, while a transaction of the test
// holds idem.holds locked, so that every page that reaches the database
// waits there (up to the dashboard's QueryTimeout) as a slow page over a
// large backlog does; once the pages wait, /healthz and /metrics are
// probed: every probe answers 200 with idem_database_up 1, since the
// dashboard has a pool of its own and serves at most dashboardConns pages
// at once, shedding the others with 503. (Before, the pages took the
// daemon's 6 connections and /healthz answered 503 "database
// unreachable", idem_database_up 0.)
func TestProbesUnderPageStorm(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 4)
	if _, err := inbox.Migrate(ctx, pool, ""); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `
		INSERT INTO idem.holds (source, key, token, job_id, state, held_at, dead_at, error)
		SELECT 'shop', 'ord_' || g, g, NULL, 'dead', now() - interval '1 day', now() - (g || ' seconds')::interval,
		       'erp answered 422: unknown customer ' || g
		  FROM generate_series(1, 30000) g`); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	var out, errw testdb.Buffer
	code := make(chan int, 1)
	go func() {
		code <- Main(ctx, []string{"run", "--database-url", url, "--listen", addr, "--http"}, &out, &errw, func(string) string { return "" })
	}()
	base := "http://" + addr
	waitUntil(t, "the daemon's dashboard", func() bool {
		resp, err := http.Get(base + "/dead")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})

	lock, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lock.Exec(ctx, `LOCK TABLE idem.holds IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	const readers = 24
	var wg sync.WaitGroup
	var mu sync.Mutex
	pages := map[int]int{}
	stop := make(chan struct{})
	for range readers {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				resp, err := http.Get(base + "/dead?source=shop&error=unknown")
				if err != nil {
					t.Error(err)
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				mu.Lock()
				pages[resp.StatusCode]++
				mu.Unlock()
				if resp.StatusCode == http.StatusServiceUnavailable {
					time.Sleep(10 * time.Millisecond) // pacing, as Retry-After asks
				}
			}
		})
	}
	waitUntil(t, "pages waiting on idem.holds", func() bool {
		var n int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM pg_catalog.pg_locks WHERE relation = 'idem.holds'::regclass AND NOT granted`).Scan(&n)
		return n >= dashboardConns
	})
	for range 5 {
		resp, err := http.Get(base + "/healthz")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("/healthz under the storm: %d %s", resp.StatusCode, body)
		}
		if m := scrape(addr); !strings.Contains(m, "\nidem_database_up 1\n") {
			t.Errorf("/metrics under the storm: idem_database_up is not 1:\n%s", grepLine(m, "idem_database_up"))
		}
	}
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	close(stop)
	wg.Wait()
	mu.Lock()
	for c := range pages {
		if c != 200 && c != 503 && c != 504 {
			t.Errorf("a page answered %d (want 200, 503 when shed, or 504 when it waited out its QueryTimeout)", c)
		}
	}
	if pages[503] == 0 {
		t.Error("no page was shed")
	}
	t.Logf("pages: %v", pages)
	mu.Unlock()
	cancel()
	select {
	case c := <-code:
		if c != 0 {
			t.Errorf("idemctl run exited %d: %s", c, errw.String())
		}
	case <-time.After(30 * time.Second):
		t.Error("idemctl run did not stop")
	}
}

func grepLine(s, prefix string) string {
	var b strings.Builder
	for _, l := range strings.Split(s, "\n") {
		if strings.HasPrefix(l, prefix) {
			fmt.Fprintln(&b, l)
		}
	}
	return b.String()
}
