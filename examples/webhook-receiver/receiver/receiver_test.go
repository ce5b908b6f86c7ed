package receiver_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stripe/stripe-go/v85/webhook"

	"github.com/idemkit/idem/examples/webhook-receiver/receiver"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/testpg"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(child())
	}
	testdb.Main(m)
}

const secret = "whsec_example_receiver"

// deliver posts body signed the way Stripe signs it (stripe-go's own
// test signer) with secret at time at.
func deliver(url string, body []byte, secret string, at time.Time) (*http.Response, error) {
	req, _ := http.NewRequest("POST", url, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	p := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: body, Secret: secret, Timestamp: at})
	req.Header.Set("Stripe-Signature", p.Header)
	return sender.Do(req)
}

// sender is Stripe: it gives up on a delivery after 10 seconds.
var sender = &http.Client{Timeout: 10 * time.Second}

// world is the receiver's database and the stub providers it calls.
type world struct {
	url     string
	stubURL string
	pool    *pgxpool.Pool
	stub    *receiver.Stub
	api     *receiver.API
}

func newWorld(t *testing.T) *world {
	t.Helper()
	w := &world{url: testpg.New(t), stub: &receiver.Stub{}}
	w.pool = testpg.Pool(t, w.url, 16)
	if err := receiver.Setup(context.Background(), w.pool); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(w.stub)
	t.Cleanup(srv.Close)
	api, err := receiver.NewAPI(srv.URL, srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	w.api, w.stubURL = api, srv.URL
	return w
}

// serve runs the receiver behind idemhttp's Stripe preset.
func serve(t *testing.T, w *world) *httptest.Server {
	t.Helper()
	rc := &receiver.Receiver{Pool: w.pool, Idem: testdb.Client(t, w.pool, nil), API: w.api}
	h, err := rc.Handler(nil, secret)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

func invoicePaid(n int) []byte {
	return []byte(fmt.Sprintf(`{"id":"evt_%d","type":"invoice.paid","data":{"object":{"id":"in_%d","customer":"cus_%d","amount_paid":420000,"customer_email":"c%d@example.com"}}}`, n, n, n, n))
}

// TestForgedPaymentIsRefused: an invoice.paid signed with the wrong
// secret, a stale one, and one with no signature book nothing and claim
// nothing; the genuine delivery that follows books the payment once.
func TestForgedPaymentIsRefused(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	pool := w.pool
	srv := serve(t, w)
	body := []byte(`{"id":"evt_f","type":"invoice.paid","data":{"object":{"id":"in_f","customer":"cus_f","amount_paid":100000,"customer_email":"f@example.com"}}}`)
	for name, send := range map[string]func() (*http.Response, error){
		"wrong secret": func() (*http.Response, error) { return deliver(srv.URL, body, "whsec_forger", time.Now()) },
		"stale":        func() (*http.Response, error) { return deliver(srv.URL, body, secret, time.Now().Add(-time.Hour)) },
		"unsigned":     func() (*http.Response, error) { return http.Post(srv.URL, "application/json", bytes.NewReader(body)) },
	} {
		resp, err := send()
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized && resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("%s: %d, want 400 or 401", name, resp.StatusCode)
		}
	}
	var payments, keys int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM payments), (SELECT count(*) FROM idem.processed_events)`).Scan(&payments, &keys); err != nil {
		t.Fatal(err)
	}
	if payments != 0 || keys != 0 {
		t.Fatalf("forged deliveries booked %d payments and claimed %d keys", payments, keys)
	}
	resp, err := deliver(srv.URL, body, secret, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM payments`).Scan(&payments); err != nil || resp.StatusCode != 200 || payments != 1 {
		t.Fatalf("genuine delivery: %d, %d payments (%v)", resp.StatusCode, payments, err)
	}
}

// TestReceiver: a Stripe event delivered 10 times at once books one
// payment, charges one fee and sends one email, even when the mail API
// fails once (the 503 releases the key; a redelivery runs the handler
// again, which replays the fee's effect instead of charging again).
func TestReceiver(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	var failed atomic.Bool
	w.stub.Hook = func(path, key, invoice string, done bool) error {
		if path == "/v1/emails" && !done && failed.CompareAndSwap(false, true) {
			return errors.New("mail API: 451 try again later")
		}
		return nil
	}
	srv := serve(t, w)
	body := invoicePaid(1)
	var wg sync.WaitGroup
	for range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for attempt := 1; attempt <= 10; attempt++ { // Stripe retries non-2xx, with backoff
				resp, err := deliver(srv.URL, body, secret, time.Now())
				if err != nil {
					t.Error(err)
					return
				}
				resp.Body.Close()
				if resp.StatusCode == 200 {
					return
				}
				time.Sleep(time.Duration(attempt) * 50 * time.Millisecond)
			}
			t.Error("delivery never succeeded")
		}()
	}
	wg.Wait()
	var payments, amount int
	if err := w.pool.QueryRow(ctx, `SELECT count(*), sum(amount_cents) FROM payments`).Scan(&payments, &amount); err != nil {
		t.Fatal(err)
	}
	fees, mails := w.stub.Done("/v1/charges", "in_1"), w.stub.Done("/v1/emails", "in_1")
	if payments != 1 || amount != 420000 || len(fees) != 1 || len(mails) != 1 || !failed.Load() {
		t.Fatalf("payments=%d amount=%d fees=%v emails=%v (mail failed once: %v)", payments, amount, fees, mails, failed.Load())
	}
	if n := len(w.stub.Writes("/v1/charges", "in_1")); n != 1 {
		t.Fatalf("the fee was requested %d times: the re-run did not replay the effect", n)
	}
}

// TestReadmeShowsTheHandler keeps the README's copy of the handler exact.
func TestReadmeShowsTheHandler(t *testing.T) {
	src, err := os.ReadFile("receiver.go")
	if err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	s := string(src)
	start := strings.Index(s, "func (rc *Receiver) ServeHTTP")
	end := strings.Index(s[start:], "\n}\n") + start + 3
	if start < 0 || !strings.Contains(string(readme), "```go\n"+s[start:end]+"```") {
		t.Fatal("examples/webhook-receiver/README.md does not show the current ServeHTTP; copy it again")
	}
}
