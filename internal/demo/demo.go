// Package demo is the quick start's storm: the example webhook receiver
// (examples/webhook-receiver) is served over HTTP and a Stripe-like sender
// fires invoice.paid events at it, each delivered several times at once,
// some slow, some failing and retried by the sender, some emails failing
// once, one event first delivered last month. The checks at the end prove
// that each payment was booked once and each email sent once.
package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stripe/stripe-go/v85/webhook"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/webhook-receiver/receiver"
)

// Config sizes the storm. Zero fields take the defaults in brackets.
type Config struct {
	Events     int     // distinct events [300]
	Deliveries int     // deliveries of each event, concurrently [4]
	Workers    int     // concurrent sender connections [16]
	FlakyRate  float64 // share of events whose first run fails [0.1]
	SlowRate   float64 // share of events whose work takes SlowFor [0.05]
	SlowFor    time.Duration
	// CrossMonth, when set, is called to make a pool whose sessions live
	// just before the start of this month; the demo delivers one event
	// through it first, so its redeliveries cross into the new month. It
	// needs a database whose idem.clock() can be pinned (the throwaway one).
	CrossMonth func(ctx context.Context, at time.Time) (*pgxpool.Pool, error)
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
}

// Report is what happened.
type Report struct {
	Events, Deliveries int
	SenderRetries      int64
	Statuses           map[int]int64
	Replayed           int64
	EmailsSent         int
	DuplicateEmails    int
	Payments           int
	BalancesOK         bool
	StillProcessing    int
	CrossMonth         string // what happened to the event first seen last month
	Forged             int    // forged, stale and unsigned deliveries sent
	ForgedRefused      int    // of those, answered 400 or 401
	Elapsed            time.Duration
	Checks             []Check
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
	fmt.Fprintf(w, "\nstorm: %d invoice.paid events x %d concurrent deliveries = %d deliveries in %s\n",
		r.Events, r.Deliveries/max(r.Events, 1), r.Deliveries, r.Elapsed.Round(time.Millisecond))
	fmt.Fprintf(w, "  forged, stale, unsigned:        %d sent, %d refused before any claim\n", r.Forged, r.ForgedRefused)
	fmt.Fprintf(w, "  sender retries after a non-2xx: %d\n", r.SenderRetries)
	fmt.Fprintf(w, "  HTTP answers:                   %v\n", r.Statuses)
	fmt.Fprintf(w, "  duplicates absorbed (replayed): %d\n", r.Replayed)
	fmt.Fprintf(w, "  payments booked:                %d\n", r.Payments)
	fmt.Fprintf(w, "  confirmation emails sent:       %d (duplicates: %d)\n", r.EmailsSent, r.DuplicateEmails)
	if r.CrossMonth != "" {
		fmt.Fprintf(w, "  event first seen last month:    %s\n", r.CrossMonth)
	}
	fmt.Fprintln(w, "\nchecks:")
	for _, c := range r.Checks {
		mark := "PASS"
		if !c.OK {
			mark = "FAIL"
		}
		fmt.Fprintf(w, "  [%s] %s (%s)\n", mark, c.Name, c.Got)
	}
}

type event struct {
	id, invoice, customer, email string
	amount                       int
	body                         []byte
}

func pick(id string, rate float64) bool {
	h := fnv.New32a()
	h.Write([]byte(id))
	return float64(h.Sum32()%10000) < rate*10000
}

