package idemhttp_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"

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
