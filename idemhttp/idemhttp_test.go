package idemhttp_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
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

func TestMain(m *testing.M) { testdb.Main(m) }

// setup returns a pool on a fresh database and a server whose handler is
// wrapped by the middleware built from cfg (Client filled in).
func setup(t *testing.T, cfg idemhttp.Config, h http.Handler) (*httptest.Server, *pgxpool.Pool) {
	t.Helper()
	pool := testdb.Pool(t, testdb.New(t), 32)
	var err error
	cfg.Client, err = idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Source == "" {
		cfg.Source = "api"
	}
	if cfg.Key == nil && cfg.Scope == nil {
		cfg.Scope = idemhttp.Unscoped
	}
	mw, err := idemhttp.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(h))
	t.Cleanup(srv.Close)
	return srv, pool
}

type reply struct {
	status int
	header http.Header
	body   string
}

func send(t *testing.T, srv *httptest.Server, method, path, body string, headers map[string]string) reply {
	t.Helper()
	req, err := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return reply{resp.StatusCode, resp.Header, string(b)}
}

var client = &http.Client{Timeout: 30 * time.Second}

func key(k string) map[string]string { return map[string]string{"Idempotency-Key": k} }

// requireProblem checks an RFC 9457 problem+json response.
func requireProblem(t *testing.T, r reply, status int) {
	t.Helper()
	if r.status != status || r.header.Get("Content-Type") != "application/problem+json" {
		t.Fatalf("got %d %s %s, want a %d problem+json", r.status, r.header.Get("Content-Type"), r.body, status)
	}
	var p struct {
		Type   string `json:"type"`
		Title  string `json:"title"`
		Status int    `json:"status"`
		Detail string `json:"detail"`
	}
	if err := json.Unmarshal([]byte(r.body), &p); err != nil || p.Status != status || p.Title == "" || p.Type == "" {
		t.Fatalf("problem body %s: %+v %v", r.body, p, err)
	}
}

