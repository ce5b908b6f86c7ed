package idemhttp_test

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemhttp/idemtest"
	"github.com/idemkit/idem/internal/testdb"
)

// wooDelivery is a WooCommerce delivery as WC_Webhook::deliver makes it
// (class-wc-webhook.php, docs/senders.md): body the JSON payload, the
// topic, resource and event headers, X-WC-Webhook-Delivery-ID of the
// second it is made in (WooCommerceDeliveryID), and the signature
// generate_signature makes: base64 HMAC-SHA256 of the body under the
// webhook's secret, computed here as WooCommerce computes it.
func wooDelivery(t *testing.T, secret, salt, topic, body string, at time.Time) *idemtest.Delivery {
	t.Helper()
	m := hmac.New(sha256.New, []byte(secret))
	m.Write([]byte(body))
	sig := base64.StdEncoding.EncodeToString(m.Sum(nil))
	if sig != idemtest.WooCommerceSignature(secret, []byte(body)) {
		t.Fatal("idemtest.WooCommerceSignature is not generate_signature")
	}
	res, ev, _ := strings.Cut(topic, ".")
	id := idemtest.WooCommerceDeliveryID(salt, "7", at)
	return &idemtest.Delivery{Sender: "woocommerce", ID: id, Type: topic, Body: []byte(body), Header: http.Header{
		"Content-Type": {"application/json"}, "User-Agent": {"WooCommerce/9.8.5 Hookshot (WordPress/6.8.1)"},
		"X-Wc-Webhook-Source": {"https://shop.example.com/"}, "X-Wc-Webhook-Topic": {topic}, "X-Wc-Webhook-Resource": {res},
		"X-Wc-Webhook-Event": {ev}, "X-Wc-Webhook-Signature": {sig}, "X-Wc-Webhook-Id": {"7"}, "X-Wc-Webhook-Delivery-Id": {id}}}
}

// wooOrder is an order's REST payload (trimmed) as order.updated carries it.
func wooOrder(id int, status, modified string) string {
	return fmt.Sprintf(`{"id":%d,"parent_id":0,"status":%q,"currency":"EUR","date_modified":%q,"date_modified_gmt":%q,"total":"42.00",`+
		`"_links":{"self":[{"href":"https://shop.example.com/wp-json/wc/v3/orders/%d"}]}}`, id, status, modified, modified, id)
}

// bodyRuns counts the handler's runs per body and topic.
type bodyRuns struct {
	mu sync.Mutex
	n  map[string]int
}

func (b *bodyRuns) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	b.mu.Lock()
	b.n[r.Header.Get("X-WC-Webhook-Topic")+" "+string(body)]++
	b.mu.Unlock()
	w.WriteHeader(http.StatusOK)
}

func (b *bodyRuns) of(d *idemtest.Delivery) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.n[d.Type+" "+string(d.Body)]
}

// TestWooCommerceEventsOfOneSecond: WooCommerce gives every delivery of a
// webhook within one second the same X-WC-Webhook-Delivery-ID. Two
// order.updated of one order in one second (a bulk edit: processing, then
// completed), each correctly signed, both run; so do two orders trashed in
// one second, and one order trashed, restored and trashed again (the same
// {"id":N} body in two seconds). The same request again (a proxy's retry,
// a capture) is answered from the stored answer, and an order.updated
// body re-sent under a fresh delivery id runs nothing. Before, the preset
// keyed by the delivery id and fingerprinted the body: the second
// order.updated was 422 and never ran (WooCommerce counts it as a failure
// and disables the webhook after more than 5).
func TestWooCommerceEventsOfOneSecond(t *testing.T) {
	t.Parallel()
	const secret = "woocommerce webhook secret"
	const salt = "the store's wp_salt('auth')"
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 4), nil)
	mw, err := idemhttp.New(idemhttp.Config{Client: c, Source: "woo-second"}.Apply(idemhttp.WooCommerce(secret)))
	if err != nil {
		t.Fatal(err)
	}
	runs := &bodyRuns{n: map[string]int{}}
	srv := httptest.NewServer(mw(runs))
	t.Cleanup(srv.Close)
	second := time.Date(2026, 11, 28, 5, 0, 0, 0, time.UTC)

	processing := wooDelivery(t, secret, salt, "order.updated", wooOrder(42, "processing", "2026-11-28T05:00:00"), second)
	completed := wooDelivery(t, secret, salt, "order.updated", wooOrder(42, "completed", "2026-11-28T05:00:00"), second)
	trash42 := wooDelivery(t, secret, salt, "order.deleted", `{"id":42}`, second)
	trash43 := wooDelivery(t, secret, salt, "order.deleted", `{"id":43}`, second)
	restored := wooDelivery(t, secret, salt, "order.restored", wooOrder(42, "completed", "2026-11-28T05:00:07"), second.Add(7*time.Second))
	trash42again := wooDelivery(t, secret, salt, "order.deleted", `{"id":42}`, second.Add(9*time.Second))
	if processing.ID != completed.ID || processing.ID != trash43.ID || trash42.ID == trash42again.ID {
		t.Fatal("the deliveries of one second do not share WooCommerce's delivery id")
	}
	events := []*idemtest.Delivery{processing, completed, trash42, trash43, restored, trash42again}
	for i, d := range events {
		resp, body := idemtest.Send(t, srv.URL, d)
		if resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "" {
			t.Fatalf("event %d (%s %s): %d replayed=%q %s; want it run", i+1, d.Type, d.Body, resp.StatusCode, resp.Header.Get(idemhttp.ReplayedHeader), body)
		}
	}
	if n := runs.of(trash42); n != 2 {
		t.Fatalf("order 42 trashed twice: the handler ran %d times, want 2", n)
	}
	for _, d := range []*idemtest.Delivery{processing, completed, trash42again} {
		if resp, _ := idemtest.Send(t, srv.URL, d); resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "true" {
			t.Fatalf("%s %s again: %d replayed=%q, want the stored answer", d.Type, d.Body, resp.StatusCode, resp.Header.Get(idemhttp.ReplayedHeader))
		}
	}
	copied := wooDelivery(t, secret, salt, "order.updated", string(completed.Body), second.Add(time.Hour))
	if resp, _ := idemtest.Send(t, srv.URL, copied); resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Fatalf("an order.updated body under a fresh delivery id: %d replayed=%q, want the stored answer", resp.StatusCode, resp.Header.Get(idemhttp.ReplayedHeader))
	}
	otherStore := idemtest.WooCommerce(secret).Redeliver(completed)
	otherStore.Header.Set("X-WC-Webhook-Source", "https://other.example.com/")
	if resp, _ := idemtest.Send(t, srv.URL, otherStore); resp.StatusCode != http.StatusUnprocessableEntity {
		t.Fatalf("the body with another store's header: %d, want 422", resp.StatusCode)
	}
	for _, d := range []*idemtest.Delivery{processing, completed, trash43, restored} {
		if n := runs.of(d); n != 1 {
			t.Errorf("%s %s ran %d times, want once", d.Type, d.Body, n)
		}
	}
}

