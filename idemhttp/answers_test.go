package idemhttp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/testdb"
)

// TestResponseCapRefused: a MaxResponseBody whose answer, base64 in the
// stored result, could exceed idem's stored-result limit is refused at
// New (ErrInvalidConfig); the limit itself is accepted.
func TestResponseCapRefused(t *testing.T) {
	t.Parallel()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 2), nil)
	for i, n := range []int{1 << 20, idemhttp.MaxResponseBodyLimit + 1} {
		_, err := idemhttp.New(idemhttp.Config{Client: c, Source: fmt.Sprintf("cap%d", i), Scope: idemhttp.Unscoped, MaxResponseBody: n})
		if !errors.Is(err, idemhttp.ErrInvalidConfig) || !strings.Contains(err.Error(), "MaxResponseBody") {
			t.Fatalf("MaxResponseBody %d: %v, want ErrInvalidConfig", n, err)
		}
	}
	if _, err := idemhttp.New(idemhttp.Config{Client: c, Source: "ok", Scope: idemhttp.Unscoped, MaxResponseBody: idemhttp.MaxResponseBodyLimit}); err != nil {
		t.Fatal(err)
	}
}

// TestRateLimitedNotCounted: a handler that answers 429 (a status about
// the moment) more often than the source's max_attempts does not fail the
// key for good: once the limit lifts, the request runs. 500s still count,
// and the key that failed for good says so without internals.
func TestRateLimitedNotCounted(t *testing.T) {
	t.Parallel()
	var limited atomic.Bool
	limited.Store(true)
	var runs atomic.Int64
	srv, pool := setup(t, idemhttp.Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		switch {
		case r.URL.Path == "/broken":
			http.Error(w, "broken", http.StatusInternalServerError)
		case limited.Load():
			http.Error(w, "slow down", http.StatusTooManyRequests)
		default:
			w.WriteHeader(http.StatusCreated)
		}
	}))
	if _, err := pool.Exec(context.Background(), `INSERT INTO idem.policies (source, ttl, lease, max_attempts) VALUES ('api', '1 day', '1 minute', 3)`); err != nil {
		t.Fatal(err)
	}
	for i := range 6 {
		if r := send(t, srv, "POST", "/pay", `{}`, key("rl")); r.status != http.StatusTooManyRequests {
			t.Fatalf("rate-limited answer %d: %d %s", i+1, r.status, r.body)
		}
	}
	limited.Store(false)
	if r := send(t, srv, "POST", "/pay", `{}`, key("rl")); r.status != http.StatusCreated {
		t.Fatalf("once the limit lifted: %d %s, want 201 (the request run)", r.status, r.body)
	}
	for range 3 {
		send(t, srv, "POST", "/broken", `{}`, key("broken"))
	}
	r := send(t, srv, "POST", "/broken", `{}`, key("broken"))
	requireProblem(t, r, http.StatusUnprocessableEntity)
	if strings.Contains(r.body, "handler answered") || strings.Contains(r.body, "gave up") || strings.Contains(r.body, "idem:") {
		t.Fatalf("the failed key's answer carries internals: %s", r.body)
	}
}

// TestScopeRequired: client-chosen Idempotency-Key headers without
// Config.Scope are refused at New (ErrScopeRequired, ErrInvalidConfig);
// Unscoped, a preset and a payload key need none.
func TestScopeRequired(t *testing.T) {
	t.Parallel()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 2), nil)
	_, err := idemhttp.New(idemhttp.Config{Client: c, Source: "a"})
	if !errors.Is(err, idemhttp.ErrScopeRequired) || !errors.Is(err, idemhttp.ErrInvalidConfig) {
		t.Fatalf("no Scope: %v, want ErrScopeRequired", err)
	}
	for i, cfg := range []idemhttp.Config{{Scope: idemhttp.Unscoped}, {Key: idemhttp.JSONKey("", "id")},
		(idemhttp.Config{}).Apply(idemhttp.Stripe("whsec_x"))} {
		cfg.Client, cfg.Source = c, fmt.Sprintf("ok%d", i)
		if _, err := idemhttp.New(cfg); err != nil {
			t.Fatalf("config %d: %v", i, err)
		}
	}
}

