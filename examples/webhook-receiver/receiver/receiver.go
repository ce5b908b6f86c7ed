// Package receiver is a realistic Stripe webhook receiver built on idem:
// idemhttp's Stripe preset verifies each delivery's signature, claims the
// event id and replays the stored answer to every duplicate; the
// invoice.paid handler behind it books the payment with an absolute upsert,
// then runs two side effects as idem effects, each once per event: it
// charges the platform fee with the payment provider, whose request carries
// the effect's deterministic Idempotency-Key, and emails the receipt.
package receiver

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"

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

// Receiver handles invoice.paid events: it books the payment, collects
// the platform fee with the payment provider and emails the receipt.
type Receiver struct {
	Pool *pgxpool.Pool
	Idem *idem.Client
	API  *API // the payment provider and the mail API
}

// FeeCents is the platform fee collected on an invoice of amount cents: 2%.
func FeeCents(amount int) int { return amount / 50 }

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
// stop a payment half-way, and it carries the event, for the effects.
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

	// 2. The fee: an effect, run once per event and its charge id stored;
	//    the call carries the effect's Idempotency-Key (idemhttp.Transport),
	//    the same on every attempt, so a charge whose answer was lost is
	//    answered by the provider on the retry instead of made twice.
	charge, err := idem.EffectValue(ctx, rc.Idem, "charge_fee", func(ctx context.Context) (string, error) {
		return rc.API.Charge(ctx, inv.Customer, FeeCents(inv.AmountPaid), inv.ID)
	})
	if err != nil {
		http.Error(w, "fee not charged yet", http.StatusServiceUnavailable)
		return
	}

	// 3. The receipt: an effect too, so a later failure re-running this
	//    handler never mails again (also long after the mail API has
	//    forgotten the key).
	if _, err := rc.Idem.Effect(ctx, "send_receipt", func(ctx context.Context) (any, error) {
		return rc.API.SendEmail(ctx, inv.Email, fmt.Sprintf("Receipt for %s (fee %s)", inv.ID, charge), inv.ID)
	}); err != nil {
		http.Error(w, "receipt not sent yet", http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{"received": true, "invoice": inv.ID, "fee": charge})
}

// Setup creates the payments table.
func Setup(ctx context.Context, pool *pgxpool.Pool) error {
	_, err := pool.Exec(ctx, Schema)
	return err
}
