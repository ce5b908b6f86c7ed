package idemhttp_test

import (
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemhttp/idemtest"
)

// TestLinearRetryIdentity: Linear's own code does not say that a retry
// keeps Linear-Delivery (its SDK never reads the header); it does say that
// every attempt is signed afresh: webhookTimestamp is "when the webhook
// was sent" and the SDK refuses one more than a minute off, while retries
// come 1 minute, 1 hour and 6 hours later. So the preset is tested both
// ways. A retry under the same Linear-Delivery (signed again) is the same
// key: answered from the stored answer, no run. A retry under a fresh
// Linear-Delivery is never taken for a replay: its body differs from the
// first attempt's (the new webhookTimestamp), so the replay guard lets it
// through and it runs; if Linear did renew the id, an event whose 2xx
// Linear never received runs a second time (docs/senders.md, "Linear").
func TestLinearRetryIdentity(t *testing.T) {
	t.Parallel()
	rs := newRecordingServer(t, idemhttp.Linear(presetSecret), "linear-retry")
	sender := idemtest.Linear(presetSecret)

	ev := sender.Event("Issue", "")
	if resp, _ := idemtest.Send(t, rs.url, ev); resp.StatusCode != 200 {
		t.Fatalf("first attempt: %d", resp.StatusCode)
	}
	time.Sleep(2 * time.Millisecond) // a later webhookTimestamp (milliseconds)
	same := sender.Redeliver(ev)
	if resp, _ := idemtest.Send(t, rs.url, same); resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Fatalf("a retry under the same Linear-Delivery: %d replayed=%q", resp.StatusCode, resp.Header.Get(idemhttp.ReplayedHeader))
	}
	if n := len(rs.runs()); n != 1 {
		t.Fatalf("%d runs after the retry under the same id, want 1", n)
	}

	time.Sleep(2 * time.Millisecond)
	fresh := sender.Redeliver(ev)
	fresh.Header.Set("Linear-Delivery", "5b7e1a9c-2f4d-4c1e-9a7b-000000000001")
	if string(fresh.Body) == string(ev.Body) {
		t.Fatal("the retry's body is the first attempt's: the test needs a fresh webhookTimestamp")
	}
	if resp, body := idemtest.Send(t, rs.url, fresh); resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "" {
		t.Fatalf("a retry under a fresh Linear-Delivery: %d %s replayed=%q; want it run, never answered as a replay", resp.StatusCode, body, resp.Header.Get(idemhttp.ReplayedHeader))
	}
	if n := len(rs.runs()); n != 2 {
		t.Fatalf("%d runs, want 2", n)
	}
}
