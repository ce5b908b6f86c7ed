package idemhttp_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemhttp/idemtest"
	"github.com/idemkit/idem/internal/testdb"
)

// eventRuns is a handler that counts runs per event of a multi-event
// delivery (SendGrid's sg_event_id, HubSpot's eventId).
type eventRuns struct {
	mu    sync.Mutex
	byID  map[string]int
	calls int
}

func (e *eventRuns) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var evs []map[string]any
	if err := json.NewDecoder(r.Body).Decode(&evs); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	e.mu.Lock()
	e.calls++
	for _, ev := range evs {
		id := fmt.Sprint(ev["sg_event_id"])
		if v, ok := ev["eventId"]; ok {
			id = fmt.Sprint(v)
		}
		e.byID[id]++
	}
	e.mu.Unlock()
	w.WriteHeader(http.StatusOK)
}

// TestBatchHalfProcessed (acceptance): a SendGrid (or HubSpot) delivery of
// 50 events, 25 of them processed before, redelivered 8 times at once
// and then once more as the sender's next retry: the handler runs for the
// 25 new events only, once each, never sees an old one, and the
// delivery's answers are 200 (done, or a duplicate) or 409 (some events
// still running under another copy: the sender retries).
func TestBatchHalfProcessed(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, testdb.New(t), 30)
	client := testdb.Client(t, pool, nil)
	for _, name := range []string{"sendgrid", "hubspot"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			runs := &eventRuns{byID: map[string]int{}}
			late := &lateHandler{}
			srv := httptest.NewServer(late)
			t.Cleanup(srv.Close)
			url := srv.URL + "/webhooks/" + name
			var sender *idemtest.Sender
			var preset idemhttp.Preset
			if name == "sendgrid" {
				sender = idemtest.SendGrid()
				preset = idemhttp.SendGrid(sender.VerificationKey(""))
			} else {
				sender = idemtest.HubSpot("hubspot client secret", url)
				preset = idemhttp.HubSpot(idemhttp.PublicURL{}, "hubspot client secret")
			}
			mw, err := idemhttp.New(idemhttp.Config{Client: client, Source: "batch-" + name}.Apply(preset))
			if err != nil {
				t.Fatal(err)
			}
			late.h = mw(runs)

			events := make([]*idemtest.Delivery, 50)
			ids := make([]string, 50)
			for i := range events {
				events[i] = sender.Event("delivered", fmt.Sprintf(`{"n":%d}`, i))
				var evs []map[string]any
				_ = json.Unmarshal(events[i].Body, &evs)
				ids[i] = fmt.Sprint(evs[0]["sg_event_id"])
				if name == "hubspot" {
					ids[i] = fmt.Sprint(evs[0]["eventId"])
				}
			}
			if resp, body := idemtest.Send(t, url, sender.Batch(events[:25]...)); resp.StatusCode != 200 {
				t.Fatalf("the first 25: %d %s", resp.StatusCode, body)
			}
			before := runs.calls

			all := sender.Batch(events...)
			codes := idemtest.Fire(t, url, all, 8)
			if i := slices.IndexFunc(codes, func(c int) bool { return c != 200 && c != 409 }); i >= 0 {
				t.Fatalf("concurrent redeliveries answered %v", codes)
			}
			// The sender's retry after any 409: everything done, a duplicate.
			if resp, _ := idemtest.Send(t, url, sender.Redeliver(all)); resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "true" {
				t.Fatalf("the retry after the storm: %d replayed=%q", resp.StatusCode, resp.Header.Get(idemhttp.ReplayedHeader))
			}
			for i, id := range ids {
				if runs.byID[id] != 1 {
					t.Fatalf("event %d (%s) ran %d times, want once", i, id, runs.byID[id])
				}
			}
			if len(runs.byID) != 50 || runs.calls-before < 1 {
				t.Fatalf("%d events ran in all (want 50), the storm made %d handler calls", len(runs.byID), runs.calls-before)
			}
			t.Logf("%s: 8 concurrent copies of 50 events (25 new): codes %v, %d handler calls for the 25", name, codes, runs.calls-before)
		})
	}
}

