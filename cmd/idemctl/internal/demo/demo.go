// Package demo is the quick start's storm: a receiver shaped like
// examples/webhook-receiver (idemhttp's Stripe preset in front of an
// invoice.paid handler) is served over HTTP and a Stripe-like sender fires
// invoice.paid events at it, each delivered several times at once, some
// slow, some failing and retried by the sender, some emails failing once,
// one event first delivered last month. The checks at the end prove that
// each payment was booked once and each email sent once, and that every
// request is accounted for.
package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stripe/stripe-go/v85/webhook"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
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
	// ExactCounts makes idem count every duplicate of the demo's source
	// (policy duplicate_sampling 1; the default samples 1 in 8), so that
	// the database's count can be checked against the sender's. It changes
	// the 'stripe' policy: only for a throwaway database.
	ExactCounts bool
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
	Statuses           map[int]int64             // HTTP answers to genuine requests
	Answers            map[idemhttp.Answer]int64 // how idemhttp answered every request
	CountedDuplicates  int64                     // idem's own count (ExactCounts), -1 when sampled
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

// requests is how many genuine requests the sender made: its deliveries
// and its retries of the ones answered with a non-2xx.
func (r *Report) requests() int64 { return int64(r.Deliveries) + r.SenderRetries }

// absorbed is how many requests were answered without running the
// handler: the stored answer replayed, or 409 while the first ran.
func (r *Report) absorbed() int64 {
	return r.Answers[idemhttp.AnswerReplayed] + r.Answers[idemhttp.AnswerInProgress]
}

// statuses lists the HTTP answers in status order: "200 x 1180, 409 x 20".
func (r *Report) statuses() string {
	codes := slices.Sorted(maps.Keys(r.Statuses))
	parts := make([]string, len(codes))
	for i, c := range codes {
		parts[i] = fmt.Sprintf("%d x %d", c, r.Statuses[c])
	}
	return strings.Join(parts, ", ")
}

// Print writes the report for a person.
func (r *Report) Print(w io.Writer) {
	fmt.Fprintf(w, "\nstorm: %d invoice.paid events, each delivered %d times at once: %d deliveries, %d retried by the sender after a non-2xx, %d requests in %s\n",
		r.Events, r.Deliveries/max(r.Events, 1), r.Deliveries, r.SenderRetries, r.requests(), r.Elapsed.Round(time.Millisecond))
	fmt.Fprintf(w, "  answers:                        %s\n", r.statuses())
	fmt.Fprintf(w, "  the handler ran:                %d times (%d failed with 500: key released, the sender retried)\n",
		r.Answers[idemhttp.AnswerRan], r.Statuses[http.StatusInternalServerError])
	fmt.Fprintf(w, "  duplicates absorbed:            %d (%d replayed the stored answer, %d told 409 while the first ran)\n",
		r.absorbed(), r.Answers[idemhttp.AnswerReplayed], r.Answers[idemhttp.AnswerInProgress])
	if r.CountedDuplicates >= 0 {
		fmt.Fprintf(w, "  duplicates idem counted:        %d (idemctl stats' DUPLICATES for stripe, below)\n", r.CountedDuplicates)
	}
	fmt.Fprintf(w, "  forged, stale, unsigned:        %d sent, %d refused before any claim\n", r.Forged, r.ForgedRefused)
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
	if _, err := pool.Exec(ctx, paymentsSchema); err != nil {
		return nil, fmt.Errorf("create the receiver's table: %w", err)
	}
	if cfg.ExactCounts {
		if _, err := pool.Exec(ctx, `
			INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling) VALUES ('stripe', '7 days', '2 minutes', 1)
			ON CONFLICT (source) DO UPDATE SET duplicate_sampling = 1`); err != nil {
			return nil, fmt.Errorf("count every duplicate: %w", err)
		}
	}
	s := &storm{cfg: cfg, pool: pool, log: log, run: fmt.Sprintf("%08x", rand.Uint32())}
	s.events, s.want = newEvents(s.run, cfg.Events)
	s.mail = &stubMailer{failFirst: func(subject string) bool { return pick(subject, 0.05) }}
	c, err := idem.New(pool, nil)
	if err != nil {
		return nil, err
	}
	s.rc = &receiver{pool: pool, idem: c, mail: s.mail,
		slow: func(id string) time.Duration {
			if pick(id+"slow", cfg.SlowRate) {
				return cfg.SlowFor
			}
			return 0
		},
		failOnce: func(id string) bool { return pick(id, cfg.FlakyRate) },
	}
	s.answers = &answerCounts{n: map[idemhttp.Answer]int64{}}
	h, err := s.rc.handler(demoSecret, s.answers, log)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /webhooks/stripe", h)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	s.url = "http://" + ln.Addr().String() + "/webhooks/stripe"

	s.rep = &Report{Events: cfg.Events, Deliveries: cfg.Events * cfg.Deliveries, Statuses: map[int]int64{}, CountedDuplicates: -1}
	if cfg.CrossMonth != nil && len(s.events) > 0 {
		if err := s.deliverLastMonth(ctx); err != nil {
			return nil, err
		}
	}
	s.client = &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: cfg.Workers}}
	forgeries, err := s.attack(ctx)
	if err != nil {
		return nil, err
	}
	if err := s.deliverAll(ctx); err != nil {
		return s.rep, err
	}
	return s.rep, s.check(ctx, forgeries)
}

