package oteltest_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
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

	"github.com/exaring/otelpgx"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemotel"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
)

const childEnv = "IDEMOTEL_TEST_CHILD"

// fileExporter writes each span as a line of JSON as it ends, so that a
// worker process killed later has already written every span it ended.
type fileExporter struct {
	mu sync.Mutex
	f  *os.File
}

func (e *fileExporter) ExportSpans(_ context.Context, spans []sdktrace.ReadOnlySpan) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, s := range spans {
		b, err := json.Marshal(fromSDK(s))
		if err != nil {
			return err
		}
		if _, err := e.f.Write(append(b, '\n')); err != nil {
			return err
		}
	}
	return nil
}

func (e *fileExporter) Shutdown(context.Context) error { return nil }

// child is an inbox worker process: its spans go to CHILD_SPANS. With
// CHILD_HANG, the handler tells the test it started and hangs until the
// process is killed.
func child() int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, err); return 1 }
	ctx := context.Background()
	f, err := os.OpenFile(os.Getenv("CHILD_SPANS"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fail(err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(&fileExporter{f: f}))
	tel, err := idemotel.New(&idemotel.Config{TracerProvider: tp})
	if err != nil {
		return fail(err)
	}
	cfg, err := pgxpool.ParseConfig(os.Getenv("CHILD_URL"))
	if err != nil {
		return fail(err)
	}
	cfg.ConnConfig.Tracer = otelpgx.NewTracer(otelpgx.WithTracerProvider(tp))
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fail(err)
	}
	c, err := idem.New(pool, &idem.Config{Tracer: tel})
	if err != nil {
		return fail(err)
	}
	hang := os.Getenv("CHILD_HANG") != ""
	in, err := inbox.New(inbox.Config{Pool: pool, Idem: c, Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
		if hang {
			fmt.Println("handling")
			select {}
		}
		return "done", nil
	}})
	if err != nil {
		return fail(err)
	}
	rc, err := in.NewWorkerClient(1, &river.Config{JobTimeout: 2 * time.Second, RescueStuckJobsAfter: 3 * time.Second})
	if err != nil {
		return fail(err)
	}
	if err := rc.Start(ctx); err != nil {
		return fail(err)
	}
	fmt.Println("working")
	select {}
}

// startChild starts a worker process and returns it and its stdout.
func startChild(t *testing.T, url, spans string, hang bool) (*exec.Cmd, *bufio.Reader) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1", "CHILD_URL="+url, "CHILD_SPANS="+spans)
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
	r := bufio.NewReader(out)
	if line, err := r.ReadString('\n'); err != nil || line != "working\n" {
		t.Fatalf("worker did not start: %q %v", line, err)
	}
	return cmd, r
}

func readSpans(t *testing.T, path string) []span {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	var out []span
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if line == "" {
			continue
		}
		var s span
		if err := json.Unmarshal([]byte(line), &s); err != nil {
			t.Fatal(err)
		}
		out = append(out, s)
	}
	return out
}

