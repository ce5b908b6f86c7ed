package docs

// The Go blocks of README.md and docs/, each in a function that is compiled
// and never run (TestCodeBlocks checks that each block is here, line for
// line). What a block takes for granted (a handler, a secret, the event
// being handled, the application's own functions) is declared below.

import (
	"context"
	"errors"
	"log"
	"net/http"
	"net/netip"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/inbox"
)

// What the blocks take for granted.
var (
	secret    string
	handler   http.Handler
	myHandler http.Handler
	event     struct{ ID string }
	inv       string
	amt       int64
	fee       int64
	customer  string
	payments  struct {
		Charge func(ctx context.Context, args ...any) (string, error)
	}
	mail, mailer struct {
		Send func(ctx context.Context, msg string) error
	}
)

func chargeCustomer(context.Context, any) (any, error)          { return nil, nil }
func receiptFor(string) string                                  { return "" }
func receipt(string) string                                     { return "" }
func book(context.Context, pgx.Tx, []byte) error                { return nil }
func useAll(...any)                                             {}
func _(ctx context.Context, pool *pgxpool.Pool, c *idem.Client) { readmeInbox(ctx, pool, c) }
func _(ctx context.Context, w http.ResponseWriter)              { readmeDo(ctx, w) }
func _(ctx context.Context, pool *pgxpool.Pool, c *idem.Client) { readmeTx(ctx, pool, c) }
func _(ctx context.Context, c *idem.Client)                     { readmeEffects(ctx, c) }
func _(ctx context.Context, c *idem.Client)                     { effectsDoc(ctx, c) }
func _(ctx context.Context)                                     { httpDoc(ctx) }
func _(ctx context.Context, pool *pgxpool.Pool, c *idem.Client) { inboxDoc(ctx, pool, c) }
func _(ctx context.Context, pool *pgxpool.Pool, c *idem.Client) { inboxDocSplit(ctx, pool, c) }
func _(ctx context.Context, pool *pgxpool.Pool, c *idem.Client) { inboxDocHandler(ctx, pool, c) }
func _(c *idem.Client)                                          { sendersDoc(c, "", "", nil, nil) }
func _(c *idem.Client)                                          { sendersTwilioDoc(c, "") }

// README.md, "Use it from Go".
func readmeDo(ctx context.Context, w http.ResponseWriter) {
	pool, _ := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	c, err := idem.New(pool, nil)
	if err != nil {
		log.Fatal(err) // a Config out of range is found here, at start-up
	}

	res, err := c.Do(ctx, "stripe", event.ID, func(ctx context.Context) (any, error) {
		return chargeCustomer(ctx, event) // runs once per event id
	})
	// Once the work ran, its outcome is recorded even if ctx was cancelled (the
	// sender hung up): a duplicate is answered from it, never runs it again.
	switch {
	case errors.Is(err, idem.ErrInProgress):
		w.Header().Set("Retry-After", "5")
		w.WriteHeader(http.StatusConflict)
	case errors.Is(err, idem.ErrMismatch):
		w.WriteHeader(http.StatusUnprocessableEntity)
	case err != nil:
		w.WriteHeader(http.StatusInternalServerError) // released: the sender's retry runs it again
	default:
		w.Write(res.Result) // the stored result (jsonb's text form): the same bytes for the first delivery and every duplicate
	}
}

// README.md, in the caller's transaction.
func readmeTx(ctx context.Context, pool *pgxpool.Pool, c *idem.Client) {
	tx, _ := pool.Begin(ctx)
	defer tx.Rollback(ctx)
	_, err := c.WithTx(tx).Do(ctx, "stripe", event.ID, func(ctx context.Context) (any, error) {
		_, err := tx.Exec(ctx, `INSERT INTO payments (invoice_id, amount) VALUES ($1, $2)
		                        ON CONFLICT (invoice_id) DO UPDATE SET amount = EXCLUDED.amount`, inv, amt)
		return nil, err
	})
	if err == nil {
		err = tx.Commit(ctx)
	}
}

// README.md, the inbox.
func readmeInbox(ctx context.Context, pool *pgxpool.Pool, c *idem.Client) {
	in, _ := inbox.New(inbox.Config{Pool: pool})
	stripe, _ := in.HTTP(idemhttp.Config{Client: c}.Apply(idemhttp.Stripe(secret)), handler) // verify, accept, 202; the worker runs handler
	http.Handle("POST /webhooks/stripe", stripe)
	workers, _ := in.NewWorkerClient(0, nil) // River: retries, dead letter, rescue; as many handlers as the pool serves
	_ = workers.Start(ctx)
}

// README.md, effects.
func readmeEffects(ctx context.Context, c *idem.Client) {
	rt, err := idemhttp.NewTransport(nil, nil) // keys POST and PATCH inside effects
	api := &http.Client{Transport: rt}
	res, err := c.Do(ctx, "stripe", event.ID, func(ctx context.Context) (any, error) {
		chargeID, err := idem.EffectValue(ctx, c, "charge_fee", func(ctx context.Context) (string, error) {
			return payments.Charge(ctx, api, fee) // same Idempotency-Key on every attempt
		})
		if err != nil {
			return nil, err
		}
		_, err = c.Effect(ctx, "send_receipt", func(ctx context.Context) (any, error) {
			return nil, mail.Send(ctx, receiptFor(chargeID)) // once per event
		})
		return chargeID, err
	})
	useAll(res, err)
}

// README.md's migrations from Go is a whole program: docs/snippets/migrateup.