// storm is one run of the demo: the events, the receiver and what the
// sender saw.
type storm struct {
	cfg     Config
	pool    *pgxpool.Pool
	log     *slog.Logger
	run     string         // this run's prefix of every id
	events  []event        // the genuine events
	want    map[string]int // each customer's balance once every event is booked
	mail    *stubMailer
	rc      *receiver
	answers *answerCounts
	url     string
	client  *http.Client
	rep     *Report
}

// newEvents makes n invoice.paid events of run and each customer's
// expected balance.
func newEvents(run string, n int) ([]event, map[string]int) {
	events := make([]event, n)
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
	return events, want
}

// deliverLastMonth delivers the first event (and processes it) just
// before midnight at the end of last month: its key lives in last month's
// partition.
func (s *storm) deliverLastMonth(ctx context.Context) error {
	e := s.events[0]
	now := time.Now().UTC()
	boundary := time.Date(now.Year(), now.Month(), 1, 0, 0, 0, 0, time.UTC)
	old, err := s.cfg.CrossMonth(ctx, boundary.Add(-time.Second))
	if err != nil {
		return fmt.Errorf("cross-month setup: %w", err)
	}
	defer old.Close()
	oc, err := idem.New(old, nil)
	if err != nil {
		return err
	}
	earlier := &receiver{pool: old, idem: oc, mail: s.mail, slow: s.rc.slow, failOnce: s.rc.failOnce}
	eh, err := earlier.handler(demoSecret, s.answers, s.log)
	if err != nil {
		return err
	}
	for attempt := 1; ; attempt++ { // the sender retries until a 2xx
		rec := &statusRecorder{header: http.Header{}}
		req := signed(ctx, s.url, e.body, demoSecret, time.Now())
		eh.ServeHTTP(rec, req)
		if attempt == 1 {
			s.rep.Deliveries++
		} else {
			s.rep.SenderRetries++
		}
		s.rep.Statuses[max(rec.code, http.StatusOK)]++
		if rec.code == 0 || rec.code == http.StatusOK {
			return nil
		}
		if attempt == 8 {
			return fmt.Errorf("cross-month first delivery still answered %d after %d attempts", rec.code, attempt)
		}
	}
}

