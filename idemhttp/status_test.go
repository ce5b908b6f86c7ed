package idemhttp_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/textproto"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/testdb"
)

// statusRow is a row of docs/http.md's status table: a handler behaviour
// and what the middleware makes of it.
type statusRow struct {
	name    string
	cfg     func(*idemhttp.Config)
	handler func(env *rowEnv, w http.ResponseWriter, r *http.Request)
	// first: the status the first request gets; problem: as problem+json.
	first   int
	problem bool
	// retry: the status a sequential retry gets, replayed when stored.
	retry    int
	replayed bool
	// runs: handler runs after the first request and its retry.
	runs int
	// attempts: the key's attempts (idem.processed_events) after both:
	// each run that counts is one.
	attempts int
	// once: a storm of 50 concurrent copies runs the handler exactly
	// once; otherwise at least once, one run at a time.
	once bool
	// raw: the handler's answer is not valid HTTP for Go's client (a NUL
	// in a header): the first request is read with a raw connection.
	raw bool
	// hangUp: the client hangs up while the handler runs.
	hangUp bool
	// overlap: runs may overlap (a lost lease: another worker takes over).
	overlap bool
}

// rowEnv is a row's run: its pool, source and the handler's gate (hangUp).
type rowEnv struct {
	pool    *pgxpool.Pool
	source  string
	started chan struct{} // closed by the first run (hangUp rows)
	proceed chan struct{} // the handler answers once it is closed (hangUp rows)
	once    sync.Once
}

var statusRows = []statusRow{
	{name: "2xx", first: 201, retry: 201, replayed: true, runs: 1, attempts: 1, once: true,
		handler: func(_ *rowEnv, w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, "created")
		}},
	{name: "1xx then 2xx", first: 201, retry: 201, replayed: true, runs: 1, attempts: 1, once: true,
		handler: func(_ *rowEnv, w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Link", "</style.css>; rel=preload")
			w.WriteHeader(http.StatusEarlyHints)
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, "created")
		}},
	{name: "1xx then 5xx", first: 503, retry: 503, runs: 2, attempts: 0,
		handler: func(_ *rowEnv, w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusEarlyHints)
			w.WriteHeader(http.StatusServiceUnavailable)
		}},
	{name: "3xx", first: 303, retry: 303, replayed: true, runs: 1, attempts: 1, once: true,
		handler: func(_ *rowEnv, w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Location", "/orders/1")
			w.WriteHeader(http.StatusSeeOther)
		}},
	{name: "4xx", first: 404, retry: 404, replayed: true, runs: 1, attempts: 1, once: true,
		handler: func(_ *rowEnv, w http.ResponseWriter, _ *http.Request) {
			http.Error(w, "no such account", http.StatusNotFound)
		}},
	{name: "409", first: 409, retry: 409, runs: 2, attempts: 0,
		handler: func(_ *rowEnv, w http.ResponseWriter, _ *http.Request) {
			http.Error(w, "the account is locked", http.StatusConflict)
		}},
	{name: "422", first: 422, retry: 422, replayed: true, runs: 1, attempts: 1, once: true,
		handler: func(_ *rowEnv, w http.ResponseWriter, _ *http.Request) {
			http.Error(w, "amount must be positive", http.StatusUnprocessableEntity)
		}},
	{name: "429", first: 429, retry: 429, runs: 2, attempts: 0,
		handler: func(_ *rowEnv, w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Retry-After", "1")
			http.Error(w, "slow down", http.StatusTooManyRequests)
		}},
	{name: "5xx", first: 500, retry: 500, runs: 2, attempts: 2,
		handler: func(_ *rowEnv, w http.ResponseWriter, _ *http.Request) {
			http.Error(w, "database down", http.StatusInternalServerError)
		}},
	{name: "panic", first: 500, problem: true, retry: 500, runs: 2, attempts: 2,
		handler: func(_ *rowEnv, _ http.ResponseWriter, _ *http.Request) {
			panic("boom")
		}},
	{name: "timeout", first: 503, problem: true, retry: 503, runs: 2, attempts: 2,
		// HandlerTimeout bounds the claim's round trip as well as the
		// handler: at 300 ms a claim slowed by a loaded CI machine ran out
		// of it before the handler started (503, the handler not run).
		cfg: func(c *idemhttp.Config) { c.HandlerTimeout = 2 * time.Second },
		handler: func(_ *rowEnv, _ http.ResponseWriter, r *http.Request) {
			<-r.Context().Done() // returns on the cancelled context, writes nothing
		}},
	{name: "lost lease", first: 409, problem: true, retry: 409, runs: 1, attempts: 1, overlap: true,
		cfg: func(c *idemhttp.Config) { c.Lease = 6 * time.Second }, // the retry comes well within it
		handler: func(env *rowEnv, _ http.ResponseWriter, r *http.Request) {
			// Another worker takes the key over: its token changes.
			if _, err := env.pool.Exec(context.Background(),
				`UPDATE idem.processed_events SET token = idem.new_token() WHERE source = $1 AND status = 'processing'`, env.source); err != nil {
				panic(err)
			}
			<-r.Context().Done() // cancelled when the heartbeat finds the lease lost
		}},
	{name: "unstorable answer", first: 201, retry: 201, replayed: true, runs: 1, attempts: 1, once: true, raw: true,
		handler: func(_ *rowEnv, w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Location", r.URL.Path) // "/files/report\x00.pdf": PostgreSQL cannot store it
			w.WriteHeader(http.StatusCreated)
		}},
	{name: "answer over the cap", first: 201, retry: 201, replayed: true, runs: 1, attempts: 1, once: true,
		cfg: func(c *idemhttp.Config) { c.MaxResponseBody = 1 << 10 },
		handler: func(_ *rowEnv, w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, strings.Repeat("x", 4<<10))
		}},
	{name: "answer over idem's stored result", first: 422, retry: 422, replayed: true, runs: 1, attempts: 1, once: true,
		cfg: func(c *idemhttp.Config) { c.MaxResponseBody = idemhttp.MaxResponseBodyLimit },
		handler: func(_ *rowEnv, w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("ETag", `"`+strings.Repeat("e", 300<<10)+`"`)
			w.WriteHeader(http.StatusUnprocessableEntity)
			io.WriteString(w, strings.Repeat("x", 700<<10)) // under the cap; not with the ETag
		}},
	{name: "client hung up", first: -1, retry: 201, replayed: true, runs: 1, attempts: 1, once: true, hangUp: true,
		handler: func(env *rowEnv, w http.ResponseWriter, _ *http.Request) {
			env.once.Do(func() { close(env.started) })
			<-env.proceed
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, "created")
		}},
}

