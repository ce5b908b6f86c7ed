package inbox_test

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
)

// bodySigned is a sender whose signature covers the body only.
type bodySigned struct {
	name   string
	preset func(...string) idemhttp.Preset
	// headers returns a delivery's headers: its ids (fresh or given) and
	// the signature of body.
	headers func(id, body string) map[string]string
}

func fresh() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

const bodySecret = "It's a Secret to Everybody"

var bodySigners = []bodySigned{
	{"github", idemhttp.GitHub, func(id, body string) map[string]string {
		m := hmac.New(sha256.New, []byte(bodySecret))
		m.Write([]byte(body))
		return map[string]string{"X-GitHub-Delivery": id, "X-GitHub-Event": "issues",
			"X-Hub-Signature-256": "sha256=" + hex.EncodeToString(m.Sum(nil))}
	}},
	{"shopify", idemhttp.Shopify, func(id, body string) map[string]string {
		m := hmac.New(sha256.New, []byte(bodySecret))
		m.Write([]byte(body))
		return map[string]string{"X-Shopify-Event-Id": id, "X-Shopify-Webhook-Id": id + "-w", "X-Shopify-Topic": "orders/create",
			"X-Shopify-Hmac-Sha256": base64.StdEncoding.EncodeToString(m.Sum(nil))}
	}},
}

// TestReplayGuard: GitHub and Shopify sign the body only, and the presets
// key by an unsigned delivery id. In synchronous and asynchronous mode, a
// captured genuine delivery re-sent 5 times with fresh delivery ids runs
// the handler once (each copy answered as a duplicate); the genuine
// redelivery with the same id is answered from the stored result; 50
// distinct genuine events each run once.
func TestReplayGuard(t *testing.T) {
	t.Parallel()
	for _, s := range bodySigners {
		for _, async := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/async=%v", s.name, async), func(t *testing.T) {
				t.Parallel()
				_, pool := setup(t)
				var runs atomic.Int64
				seen := map[string]*atomic.Int64{}
				for i := range 51 {
					seen[fmt.Sprintf(`{"n":%d}`, i)] = new(atomic.Int64)
				}
				h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					b, _ := io.ReadAll(r.Body)
					runs.Add(1)
					seen[string(b)].Add(1)
					w.Header().Set("Content-Type", "application/json")
					fmt.Fprintf(w, `{"run":%d}`, runs.Load())
				})
				cfg := idemhttp.Config{Client: testdb.Client(t, pool, nil)}
				if async {
					in, err := inbox.New(inbox.Config{Pool: pool, Handler: inbox.FromHTTP(h)})
					if err != nil {
						t.Fatal(err)
					}
					cfg.Async = in
					start(t, in, 2, nil)
				}
				mw, err := idemhttp.New(cfg.Apply(s.preset(bodySecret)))
				if err != nil {
					t.Fatal(err)
				}
				srv := httptest.NewServer(mw(h))
				defer srv.Close()
				post := func(id, body string) (*http.Response, string) {
					req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(body))
					for k, v := range s.headers(id, body) {
						req.Header.Set(k, v)
					}
					resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
					if err != nil {
						t.Fatal(err)
					}
					defer resp.Body.Close()
					b, _ := io.ReadAll(resp.Body)
					return resp, string(b)
				}
				want := map[bool]int{false: 200, true: 202}[async]
				genuine, body := fresh(), `{"n":0}`
				if r, _ := post(genuine, body); r.StatusCode != want || r.Header.Get("Idempotency-Replayed") != "" {
					t.Fatalf("genuine: %d %v", r.StatusCode, r.Header)
				}
				for range 5 { // the attacker's copies, each with a fresh delivery id
					if r, b := post(fresh(), body); r.StatusCode/100 != 2 || r.Header.Get("Idempotency-Replayed") != "true" {
						t.Fatalf("copy: %d %v %s", r.StatusCode, r.Header, b)
					}
				}
				r, b := post(genuine, body) // the sender's own redelivery
				if r.StatusCode != want || r.Header.Get("Idempotency-Replayed") != "true" || (!async && b != `{"run":1}`) {
					t.Fatalf("genuine redelivery: %d %v %s", r.StatusCode, r.Header, b)
				}
				for i := 1; i <= 50; i++ {
					if r, _ := post(fresh(), fmt.Sprintf(`{"n":%d}`, i)); r.StatusCode != want {
						t.Fatalf("event %d: %d", i, r.StatusCode)
					}
				}
				waitFor(t, "51 events run", func() bool { return runs.Load() >= 51 })
				time.Sleep(200 * time.Millisecond)
				if runs.Load() != 51 {
					t.Fatalf("the handler ran %d times, want 51", runs.Load())
				}
				for body, n := range seen {
					if n.Load() != 1 {
						t.Fatalf("%s ran %d times", body, n.Load())
					}
				}
			})
		}
	}
}