// README.md, River's migrations for the inbox.
func readmeMigrateInbox(ctx context.Context, pool *pgxpool.Pool) error {
	versions, err := inbox.Migrate(ctx, pool, "") // River's migrations ("" = the search_path), then GrantRiver
	useAll(versions)
	return err
}

// docs/effects.md.
func effectsDoc(ctx context.Context, c *idem.Client) {
	res, err := c.Do(ctx, "stripe", event.ID, func(ctx context.Context) (any, error) {
		// Business writes: absolute, or in the event's transaction (below).
		charge, err := idem.EffectValue(ctx, c, "charge_fee", func(ctx context.Context) (string, error) {
			return payments.Charge(ctx, customer, fee) // POST through idemhttp.Transport: keyed
		})
		if err != nil {
			return nil, err // the event is retried; the charge is replayed, not made again
		}
		_, err = c.Effect(ctx, "send_receipt", func(ctx context.Context) (any, error) {
			return nil, mailer.Send(ctx, receipt(charge))
		})
		return charge, err
	})
	useAll(res, err)
}

// docs/http.md.
func httpDoc(ctx context.Context) {
	pool, _ := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	c, err := idem.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	mw, err := idemhttp.New(idemhttp.Config{Client: c}.
		Apply(idemhttp.Stripe(os.Getenv("STRIPE_WEBHOOK_SECRET"))))
	http.Handle("POST /webhooks/stripe", mw(myHandler))
	useAll(err)
}

// userKey is where docs/http.md's authentication middleware puts the user.
type userKey struct{}

// docs/http.md, per-client scope.
func scopeDoc(c *idem.Client) {
	mw, err := idemhttp.New(idemhttp.Config{Client: c, Source: "orders",
		Scope: func(r *http.Request) (string, error) {
			user, ok := r.Context().Value(userKey{}).(string) // set by your authentication middleware
			if !ok {
				return "", idemhttp.ErrNoPrincipal
			}
			return user, nil
		}})
	http.Handle("POST /orders", mw(myHandler))
	useAll(err)
}

// docs/senders.md, one endpoint per source.
func sendersDoc(c *idem.Client, billingSecret, connectSecret string, billingHandler, connectHandler http.Handler) {
	billing, err := idemhttp.New(idemhttp.Config{Client: c, Source: "stripe-billing"}.Apply(idemhttp.Stripe(billingSecret)))
	connect, err := idemhttp.New(idemhttp.Config{Client: c, Source: "stripe-connect"}.Apply(idemhttp.Stripe(connectSecret)))
	http.Handle("POST /webhooks/stripe/billing", billing(billingHandler))
	http.Handle("POST /webhooks/stripe/connect", connect(connectHandler))
	useAll(err)
}

// docs/senders.md, URLs the sender signs.
func sendersTwilioDoc(c *idem.Client, authToken string) {
	mw, err := idemhttp.New(idemhttp.Config{Client: c}.Apply(
		idemhttp.Twilio(idemhttp.PublicURL{TrustedProxies: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}, authToken)))
	useAll(mw, err)
}

// docs/inbox.md, the setup.
func inboxDoc(ctx context.Context, pool *pgxpool.Pool, c *idem.Client) {
	in, err := inbox.New(inbox.Config{Pool: pool})
	// One process, both sides: verify, accept and answer 202 (web side), and
	// run handler (the http.Handler a synchronous middleware would wrap) for
	// stripe's events (worker side).
	stripe, err := in.HTTP(idemhttp.Config{Client: c}.Apply(idemhttp.Stripe(secret)), handler)
	http.Handle("POST /webhooks/stripe", stripe)
	// As many handlers at once as the pool serves (see "Sizing the pool").
	workers, err := in.NewWorkerClient(0, nil) // a River client working the inbox queue
	err = workers.Start(ctx)
	useAll(err)
}

// docs/inbox.md, separate web and worker processes.
func inboxDocSplit(ctx context.Context, pool *pgxpool.Pool, c *idem.Client) {
	// The web process: verify, accept, answer 202. It routes nothing.
	in, err := inbox.New(inbox.Config{Pool: pool})
	stripe, err := in.Middleware(idemhttp.Config{Client: c}.Apply(idemhttp.Stripe(secret)))
	http.Handle("POST /webhooks/stripe", stripe(http.NotFoundHandler()))

	// The worker process: run handler for stripe's events. No HTTP server.
	worker, err := inbox.New(inbox.Config{Pool: pool})
	err = worker.HandleHTTP("stripe", handler)
	workers, err := worker.NewWorkerClient(0, nil)
	err = workers.Start(ctx)
	useAll(err)
}

// docs/inbox.md, a handler in the job's transaction.
func inboxDocHandler(ctx context.Context, pool *pgxpool.Pool, c *idem.Client) {
	in, err := inbox.New(inbox.Config{
		Pool:        pool,
		MaxAttempts: map[string]int{"stripe": 8}, // then dead-lettered; default 10
		Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
			// Runs in a River worker, under the delivery's claim. Write in tx:
			// it commits with the key's and the job's completion. Effects
			// (idem.Client.Effect) run once however often this runs.
			return nil, book(ctx, tx, d.Payload)
		},
	})
	mw, err := idemhttp.New(idemhttp.Config{Client: c, Async: in}.Apply(idemhttp.Stripe(secret)))
	http.Handle("POST /webhooks/stripe", mw(http.NotFoundHandler())) // the inbox runs Handler, not this
	useAll(ctx, err)
}
