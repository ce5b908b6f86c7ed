package idemhttp_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/testdb"
)

// provider is a stub payment API that honours Idempotency-Key the way
// Stripe does: a key seen before is answered with the first answer, and
// charges nothing. dropFirst loses the answer to the first charge of a key
// (it charges, then hangs up), as a network cut would.
type provider struct {
	mu        sync.Mutex
	keys      []string          // Idempotency-Key of every request, in order
	charged   map[string]string // key -> charge id
	dropFirst bool
}

func (p *provider) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	key := r.Header.Get("Idempotency-Key")
	p.keys = append(p.keys, key)
	if p.charged == nil {
		p.charged = map[string]string{}
	}
	id, seen := p.charged[key]
	if !seen {
		id = fmt.Sprintf("ch_%d", len(p.charged)+1)
		p.charged[key] = id
	}
	drop := p.dropFirst && !seen
	p.mu.Unlock()
	if drop {
		conn, _, _ := w.(http.Hijacker).Hijack()
		conn.Close()
		return
	}
	io.WriteString(w, id)
}

func (p *provider) snapshot() (keys []string, charges int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.keys...), len(p.charged)
}

func charge(ctx context.Context, hc *http.Client, url string) (string, error) {
	req, _ := http.NewRequestWithContext(ctx, "POST", url+"/v1/charges", strings.NewReader("amount=4200"))
	resp, err := hc.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// TestTransport: writes inside an effect carry the effect's key (also
// over a key the caller set); the same call in a re-run carries the same
// key; reads and (when allowed) writes outside effects are sent as they
// are; a write outside an effect is refused, also one that carries a key
// of its own.
func TestTransport(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 4)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var got []string
	stub := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, r.Method+" "+r.URL.Path+" "+r.Header.Get("Idempotency-Key")+r.Header.Get("Paypal-Request-Id"))
		mu.Unlock()
	}))
	t.Cleanup(stub.Close)
	rt, err := idemhttp.NewTransport(nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{Transport: rt}
	do := func(ctx context.Context, hc *http.Client, method, path string, header ...string) error {
		req, _ := http.NewRequestWithContext(ctx, method, stub.URL+path, strings.NewReader("x"))
		if len(header) == 2 {
			req.Header.Set(header[0], header[1])
		}
		resp, err := hc.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	ev, err := c.Claim(ctx, "stripe", "evt_t")
	if err != nil {
		t.Fatal(err)
	}
	eff := idem.Effect{Name: "charge", EventSource: "stripe", EventKey: "evt_t"}
	_, err = c.Effect(idem.WithEvent(ctx, ev), "charge", func(ctx context.Context) (any, error) {
		for _, call := range []struct{ method, path string }{
			{"POST", "/v1/charges"}, {"PATCH", "/v1/charges/ch_1"}, {"GET", "/v1/charges/ch_1"}, {"PUT", "/v1/x"}, {"DELETE", "/v1/x"},
		} {
			if err := do(ctx, hc, call.method, call.path); err != nil {
				return nil, err
			}
		}
		if err := do(ctx, hc, "POST", "/v1/charges", "Idempotency-Key", "mine"); err != nil {
			return nil, err
		}
		return nil, do(idemhttp.WithOutboundLabel(ctx, "second"), hc, "POST", "/v1/charges")
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"POST /v1/charges " + eff.OutboundKey("POST /v1/charges"),
		"PATCH /v1/charges/ch_1 " + eff.OutboundKey("PATCH /v1/charges/ch_1"),
		"GET /v1/charges/ch_1 ", "PUT /v1/x ", "DELETE /v1/x ",
		"POST /v1/charges " + eff.OutboundKey("POST /v1/charges"), // the caller's "mine" loses to the effect's key
		"POST /v1/charges " + eff.OutboundKey("second"),
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("the provider saw\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if eff.OutboundKey("POST /v1/charges") == eff.OutboundKey("second") {
		t.Fatal("two labels share a key")
	}

	t.Run("outside an effect", func(t *testing.T) {
		if err := do(ctx, hc, "POST", "/v1/charges"); !errors.Is(err, idemhttp.ErrNoEffect) {
			t.Fatalf("write outside an effect: %v, want ErrNoEffect", err)
		}
		if err := do(ctx, hc, "POST", "/v1/charges", "Idempotency-Key", "mine"); !errors.Is(err, idemhttp.ErrNoEffect) {
			t.Fatalf("write outside an effect with a key of its own: %v, want ErrNoEffect", err)
		}
		if err := do(ctx, hc, "GET", "/v1/charges"); err != nil {
			t.Fatalf("read outside an effect: %v", err)
		}
		loose, _ := idemhttp.NewTransport(nil, &idemhttp.TransportConfig{AllowUnkeyed: true})
		if err := do(ctx, &http.Client{Transport: loose}, "POST", "/v1/charges"); err != nil {
			t.Fatalf("AllowUnkeyed: %v", err)
		}
	})
	t.Run("header, methods, namespace", func(t *testing.T) {
		mu.Lock()
		got = nil
		mu.Unlock()
		pp, err := idemhttp.NewTransport(nil, &idemhttp.TransportConfig{Header: "PayPal-Request-Id", Methods: []string{"POST", "PUT"}, Namespace: "billing"})
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.Effect(idem.WithEvent(ctx, ev), "payout", func(ctx context.Context) (any, error) {
			if err := do(ctx, &http.Client{Transport: pp}, "PUT", "/v1/x"); err != nil {
				return nil, err
			}
			return nil, do(ctx, &http.Client{Transport: pp}, "PATCH", "/v1/x")
		})
		if err != nil {
			t.Fatal(err)
		}
		payout := idem.Effect{Name: "payout", EventSource: "stripe", EventKey: "evt_t"}
		want := []string{"PUT /v1/x " + payout.OutboundKey("billing\x00PUT /v1/x"), "PATCH /v1/x "}
		if strings.Join(got, "\n") != strings.Join(want, "\n") {
			t.Fatalf("saw %q, want %q", got, want)
		}
	})
	t.Run("bad config", func(t *testing.T) {
		for name, cfg := range map[string]idemhttp.TransportConfig{
			"header with a space": {Header: "Idempotency Key"},
			"empty methods":       {Methods: []string{}},
			"lower-case method":   {Methods: []string{"post"}},
			"blank method":        {Methods: []string{""}},
		} {
			if _, err := idemhttp.NewTransport(nil, &cfg); !errors.Is(err, idemhttp.ErrInvalidTransport) {
				t.Errorf("%s: %v, want ErrInvalidTransport", name, err)
			}
		}
	})
}

// TestInboundToOutbound: a webhook handler behind the middleware charges
// through the Transport inside an effect. The provider charges, and its
// answer is lost; the handler fails, the sender redelivers, and the
// re-run sends the same key: one charge, the same id answered.
func TestInboundToOutbound(t *testing.T) {
	t.Parallel()
	p := &provider{dropFirst: true}
	stub := httptest.NewServer(p)
	t.Cleanup(stub.Close)
	rt, _ := idemhttp.NewTransport(nil, nil)
	hc := &http.Client{Transport: rt}
	var c *idem.Client
	srv, pool := setup(t, idemhttp.Config{Source: "shop"}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id, err := idem.EffectValue(r.Context(), c, "charge", func(ctx context.Context) (string, error) {
			return charge(ctx, hc, stub.URL)
		})
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		io.WriteString(w, id)
	}))
	c = testdb.Client(t, pool, nil)
	var answers []string
	for range 3 {
		r := send(t, srv, "POST", "/orders", `{"order":1}`, map[string]string{"Idempotency-Key": "order-1"})
		answers = append(answers, fmt.Sprint(r.status, " ", strings.TrimSpace(r.body)))
	}
	keys, charges := p.snapshot()
	if charges != 1 || len(keys) != 2 || keys[0] != keys[1] || keys[0] == "" {
		t.Fatalf("provider: %d charges, keys %q; want 1 charge and the same key twice", charges, keys)
	}
	if answers[0][:3] != "502" || answers[1] != "200 ch_1" || answers[2] != "200 ch_1" {
		t.Fatalf("answers %q", answers)
	}
}

// An outbound call inside an effect carries the effect's Idempotency-Key:
// the provider charged, its answer was lost, and the retry is answered
// from the provider's record of the key instead of charging again.
func ExampleNewTransport() {
	ctx := context.Background()
	pool, done := testdb.ExamplePool()
	defer done()
	c, err := idem.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}

	p := &provider{dropFirst: true} // a Stripe-like API: it honours Idempotency-Key
	api := httptest.NewServer(p)
	defer api.Close()

	rt, err := idemhttp.NewTransport(http.DefaultTransport, nil)
	if err != nil {
		log.Fatal(err)
	}
	stripe := &http.Client{Transport: rt}

	for delivery := 1; delivery <= 3; delivery++ {
		res, err := c.Do(ctx, "stripe", "evt_1Q", func(ctx context.Context) (any, error) {
			return idem.EffectValue(ctx, c, "charge", func(ctx context.Context) (string, error) {
				return charge(ctx, stripe, api.URL) // POST /v1/charges, keyed
			})
		})
		if err != nil {
			fmt.Printf("delivery %d: failed, the sender retries: %v\n", delivery, errors.Is(err, io.EOF))
			continue
		}
		fmt.Printf("delivery %d: %s, replayed %v\n", delivery, res.Result, res.Replayed)
	}
	keys, charges := p.snapshot()
	fmt.Println("requests:", len(keys), "same key:", keys[0] == keys[1], "charges:", charges)
	// Output:
	// delivery 1: failed, the sender retries: true
	// delivery 2: "ch_1", replayed false
	// delivery 3: "ch_1", replayed true
	// requests: 2 same key: true charges: 1
}