// attack sends an attacker's deliveries, before the storm: for the first
// events, a forgery of the genuine event id with a changed amount (signed
// with a wrong secret), a stale replay of the genuine delivery (signed an
// hour ago) and an unsigned one; and forged events that never existed.
// None may be claimed, book a payment or block the genuine delivery. It
// returns how many genuine events had their ids forged.
func (s *storm) attack(ctx context.Context) (int, error) {
	forgeries := 0
	for i := range min(20, len(s.events)) {
		e := s.events[i]
		fake := bytes.Replace(e.body, []byte(fmt.Sprintf(`"amount_paid":%d`, e.amount)), []byte(`"amount_paid":999999`), 1)
		invented := bytes.ReplaceAll(e.body, []byte(s.run), []byte("forged"+s.run[:2]))
		for _, req := range []*http.Request{
			signed(ctx, s.url, fake, "whsec_not_the_endpoints_secret", time.Now()),
			signed(ctx, s.url, e.body, demoSecret, time.Now().Add(-time.Hour)),
			signed(ctx, s.url, invented, "whsec_not_the_endpoints_secret", time.Now()),
			unsigned(ctx, s.url, e.body),
		} {
			s.rep.Forged++
			resp, err := s.client.Do(req)
			if err != nil {
				return forgeries, err
			}
			resp.Body.Close()
			if resp.StatusCode == http.StatusBadRequest || resp.StatusCode == http.StatusUnauthorized {
				s.rep.ForgedRefused++
			}
		}
		forgeries++
	}
	return forgeries, nil
}

