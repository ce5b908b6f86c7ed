package inbox_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/riverqueue/river"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
)

// stormWorker is the storm's worker process: it writes each event in its
// job's transaction, and fails the poison ones for good until the table
// fixed has a row. River rescues a killed worker's jobs after 3 s; Repair
// runs every 2 s.
func stormWorker() int {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(os.Getenv("CHILD_URL"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if n, _ := strconv.Atoi(os.Getenv("CHILD_CONNS")); n > 0 {
		cfg.MaxConns = int32(n)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	in, err := inbox.New(inbox.Config{Pool: pool, RetryPolicy: fast{}, RepairEvery: 2 * time.Second,
		Logger: slog.New(slog.DiscardHandler),
		Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
			if strings.Contains(d.Key, "poison-") { // the key is scoped: "<client>|poison-N"
				var fixed bool
				if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM fixed)`).Scan(&fixed); err != nil {
					return nil, err
				}
				if !fixed {
					return nil, idem.Permanent(errors.New("poison: unknown customer"))
				}
			}
			time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond) // work that spans a kill
			return nil, record(ctx, tx, d)
		}})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	rc, err := in.NewWorkerClient(0, &river.Config{JobTimeout: 2 * time.Second, RescueStuckJobsAfter: 3 * time.Second,
		Logger: slog.New(slog.DiscardHandler)})
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

// startStormWorker starts a storm worker process on a pool of conns.
func startStormWorker(t *testing.T, url string, conns int) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1", "CHILD_MODE=storm", "CHILD_URL="+url, "CHILD_CONNS="+strconv.Itoa(conns))
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
		t.Fatalf("storm worker did not start: %v", err)
	}
	go io.Copy(io.Discard, out)
	return cmd
}

// TestInboxStorm: 2,000 events (each delivered twice at once, over real
// HTTP, 20 of them poison) accepted by a web side whose pool is squeezed
// to 2 connections, while in turn the worker process is SIGKILLed, the
// server restarts as pg_ctl restart -m immediate does, the worker is
// SIGKILLed again, and prune and rotation run every second with a
// 1-minute retention. Afterwards every accepted event is processed
// exactly once or is a dead letter with its reason; the reconciliation
// adds up to 2,000; and the replay of the dead letters processes each
// once.
func TestInboxStorm(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// Durable: an immediate shutdown must not lose a commit that was
	// answered 202 (the throwaway default, synchronous_commit=off, would).
	cl, err := pgcluster.Start(ctx, pgcluster.Durable())
	if err != nil {
		t.Fatalf("this test restarts a server of its own and needs the PostgreSQL server binaries: %v (%s)", err, pgcluster.InstallHint)
	}
	defer cl.Stop()
	url := cl.URL("postgres")
	admin, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	db := stdlib.OpenDBFromPool(admin)
	if _, err := migrate.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	db.Close()
	if _, err := inbox.Migrate(ctx, admin, ""); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		`INSERT INTO idem.policies (source, ttl, lease) VALUES ('storm', '1 minute', '10 seconds')`,
		`CREATE TABLE processed (source text, key text, attempt int, at timestamptz DEFAULT clock_timestamp())`,
		`CREATE TABLE fixed (at timestamptz)`,
	} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	count := func(q string) int {
		for {
			var n int
			err := admin.QueryRow(ctx, q).Scan(&n)
			if err == nil {
				return n
			}
			time.Sleep(100 * time.Millisecond) // the server is restarting
		}
	}

	// The web side: idemhttp's asynchronous mode on a pool of 2.
	webCfg, _ := pgxpool.ParseConfig(url)
	webCfg.MaxConns = 2
	web, err := pgxpool.NewWithConfig(ctx, webCfg)
	if err != nil {
		t.Fatal(err)
	}
	defer web.Close()
	in, err := inbox.New(inbox.Config{Pool: web, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	mw, err := idemhttp.New(idemhttp.Config{Client: testdb.Client(t, web, nil), Async: in, Source: "storm",
		Key: idemhttp.HeaderKey("", "X-Event-Id"), VerifiedUpstream: true, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.NotFoundHandler()))
	defer srv.Close()

	// Prune and rotation every second until the end.
	stop := make(chan struct{})
	var maint sync.WaitGroup
	maint.Add(1)
	go func() {
		defer maint.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Second):
			}
			_, _ = admin.Exec(ctx, `CALL idem.prune()`)
			_, _ = admin.Exec(ctx, `CALL idem.rotate()`)
		}
	}()

	worker := startStormWorker(t, url, 12)
	const events = 2000
	var next atomic.Int64
	// Every event must get a 202. Most get one "new" 202; an event whose
	// accept committed just as the server went down gets its 202 as a
	// duplicate on the sender's retry (the first answer was lost: 503).
	// None may be answered as new twice (a poison event redelivered after
	// its dead letter is new again, and is left out).
	var answered, fresh sync.Map
	var newTwice atomic.Int64
	hc := &http.Client{Timeout: 5 * time.Second}
	send := func(i int) {
		key := fmt.Sprintf("evt-%d", i)
		if i%100 == 0 {
			key = fmt.Sprintf("poison-%d", i)
		}
		for attempt := 0; ; attempt++ {
			req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(fmt.Sprintf(`{"n":%d}`, i)))
			req.Header.Set("X-Event-Id", key)
			resp, err := hc.Do(req)
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == http.StatusAccepted {
					answered.Store(key, true)
					if resp.Header.Get("Idempotency-Replayed") == "" {
						if _, again := fresh.LoadOrStore(key, true); again && !strings.HasPrefix(key, "poison-") {
							newTwice.Add(1)
						}
					}
					return
				}
			}
			time.Sleep(time.Duration(50+rand.IntN(200)) * time.Millisecond) // the sender retries
		}
	}
	var senders sync.WaitGroup
	for range 16 {
		senders.Add(1)
		go func() {
			defer senders.Done()
			for i := int(next.Add(1)) - 1; i < events; i = int(next.Add(1)) - 1 {
				var both sync.WaitGroup
				for range 2 { // each event delivered twice at once
					both.Add(1)
					go func() { defer both.Done(); send(i) }()
				}
				both.Wait()
			}
		}()
	}

	// The faults, in turn, as the events flow.
	waitUntil := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(3 * time.Minute); !cond(); time.Sleep(50 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
		}
	}
	waitUntil("300 processed", func() bool { return count(`SELECT count(*) FROM processed`) >= 300 })
	_ = worker.Process.Signal(syscall.SIGKILL)
	_ = worker.Wait()
	time.Sleep(3500 * time.Millisecond) // past RescueStuckJobsAfter: the next worker's leader rescues
	worker = startStormWorker(t, url, 12)
	waitUntil("700 processed", func() bool { return count(`SELECT count(*) FROM processed`) >= 700 })
	if err := cl.RestartImmediate(ctx); err != nil {
		t.Fatal(err)
	}
	waitUntil("1100 processed", func() bool { return count(`SELECT count(*) FROM processed`) >= 1100 })
	_ = worker.Process.Signal(syscall.SIGKILL)
	_ = worker.Wait()
	time.Sleep(3500 * time.Millisecond)
	startStormWorker(t, url, 12)
	senders.Wait()
	got := 0
	answered.Range(func(any, any) bool { got++; return true })
	if got != events || newTwice.Load() != 0 {
		t.Fatalf("%d events answered 202, want %d; %d answered as new twice", got, events, newTwice.Load())
	}

	waitUntil("every event processed or dead-lettered", func() bool {
		st, err := in.Reconcile(ctx)
		return err == nil && len(st) == 1 && st[0].Queued == 0
	})
	// A job River could not finalize when the server went down, or whose
	// worker was killed, is still "running" in River's table until River's
	// rescuer (every 30 s) runs it again; its event is already processed
	// or dead-lettered, and that run changes nothing, but a dead letter
	// River retries is revived meanwhile. Wait for River to finish.
	waitUntil("River finishing every inbox job", func() bool {
		return count(`SELECT count(*) FROM river_job WHERE kind = 'idem.inbox' AND state NOT IN ('completed', 'discarded', 'cancelled')`) == 0
	})
	st, err := in.Reconcile(ctx)
	if err != nil {
		t.Fatal(err)
	}
	s := st[0]
	t.Logf("after the storm: %s", s)
	if !s.Balanced() || s.Accepted != events || s.Processed != events-20 || s.Dead != 20 || s.Unaccounted != 0 {
		t.Fatalf("reconciliation %s; want 2000 = 1980 + 20 + 0", s)
	}
	if n, d := count(`SELECT count(*) FROM processed`), count(`SELECT count(DISTINCT key) FROM processed`); n != events-20 || d != events-20 {
		t.Fatalf("%d rows for %d events; want each of %d once", n, d, events-20)
	}
	dead, err := in.DeadLetters(ctx, inbox.Filter{Source: "storm"})
	if err != nil || len(dead) != 20 {
		t.Fatalf("%d dead letters (%v), want 20", len(dead), err)
	}
	for _, d := range dead {
		if !strings.Contains(d.Key, "poison-") || !strings.Contains(d.LastError, "poison: unknown customer") || d.PayloadLost {
			t.Fatalf("dead letter %+v", d)
		}
	}

	// The fix, and the replay of the dead letters: each processed once.
	if _, err := admin.Exec(ctx, `INSERT INTO fixed VALUES (now())`); err != nil {
		t.Fatal(err)
	}
	res, err := in.Replay(ctx, inbox.Filter{Source: "storm"})
	if err != nil || len(res) != 20 {
		t.Fatalf("replay: %d %v", len(res), err)
	}
	for _, r := range res {
		if r.Outcome != "replayed" {
			var row string
			_ = admin.QueryRow(ctx, `SELECT coalesce(string_agg(e::text, ' | '), 'no row') FROM idem.processed_events e WHERE key = $1`, r.Key).Scan(&row)
			var hold string
			_ = admin.QueryRow(ctx, `SELECT coalesce(string_agg(h::text, ' | '), 'no hold') FROM idem.holds h WHERE key = $1`, r.Key).Scan(&hold)
			t.Fatalf("replay of %s: %s %s; row %s; hold %s", r.Key, r.Outcome, r.Error, row, hold)
		}
	}
	waitUntil("the replays processed", func() bool { return count(`SELECT count(*) FROM processed`) == events })
	close(stop)
	maint.Wait()
	time.Sleep(500 * time.Millisecond)
	if n, d := count(`SELECT count(*) FROM processed`), count(`SELECT count(DISTINCT key) FROM processed`); n != events || d != events {
		t.Fatalf("after the replay: %d rows for %d events; want each of %d once", n, d, events)
	}
	st, _ = in.Reconcile(ctx)
	if s := st[0]; !s.Balanced() || s.Processed != events || s.Dead != 0 || s.Queued != 0 {
		t.Fatalf("reconciliation after the replay: %s", s)
	}
}
