package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/stripe/stripe-go/v85/webhook"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
)

// The day after an incident (issue 52): every dead letter can be
// replayed, a crashing event ends, every delivery is accepted.

// manyDeadLetters accepts n events of source (keys prefix-0 ... and
// prefix-(n-1)), 8 at a time, whose handler fails for good, and runs them
// until all n are dead letters.
func manyDeadLetters(t *testing.T, pool *pgxpool.Pool, source, prefix string, n int) {
	t.Helper()
	ctx := context.Background()
	app, err := inbox.New(inbox.Config{Pool: pool, Queue: "dead_" + prefix,
		Handler: func(context.Context, pgx.Tx, *inbox.Delivery) (any, error) {
			return nil, idem.Permanent(errors.New("unknown customer"))
		}})
	if err != nil {
		t.Fatal(err)
	}
	before := count(t, pool, `SELECT count(*) FROM idem.holds WHERE state = 'dead' AND source = $1`, source)
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := w; i < n; i += 8 {
				if _, err := app.Accept(ctx, &inbox.Delivery{Source: source, Key: fmt.Sprintf("%s-%04d", prefix, i), EventType: "charge", Payload: []byte(`{"n":1}`)}); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	rc := start(t, app, 8, nil)
	waitFor(t, "the dead letters", func() bool {
		return count(t, pool, `SELECT count(*) FROM idem.holds WHERE state = 'dead' AND source = $1`, source) == before+n &&
			count(t, pool, `SELECT count(*) FROM river_job WHERE queue = $1 AND state = 'cancelled'`, "dead_"+prefix) == n
	})
	if err := rc.Stop(ctx); err != nil {
		t.Fatal(err)
	}
}

// outcomes counts replay results per outcome.
func outcomes(res []inbox.ReplayResult) map[string]int {
	m := map[string]int{}
	for _, r := range res {
		m[r.Outcome]++
	}
	return m
}

// TestReplayEveryDeadLetter (issue 52, 1): after an outage that left
// 1,200 dead letters, one Replay replays all 1,200 (it stopped at the
// 1,000 oldest: DeadLetters turned a limit of 0 into 1,000), and the
// listing and its count agree.
func TestReplayEveryDeadLetter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	const n = 1200
	manyDeadLetters(t, pool, "outage", "evt", n)
	tool, err := inbox.New(inbox.Config{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	dead, err := tool.DeadLetters(ctx, inbox.Filter{Source: "outage"})
	if err != nil || len(dead) != n {
		t.Fatalf("listed %d dead letters (want %d): %v", len(dead), n, err)
	}
	newest, err := tool.DeadLetters(ctx, inbox.Filter{Source: "outage", Newest: true, Limit: 3})
	if err != nil || len(newest) != 3 || newest[0].FailedAt.Before(dead[n-1].FailedAt) || newest[0].Key != dead[n-1].Key {
		t.Fatalf("newest first: %+v %v", newest, err)
	}
	res, err := tool.Replay(ctx, inbox.Filter{Source: "outage"})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, r := range res {
		seen[r.Key] = true
	}
	if got := outcomes(res); got[inbox.ReplayReplayed] != n || len(seen) != n {
		t.Fatalf("replay: %v over %d keys, want %d replayed", got, len(seen), n)
	}
	if left, err := tool.CountDeadLetters(ctx, inbox.Filter{Source: "outage"}); err != nil || left != 0 {
		t.Fatalf("%d dead letters left (%v)", left, err)
	}
	if q := count(t, pool, `SELECT count(*) FROM idem.holds WHERE source = 'outage' AND state = 'queued'`); q != n {
		t.Fatalf("%d events queued again, want %d", q, n)
	}
}

// TestReplayReachesPastLeftDeadLetters (issue 52, 2): the 1,000 oldest
// dead letters are ones replay leaves as they are (their keys failed for
// good past the policy's max_attempts); the 50 newer ones behind them are
// all replayed, and each run says what it left and why.
func TestReplayReachesPastLeftDeadLetters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	if _, err := pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease, max_attempts) VALUES ('shop', '30 days', '2 minutes', 1)`); err != nil {
		t.Fatal(err)
	}
	manyDeadLetters(t, pool, "shop", "old", 1000)
	tool, err := inbox.New(inbox.Config{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	// The first replay finds each key past its one attempt: idem gives
	// up on it (failed for good), and the dead letter stays.
	res, err := tool.Replay(ctx, inbox.Filter{Source: "shop"})
	if got := outcomes(res); err != nil || got[inbox.ReplayFailed] != 1000 || !res[0].Left() || res[0].Error == "" {
		t.Fatalf("first replay: %v %v", got, err)
	}
	// The policy is lifted; 50 newer events fail and are dead letters.
	if _, err := pool.Exec(ctx, `DELETE FROM idem.policies WHERE source = 'shop'`); err != nil {
		t.Fatal(err)
	}
	manyDeadLetters(t, pool, "shop", "new", 50)
	for run := range 2 {
		res, err := tool.Replay(ctx, inbox.Filter{Source: "shop"})
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]int{inbox.ReplayFailed: 1000, inbox.ReplayReplayed: 50}
		if run == 1 {
			delete(want, inbox.ReplayReplayed) // replayed by the first run: queued, not dead
		}
		if got := outcomes(res); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("run %d: %v, want %v", run, got, want)
		}
		for _, r := range res {
			if r.Outcome == inbox.ReplayReplayed && !strings.HasPrefix(r.Key, "new-") {
				t.Fatalf("replayed %s", r.Key)
			}
		}
	}
	if q := count(t, pool, `SELECT count(*) FROM idem.holds WHERE source = 'shop' AND state = 'queued' AND key LIKE 'new-%'`); q != 50 {
		t.Fatalf("%d of the 50 newer events queued again", q)
	}
}

// crashWorker is a worker process whose handler kills its own process
// (as an out-of-memory kill, a crash in cgo or a panic in a goroutine of
// its own would), after noting the attempt in table crashes.
func crashWorker() int {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("CHILD_URL"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	in, err := inbox.New(inbox.Config{Pool: pool, RunLease: time.Second, RepairEvery: -1,
		Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
			if _, err := pool.Exec(ctx, `INSERT INTO crashes (key, attempt) VALUES ($1, $2)`, d.Key, d.Attempt); err != nil {
				return nil, err
			}
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {}
		}})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	rc, err := in.NewWorkerClient(1, &river.Config{JobTimeout: time.Second, RescueStuckJobsAfter: 2 * time.Second})
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

// TestCrashingHandlerDeadLettered (issue 52, 3): an event whose handler
// kills its worker process on each attempt. River's rescuer counts each
// crash as an attempt and, past MaxAttempts (2), discards the job: the
// event ends as one dead letter, with its payload and the reason, after
// exactly 2 runs, and is never enqueued again with fresh attempts. While
// it crash-loops, Reconcile (idemctl check) reports it.
func TestCrashingHandlerDeadLettered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool := setup(t)
	if _, err := pool.Exec(ctx, `CREATE TABLE crashes (key text, attempt int, at timestamptz DEFAULT clock_timestamp())`); err != nil {
		t.Fatal(err)
	}
	// The leader: a worker client on a queue of its own (it never runs
	// the event), whose rescuer rescues the crashed attempts and whose
	// periodic Repair (every second) finds the job River gave up on.
	leaderIn, err := inbox.New(inbox.Config{Pool: pool, Queue: "leader", RetryPolicy: fast{}, RepairEvery: time.Second,
		Handler: func(context.Context, pgx.Tx, *inbox.Delivery) (any, error) {
			return nil, errors.New("the leader runs no event")
		}})
	if err != nil {
		t.Fatal(err)
	}
	start(t, leaderIn, 1, &river.Config{JobTimeout: time.Second, RescueStuckJobsAfter: 2 * time.Second})
	in, err := inbox.New(inbox.Config{Pool: pool, MaxAttempts: map[string]int{"crash": 2}})
	if err != nil {
		t.Fatal(err)
	}
	a, err := in.Accept(ctx, &inbox.Delivery{Source: "crash", Key: "evt_poison", EventType: "charge", Payload: []byte(`{"poison":true}`)})
	if err != nil {
		t.Fatal(err)
	}
	jobState := func() string {
		var s string
		if err := pool.QueryRow(ctx, `SELECT state::text FROM river_job WHERE id = $1`, a.JobID).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	var crashing int64
	for run := 1; run <= 4; run++ {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), childEnv+"=1", "CHILD_MODE=crash", "CHILD_URL="+url)
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || ws.Signal() != syscall.SIGKILL {
				t.Fatalf("run %d: the worker ended with %v, not killed by its handler", run, err)
			}
		case <-time.After(3 * time.Minute):
			_ = cmd.Process.Kill()
			t.Fatalf("run %d: the worker never ran the event", run)
		}
		// The rescuer finds the crashed attempt: a retry, or past the
		// last attempt a discard, which Repair makes a dead letter.
		waitForLong(t, "the crashed attempt rescued", func() bool { return jobState() != "running" })
		if st, err := inbox.Reconcile(ctx, pool, ""); err == nil {
			for _, s := range st {
				if s.Source == "crash" && s.Crashing > crashing {
					crashing = s.Crashing
				}
			}
		}
		if jobState() == "discarded" {
			break
		}
	}
	waitForLong(t, "the dead letter", func() bool {
		return count(t, pool, `SELECT count(*) FROM idem.holds WHERE source = 'crash' AND state = 'dead'`) == 1
	})
	if n := count(t, pool, `SELECT count(*) FROM crashes`); n != 2 {
		t.Fatalf("the handler ran %d times, want 2 (MaxAttempts)", n)
	}
	if crashing != 1 {
		t.Fatalf("Reconcile reported %d crashing events while it crash-looped, want 1", crashing)
	}
	dead, err := in.DeadLetters(ctx, inbox.Filter{Source: "crash"})
	if err != nil || len(dead) != 1 {
		t.Fatalf("dead letters %+v %v", dead, err)
	}
	if d := dead[0]; d.PayloadLost || d.Attempts != 2 || d.EventType != "charge" || !strings.Contains(d.LastError, "crashed or hung") {
		t.Fatalf("dead letter %+v", d)
	}
	// Its payload is on the hold too: River's cleaner may delete the job.
	if n := count(t, pool, `SELECT count(*) FROM idem.holds WHERE source = 'crash' AND payload->>'key' = 'evt_poison'`); n != 1 {
		t.Fatal("the payload is not kept with the dead letter")
	}
	// Repair runs again and again: nothing is enqueued again.
	rep, err := in.Repair(ctx)
	if err != nil || rep != (inbox.RepairReport{}) {
		t.Fatalf("repair again: %+v %v", rep, err)
	}
	if n := count(t, pool, `SELECT count(*) FROM river_job WHERE kind = $1`, inbox.Kind); n != 1 {
		t.Fatalf("%d jobs of the event, want its one", n)
	}
	st, err := inbox.Reconcile(ctx, pool, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range st {
		if s.Source == "crash" && (!s.Balanced() || s.Dead != 1 || s.Queued != 0 || s.Crashing != 0) {
			t.Fatalf("reconcile: %s (crashing %d)", s, s.Crashing)
		}
	}
}

// waitForLong is waitFor over River's rescue interval (30 seconds).
func waitForLong(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(3 * time.Minute); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatalf("timed out waiting for %s", what)
}

// TestAcceptThroughPgBouncer (issue 52, 4): the web side through PgBouncer
// 1.18 in transaction mode, with pgx's default pool configuration (its
// statement cache): 3,000 signed deliveries, 12 at a time, are all
// answered 202 on their first try, and each is one queued event. River's
// job insert in the accept's transaction hit the pooler's
// prepared-statement errors (42P05, 26000) and answered 503.
func TestAcceptThroughPgBouncer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, direct := setup(t)
	var dbname string
	if err := direct.QueryRow(ctx, `SELECT current_database()`).Scan(&dbname); err != nil {
		t.Fatal(err)
	}
	pool := testdb.Pool(t, testdb.PgBouncer(t, dbname), 16)
	if m := pool.Config().ConnConfig.DefaultQueryExecMode; m != pgx.QueryExecModeCacheStatement {
		t.Fatalf("pool mode %v, want pgx's default", m)
	}
	in, err := inbox.New(inbox.Config{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	mw, err := idemhttp.New(idemhttp.Config{Client: testdb.Client(t, pool, nil), Async: in}.Apply(idemhttp.Stripe("whsec_bouncer")))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.NotFoundHandler()))
	t.Cleanup(srv.Close)
	const n = 3000
	var refused atomic.Int64
	var firstRefusal atomic.Value
	var wg sync.WaitGroup
	for w := range 12 {
		wg.Go(func() {
			for i := w; i < n; i += 12 {
				body := fmt.Sprintf(`{"id":"evt_%04d","type":"invoice.paid","data":{"object":{}}}`, i)
				p := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: []byte(body), Secret: "whsec_bouncer", Timestamp: time.Now()})
				req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(body))
				req.Header.Set("Stripe-Signature", p.Header)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				resp.Body.Close()
				if resp.StatusCode != http.StatusAccepted {
					refused.Add(1)
					firstRefusal.CompareAndSwap(nil, fmt.Sprintf("evt_%04d: %d", i, resp.StatusCode))
				}
			}
		})
	}
	wg.Wait()
	if r := refused.Load(); r != 0 {
		t.Fatalf("%d of %d deliveries not accepted on their first try (first: %v)", r, n, firstRefusal.Load())
	}
	if q := count(t, direct, `SELECT count(*) FROM idem.holds WHERE state = 'queued'`); q != n {
		t.Fatalf("%d events queued, want %d", q, n)
	}
	if j := count(t, direct, `SELECT count(*) FROM river_job WHERE kind = $1`, inbox.Kind); j != n {
		t.Fatalf("%d jobs, want %d", j, n)
	}
}

// TestRepairGaveUpJob: an event still queued under a job River gave up on
// (discarded by its rescuer past its attempts, or cancelled) is a dead
// letter after Repair, with its payload kept on the hold and the reason:
// River's cleaner deleting the job afterwards loses nothing (it was
// "payload lost" when the cleaner came first, and before that it was
// enqueued again with fresh attempts). Repair pages through every orphan:
// 1,200 events whose jobs completed without them are all enqueued again.
func TestRepairGaveUpJob(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	in, err := inbox.New(inbox.Config{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	accept := func(source, key string) int64 {
		a, err := in.Accept(ctx, &inbox.Delivery{Source: source, Key: key, EventType: "charge", Payload: []byte(`{"amount":42}`)})
		if err != nil {
			t.Fatal(err)
		}
		return a.JobID
	}
	rescued := accept("gaveup", "evt_rescued")
	cancelled := accept("gaveup", "evt_cancelled")
	if _, err := pool.Exec(ctx, `UPDATE river_job SET state = 'discarded', attempt = 3, attempted_at = now(), finalized_at = now(),
		errors = ARRAY['{"at":"2026-11-28T00:00:00Z","attempt":3,"error":"Stuck job rescued by JobRescuer"}'::jsonb] WHERE id = $1`, rescued); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE river_job SET state = 'cancelled', attempt = 1, attempted_at = now(), finalized_at = now(),
		errors = ARRAY['{"at":"2026-11-28T00:00:00Z","attempt":1,"error":"cancelled from River UI"}'::jsonb] WHERE id = $1`, cancelled); err != nil {
		t.Fatal(err)
	}
	// No attempt took either key: Repair fails it as a worker would
	// have, so that the replay below claims it at once (not after the
	// accept's lease).
	rep, err := in.Repair(ctx)
	if err != nil || rep != (inbox.RepairReport{Discarded: 2}) {
		t.Fatalf("repair: %+v %v", rep, err)
	}
	// River's cleaner deletes the jobs.
	if _, err := pool.Exec(ctx, `DELETE FROM river_job WHERE id = ANY($1)`, []int64{rescued, cancelled}); err != nil {
		t.Fatal(err)
	}
	dead, err := in.DeadLetters(ctx, inbox.Filter{Source: "gaveup"})
	if err != nil || len(dead) != 2 {
		t.Fatalf("dead letters %+v %v", dead, err)
	}
	reasons := map[string]string{"evt_rescued": "crashed or hung", "evt_cancelled": "cancelled from River UI"}
	for _, d := range dead {
		if d.PayloadLost || d.EventType != "charge" || !strings.Contains(d.LastError, reasons[d.Key]) {
			t.Fatalf("dead letter %+v", d)
		}
	}
	if rep, err := in.Repair(ctx); err != nil || rep != (inbox.RepairReport{}) {
		t.Fatalf("repair again: %+v %v", rep, err)
	}
	res, err := in.Replay(ctx, inbox.Filter{Source: "gaveup"})
	if got := outcomes(res); err != nil || got[inbox.ReplayReplayed] != 2 {
		t.Fatalf("replay: %v %v", got, err)
	}
	var payload string
	if err := pool.QueryRow(ctx, `SELECT convert_from(decode(args->>'payload', 'base64'), 'UTF8') FROM river_job WHERE id = $1`, res[0].NewJobID).Scan(&payload); err != nil || payload != `{"amount":42}` {
		t.Fatalf("the replayed job's payload %q %v", payload, err)
	}

	// Two Repairs at once over 50 events whose jobs River gave up on:
	// each event is dead-lettered once, by one of them.
	for i := range 50 {
		accept("race", fmt.Sprintf("evt-%02d", i))
	}
	if _, err := pool.Exec(ctx, `UPDATE river_job SET state = 'discarded', attempt = 10, finalized_at = now() WHERE metadata->>'idem_source' = 'race'`); err != nil {
		t.Fatal(err)
	}
	reps := make([]inbox.RepairReport, 2)
	var rg sync.WaitGroup
	for i := range reps {
		rg.Go(func() {
			var err error
			if reps[i], err = in.Repair(ctx); err != nil {
				t.Error(err)
			}
		})
	}
	rg.Wait()
	if reps[0].Discarded+reps[1].Discarded != 50 || reps[0].Requeued+reps[1].Requeued != 0 {
		t.Fatalf("two repairs at once: %+v", reps)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem.holds WHERE source = 'race' AND state = 'dead' AND payload IS NOT NULL`); n != 50 {
		t.Fatalf("%d dead letters with their payload, want 50", n)
	}

	// 1,200 events whose jobs completed without completing them.
	const n = 1200
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := w; i < n; i += 8 {
				if _, err := in.Accept(ctx, &inbox.Delivery{Source: "overlap", Key: fmt.Sprintf("evt-%04d", i), Payload: []byte(`{}`)}); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if _, err := pool.Exec(ctx, `UPDATE river_job SET state = 'completed', finalized_at = now() WHERE metadata->>'idem_source' = 'overlap'`); err != nil {
		t.Fatal(err)
	}
	if rep, err := in.Repair(ctx); err != nil || rep != (inbox.RepairReport{Requeued: n}) {
		t.Fatalf("repair of %d: %+v %v", n, rep, err)
	}
	if st, err := inbox.Reconcile(ctx, pool, ""); err != nil {
		t.Fatal(err)
	} else {
		for _, s := range st {
			if s.Unaccounted != 0 || !s.Balanced() {
				t.Fatalf("reconcile: %s", s)
			}
		}
	}
}

// TestRepairUnderApplicationLeader: an application runs its own River
// client (AddWorker), which leads. River enqueues periodic jobs on its
// leader only: with RepairPeriodicJob in that client's PeriodicJobs,
// Repair runs there, and an event whose job River gave up on becomes a
// dead letter without the application calling Repair.
func TestRepairUnderApplicationLeader(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	in, err := inbox.New(inbox.Config{Pool: pool, RepairEvery: time.Second,
		Handler: func(context.Context, pgx.Tx, *inbox.Delivery) (any, error) { return nil, nil }})
	if err != nil {
		t.Fatal(err)
	}
	a, err := in.Accept(ctx, &inbox.Delivery{Source: "app", Key: "evt_1", Payload: []byte(`{}`)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE river_job SET state = 'discarded', attempt = 10, finalized_at = now(),
		errors = ARRAY['{"at":"2026-11-28T00:00:00Z","attempt":10,"error":"Stuck job rescued by JobRescuer"}'::jsonb] WHERE id = $1`, a.JobID); err != nil {
		t.Fatal(err)
	}
	workers := river.NewWorkers()
	if err := in.AddWorker(workers); err != nil {
		t.Fatal(err)
	}
	rc, err := river.NewClient(riverpgxv5.New(pool), &river.Config{Workers: workers,
		Queues:       map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 2}, in.Queue(): {MaxWorkers: 2}},
		PeriodicJobs: []*river.PeriodicJob{in.RepairPeriodicJob()}})
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rc.Stop(context.Background()) })
	waitForLong(t, "the application's leader to repair the event", func() bool {
		return count(t, pool, `SELECT count(*) FROM idem.holds WHERE source = 'app' AND state = 'dead' AND payload IS NOT NULL`) == 1
	})
}

// TestReplayRunEnds: the replayed events fail for good again at once
// (workers running while the replay pages through 1,100 dead letters):
// the run goes through the dead letters there were when it started, each
// once, and ends; the ones dead again are there for the next run.
func TestReplayRunEnds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	const n = 1100
	manyDeadLetters(t, pool, "again", "evt", n)
	tool, err := inbox.New(inbox.Config{Pool: pool, Queue: "again_loop",
		Handler: func(context.Context, pgx.Tx, *inbox.Delivery) (any, error) {
			return nil, idem.Permanent(errors.New("still unknown"))
		}})
	if err != nil {
		t.Fatal(err)
	}
	start(t, tool, 8, nil)
	res, err := tool.Replay(ctx, inbox.Filter{Source: "again"})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	for _, r := range res {
		if seen[r.Key]++; seen[r.Key] > 1 {
			t.Fatalf("%s replayed twice in one run", r.Key)
		}
	}
	if len(seen) != n || outcomes(res)[inbox.ReplayReplayed] != n {
		t.Fatalf("%d keys, %v", len(seen), outcomes(res))
	}
}