// noRedirects is a client that reads a 3xx instead of following it.
var noRedirects = &http.Client{Timeout: 30 * time.Second,
	CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}

// TestStatusTable: every row of docs/http.md's status table, on a real
// server and client: what the first request gets, what a retry gets
// (replayed when stored), how often the handler ran, how many attempts
// the key counts, and a storm of 50 concurrent copies: the handler runs
// once where the row stores the answer, and never twice at once.
func TestStatusTable(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, testdb.New(t), 64)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i, row := range statusRows {
		t.Run(row.name, func(t *testing.T) {
			for _, phase := range []string{"sequential", "storm"} {
				env := &rowEnv{pool: pool, source: fmt.Sprintf("row%d-%s", i, phase),
					started: make(chan struct{}), proceed: make(chan struct{})}
				var runs, active, maxActive atomic.Int64
				cfg := idemhttp.Config{Client: c, Source: env.source, Scope: idemhttp.Unscoped,
					Logger: quietLogger}
				if row.cfg != nil {
					row.cfg(&cfg)
				}
				mw, err := idemhttp.New(cfg)
				if err != nil {
					t.Fatal(err)
				}
				srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					runs.Add(1)
					n := active.Add(1)
					defer active.Add(-1)
					for m := maxActive.Load(); n > m && !maxActive.CompareAndSwap(m, n); m = maxActive.Load() {
					}
					row.handler(env, w, r)
				})))
				if phase == "sequential" {
					row.sequential(t, env, srv, &runs)
				} else {
					row.storm(t, env, srv, &runs, &maxActive)
				}
				srv.Close()
			}
		})
	}
}

const rowPath = "/files/report%00.pdf"