// deliverAll delivers every event cfg.Deliveries times, shuffled, from
// cfg.Workers senders that retry until a 2xx.
func (s *storm) deliverAll(ctx context.Context) error {
	var mu sync.Mutex
	deliver := func(e event) error {
		for attempt := 0; ; attempt++ {
			resp, err := s.client.Do(signed(ctx, s.url, e.body, demoSecret, time.Now()))
			if err != nil {
				return err
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			mu.Lock()
			s.rep.Statuses[resp.StatusCode]++
			mu.Unlock()
			if resp.StatusCode/100 == 2 {
				return nil
			}
			if attempt >= 8 {
				return fmt.Errorf("event %s: still %d after %d attempts", e.id, resp.StatusCode, attempt+1)
			}
			atomic.AddInt64(&s.rep.SenderRetries, 1)
			time.Sleep(time.Duration(20*(attempt+1)) * time.Millisecond) // the sender's backoff
		}
	}

	start := time.Now()
	queue := make([]event, 0, s.cfg.Events*s.cfg.Deliveries)
	for _, e := range s.events {
		for range s.cfg.Deliveries {
			queue = append(queue, e)
		}
	}
	rand.Shuffle(len(queue), func(i, j int) { queue[i], queue[j] = queue[j], queue[i] })
	ch := make(chan event)
	var firstErr error
	var errOnce sync.Once
	var wg sync.WaitGroup
	for range s.cfg.Workers {
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
	s.rep.Elapsed = time.Since(start)
	s.rep.Answers = s.answers.snapshot()
	return firstErr
}

// check counts what the storm left behind (payments, emails, balances,
// keys) and fills the report's checks.
func (s *storm) check(ctx context.Context, forgeries int) error {
	rep, cfg, pool, run := s.rep, s.cfg, s.pool, s.run
	for _, n := range s.mail.sent {
		rep.EmailsSent++
		rep.DuplicateEmails += n - 1
	}
	got := map[string]int{}
	rows, err := pool.Query(ctx, `SELECT customer, sum(amount_cents)::int, count(*)::int FROM payments WHERE event_id LIKE $1 GROUP BY customer`, "evt_"+run+"%")
	if err != nil {
		return err
	}
	for rows.Next() {
		var c string
		var sum, n int
		if err := rows.Scan(&c, &sum, &n); err != nil {
			return err
		}
		got[c] = sum
		rep.Payments += n
	}
	if err := rows.Err(); err != nil {
		return err
	}
	rep.BalancesOK = len(got) == len(s.want)
	for c, w := range s.want {
		rep.BalancesOK = rep.BalancesOK && got[c] == w
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE key LIKE $1 AND status <> 'completed'`,
		"%"+run+"%").Scan(&rep.StillProcessing); err != nil {
		return err
	}
	var forgedPayments int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM payments WHERE amount_cents = 999999 OR event_id LIKE $1`,
		"evt_forged"+run[:2]+"%").Scan(&forgedPayments); err != nil {
		return err
	}
	rep.Checks = []Check{
		{"forged, stale and unsigned deliveries refused before any claim", rep.ForgedRefused == rep.Forged && forgedPayments == 0,
			fmt.Sprintf("%d of %d refused, %d forged payments booked; %d genuine events delivered after forgeries of their ids", rep.ForgedRefused, rep.Forged, forgedPayments, forgeries)},
		{"one payment per invoice", rep.Payments == cfg.Events, fmt.Sprintf("%d payments for %d events", rep.Payments, cfg.Events)},
		{"one email per event, none twice", rep.EmailsSent == cfg.Events && rep.DuplicateEmails == 0,
			fmt.Sprintf("%d sent, %d duplicates", rep.EmailsSent, rep.DuplicateEmails)},
		{"customer balances are exact", rep.BalancesOK, fmt.Sprintf("%d customers", len(s.want))},
		{"no key left in processing", rep.StillProcessing == 0, fmt.Sprintf("%d left", rep.StillProcessing)},
		{"every request accounted for: the handler ran or a duplicate was absorbed",
			rep.Answers[idemhttp.AnswerRan]+rep.absorbed() == rep.requests(),
			fmt.Sprintf("%d ran + %d absorbed = %d of %d requests", rep.Answers[idemhttp.AnswerRan], rep.absorbed(),
				rep.Answers[idemhttp.AnswerRan]+rep.absorbed(), rep.requests())},
	}
	if cfg.ExactCounts {
		if err := pool.QueryRow(ctx, `SELECT coalesce(sum(duplicates), 0) FROM idem.duplicate_counts WHERE source = 'stripe'`).Scan(&rep.CountedDuplicates); err != nil {
			return err
		}
		rep.Checks = append(rep.Checks, Check{"idem counted every duplicate the sender saw absorbed",
			rep.CountedDuplicates == rep.absorbed(), fmt.Sprintf("%d counted, %d absorbed", rep.CountedDuplicates, rep.absorbed())})
	}
	if cfg.CrossMonth != nil {
		var month time.Time
		var attempts int
		err := pool.QueryRow(ctx, `SELECT first_seen_month, attempts FROM idem.processed_events WHERE source = 'stripe' AND key = $1 AND expires_at > now()`, s.events[0].id).Scan(&month, &attempts)
		ok := err == nil && month.Month() != time.Now().UTC().Month()
		rep.CrossMonth = fmt.Sprintf("key in the %s partition (%d attempt(s), all last month), %d redeliveries this month replayed",
			month.Format("2006-01"), attempts, cfg.Deliveries)
		rep.Checks = append(rep.Checks, Check{"a key first seen last month is recognized this month", ok, rep.CrossMonth})
	}
	return nil
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

// answerCounts counts idemhttp's answers (its Observer).
type answerCounts struct {
	mu sync.Mutex
	n  map[idemhttp.Answer]int64
}

func (a *answerCounts) ObserveAnswer(_ string, ans idemhttp.Answer) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.n[ans]++
}

func (a *answerCounts) snapshot() map[idemhttp.Answer]int64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return maps.Clone(a.n)
}

// statusRecorder is a minimal ResponseWriter for the in-process delivery.
type statusRecorder struct {
	header http.Header
	code   int
}

func (s *statusRecorder) Header() http.Header         { return s.header }
func (s *statusRecorder) WriteHeader(c int)           { s.code = c }
func (s *statusRecorder) Write(p []byte) (int, error) { return len(p), nil }