// TestNoSecretsAtRest: deliveries carrying credentials (Authorization,
// Cookie, X-Api-Key, X-Auth-Token) go through the inbox, with a preset and
// in the plain Idempotency-Key mode. The handler gets none of them, and a
// scan of every column of every table (idem's and River's), as text and
// as base64, finds none of them.
func TestNoSecretsAtRest(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	_, pool := setup(t)
	secrets := map[string]string{
		"Authorization": "Bearer sk_live_authorization_51Hx",
		"Cookie":        "session=cookie_secret_8f3a",
		"X-Api-Key":     "apikey_secret_77c1",
		"X-Auth-Token":  "authtoken_secret_9d2e",
	}
	var leaked atomic.Int64
	var runs atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		for name := range secrets {
			if r.Header.Get(name) != "" {
				leaked.Add(1)
			}
		}
	})
	in, err := inbox.New(inbox.Config{Pool: pool, Handler: inbox.FromHTTP(h)})
	if err != nil {
		t.Fatal(err)
	}
	start(t, in, 2, nil)
	for _, preset := range []string{"github", "ietf"} {
		cfg := idemhttp.Config{Client: testdb.Client(t, pool, nil), Async: in, Source: "api", Scope: idemhttp.Unscoped}
		if preset == "github" {
			cfg.Source = ""
			cfg = cfg.Apply(idemhttp.GitHub(bodySecret))
		}
		mw, err := idemhttp.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(mw(h))
		for i := range 3 {
			body := fmt.Sprintf(`{"%s":%d}`, preset, i)
			req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			if preset == "github" {
				for k, v := range bodySigners[0].headers(fresh(), body) {
					req.Header.Set(k, v)
				}
			} else {
				req.Header.Set("Idempotency-Key", fresh())
			}
			for k, v := range secrets {
				req.Header.Set(k, v)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != 202 {
				t.Fatalf("%s: %d", preset, resp.StatusCode)
			}
		}
		srv.Close()
	}
	waitFor(t, "6 deliveries processed", func() bool { return runs.Load() == 6 })
	if leaked.Load() != 0 {
		t.Fatalf("the handler was handed %d credential headers", leaked.Load())
	}
	rows, err := pool.Query(ctx, `SELECT format('%I.%I', n.nspname, c.relname) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE c.relkind IN ('r', 'p') AND n.nspname IN ('idem', 'public') ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	var tables []string
	for rows.Next() {
		var name string
		_ = rows.Scan(&name)
		tables = append(tables, name)
	}
	if rows.Err() != nil || len(tables) < 5 {
		t.Fatalf("tables %v %v", tables, rows.Err())
	}
	var needles []string
	for _, v := range secrets {
		part := v[strings.LastIndex(v, " ")+1:]
		needles = append(needles, part, base64.StdEncoding.EncodeToString([]byte(part)), base64.StdEncoding.EncodeToString([]byte(v)))
	}
	for _, table := range tables {
		var all string
		if err := pool.QueryRow(ctx, `SELECT coalesce(string_agg(t::text, E'\n'), '') FROM `+table+` t`).Scan(&all); err != nil {
			t.Fatal(err)
		}
		for _, n := range needles {
			if strings.Contains(all, n) {
				t.Errorf("%s holds %q", table, n)
			}
		}
		// base64 of a JSON-encoded payload or header map: decode each
		// base64-looking run and look inside too.
		for _, word := range strings.FieldsFunc(all, func(r rune) bool { return r == '"' || r == ',' || r == ' ' || r == '\n' }) {
			if len(word) < 16 {
				continue
			}
			if dec, err := base64.StdEncoding.DecodeString(word); err == nil {
				for _, n := range needles {
					if strings.Contains(string(dec), n) {
						t.Errorf("%s holds %q in base64", table, n)
					}
				}
			}
		}
	}
}
