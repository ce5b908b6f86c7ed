package demo

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/inbox"
)

// TimeoutsConfig is the timeout storm: a slow handler behind a sender that
// gives up early and retries, answered synchronously or asynchronously.
type TimeoutsConfig struct {
	Events      int           // distinct events (default 20)
	Deliveries  int           // deliveries of each at once (default 2)
	Handler     time.Duration // the handler's time (default 5s)
	Timeout     time.Duration // the sender's timeout (default 2s)
	MaxAttempts int           // the sender's attempts per delivery (default 12)
	Async       bool          // answer first (idemhttp.Config.Async on the inbox)
}

// TimeoutsReport is what the sender saw, and what ran.
type TimeoutsReport struct {
	Mode                          string
	Requests, Timeouts, Retries   int
	Non2xx                        int
	P50, P99, Max                 time.Duration // per request, as the sender saw it
	Events, ProcessedOnce, Repeat int           // events processed once; run more than once
	Elapsed                       time.Duration // until every event was processed
	// Inbox is the asynchronous mode's reconciliation of its source
	// (accepted = processed + dead-lettered + queued); nil when synchronous.
	Inbox *inbox.SourceStats
}

func (c *TimeoutsConfig) defaults() {
	c.Events = cmp.Or(c.Events, 20)
	c.Deliveries = cmp.Or(c.Deliveries, 2)
	c.Handler = cmp.Or(c.Handler, 5*time.Second)
	c.Timeout = cmp.Or(c.Timeout, 2*time.Second)
	c.MaxAttempts = cmp.Or(c.MaxAttempts, 12)
}

// AsyncOK: every delivery answered at once, and each event processed once.
func (r *TimeoutsReport) AsyncOK() bool {
	return r.Timeouts == 0 && r.Retries == 0 && r.Non2xx == 0 && r.OnceEach()
}

// OnceEach: each event processed exactly once.
func (r *TimeoutsReport) OnceEach() bool { return r.ProcessedOnce == r.Events && r.Repeat == 0 }