// TestBatchLeaseKeptWhileHandlerRuns: a multi-event delivery whose handler
// ignores its context and runs well past the lease (1 s here, and past
// HandlerTimeout) keeps its events' leases: they are extended while it
// runs (the row's lease moves past the one the claim granted), so the
// sender's retry that arrives after the first lease would have ended is
// answered 409 and does not run the same events a second time. Once the
// handler returns, its answer completes them and the next retry is a
// duplicate.
func TestBatchLeaseKeptWhileHandlerRuns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 10)
	client := testdb.Client(t, pool, nil)
	runs := &eventRuns{byID: map[string]int{}}
	release := make(chan struct{})
	started := make(chan struct{}, 2)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		started <- struct{}{}
		<-release // ignores r.Context(): HandlerTimeout ends long before
		runs.ServeHTTP(w, r)
	})
	sender := idemtest.SendGrid()
	mw, err := idemhttp.New(idemhttp.Config{Client: client, Source: "lease-sendgrid", Lease: time.Second,
		HandlerTimeout: 500 * time.Millisecond}.Apply(idemhttp.SendGrid(sender.VerificationKey(""))))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(handler))
	t.Cleanup(srv.Close)
	delivery := sender.Batch(sender.Event("delivered", `{"n":1}`), sender.Event("open", `{"n":2}`))

	first := make(chan int, 1)
	go func() {
		resp, _ := idemtest.Send(t, srv.URL, delivery)
		first <- resp.StatusCode
	}()
	select {
	case <-started:
	case code := <-first:
		t.Fatalf("the first delivery was answered %d without running the handler", code)
	}
	var granted time.Time
	if err := pool.QueryRow(ctx, `SELECT min(lease_expires_at) FROM idem.processed_events WHERE source = 'lease-sendgrid'`).Scan(&granted); err != nil {
		t.Fatal(err)
	}
	// Wait (bounded) until the lease the claim granted has ended by the
	// database's clock, and the heartbeat has extended every event's lease
	// past it.
	for i := 0; ; i++ {
		var now, lease time.Time
		if err := pool.QueryRow(ctx, `SELECT clock_timestamp(), min(lease_expires_at) FROM idem.processed_events WHERE source = 'lease-sendgrid'`).Scan(&now, &lease); err != nil {
			t.Fatal(err)
		}
		if now.After(granted) && lease.After(now) {
			break
		}
		if i == 200 {
			close(release)
			t.Fatalf("the lease granted until %v was not extended while the handler ran (now %v, lease %v)", granted, now, lease)
		}
		time.Sleep(50 * time.Millisecond)
	}
	resp, body := idemtest.Send(t, srv.URL, sender.Redeliver(delivery))
	if resp.StatusCode != http.StatusConflict {
		close(release)
		t.Fatalf("the retry while the handler runs past its first lease: %d %s, want 409", resp.StatusCode, body)
	}
	close(release)
	if code := <-first; code != http.StatusOK {
		t.Fatalf("the first delivery: %d", code)
	}
	select {
	case <-started:
		t.Fatal("the retry ran the handler while the first run held the events")
	default:
	}
	resp, _ = idemtest.Send(t, srv.URL, sender.Redeliver(delivery))
	if resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Fatalf("the retry after the run: %d, want a duplicate", resp.StatusCode)
	}
	if runs.calls != 1 || len(runs.byID) != 2 {
		t.Fatalf("the handler ran %d times for %d events, want once for 2", runs.calls, len(runs.byID))
	}
}

// TestBatchHandlerTimeoutReleases: a multi-event delivery whose handler
// returns on HandlerTimeout's cancelled context without answering is
// answered as the single-event path answers it (503 "Request timed out",
// Retry-After) and its events are released, never completed: the
// sender's retry runs the handler again, instead of a 2xx for events whose
// handler never ran successfully.
func TestBatchHandlerTimeoutReleases(t *testing.T) {
	t.Parallel()
	client := testdb.Client(t, testdb.Pool(t, testdb.New(t), 6), nil)
	runs := &eventRuns{byID: map[string]int{}}
	var calls atomic.Int32
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			<-r.Context().Done() // gives up without answering
			return
		}
		runs.ServeHTTP(w, r)
	})
	sender := idemtest.SendGrid()
	mw, err := idemhttp.New(idemhttp.Config{Client: client, Source: "timeout-sendgrid",
		HandlerTimeout: 500 * time.Millisecond}.Apply(idemhttp.SendGrid(sender.VerificationKey(""))))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(handler))
	t.Cleanup(srv.Close)
	delivery := sender.Batch(sender.Event("delivered", `{"n":1}`), sender.Event("open", `{"n":2}`))
	resp, body := idemtest.Send(t, srv.URL, delivery)
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" || !strings.Contains(string(body), "Request timed out") {
		t.Fatalf("a handler that timed out without answering: %d %s, want 503 Request timed out", resp.StatusCode, body)
	}
	resp, body = idemtest.Send(t, srv.URL, sender.Redeliver(delivery))
	if resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "" || runs.calls != 1 || len(runs.byID) != 2 {
		t.Fatalf("the retry: %d %s replayed=%q, the handler ran %d times; want it run", resp.StatusCode, body, resp.Header.Get(idemhttp.ReplayedHeader), runs.calls)
	}
}

