package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// A webhook handler: the work runs once however often the event arrives.
func ExampleClient_Do() {
	ctx := context.Background()
	pool, done := testdb.ExamplePool()
	defer done()
	c, err := idem.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}

	for delivery := 1; delivery <= 3; delivery++ {
		res, err := c.Do(ctx, "stripe", "evt_1NG8Du2eZvKYlo2C", func(ctx context.Context) (any, error) {
			fmt.Println("charging the customer")
			return map[string]any{"charged": 4200}, nil
		})
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("delivery %d: result %s, replayed %v\n", delivery, res.Result, res.Replayed)
	}
	// Output:
	// charging the customer
	// delivery 1: result {"charged": 4200}, replayed false
	// delivery 2: result {"charged": 4200}, replayed true
	// delivery 3: result {"charged": 4200}, replayed true
}

// DoValue: typed work, the same value for the delivery that ran it and for
// every duplicate (decoded from the stored result each time).
func ExampleDoValue() {
	ctx := context.Background()
	pool, done := testdb.ExamplePool()
	defer done()
	c, err := idem.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}

	type booking struct {
		Invoice string `json:"invoice"`
		Cents   int    `json:"cents"`
	}
	for delivery := 1; delivery <= 2; delivery++ {
		b, err := idem.DoValue(ctx, c, "stripe", "evt_3PqT", func(ctx context.Context) (booking, error) {
			fmt.Println("booking the payment")
			return booking{Invoice: "in_1", Cents: 4200}, nil
		})
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("delivery %d: %+v\n", delivery, b)
	}
	// Output:
	// booking the payment
	// delivery 1: {Invoice:in_1 Cents:4200}
	// delivery 2: {Invoice:in_1 Cents:4200}
}

// Claim, do the work, complete: the protocol step by step, with what a
// duplicate sees at each point.
func ExampleClient_Claim() {
	ctx := context.Background()
	pool, done := testdb.ExamplePool()
	defer done()
	c, err := idem.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}

	first, _ := c.Claim(ctx, "github", "72d3162e-cc78-11e3-81ab-4c9367dc0958", idem.WithLease(30*time.Second))
	fmt.Println("first delivery:", first.Outcome, "attempt", first.Attempt)

	dup, _ := c.Claim(ctx, "github", "72d3162e-cc78-11e3-81ab-4c9367dc0958")
	fmt.Println("duplicate while working:", dup.Outcome)

	_ = c.Complete(ctx, "github", "72d3162e-cc78-11e3-81ab-4c9367dc0958", first.Token, json.RawMessage(`{"status":200}`))
	dup, _ = c.Claim(ctx, "github", "72d3162e-cc78-11e3-81ab-4c9367dc0958")
	fmt.Println("duplicate after completion:", dup.Outcome, string(dup.Result))

	// The first worker's token is spent; it cannot complete twice with
	// another result, and a stranger's token is refused.
	err = c.Complete(ctx, "github", "72d3162e-cc78-11e3-81ab-4c9367dc0958", first.Token+1, nil)
	fmt.Println("complete with a stale token:", errors.Is(err, idem.ErrStaleToken))
	// Output:
	// first delivery: acquired attempt 1
	// duplicate while working: in_progress
	// duplicate after completion: completed {"status": 200}
	// complete with a stale token: true
}

// Exactly-once database effects: claim inside the transaction that writes
// the business data, so both commit or neither does.
func ExampleClient_WithTx() {
	ctx := context.Background()
	pool, done := testdb.ExamplePool()
	defer done()
	if _, err := pool.Exec(ctx, `CREATE TABLE payments (event_id text PRIMARY KEY, amount int)`); err != nil {
		log.Fatal(err)
	}
	c, err := idem.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}

	handle := func(eventID string, amount int) error {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx)
		_, err = c.WithTx(tx).Do(ctx, "stripe", eventID, func(ctx context.Context) (any, error) {
			_, err := tx.Exec(ctx, `INSERT INTO payments VALUES ($1, $2)`, eventID, amount)
			return nil, err
		})
		if err != nil {
			return err
		}
		return tx.Commit(ctx)
	}
	for range 3 {
		if err := handle("evt_42", 1500); err != nil {
			log.Fatal(err)
		}
	}
	var n, total int
	_ = pool.QueryRow(ctx, `SELECT count(*), sum(amount) FROM payments`).Scan(&n, &total)
	fmt.Println("payments:", n, "total:", total)
	// Output:
	// payments: 1 total: 1500
}

// Keys for operations that have no provider event id.
func ExampleHashKey() {
	a, _ := idem.HashKey(map[string]any{"user": 7, "cart": "c-19", "total": 12.50})
	b, _ := idem.HashKey(map[string]any{"total": 12.50, "cart": "c-19", "user": 7})
	fmt.Println(a == b, len(a))

	t := time.Date(2026, 11, 22, 10, 0, 5, 0, time.UTC)
	tap1, _ := idem.BucketedKey(map[string]any{"form": "signup", "email": "a@b.c"}, t, time.Minute)
	tap2, _ := idem.BucketedKey(map[string]any{"form": "signup", "email": "a@b.c"}, t.Add(20*time.Second), time.Minute)
	later, _ := idem.BucketedKey(map[string]any{"form": "signup", "email": "a@b.c"}, t.Add(2*time.Minute), time.Minute)
	fmt.Println(tap1 == tap2, tap1 == later)
	// Output:
	// true 64
	// true false
}