// TestPayloadKeysNotScoped: a key taken from the event identifies the
// event whoever sends it: the same event delivered with a rotated token,
// or with none, is replayed, not run again, and its key is the event id
// as idemctl release --key finds it; that credentials come with keys that
// are not scoped is logged once. A key an earlier version stored under
// the "anonymous" scope is still found by a delivery without credentials.
func TestPayloadKeysNotScoped(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	logs := &capturedLog{}
	srv, pool := setup(t, idemhttp.Config{Source: "events", Key: idemhttp.JSONKey("", "id"), Logger: slog.New(slog.NewTextHandler(logs, nil))}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		io.WriteString(w, "processed")
	}))
	ev := `{"id":"evt_1"}`
	send(t, srv, "POST", "/hook", ev, map[string]string{"Authorization": "Bearer token-1"})
	r2 := send(t, srv, "POST", "/hook", ev, map[string]string{"Authorization": "Bearer token-2"})
	r3 := send(t, srv, "POST", "/hook", ev, nil)
	if runs.Load() != 1 || r2.header.Get(idemhttp.ReplayedHeader) != "true" || r3.header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Fatalf("one event with a rotated token and with none ran %d times", runs.Load())
	}
	// Requests with credentials and keys not scoped: said once, in the log.
	if n := strings.Count(logs.String(), "Config.Scope is not set"); n != 1 {
		t.Fatalf("the warning about unscoped keys with credentials was logged %d times, want once: %s", n, logs.String())
	}
	c := testdb.Client(t, pool, nil)
	if st, err := c.Peek(context.Background(), "events", "evt_1"); err != nil || st != "completed" {
		t.Fatalf("the event's key under its own id: %q %v", st, err)
	}
	// Stored by an earlier version, which scoped it "anonymous".
	old := idem.ScopeKey("anonymous", "evt_2")
	cl, err := c.Claim(context.Background(), "events", old)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Complete(context.Background(), "events", old, cl.Token, json.RawMessage(`{"status":200,"body":"b2xk"}`)); err != nil {
		t.Fatal(err)
	}
	if r := send(t, srv, "POST", "/hook", `{"id":"evt_2"}`, nil); r.body != "old" || runs.Load() != 1 {
		t.Fatalf("an event stored by an earlier version: %q, runs %d", r.body, runs.Load())
	}
}

// capturedLog is a slog handler's output, safe for concurrent writes.
type capturedLog struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *capturedLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *capturedLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestProblemsLeakNothing: problem answers carry what the client can act
// on and a request id; the SQL error, the source, the scope and the key
// go to the log under the same id.
func TestProblemsLeakNothing(t *testing.T) {
	t.Parallel()
	logs := &capturedLog{}
	srv, _ := setup(t, idemhttp.Config{Source: "secret-source", Scope: func(*http.Request) (string, error) { return "tenant-42", nil },
		Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }))
	long := strings.Repeat("k", 600) // over idem's 512 bytes: refused by the claim
	for name, h := range map[string]map[string]string{
		"key over 512 bytes": key(long),
		"bad key header":     key(`"unterminated`),
	} {
		r := send(t, srv, "POST", "/orders", `{}`, h)
		requireProblem(t, r, http.StatusBadRequest)
		var p struct {
			Detail    string `json:"detail"`
			RequestID string `json:"request_id"`
		}
		if err := json.Unmarshal([]byte(r.body), &p); err != nil {
			t.Fatal(err)
		}
		for _, leak := range []string{"secret-source", "tenant-42", "idem:", "SQLSTATE", "kkkkkkkk"} {
			if strings.Contains(r.body, leak) {
				t.Fatalf("%s: the answer carries %q: %s", name, leak, r.body)
			}
		}
		if p.RequestID == "" || r.header.Get(idemhttp.RequestIDHeader) != p.RequestID || !strings.Contains(logs.String(), "request_id="+p.RequestID) {
			t.Fatalf("%s: request id %q not in the log: %s", name, p.RequestID, logs.String())
		}
	}
	if !strings.Contains(logs.String(), "tenant-42") {
		t.Fatalf("the log does not say which key: %s", logs.String())
	}
}

