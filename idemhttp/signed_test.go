package idemhttp_test

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stripe/stripe-go/v85/webhook"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/testdb"
)

// Tests of what a signature proves: the key, the fingerprint and the
// replay guard of every preset come from what the sender signed, or from
// headers bound to it. Signatures are made with the senders' own
// libraries where they exist (the senders table, presets_test.go).

func senderNamed(name string) sender {
	for _, s := range senders {
		if s.name == name {
			return s
		}
	}
	panic("no sender " + name)
}

// boundHeaders are, per preset, the unsigned headers that say what a
// delivery means (docs/senders.md): the test handlers take a delivery's
// meaning from them and the body, as a handler would.
var boundHeaders = map[string][]string{
	"github":  {"X-GitHub-Event", "X-GitHub-Hook-Id", "X-GitHub-Hook-Installation-Target-Id", "X-GitHub-Hook-Installation-Target-Type"},
	"shopify": {"X-Shopify-Topic", "X-Shopify-Shop-Domain", "X-Shopify-Api-Version"},
}

// meaning is what a handler acts on: the body and the bound headers.
func meaning(senderName string, h http.Header, body []byte) string {
	m := sha256.New()
	m.Write(body)
	for _, n := range boundHeaders[senderName] {
		fmt.Fprintf(m, "\n%s=%q", n, h.Values(n))
	}
	return hex.EncodeToString(m.Sum(nil))[:16]
}

// actor is a handler that fails the first delivery of the genuine event
// (answers 500: the key is released for the sender's retry), then acts on
// it, and acknowledges without acting any delivery whose meaning differs
// from the genuine one (a type it ignores, another shop): the handler an
// attacker would like to reach under the genuine event's key.
type actor struct {
	sender  string
	genuine string // meaning of the genuine delivery
	failed  atomic.Bool
	acted   atomic.Int64
	altered atomic.Int64
}

func (a *actor) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	m := meaning(a.sender, r.Header, body)
	switch {
	case m != a.genuine:
		a.altered.Add(1)
		fmt.Fprint(w, "ignored "+m)
	case a.failed.CompareAndSwap(false, true):
		http.Error(w, "first attempt fails", http.StatusInternalServerError)
	default:
		a.acted.Add(1)
		fmt.Fprint(w, "acted "+m)
	}
}

// storedBody returns the body of the answer stored under source/key.
func storedBody(t *testing.T, ctx context.Context, q *pgxpool.Pool, source, key string) string {
	t.Helper()
	var raw []byte
	if err := q.QueryRow(ctx, `SELECT result FROM idem.processed_events WHERE source = $1 AND key = $2`, source, key).Scan(&raw); err != nil {
		t.Fatalf("no stored answer under %s/%s: %v", source, key, err)
	}
	var resp idemhttp.Response
	if err := json.Unmarshal(raw, &resp); err != nil {
		t.Fatal(err)
	}
	return string(resp.Body)
}

