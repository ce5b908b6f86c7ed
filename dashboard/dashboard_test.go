package dashboard_test

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"html"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dashboard"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// fixture is a database with claims of two sources (sampling 1: exact
// counts), a snapshot, a prune run, and five dead letters of source
// "shop" whose handler fails the first time only.
type fixture struct {
	pool *pgxpool.Pool
	in   *inbox.Inbox
	mu   sync.Mutex
	runs map[string]int // key -> times the handler committed
}

func setup(t *testing.T) *fixture {
	t.Helper()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 20)
	if _, err := inbox.Migrate(ctx, pool, ""); err != nil {
		t.Fatal(err)
	}
	f := &fixture{pool: pool, runs: map[string]int{}}
	failed := map[string]bool{}
	in, err := inbox.New(inbox.Config{Pool: pool, Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
		f.mu.Lock()
		defer f.mu.Unlock()
		if !failed[d.Key] {
			failed[d.Key] = true
			return nil, idem.Permanent(errors.New("upstream said 422: unknown customer"))
		}
		f.runs[d.Key]++
		return map[string]string{"ok": d.Key}, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	f.in = in
	if _, err := pool.Exec(ctx, `
		INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling) VALUES ('web', '1 day', '1 minute', 1), ('shop', '7 days', '1 minute', 1);
		SELECT idem.claim('web', 'k' || g) FROM generate_series(1, 30) g;
		SELECT idem.complete('web', 'k' || g, (SELECT token FROM idem.processed_events WHERE source = 'web' AND key = 'k' || g), '{"email": "someone@example.com"}')
		  FROM generate_series(1, 20) g;
		SELECT idem.claim('web', 'k' || (g % 20 + 1)) FROM generate_series(1, 10) g;
		SELECT idem.fail('web', 'k21', (SELECT token FROM idem.processed_events WHERE source = 'web' AND key = 'k21'), 'card declined', false)`); err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		if _, err := in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: "evt_" + string(rune('a'+i)), EventType: "order.paid",
			Payload: []byte(`{"secret_payload": true}`)}); err != nil {
			t.Fatal(err)
		}
	}
	rc, err := in.NewWorkerClient(2, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = rc.Stop(ctx)
	})
	waitFor(t, "5 dead letters", func() bool {
		n, err := in.CountDeadLetters(ctx, inbox.Filter{})
		return err == nil && n == 5
	})
	// River records a job's end after its work returns, on its own
	// schedule (its completer): the pages read the jobs' states too.
	waitFor(t, "their 5 jobs cancelled", func() bool {
		counts, err := in.JobCounts(ctx, 100)
		return err == nil && counts["cancelled"] == 5
	})
	if _, err := pool.Exec(ctx, `SELECT idem.snapshot_stats()`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CALL idem.prune()`); err != nil {
		t.Fatal(err)
	}
	return f
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatalf("timed out waiting for %s", what)
}

func serve(t *testing.T, cfg dashboard.Config) *httptest.Server {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	d, err := dashboard.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(d)
	t.Cleanup(srv.Close)
	return srv
}

func get(t *testing.T, u string) (int, string) {
	t.Helper()
	resp, err := http.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func post(t *testing.T, u string, form url.Values, header map[string]string) (int, string) {
	t.Helper()
	return postHost(t, u, "", form, header)
}

// postHost posts form to u with the Host header host ("": u's).
func postHost(t *testing.T, u, host string, form url.Values, header map[string]string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, u, strings.NewReader(form.Encode()))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for k, v := range header {
		req.Header.Set(k, v)
	}
	if host != "" {
		req.Host = host
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// getHost GETs u with the Host header host and returns the status.
func getHost(t *testing.T, u, host string) int {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, u, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Host = host
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

func contains(t *testing.T, page, body string, want ...string) {
	t.Helper()
	for _, w := range want {
		if !strings.Contains(body, w) {
			t.Errorf("%s: %q not in the page:\n%s", page, w, body)
		}
	}
}

func TestPages(t *testing.T) {
	t.Parallel()
	f := setup(t)
	srv := serve(t, dashboard.Config{Pool: f.pool, Inbox: f.in})

	t.Run("overview", func(t *testing.T) {
		code, body := get(t, srv.URL+"/")
		if code != 200 {
			t.Fatalf("%d %s", code, body)
		}
		// web: 30 acquired + 10 duplicates = 25.0%; shop: 5 acquired (the
		// accepts), no duplicate.
		contains(t, "overview", body, `id="source-web"`, `data-figure="rate-1h">25.0%`, `data-figure="rate-24h">25.0%`,
			`id="source-shop"`, `<svg class="chart"`, `class="threshold"`, "alert 20.0%", "duplicates above 20.0%")
		if strings.Contains(body, "someone@example.com") || strings.Contains(body, "secret_payload") {
			t.Fatal("the overview shows a result or a payload")
		}
	})
	t.Run("keys", func(t *testing.T) {
		code, body := get(t, srv.URL+"/keys?source=web&status=failed")
		if code != 200 {
			t.Fatalf("%d %s", code, body)
		}
		contains(t, "keys", body, ">k21<", "card declined")
		_, body = get(t, srv.URL+"/keys?source=web&key=k1")
		contains(t, "lookup", body, "completed", "hidden: results can hold personal data")
		if strings.Contains(body, "someone@example.com") {
			t.Fatal("a result is shown without ShowResults")
		}
		shown := serve(t, dashboard.Config{Pool: f.pool, ShowResults: true})
		_, body = get(t, shown.URL+"/keys?source=web&key=k1")
		contains(t, "lookup with ShowResults", body, "someone@example.com")
		_, body = get(t, srv.URL+"/keys?source=web&key=nope")
		contains(t, "lookup of a missing key", body, "No key")
	})
	t.Run("dead letters", func(t *testing.T) {
		code, body := get(t, srv.URL+"/dead?source=shop&error=UNKNOWN+customer")
		if code != 200 {
			t.Fatalf("%d %s", code, body)
		}
		contains(t, "dead", body, `data-figure="dead-count">5<`, "evt_a", "upstream said 422", "Read-only")
		if strings.Contains(body, `type="checkbox"`) || strings.Contains(body, "secret_payload") {
			t.Fatal("read-only page offers a selection, or shows a payload")
		}
		_, body = get(t, srv.URL+"/dead?error=timeout")
		contains(t, "dead, no match", body, `data-figure="dead-count">0<`)
	})
	t.Run("maintenance", func(t *testing.T) {
		code, body := get(t, srv.URL+"/maintenance")
		if code != 200 {
			t.Fatalf("%d %s", code, body)
		}
		contains(t, "maintenance", body, `data-figure="months-ahead">`, `data-figure="default-rows">0<`, `data-job="prune"`, "deleted 0", "processed_events_")
	})
	t.Run("static", func(t *testing.T) {
		code, body := get(t, srv.URL+"/static/idem.css")
		if code != 200 || !strings.Contains(body, "svg.chart") {
			t.Fatalf("%d", code)
		}
	})
	t.Run("bad input", func(t *testing.T) {
		for _, u := range []string{"/keys?status=bogus", "/keys?key=k1", "/dead?since=yesterday", "/dead?since=2026-11-24T10:00&until=2026-11-24T09:00",
			"/keys?before=soon", "/keys?source=" + strings.Repeat("s", 65)} {
			code, body := get(t, srv.URL+u)
			if code != http.StatusBadRequest || !strings.Contains(body, "bad request") {
				t.Errorf("%s: %d %s", u, code, body)
			}
		}
	})
	t.Run("no action route when read-only", func(t *testing.T) {
		code, _ := post(t, srv.URL+"/dead/replay", url.Values{"scope": {"all"}, "confirm": {"1"}, "expected": {"5"}}, nil)
		if code != http.StatusNotFound {
			t.Fatalf("POST /dead/replay with actions off: %d, want 404", code)
		}
	})
}

// TestReplay: with actions on, a cross-origin post changes nothing; the dry
// run changes nothing and counts; the confirmed replay processes each dead
// letter once.
func TestReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := setup(t)
	srv := serve(t, dashboard.Config{Pool: f.pool, Inbox: f.in, Actions: true})
	all := url.Values{"source": {"shop"}, "error": {"422"}, "scope": {"all"}}
	dead := func() int64 {
		n, err := f.in.CountDeadLetters(ctx, inbox.Filter{})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}

	_, body := get(t, srv.URL+"/dead")
	contains(t, "dead, actions on", body, `type="checkbox"`, `id="replay-all"`)
	confirmed := url.Values{"source": {"shop"}, "error": {"422"}, "scope": {"all"}, "confirm": {"1"}, "expected": {"5"}}
	for name, h := range map[string]map[string]string{
		"Sec-Fetch-Site cross-site": {"Sec-Fetch-Site": "cross-site"},
		"Origin elsewhere":          {"Origin": "http://attacker.example"},
	} {
		code, _ := post(t, srv.URL+"/dead/replay", confirmed, h)
		if code != http.StatusForbidden || dead() != 5 {
			t.Fatalf("%s: %d, %d dead letters left", name, code, dead())
		}
	}
	code, body := post(t, srv.URL+"/dead/replay", all, map[string]string{"Sec-Fetch-Site": "same-origin"})
	if code != 200 || dead() != 5 {
		t.Fatalf("dry run: %d, %d dead letters left", code, dead())
	}
	contains(t, "dry run", body, `data-figure="dry-run-count">5<`, `name="expected" value="5"`, `id="confirm"`)

	code, body = post(t, srv.URL+"/dead/replay", confirmed, map[string]string{"Sec-Fetch-Site": "same-origin"})
	if code != 200 {
		t.Fatalf("replay: %d %s", code, body)
	}
	contains(t, "replayed", body, "<b>5</b> replayed")
	waitFor(t, "the replayed events processed", func() bool {
		f.mu.Lock()
		defer f.mu.Unlock()
		return len(f.runs) == 5
	})
	time.Sleep(200 * time.Millisecond)
	f.mu.Lock()
	for k, n := range f.runs {
		if n != 1 {
			t.Errorf("%s ran %d times", k, n)
		}
	}
	f.mu.Unlock()
	if dead() != 0 {
		t.Fatalf("%d dead letters left", dead())
	}
	// Replaying again: nothing matches, nothing runs.
	code, body = post(t, srv.URL+"/dead/replay", confirmed, map[string]string{"Sec-Fetch-Site": "same-origin"})
	if code != 200 {
		t.Fatalf("%d %s", code, body)
	}
	contains(t, "nothing to replay", body, "Went through 0 dead letters")
}

func TestConfig(t *testing.T) {
	t.Parallel()
	pool := &pgxpool.Pool{}
	for name, cfg := range map[string]dashboard.Config{
		"no pool":                {},
		"alert above 1":          {Pool: pool, DuplicateAlert: 1.5},
		"negative alert":         {Pool: pool, DuplicateAlert: -0.1},
		"negative timeout":       {Pool: pool, QueryTimeout: -time.Second},
		"negative replay limit":  {Pool: pool, ReplayLimit: -1},
		"prefix without slash":   {Pool: pool, Prefix: "idem"},
		"prefix ending in /":     {Pool: pool, Prefix: "/idem/"},
		"allowed host with port": {Pool: pool, AllowedHosts: []string{"localhost:9187"}},
		"empty allowed host":     {Pool: pool, AllowedHosts: []string{"localhost", ""}},
		"allowed host as a URL":  {Pool: pool, AllowedHosts: []string{"http://localhost"}},
	} {
		if _, err := dashboard.New(cfg); !errors.Is(err, dashboard.ErrInvalidConfig) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func TestPrefix(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 4)
	d, err := dashboard.New(dashboard.Config{Pool: pool, Prefix: "/ops/idem"})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/ops/idem/", d)
	mux.Handle("/ops/idem", d)
	srv := httptest.NewServer(mux)
	defer srv.Close()
	code, body := get(t, srv.URL+"/ops/idem/maintenance")
	if code != 200 {
		t.Fatalf("%d %s", code, body)
	}
	contains(t, "prefixed", body, `href="/ops/idem/keys"`, `href="/ops/idem/static/idem.css"`)
	if code, _ := get(t, srv.URL+"/ops/idem/static/idem.css"); code != 200 {
		t.Fatalf("static under the prefix: %d", code)
	}
	if code, body := get(t, srv.URL+"/ops/idem"); code != 200 || !strings.Contains(body, "Overview") {
		t.Fatalf("the prefix without its slash: %d", code)
	}
}

// TestAsMaintainer: the dashboard on a pool whose sessions are a role given
// only idem.grant_maintainer (and River's rights by inbox.GrantRiver) reads
// every page and replays dead letters: what its documentation asks for is
// enough.
func TestAsMaintainer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := setup(t)
	role := fmt.Sprintf("dash_maint_%d", time.Now().UnixNano())
	if _, err := f.pool.Exec(ctx, `CREATE ROLE `+role); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = f.pool.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE IF EXISTS `+role)
	})
	if _, err := f.pool.Exec(ctx, `SELECT idem.grant_maintainer($1)`, role); err != nil {
		t.Fatal(err)
	}
	if err := inbox.GrantRiver(ctx, f.pool, ""); err != nil {
		t.Fatal(err)
	}
	cfg := f.pool.Config().Copy()
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, `SET ROLE `+role)
		return err
	}
	mpool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer mpool.Close()
	var who string
	if err := mpool.QueryRow(ctx, `SELECT current_user`).Scan(&who); err != nil || who != role {
		t.Fatalf("the pool's role: %q %v", who, err)
	}
	min, err := inbox.New(inbox.Config{Pool: mpool, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	srv := serve(t, dashboard.Config{Pool: mpool, Inbox: min, Actions: true})
	for _, p := range []string{"/", "/keys?source=web", "/keys?source=web&key=k1", "/keys?status=stuck", "/dead", "/maintenance"} {
		if code, body := get(t, srv.URL+p); code != 200 {
			t.Errorf("%s as the maintainer: %d %s", p, code, body)
		}
	}
	code, body := post(t, srv.URL+"/dead/replay", url.Values{"source": {"shop"}, "scope": {"all"}, "confirm": {"1"}, "expected": {"5"}},
		map[string]string{"Sec-Fetch-Site": "same-origin"})
	if code != 200 || !strings.Contains(body, "<b>5</b> replayed") {
		t.Fatalf("replay as the maintainer: %d %s", code, body)
	}
	waitFor(t, "the replayed events processed", func() bool {
		f.mu.Lock()
		defer f.mu.Unlock()
		return len(f.runs) == 5
	})
}

// TestAllowedHosts: with AllowedHosts set, a request for another host
// name (a DNS-rebinding page: another name resolving to the dashboard's
// address, same-origin to the browser) is 421 and replays nothing; the
// allowed names are answered whatever their case and port; without
// AllowedHosts any host is answered.
func TestAllowedHosts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := setup(t)
	srv := serve(t, dashboard.Config{Pool: f.pool, Inbox: f.in, Actions: true,
		AllowedHosts: []string{"localhost", "127.0.0.1", "::1", "Dash.Example"}})
	su, err := url.Parse(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	dead := func() int64 {
		n, err := f.in.CountDeadLetters(ctx, inbox.Filter{})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	confirmed := url.Values{"source": {"shop"}, "scope": {"all"}, "confirm": {"1"}, "expected": {"1"}}

	t.Run("DNS rebinding refused", func(t *testing.T) {
		host := "rebind.attacker.example:" + su.Port()
		code, body := postHost(t, srv.URL+"/dead/replay", host, confirmed,
			map[string]string{"Origin": "http://" + host, "Sec-Fetch-Site": "same-origin"})
		if code != http.StatusMisdirectedRequest || !strings.Contains(body, "AllowedHosts") {
			t.Errorf("POST with Host %s: %d %s", host, code, body)
		}
		if n := dead(); n != 5 {
			t.Fatalf("a request for another host replayed: %d dead letters left", n)
		}
		for _, p := range []string{"/", "/keys?source=web", "/dead", "/static/idem.css"} {
			if code := getHost(t, srv.URL+p, host); code != http.StatusMisdirectedRequest {
				t.Errorf("GET %s with Host %s: %d", p, host, code)
			}
		}
	})
	t.Run("allowed names answered", func(t *testing.T) {
		for _, host := range []string{su.Host, "localhost:" + su.Port(), "LocalHost:" + su.Port(), "[::1]:" + su.Port(), "dash.example", "DASH.example:443"} {
			if code := getHost(t, srv.URL+"/maintenance", host); code != http.StatusOK {
				t.Errorf("GET with Host %s: %d", host, code)
			}
		}
		code, body := postHost(t, srv.URL+"/dead/replay", "localhost:"+su.Port(), confirmed,
			map[string]string{"Origin": "http://localhost:" + su.Port(), "Sec-Fetch-Site": "same-origin"})
		if code != http.StatusOK || !strings.Contains(body, "<b>1</b> replayed") {
			t.Fatalf("replay from an allowed host: %d %s", code, body)
		}
	})
	t.Run("any host without AllowedHosts", func(t *testing.T) {
		open := serve(t, dashboard.Config{Pool: f.pool})
		req, err := http.NewRequest(http.MethodGet, open.URL+"/maintenance", nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Host = "anything.example"
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET with Host anything.example: %d", resp.StatusCode)
		}
	})
}

// TestBadText: a query or form value PostgreSQL cannot take as text
// (invalid UTF-8, a NUL byte), in a key, a source, an error text or a
// replay form's key ref, is a 400 that says so, not a failed query.
func TestBadText(t *testing.T) {
	t.Parallel()
	f := setup(t)
	var logs testdb.Buffer
	srv := serve(t, dashboard.Config{Pool: f.pool, Inbox: f.in, Actions: true,
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelError}))})
	t.Run("queries", func(t *testing.T) {
		for _, u := range []string{
			"/keys?source=web&key=%ff", "/keys?source=%ff&key=k1", "/keys?source=web&key=a%00b", "/keys?source=%ff",
			"/keys?status=failed&source=a%00", "/dead?source=%ff", "/dead?error=%ff", "/dead?error=a%00", "/dead?source=a%00",
		} {
			code, body := get(t, srv.URL+u)
			if code != http.StatusBadRequest || !strings.Contains(body, "bad request") ||
				!(strings.Contains(body, "is not valid UTF-8") || strings.Contains(body, "holds a NUL byte")) {
				t.Errorf("GET %s: %d %s", u, code, body)
			}
		}
	})
	t.Run("replay forms", func(t *testing.T) {
		ref := func(source, key string) string {
			return base64.RawURLEncoding.EncodeToString([]byte(source)) + "." + base64.RawURLEncoding.EncodeToString([]byte(key))
		}
		for name, form := range map[string]url.Values{
			"source of invalid UTF-8": {"source": {"\xff"}, "scope": {"all"}},
			"error text with NUL":     {"error": {"4\x0022"}, "scope": {"all"}, "confirm": {"1"}, "expected": {"1"}},
			"ref of invalid UTF-8":    {"scope": {"selected"}, "k": {ref("shop", "\xff")}},
			"ref with NUL":            {"scope": {"selected"}, "k": {ref("shop", "a\x00")}},
			"ref of a NUL source":     {"scope": {"selected"}, "k": {ref("\x00", "evt_a")}, "confirm": {"1"}, "expected": {"1"}},
		} {
			code, body := post(t, srv.URL+"/dead/replay", form, map[string]string{"Sec-Fetch-Site": "same-origin"})
			if code != http.StatusBadRequest || !(strings.Contains(body, "is not valid UTF-8") || strings.Contains(body, "holds a NUL byte")) {
				t.Errorf("POST %s: %d %s", name, code, body)
			}
		}
	})
	if logs.String() != "" {
		t.Errorf("logged as errors:\n%s", logs.String())
	}
}