// TestRepeatedKeyHeader: two Idempotency-Key header lines, or a list a
// proxy combined them into, are 400 (an RFC 8941 Item field does not
// parse as a list), not keyed by the first.
func TestRepeatedKeyHeader(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	srv, _ := setup(t, idemhttp.Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs.Add(1) }))
	for _, values := range [][]string{{`"a"`, `"b"`}, {"a", "b"}, {`"a", "b"`}, {"a, b"}} {
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(`{}`))
		req.Header["Idempotency-Key"] = values
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("Idempotency-Key %q: %d, want 400", values, resp.StatusCode)
		}
	}
	if runs.Load() != 0 {
		t.Fatal("a request with two keys ran the handler")
	}
}

// TestFingerprintCoversQuery: the same key with another query string is
// a mismatch (422), not the first answer replayed; a key stored by an
// earlier version (method, path and body only) is still replayed to its
// retry.
func TestFingerprintCoversQuery(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	srv, pool := setup(t, idemhttp.Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		fmt.Fprintf(w, "charged %s", r.URL.Query().Get("amount"))
	}))
	if r := send(t, srv, "POST", "/charge?amount=1", `{}`, key("q")); r.body != "charged 1" {
		t.Fatalf("first: %+v", r)
	}
	requireProblem(t, send(t, srv, "POST", "/charge?amount=1000", `{}`, key("q")), http.StatusUnprocessableEntity)
	if r := send(t, srv, "POST", "/charge?amount=1", `{}`, key("q")); r.body != "charged 1" || r.header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Fatalf("the same query again: %+v", r)
	}
	// As an earlier version stored it.
	c := testdb.Client(t, pool, nil)
	old := idem.Fingerprint([]byte("POST"), []byte("/charge"), []byte(`{}`))
	cl, err := c.Claim(context.Background(), "api", "legacy", idem.WithFingerprint(old))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Complete(context.Background(), "api", "legacy", cl.Token, json.RawMessage(`{"status":200,"body":"b2xk"}`)); err != nil {
		t.Fatal(err)
	}
	if r := send(t, srv, "POST", "/charge?amount=5", `{}`, key("legacy")); r.body != "old" || runs.Load() != 1 {
		t.Fatalf("the retry of a request stored before the upgrade: %d %q, runs %d", r.status, r.body, runs.Load())
	}
}

// TestLargeAnswerStreams: an answer over MaxResponseBody streams to the
// client as the handler writes and flushes it (http.Flusher and
// http.ResponseController), through a reverse proxy; its status and
// headers are stored, and a duplicate gets them without running the
// handler. The handler writes its second part only once the client has
// read the first: were the answer buffered, the test would never end.
func TestLargeAnswerStreams(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"Flusher", "ResponseController"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			gotFirst := make(chan struct{})
			var runs atomic.Int64
			srv, _ := setup(t, idemhttp.Config{MaxResponseBody: 1 << 10}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				w.Header().Set("Content-Type", "text/event-stream")
				w.WriteHeader(http.StatusAccepted)
				io.WriteString(w, strings.Repeat("a", 4<<10)+"\n")
				if how == "Flusher" {
					w.(http.Flusher).Flush()
				} else if err := http.NewResponseController(w).Flush(); err != nil {
					panic(err)
				}
				select {
				case <-gotFirst:
				case <-time.After(20 * time.Second):
					io.WriteString(w, "not streamed\n")
					return
				}
				io.WriteString(w, "second\n")
			}))
			target, _ := url.Parse(srv.URL)
			proxy := httputil.NewSingleHostReverseProxy(target)
			front := httptest.NewServer(proxy)
			defer front.Close()

			req, _ := http.NewRequest("POST", front.URL+"/stream", strings.NewReader(`{}`))
			req.Header.Set("Idempotency-Key", "big")
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			first := make([]byte, 4<<10+1)
			if _, err := io.ReadFull(resp.Body, first); err != nil {
				t.Fatal(err)
			}
			close(gotFirst)
			rest, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != http.StatusAccepted || string(rest) != "second\n" {
				t.Fatalf("%d, rest %q", resp.StatusCode, rest)
			}
			dup := send(t, srv, "POST", "/stream", `{}`, key("big"))
			if dup.status != http.StatusAccepted || dup.header.Get("Content-Type") != "text/event-stream" || dup.body != "" || runs.Load() != 1 {
				t.Fatalf("duplicate: %d %q %q, runs %d", dup.status, dup.header.Get("Content-Type"), dup.body, runs.Load())
			}
		})
	}
}

