// Package demo is the quick start's storm: a Stripe-style invoice.paid
// handler receives every event several times at once, some deliveries slow,
// some failing and retried by the sender, and the checks at the end prove
// that each payment was booked once and each confirmation email sent once.
package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
)

// Config sizes the storm. Zero fields take the defaults in brackets.
type Config struct {
	Events     int     // distinct events [300]
	Deliveries int     // deliveries of each event, concurrently [4]
	Workers    int     // concurrent handlers [16]
	FlakyRate  float64 // share of events whose first run fails (retryable) [0.1]
	SlowRate   float64 // share of runs that take SlowFor [0.05]
	SlowFor    time.Duration
	Schema     string // schema for the demo's own tables [idem_demo]
	Source     string // idem source name [stripe-demo]
}

func (c *Config) defaults() {
	if c.Events == 0 {
		c.Events = 300
	}
	if c.Deliveries == 0 {
		c.Deliveries = 4
	}
	if c.Workers == 0 {
		c.Workers = 16
	}
	if c.FlakyRate == 0 {
		c.FlakyRate = 0.1
	}
	if c.SlowRate == 0 {
		c.SlowRate = 0.05
	}
	if c.SlowFor == 0 {
		c.SlowFor = 150 * time.Millisecond
	}
	if c.Schema == "" {
		c.Schema = "idem_demo"
	}
	if c.Source == "" {
		c.Source = "stripe-demo"
	}
}

// Report is what happened.
type Report struct {
	Events, Deliveries, Retries int
	Acquired, Replayed, Waited  int64
	FailedRuns                  int64
	EmailsSent, DuplicateEmails int
	Payments                    int
	BalancesOK                  bool
	StillProcessing             int
	Elapsed                     time.Duration
	Checks                      []Check
}

// Check is one assertion of the demo.
type Check struct {
	Name string
	OK   bool
	Got  string
}

// OK reports whether every check passed.
func (r *Report) OK() bool {
	for _, c := range r.Checks {
		if !c.OK {
			return false
		}
	}
	return len(r.Checks) > 0
}

// Print writes the report for a person.
func (r *Report) Print(w io.Writer) {
	fmt.Fprintf(w, "\nstorm: %d events x %d deliveries = %d deliveries (+%d sender retries) in %s\n",
		r.Events, r.Deliveries/r.Events, r.Deliveries, r.Retries, r.Elapsed.Round(time.Millisecond))
	fmt.Fprintf(w, "  work ran (acquired):        %d (%d of them failed and were retried)\n", r.Acquired, r.FailedRuns)
	fmt.Fprintf(w, "  duplicates absorbed:        %d replayed + %d waited for the first delivery\n", r.Replayed, r.Waited)
	fmt.Fprintf(w, "  payments booked:            %d\n", r.Payments)
	fmt.Fprintf(w, "  confirmation emails sent:   %d (duplicates: %d)\n", r.EmailsSent, r.DuplicateEmails)
	fmt.Fprintln(w, "\nchecks:")
	for _, c := range r.Checks {
		mark := "PASS"
		if !c.OK {
			mark = "FAIL"
		}
		fmt.Fprintf(w, "  [%s] %s (%s)\n", mark, c.Name, c.Got)
	}
}

// mailer is the stub transport: it records what was sent.
type mailer struct {
	mu   sync.Mutex
	sent map[string]int
}

func (m *mailer) send(invoice string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.sent[invoice]++
}

type event struct {
	id, invoice, customer string
	amount                int
	flaky                 bool
}

var errFlaky = errors.New("payment processor timed out")

