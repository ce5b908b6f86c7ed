package idemhttp_test

import (
	"context"
	"fmt"
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem/idemhttp"
)

// Example deliveries as the senders document them.
var (
	// Stripe: an Event object, the id is the idempotency key.
	stripeEvent = `{
  "id": "evt_1NG8Du2eZvKYlo2CUI79vXWy",
  "object": "event",
  "api_version": "2019-02-19",
  "created": 1686089970,
  "data": {"object": {"id": "in_1NG8Du2eZvKYlo2C6Ipfo8cX", "object": "invoice", "amount_paid": 4200, "currency": "usd", "customer": "cus_9s6XKzkNRiz8i3", "status": "paid"}},
  "livemode": false,
  "pending_webhooks": 0,
  "request": {"id": null, "idempotency_key": null},
  "type": "invoice.paid"
}`
	// GitHub: the delivery GUID and event name are headers.
	githubHeaders = map[string]string{
		"X-GitHub-Delivery":   "72d3162e-cc78-11e3-81ab-4c9367dc0958",
		"X-GitHub-Event":      "issues",
		"X-GitHub-Hook-ID":    "292430182",
		"X-Hub-Signature-256": "sha256=d57c68ca6f92289e6987922ff26938930f6e66a2d161ef06abdf1859230aa23c",
		"User-Agent":          "GitHub-Hookshot/044aadd",
		"Content-Type":        "application/json",
	}
	githubBody = `{"action":"opened","issue":{"url":"https://api.github.com/repos/octocat/Hello-World/issues/1347","number":1347},"repository":{"id":1296269,"full_name":"octocat/Hello-World"},"sender":{"login":"octocat","id":1}}`
	// Shopify: X-Shopify-Event-Id is the same for every delivery of one event.
	shopifyHeaders = map[string]string{
		"X-Shopify-Topic":        "orders/create",
		"X-Shopify-Hmac-Sha256":  "XWmrwMey6OsLMeiZKwP4FppHH3cmAiiJJAweH5Jo4bM=",
		"X-Shopify-Shop-Domain":  "johns-apparel.myshopify.com",
		"X-Shopify-API-Version":  "2024-07",
		"X-Shopify-Webhook-Id":   "b54557e4-bdd9-4b37-8a5f-bf7d70bcd043",
		"X-Shopify-Triggered-At": "2023-03-29T18:00:27.877041743Z",
		"X-Shopify-Event-Id":     "98880550-7158-44d4-b7cd-2c97c8a091b5",
	}
	shopifyBody = `{"id":820982911946154508,"email":"jon@example.com","total_price":"403.00","currency":"USD"}`
	// Standard Webhooks (and Svix, which writes svix-id).
	standardHeaders = map[string]string{
		"webhook-id":        "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W",
		"webhook-timestamp": "1674087231",
		"webhook-signature": "v1,K5oZfzN95Z9UVu1EsfQmfVNQhnkZ2pj9o9NDN/H/pI4=",
	}
	svixHeaders = map[string]string{
		"svix-id":        "msg_p5jXN8AQM9LWM0D4loKWxJek",
		"svix-timestamp": "1614265330",
		"svix-signature": "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
	}
	standardBody = `{"type":"contact.created","timestamp":"2022-11-03T20:26:10.344522Z","data":{"id":"1f81eb52-5198-4599-803e-771906343485","type":"contact"}}`
)

func TestPresets(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name      string
		preset    idemhttp.Preset
		headers   map[string]string
		body      string
		source    string
		key       string
		eventType string
	}{
		{"stripe", idemhttp.Stripe(), map[string]string{"Stripe-Signature": "t=1686089970,v1=5257a869e7ec"}, stripeEvent, "stripe", "evt_1NG8Du2eZvKYlo2CUI79vXWy", "invoice.paid"},
		{"github", idemhttp.GitHub(), githubHeaders, githubBody, "github", "72d3162e-cc78-11e3-81ab-4c9367dc0958", "issues"},
		{"shopify", idemhttp.Shopify(), shopifyHeaders, shopifyBody, "shopify", "98880550-7158-44d4-b7cd-2c97c8a091b5", "orders/create"},
		{"standard webhooks", idemhttp.StandardWebhooks(), standardHeaders, standardBody, "webhooks", "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", "contact.created"},
		{"svix", idemhttp.StandardWebhooks(), svixHeaders, standardBody, "webhooks", "msg_p5jXN8AQM9LWM0D4loKWxJek", "contact.created"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var runs atomic.Int64
			srv, pool := setup(t, idemhttp.Config{}.Apply(tc.preset), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				fmt.Fprint(w, `{"received":true}`)
			}))
			first := send(t, srv, "POST", "/webhooks", tc.body, tc.headers)
			// The sender redelivers: same headers, same body.
			again := send(t, srv, "POST", "/webhooks", tc.body, tc.headers)
			if first.status != 200 || again.status != 200 || again.header.Get(idemhttp.ReplayedHeader) != "true" || runs.Load() != 1 {
				t.Fatalf("first %+v, redelivery %+v, handler ran %d times", first, again, runs.Load())
			}
			var source, key, eventType string
			if err := pool.QueryRow(context.Background(), `SELECT source, key, event_type FROM idem.processed_events`).Scan(&source, &key, &eventType); err != nil {
				t.Fatal(err)
			}
			if source != tc.source || key != tc.key || eventType != tc.eventType {
				t.Fatalf("stored %s/%s (%s), want %s/%s (%s)", source, key, eventType, tc.source, tc.key, tc.eventType)
			}
		})
	}
	t.Run("stripe keeps keys past its retry window", func(t *testing.T) {
		t.Parallel()
		srv, pool := setup(t, idemhttp.Config{}.Apply(idemhttp.Stripe()), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
		send(t, srv, "POST", "/", stripeEvent, nil)
		var days float64
		if err := pool.QueryRow(context.Background(), `SELECT extract(epoch FROM expires_at - first_seen) / 86400 FROM idem.processed_events`).Scan(&days); err != nil {
			t.Fatal(err)
		}
		if days < 2*3 {
			t.Fatalf("stripe keys kept %.1f days, want more than twice the 3-day retry window", days)
		}
	})
	t.Run("no id in a stripe body is 400", func(t *testing.T) {
		t.Parallel()
		srv, _ := setup(t, idemhttp.Config{}.Apply(idemhttp.Stripe()), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
		requireProblem(t, send(t, srv, "POST", "/", `{"object":"event"}`, nil), http.StatusBadRequest)
		requireProblem(t, send(t, srv, "POST", "/", `not json`, nil), http.StatusBadRequest)
	})
	t.Run("custom extractor", func(t *testing.T) {
		t.Parallel()
		cfg := idemhttp.Config{Source: "queue", Key: func(r *http.Request, _ []byte) (string, string, error) {
			return r.URL.Query().Get("msg"), "job", nil
		}}
		var runs atomic.Int64
		srv, _ := setup(t, cfg, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs.Add(1) }))
		send(t, srv, "POST", "/?msg=m1", "", nil)
		send(t, srv, "POST", "/?msg=m1", "", nil)
		if runs.Load() != 1 {
			t.Fatalf("custom key: handler ran %d times", runs.Load())
		}
	})
}