// TestBatchUnusableEventID: an event idem cannot take for a key (an id,
// here Adyen's eventCode:pspReference:success, holding a NUL byte or over
// 512 bytes; a type over 256 bytes), in a correctly signed delivery, makes
// the delivery 400 with a problem naming the event, before anything is
// claimed (it was 503, retried by the sender for good), and nothing runs.
func TestBatchUnusableEventID(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, testdb.New(t), 6)
	client := testdb.Client(t, pool, nil)
	const key = "00112233445566778899AABBCCDDEEFF00112233445566778899AABBCCDDEEFF"
	runs := idemtest.Count(nil)
	mw, err := idemhttp.New(idemhttp.Config{Client: client, Source: "badid-adyen"}.Apply(idemhttp.Adyen(key)))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(runs))
	t.Cleanup(srv.Close)
	sender := idemtest.Adyen(key)
	for name, code := range map[string]string{
		"NUL":        "AUTHORISATION\x00",
		"over 512":   strings.Repeat("A", 600),
		"type > 256": strings.Repeat("B", 300),
	} {
		t.Run(name, func(t *testing.T) {
			d := sender.Batch(sender.Event("AUTHORISATION", `{"n":1}`), sender.Event(code, `{"n":2}`))
			resp, body := idemtest.Send(t, srv.URL, d)
			if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "Event 2 of 2 of the Adyen delivery") {
				t.Fatalf("%d %s, want 400 naming event 2", resp.StatusCode, body)
			}
		})
	}
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM idem.processed_events WHERE source = 'badid-adyen'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 || runs.Total() != 0 {
		t.Fatalf("%d keys claimed, %d runs, want none", n, runs.Total())
	}
}

// TestBatchOverMaxBatch: a delivery of more events than one batch claim
// takes (idem.MaxBatch) is claimed in chunks, each inside the work of the
// one before, and still runs the handler once over every event acquired:
// 1,500 events, the first 500 (then the first 1,000: a whole chunk with
// nothing to run) processed before; a momentary 503 releases every event of
// both chunks without counting, and the retry runs each new event once.
func TestBatchOverMaxBatch(t *testing.T) {
	t.Parallel()
	client := testdb.Client(t, testdb.Pool(t, testdb.New(t), 6), nil)
	for _, before := range []int{500, idem.MaxBatch} {
		t.Run(fmt.Sprint(before), func(t *testing.T) {
			t.Parallel()
			runs := &eventRuns{byID: map[string]int{}}
			var fail atomic.Bool
			sender := idemtest.SendGrid()
			mw, err := idemhttp.New(idemhttp.Config{Client: client, Source: fmt.Sprint("big-", before)}.Apply(idemhttp.SendGrid(sender.VerificationKey(""))))
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if fail.Load() {
					w.WriteHeader(http.StatusServiceUnavailable)
					return
				}
				runs.ServeHTTP(w, r)
			})))
			t.Cleanup(srv.Close)
			events := make([]*idemtest.Delivery, 1500)
			for i := range events {
				events[i] = sender.Event("delivered", fmt.Sprintf(`{"n":%d}`, i))
			}
			if resp, body := idemtest.Send(t, srv.URL, sender.Batch(events[:before]...)); resp.StatusCode != 200 {
				t.Fatalf("the first %d: %d %s", before, resp.StatusCode, body)
			}
			all := sender.Batch(events...)
			fail.Store(true)
			if resp, body := idemtest.Send(t, srv.URL, all); resp.StatusCode != http.StatusServiceUnavailable {
				t.Fatalf("all 1,500, the handler answering 503: %d %s", resp.StatusCode, body)
			}
			fail.Store(false)
			if resp, body := idemtest.Send(t, srv.URL, sender.Redeliver(all)); resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "" {
				t.Fatalf("the retry: %d %s", resp.StatusCode, body)
			}
			if resp, _ := idemtest.Send(t, srv.URL, sender.Redeliver(all)); resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "true" {
				t.Fatalf("the retry after: %d, want a duplicate", resp.StatusCode)
			}
			if runs.calls != 2 || len(runs.byID) != 1500 {
				t.Fatalf("%d handler calls for %d events, want 2 for 1,500", runs.calls, len(runs.byID))
			}
			for id, n := range runs.byID {
				if n != 1 {
					t.Fatalf("event %s ran %d times", id, n)
				}
			}
		})
	}
}