// link is the href of the first <a> whose text starts with text, as the
// browser reads it (the attribute unescaped), or "".
func link(body, text string) string {
	m := regexp.MustCompile(`<a href="([^"]*)">` + regexp.QuoteMeta(text)).FindStringSubmatch(body)
	if m == nil {
		return ""
	}
	return html.UnescapeString(m[1])
}

// TestLinks: the keys list's "Next" link leads to the next page (of the
// same filter), and the replay's "Back to the dead letters" link keeps the
// filter; each query string is escaped once.
func TestLinks(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := setup(t)
	const source = "p g&x=1" // a source that needs escaping in a query
	for _, sql := range []string{
		`SELECT idem.claim($1, 'p' || g) FROM generate_series(1, 60) g`,
		`UPDATE idem.processed_events SET expires_at = expires_at + substr(key, 2)::int * interval '1 second' WHERE source = $1`,
	} {
		if _, err := f.pool.Exec(ctx, sql, source); err != nil {
			t.Fatal(err)
		}
	}
	srv := serve(t, dashboard.Config{Pool: f.pool, Inbox: f.in, Actions: true})

	t.Run("next page", func(t *testing.T) {
		_, body := get(t, srv.URL+"/keys?"+url.Values{"source": {source}}.Encode())
		if n := strings.Count(body, `<a class="key"`); n != 50 || !strings.Contains(body, ">p60<") {
			t.Fatalf("page 1: %d keys, p60 on it: %v", n, strings.Contains(body, ">p60<"))
		}
		next := link(body, "Next 50")
		if next == "" {
			t.Fatal("no Next link on a full page")
		}
		u, err := url.Parse(next)
		if err != nil {
			t.Fatal(err)
		}
		if u.Path != "/keys" || u.Query().Get("source") != source || u.Query().Get("before") == "" {
			t.Fatalf("the Next link %q does not carry the cursor and the filter", next)
		}
		code, body := get(t, srv.URL+next)
		if code != 200 {
			t.Fatalf("page 2: %d %s", code, body)
		}
		if n := strings.Count(body, `<a class="key"`); n != 10 || strings.Contains(body, ">p60<") || strings.Contains(body, ">p11<") ||
			!strings.Contains(body, ">p10<") || !strings.Contains(body, ">p1<") {
			t.Errorf("page 2 (%s): %d keys, want p10 to p1", next, n)
		}
		if link(body, "Next") != "" {
			t.Error("a Next link on the last page")
		}
	})
	t.Run("back keeps the filter", func(t *testing.T) {
		form := url.Values{"source": {"shop"}, "error": {"422: unknown"}, "scope": {"all"}, "confirm": {"1"}, "expected": {"0"}}
		_, body := post(t, srv.URL+"/dead/replay", form, map[string]string{"Sec-Fetch-Site": "same-origin"})
		back := link(body, "Back to the dead letters")
		if back == "" {
			t.Fatalf("no back link:\n%s", body)
		}
		u, err := url.Parse(back)
		if err != nil {
			t.Fatal(err)
		}
		if u.Path != "/dead" || u.Query().Get("source") != "shop" || u.Query().Get("error") != "422: unknown" {
			t.Fatalf("the back link %q does not carry the filter", back)
		}
		code, body := get(t, srv.URL+back)
		if code != 200 {
			t.Fatalf("%s: %d %s", back, code, body)
		}
		contains(t, "back", body, `value="422: unknown"`, `data-figure="dead-count">5<`)
	})
}