// TestLargeAnswerMemory: a 50 MB answer (over MaxResponseBody) is not
// held in memory: what the process allocates while it is answered stays
// far below its size. Not parallel: the allocations counted are the
// process's. The numbers are in docs/performance.md.
func TestLargeAnswerMemory(t *testing.T) {
	const size, chunk = 50 << 20, 32 << 10
	buf := bytes.Repeat([]byte("x"), chunk)
	srv, _ := setup(t, idemhttp.Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for n := 0; n < size; n += chunk {
			w.Write(buf)
		}
	}))
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	// The peak of the heap in use, sampled while the answer is sent.
	var peak atomic.Uint64
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		var ms runtime.MemStats
		for {
			runtime.ReadMemStats(&ms)
			if ms.HeapInuse > peak.Load() {
				peak.Store(ms.HeapInuse)
			}
			select {
			case <-stop:
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()
	req, _ := http.NewRequest("POST", srv.URL+"/export", strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", "50mb")
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	n, err := io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	runtime.ReadMemStats(&after)
	close(stop)
	<-sampled
	if err != nil || n != size {
		t.Fatalf("read %d bytes, %v", n, err)
	}
	alloc := after.TotalAlloc - before.TotalAlloc
	t.Logf("50 MB answer: %.1f MB allocated while it was answered; heap in use %.1f MB before, peak %.1f MB (+%.1f MB)",
		float64(alloc)/(1<<20), float64(before.HeapInuse)/(1<<20), float64(peak.Load())/(1<<20),
		float64(peak.Load()-min(peak.Load(), before.HeapInuse))/(1<<20))
	if alloc > 20<<20 {
		t.Fatalf("%d bytes allocated for a %d-byte answer: it was held in memory", alloc, size)
	}
}

// TestPanicWhileStreaming: a handler that panics after part of a large
// answer went out: the answer is cut off (the client reads an error, never
// a complete-looking answer), the key is released and the retry runs.
func TestPanicWhileStreaming(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	srv, _ := setup(t, idemhttp.Config{MaxResponseBody: 1 << 10, Logger: quietLogger}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if runs.Add(1) == 1 {
			io.WriteString(w, strings.Repeat("a", 8<<10))
			w.(http.Flusher).Flush()
			panic("boom")
		}
		io.WriteString(w, "whole")
	}))
	req, _ := http.NewRequest("POST", srv.URL+"/export", strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", "p")
	resp, err := client.Do(req)
	if err == nil {
		_, err = io.ReadAll(resp.Body)
		resp.Body.Close()
	}
	if err == nil {
		t.Fatal("the answer of a handler that panicked while it streamed read as complete")
	}
	if r := send(t, srv, "POST", "/export", `{}`, key("p")); r.body != "whole" || runs.Load() != 2 {
		t.Fatalf("retry: %q, runs %d", r.body, runs.Load())
	}
}