// TestStandardWebhooksKeyIsTheSignedID (Svix): the key is the id of the
// scheme the delivery is verified by. A captured Svix-signed delivery
// re-sent six times with an added webhook-id of the attacker's choosing
// runs once, under its svix-id; the same copy naming another message's
// id, whose first attempt failed, stores nothing under that message's
// key: its own retry runs; a signed header given twice is refused.
func TestStandardWebhooksKeyIsTheSignedID(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	svix, std := senderNamed("svix"), senderNamed("standard webhooks")
	var runs atomic.Int64
	var failB atomic.Bool
	srv, pool := setup(t, idemhttp.Config{}.Apply(idemhttp.StandardWebhooks(svix.secret)), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("webhook-signature") != "" && failB.CompareAndSwap(false, true) {
			http.Error(w, "message B's first attempt fails", http.StatusInternalServerError)
			return
		}
		runs.Add(1)
		fmt.Fprint(w, "processed")
	}))
	captured := svix.delivery(svix.secret, svix.body, time.Now())
	for i := range 6 {
		h := maps.Clone(captured)
		h["webhook-id"] = fmt.Sprintf("msg_attacker_%d", i)
		if r := send(t, srv, "POST", "/", svix.body, h); r.status != 200 {
			t.Fatalf("copy %d: %d %s", i, r.status, r.body)
		}
	}
	// Message B (Standard Webhooks headers): its first attempt fails.
	bBody := strings.Replace(std.body, "contact.created", "contact.deleted", 1)
	b := std.delivery(std.secret, bBody, time.Now())
	if r := send(t, srv, "POST", "/", bBody, b); r.status != 500 {
		t.Fatalf("B's first attempt: %d", r.status)
	}
	// The captured Svix delivery, filed under B's id.
	h := maps.Clone(captured)
	h["webhook-id"] = b["webhook-id"]
	send(t, srv, "POST", "/", svix.body, h)
	if r := send(t, srv, "POST", "/", bBody, std.delivery(std.secret, bBody, time.Now())); r.status != 200 || r.header.Get(idemhttp.ReplayedHeader) != "" {
		t.Fatalf("B's retry: %d replayed %q, want it run", r.status, r.header.Get(idemhttp.ReplayedHeader))
	}
	if runs.Load() != 2 {
		t.Fatalf("the handler ran %d times, want 2 (the Svix message once, B once)", runs.Load())
	}
	var keys []string
	rows, _ := pool.Query(ctx, `SELECT key FROM idem.processed_events ORDER BY key`)
	for rows.Next() {
		var k string
		rows.Scan(&k)
		keys = append(keys, k)
	}
	if want := []string{b["webhook-id"], svix.key}; !slices.Equal(keys, want) {
		t.Fatalf("keys %q, want %q", keys, want)
	}
	if got := storedBody(t, ctx, pool, "webhooks", b["webhook-id"]); got != "processed" {
		t.Fatalf("B's stored answer %q", got)
	}
	// A signed header given twice is malformed: which one was verified
	// and which one keyed would depend on the reader.
	for _, name := range []string{"svix-id", "svix-timestamp", "svix-signature"} {
		req, _ := http.NewRequest("POST", srv.URL+"/", strings.NewReader(svix.body))
		for k, v := range captured {
			req.Header.Set(k, v)
		}
		req.Header.Add(name, "msg_second")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("%s repeated: %d, want 400", name, resp.StatusCode)
		}
	}
}

// TestEmptySecretRefused: every way to build a verifier refuses an empty,
// blank or malformed secret at construction, alone or in a rotation list
// (an unset environment variable next to the new secret).
func TestEmptySecretRefused(t *testing.T) {
	t.Parallel()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 1), nil)
	good := map[string]string{"stripe": "whsec_genuine", "github": "gh secret", "shopify": "shpss_x",
		"webhooks": "whsec_" + base64.StdEncoding.EncodeToString([]byte("a genuine key of 24 bytes"))}
	presets := map[string]func(...string) idemhttp.Preset{"stripe": idemhttp.Stripe, "github": idemhttp.GitHub,
		"shopify": idemhttp.Shopify, "webhooks": idemhttp.StandardWebhooks}
	bad := map[string][]string{
		"stripe":   {"", " ", "whsec_", "sk_live_notasecret", "whsec_x\n"},
		"github":   {"", "   ", "secret\n"},
		"shopify":  {"", "\t", "shpss_x\r\n"},
		"webhooks": {"", "whsec_", "whsec_not base64!", "whsec_AAAA\n"},
	}
	for name, secrets := range bad {
		for _, s := range secrets {
			for _, list := range [][]string{{s}, {good[name], s}, {s, good[name]}} {
				_, err := idemhttp.New(idemhttp.Config{Client: c, Source: fmt.Sprintf("%s-%q", name, list)}.Apply(presets[name](list...)))
				if !errors.Is(err, idemhttp.ErrInvalidSecret) {
					t.Errorf("%s preset with secrets %q: %v, want ErrInvalidSecret", name, list, err)
				}
			}
		}
	}
	verifiers := map[string]func(...string) (idemhttp.Verifier, error){
		"stripe": func(s ...string) (idemhttp.Verifier, error) {
			return idemhttp.StripeVerifier(idemhttp.DefaultTolerance, s...)
		},
		"github":   idemhttp.GitHubVerifier,
		"shopify":  idemhttp.ShopifyVerifier,
		"webhooks": idemhttp.StandardWebhooksVerifier,
	}
	for name, build := range verifiers {
		if _, err := build(); !errors.Is(err, idemhttp.ErrInvalidSecret) {
			t.Errorf("%s verifier without secrets: %v", name, err)
		}
		for _, s := range bad[name] {
			if v, err := build(good[name], s); !errors.Is(err, idemhttp.ErrInvalidSecret) || v != nil {
				t.Errorf("%s verifier with %q: %v", name, s, err)
			}
		}
		if _, err := build(good[name]); err != nil {
			t.Errorf("%s verifier with a good secret: %v", name, err)
		}
	}
	if _, err := idemhttp.StripeVerifier(0, good["stripe"]); err == nil {
		t.Error("a zero tolerance was accepted")
	}
}

