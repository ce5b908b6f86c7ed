package receiver_test

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stripe/stripe-go/v85/webhook"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/webhook-receiver/receiver"
	"github.com/idemkit/idem/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

const secret = "whsec_example_receiver"

// deliver posts body signed the way Stripe signs it (stripe-go's own
// test signer) with secret at time at.
func deliver(url string, body []byte, secret string, at time.Time) (*http.Response, error) {
	req, _ := http.NewRequest("POST", url, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	p := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: body, Secret: secret, Timestamp: at})
	req.Header.Set("Stripe-Signature", p.Header)
	return http.DefaultClient.Do(req)
}

// serve runs the receiver behind idemhttp's Stripe preset.
func serve(t *testing.T, rc *receiver.Receiver) *httptest.Server {
	t.Helper()
	h, err := rc.Handler(nil, secret)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

// TestForgedPaymentIsRefused: an invoice.paid signed with the wrong
// secret, a stale one, and one with no signature book nothing and claim
// nothing; the genuine delivery that follows books the payment once.
func TestForgedPaymentIsRefused(t *testing.T) {
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 4)
	if err := receiver.Setup(ctx, pool); err != nil {
		t.Fatal(err)
	}
	srv := serve(t, &receiver.Receiver{Pool: pool, Idem: idem.New(pool, nil), Mail: &receiver.StubMailer{}})
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
// payment and sends one email, even when the email fails once (the 500
// releases the key; a redelivery runs the handler again).
func TestReceiver(t *testing.T) {
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 16)
	if err := receiver.Setup(ctx, pool); err != nil {
		t.Fatal(err)
	}
	mail := &receiver.StubMailer{FailFirst: func(string) bool { return true }}
	srv := serve(t, &receiver.Receiver{Pool: pool, Idem: idem.New(pool, nil), Mail: mail})
	body := []byte(`{"id":"evt_1","type":"invoice.paid","data":{"object":{"id":"in_1","customer":"cus_1","amount_paid":4200,"customer_email":"a@example.com"}}}`)
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
	if err := pool.QueryRow(ctx, `SELECT count(*), sum(amount_cents) FROM payments`).Scan(&payments, &amount); err != nil {
		t.Fatal(err)
	}
	if payments != 1 || amount != 4200 || fmt.Sprint(mail.Sent) != "map[Receipt for in_1:1]" {
		t.Fatalf("payments=%d amount=%d emails=%v", payments, amount, mail.Sent)
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
