package inbox_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
)

// TestFromHTTPRequestTarget: a handler behind the inbox, routed by an
// http.ServeMux pattern with a wildcard, reads its tenant from
// r.PathValue and its region from the query, as it does synchronously:
// the inbox stores the request target, host and pattern with the event and
// replays the request through them. A query byte that is not UTF-8 (sent
// raw) reaches the handler as the same value. Before, the handler was
// called at "POST /" and failed on every attempt: every event was accepted
// with 202 and dead-lettered.
func TestFromHTTPRequestTarget(t *testing.T) {
	t.Parallel()
	_, pool := setup(t)
	type seen struct{ tenant, region, raw, path, pattern, host string }
	got := make(chan seen, 10)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tenant := r.PathValue("tenant")
		if tenant == "" {
			http.Error(w, "no tenant in the URL", http.StatusNotFound)
			return
		}
		got <- seen{tenant, r.URL.Query().Get("region"), r.URL.Query().Get("raw"), r.URL.Path, r.Pattern, r.Host}
	})
	in, err := inbox.New(inbox.Config{Pool: pool, RetryPolicy: fast{}, DefaultMaxAttempts: 2})
	if err != nil {
		t.Fatal(err)
	}
	async, err := in.HTTP(idemhttp.Config{Client: testdb.Client(t, pool, nil), Source: "tenants", Scope: idemhttp.Unscoped}, h)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /hooks/{tenant}", async)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	start(t, in, 2, nil)

	// Sent by hand: Go's client would not send a raw 0xff in the query.
	u, _ := url.Parse(srv.URL)
	conn, err := net.Dial("tcp", u.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	body := `{"n":1}`
	fmt.Fprintf(conn, "POST /hooks/acme?region=eu%%20west&raw=\xff HTTP/1.1\r\nHost: hooks.example\r\nIdempotency-Key: k1\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(body), body)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("accept: %d", resp.StatusCode)
	}
	select {
	case s := <-got:
		want := seen{"acme", "eu west", "\xff", "/hooks/acme", "POST /hooks/{tenant}", "hooks.example"}
		if s != want {
			t.Fatalf("the handler saw %+v, want %+v", s, want)
		}
	case <-time.After(30 * time.Second):
		dead, _ := in.DeadLetters(context.Background(), inbox.Filter{})
		t.Fatalf("the handler never saw its tenant; dead letters %+v", dead)
	}
	// A target whose path starts with "//" is replayed as that path, as
	// the server parsed it, not as a host.
	var path string
	h2 := inbox.FromHTTP(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { path = r.URL.Path + "|" + r.URL.Host }))
	if _, err := h2(context.Background(), nil, &inbox.Delivery{Target: "//evil.example/x?y=1"}); err != nil || path != "//evil.example/x|" {
		t.Fatalf("a // target: %q %v", path, err)
	}
	waitFor(t, "the event processed", func() bool {
		return count(t, pool, `SELECT count(*) FROM idem.processed_events WHERE source = 'tenants' AND status = 'completed'`) == 1
	})
}

// TestAcceptRefusesUnstorableTexts: a delivery whose request target, host
// or pattern holds a NUL or invalid UTF-8, or whose header holds a NUL
// (which River's jsonb job arguments cannot keep), is refused with
// idem.ErrInvalidInput and inserts nothing; a header value that is not
// UTF-8 (HTTP allows Latin-1) is accepted.
func TestAcceptRefusesUnstorableTexts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	in, err := inbox.New(inbox.Config{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	for name, d := range map[string]*inbox.Delivery{
		"target NUL":      {Target: "/a\x00b"},
		"host invalid":    {Host: "h\xff"},
		"pattern NUL":     {Pattern: "POST /\x00"},
		"header NUL":      {Header: http.Header{"X-A": {"a\x00"}}},
		"header name NUL": {Header: http.Header{"X-\x00": {"a"}}},
	} {
		d.Source, d.Key, d.Payload = "bad", name, []byte(`{}`)
		if _, err := in.Accept(ctx, d); !errors.Is(err, idem.ErrInvalidInput) {
			t.Errorf("%s: %v, want ErrInvalidInput", name, err)
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM river_job`); n != 0 {
		t.Fatalf("%d jobs inserted", n)
	}
	if _, err := in.Accept(ctx, &inbox.Delivery{Source: "bad", Key: "latin-1 header", Payload: []byte(`{}`),
		Header: http.Header{"User-Agent": {"caf\xe9"}}}); err != nil {
		t.Fatalf("a Latin-1 header: %v", err)
	}
}
