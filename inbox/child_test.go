package inbox_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/inbox"
)

const childEnv = "INBOX_TEST_CHILD"

// child is a worker process: it works the inbox with a handler that runs
// an effect (a keyed POST to CHILD_STUB) and then, with CHILD_HANG, hangs
// "mid-job" until it is killed.
func child() int {
	switch os.Getenv("CHILD_MODE") {
	case "storm":
		return stormWorker()
	case "crash":
		return crashWorker()
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("CHILD_URL"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	c, err := idem.New(pool, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	rt, _ := idemhttp.NewTransport(nil, nil)
	hc := &http.Client{Transport: rt}
	hang := os.Getenv("CHILD_HANG") != ""
	in, err := inbox.New(inbox.Config{Pool: pool, Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
		if _, err := c.Effect(ctx, "notify", func(ctx context.Context) (any, error) {
			req, _ := http.NewRequestWithContext(ctx, "POST", os.Getenv("CHILD_STUB"), strings.NewReader(d.Key))
			resp, err := hc.Do(req)
			if err != nil {
				return nil, err
			}
			resp.Body.Close()
			return resp.StatusCode, nil
		}); err != nil {
			return nil, err
		}
		if hang {
			select {} // mid-job: the effect is done, the event is not
		}
		return nil, record(ctx, tx, d)
	}})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	rc, err := in.NewWorkerClient(0, &river.Config{JobTimeout: 2 * time.Second, RescueStuckJobsAfter: 3 * time.Second})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := rc.Start(ctx); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println("working")
	select {}
}

func startWorker(t *testing.T, url, stub string, hang bool) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1", "CHILD_URL="+url, "CHILD_STUB="+stub)
	if hang {
		cmd.Env = append(cmd.Env, "CHILD_HANG=1")
	}
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	if _, err := bufio.NewReader(out).ReadString('\n'); err != nil {
		t.Fatalf("worker did not start: %v", err)
	}
	go io.Copy(io.Discard, out)
	return cmd
}

// TestWorkerKilledMidJob: the worker process is killed with SIGKILL while
// the handler runs, after its effect. River rescues the stuck job; a new
// worker process runs it again under the same claim: the effect is
// replayed, not repeated, and the event is processed once.
func TestWorkerKilledMidJob(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool := setup(t)
	var mu sync.Mutex
	var hits []string
	hit := make(chan struct{}, 10)
	stub := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		hits = append(hits, r.Header.Get("Idempotency-Key"))
		mu.Unlock()
		hit <- struct{}{}
	}))
	t.Cleanup(stub.Close)
	in, err := inbox.New(inbox.Config{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := in.Accept(ctx, &inbox.Delivery{Source: "stripe", Key: "evt_kill", Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	first := startWorker(t, url, stub.URL, true)
	select {
	case <-hit:
	case <-time.After(30 * time.Second):
		t.Fatal("the first worker never ran the effect")
	}
	waitFor(t, "the effect recorded", func() bool {
		return count(t, pool, `SELECT count(*) FROM idem.processed_events WHERE source = 'stripe/effects' AND status = 'completed'`) == 1
	})
	if err := first.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = first.Wait()
	if n := count(t, pool, `SELECT count(*) FROM river_job WHERE state = 'running'`); n != 1 {
		t.Fatalf("%d running jobs after the kill, want the stuck one", n)
	}

	startWorker(t, url, stub.URL, false)
	waitFor(t, "the event processed after the rescue", func() bool {
		return count(t, pool, `SELECT count(*) FROM processed WHERE key = 'evt_kill'`) == 1
	})
	var attempt int
	var state string
	if err := pool.QueryRow(ctx, `SELECT attempt, state FROM river_job WHERE kind = $1`, inbox.Kind).Scan(&attempt, &state); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(hits) != 1 || attempt < 2 || state != "completed" {
		t.Fatalf("effect calls %d (want 1), job attempt %d state %s", len(hits), attempt, state)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem.processed_events WHERE source = 'stripe' AND status = 'completed'`); n != 1 {
		t.Fatal("the event's key is not completed")
	}
	t.Logf("killed mid-job; rescued and processed at attempt %d; the effect ran once", attempt)
}
