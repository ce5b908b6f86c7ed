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
// Idempotency-Key as Stripe does (a key seen before is answered with the
// payment intent it created; a request without one always creates),
// records every value of the header each request carried, and loses its
// answer to the first request of a key (it creates the payment intent,
// then hangs up).
type stripeAPI struct {
	mu      sync.Mutex
	keys    [][]string        // Idempotency-Key values of every request
	created map[string]string // key -> payment intent id
	amounts map[string]string // payment intent id -> the amount it was created with
}

func (s *stripeAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	amount := r.PostFormValue("amount")
	s.mu.Lock()
	vals := r.Header.Values("Idempotency-Key")
	s.keys = append(s.keys, vals)
	if s.created == nil {
		s.created, s.amounts = map[string]string{}, map[string]string{}
	}
	key := strings.Join(vals, ",")
	id, seen := s.created[key]
	seen = seen && key != ""
	if !seen {
		id = fmt.Sprintf("pi_%d", len(s.amounts)+1)
		s.created[key], s.amounts[id] = id, amount
	}
	amount = s.amounts[id]
	s.mu.Unlock()
	if !seen {
		conn, _, _ := w.(http.Hijacker).Hijack()
		conn.Close()
		return
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{"id": id, "object": "payment_intent", "amount": json.Number(amount), "currency": "usd"})
}

// charges returns how many payment intents the stub created and the
// Idempotency-Key values of every request.
func (s *stripeAPI) charges() (int, [][]string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.amounts), append([][]string(nil), s.keys...)
}

// stripeClient is stripe-go's own client against url through rt, with
// stripe-go's own retry loop making up to retries retries.
func stripeClient(url string, rt http.RoundTripper, retries int64) *stripe.Client {
	return stripe.NewClient("sk_test_idem", stripe.WithBackends(stripe.NewBackendsWithConfig(&stripe.BackendConfig{
		URL: stripe.String(url), HTTPClient: &http.Client{Transport: rt}, MaxNetworkRetries: stripe.Int64(retries),
		LeveledLogger: &stripe.LeveledLogger{Level: stripe.LevelNull},
	})))
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
	sc := stripeClient(srv.URL, rt, 0)
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
// outside an effect such a write is refused, keyed or not, and with
// AllowUnkeyed sent as it is, once.
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
	if err := send(ctx, "post", http.Header{"idempotency-key": {"mine"}}); !errors.Is(err, idemhttp.ErrNoEffect) {
		t.Fatalf("a caller-keyed write outside an effect: %v, want ErrNoEffect", err)
	}
	if err := send(ctx, "post", nil); !errors.Is(err, idemhttp.ErrNoEffect) {
		t.Fatalf("a lower-case unkeyed write outside an effect: %v, want ErrNoEffect", err)
	}
	loose, _ := idemhttp.NewTransport(nil, &idemhttp.TransportConfig{AllowUnkeyed: true})
	hc = &http.Client{Transport: loose}
	if err := send(ctx, "post", http.Header{"idempotency-key": {"mine"}}); err != nil {
		t.Fatalf("a caller-keyed write outside an effect, AllowUnkeyed: %v", err)
	}
	if len(seen) != 1 || len(seen[0]) != 1 || seen[0][0] != "mine" {
		t.Fatalf("outside an effect the provider saw %q, want the caller's key once", seen)
	}
}

// TestOutboundStripeEffectForgotten: a charge made through stripe-go in
// Do's work with the Effect wrapper forgotten. stripe-go puts a random
// Idempotency-Key on every write, which the Transport once took for the
// caller's own key: each delivery of the event charged again (3
// deliveries, 3 payment intents, 3 keys, no error). A write outside an
// effect is refused whatever key it carries: no delivery charges, each
// fails with ErrNoEffect (through stripe-go's own retry, which is refused
// too), and a client opted out with AllowUnkeyed sends stripe-go's key as
// it is.
func TestOutboundStripeEffectForgotten(t *testing.T) {
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
	sc := stripeClient(srv.URL, rt, 1)
	errLedger := errors.New("ledger unavailable")
	var errs []error
	for range 3 { // the event's deliveries
		_, err := c.Do(ctx, "stripe", "evt_forgot", func(ctx context.Context) (any, error) {
			// The Effect wrapper forgotten: the charge is made in the
			// event's work itself, which fails after it.
			if _, err := sc.V1PaymentIntents.Create(ctx, &stripe.PaymentIntentCreateParams{Amount: stripe.Int64(4200), Currency: stripe.String("usd")}); err != nil {
				return nil, err
			}
			return nil, errLedger
		})
		errs = append(errs, err)
	}
	if n, keys := api.charges(); n != 0 || len(keys) != 0 {
		t.Fatalf("3 deliveries: the API saw %d requests (keys %q) and created %d payment intents; want none", len(keys), keys, n)
	}
	for i, err := range errs {
		if !errors.Is(err, idemhttp.ErrNoEffect) {
			t.Fatalf("delivery %d: %v, want ErrNoEffect", i+1, err)
		}
	}

	loose, _ := idemhttp.NewTransport(nil, &idemhttp.TransportConfig{AllowUnkeyed: true})
	pi, err := stripeClient(srv.URL, loose, 1).V1PaymentIntents.Create(ctx, &stripe.PaymentIntentCreateParams{Amount: stripe.Int64(100), Currency: stripe.String("usd")})
	if err != nil {
		t.Fatalf("AllowUnkeyed: %v", err)
	}
	n, keys := api.charges()
	if n != 1 || pi.ID != "pi_1" || len(keys) != 2 || len(keys[0]) != 1 || keys[0][0] == "" || keys[1][0] != keys[0][0] {
		t.Fatalf("AllowUnkeyed: %d created (%s), keys %q; want one, under stripe-go's own key sent twice (its retry)", n, pi.ID, keys)
	}
}

