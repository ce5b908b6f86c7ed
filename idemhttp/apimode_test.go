package idemhttp_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/testdb"
)

// TestNoPrincipalNeverMeetsAPrincipal: Config.Scope returns "" for a
// request without a principal (a guest). Alice's "order-1" is stored as
// "alice|order-1"; a guest sending the key "alice|order-1" (bare or as a
// structured-field string) with the same body is a key of its own, run
// for the guest, never answered alice's stored answer; and a guest who
// goes first under alice's next key stores nothing alice's request gets.
// Before, a request without a principal was keyed by its key as it is,
// and the guest read alice's answer (and wrote hers). Each space still
// replays its own answers: alice's retry is alice's, the guest's the
// guest's; the handler reads its principal with idemhttp.Principal.
func TestNoPrincipalNeverMeetsAPrincipal(t *testing.T) {
	t.Parallel()
	scope := func(r *http.Request) (string, error) {
		switch a := r.Header.Get("Authorization"); a {
		case "":
			return "", nil // a guest
		case "Bearer alice":
			return "alice", nil
		}
		return "", idemhttp.ErrNoPrincipal
	}
	var runs atomic.Int64
	srv, pool := setup(t, idemhttp.Config{Scope: scope}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		who := idemhttp.Principal(r.Context())
		if want, _ := scope(r); who != want {
			t.Errorf("idemhttp.Principal: %q, want %q", who, want)
		}
		if who == "" {
			who = "guest"
		}
		body, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"for":%q,"order":%s,"run":%d}`, who, body, runs.Load())
	}))
	alice := func(k string) map[string]string {
		return map[string]string{"Idempotency-Key": k, "Authorization": "Bearer alice"}
	}
	guest := key
	forWhom := func(r reply) string {
		var v struct {
			For string `json:"for"`
		}
		if err := json.Unmarshal([]byte(r.body), &v); err != nil {
			t.Fatalf("answer %d %q: %v", r.status, r.body, err)
		}
		return v.For
	}
	const order = `{"name":"Alice Liddell","address":"7 Looking Glass Lane"}`

	// A guest reads: alice first, then the guest under her stored key.
	a1 := send(t, srv, "POST", "/orders", order, alice("order-1"))
	if a1.status != http.StatusCreated || forWhom(a1) != "alice" {
		t.Fatalf("alice's first request: %d %s", a1.status, a1.body)
	}
	for _, k := range []string{`alice|order-1`, `"alice|order-1"`} {
		g := send(t, srv, "POST", "/orders", order, guest(k))
		if forWhom(g) != "guest" || strings.Contains(g.body, `"run":1`) {
			t.Fatalf("a guest sending %s was answered %s (replayed %q): alice's answer", k, g.body, g.header.Get(idemhttp.ReplayedHeader))
		}
	}
	if runs.Load() != 2 {
		t.Fatalf("the handler ran %d times, want 2 (alice, then the guest once: its quoted retry is its own replay)", runs.Load())
	}
	// A guest writes: the guest goes first under alice's next key.
	g2 := send(t, srv, "POST", "/orders", order, guest("alice|order-2"))
	a2 := send(t, srv, "POST", "/orders", order, alice("order-2"))
	if forWhom(g2) != "guest" || forWhom(a2) != "alice" || a2.header.Get(idemhttp.ReplayedHeader) != "" {
		t.Fatalf("guest first under alice|order-2: guest got %s, then alice got %s (replayed %q)", g2.body, a2.body, a2.header.Get(idemhttp.ReplayedHeader))
	}
	// Each space replays its own.
	if r := send(t, srv, "POST", "/orders", order, alice("order-1")); r.body != a1.body || r.header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Fatalf("alice's retry: %s (replayed %q), want %s", r.body, r.header.Get(idemhttp.ReplayedHeader), a1.body)
	}
	if r := send(t, srv, "POST", "/orders", order, guest("alice|order-2")); r.body != g2.body || r.header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Fatalf("the guest's retry: %s, want %s", r.body, g2.body)
	}
	// The keys as stored: a guest's is ScopeKey("", key), "|" first.
	c := testdb.Client(t, pool, nil)
	for _, k := range []string{"alice|order-1", "alice|order-2", "|alice|order-1", "|alice|order-2"} {
		if st, err := c.Peek(context.Background(), "api", k); err != nil || st != "completed" {
			t.Errorf("key %q: %q %v", k, st, err)
		}
	}

	// Keys stored by an earlier version, which keyed a guest's request by
	// its key as it is. One without "|" cannot be a principal's: the
	// guest's retry across the upgrade is answered from it. One holding
	// "|" may be a principal's: never looked up for a guest.
	old := func(k, body string) {
		t.Helper()
		r := httptest.NewRequest("POST", "/orders", nil)
		fp := idemhttp.RequestFingerprint(r, []byte(order))
		if _, err := c.Do(context.Background(), "api", k, func(context.Context) (any, error) {
			return idemhttp.Response{Status: http.StatusCreated, Body: []byte(body)}, nil
		}, idem.WithFingerprint(fp)); err != nil {
			t.Fatal(err)
		}
	}
	old("guest-7", `{"for":"guest","stored":"before the upgrade"}`)
	old("alice|order-9", `{"for":"alice","stored":"before the upgrade"}`)
	before := runs.Load()
	if r := send(t, srv, "POST", "/orders", order, guest("guest-7")); r.body != `{"for":"guest","stored":"before the upgrade"}` || runs.Load() != before {
		t.Fatalf("a guest's retry across the upgrade: %s; the handler ran %d times", r.body, runs.Load()-before)
	}
	if r := send(t, srv, "POST", "/orders", order, guest("alice|order-9")); forWhom(r) != "guest" || runs.Load() != before+1 {
		t.Fatalf("a guest under a stored key holding |: %s", r.body)
	}
}

// gzipped compresses h's answers for clients that accept gzip, as a
// compressing middleware does (Content-Encoding: gzip, Vary).
func gzipped(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.Contains(r.Header.Get("Accept-Encoding"), "gzip") {
			h.ServeHTTP(w, r)
			return
		}
		w.Header().Set("Content-Encoding", "gzip")
		w.Header().Add("Vary", "Accept-Encoding")
		gz := gzip.NewWriter(w)
		defer gz.Close()
		h.ServeHTTP(gzipWriter{w, gz}, r)
	})
}

type gzipWriter struct {
	http.ResponseWriter
	gz *gzip.Writer
}

func (g gzipWriter) Write(b []byte) (int, error) { return g.gz.Write(b) }

// TestCompressedAnswerReplays: an answer compressed by a middleware inside
// idem, or by an upstream behind an httputil.ReverseProxy that idem wraps,
// or served through a ReverseProxy in front of idem, is replayed with its
// Content-Encoding (not in the default ReplayHeaders, nor in the
// ReplayHeaders here): a Go client that asked for gzip itself reads the
// same JSON both times, and one that sends Accept-Encoding explicitly
// reads the same gzip bytes, with Content-Encoding: gzip, both times.
// Before, the replay sent the stored gzip bytes without Content-Encoding:
// the client read binary as its JSON.
func TestCompressedAnswerReplays(t *testing.T) {
	t.Parallel()
	const answer = `{"order":42,"status":"created","items":["tea","jam","toast"]}`
	var runs atomic.Int64
	app := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/orders/42")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, answer)
	})
	upstream := httptest.NewServer(gzipped(app))
	t.Cleanup(upstream.Close)
	upURL, _ := url.Parse(upstream.URL)

	inside, _ := setup(t, idemhttp.Config{}, gzipped(app))
	behind, _ := setup(t, idemhttp.Config{ReplayHeaders: []string{"Location"}}, httputil.NewSingleHostReverseProxy(upURL))
	insideURL, _ := url.Parse(inside.URL)
	front := httptest.NewServer(httputil.NewSingleHostReverseProxy(insideURL))
	t.Cleanup(front.Close)

	type read struct {
		status               int
		encoding, ctype, loc string
		raw                  []byte
		text                 string
	}
	do := func(t *testing.T, base, k string, explicit bool) read {
		t.Helper()
		req, _ := http.NewRequest("POST", base+"/orders", strings.NewReader(`{"items":["tea","jam","toast"]}`))
		req.Header.Set("Idempotency-Key", k)
		if explicit {
			req.Header.Set("Accept-Encoding", "gzip")
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		raw, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		rd := read{resp.StatusCode, resp.Header.Get("Content-Encoding"), resp.Header.Get("Content-Type"), resp.Header.Get("Location"), raw, string(raw)}
		if explicit {
			if rd.encoding != "gzip" {
				t.Fatalf("asked for gzip explicitly: Content-Encoding %q, body %q", rd.encoding, raw)
			}
			zr, err := gzip.NewReader(bytes.NewReader(raw))
			if err != nil {
				t.Fatalf("the body is not gzip: %v (%q)", err, raw)
			}
			plain, err := io.ReadAll(zr)
			if err != nil {
				t.Fatal(err)
			}
			rd.text = string(plain)
		} else if !resp.Uncompressed && resp.Header.Get(idemhttp.ReplayedHeader) == "" {
			t.Fatalf("the first answer was not compressed: the test proves nothing")
		}
		return rd
	}
	for name, base := range map[string]string{"middleware inside idem": inside.URL,
		"upstream behind a reverse proxy": behind.URL, "reverse proxy in front of idem": front.URL} {
		for _, explicit := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/explicit Accept-Encoding %v", name, explicit), func(t *testing.T) {
				k := fmt.Sprintf("%s-%v", name, explicit)
				first := do(t, base, k, explicit)
				replay := do(t, base, k, explicit)
				if first.status != http.StatusCreated || first.text != answer {
					t.Fatalf("first answer: %d %q", first.status, first.text)
				}
				if replay.status != first.status || replay.text != first.text || !bytes.Equal(replay.raw, first.raw) ||
					replay.encoding != first.encoding || replay.ctype != first.ctype || replay.loc != first.loc {
					t.Fatalf("the replay differs from the first answer:\n first  %+v\n replay %+v", first, replay)
				}
			})
		}
	}
	if n := runs.Load(); n != 6 {
		t.Fatalf("the handler ran %d times for 6 keys", n)
	}
}

// TestUnscopedKeysAsTheyAre: with Scope set to Unscoped no request has a
// principal, so there is no principal's space to keep apart: keys are
// stored as they are, as before (idemctl release --key finds them, and
// retries across the upgrade are answered), while a Scope of the
// application's that returns "" keys "|" and the key.
func TestUnscopedKeysAsTheyAre(t *testing.T) {
	t.Parallel()
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "done") })
	for _, tc := range []struct {
		name   string
		scope  func(*http.Request) (string, error)
		stored string
	}{
		{"Unscoped", idemhttp.Unscoped, "a|b"},
		{"a Scope returning \"\"", func(*http.Request) (string, error) { return "", nil }, "|a|b"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv, pool := setup(t, idemhttp.Config{Scope: tc.scope}, ok)
			if r := send(t, srv, "POST", "/x", "{}", key("a|b")); r.status != http.StatusOK {
				t.Fatalf("%d %s", r.status, r.body)
			}
			if st, err := testdb.Client(t, pool, nil).Peek(context.Background(), "api", tc.stored); err != nil || st != "completed" {
				t.Fatalf("key %q: %q %v", tc.stored, st, err)
			}
		})
	}
}
