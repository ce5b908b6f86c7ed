package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
	"github.com/riverqueue/river/rivertype"
	"github.com/stripe/stripe-go/v85/webhook"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(child())
	}
	testdb.Main(m)
}

// setup returns a pool on a fresh database with idem's and River's
// migrations, and a table the handlers write to.
func setup(t testing.TB) (string, *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 40)
	if _, err := inbox.Migrate(ctx, pool, ""); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE processed (source text, key text, attempt int, at timestamptz DEFAULT clock_timestamp())`); err != nil {
		t.Fatal(err)
	}
	return url, pool
}

// record is a handler's business write, in the job's transaction.
func record(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) error {
	_, err := tx.Exec(ctx, `INSERT INTO processed (source, key, attempt) VALUES ($1, $2, $3)`, d.Source, d.Key, d.Attempt)
	return err
}

// start runs a worker client until the test ends.
func start(t testing.TB, in *inbox.Inbox, workers int, base *river.Config) *river.Client[pgx.Tx] {
	t.Helper()
	rc, err := in.NewWorkerClient(workers, base)
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = rc.Stop(ctx)
	})
	return rc
}

// waitFor polls cond until it holds or 60 seconds pass.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatalf("timed out waiting for %s", what)
}

func count(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// fast retries after 50 ms times the attempt, for tests.
type fast struct{}

func (fast) NextRetry(job *rivertype.JobRow) time.Time {
	return time.Now().Add(time.Duration(job.Attempt) * 50 * time.Millisecond)
}

// TestAcceptThenProcess: 30 events, each accepted by 4 racing deliveries:
// one job each; the worker processes each once, writing in the job's
// transaction, and completes its key. Deliveries after that are
// duplicates and insert nothing.
func TestAcceptThenProcess(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	var ran atomic.Int64
	in, err := inbox.New(inbox.Config{Pool: pool, Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
		ran.Add(1)
		if _, ok := idem.EventFrom(ctx); !ok {
			return nil, errors.New("no event in the handler's context")
		}
		return map[string]string{"payload": string(d.Payload)}, record(ctx, tx, d)
	}})
	if err != nil {
		t.Fatal(err)
	}
	var accepted, dups atomic.Int64
	var wg sync.WaitGroup
	for i := range 30 {
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				a, err := in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: fmt.Sprintf("order-%d", i), Payload: []byte(fmt.Sprintf(`{"n":%d}`, i))})
				switch {
				case err != nil:
					t.Error(err)
				case a.Duplicate:
					dups.Add(1)
				default:
					accepted.Add(1)
				}
			}()
		}
	}
	wg.Wait()
	if accepted.Load() != 30 || dups.Load() != 90 {
		t.Fatalf("accepted %d, duplicates %d; want 30 and 90", accepted.Load(), dups.Load())
	}
	if n := count(t, pool, `SELECT count(*) FROM river_job WHERE kind = $1`, inbox.Kind); n != 30 {
		t.Fatalf("%d jobs, want 30", n)
	}
	start(t, in, 10, nil)
	waitFor(t, "every key completed", func() bool {
		return count(t, pool, `SELECT count(*) FROM idem.processed_events WHERE source = 'shop' AND status = 'completed'`) == 30
	})
	if n := count(t, pool, `SELECT count(*) FROM processed`); n != 30 || ran.Load() != 30 {
		t.Fatalf("%d rows, handler ran %d times; want 30", n, ran.Load())
	}
	a, err := in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: "order-7", Payload: []byte(`{"n":7}`)})
	if err != nil || !a.Duplicate || a.Outcome != idem.Completed {
		t.Fatalf("accept after processing: %+v %v", a, err)
	}
	var result string
	if err := pool.QueryRow(ctx, `SELECT result::text FROM idem.processed_events WHERE key = 'order-7'`).Scan(&result); err != nil || result != `{"payload": "{\"n\":7}"}` {
		t.Fatalf("stored result %s (%v)", result, err)
	}
	// A key accepted without a fingerprint matches any; one accepted with
	// a fingerprint refuses another.
	if a, err := in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: "order-8", Fingerprint: "other", Payload: []byte(`{}`)}); err != nil || !a.Duplicate {
		t.Fatalf("order-8 with a fingerprint: %+v %v, want a duplicate", a, err)
	}
	if _, err := in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: "fp-1", Fingerprint: "a", Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	if _, err := in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: "fp-1", Fingerprint: "b", Payload: []byte(`{}`)}); !errors.Is(err, idem.ErrMismatch) {
		t.Fatalf("changed payload: %v, want ErrMismatch", err)
	}
}

// TestPoisonEvent: an event whose handler keeps failing is retried with
// backoff up to its source's maximum, dead-lettered, counted and listed
// with its last error; after the fix it is replayed and processed once;
// replaying it again, or replaying an event processed meanwhile, does
// nothing.
func TestPoisonEvent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	var fixed atomic.Bool
	var ran atomic.Int64
	in, err := inbox.New(inbox.Config{Pool: pool, RetryPolicy: fast{}, MaxAttempts: map[string]int{"poison": 3},
		Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
			if !fixed.Load() {
				return nil, fmt.Errorf("attempt %d: unknown customer in %s", d.Attempt, d.Payload)
			}
			ran.Add(1)
			return nil, record(ctx, tx, d)
		}})
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"evt_bad", "evt_other"} {
		if _, err := in.Accept(ctx, &inbox.Delivery{Source: "poison", Key: key, Payload: []byte(`{"customer":"cus_x"}`)}); err != nil {
			t.Fatal(err)
		}
	}
	start(t, in, 4, nil)
	var dead []inbox.DeadLetter
	waitFor(t, "two dead letters, discarded by River", func() bool {
		dead, err = in.DeadLetters(ctx, inbox.Filter{Source: "poison"})
		return err == nil && len(dead) == 2 && dead[0].State == rivertype.JobStateDiscarded && dead[1].State == rivertype.JobStateDiscarded
	})
	d := dead[0]
	if d.Key != "evt_bad" {
		d = dead[1]
	}
	if d.Key != "evt_bad" || d.Attempts != 3 || !strings.Contains(d.LastError, "attempt 3: unknown customer") || d.State != rivertype.JobStateDiscarded {
		t.Fatalf("dead letter %+v", d)
	}
	// Retried with backoff: the attempts were spread out.
	var spread time.Duration
	if err := pool.QueryRow(ctx, `SELECT (max((e->>'at')::timestamptz) - min((e->>'at')::timestamptz)) FROM river_job, jsonb_array_elements(to_jsonb(errors)) e WHERE id = $1`, d.JobID).Scan(&spread); err != nil || spread < 100*time.Millisecond {
		t.Fatalf("attempts spread over %v (%v); want the backoff between them", spread, err)
	}
	st, err := in.Stats(ctx)
	if err != nil || len(st) != 1 || st[0].Source != "poison" || st[0].Dead != 2 {
		t.Fatalf("stats %+v %v", st, err)
	}
	if since, _ := in.DeadLetters(ctx, inbox.Filter{Since: time.Now().Add(time.Hour)}); len(since) != 0 {
		t.Fatalf("--since in the future listed %d", len(since))
	}

	// Meanwhile the sender redelivered evt_other and it was processed.
	fixed.Store(true)
	a, err := in.Accept(ctx, &inbox.Delivery{Source: "poison", Key: "evt_other", Payload: []byte(`{"customer":"cus_x"}`)})
	if err != nil || a.Duplicate {
		t.Fatalf("redelivery of a dead-lettered event: %+v %v; want it accepted again", a, err)
	}
	waitFor(t, "evt_other processed", func() bool {
		return count(t, pool, `SELECT count(*) FROM processed WHERE key = 'evt_other'`) == 1
	})

	// The redelivery took evt_other's dead letter over: it is no longer
	// one, so the replay finds evt_bad only.
	res, err := in.Replay(ctx, inbox.Filter{Source: "poison"})
	if err != nil || len(res) != 1 || res[0].Key != "evt_bad" || res[0].Outcome != "replayed" {
		t.Fatalf("replay: %+v %v", res, err)
	}
	waitFor(t, "evt_bad processed", func() bool {
		return count(t, pool, `SELECT count(*) FROM processed WHERE key = 'evt_bad'`) == 1
	})
	again, err := in.Replay(ctx, inbox.Filter{Source: "poison", Key: "evt_bad"})
	if err != nil || len(again) != 0 {
		t.Fatalf("second replay: %+v %v", again, err)
	}
	if left, _ := in.DeadLetters(ctx, inbox.Filter{}); len(left) != 0 {
		t.Fatalf("dead letters left: %+v", left)
	}
	time.Sleep(200 * time.Millisecond)
	if ran.Load() != 2 || count(t, pool, `SELECT count(*) FROM processed`) != 2 {
		t.Fatalf("handler succeeded %d times; want once per event", ran.Load())
	}
}

// TestPermanentIsDeadAtOnce: an error marked idem.Permanent dead-letters
// the job at the first attempt (cancelled).
func TestPermanentIsDeadAtOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	var calls atomic.Int64
	in, _ := inbox.New(inbox.Config{Pool: pool, Handler: func(context.Context, pgx.Tx, *inbox.Delivery) (any, error) {
		calls.Add(1)
		return nil, idem.Permanent(errors.New("malformed event"))
	}})
	if _, err := in.Accept(ctx, &inbox.Delivery{Source: "s", Key: "k", Payload: []byte(`x`)}); err != nil {
		t.Fatal(err)
	}
	start(t, in, 1, nil)
	waitFor(t, "the dead letter", func() bool {
		d, err := in.DeadLetters(ctx, inbox.Filter{})
		return err == nil && len(d) == 1 && d[0].State == rivertype.JobStateCancelled && d[0].Attempts == 1
	})
	if calls.Load() != 1 {
		t.Fatalf("called %d times", calls.Load())
	}
}

// TestConfig: bad settings are refused at construction.
func TestConfig(t *testing.T) {
	t.Parallel()
	_, pool := setup(t)
	for name, cfg := range map[string]inbox.Config{
		"no pool":      {},
		"max attempts": {Pool: pool, DefaultMaxAttempts: -1},
		"per source":   {Pool: pool, MaxAttempts: map[string]int{"s": 0}},
		"repair every": {Pool: pool, RepairEvery: time.Millisecond},
		"run lease":    {Pool: pool, RunLease: 8 * 24 * time.Hour},
		"negative ttl": {Pool: pool, TTL: -time.Second},
	} {
		if _, err := inbox.New(cfg); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("%s: %v, want ErrInvalidConfig", name, err)
		}
	}
	// A queue name River refuses is refused when the first job is inserted.
	bad, err := inbox.New(inbox.Config{Pool: pool, Queue: "has space"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bad.Accept(context.Background(), &inbox.Delivery{Source: "s", Key: "k"}); err == nil {
		t.Error("a job was inserted into queue \"has space\"")
	}
	in, _ := inbox.New(inbox.Config{Pool: pool})
	if _, err := in.NewWorkerClient(1, nil); !errors.Is(err, inbox.ErrNoHandler) {
		t.Errorf("worker without a handler: %v", err)
	}
}

// TestMigrateNextToRiver: an application already runs River in the
// database, with a job of its own. idem's River migrations apply nothing,
// leave its job alone, and run again, or four at once on a fresh
// database, without error.
func TestMigrateNextToRiver(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 8)
	m, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		t.Fatal(err)
	}
	app, err := river.NewClient(riverpgxv5.New(pool), &river.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := app.Insert(ctx, appJob{}, nil); err != nil {
		t.Fatal(err)
	}
	applied, err := inbox.Migrate(ctx, pool, "")
	if err != nil || len(applied) != 0 {
		t.Fatalf("next to the app's River: applied %v, %v", applied, err)
	}
	if n := count(t, pool, `SELECT count(*) FROM river_job WHERE kind = 'app_job'`); n != 1 {
		t.Fatalf("the app's job: %d", n)
	}

	fresh := testdb.Pool(t, testdb.New(t), 8)
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := inbox.Migrate(ctx, fresh, ""); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if n := count(t, fresh, `SELECT count(*) FROM river_migration`); n == 0 {
		t.Fatal("no River migrations recorded")
	}
}

type appJob struct{}

func (appJob) Kind() string { return "app_job" }

// TestRiverStaysOut: programs that do not use the inbox do not import
// River: idem, idemhttp, idemprom and the generated accessors.
func TestRiverStaysOut(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "-deps", "github.com/idemkit/idem", "github.com/idemkit/idem/idemhttp",
		"github.com/idemkit/idem/idemprom", "github.com/idemkit/idem/db/pgxdb", "github.com/idemkit/idem/db/sqldb").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	if strings.Contains(string(out), "riverqueue") {
		t.Fatal("River is in the import graph of a package that does not use the inbox")
	}
}

// TestAsyncHTTP: idemhttp's asynchronous mode on the inbox, over real
// HTTP: a verified delivery is answered 202 and queued; its duplicate 202
// with Idempotency-Replayed, as is the same (signed) event id with other
// bytes; a forged one 401. The worker runs the very http.Handler a synchronous
// middleware would (inbox.FromHTTP), once, with the payload and the
// sender's headers; a non-2xx answer from it is retried.
func TestAsyncHTTP(t *testing.T) {
	t.Parallel()
	_, pool := setup(t)
	var calls atomic.Int64
	var mu sync.Mutex
	var bodies []string
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if calls.Add(1) == 1 {
			http.Error(w, "ledger busy", http.StatusServiceUnavailable) // retried
			return
		}
		mu.Lock()
		bodies = append(bodies, string(b)+" signed:"+fmt.Sprint(r.Header.Get("Stripe-Signature") != ""))
		mu.Unlock()
		w.WriteHeader(http.StatusOK)
	})
	in, err := inbox.New(inbox.Config{Pool: pool, RetryPolicy: fast{}, Handler: inbox.FromHTTP(h)})
	if err != nil {
		t.Fatal(err)
	}
	mw, err := idemhttp.New(idemhttp.Config{Client: testdb.Client(t, pool, nil), Async: in}.Apply(idemhttp.Stripe("whsec_async")))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.NotFoundHandler()))
	t.Cleanup(srv.Close)
	post := func(body, secret string) *http.Response {
		p := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: []byte(body), Secret: secret, Timestamp: time.Now()})
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(body))
		req.Header.Set("Stripe-Signature", p.Header)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}
	body := `{"id":"evt_async","type":"invoice.paid","data":{"object":{}}}`
	if r := post(body, "whsec_async"); r.StatusCode != 202 || r.Header.Get("Idempotency-Replayed") != "" {
		t.Fatalf("first: %d %v", r.StatusCode, r.Header)
	}
	if r := post(body, "whsec_async"); r.StatusCode != 202 || r.Header.Get("Idempotency-Replayed") != "true" {
		t.Fatalf("duplicate: %d %v", r.StatusCode, r.Header)
	}
	// Stripe signs the event id: the same id with other bytes is the same
	// event (re-serialized, pending_webhooks changed), a duplicate.
	if r := post(`{"id":"evt_async","type":"invoice.paid","data":{"object":{"changed":1}}}`, "whsec_async"); r.StatusCode != 202 || r.Header.Get("Idempotency-Replayed") != "true" {
		t.Fatalf("changed body: %d %v", r.StatusCode, r.Header)
	}
	if r := post(`{"id":"evt_forged"}`, "whsec_forger"); r.StatusCode != 401 {
		t.Fatalf("forged: %d", r.StatusCode)
	}
	start(t, in, 2, nil)
	waitFor(t, "the event processed", func() bool {
		return count(t, pool, `SELECT count(*) FROM idem.processed_events WHERE key = 'evt_async' AND status = 'completed'`) == 1
	})
	mu.Lock()
	defer mu.Unlock()
	if calls.Load() != 2 || len(bodies) != 1 || bodies[0] != body+" signed:true" {
		t.Fatalf("handler calls %d, bodies %q", calls.Load(), bodies)
	}
	if n := count(t, pool, `SELECT count(*) FROM river_job WHERE kind = $1`, inbox.Kind); n != 1 {
		t.Fatalf("%d jobs, want 1", n)
	}
}