// Timeouts runs the timeout storm on pool (idem migrated; River's
// migrations are applied for the asynchronous mode).
func Timeouts(ctx context.Context, pool *pgxpool.Pool, cfg TimeoutsConfig, log *slog.Logger) (*TimeoutsReport, error) {
	cfg.defaults()
	rep := &TimeoutsReport{Mode: "sync", Events: cfg.Events}
	source := "timeouts-sync"
	if cfg.Async {
		rep.Mode, source = "async", "timeouts-async"
	}
	var mu sync.Mutex
	runs := map[string]int{}
	work := func(ctx context.Context, key string) {
		if strings.HasPrefix(key, "evt_warmup_") {
			return
		}
		time.Sleep(cfg.Handler) // the slow part: another service, a report, ...
		mu.Lock()
		runs[key]++
		mu.Unlock()
	}
	c, err := idem.New(pool, &idem.Config{Logger: log})
	if err != nil {
		return nil, err
	}
	hcfg := idemhttp.Config{Client: c, Source: source, Logger: log}
	var handler http.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var ev struct {
			ID string `json:"id"`
		}
		_ = json.NewDecoder(r.Body).Decode(&ev)
		work(r.Context(), ev.ID)
		w.WriteHeader(http.StatusOK)
	})
	var in *inbox.Inbox
	if cfg.Async {
		if _, err := inbox.Migrate(ctx, pool, ""); err != nil {
			return nil, err
		}
		var err error
		in, err = inbox.New(inbox.Config{Pool: pool, Idem: c, Logger: log, Handler: func(ctx context.Context, _ pgx.Tx, d *inbox.Delivery) (any, error) {
			work(ctx, d.Key)
			return nil, nil
		}})
		if err != nil {
			return nil, err
		}
		rc, err := in.NewWorkerClient(0, nil) // as many handlers as the pool serves
		if err != nil {
			return nil, err
		}
		if err := rc.Start(ctx); err != nil {
			return nil, err
		}
		defer func() {
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			_ = rc.Stop(sctx)
		}()
		hcfg.Async = in
	}
	mw, err := idemhttp.New(hcfg.Apply(idemhttp.Stripe(demoSecret)))
	if err != nil {
		return nil, err
	}
	srv := httptest.NewServer(mw(handler))
	defer srv.Close()

	sender := &http.Client{Timeout: cfg.Timeout, Transport: &http.Transport{MaxIdleConnsPerHost: cfg.Events * cfg.Deliveries}}
	// send is the sender: one delivery, signed the way Stripe signs it.
	send := func(body []byte) (*http.Response, error) {
		return sender.Do(signed(ctx, srv.URL, body, demoSecret, time.Now()))
	}
	// A server in service is warm: its connections open, its statements
	// prepared. One round of warm-up deliveries (not counted, not slow)
	// first, so the storm measures answering, not starting.
	var warm sync.WaitGroup
	for i := range cfg.Events * cfg.Deliveries {
		warm.Add(1)
		go func() {
			defer warm.Done()
			if resp, err := send(fmt.Appendf(nil, `{"id":"evt_warmup_%s_%03d","object":"event","type":"invoice.paid","data":{"object":{}}}`, rep.Mode, i)); err == nil {
				resp.Body.Close()
			}
		}()
	}
	warm.Wait()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		var done int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE source = $1 AND key LIKE 'evt\_warmup\_%' AND status = 'completed'`, source).Scan(&done); err != nil || done == cfg.Events*cfg.Deliveries {
			break // the warm-up is processed too (asynchronous mode: by the workers)
		}
	}

	var lat []time.Duration
	var timeouts, non2xx, requests, retries atomic.Int64
	start := time.Now()
	var wg sync.WaitGroup
	for i := range cfg.Events {
		body := fmt.Appendf(nil, `{"id":"evt_timeouts_%s_%03d","object":"event","type":"invoice.paid","data":{"object":{}}}`, rep.Mode, i)
		for range cfg.Deliveries {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for attempt := 1; attempt <= cfg.MaxAttempts; attempt++ {
					if attempt > 1 {
						retries.Add(1)
						time.Sleep(min(250*time.Millisecond<<(attempt-2), 2*time.Second)) // the sender's backoff, compressed
					}
					t0 := time.Now()
					resp, err := send(body)
					d := time.Since(t0)
					requests.Add(1)
					mu.Lock()
					lat = append(lat, d)
					mu.Unlock()
					if err != nil {
						timeouts.Add(1)
						continue
					}
					resp.Body.Close()
					if resp.StatusCode/100 == 2 {
						return
					}
					non2xx.Add(1)
				}
			}()
		}
	}
	wg.Wait()
	// Wait for the processing itself (asynchronous mode: in the background).
	for deadline := time.Now().Add(cfg.Handler*4 + time.Minute); ; time.Sleep(20 * time.Millisecond) {
		mu.Lock()
		n := len(runs)
		mu.Unlock()
		if n == cfg.Events || time.Now().After(deadline) {
			break
		}
	}
	rep.Elapsed = time.Since(start)
	rep.Requests, rep.Timeouts, rep.Retries, rep.Non2xx = int(requests.Load()), int(timeouts.Load()), int(retries.Load()), int(non2xx.Load())
	slices.Sort(lat)
	if n := len(lat); n > 0 {
		rep.P50, rep.P99, rep.Max = lat[n/2], lat[min(n-1, n*99/100)], lat[n-1]
	}
	mu.Lock()
	for _, n := range runs {
		if n == 1 {
			rep.ProcessedOnce++
		} else {
			rep.Repeat++
		}
	}
	mu.Unlock()
	if in != nil {
		// The last completions commit just after the handlers return.
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			st, err := in.Reconcile(ctx)
			if err != nil {
				return nil, err
			}
			for _, s := range st {
				if s.Source == source {
					rep.Inbox = &s
				}
			}
			if (rep.Inbox != nil && rep.Inbox.Queued == 0) || time.Now().After(deadline) {
				break
			}
		}
	}
	return rep, nil
}

// ReconcileOK: the asynchronous mode's events (the warm-up's and the
// storm's) add up, every accepted event processed.
func (r *TimeoutsReport) ReconcileOK() bool {
	s := r.Inbox
	return s != nil && s.Balanced() && s.Accepted >= int64(r.Events) && s.Processed == s.Accepted && s.Unaccounted == 0
}