// Run serves the receiver against pool (idem's migrations must be
// applied), runs the storm and checks the outcome.
func Run(ctx context.Context, pool *pgxpool.Pool, cfg Config, log *slog.Logger) (*Report, error) {
	cfg.defaults()
	if err := receiver.Setup(ctx, pool); err != nil {
		return nil, fmt.Errorf("create the receiver's table: %w", err)
	}
	run := fmt.Sprintf("%08x", rand.Uint32())
	events := make([]event, cfg.Events)
	want := map[string]int{}
	for i := range events {
		e := event{
			id:       fmt.Sprintf("evt_%s%05d", run, i),
			invoice:  fmt.Sprintf("in_%s%05d", run, i),
			customer: fmt.Sprintf("cus_%s%02d", run, i%25),
			amount:   100 * (1 + i%50),
		}
		e.email = e.customer + "@example.com"
		e.body, _ = json.Marshal(map[string]any{
			"id": e.id, "object": "event", "type": "invoice.paid", "livemode": false,
			"data": map[string]any{"object": map[string]any{
				"id": e.invoice, "object": "invoice", "customer": e.customer,
				"customer_email": e.email, "amount_paid": e.amount, "currency": "usd", "status": "paid"}},
		})
		events[i] = e
		want[e.customer] += e.amount
	}

	mail := &receiver.StubMailer{FailFirst: func(subject string) bool { return pick(subject, 0.05) }}
	rc := &receiver.Receiver{Secrets: []string{demoSecret}, Pool: pool, Idem: idem.New(pool, nil), Mail: mail, Log: log,
		Chaos: &receiver.Chaos{
			Slow: func(id string) time.Duration {
				if pick(id+"slow", cfg.SlowRate) {
					return cfg.SlowFor
				}
				return 0
			},
			FailOnce: func(id string) bool { return pick(id, cfg.FlakyRate) },
		}}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /webhooks/stripe", rc)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	url := "http://" + ln.Addr().String() + "/webhooks/stripe"

	rep := &Report{Events: cfg.Events, Deliveries: cfg.Events * cfg.Deliveries, Statuses: map[int]int64{}}
	// One event was first delivered (and processed) just before midnight
	// at the end of last month: its key lives in last month's partition.
	if cfg.CrossMonth != nil && len(events) > 0 {
		e := events[0]
		now := time.Now().UTC()
		boundary := time.Date(now.Year(), now.Month(), 1, 0, 0, 0, 0, time.UTC)
		old, err := cfg.CrossMonth(ctx, boundary.Add(-time.Second))
		if err != nil {
			return nil, fmt.Errorf("cross-month setup: %w", err)
		}
		earlier := &receiver.Receiver{Secrets: rc.Secrets, Pool: old, Idem: idem.New(old, nil), Mail: mail, Log: log, Chaos: rc.Chaos}
		for attempt := 1; ; attempt++ { // the sender retries until a 2xx
			rec := &statusRecorder{header: http.Header{}}
			req := signed(ctx, url, e.body, demoSecret, time.Now())
			earlier.ServeHTTP(rec, req)
			rep.Deliveries++
			if rec.code == 0 || rec.code == http.StatusOK {
				break
			}
			if attempt == 8 {
				old.Close()
				return nil, fmt.Errorf("cross-month first delivery still answered %d after %d attempts", rec.code, attempt)
			}
		}
		old.Close()
	}

	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: cfg.Workers}}
	// An attacker's deliveries, before the storm: for the first events, a
	// forgery of the genuine event id with a changed amount (signed with a
	// wrong secret), a stale replay of the genuine delivery (signed an hour
	// ago) and an unsigned one; and forged events that never existed. None
	// may be claimed, book a payment or block the genuine delivery.
	forgeries := 0
	for i := range min(20, len(events)) {
		e := events[i]
		fake := bytes.Replace(e.body, []byte(fmt.Sprintf(`"amount_paid":%d`, e.amount)), []byte(`"amount_paid":999999`), 1)
		invented := bytes.ReplaceAll(e.body, []byte(run), []byte("forged"+run[:2]))
		for _, req := range []*http.Request{
			signed(ctx, url, fake, "whsec_not_the_endpoints_secret", time.Now()),
			signed(ctx, url, e.body, demoSecret, time.Now().Add(-time.Hour)),
			signed(ctx, url, invented, "whsec_not_the_endpoints_secret", time.Now()),
			unsigned(ctx, url, e.body),
		} {
			rep.Forged++
			resp, err := client.Do(req)
			if err != nil {
				return nil, err
			}
			resp.Body.Close()
			if resp.StatusCode == http.StatusBadRequest || resp.StatusCode == http.StatusUnauthorized {
				rep.ForgedRefused++
			}
		}
		forgeries++
	}

	var mu sync.Mutex
	deliver := func(e event) error {
		for attempt := 0; ; attempt++ {
			resp, err := client.Do(signed(ctx, url, e.body, demoSecret, time.Now()))
			if err != nil {
				return err
			}
			var body struct {
				Replayed bool `json:"replayed"`
			}
			_ = json.NewDecoder(resp.Body).Decode(&body)
			resp.Body.Close()
			mu.Lock()
			rep.Statuses[resp.StatusCode]++
			mu.Unlock()
			if resp.StatusCode/100 == 2 {
				if body.Replayed {
					atomic.AddInt64(&rep.Replayed, 1)
				}
				return nil
			}
			if attempt >= 8 {
				return fmt.Errorf("event %s: still %d after %d attempts", e.id, resp.StatusCode, attempt+1)
			}
			atomic.AddInt64(&rep.SenderRetries, 1)
			time.Sleep(time.Duration(20*(attempt+1)) * time.Millisecond) // the sender's backoff
		}
	}

	start := time.Now()
	queue := make([]event, 0, cfg.Events*cfg.Deliveries)
	for _, e := range events {
		for range cfg.Deliveries {
			queue = append(queue, e)
		}
	}
	rand.Shuffle(len(queue), func(i, j int) { queue[i], queue[j] = queue[j], queue[i] })
	ch := make(chan event)
	var firstErr error
	var errOnce sync.Once
	var wg sync.WaitGroup
	for range cfg.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for e := range ch {
				if err := deliver(e); err != nil {
					errOnce.Do(func() { firstErr = err })
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
	if firstErr != nil {
		return rep, firstErr
	}

	for _, n := range mail.Sent {
		rep.EmailsSent++
		rep.DuplicateEmails += n - 1
	}
	got := map[string]int{}
	rows, err := pool.Query(ctx, `SELECT customer, sum(amount_cents)::int, count(*)::int FROM payments WHERE event_id LIKE $1 GROUP BY customer`, "evt_"+run+"%")
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
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE key LIKE $1 AND status <> 'completed'`,
		"%"+run+"%").Scan(&rep.StillProcessing); err != nil {
		return rep, err
	}
	var forgedPayments int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM payments WHERE amount_cents = 999999 OR event_id LIKE $1`,
		"evt_forged"+run[:2]+"%").Scan(&forgedPayments); err != nil {
		return rep, err
	}
	rep.Checks = []Check{
		{"forged, stale and unsigned deliveries refused before any claim", rep.ForgedRefused == rep.Forged && forgedPayments == 0,
			fmt.Sprintf("%d of %d refused, %d forged payments booked; %d genuine events delivered after forgeries of their ids", rep.ForgedRefused, rep.Forged, forgedPayments, forgeries)},
		{"one payment per invoice", rep.Payments == cfg.Events, fmt.Sprintf("%d payments for %d events", rep.Payments, cfg.Events)},
		{"one email per event, none twice", rep.EmailsSent == cfg.Events && rep.DuplicateEmails == 0,
			fmt.Sprintf("%d sent, %d duplicates", rep.EmailsSent, rep.DuplicateEmails)},
		{"customer balances are exact", rep.BalancesOK, fmt.Sprintf("%d customers", len(want))},
		{"no key left in processing", rep.StillProcessing == 0, fmt.Sprintf("%d left", rep.StillProcessing)},
	}
	if cfg.CrossMonth != nil {
		var month time.Time
		var attempts int
		err := pool.QueryRow(ctx, `SELECT first_seen_month, attempts FROM idem.processed_events WHERE source = 'stripe' AND key = $1`, events[0].id).Scan(&month, &attempts)
		ok := err == nil && month.Month() != time.Now().UTC().Month()
		rep.CrossMonth = fmt.Sprintf("key in the %s partition (%d attempt(s), all last month), %d redeliveries this month replayed",
			month.Format("2006-01"), attempts, cfg.Deliveries)
		rep.Checks = append(rep.Checks, Check{"a key first seen last month is recognized this month", ok, rep.CrossMonth})
	}
	return rep, nil
}

// demoSecret is the receiver's signing secret in the demo; the sender
// signs every genuine delivery with it, as Stripe does.
const demoSecret = "whsec_idem_demo"

// signed is a delivery signed the way Stripe signs it, with stripe-go's
// own signer, at time at.
func signed(ctx context.Context, url string, body []byte, secret string, at time.Time) *http.Request {
	req := unsigned(ctx, url, body)
	p := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: body, Secret: secret, Timestamp: at})
	req.Header.Set("Stripe-Signature", p.Header)
	return req
}

func unsigned(ctx context.Context, url string, body []byte) *http.Request {
	req, _ := http.NewRequestWithContext(ctx, "POST", url, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	return req
}

// statusRecorder is a minimal ResponseWriter for the in-process delivery.
type statusRecorder struct {
	header http.Header
	code   int
}

func (s *statusRecorder) Header() http.Header         { return s.header }
func (s *statusRecorder) WriteHeader(c int)           { s.code = c }
func (s *statusRecorder) Write(p []byte) (int, error) { return len(p), nil }