// TestUnsignedTypeCannotSuppressEvent: GitHub and Shopify sign the body
// only. A captured delivery whose first attempt failed, re-sent under its
// own key with only the event type header changed (to a type the handler
// acknowledges without acting), stores nothing under the genuine key
// (422): the sender's retry runs the event.
func TestUnsignedTypeCannotSuppressEvent(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ sender, typeHeader, ackOnly string }{
		{"github", "X-GitHub-Event", "ping"},
		{"shopify", "X-Shopify-Topic", "app/uninstalled"},
	} {
		t.Run(tc.sender, func(t *testing.T) {
			t.Parallel()
			s := senderNamed(tc.sender)
			captured := s.delivery(s.secret, s.body, time.Now())
			hc := http.Header{}
			for k, v := range captured {
				hc.Set(k, v)
			}
			a := &actor{sender: tc.sender, genuine: meaning(tc.sender, hc, []byte(s.body))}
			srv, _ := setup(t, idemhttp.Config{}.Apply(s.preset(s.secret)), a)
			if r := send(t, srv, "POST", "/", s.body, captured); r.status != 500 {
				t.Fatalf("first attempt: %d", r.status)
			}
			for _, typ := range []string{tc.ackOnly, ""} {
				copy := maps.Clone(captured)
				copy[tc.typeHeader] = typ
				if r := send(t, srv, "POST", "/", s.body, copy); r.status != http.StatusUnprocessableEntity {
					t.Fatalf("copy with %s %q: %d %s, want 422", tc.typeHeader, typ, r.status, r.body)
				}
			}
			if r := send(t, srv, "POST", "/", s.body, s.delivery(s.secret, s.body, time.Now())); r.status != 200 || r.header.Get(idemhttp.ReplayedHeader) != "" {
				t.Fatalf("the sender's retry: %d replayed %q %s", r.status, r.header.Get(idemhttp.ReplayedHeader), r.body)
			}
			if a.acted.Load() != 1 || a.altered.Load() != 0 {
				t.Fatalf("acted %d, acknowledged altered copies %d; want 1, 0", a.acted.Load(), a.altered.Load())
			}
		})
	}
}

// TestStripeFutureTimestamps: a delivery signed (by stripe-go) with a
// timestamp in the future beyond the tolerance is refused, as one in the
// past is: 1 hour, 30 days, the time in milliseconds. Within the
// tolerance it is accepted.
func TestStripeFutureTimestamps(t *testing.T) {
	t.Parallel()
	s := senderNamed("stripe")
	var runs atomic.Int64
	srv, _ := setup(t, idemhttp.Config{}.Apply(idemhttp.Stripe(s.secret)), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs.Add(1) }))
	now := time.Now()
	for name, at := range map[string]time.Time{
		"1 hour ahead":    now.Add(time.Hour),
		"30 days ahead":   now.Add(30 * 24 * time.Hour),
		"milliseconds":    time.Unix(now.UnixMilli(), 0),
		"6 minutes ahead": now.Add(6 * time.Minute),
	} {
		p := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: []byte(s.body), Secret: s.secret, Timestamp: at})
		if r := send(t, srv, "POST", "/", s.body, map[string]string{"Stripe-Signature": p.Header}); r.status != http.StatusUnauthorized {
			t.Errorf("%s: %d %s, want 401", name, r.status, r.body)
		}
	}
	if runs.Load() != 0 {
		t.Fatalf("the handler ran %d times for future deliveries", runs.Load())
	}
	p := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: []byte(s.body), Secret: s.secret, Timestamp: now.Add(4 * time.Minute)})
	if r := send(t, srv, "POST", "/", s.body, map[string]string{"Stripe-Signature": p.Header}); r.status != 200 || runs.Load() != 1 {
		t.Fatalf("4 minutes ahead (within the tolerance): %d, ran %d", r.status, runs.Load())
	}
}

// reserialize returns body as the sender might send it again: indented,
// and with Stripe's pending_webhooks changed.
func reserialize(t *testing.T, body string) string {
	var v map[string]any
	if err := json.Unmarshal([]byte(body), &v); err != nil {
		t.Fatal(err)
	}
	if _, ok := v["pending_webhooks"]; ok {
		v["pending_webhooks"] = 3
	}
	b, _ := json.MarshalIndent(v, "", "    ")
	return string(b)
}

