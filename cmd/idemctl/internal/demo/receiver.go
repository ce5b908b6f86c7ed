package demo

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
)

// The demo's receiver: the shape of examples/webhook-receiver (idemhttp's
// Stripe preset in front of an invoice.paid handler that books the payment
// and sends a receipt behind a key of its own), with the faults a storm
// needs: slow work and work that fails once. It is the demo's own so that
// idemctl does not depend on an example.

const paymentsSchema = `
CREATE TABLE IF NOT EXISTS payments (
    invoice_id   text PRIMARY KEY,
    customer     text NOT NULL,
    amount_cents integer NOT NULL,
    event_id     text NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT now()
)`

type stripeEvent struct {
	ID   string `json:"id"`
	Type string `json:"type"`
	Data struct {
		Object struct {
			ID         string `json:"id"`
			Customer   string `json:"customer"`
			AmountPaid int    `json:"amount_paid"`
			Email      string `json:"customer_email"`
		} `json:"object"`
	} `json:"data"`
}

// KeyTTL is how long the demo keeps its event keys: longer than a month, so
// that the event first seen at the end of last month is still known
// whatever the day of this month (the Stripe preset's own 7 days would
// forget it from the 8th on, and rightly run it again as a new event).
const KeyTTL = 40 * 24 * time.Hour

type receiver struct {
	pool     *pgxpool.Pool
	idem     *idem.Client
	mail     *stubMailer
	slow     func(eventID string) time.Duration
	failOnce func(eventID string) bool
	failed   sync.Map
}

// handler is the receiver behind idemhttp's Stripe preset: the middleware
// verifies the signature, claims the event id and replays the stored 2xx
// answer to every duplicate; anything else releases the key for Stripe's
// retry.
func (rc *receiver) handler(secret string, obs idemhttp.Observer, log *slog.Logger) (http.Handler, error) {
	mw, err := idemhttp.New(idemhttp.Config{Client: rc.idem, Observer: obs, Logger: log, TTL: KeyTTL}.Apply(idemhttp.Stripe(secret)))
	if err != nil {
		return nil, err
	}
	return mw(http.HandlerFunc(rc.serve)), nil
}

func (rc *receiver) serve(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context() // detached from the sender's connection by idemhttp
	var ev stripeEvent
	if err := json.NewDecoder(r.Body).Decode(&ev); err != nil {
		http.Error(w, "not a Stripe event", http.StatusBadRequest)
		return
	}
	inv := ev.Data.Object
	if d := rc.slow(ev.ID); d > 0 {
		time.Sleep(d)
	}
	if rc.failOnce(ev.ID) {
		if _, seen := rc.failed.LoadOrStore(ev.ID, true); !seen {
			http.Error(w, "payment ledger timed out", http.StatusInternalServerError)
			return
		}
	}
	// Absolute, not relative: a run repeated after a crash writes the same.
	if _, err := rc.pool.Exec(ctx, `
		INSERT INTO payments (invoice_id, customer, amount_cents, event_id) VALUES ($1, $2, $3, $4)
		ON CONFLICT (invoice_id) DO UPDATE SET amount_cents = EXCLUDED.amount_cents`,
		inv.ID, inv.Customer, inv.AmountPaid, ev.ID); err != nil {
		http.Error(w, "database unavailable", http.StatusServiceUnavailable)
		return
	}
	// The email cannot be taken back: an effect, run once per event, so a
	// rerun of this handler (after the email failed) never sends it again.
	if _, err := rc.idem.Effect(ctx, "send_receipt", func(ctx context.Context) (any, error) {
		return nil, rc.mail.send("Receipt for " + inv.ID)
	}); err != nil {
		http.Error(w, "email not sent yet", http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"received": true, "invoice": %q}`, inv.ID)
}

// stubMailer records sends; failFirst makes the first send of a subject
// fail (a flaky SMTP relay).
type stubMailer struct {
	mu        sync.Mutex
	sent      map[string]int
	failed    map[string]bool
	failFirst func(subject string) bool
}

func (m *stubMailer) send(subject string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.sent == nil {
		m.sent, m.failed = map[string]int{}, map[string]bool{}
	}
	if m.failFirst(subject) && !m.failed[subject] {
		m.failed[subject] = true
		return errors.New("smtp: 451 try again later")
	}
	m.sent[subject]++
	return nil
}