func TestResponsePaths(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	release := make(chan struct{})
	entered := make(chan struct{}, 1)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		body, _ := io.ReadAll(r.Body)
		switch r.URL.Path {
		case "/orders":
			w.Header().Set("Location", "/orders/7")
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("X-Not-Replayed", "x")
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"order":7,"echo":%q}`, body)
		case "/slow":
			entered <- struct{}{}
			<-release
			w.WriteHeader(http.StatusAccepted)
		case "/down":
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprint(w, "upstream down")
		case "/bad":
			w.WriteHeader(http.StatusUnprocessableEntity)
			fmt.Fprint(w, "no such customer")
		case "/panic":
			panic("handler bug")
		case "/huge":
			w.Write([]byte(strings.Repeat("x", 600<<10)))
		}
	})
	srv, _ := setup(t, idemhttp.Config{}, h)

	t.Run("missing key is 400", func(t *testing.T) {
		requireProblem(t, send(t, srv, "POST", "/orders", "{}", nil), http.StatusBadRequest)
	})
	t.Run("first runs, duplicate replays", func(t *testing.T) {
		before := runs.Load()
		first := send(t, srv, "POST", "/orders", `{"qty":1}`, key("k-orders"))
		second := send(t, srv, "POST", "/orders", `{"qty":1}`, key("k-orders"))
		if runs.Load()-before != 1 {
			t.Fatalf("handler ran %d times", runs.Load()-before)
		}
		if first.status != 201 || second.status != 201 || first.body != second.body ||
			second.header.Get("Location") != "/orders/7" || second.header.Get("Content-Type") != "application/json" {
			t.Fatalf("first %+v\nsecond %+v", first, second)
		}
		if first.header.Get(idemhttp.ReplayedHeader) != "" || second.header.Get(idemhttp.ReplayedHeader) != "true" {
			t.Fatalf("Idempotency-Replayed: first %q second %q", first.header.Get(idemhttp.ReplayedHeader), second.header.Get(idemhttp.ReplayedHeader))
		}
		if second.header.Get("X-Not-Replayed") != "" {
			t.Fatal("a header outside ReplayHeaders was replayed")
		}
	})
	t.Run("structured-field key", func(t *testing.T) {
		a := send(t, srv, "POST", "/orders", `{"qty":1}`, key(`"sf-\"quoted\"-key"`))
		b := send(t, srv, "POST", "/orders", `{"qty":1}`, key(`"sf-\"quoted\"-key"`))
		if a.status != 201 || b.header.Get(idemhttp.ReplayedHeader) != "true" {
			t.Fatalf("%+v %+v", a, b)
		}
		requireProblem(t, send(t, srv, "POST", "/orders", "{}", key(`"unterminated`)), http.StatusBadRequest)
		requireProblem(t, send(t, srv, "POST", "/orders", "{}", key(`"bad \x escape"`)), http.StatusBadRequest)
	})
	t.Run("key too long is 400", func(t *testing.T) {
		requireProblem(t, send(t, srv, "POST", "/orders", "{}", key(strings.Repeat("k", 600))), http.StatusBadRequest)
	})
	t.Run("different payload is 422", func(t *testing.T) {
		send(t, srv, "POST", "/orders", `{"qty":1}`, key("k-mismatch"))
		requireProblem(t, send(t, srv, "POST", "/orders", `{"qty":2}`, key("k-mismatch")), http.StatusUnprocessableEntity)
	})
	t.Run("in flight is 409 with Retry-After", func(t *testing.T) {
		done := make(chan reply)
		go func() { done <- send(t, srv, "POST", "/slow", "", key("k-slow")) }()
		<-entered // the first request is inside the handler
		r := send(t, srv, "POST", "/slow", "", key("k-slow"))
		close(release)
		defer func() {
			if first := <-done; first.status != http.StatusAccepted {
				t.Errorf("the first request: %+v", first)
			}
		}()
		requireProblem(t, r, http.StatusConflict)
		if ra := r.header.Get("Retry-After"); ra == "" || ra == "0" {
			t.Fatalf("Retry-After %q", ra)
		}

	})
	t.Run("5xx releases the key", func(t *testing.T) {
		before := runs.Load()
		a := send(t, srv, "POST", "/down", "", key("k-down"))
		b := send(t, srv, "POST", "/down", "", key("k-down"))
		if a.status != 503 || b.status != 503 || a.body != "upstream down" || runs.Load()-before != 2 {
			t.Fatalf("5xx: %+v %+v runs=%d", a, b, runs.Load()-before)
		}
	})
	t.Run("4xx is stored and replayed", func(t *testing.T) {
		before := runs.Load()
		a := send(t, srv, "POST", "/bad", "", key("k-bad"))
		b := send(t, srv, "POST", "/bad", "", key("k-bad"))
		if a.status != 422 || b.status != 422 || b.body != "no such customer" || runs.Load()-before != 1 {
			t.Fatalf("4xx: %+v %+v", a, b)
		}
	})
	t.Run("panic is 500 and releases the key", func(t *testing.T) {
		before := runs.Load()
		requireProblem(t, send(t, srv, "POST", "/panic", "", key("k-panic")), http.StatusInternalServerError)
		requireProblem(t, send(t, srv, "POST", "/panic", "", key("k-panic")), http.StatusInternalServerError)
		if runs.Load()-before != 2 {
			t.Fatalf("after a panic the handler ran %d times, want 2", runs.Load()-before)
		}
	})
	t.Run("request body over the cap is 413", func(t *testing.T) {
		requireProblem(t, send(t, srv, "POST", "/orders", strings.Repeat("x", 2<<20), key("k-big")), http.StatusRequestEntityTooLarge)
	})
	t.Run("response over the cap is sent in full, its status stored without the body", func(t *testing.T) {
		before := runs.Load()
		a := send(t, srv, "POST", "/huge", "", key("k-huge"))
		b := send(t, srv, "POST", "/huge", "", key("k-huge"))
		if a.status != 200 || len(a.body) != 600<<10 {
			t.Fatalf("first: %d, %d bytes; want 200 and the whole body", a.status, len(a.body))
		}
		if b.status != 200 || len(b.body) != 0 || b.header.Get(idemhttp.ReplayedHeader) != "true" || runs.Load()-before != 1 {
			t.Fatalf("duplicate: %d, %d bytes, replayed=%q, runs=%d; want a replayed 200 with no body and one run",
				b.status, len(b.body), b.header.Get(idemhttp.ReplayedHeader), runs.Load()-before)
		}
	})
}

func TestPassThroughMissingKey(t *testing.T) {
	t.Parallel()
	srv, _ := setup(t, idemhttp.Config{PassThroughMissingKey: true}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "ran")
	}))
	if r := send(t, srv, "POST", "/", "", nil); r.status != 200 || r.body != "ran" {
		t.Fatalf("%+v", r)
	}
}

func TestStoreConfigurable(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	srv, _ := setup(t, idemhttp.Config{Store: func(int) bool { return true }}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusBadGateway)
	}))
	send(t, srv, "POST", "/", "", key("k"))
	if r := send(t, srv, "POST", "/", "", key("k")); r.status != 502 || r.header.Get(idemhttp.ReplayedHeader) != "true" || runs.Load() != 1 {
		t.Fatalf("stored 5xx: %+v runs=%d", r, runs.Load())
	}
}

