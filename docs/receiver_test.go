package docs

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemhttp/idemtest"
	"github.com/idemkit/idem/testpg"
)

// TestMain starts a throwaway PostgreSQL (or uses $IDEM_TEST_DATABASE_URL's).
func TestMain(m *testing.M) { testpg.Main(m) }

// newTestPool is the receiver's own test database: a fresh one for each
// test, with idem's migrations applied, and the receiver's table.
func newTestPool(t *testing.T) *pgxpool.Pool {
	pool := testpg.Pool(t, testpg.New(t), 24)
	if _, err := pool.Exec(context.Background(), `CREATE TABLE payments (invoice_id text PRIMARY KEY, cents bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return pool
}

// newWebhookHandler is the receiver under test: it books a Stripe
// invoice.paid event's payment (a relative write, on purpose: run twice,
// it would fail on the primary key, and the test would see it).
func newWebhookHandler(pool *pgxpool.Pool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var ev struct {
			Data struct {
				Object struct {
					ID         string `json:"id"`
					AmountPaid int64  `json:"amount_paid"`
				} `json:"object"`
			} `json:"data"`
		}
		if err := json.NewDecoder(r.Body).Decode(&ev); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		if _, err := pool.Exec(r.Context(), `INSERT INTO payments VALUES ($1, $2)`, ev.Data.Object.ID, ev.Data.Object.AmountPaid); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusOK)
	})
}

// TestStripeWebhookRunsOnce is the receiver test docs/http.md shows.
func TestStripeWebhookRunsOnce(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t) // your test database, with idem's migrations applied
	stripe := idemtest.Stripe("whsec_test")
	runs := idemtest.Count(newWebhookHandler(pool)) // the handler under test, counted
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	mw, err := idemhttp.New(idemhttp.Config{Client: c}.Apply(idemhttp.Stripe("whsec_test")))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(runs))
	defer srv.Close()

	ev := stripe.Event("invoice.paid", `{"id":"in_1","amount_paid":4200}`)
	idemtest.Fire(t, srv.URL, ev, 20) // 20 copies at once, each on its own connection
	if resp, _ := idemtest.Send(t, srv.URL, stripe.Redeliver(ev)); resp.Header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Fatalf("Stripe's retry was not answered from the stored response: %d", resp.StatusCode)
	}
	if resp, _ := idemtest.Send(t, srv.URL, stripe.Forge(ev)); resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("a forged delivery got %d", resp.StatusCode)
	}
	runs.AssertOnce(t, ev)
}
