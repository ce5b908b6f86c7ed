package idemhttp_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"maps"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"github.com/stripe/stripe-go/v85/webhook"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/testdb"
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
		"X-GitHub-Delivery": "72d3162e-cc78-11e3-81ab-4c9367dc0958",
		"X-GitHub-Event":    "issues",
		"X-GitHub-Hook-ID":  "292430182",
		"User-Agent":        "GitHub-Hookshot/044aadd",
		"Content-Type":      "application/json",
	}
	githubBody = `{"action":"opened","issue":{"url":"https://api.github.com/repos/octocat/Hello-World/issues/1347","number":1347},"repository":{"id":1296269,"full_name":"octocat/Hello-World"},"sender":{"login":"octocat","id":1}}`
	// Shopify: X-Shopify-Event-Id is the same for every delivery of one event.
	shopifyHeaders = map[string]string{
		"X-Shopify-Topic":        "orders/create",
		"X-Shopify-Shop-Domain":  "johns-apparel.myshopify.com",
		"X-Shopify-API-Version":  "2024-07",
		"X-Shopify-Webhook-Id":   "b54557e4-bdd9-4b37-8a5f-bf7d70bcd043",
		"X-Shopify-Triggered-At": "2023-03-29T18:00:27.877041743Z",
		"X-Shopify-Event-Id":     "98880550-7158-44d4-b7cd-2c97c8a091b5",
	}
	shopifyBody  = `{"id":820982911946154508,"email":"jon@example.com","total_price":"403.00","currency":"USD"}`
	standardBody = `{"type":"contact.created","timestamp":"2022-11-03T20:26:10.344522Z","data":{"id":"1f81eb52-5198-4599-803e-771906343485","type":"contact"}}`
)

// sender is one webhook sender as the tests play it: its preset, how it
// signs a delivery (with its own library where it has one), and where the
// event id lives.
type sender struct {
	name      string
	preset    func(secrets ...string) idemhttp.Preset
	secret    string
	wrong     string
	sign      func(secret, body string, at time.Time) map[string]string // the signature headers
	headers   map[string]string                                         // the other headers (key, type)
	body      string
	source    string
	key       string
	eventType string
	stamped   bool   // the signature covers a timestamp (stale deliveries are refused)
	sigHeader string // the header a forger would tamper with
}

func hmacHex(secret, body string) string {
	m := hmac.New(sha256.New, []byte(secret))
	m.Write([]byte(body))
	return hex.EncodeToString(m.Sum(nil))
}

func hmacBase64(secret, body string) string {
	m := hmac.New(sha256.New, []byte(secret))
	m.Write([]byte(body))
	return base64.StdEncoding.EncodeToString(m.Sum(nil))
}

func standardSign(id string) func(secret, body string, at time.Time) map[string]string {
	return func(secret, body string, at time.Time) map[string]string {
		wh, err := standardwebhooks.NewWebhook(secret)
		if err != nil {
			panic(err)
		}
		sig, err := wh.Sign(id, at, []byte(body))
		if err != nil {
			panic(err)
		}
		return map[string]string{"webhook-id": id, "webhook-timestamp": strconv.FormatInt(at.Unix(), 10), "webhook-signature": sig}
	}
}

