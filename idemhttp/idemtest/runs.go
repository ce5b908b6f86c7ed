package idemtest

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"io"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// Runs is an http.Handler that counts, per event, how often the handler it
// wraps started, and then calls it. An event is what the idemhttp presets
// take for one: a Standard Webhooks (or Svix) message by its id, a Twilio
// request by its I-Twilio-Idempotency-Token (Twilio sends one signed
// request as two events: a caller pressing the same key twice), an Adyen
// notification by its items' keys (its handler gets their signed fields
// only), any other delivery by its body, so that a redelivery, and a
// GitHub or Shopify copy under a fresh delivery id, count as the same
// event.
//
// Put it where your handler is: inside idemhttp's middleware, or as the
// handler an inbox runs (inbox.FromHTTP, Inbox.HTTP), where runs happen
// later, in the worker (use WaitRuns).
type Runs struct {
	next http.Handler

	mu   sync.Mutex
	byEv map[[32]byte]int
	all  int
	ch   chan struct{} // closed and replaced on every run
}

// Count returns a Runs around h (nil: a handler that answers 200).
func Count(h http.Handler) *Runs {
	if h == nil {
		h = http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	}
	return &Runs{next: h, byEv: map[[32]byte]int{}, ch: make(chan struct{})}
}

// ServeHTTP counts the run, then calls the wrapped handler.
func (r *Runs) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, err := io.ReadAll(req.Body)
	if err != nil {
		http.Error(w, "idemtest: reading the body: "+err.Error(), http.StatusBadRequest)
		return
	}
	req.Body = io.NopCloser(bytes.NewReader(body))
	r.mu.Lock()
	r.byEv[eventOf(req.Header, body)]++
	r.all++
	close(r.ch)
	r.ch = make(chan struct{})
	r.mu.Unlock()
	r.next.ServeHTTP(w, req)
}

// Of returns how often the handler ran for d's event.
func (r *Runs) Of(d *Delivery) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.byEv[eventOf(d.Header, d.Body)]
}

// eventOf identifies a delivery's event (see Runs).
func eventOf(h http.Header, body []byte) [32]byte {
	for _, id := range []string{"webhook-id", "svix-id", "I-Twilio-Idempotency-Token"} {
		if v := h.Get(id); v != "" {
			return sha256.Sum256([]byte(id + ":" + v))
		}
	}
	if k := adyenItemsKey(body); k != "" {
		return sha256.Sum256([]byte("adyen:" + k))
	}
	return sha256.Sum256(body)
}

// adyenItemsKey identifies an Adyen notification by its items' keys
// (eventCode, pspReference, success: what the preset keys each by), since
// the preset hands the handler only the signed fields of each item, not
// the delivered bytes; "" for any other body.
func adyenItemsKey(body []byte) string {
	var n struct {
		NotificationItems []struct {
			Item struct{ EventCode, PspReference, Success string } `json:"NotificationRequestItem"`
		} `json:"notificationItems"`
	}
	if json.Unmarshal(body, &n) != nil || len(n.NotificationItems) == 0 {
		return ""
	}
	keys := make([]string, len(n.NotificationItems))
	for i, it := range n.NotificationItems {
		keys[i] = idem.JoinKey(it.Item.EventCode, it.Item.PspReference, it.Item.Success)
	}
	return idem.JoinKey(keys[0], keys[1:]...)
}

// Total returns how often the handler ran, for all events.
func (r *Runs) Total() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.all
}

// AssertOnce fails t unless the handler ran exactly once for each of ds,
// and at most once for every other event.
func (r *Runs) AssertOnce(t testing.TB, ds ...*Delivery) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, d := range ds {
		if n := r.byEv[eventOf(d.Header, d.Body)]; n != 1 {
			t.Errorf("idemtest: the handler ran %d times for %s event %s, want once", n, d.Sender, d.ID)
		}
	}
	for _, n := range r.byEv {
		if n > 1 {
			t.Errorf("idemtest: the handler ran %d times for one event", n)
		}
	}
}

// WaitRuns waits until the handler has run total times (for all events)
// or timeout passes, and fails t then. Use it before AssertOnce when the
// handler runs later (an inbox's worker); then wait a little longer than
// a retry would take if you want to see a second run that should not
// happen (AssertOnce counts what ran).
func (r *Runs) WaitRuns(t testing.TB, total int, timeout time.Duration) {
	t.Helper()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		r.mu.Lock()
		n, ch := r.all, r.ch
		r.mu.Unlock()
		if n >= total {
			return
		}
		select {
		case <-ch:
		case <-deadline.C:
			t.Fatalf("idemtest: the handler ran %d times in %v, want %d", n, timeout, total)
		}
	}
}