// TestConcurrentIdenticalRequests: 8 identical requests per key at once,
// 150 keys: the handler body runs once per key.
func TestConcurrentIdenticalRequests(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	runs := map[string]int{}
	srv, _ := setup(t, idemhttp.Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		runs[r.Header.Get("Idempotency-Key")]++
		mu.Unlock()
		time.Sleep(5 * time.Millisecond)
		fmt.Fprint(w, "done")
	}))
	const keys, copies = 150, 8
	var wg sync.WaitGroup
	var conflicts, replays atomic.Int64
	start := make(chan struct{})
	for k := range keys {
		for range copies {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				r := send(t, srv, "POST", "/hook", `{"a":1}`, key(fmt.Sprintf("race-%d", k)))
				switch {
				case r.status == http.StatusConflict:
					conflicts.Add(1)
				case r.status == 200 && r.body == "done":
					if r.header.Get(idemhttp.ReplayedHeader) == "true" {
						replays.Add(1)
					}
				default:
					t.Errorf("unexpected %+v", r)
				}
			}()
		}
	}
	close(start)
	wg.Wait()
	if len(runs) != keys {
		t.Fatalf("handler ran for %d keys, want %d", len(runs), keys)
	}
	for k, n := range runs {
		if n != 1 {
			t.Errorf("handler ran %d times for %s", n, k)
		}
	}
	t.Logf("%d replays, %d conflicts (409)", replays.Load(), conflicts.Load())
}

func TestConfigRefused(t *testing.T) {
	t.Parallel()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 1), nil)
	for name, cfg := range map[string]idemhttp.Config{
		"negative TTL":             {Client: c, Source: "s", TTL: -time.Second},
		"negative lease":           {Client: c, Source: "s", Lease: -time.Second},
		"negative handler timeout": {Client: c, Source: "s", HandlerTimeout: -time.Second},
		"negative body cap":        {Client: c, Source: "s", MaxRequestBody: -1},
	} {
		if _, err := idemhttp.New(cfg); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// TestTransientAnswersNotStored: answers that describe the moment, not the
// request, are not stored, so the sender's retry runs the handler again.
func TestTransientAnswersNotStored(t *testing.T) {
	t.Parallel()
	stripe := senders[0]
	for _, mode := range []struct {
		name    string
		cfg     idemhttp.Config
		headers func(body string) map[string]string
		answers []int // what the handler answers first; it answers 200 once fixed
	}{
		{"IETF Idempotency-Key", idemhttp.Config{}, func(string) map[string]string { return key("k") },
			[]int{401, 403, 408, 409, 425, 429}},
		{"Stripe preset", idemhttp.Config{}.Apply(idemhttp.Stripe(stripe.secret)),
			func(body string) map[string]string { return stripe.delivery(stripe.secret, body, time.Now()) },
			[]int{400, 401, 403, 404, 409, 422, 429}},
	} {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			for _, first := range mode.answers {
				var runs atomic.Int64
				var fixed atomic.Bool
				srv, _ := setup(t, mode.cfg, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					runs.Add(1)
					if !fixed.Load() {
						w.WriteHeader(first)
						return
					}
					fmt.Fprint(w, "done")
				}))
				b := strings.Replace(stripeEvent, "evt_1NG8Du2eZvKYlo2CUI79vXWy", fmt.Sprintf("evt_%d", first), 1)
				if r := send(t, srv, "POST", "/", b, mode.headers(b)); r.status != first {
					t.Fatalf("first answer %d, want %d", r.status, first)
				}
				fixed.Store(true) // the secret is fixed; the object now exists
				if r := send(t, srv, "POST", "/", b, mode.headers(b)); r.status != 200 || r.body != "done" || runs.Load() != 2 {
					t.Fatalf("after a %d: the retry got %d %q, handler ran %d times, want it run again", first, r.status, r.body, runs.Load())
				}
			}
		})
	}
}