var senders = []sender{
	{
		name: "stripe", preset: idemhttp.Stripe, secret: "whsec_test_genuine", wrong: "whsec_test_forger",
		sign: func(secret, body string, at time.Time) map[string]string {
			p := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: []byte(body), Secret: secret, Timestamp: at})
			return map[string]string{"Stripe-Signature": p.Header}
		},
		body: stripeEvent, source: "stripe", key: "evt_1NG8Du2eZvKYlo2CUI79vXWy", eventType: "invoice.paid",
		stamped: true, sigHeader: "Stripe-Signature",
	},
	{
		name: "github", preset: idemhttp.GitHub, secret: "It's a Secret to Everybody", wrong: "not the secret",
		sign: func(secret, body string, _ time.Time) map[string]string {
			return map[string]string{"X-Hub-Signature-256": "sha256=" + hmacHex(secret, body)}
		},
		headers: githubHeaders, body: githubBody, source: "github", key: "72d3162e-cc78-11e3-81ab-4c9367dc0958", eventType: "issues",
		sigHeader: "X-Hub-Signature-256",
	},
	{
		name: "shopify", preset: idemhttp.Shopify, secret: "shpss_genuine", wrong: "shpss_forger",
		sign: func(secret, body string, _ time.Time) map[string]string {
			return map[string]string{"X-Shopify-Hmac-Sha256": hmacBase64(secret, body)}
		},
		headers: shopifyHeaders, body: shopifyBody, source: "shopify", key: "98880550-7158-44d4-b7cd-2c97c8a091b5", eventType: "orders/create",
		sigHeader: "X-Shopify-Hmac-Sha256",
	},
	{
		name: "standard webhooks", preset: idemhttp.StandardWebhooks,
		secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", wrong: "whsec_" + base64.StdEncoding.EncodeToString([]byte("forger's key")),
		sign: standardSign("msg_2KWPBgLlAfxdpx2AI54pPJ85f4W"),
		body: standardBody, source: "webhooks", key: "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", eventType: "contact.created",
		stamped: true, sigHeader: "webhook-signature",
	},
	{
		name: "svix", preset: idemhttp.StandardWebhooks,
		secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", wrong: "whsec_" + base64.StdEncoding.EncodeToString([]byte("forger's key")),
		sign: func(secret, body string, at time.Time) map[string]string {
			h := standardSign("msg_p5jXN8AQM9LWM0D4loKWxJek")(secret, body, at)
			return map[string]string{"svix-id": h["webhook-id"], "svix-timestamp": h["webhook-timestamp"], "svix-signature": h["webhook-signature"]}
		},
		body: standardBody, source: "webhooks", key: "msg_p5jXN8AQM9LWM0D4loKWxJek", eventType: "contact.created",
		stamped: true, sigHeader: "svix-signature",
	},
}

func (s sender) delivery(secret, body string, at time.Time) map[string]string {
	h := maps.Clone(s.headers)
	if h == nil {
		h = map[string]string{}
	}
	maps.Copy(h, s.sign(secret, body, at))
	return h
}