// Side effects inside an event's work: the receipt email runs once however
// often the event's work runs, and a re-run gets the stored result of the
// charge instead of charging again.
func ExampleClient_Effect() {
	ctx := context.Background()
	pool, done := testdb.ExamplePool()
	defer done()
	c, err := idem.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}

	for run := 1; run <= 3; run++ {
		_, err := c.Do(ctx, "stripe", "evt_1Q", func(ctx context.Context) (any, error) {
			charge, err := idem.EffectValue(ctx, c, "charge", func(ctx context.Context) (string, error) {
				fmt.Println("  charging the card")
				return "ch_3MmlLr", nil
			})
			if err != nil {
				return nil, err
			}
			if _, err := c.Effect(ctx, "send_receipt", func(ctx context.Context) (any, error) {
				fmt.Println("  emailing the receipt for", charge)
				return nil, nil
			}); err != nil {
				return nil, err
			}
			if run < 3 {
				return nil, errors.New("booking failed; the sender will retry")
			}
			fmt.Println("  booked", charge)
			return charge, nil
		})
		fmt.Printf("run %d: err=%v\n", run, err)
	}
	// Output:
	//   charging the card
	//   emailing the receipt for ch_3MmlLr
	// run 1: err=booking failed; the sender will retry
	// run 2: err=booking failed; the sender will retry
	//   booked ch_3MmlLr
	// run 3: err=<nil>
}

// The key of an outbound call is derived from the event, the effect and
// the call, never from the attempt: a retry after a crash sends the same
// key, and the provider answers it without charging twice.
func ExampleEffect_OutboundKey() {
	ctx := context.Background()
	pool, done := testdb.ExamplePool()
	defer done()
	c, err := idem.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}

	ev, err := c.Claim(ctx, "stripe", "evt_1Q")
	if err != nil {
		log.Fatal(err)
	}
	_, err = c.Effect(idem.WithEvent(ctx, ev), "charge", func(ctx context.Context) (any, error) {
		eff, _ := idem.EffectFrom(ctx)
		fmt.Println("effect", eff.Name, "attempt", eff.Attempt, "key", eff.Key)
		fmt.Println("Idempotency-Key:", eff.OutboundKey("POST /v1/charges"))
		return nil, nil
	})
	if err != nil {
		log.Fatal(err)
	}
	// The same key, computed anywhere, any time:
	fmt.Println("Idempotency-Key:", idem.Effect{EventSource: "stripe", EventKey: "evt_1Q", Name: "charge"}.OutboundKey("POST /v1/charges"))
	// Output:
	// effect charge attempt 1 key charge/evt_1Q
	// Idempotency-Key: 1eb32150bed823ca383130c8b5add38723af507058a6f0d1d608837f063d052d
	// Idempotency-Key: 1eb32150bed823ca383130c8b5add38723af507058a6f0d1d608837f063d052d
}

// A queue consumer: a fetched batch is claimed in one call, the acquired
// messages' effects are written in one transaction with the claims and the
// completions, and every message whose outcome is final is acknowledged; a
// redelivered batch replays without running the work.
func ExampleClient_DoBatch() {
	ctx := context.Background()
	pool, done := testdb.ExamplePool()
	defer done()
	c, err := idem.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS public.orders (id text PRIMARY KEY)`); err != nil {
		log.Fatal(err)
	}

	batch := []idem.BatchItem{{Key: "msg-1"}, {Key: "msg-2"}, {Key: "msg-1"}} // msg-1 delivered twice
	for delivery := 1; delivery <= 2; delivery++ {
		tx, err := pool.Begin(ctx)
		if err != nil {
			log.Fatal(err)
		}
		res, err := c.WithTx(tx).DoBatch(ctx, "orders", batch, func(ctx context.Context, acquired []*idem.Claim) ([]idem.WorkResult, error) {
			out := make([]idem.WorkResult, len(acquired))
			for i, cl := range acquired {
				if _, err := tx.Exec(ctx, `INSERT INTO public.orders (id) VALUES ($1)`, cl.Key); err != nil {
					return nil, err
				}
				out[i].Value = "stored " + cl.Key
			}
			return out, nil
		})
		if err != nil {
			_ = tx.Rollback(ctx)
			log.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			log.Fatal(err)
		}
		for i, r := range res {
			switch {
			case r.Err == nil: // done now or before: acknowledge
				fmt.Printf("delivery %d, %s: ack %s (replayed %v)\n", delivery, batch[i].Key, r.Result.Result, r.Replayed)
			case errors.Is(r.Err, idem.ErrInProgress): // another copy is in flight: redeliver later
				fmt.Printf("delivery %d, %s: nak\n", delivery, batch[i].Key)
			default:
				fmt.Printf("delivery %d, %s: %v\n", delivery, batch[i].Key, r.Err)
			}
		}
	}
	// Output:
	// delivery 1, msg-1: ack "stored msg-1" (replayed false)
	// delivery 1, msg-2: ack "stored msg-2" (replayed false)
	// delivery 1, msg-1: nak
	// delivery 2, msg-1: ack "stored msg-1" (replayed true)
	// delivery 2, msg-2: ack "stored msg-2" (replayed true)
	// delivery 2, msg-1: ack "stored msg-1" (replayed true)
}