// acceptingStack is the process that answers deliveries 202: idemhttp in
// asynchronous mode over the inbox, behind otelhttp.
func acceptingStack(t *testing.T) (*stack, *inbox.Inbox, string) {
	t.Helper()
	url := testdb.New(t)
	s := newStack(t, url, idemotel.KeyHash)
	if _, err := inbox.Migrate(context.Background(), s.pool, ""); err != nil {
		t.Fatal(err)
	}
	in, err := inbox.New(inbox.Config{Pool: s.pool, Idem: s.client})
	if err != nil {
		t.Fatal(err)
	}
	h, err := in.HTTP(idemhttp.Config{Client: s.client, Source: "shop", Scope: idemhttp.Unscoped}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(otelhttp.NewHandler(h, "POST /orders", otelhttp.WithTracerProvider(s.tp)))
	t.Cleanup(srv.Close)
	return s, in, srv.URL
}

// TestInboxTraceAcrossProcesses: a delivery answered 202 in this process
// is worked by another; the worker's span links to the accepting
// request's trace. The first worker is killed (SIGKILL) mid-handler; River
// rescues the job and a new worker process retries it: the retried
// attempt links to the same trace. The trace context is in the job's
// metadata, never in its arguments.
func TestInboxTraceAcrossProcesses(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, _, url := acceptingStack(t)
	if code, body := post(t, url, secretKey); code != http.StatusAccepted {
		t.Fatal(code, body)
	}
	accepted := fromSDKs(s.rec.Ended())
	srv := one(t, serverSpans(accepted), "POST")
	send := one(t, accepted, "send ")
	mustParent(t, accepted, send, "POST")
	if srv.Attrs["idem.http.answer"] != "accepted" {
		t.Fatalf("the accepting server span: %v", srv.Attrs)
	}
	var args, meta string
	if err := s.pool.QueryRow(ctx, `SELECT args::text, metadata::text FROM river_job WHERE kind = $1`, inbox.Kind).Scan(&args, &meta); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(meta, `"idem_trace"`) || !strings.Contains(meta, srv.TraceID) || strings.Contains(args, srv.TraceID) {
		t.Fatalf("the trace context belongs in the job's metadata: metadata %s args %s", meta, args)
	}

	dir := t.TempDir()
	first, out := startChild(t, s.url, dir+"/first.jsonl", true)
	if line, err := out.ReadString('\n'); err != nil || line != "handling\n" {
		t.Fatalf("the first worker did not start the handler: %q %v", line, err)
	}
	go io.Copy(io.Discard, out)
	if err := first.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = first.Wait()

	startChild(t, s.url, dir+"/second.jsonl", false)
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var state string
		var attempt int
		if err := s.pool.QueryRow(ctx, `SELECT state, attempt FROM river_job WHERE kind = $1`, inbox.Kind).Scan(&state, &attempt); err != nil {
			t.Fatal(err)
		}
		if state == "completed" {
			if attempt < 2 {
				t.Fatalf("completed at attempt %d: the killed attempt was not retried", attempt)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the job is %s at attempt %d after 2 minutes", state, attempt)
		}
		time.Sleep(100 * time.Millisecond)
	}
	spans := readSpans(t, dir+"/second.jsonl")
	var process span
	for _, sp := range find(spans, "process ") {
		if sp.Attrs["idem.inbox.outcome"] == "processed" {
			process = sp
		}
	}
	if process.Name == "" {
		t.Fatalf("no processed attempt in the second worker's spans:\n%s", render(spans))
	}
	if process.Kind != "consumer" || process.Attrs["idem.attempt"] < "2" || process.Attrs["messaging.system"] != "river" {
		t.Fatalf("the retried attempt's span: %v", process)
	}
	if len(process.Links) != 1 || process.Links[0].TraceID != srv.TraceID || process.Links[0].SpanID != send.SpanID {
		t.Fatalf("the retried attempt links to %v, want the accepting request's trace %s (span %s)", process.Links, srv.TraceID, send.SpanID)
	}
	var rm metricdata.ResourceMetrics
	if err := s.reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	if got := sums(rm); got["idem.inbox.accepted{idem.source=shop}"] != 1 {
		t.Fatalf("accepted: %v", got)
	}
	noSecrets(t, append(accepted, append(spans, readSpans(t, dir+"/first.jsonl")...)...), rm, secretKey, secretToken)
	writeTree(t, "inbox: accepted", render(inTrace(accepted, srv.TraceID)))
	writeTree(t, "inbox: worked in another process", render(inTrace(spans, process.TraceID)))
}

// TestInboxTraceAfterReplay: a dead-lettered event replayed (a new job)
// still links to the request that accepted it, and the inbox's metrics
// count the acceptance, the dead letter and the processing.
func TestInboxTraceAfterReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, in, url := acceptingStack(t)
	var fail sync.Once
	if err := in.Handle("shop", func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
		var err error
		fail.Do(func() { err = idem.Permanent(errors.New("the order service refused it")) })
		return nil, err
	}); err == nil {
		t.Fatal("a second handler for the source was accepted")
	}
	// The source's handler is in.HTTP's; a worker of another Inbox over
	// the same client runs this test's handler.
	worker, err := inbox.New(inbox.Config{Pool: s.pool, Idem: s.client, Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
		var err error
		fail.Do(func() { err = idem.Permanent(errors.New("the order service refused it")) })
		return nil, err
	}})
	if err != nil {
		t.Fatal(err)
	}
	if code, body := post(t, url, secretKey); code != http.StatusAccepted {
		t.Fatal(code, body)
	}
	srv := one(t, serverSpans(fromSDKs(s.rec.Ended())), "POST")
	startWorker(t, worker)
	var dead []inbox.DeadLetter
	waitUntil(t, "the dead letter", func() bool {
		dead, err = in.DeadLetters(ctx, inbox.Filter{Source: "shop"})
		return err == nil && len(dead) == 1
	})
	res, err := in.Replay(ctx, inbox.Filter{Source: "shop"})
	if err != nil || len(res) != 1 || res[0].Outcome != "replayed" {
		t.Fatal(res, err)
	}
	processedLinksTo(t, s, "the replayed job", srv.TraceID)
	var rm metricdata.ResourceMetrics
	if err := s.reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	got := sums(rm)
	for k, want := range map[string]int64{
		"idem.inbox.accepted{idem.source=shop}":      2, // the delivery, the replay
		"idem.inbox.dead_lettered{idem.source=shop}": 1,
		"idem.inbox.processed{idem.source=shop}":     1,
		"idem.inbox.lag{idem.source=shop}":           2, // each job's first attempt
	} {
		if got[k] != want {
			t.Errorf("%s = %d, want %d (all: %v)", k, got[k], want, got)
		}
	}
	noSecrets(t, fromSDKs(s.rec.Ended()), rm, secretKey, secretToken)
}