// TestRetryWithDifferentBody: for a sender whose signature covers the
// event id (Stripe, Standard Webhooks, Svix) the id is the identity: after
// a failed first attempt, the sender's retry with a re-serialized body
// (and Stripe's pending_webhooks changed) runs, and a later one is
// answered from the stored answer; never 422. For GitHub and Shopify,
// whose signature covers the body only and who redeliver the same bytes,
// a different signed body under a known delivery id is 422 and stores
// nothing; the byte-identical retry runs.
func TestRetryWithDifferentBody(t *testing.T) {
	t.Parallel()
	for _, s := range senders {
		t.Run(s.name, func(t *testing.T) {
			t.Parallel()
			var attempts, runs atomic.Int64
			srv, _ := setup(t, idemhttp.Config{}.Apply(s.preset(s.secret)), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if attempts.Add(1) == 1 {
					http.Error(w, "first attempt fails", http.StatusInternalServerError)
					return
				}
				runs.Add(1)
				fmt.Fprint(w, "processed")
			}))
			if r := send(t, srv, "POST", "/", s.body, s.delivery(s.secret, s.body, time.Now())); r.status != 500 {
				t.Fatalf("first attempt: %d", r.status)
			}
			other := reserialize(t, s.body)
			r := send(t, srv, "POST", "/", other, s.delivery(s.secret, other, time.Now()))
			if !s.stamped { // GitHub, Shopify
				if r.status != http.StatusUnprocessableEntity || runs.Load() != 0 {
					t.Fatalf("another body under the delivery id: %d, ran %d; want 422, nothing run", r.status, runs.Load())
				}
				if r := send(t, srv, "POST", "/", s.body, s.delivery(s.secret, s.body, time.Now())); r.status != 200 || runs.Load() != 1 {
					t.Fatalf("the byte-identical retry: %d, ran %d", r.status, runs.Load())
				}
				return
			}
			if r.status != 200 || runs.Load() != 1 {
				t.Fatalf("the re-serialized retry after a failed attempt: %d %s, ran %d; want it run", r.status, r.body, runs.Load())
			}
			again := reserialize(t, other)
			r = send(t, srv, "POST", "/", again, s.delivery(s.secret, again, time.Now()))
			if r.status != 200 || r.header.Get(idemhttp.ReplayedHeader) != "true" || r.body != "processed" || runs.Load() != 1 {
				t.Fatalf("a later re-serialized retry: %d replayed %q %q, ran %d", r.status, r.header.Get(idemhttp.ReplayedHeader), r.body, runs.Load())
			}
		})
	}
}