// TestOutboundStripeNestedDo: an order's payout effect pays each seller
// inside a DoValue of its own, through stripe-go (whose retry loop makes
// up to 2 retries). The inner Do's writes once carried the enclosing
// effect's key: both sellers' requests under one Idempotency-Key, the
// second answered with the first's payment intent, never created. The
// effect a request belongs to is the innermost one of the innermost event:
// wired so (no Effect in the inner Do), the writes are refused as outside
// an effect; with an Effect in each inner Do, each seller's write carries
// its own key, and the first answers lost (stripe-go retries) and the
// event delivered three times create one payment intent per seller, each
// with its own amount.
func TestOutboundStripeNestedDo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 6), nil)
	rt, err := idemhttp.NewTransport(nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	sellers := map[string]int64{"alice": 1000, "bob": 2500}
	pay := func(sc *stripe.Client, order string, withEffect bool) func(ctx context.Context) (map[string]string, error) {
		return func(ctx context.Context) (map[string]string, error) {
			ids := map[string]string{}
			for _, seller := range []string{"alice", "bob"} {
				transfer := func(ctx context.Context) (string, error) {
					pi, err := sc.V1PaymentIntents.Create(ctx, &stripe.PaymentIntentCreateParams{Amount: stripe.Int64(sellers[seller]), Currency: stripe.String("usd")})
					if err != nil {
						return "", err
					}
					return fmt.Sprintf("%s:%d", pi.ID, pi.Amount), nil
				}
				id, err := idem.DoValue(ctx, c, "transfer", order+"/"+seller, func(ctx context.Context) (string, error) {
					if !withEffect {
						return transfer(ctx)
					}
					return idem.EffectValue(ctx, c, "pay", transfer)
				})
				if err != nil {
					return nil, err
				}
				ids[seller] = id
			}
			return ids, nil
		}
	}

	t.Run("inner Do without an effect", func(t *testing.T) {
		api := &stripeAPI{}
		srv := httptest.NewServer(api)
		t.Cleanup(srv.Close)
		sc := stripeClient(srv.URL, rt, 1)
		_, err := c.Do(ctx, "shop", "order-7a", func(ctx context.Context) (any, error) {
			return idem.EffectValue(ctx, c, "payout", pay(sc, "order-7a", false))
		})
		if n, keys := api.charges(); n != 0 || len(keys) != 0 || !errors.Is(err, idemhttp.ErrNoEffect) {
			t.Fatalf("the API saw %d requests (keys %q) and created %d, error %v; want none, ErrNoEffect", len(keys), keys, n, err)
		}
	})
	t.Run("an effect in each inner Do", func(t *testing.T) {
		api := &stripeAPI{}
		srv := httptest.NewServer(api)
		t.Cleanup(srv.Close)
		sc := stripeClient(srv.URL, rt, 2)
		var answers []string
		for range 3 {
			res, err := c.Do(ctx, "shop", "order-7", func(ctx context.Context) (any, error) {
				return idem.EffectValue(ctx, c, "payout", pay(sc, "order-7", true))
			})
			if err != nil {
				t.Fatal(err)
			}
			answers = append(answers, string(res.Result))
		}
		n, keys := api.charges()
		alice := idem.Effect{Name: "pay", EventSource: "transfer", EventKey: "order-7/alice"}.OutboundKey("POST /v1/payment_intents")
		bob := idem.Effect{Name: "pay", EventSource: "transfer", EventKey: "order-7/bob"}.OutboundKey("POST /v1/payment_intents")
		want := [][]string{{alice}, {alice}, {bob}, {bob}} // each first answer lost, stripe-go's retry answered
		if n != 2 || fmt.Sprint(keys) != fmt.Sprint(want) {
			t.Fatalf("created %d payment intents, keys %q; want 2, keys %q", n, keys, want)
		}
		for i, a := range answers {
			var ids map[string]string
			if err := json.Unmarshal([]byte(a), &ids); err != nil || ids["alice"] != "pi_1:1000" || ids["bob"] != "pi_2:2500" {
				t.Fatalf("delivery %d answered %s, want alice pi_1:1000 and bob pi_2:2500", i+1, a)
			}
		}
	})
}
