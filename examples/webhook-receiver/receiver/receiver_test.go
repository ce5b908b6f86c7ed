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

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/webhook-receiver/receiver"
	"github.com/idemkit/idem/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// TestReceiver: a Stripe event delivered 10 times at once books one
// payment and sends one email, even when the email fails once.
func TestReceiver(t *testing.T) {
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 16)
	if err := receiver.Setup(ctx, pool); err != nil {
		t.Fatal(err)
	}
	mail := &receiver.StubMailer{FailFirst: func(string) bool { return true }}
	srv := httptest.NewServer(&receiver.Receiver{Pool: pool, Idem: idem.New(pool, nil), Mail: mail})
	defer srv.Close()
	body := []byte(`{"id":"evt_1","type":"invoice.paid","data":{"object":{"id":"in_1","customer":"cus_1","amount_paid":4200,"customer_email":"a@example.com"}}}`)
	var wg sync.WaitGroup
	for range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for attempt := 0; attempt < 5; attempt++ { // Stripe retries non-2xx
				resp, err := http.Post(srv.URL, "application/json", bytes.NewReader(body))
				if err != nil {
					t.Error(err)
					return
				}
				resp.Body.Close()
				if resp.StatusCode == 200 {
					return
				}
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