// TestOneEndpointPerSource: two endpoints of one preset (two Stripe
// accounts) over one Client cannot share the preset's source: New
// refuses the second (ErrSourceInUse). Named apart, an event id both
// receive runs both handlers. The same endpoint built twice, or during a
// rotation, shares its source.
func TestOneEndpointPerSource(t *testing.T) {
	t.Parallel()
	s := senderNamed("stripe")
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 8), nil)
	build := func(cfg idemhttp.Config, p idemhttp.Preset, h http.Handler) (*httptest.Server, error) {
		cfg.Client = c
		if p != nil {
			cfg = cfg.Apply(p)
		} else {
			cfg.Scope = idemhttp.Unscoped
		}
		mw, err := idemhttp.New(cfg)
		if err != nil {
			return nil, err
		}
		srv := httptest.NewServer(mw(h))
		t.Cleanup(srv.Close)
		return srv, nil
	}
	var runsA, runsB atomic.Int64
	a, err := build(idemhttp.Config{}, idemhttp.Stripe("whsec_account_a"), http.HandlerFunc(func(http.ResponseWriter, *http.Request) { runsA.Add(1) }))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := build(idemhttp.Config{}, idemhttp.Stripe("whsec_account_b"), http.NotFoundHandler()); !errors.Is(err, idemhttp.ErrSourceInUse) {
		t.Fatalf("a second Stripe endpoint on the default source: %v, want ErrSourceInUse", err)
	}
	if _, err := build(idemhttp.Config{Source: "stripe"}, idemhttp.Stripe("whsec_account_b"), http.NotFoundHandler()); !errors.Is(err, idemhttp.ErrSourceInUse) {
		t.Fatalf("a second Stripe endpoint naming the taken source: %v, want ErrSourceInUse", err)
	}
	if _, err := build(idemhttp.Config{VerifiedUpstream: true}, idemhttp.Stripe(), http.NotFoundHandler()); !errors.Is(err, idemhttp.ErrSourceInUse) {
		t.Fatalf("an endpoint verified upstream on the taken default source: %v, want ErrSourceInUse", err)
	}
	b, err := build(idemhttp.Config{Source: "stripe-b"}, idemhttp.Stripe("whsec_account_b"), http.HandlerFunc(func(http.ResponseWriter, *http.Request) { runsB.Add(1) }))
	if err != nil {
		t.Fatal(err)
	}
	// The same endpoint built twice, and rolled to a new secret.
	for _, secrets := range [][]string{{"whsec_account_a"}, {"whsec_account_a", "whsec_account_a2"}, {"whsec_account_a2"}} {
		if _, err := build(idemhttp.Config{}, idemhttp.Stripe(secrets...), http.NotFoundHandler()); err != nil {
			t.Fatalf("endpoint A with %q: %v", secrets, err)
		}
	}
	// Sources named by the caller may be shared knowingly.
	for range 2 {
		if _, err := build(idemhttp.Config{Source: "api"}, nil, http.NotFoundHandler()); err != nil {
			t.Fatalf("two IETF middlewares naming one source: %v", err)
		}
	}
	for _, ep := range []struct {
		srv    *httptest.Server
		secret string
	}{{a, "whsec_account_a"}, {b, "whsec_account_b"}} {
		p := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: []byte(s.body), Secret: ep.secret, Timestamp: time.Now()})
		if r := send(t, ep.srv, "POST", "/", s.body, map[string]string{"Stripe-Signature": p.Header}); r.status != 200 || r.header.Get(idemhttp.ReplayedHeader) != "" {
			t.Fatalf("one event id at two endpoints: %d replayed %q", r.status, r.header.Get(idemhttp.ReplayedHeader))
		}
	}
	if runsA.Load() != 1 || runsB.Load() != 1 {
		t.Fatalf("endpoint A ran %d, B %d; want once each", runsA.Load(), runsB.Load())
	}
}

