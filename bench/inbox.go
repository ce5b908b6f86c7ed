package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/inbox"
)

// benchInbox: the inbox's accept (claim + River InsertTx in one
// transaction) against a synchronous claim, and end-to-end events/s (accept
// and process) against bare River jobs (insert and work, no idem).
func benchInbox(ctx context.Context, e *env, o options, t *table) error {
	if _, err := inbox.Migrate(ctx, e.pool, ""); err != nil {
		return err
	}
	var handled atomic.Int64
	in, err := inbox.New(inbox.Config{Pool: e.pool, Queue: "bench_inbox", Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
		handled.Add(1)
		return nil, nil
	}})
	if err != nil {
		return err
	}
	c, err := idem.New(e.pool, nil)
	if err != nil {
		return err
	}
	payload := []byte(`{"id":"evt_bench","type":"invoice.paid","data":{"object":{"amount_paid":4200}}}`)
	const clients = 8
	accept := func(ctx context.Context, _ int, _ int64) error {
		_, err := in.Accept(ctx, &inbox.Delivery{Source: "bench-inbox", Key: newKey(), Payload: payload})
		return err
	}
	claim := func(ctx context.Context, _ int, _ int64) error {
		_, err := c.Claim(ctx, "bench-sync", newKey())
		return err
	}
	cmp, err := interleave(ctx, o.rounds, clients, o.duration, accept, claim)
	if err != nil {
		return err
	}
	t.throughputRow("inbox", fmt.Sprintf("accept (claim + InsertTx, one transaction) vs a synchronous claim, %d clients", clients), cmp, "information: the price of answering first")
	// The accepted events are held for their jobs: release both, or the
	// worker client's Repair would (rightly) dead-letter every one whose
	// job is gone, inside the end-to-end rounds below.
	if _, err := e.pool.Exec(ctx, `DELETE FROM idem.holds WHERE source = 'bench-inbox';
	                               DELETE FROM river_job WHERE queue = 'bench_inbox'`); err != nil {
		return err
	}

	// End to end: n events accepted by 8 clients while a worker client
	// (50 workers) processes them; against the same n bare River jobs.
	n := 2000
	if o.full {
		n = 10000
	}
	var ratios, idemRates, riverRates []float64
	for range o.rounds {
		handled.Store(0)
		wc, err := in.NewWorkerClient(0, &river.Config{Logger: quietLogger()}) // as many as the pool serves
		if err != nil {
			return err
		}
		idemRate, err := endToEnd(ctx, wc, n, func(ctx context.Context, i int) error { return accept(ctx, i, 0) },
			func() int64 { return handled.Load() })
		if err != nil {
			return err
		}
		var worked atomic.Int64
		workers := river.NewWorkers()
		river.AddWorker(workers, river.WorkFunc(func(ctx context.Context, job *river.Job[bareArgs]) error {
			worked.Add(1)
			return nil
		}))
		bare, err := river.NewClient(riverpgxv5.New(e.pool), &river.Config{Logger: quietLogger(), Workers: workers,
			Queues: map[string]river.QueueConfig{"bench_bare": {MaxWorkers: 50}}})
		if err != nil {
			return err
		}
		riverRate, err := endToEnd(ctx, bare, n, func(ctx context.Context, i int) error {
			return pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
				_, err := bare.InsertTx(ctx, tx, bareArgs{Payload: payload}, &river.InsertOpts{Queue: "bench_bare"})
				return err
			})
		}, func() int64 { return worked.Load() })
		if err != nil {
			return err
		}
		idemRates, riverRates, ratios = append(idemRates, idemRate), append(riverRates, riverRate), append(ratios, idemRate/riverRate)
	}
	t.add(row{section: "inbox", metric: fmt.Sprintf("end to end: %d events accepted (8 clients) and processed (50 workers) vs bare River jobs", n),
		idem: fmt.Sprintf("%.0f events/s", median(idemRates)), baseline: fmt.Sprintf("%.0f jobs/s", median(riverRates)),
		ratio: median(ratios), spread: spread(ratios), target: "information"})
	return nil
}

type bareArgs struct {
	Payload []byte `json:"payload"`
}

func (bareArgs) Kind() string { return "bench_bare" }

// endToEnd starts the client, inserts n events from 8 goroutines, and
// returns events/s from the first insert until done() reaches n.
func endToEnd(ctx context.Context, rc *river.Client[pgx.Tx], n int, insert func(context.Context, int) error, done func() int64) (float64, error) {
	if err := rc.Start(ctx); err != nil {
		return 0, err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		_ = rc.Stop(sctx)
	}()
	start := time.Now()
	var next atomic.Int64
	var wg sync.WaitGroup
	var first error
	var mu sync.Mutex
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1)); i <= n; i = int(next.Add(1)) {
				if err := insert(ctx, i); err != nil {
					mu.Lock()
					first = err
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	if first != nil {
		return 0, first
	}
	for deadline := time.Now().Add(5 * time.Minute); done() < int64(n); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("only %d of %d processed after 5 minutes", done(), n)
		}
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// quietLogger keeps River's own log to errors.
func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
}