// TestWooCommerceActivationPing: when a webhook is saved active,
// WooCommerce posts "webhook_id=N", unsigned, with none of its delivery
// headers (WC_Webhook::deliver_ping), and reports the delivery URL as
// failing unless the answer is 200. The preset answers it 200 without
// claiming, storing or running anything, in synchronous and asynchronous
// mode alike; a request with the ping's body and a WooCommerce header, or
// with any other body, is a delivery and is verified as one (400 unsigned,
// 401 forged). Before, the ping was answered 400.
func TestWooCommerceActivationPing(t *testing.T) {
	t.Parallel()
	const secret = "woocommerce webhook secret"
	pool := testdb.Pool(t, testdb.New(t), 4)
	c := testdb.Client(t, pool, nil)
	runs := idemtest.Count(nil)
	mw, err := idemhttp.New(idemhttp.Config{Client: c, Source: "woo-ping"}.Apply(idemhttp.WooCommerce(secret)))
	if err != nil {
		t.Fatal(err)
	}
	acc := captureAll{ds: make(chan *idemhttp.Delivery, 1)}
	async, err := idemhttp.New(idemhttp.Config{Client: c, Source: "woo-ping-async", Async: acc}.Apply(idemhttp.WooCommerce(secret)))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(runs))
	t.Cleanup(srv.Close)
	asrv := httptest.NewServer(async(runs))
	t.Cleanup(asrv.Close)
	ping := func(u, body string, h http.Header) int {
		req, _ := http.NewRequest(http.MethodPost, u, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.Header.Set("User-Agent", "WooCommerce/9.8.5 Hookshot (WordPress/6.8.1)")
		for k, v := range h {
			req.Header[k] = v
		}
		resp, err := idemtest.Client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, u := range []string{srv.URL, asrv.URL} {
		if code := ping(u, "webhook_id=7", nil); code != 200 {
			t.Fatalf("the activation ping at %s: %d, want 200", u, code)
		}
	}
	for _, tc := range []struct {
		body string
		h    http.Header
		want int
	}{
		{"webhook_id=7", http.Header{"X-Wc-Webhook-Topic": {"order.created"}}, 400},
		{"webhook_id=7", http.Header{"X-Wc-Webhook-Signature": {idemtest.WooCommerceSignature("forger", []byte("webhook_id=7"))}}, 401},
		{"webhook_id=7&x=1", nil, 400},
		{"webhook_id=", nil, 400},
	} {
		if code := ping(srv.URL, tc.body, tc.h); code != tc.want {
			t.Errorf("%q with %v: %d, want %d", tc.body, tc.h, code, tc.want)
		}
	}
	select {
	case d := <-acc.ds:
		t.Fatalf("asynchronous mode accepted the ping: %+v", d)
	default:
	}
	if runs.Total() != 0 || countKeys(t, pool, "woo-ping") != 0 || countKeys(t, pool, "woo-ping-async") != 0 {
		t.Fatalf("the ping ran the handler (%d) or stored a key", runs.Total())
	}
}