// TestCapturedCopiesRaceTheRetry (acceptance): per preset, a genuine
// delivery's first attempt fails; then the sender's retry races copies
// of the captured delivery, each with one unsigned header changed, added
// or removed (every header of the delivery the signature does not cover,
// and the headers any preset reads). The event is processed exactly
// once, with its genuine meaning; no copy makes the handler act on an
// altered meaning, nothing but the event's key is stored in the source,
// and the answer stored under it is the genuine one.
func TestCapturedCopiesRaceTheRetry(t *testing.T) {
	t.Parallel()
	signed := map[string][]string{ // headers the signature covers or carries
		"stripe":            {"Stripe-Signature"},
		"github":            {"X-Hub-Signature-256"},
		"shopify":           {"X-Shopify-Hmac-Sha256"},
		"standard webhooks": {"webhook-id", "webhook-timestamp", "webhook-signature"},
		"svix":              {"svix-id", "svix-timestamp", "svix-signature"},
	}
	typeValue := map[string]string{"X-GitHub-Event": "ping", "X-Shopify-Topic": "app/uninstalled"}
	added := []string{"webhook-id", "webhook-timestamp", "webhook-signature", "svix-id", "svix-timestamp", "svix-signature", "X-GitHub-Delivery", "X-GitHub-Event", "X-GitHub-Hook-Id",
		"X-GitHub-Hook-Installation-Target-Id", "X-GitHub-Hook-Installation-Target-Type", "X-Shopify-Event-Id",
		"X-Shopify-Webhook-Id", "X-Shopify-Topic", "X-Shopify-Shop-Domain", "X-Shopify-Api-Version", "Idempotency-Key",
		"X-Forwarded-For", "User-Agent"}
	for _, s := range senders {
		t.Run(s.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			extra := map[string]string{"Content-Type": "application/json", "User-Agent": s.name + "-sender/1.0"}
			captured := s.delivery(s.secret, s.body, time.Now())
			maps.Copy(captured, extra)
			h := http.Header{}
			for k, v := range captured {
				h.Set(k, v)
			}
			a := &actor{sender: s.name, genuine: meaning(s.name, h, []byte(s.body))}
			srv, pool := setup(t, idemhttp.Config{}.Apply(s.preset(s.secret)), a)
			if r := send(t, srv, "POST", "/", s.body, captured); r.status != 500 {
				t.Fatalf("first attempt: %d %s", r.status, r.body)
			}

			type delivery struct {
				name    string
				headers map[string]string
			}
			var copies []delivery
			for name, v := range captured {
				if slices.ContainsFunc(signed[s.name], func(n string) bool { return strings.EqualFold(n, name) }) {
					continue
				}
				changed := maps.Clone(captured)
				changed[name] = v + "-0"
				if tv, ok := typeValue[name]; ok {
					changed[name] = tv
				}
				removed := maps.Clone(captured)
				delete(removed, name)
				copies = append(copies, delivery{name + " changed", changed}, delivery{name + " removed", removed})
			}
			for _, name := range added {
				if slices.ContainsFunc(slices.Collect(maps.Keys(captured)), func(n string) bool { return strings.EqualFold(n, name) }) {
					continue
				}
				c := maps.Clone(captured)
				c[name] = "added-" + name
				if tv, ok := typeValue[name]; ok {
					c[name] = tv
				}
				copies = append(copies, delivery{name + " added", c})
			}
			retry := s.delivery(s.secret, s.body, time.Now())
			maps.Copy(retry, extra)
			all := append([]delivery{{"the sender's retry", retry}}, copies...)
			rand.Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] }) // no one starts first by design

			codes := make([]int, len(all))
			var start, wg sync.WaitGroup
			start.Add(1)
			for i, d := range all {
				wg.Go(func() {
					req, _ := http.NewRequest("POST", srv.URL+"/", strings.NewReader(s.body))
					for k, v := range d.headers {
						req.Header.Set(k, v)
					}
					req.Close = true
					start.Wait()
					resp, err := client.Do(req)
					if err != nil {
						t.Errorf("%s: %v", d.name, err)
						return
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					codes[i] = resp.StatusCode
				})
			}
			start.Done()
			wg.Wait()
			// The sender retries until it gets a 2xx.
			for i := 0; a.acted.Load() == 0 && i < 50; i++ {
				if r := send(t, srv, "POST", "/", s.body, retry); r.status == 200 {
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
			if a.acted.Load() != 1 || a.altered.Load() != 0 {
				t.Fatalf("%d copies: the handler acted %d times on the event and %d times on an altered meaning; want 1, 0 (codes %v)",
					len(copies), a.acted.Load(), a.altered.Load(), codes)
			}
			var keys []string
			rows, _ := pool.Query(ctx, `SELECT key FROM idem.processed_events WHERE source = $1`, s.source)
			for rows.Next() {
				var k string
				rows.Scan(&k)
				keys = append(keys, k)
			}
			if len(keys) != 1 || keys[0] != s.key {
				t.Fatalf("keys stored in %s: %q, want only %q", s.source, keys, s.key)
			}
			if got := storedBody(t, ctx, pool, s.source, s.key); got != "acted "+a.genuine {
				t.Fatalf("the answer stored under the event's key is %q, want the genuine one", got)
			}
			t.Logf("%d copies raced the sender's retry", len(copies))
			for i, d := range all {
				t.Logf("%s: %d", d.name, codes[i])
			}
		})
	}
}

// TestBodyFingerprintedKeysAfterUpgrade: a GitHub or Shopify key whose
// first attempt failed under an earlier version (stored with the
// body-only fingerprint) is not a mismatch for the sender's retry after
// the upgrade: the retry runs.
func TestBodyFingerprintedKeysAfterUpgrade(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"github", "shopify"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			s := senderNamed(name)
			var runs atomic.Int64
			srv, pool := setup(t, idemhttp.Config{}.Apply(s.preset(s.secret)), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
			}))
			c := testdb.Client(t, pool, nil)
			cl, err := c.Claim(ctx, s.source, s.key, idem.WithFingerprint(idem.Fingerprint([]byte(s.body))))
			if err != nil {
				t.Fatal(err)
			}
			if err := c.Fail(ctx, s.source, s.key, cl.Token, "handler answered 500", true); err != nil {
				t.Fatal(err)
			}
			if r := send(t, srv, "POST", "/", s.body, s.delivery(s.secret, s.body, time.Now())); r.status != 200 || runs.Load() != 1 {
				t.Fatalf("the sender's retry of a key stored before the upgrade: %d %s, ran %d", r.status, r.body, runs.Load())
			}
		})
	}
}
