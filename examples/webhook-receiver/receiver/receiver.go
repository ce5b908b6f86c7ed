// Package receiver is a realistic Stripe-style webhook receiver built on
// idem: an invoice.paid handler that records the payment in the same
// transaction as the claim (an exactly-once database effect) and sends a
// confirmation email behind a key of its own (sent once).
package receiver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"time"

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

// Receiver handles POST /webhooks/stripe.
type Receiver struct {
	// Secrets are the endpoint's signing secrets ("whsec_...", two while
	// one is rolled). A delivery whose Stripe-Signature does not verify
	// against one of them is refused before anything is claimed.
	Secrets []string
	Pool    *pgxpool.Pool
	Idem    *idem.Client
	Mail    Mailer
	Log     *slog.Logger
	// Chaos, when set, slows or fails the work on purpose (the demo's storm).
	Chaos *Chaos
}

// Chaos injects the faults a real receiver meets.
type Chaos struct {
	Slow     func(eventID string) time.Duration // work that takes a while
	FailOnce func(eventID string) bool          // work that fails once, then succeeds
	failed   sync.Map
}

func (c *Chaos) apply(ctx context.Context, eventID string) error {
	if c == nil {
		return nil
	}
	if c.Slow != nil {
		if d := c.Slow(eventID); d > 0 {
			select {
			case <-time.After(d):
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	}
	if c.FailOnce != nil && c.FailOnce(eventID) {
		if _, seen := c.failed.LoadOrStore(eventID, true); !seen {
			return errors.New("payment ledger timed out")
		}
	}
	return nil
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

func (rc *Receiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// Detached from the request: Stripe hangs up after about 10 seconds,
	// and work that has started (a payment, an email) must finish and be
	// recorded anyway, or Stripe's retry would do it again. The receiver's
	// own deadline bounds it instead.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), time.Minute)
	defer cancel()
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 1<<20))
	if err != nil {
		http.Error(w, "body too large", http.StatusRequestEntityTooLarge)
		return
	}
	// 0. Is it Stripe? Verified before anything is claimed, so a forged
	//    delivery carrying a genuine event id can never poison its key.
	if err := idemhttp.StripeVerifier(idemhttp.DefaultTolerance, rc.Secrets...)(r, body); err != nil {
		status := http.StatusUnauthorized
		if errors.Is(err, idemhttp.ErrSignatureMissing) {
			status = http.StatusBadRequest
		}
		http.Error(w, "signature verification failed", status)
		return
	}
	var ev Event
	if err := json.Unmarshal(body, &ev); err != nil || ev.ID == "" {
		http.Error(w, "not a Stripe event", http.StatusBadRequest)
		return
	}
	if ev.Type != "invoice.paid" {
		w.WriteHeader(http.StatusOK) // not ours; acknowledge so Stripe stops
		return
	}
	inv := ev.Data.Object

	// 1. The payment: claim and write in one transaction. A duplicate waits
	//    for the first delivery's transaction, then replays its result.
	tx, err := rc.Pool.Begin(ctx)
	if err != nil {
		http.Error(w, "database unavailable", http.StatusServiceUnavailable)
		return
	}
	defer tx.Rollback(ctx)
	res, err := rc.Idem.WithTx(tx).Do(ctx, "stripe", ev.ID, func(ctx context.Context) (any, error) {
		if err := rc.Chaos.apply(ctx, ev.ID); err != nil {
			return nil, err
		}
		// Absolute, not relative: the invoice is paid with this amount.
		_, err := tx.Exec(ctx, `
			INSERT INTO payments (invoice_id, customer, amount_cents, event_id)
			VALUES ($1, $2, $3, $4)
			ON CONFLICT (invoice_id) DO UPDATE SET amount_cents = EXCLUDED.amount_cents`,
			inv.ID, inv.Customer, inv.AmountPaid, ev.ID)
		return map[string]any{"invoice": inv.ID, "status": "recorded"}, err
	}, idem.WithFingerprint(idem.Fingerprint(body)), idem.WithEventType(ev.Type))
	switch {
	case errors.Is(err, idem.ErrMismatch):
		http.Error(w, "event id reused with a different payload", http.StatusUnprocessableEntity)
		return
	case err != nil:
		// The failure was recorded in tx: commit it so the redelivery
		// re-runs the work (attempt 2). Stripe retries on any non-2xx.
		_ = tx.Commit(ctx)
		rc.log().LogAttrs(ctx, slog.LevelWarn, "payment failed; Stripe will retry", slog.String("event", ev.ID), slog.Any("error", err))
		http.Error(w, "temporary failure", http.StatusInternalServerError)
		return
	}
	if err := tx.Commit(ctx); err != nil {
		http.Error(w, "commit failed", http.StatusServiceUnavailable)
		return
	}

	// 2. The side effect: an email can't be rolled back, so it gets a key
	//    of its own, claimed only after the payment committed. Whoever
	//    acquires it sends; everyone else sees it done (or in flight).
	_, err = rc.Idem.Do(ctx, "email", "receipt:"+inv.ID, func(ctx context.Context) (any, error) {
		return nil, rc.Mail.Send(ctx, inv.Email, fmt.Sprintf("Receipt for %s", inv.ID))
	})
	if err != nil && !errors.Is(err, idem.ErrInProgress) {
		// Released for a retry: ask Stripe to redeliver; the payment part
		// will replay and the email will be tried again.
		http.Error(w, "email not sent yet", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{"received": true, "replayed": res.Replayed})
}

func (rc *Receiver) log() *slog.Logger {
	if rc.Log != nil {
		return rc.Log
	}
	return slog.Default()
}

// StubMailer records sends instead of sending. FailFirst makes the first
// send to each address fail (a flaky SMTP relay).
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