func (row statusRow) sequential(t *testing.T, env *rowEnv, srv *httptest.Server, runs *atomic.Int64) {
	t.Helper()
	switch {
	case row.raw:
		if got := rawStatus(t, srv.URL, rowPath, "k"); got != row.first {
			t.Fatalf("first: %d, want %d", got, row.first)
		}
	case row.hangUp:
		ctx, cancel := context.WithCancel(context.Background())
		go func() { <-env.started; cancel() }()
		if _, err := sendCtx(ctx, srv.URL+rowPath, "k"); !errors.Is(err, context.Canceled) {
			t.Fatalf("the client that hung up: %v", err)
		}
		close(env.proceed)
		waitStored(t, env, "k")
	default:
		r, err := sendCtx(context.Background(), srv.URL+rowPath, "k")
		if err != nil {
			t.Fatal(err)
		}
		if r.status != row.first || row.problem != (r.header.Get("Content-Type") == "application/problem+json") {
			t.Fatalf("first: %d %s %.200q, want %d (problem %v)", r.status, r.header.Get("Content-Type"), r.body, row.first, row.problem)
		}
		if strings.HasPrefix(row.name, "1xx") && r.got1xx != http.StatusEarlyHints {
			t.Fatalf("the 103 was not sent (got %d)", r.got1xx)
		}
	}
	r, err := sendCtx(context.Background(), srv.URL+rowPath, "k")
	if err != nil {
		t.Fatal(err)
	}
	if r.status != row.retry || (r.header.Get(idemhttp.ReplayedHeader) == "true") != row.replayed {
		t.Fatalf("retry: %d replayed %q %.200q, want %d replayed %v", r.status, r.header.Get(idemhttp.ReplayedHeader), r.body, row.retry, row.replayed)
	}
	if got := runs.Load(); got != int64(row.runs) {
		t.Fatalf("the handler ran %d times, want %d", got, row.runs)
	}
	var attempts int
	if err := env.pool.QueryRow(context.Background(), `SELECT attempts FROM idem.processed_events WHERE source = $1 AND key = 'k'`,
		env.source).Scan(&attempts); err != nil {
		t.Fatal(err)
	}
	if attempts != row.attempts {
		t.Fatalf("attempts %d, want %d", attempts, row.attempts)
	}
}

// storm fires 50 copies of one request at once, each on its own
// connection.
func (row statusRow) storm(t *testing.T, env *rowEnv, srv *httptest.Server, runs, maxActive *atomic.Int64) {
	t.Helper()
	const copies = 50
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if row.hangUp {
		go func() { <-env.started; cancel() }() // every client hangs up once the handler runs
	}
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range copies {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			_, _ = sendCtx(ctx, srv.URL+rowPath, "s") // the raw row's answer does not parse: only runs count
		}()
	}
	close(start)
	wg.Wait()
	if row.hangUp {
		close(env.proceed)
		waitStored(t, env, "s")
	}
	got := runs.Load()
	switch {
	case row.once && got != 1:
		t.Fatalf("%d copies ran the handler %d times, want once", copies, got)
	case got < 1 || got > copies:
		t.Fatalf("%d copies ran the handler %d times", copies, got)
	case !row.overlap && maxActive.Load() != 1:
		t.Fatalf("%d runs at once", maxActive.Load())
	}
}

// waitStored waits until the key's answer is recorded (the handler of a
// client that hung up goes on).
func waitStored(t *testing.T, env *rowEnv, key string) {
	t.Helper()
	for range 500 {
		var status string
		err := env.pool.QueryRow(context.Background(), `SELECT status FROM idem.processed_events WHERE source = $1 AND key = $2`,
			env.source, key).Scan(&status)
		if err == nil && status != "processing" {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatal("the answer of the client that hung up was never recorded")
}

type rowReply struct {
	reply
	got1xx int
}

func sendCtx(ctx context.Context, url, k string) (rowReply, error) {
	var got1xx atomic.Int64
	ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{Got1xxResponse: func(code int, _ textproto.MIMEHeader) error {
		got1xx.Store(int64(code))
		return nil
	}})
	req, err := http.NewRequestWithContext(ctx, "POST", url, strings.NewReader(`{"n":1}`))
	if err != nil {
		return rowReply{}, err
	}
	req.Header.Set("Idempotency-Key", k)
	resp, err := noRedirects.Do(req)
	if err != nil {
		return rowReply{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return rowReply{reply{resp.StatusCode, resp.Header, string(b)}, int(got1xx.Load())}, err
}

// rawStatus sends a request on a raw connection and reads the status of
// the answer, which Go's client would refuse (a NUL in a header).
func rawStatus(t *testing.T, base, path, k string) int {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: x\r\nIdempotency-Key: %s\r\nContent-Length: 7\r\nConnection: close\r\n\r\n{\"n\":1}", path, k)
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	var status int
	if _, err := fmt.Sscanf(line, "HTTP/1.1 %d", &status); err != nil {
		t.Fatalf("status line %q: %v", line, err)
	}
	return status
}

var quietLogger = slog.New(slog.DiscardHandler)