// TestInboxTraceAfterRepair: a delivery answered 202 whose job finished
// without processing it (its River row marked completed by hand, as River
// can leave one when two attempts overlap) is enqueued again by Repair;
// the new job's attempt links to the accepting request's trace, which
// Repair carries over from the old job's metadata.
func TestInboxTraceAfterRepair(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, in, url := acceptingStack(t)
	if code, body := post(t, url, secretKey); code != http.StatusAccepted {
		t.Fatal(code, body)
	}
	srv := one(t, serverSpans(fromSDKs(s.rec.Ended())), "POST")
	tag, err := s.pool.Exec(ctx, `UPDATE river_job SET state = 'completed', finalized_at = now() WHERE kind = $1`, inbox.Kind)
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatal(tag, err)
	}
	rep, err := in.Repair(ctx)
	if err != nil || rep.Requeued != 1 {
		t.Fatal(rep, err)
	}
	startWorker(t, in)
	processedLinksTo(t, s, "the repaired job", srv.TraceID)
	noSecrets(t, fromSDKs(s.rec.Ended()), metricdata.ResourceMetrics{}, secretKey, secretToken)
}

// startWorker starts a worker client of in, one worker, stopped at the
// test's end.
func startWorker(t *testing.T, in *inbox.Inbox) {
	t.Helper()
	rc, err := in.NewWorkerClient(1, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rc.Stop(context.Background()) })
}

// processedLinksTo waits for a process span whose attempt processed the
// event (what names the job) and checks that it links to trace.
func processedLinksTo(t *testing.T, s *stack, what, trace string) {
	t.Helper()
	var processed span
	waitUntil(t, what+" processed", func() bool {
		for _, sp := range find(fromSDKs(s.rec.Ended()), "process ") {
			if sp.Attrs["idem.inbox.outcome"] == "processed" {
				processed = sp
				return true
			}
		}
		return false
	})
	if len(processed.Links) != 1 || processed.Links[0].TraceID != trace {
		t.Fatalf("%s's span links to %v, want the accepting request's trace %s", what, processed.Links, trace)
	}
}

func waitUntil(t *testing.T, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within a minute", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