// TestKeysCursor: the keys list's pages go on after the last row in the
// order (expires_at, source, key), so keys that share an expires_at are
// each listed once across the pages, with a source filter or without.
func TestKeysCursor(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := setup(t)
	for _, sql := range []string{
		`SELECT idem.claim('tie', 't' || g) FROM generate_series(1, 60) g`,
		`SELECT idem.claim('tie2', 't' || g) FROM generate_series(1, 20) g`,
		`UPDATE idem.processed_events SET expires_at = '2100-01-01 00:00:00.123456+00' WHERE source IN ('tie', 'tie2')`,
	} {
		if _, err := f.pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	srv := serve(t, dashboard.Config{Pool: f.pool})
	keyLink := regexp.MustCompile(`<a class="key" href="([^"]*)"`)
	// walk follows the Next links from u; it returns source/key of every
	// row listed, in order, and the number of pages.
	walk := func(t *testing.T, u string) ([]string, int) {
		var listed []string
		pages := 0
		for u != "" && pages < 10 {
			code, body := get(t, srv.URL+u)
			if code != 200 {
				t.Fatalf("%s: %d %s", u, code, body)
			}
			pages++
			for _, m := range keyLink.FindAllStringSubmatch(body, -1) {
				ku, err := url.Parse(html.UnescapeString(m[1]))
				if err != nil {
					t.Fatal(err)
				}
				listed = append(listed, ku.Query().Get("source")+"/"+ku.Query().Get("key"))
			}
			u = link(body, "Next")
		}
		return listed, pages
	}
	once := func(t *testing.T, listed []string, want int) {
		seen := map[string]int{}
		for _, k := range listed {
			seen[k]++
			if seen[k] == 2 {
				t.Errorf("%s listed twice", k)
			}
		}
		if len(seen) != want {
			t.Errorf("%d keys listed, want %d", len(seen), want)
		}
	}

	t.Run("one source", func(t *testing.T) {
		listed, pages := walk(t, "/keys?source=tie")
		if pages != 2 {
			t.Errorf("%d pages, want 2", pages)
		}
		once(t, listed, 60)
	})
	t.Run("every source", func(t *testing.T) {
		var all int
		if err := f.pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events`).Scan(&all); err != nil {
			t.Fatal(err)
		}
		listed, _ := walk(t, "/keys")
		once(t, listed, all)
		// The 80 keys sharing the latest expires_at come first, tie2's
		// before tie's (source descending).
		if len(listed) < 80 || listed[0] != "tie2/t9" || listed[79] != "tie/t1" {
			t.Errorf("the tied keys are not first, in (source, key) descending: %v", listed[:min(len(listed), 80)])
		}
	})
}

// TestNoSnapshotYet: a source that claimed keys before the first snapshot
// of key counts says when one will come: at the time Config.NextSnapshot
// gives (idemctl run's schedule), or which command takes them.
func TestNoSnapshotYet(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 4)
	if _, err := pool.Exec(ctx, `
		INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling) VALUES ('fresh', '1 day', '1 minute', 1);
		SELECT idem.claim('fresh', 'k1')`); err != nil {
		t.Fatal(err)
	}
	due := time.Date(2026, 11, 28, 12, 34, 56, 0, time.UTC)
	_, body := get(t, serve(t, dashboard.Config{Pool: pool, NextSnapshot: func() time.Time { return due }}).URL+"/")
	contains(t, "overview with the schedule", body, `id="source-fresh"`, "no snapshot yet: the next is due at 12:34:56 UTC")
	_, body = get(t, serve(t, dashboard.Config{Pool: pool}).URL+"/")
	contains(t, "overview without it", body, "no snapshot yet: taken by <code>idemctl run</code> (--stats-schedule, every 5m by default)")
}
