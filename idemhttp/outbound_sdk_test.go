package idemhttp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/stripe/stripe-go/v85"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/testdb"
)

// stripeAPI is a stub of Stripe's /v1/payment_intents that honours
// Idempotency-Key as Stripe does, records every value of the header each
// request carried, and loses its answer to the first request of a key
// (it creates the payment intent, then hangs up).
type stripeAPI struct {
	mu      sync.Mutex
	keys    [][]string        // Idempotency-Key values of every request
	created map[string]string // key -> payment intent id
}

func (s *stripeAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	vals := r.Header.Values("Idempotency-Key")
	s.keys = append(s.keys, vals)
	if s.created == nil {
		s.created = map[string]string{}
	}
	key := strings.Join(vals, ",")
	id, seen := s.created[key]
	if !seen {
		id = fmt.Sprintf("pi_%d", len(s.created)+1)
		s.created[key] = id
	}
	s.mu.Unlock()
	if !seen {
		conn, _, _ := w.(http.Hijacker).Hijack()
		conn.Close()
		return
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{"id": id, "object": "payment_intent", "amount": 4200, "currency": "usd"})
}

// TestTransportOverStripeGo: stripe-go sets a random Idempotency-Key on
// every write. Through the Transport, inside an effect, the effect's key
// replaces it: the effect, retried after Stripe's answer was lost, sends
// the same key again and one payment intent is created.
func TestTransportOverStripeGo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 4), nil)
	api := &stripeAPI{}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	rt, err := idemhttp.NewTransport(nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	sc := stripe.NewClient("sk_test_idem", stripe.WithBackends(stripe.NewBackendsWithConfig(&stripe.BackendConfig{
		URL: stripe.String(srv.URL), HTTPClient: &http.Client{Transport: rt}, MaxNetworkRetries: stripe.Int64(0),
		LeveledLogger: &stripe.LeveledLogger{Level: stripe.LevelNull},
	})))
	var answers []string
	for range 3 { // the event's deliveries
		res, err := c.Do(ctx, "stripe", "evt_sdk", func(ctx context.Context) (any, error) {
			return idem.EffectValue(ctx, c, "charge", func(ctx context.Context) (string, error) {
				pi, err := sc.V1PaymentIntents.Create(ctx, &stripe.PaymentIntentCreateParams{Amount: stripe.Int64(4200), Currency: stripe.String("usd")})
				if err != nil {
					return "", err
				}
				return pi.ID, nil
			})
		})
		if err != nil {
			answers = append(answers, "failed")
			continue
		}
		answers = append(answers, string(res.Result))
	}
	want := idem.Effect{Name: "charge", EventSource: "stripe", EventKey: "evt_sdk"}.OutboundKey("POST /v1/payment_intents")
	api.mu.Lock()
	defer api.mu.Unlock()
	if len(api.keys) != 2 || len(api.created) != 1 {
		t.Fatalf("Stripe saw %d requests with keys %q and created %d payment intents; want 2 requests, 1 created", len(api.keys), api.keys, len(api.created))
	}
	for i, k := range api.keys {
		if len(k) != 1 || k[0] != want {
			t.Fatalf("request %d carried Idempotency-Key %q, want only the effect's %q", i+1, k, want)
		}
	}
	if strings.Join(answers, " ") != `failed "pi_1" "pi_1"` {
		t.Fatalf("answers %q", answers)
	}
}

// TestTransportKeySpellings: inside an effect, a write whose method is
// written in lower case is keyed, and a key the caller set under a
// non-canonical header name is replaced, not sent next to the effect's;
// outside an effect such a caller key is sent as it is, once.
func TestTransportKeySpellings(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 4), nil)
	var mu sync.Mutex
	var seen [][]string
	stub := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var vals []string
		for name, vs := range r.Header {
			if strings.EqualFold(name, "Idempotency-Key") {
				vals = append(vals, vs...)
			}
		}
		mu.Lock()
		seen = append(seen, vals)
		mu.Unlock()
	}))
	t.Cleanup(stub.Close)
	rt, _ := idemhttp.NewTransport(nil, nil)
	hc := &http.Client{Transport: rt}
	send := func(ctx context.Context, method string, h http.Header) error {
		req, _ := http.NewRequestWithContext(ctx, method, stub.URL+"/v1/charges", strings.NewReader("amount=1"))
		for k, v := range h {
			req.Header[k] = v // as set, not canonicalized
		}
		resp, err := hc.Do(req)
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		return err
	}
	ev, err := c.Claim(ctx, "shop", "order-1")
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Effect(idem.WithEvent(ctx, ev), "charge", func(ctx context.Context) (any, error) {
		return nil, errors.Join(
			send(ctx, "post", nil),
			send(ctx, "POST", http.Header{"idempotency-key": {"mine"}}),
			send(ctx, "Post", http.Header{"IDEMPOTENCY-KEY": {"a"}, "Idempotency-Key": {"b"}}))
	})
	if err != nil {
		t.Fatal(err)
	}
	want := idem.Effect{Name: "charge", EventSource: "shop", EventKey: "order-1"}.OutboundKey("POST /v1/charges")
	for i, vals := range seen {
		if len(vals) != 1 || vals[0] != want {
			t.Fatalf("write %d inside the effect carried %q, want only the effect's key", i+1, vals)
		}
	}
	seen = nil
	if err := send(ctx, "post", http.Header{"idempotency-key": {"mine"}}); err != nil {
		t.Fatalf("a caller-keyed write outside an effect: %v", err)
	}
	if err := send(ctx, "post", nil); !errors.Is(err, idemhttp.ErrNoEffect) {
		t.Fatalf("a lower-case unkeyed write outside an effect: %v, want ErrNoEffect", err)
	}
	if len(seen) != 1 || len(seen[0]) != 1 || seen[0][0] != "mine" {
		t.Fatalf("outside an effect the provider saw %q, want the caller's key once", seen)
	}
}
