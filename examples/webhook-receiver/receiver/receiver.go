// Package receiver is a realistic Stripe webhook receiver built on idem:
// idemhttp's Stripe preset verifies each delivery's signature, claims the
// event id and replays the stored answer to every duplicate; the
// invoice.paid handler behind it books the payment with an absolute upsert
// and sends the receipt email behind an idem key of its own (sent once).
package receiver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
)

// Event is the part of a Stripe event the receiver reads.
type Event struct {
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

// Mailer sends email. StubMailer records what it was asked to send.
type Mailer interface {
	Send(ctx context.Context, to, subject string) error
}

// Receiver handles invoice.paid events.
type Receiver struct {
	Pool *pgxpool.Pool
	Idem *idem.Client
	Mail Mailer
}

// Schema creates the receiver's table.
const Schema = `
CREATE TABLE IF NOT EXISTS payments (
    invoice_id   text PRIMARY KEY,
    customer     text NOT NULL,
    amount_cents integer NOT NULL,
    event_id     text NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT now()
)`

// Handler returns the receiver behind idemhttp's Stripe preset. secrets
// are the endpoint's signing secrets ("whsec_...", two while one is
// rolled): a delivery whose Stripe-Signature does not verify against one
// of them is refused (400 or 401) before anything is claimed, so a forged
// delivery carrying a genuine event id can never poison its key.
func (rc *Receiver) Handler(log *slog.Logger, secrets ...string) (http.Handler, error) {
	mw, err := idemhttp.New(idemhttp.Config{Client: rc.Idem, Logger: log}.Apply(idemhttp.Stripe(secrets...)))
	if err != nil {
		return nil, err
	}
	return mw(rc), nil
}

// ServeHTTP runs once per event: idemhttp has claimed the event id, answers
// every duplicate with the stored 2xx, and runs this again only after a
// non-2xx answer (the key is released and Stripe retries). Its context is
// detached from Stripe's connection, so a sender that hangs up does not
// stop a payment half-way.
func (rc *Receiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	var ev Event
	if err := json.NewDecoder(r.Body).Decode(&ev); err != nil {
		http.Error(w, "not a Stripe event", http.StatusBadRequest)
		return
	}
	if ev.Type != "invoice.paid" {
		w.WriteHeader(http.StatusOK) // not ours; acknowledge so Stripe stops
		return
	}
	inv := ev.Data.Object

	// 1. The payment: absolute, not relative (the invoice is paid with this
	//    amount), so a run repeated after a crash writes the same row.
	if _, err := rc.Pool.Exec(ctx, `
		INSERT INTO payments (invoice_id, customer, amount_cents, event_id)
		VALUES ($1, $2, $3, $4)
		ON CONFLICT (invoice_id) DO UPDATE SET amount_cents = EXCLUDED.amount_cents`,
		inv.ID, inv.Customer, inv.AmountPaid, ev.ID); err != nil {
		http.Error(w, "database unavailable", http.StatusServiceUnavailable)
		return
	}

	// 2. The email can't be taken back, so it gets a key of its own: if the
	//    send fails, the 500 makes Stripe redeliver, the payment above is
	//    written again (the same), and the email is sent at most once.
	_, err := rc.Idem.Do(ctx, "email", "receipt:"+inv.ID, func(ctx context.Context) (any, error) {
		return nil, rc.Mail.Send(ctx, inv.Email, fmt.Sprintf("Receipt for %s", inv.ID))
	})
	if err != nil && !errors.Is(err, idem.ErrInProgress) {
		http.Error(w, "email not sent yet", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{"received": true, "invoice": inv.ID})
}

// StubMailer records sends instead of sending. FailFirst makes the first
// send of a subject fail (a flaky SMTP relay).
type StubMailer struct {
	mu        sync.Mutex
	Sent      map[string]int // subject -> times sent
	FailFirst func(subject string) bool
	failed    map[string]bool
}

// Send records the mail.
func (m *StubMailer) Send(_ context.Context, to, subject string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.Sent == nil {
		m.Sent, m.failed = map[string]int{}, map[string]bool{}
	}
	if m.FailFirst != nil && m.FailFirst(subject) && !m.failed[subject] {
		m.failed[subject] = true
		return errors.New("smtp: 451 try again later")
	}
	m.Sent[subject]++
	return nil
}

// Setup creates the payments table.
func Setup(ctx context.Context, pool *pgxpool.Pool) error {
	_, err := pool.Exec(ctx, Schema)
	return err
}