// Run creates the demo tables in cfg.Schema, runs the storm against pool
// (idem's migrations must be applied) and checks the outcome.
func Run(ctx context.Context, pool *pgxpool.Pool, cfg Config) (*Report, error) {
	cfg.defaults()
	schema := pgx.Identifier{cfg.Schema}.Sanitize()
	if _, err := pool.Exec(ctx, fmt.Sprintf(`
		CREATE SCHEMA IF NOT EXISTS %[1]s;
		DROP TABLE IF EXISTS %[1]s.payments;
		CREATE TABLE %[1]s.payments (
			invoice_id   text PRIMARY KEY,
			customer     text NOT NULL,
			amount_cents integer NOT NULL,
			paid_at      timestamptz NOT NULL DEFAULT now())`, schema)); err != nil {
		return nil, fmt.Errorf("create demo tables: %w", err)
	}
	run := fmt.Sprintf("%x", rand.Uint32())
	events := make([]event, cfg.Events)
	want := map[string]int{}
	for i := range events {
		e := event{
			id:       fmt.Sprintf("evt_%s_%04d", run, i),
			invoice:  fmt.Sprintf("in_%s_%04d", run, i),
			customer: fmt.Sprintf("cus_%02d", i%25),
			amount:   100 * (1 + i%50),
			flaky:    rand.Float64() < cfg.FlakyRate,
		}
		events[i] = e
		want[e.customer] += e.amount
	}

	client := idem.New(pool, &idem.Config{})
	mail := &mailer{sent: map[string]int{}}
	var flakyOnce sync.Map
	rep := &Report{Events: cfg.Events, Deliveries: cfg.Events * cfg.Deliveries}
	var retries atomic.Int64

	// handle is the webhook handler: the payment row and the claim commit
	// together; the email goes out after the commit, only for the delivery
	// that did the work.
	handle := func(ctx context.Context, e event) error {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx)
		res, err := client.WithTx(tx).Do(ctx, cfg.Source, e.id, func(ctx context.Context) (any, error) {
			if rand.Float64() < cfg.SlowRate {
				time.Sleep(cfg.SlowFor)
			}
			if _, seen := flakyOnce.LoadOrStore(e.id, true); e.flaky && !seen {
				return nil, errFlaky
			}
			// An absolute write: the invoice is paid, whatever ran before.
			_, err := tx.Exec(ctx, fmt.Sprintf(`INSERT INTO %s.payments (invoice_id, customer, amount_cents)
				VALUES ($1, $2, $3) ON CONFLICT (invoice_id) DO UPDATE SET amount_cents = EXCLUDED.amount_cents`, schema),
				e.invoice, e.customer, e.amount)
			return map[string]any{"invoice": e.invoice, "status": "paid"}, err
		}, idem.WithEventType("invoice.paid"))
		if err != nil {
			if errors.Is(err, errFlaky) {
				atomic.AddInt64(&rep.FailedRuns, 1)
				// The failure is recorded in the transaction; commit it so
				// the next delivery re-runs the work.
				_ = tx.Commit(ctx)
			}
			return err
		}
		if err := tx.Commit(ctx); err != nil {
			return err
		}
		if res.Replayed {
			atomic.AddInt64(&rep.Replayed, 1)
		} else {
			atomic.AddInt64(&rep.Acquired, 1)
			mail.send(e.invoice)
		}
		return nil
	}

	// deliver is the sender: it retries a failed delivery with backoff.
	deliver := func(ctx context.Context, e event) error {
		for attempt := 0; ; attempt++ {
			err := handle(ctx, e)
			if err == nil {
				return nil
			}
			if errors.Is(err, idem.ErrInProgress) {
				atomic.AddInt64(&rep.Waited, 1)
				return nil
			}
			if attempt >= 8 || ctx.Err() != nil {
				return fmt.Errorf("event %s: gave up after %d attempts: %w", e.id, attempt+1, err)
			}
			retries.Add(1)
			time.Sleep(time.Duration(10*(attempt+1)) * time.Millisecond)
		}
	}

	start := time.Now()
	queue := make([]event, 0, rep.Deliveries)
	for _, e := range events {
		for range cfg.Deliveries {
			queue = append(queue, e)
		}
	}
	rand.Shuffle(len(queue), func(i, j int) { queue[i], queue[j] = queue[j], queue[i] })
	ch := make(chan event)
	errc := make(chan error, cfg.Workers)
	var wg sync.WaitGroup
	for range cfg.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for e := range ch {
				if err := deliver(ctx, e); err != nil {
					select {
					case errc <- err:
					default:
					}
				}
			}
		}()
	}
	for _, e := range queue {
		ch <- e
	}
	close(ch)
	wg.Wait()
	rep.Elapsed = time.Since(start)
	rep.Retries = int(retries.Load())
	select {
	case err := <-errc:
		return rep, err
	default:
	}

	for _, n := range mail.sent {
		rep.EmailsSent += n
		if n > 1 {
			rep.DuplicateEmails += n - 1
		}
	}
	got := map[string]int{}
	rows, err := pool.Query(ctx, fmt.Sprintf(`SELECT customer, sum(amount_cents)::int, count(*)::int FROM %s.payments GROUP BY customer`, schema))
	if err != nil {
		return rep, err
	}
	for rows.Next() {
		var c string
		var sum, n int
		if err := rows.Scan(&c, &sum, &n); err != nil {
			return rep, err
		}
		got[c] = sum
		rep.Payments += n
	}
	if err := rows.Err(); err != nil {
		return rep, err
	}
	rep.BalancesOK = len(got) == len(want)
	for c, w := range want {
		rep.BalancesOK = rep.BalancesOK && got[c] == w
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE source = $1 AND key LIKE $2 AND status <> 'completed'`,
		cfg.Source, "evt_"+run+"_%").Scan(&rep.StillProcessing); err != nil {
		return rep, err
	}
	rep.Checks = []Check{
		{"every event's work ran exactly once", rep.Acquired == int64(cfg.Events), fmt.Sprintf("%d runs that stuck for %d events", rep.Acquired, cfg.Events)},
		{"one payment per invoice", rep.Payments == cfg.Events, fmt.Sprintf("%d payments", rep.Payments)},
		{"one email per event, none twice", rep.EmailsSent == cfg.Events && rep.DuplicateEmails == 0, fmt.Sprintf("%d sent, %d duplicates", rep.EmailsSent, rep.DuplicateEmails)},
		{"customer balances are exact", rep.BalancesOK, fmt.Sprintf("%d customers", len(want))},
		{"no key left in processing", rep.StillProcessing == 0, fmt.Sprintf("%d left", rep.StillProcessing)},
	}
	return rep, nil
}