// TestClientScope: keys are scoped by the principal Config.Scope names
// from the application's authentication, not by credentials. The same
// Idempotency-Key and body from two principals are two keys, each gets
// its own replay; the same principal after a token refresh (another
// Authorization header) is the same client, replayed, not run again; a
// request whose principal is unknown is 401 and claims nothing.
func TestClientScope(t *testing.T) {
	t.Parallel()
	tokens := map[string]string{"Bearer alice-1": "alice", "Bearer alice-2": "alice", "Bearer bob-1": "bob"}
	scope := func(r *http.Request) (string, error) {
		if p, ok := tokens[r.Header.Get("Authorization")]; ok {
			return p, nil
		}
		return "", idemhttp.ErrNoPrincipal
	}
	var runs atomic.Int64
	srv, pool := setup(t, idemhttp.Config{Scope: scope}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		fmt.Fprintf(w, "account of %s", tokens[r.Header.Get("Authorization")])
	}))
	as := func(token string) map[string]string {
		return map[string]string{"Idempotency-Key": `"order-1"`, "Authorization": token}
	}
	a1 := send(t, srv, "POST", "/orders", `{"qty":1}`, as("Bearer alice-1"))
	b1 := send(t, srv, "POST", "/orders", `{"qty":1}`, as("Bearer bob-1"))
	a2 := send(t, srv, "POST", "/orders", `{"qty":1}`, as("Bearer alice-2")) // refreshed token
	if b1.body != "account of bob" || b1.header.Get(idemhttp.ReplayedHeader) != "" {
		t.Fatalf("bob got %q (replayed %q): another client's answer", b1.body, b1.header.Get(idemhttp.ReplayedHeader))
	}
	if a1.body != "account of alice" || a2.body != a1.body || a2.header.Get(idemhttp.ReplayedHeader) != "true" || runs.Load() != 2 {
		t.Fatalf("alice: %q then, with a refreshed token, %q (replayed %q); handler ran %d times", a1.body, a2.body, a2.header.Get(idemhttp.ReplayedHeader), runs.Load())
	}
	requireProblem(t, send(t, srv, "POST", "/orders", `{"qty":1}`, as("Bearer stolen")), http.StatusUnauthorized)
	if runs.Load() != 2 {
		t.Fatal("a request without a principal ran the handler")
	}
	// The key is visible as the principal's: idemctl release --key 'alice|order-1'.
	if st, err := testdb.Client(t, pool, nil).Peek(context.Background(), "api", idem.ScopeKey("alice", "order-1")); err != nil || st != "completed" {
		t.Fatalf("alice's key: %q, %v", st, err)
	}
}

type answers struct {
	mu  sync.Mutex
	got []idemhttp.Answer
}

func (a *answers) ObserveAnswer(_ string, ans idemhttp.Answer) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.got = append(a.got, ans)
}

func (a *answers) last() idemhttp.Answer {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.got) == 0 {
		return ""
	}
	return a.got[len(a.got)-1]
}

// TestLeaseLost: another worker takes the key over while the handler runs
// (its token changes under it). The heartbeat's extend fails and the
// handler's context is cancelled: a handler that stops there gets 409 with
// Retry-After (the retry gets the other run's answer); one that ignores its
// context and answers has its answer sent. Both are reported as
// AnswerLeaseLost, and nothing of the lost run is stored.
func TestLeaseLost(t *testing.T) {
	t.Parallel()
	var pool *pgxpool.Pool
	ready := make(chan struct{})
	obs := &answers{}
	srv, p := setup(t, idemhttp.Config{Lease: time.Second, Observer: obs}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-ready
		if _, err := pool.Exec(context.Background(), `UPDATE idem.processed_events SET token = idem.new_token() WHERE status = 'processing'`); err != nil {
			t.Error(err)
		}
		if r.Header.Get("X-Ignore-Context") == "" {
			select {
			case <-r.Context().Done():
				return // nothing written
			case <-time.After(10 * time.Second):
				t.Error("the handler's context was not cancelled after the lease was lost")
			}
		}
		time.Sleep(1500 * time.Millisecond) // past a heartbeat
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "made by the lost run")
	}))
	pool = p
	close(ready)

	r := send(t, srv, "POST", "/orders", `{}`, key("lost-1"))
	requireProblem(t, r, http.StatusConflict)
	if r.header.Get("Retry-After") == "" || obs.last() != idemhttp.AnswerLeaseLost {
		t.Fatalf("handler stopped by the lost lease: %+v, answer %q", r, obs.last())
	}

	r = send(t, srv, "POST", "/orders", `{}`, map[string]string{"Idempotency-Key": "lost-2", "X-Ignore-Context": "1"})
	if r.status != http.StatusCreated || r.body != "made by the lost run" || obs.last() != idemhttp.AnswerLeaseLost {
		t.Fatalf("handler that answered anyway: %+v, answer %q", r, obs.last())
	}
	var stored int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM idem.processed_events WHERE status <> 'processing'`).Scan(&stored); err != nil || stored != 0 {
		t.Fatalf("%d keys recorded by lost runs (%v), want none", stored, err)
	}
}