// TestPresets: each sender's genuine delivery runs the handler once and
// its redelivery is replayed; what is stored is the sender's event id.
func TestPresets(t *testing.T) {
	t.Parallel()
	for _, tc := range senders {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var runs atomic.Int64
			srv, pool := setup(t, idemhttp.Config{}.Apply(tc.preset(tc.secret)), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				fmt.Fprint(w, `{"received":true}`)
			}))
			headers := tc.delivery(tc.secret, tc.body, time.Now())
			first := send(t, srv, "POST", "/webhooks", tc.body, headers)
			// The sender redelivers: same headers, same body.
			again := send(t, srv, "POST", "/webhooks", tc.body, headers)
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
		stripe := senders[0]
		srv, pool := setup(t, idemhttp.Config{}.Apply(idemhttp.Stripe(stripe.secret)), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
		send(t, srv, "POST", "/", stripeEvent, stripe.delivery(stripe.secret, stripeEvent, time.Now()))
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
		stripe := senders[0]
		srv, _ := setup(t, idemhttp.Config{}.Apply(idemhttp.Stripe(stripe.secret)), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
		for _, b := range []string{`{"object":"event"}`, `not json`} {
			requireProblem(t, send(t, srv, "POST", "/", b, stripe.delivery(stripe.secret, b, time.Now())), http.StatusBadRequest)
		}
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

// TestForgedDeliveries: per preset, a wrong secret, a tampered body, a
// stale timestamp, a missing and a malformed signature header each get a
// 4xx, the handler does not run and nothing is stored; the genuine
// delivery that follows any number of forged ones with the same event id
// is processed exactly once.
func TestForgedDeliveries(t *testing.T) {
	t.Parallel()
	for _, tc := range senders {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var runs atomic.Int64
			srv, pool := setup(t, idemhttp.Config{}.Apply(tc.preset(tc.secret)), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				fmt.Fprint(w, `{"received":true}`)
			}))
			now := time.Now()
			tampered := strings.Replace(tc.body, `"`, `"x`, 1)
			forged := map[string]map[string]string{
				"wrong secret":  tc.delivery(tc.wrong, tc.body, now),
				"tampered body": tc.delivery(tc.secret, tc.body, now), // sent with the tampered body below
				"missing":       tc.headers,
				"malformed":     maps.Clone(tc.delivery(tc.secret, tc.body, now)),
			}
			forged["malformed"][tc.sigHeader] = "%%%not-a-signature"
			if tc.stamped {
				forged["stale (10 minutes)"] = tc.delivery(tc.secret, tc.body, now.Add(-10*time.Minute))
			}
			for round := range 3 {
				for name, h := range forged {
					b := tc.body
					if name == "tampered body" {
						b = tampered
					}
					r := send(t, srv, "POST", "/webhooks", b, h)
					if r.status != http.StatusUnauthorized && r.status != http.StatusBadRequest {
						t.Fatalf("round %d, %s: %d %s, want 400 or 401", round, name, r.status, r.body)
					}
					if ct := r.header.Get("Content-Type"); ct != "application/problem+json" {
						t.Fatalf("%s: Content-Type %q", name, ct)
					}
				}
			}
			if runs.Load() != 0 {
				t.Fatalf("the handler ran %d times for forged deliveries", runs.Load())
			}
			var rows int
			if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM idem.processed_events`).Scan(&rows); err != nil || rows != 0 {
				t.Fatalf("forged deliveries stored %d rows (%v)", rows, err)
			}
			genuine := tc.delivery(tc.secret, tc.body, time.Now())
			first := send(t, srv, "POST", "/webhooks", tc.body, genuine)
			again := send(t, srv, "POST", "/webhooks", tc.body, genuine)
			if first.status != 200 || again.header.Get(idemhttp.ReplayedHeader) != "true" || runs.Load() != 1 {
				t.Fatalf("genuine after forgeries: %d, redelivery %d (replayed %q), handler ran %d times",
					first.status, again.status, again.header.Get(idemhttp.ReplayedHeader), runs.Load())
			}
		})
	}
}

// TestSecretRotation: two secrets at once (the old one while the new one
// rolls out) both verify; Stripe also signs with both in one header.
func TestSecretRotation(t *testing.T) {
	t.Parallel()
	stripe := senders[0]
	var runs atomic.Int64
	srv, _ := setup(t, idemhttp.Config{}.Apply(idemhttp.Stripe("whsec_new", "whsec_old")), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
	}))
	for i, secret := range []string{"whsec_old", "whsec_new"} {
		b := strings.Replace(stripe.body, "evt_1NG8Du2eZvKYlo2CUI79vXWy", fmt.Sprintf("evt_rot_%d", i), 1)
		if r := send(t, srv, "POST", "/", b, stripe.delivery(secret, b, time.Now())); r.status != 200 {
			t.Fatalf("signed with %s: %d %s", secret, r.status, r.body)
		}
	}
	// Stripe's own rotation: one header, a v1 signature per secret.
	b := strings.Replace(stripe.body, "evt_1NG8Du2eZvKYlo2CUI79vXWy", "evt_rot_both", 1)
	now := time.Now()
	header := fmt.Sprintf("t=%d,v1=%s,v1=%s", now.Unix(),
		hex.EncodeToString(webhook.ComputeSignature(now, []byte(b), "whsec_unknown")),
		hex.EncodeToString(webhook.ComputeSignature(now, []byte(b), "whsec_new")))
	if r := send(t, srv, "POST", "/", b, map[string]string{"Stripe-Signature": header}); r.status != 200 {
		t.Fatalf("two v1 signatures: %d %s", r.status, r.body)
	}
	if runs.Load() != 3 {
		t.Fatalf("handler ran %d times, want 3", runs.Load())
	}
}

// TestGitHubDocumentedSignature: the example in GitHub's documentation
// ("Validating webhook deliveries").
func TestGitHubDocumentedSignature(t *testing.T) {
	t.Parallel()
	r, _ := http.NewRequest("POST", "/", nil)
	r.Header.Set("X-Hub-Signature-256", "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17")
	v, err := idemhttp.GitHubVerifier("It's a Secret to Everybody")
	if err != nil {
		t.Fatal(err)
	}
	if err := v(r, []byte("Hello, World!")); err != nil {
		t.Fatal(err)
	}
}

// TestPresetWithoutSecret: a preset with no secret refuses to start unless
// verification is said to happen upstream.
func TestPresetWithoutSecret(t *testing.T) {
	t.Parallel()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 1), nil)
	for _, p := range []idemhttp.Preset{idemhttp.Stripe(), idemhttp.GitHub(), idemhttp.Shopify(), idemhttp.StandardWebhooks()} {
		if _, err := idemhttp.New(idemhttp.Config{Client: c}.Apply(p)); err == nil || !strings.Contains(err.Error(), "VerifiedUpstream") {
			t.Errorf("no secret: %v, want a refusal naming VerifiedUpstream", err)
		}
		if _, err := idemhttp.New(idemhttp.Config{Client: c, VerifiedUpstream: true}.Apply(p)); err != nil {
			t.Errorf("VerifiedUpstream: %v", err)
		}
	}
	for _, bad := range []idemhttp.Preset{idemhttp.Stripe(""), idemhttp.StandardWebhooks("not base64!")} {
		if _, err := idemhttp.New(idemhttp.Config{Client: c}.Apply(bad)); err == nil {
			t.Error("a bad secret was accepted")
		}
	}
}
