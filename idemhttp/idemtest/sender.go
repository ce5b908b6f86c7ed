// Package idemtest helps test a webhook receiver built with idemhttp: it
// signs deliveries the way each preset's sender does (with the sender's own
// library where there is one), fires duplicates and races at a server with
// a real HTTP client, and counts how often the handler ran for each event.
//
//	stripe := idemtest.Stripe("whsec_test")
//	runs := idemtest.Count(handler)
//	mw, _ := idemhttp.New(idemhttp.Config{Client: c}.Apply(idemhttp.Stripe("whsec_test")))
//	srv := httptest.NewServer(mw(runs))
//	ev := stripe.Event("invoice.paid", `{"id":"in_1"}`)
//	idemtest.Fire(t, srv.URL, ev, 20) // 20 copies at once
//	runs.AssertOnce(t, ev)
//
// See docs/http.md, "Testing your receiver".
package idemtest

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"github.com/stripe/stripe-go/v85/webhook"
)

// A Sender makes signed deliveries as one webhook sender does, for the
// idemhttp preset of the same name and the same secret.
type Sender struct {
	name string
	// event builds a new event's body and headers from its id and type.
	event func(id, typ string, data json.RawMessage) ([]byte, http.Header)
	// sign adds the signature headers of body, signed at at, under the
	// delivery id id.
	sign func(h http.Header, id string, body []byte, at time.Time) error
	// deliveryHeader is the header of the delivery id, when the sender
	// has one apart from the event id ("" for Stripe).
	deliveryHeader string
	// newID makes an event (or delivery) id of the sender's form.
	newID func() string

	// The senders added with the second set of presets (presets.go) say
	// the rest themselves: forge makes the same sender under a key the
	// receiver does not know; resend puts a fresh delivery id into h and
	// returns it; stamp rewrites a body's own signed timestamp (Linear);
	// idOf is the preset's key of a built delivery when it is not the id
	// (Zoom: the body's digest); handshake builds the sender's handshake
	// request; batch: the body is a JSON array of events.
	forge     func() *Sender
	resend    func(h http.Header) string
	stamp     func(body []byte, at time.Time) []byte
	idOf      func(id string, body []byte) string
	query     func(body []byte) string     // Delivery.Query of a body
	join      func(bodies [][]byte) []byte // Batch's body (default: the arrays concatenated)
	handshake func() *Delivery
	stamped   bool
	batch     bool
	// key is what the receiver's preset is given when it is not the
	// secret the sender was made with (a public key).
	key string
}

// A Delivery is one signed delivery of an event: its body and headers as
// the sender sends them. Make one with a Sender's Event, Redeliver or
// Resend; a Delivery is not changed by those (they return new ones).
type Delivery struct {
	// Sender is the sender's name ("stripe", "github", ...).
	Sender string
	// ID is the event's id as the preset keys it: Stripe's "evt_..."
	// (in the body), GitHub's X-GitHub-Delivery, Shopify's
	// X-Shopify-Event-Id, Standard Webhooks' webhook-id.
	ID, Type string
	Body     []byte
	Header   http.Header
	// Query is appended to the URL the delivery is sent to (Twilio's
	// bodySHA256 of a JSON body, a Twilio GET's parameters).
	Query string
	// Method is the request's method: POST when empty (Twilio also sends
	// GET, its parameters in Query).
	Method string
}

// Request returns the delivery to url: a POST, or Method.
func (d *Delivery) Request(ctx context.Context, url string) (*http.Request, error) {
	if d.Query != "" {
		sep := "?"
		if strings.Contains(url, "?") {
			sep = "&"
		}
		url += sep + d.Query
	}
	method := d.Method
	if method == "" {
		method = http.MethodPost
	}
	r, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(d.Body))
	if err != nil {
		return nil, err
	}
	for k, v := range d.Header {
		r.Header[k] = append([]string(nil), v...)
	}
	return r, nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func uuid() string {
	h := randomHex(16)
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

// data is the event's data: the given JSON, or {"id": a fresh id} when
// empty (two real events never carry the same body). It must be JSON;
// Event panics otherwise (a test's own mistake, not the receiver's).
func data(s string) json.RawMessage {
	if s == "" {
		return json.RawMessage(`{"id":"obj_` + randomHex(12) + `"}`)
	}
	if !json.Valid([]byte(s)) {
		panic(fmt.Sprintf("idemtest: event data is not JSON: %.64q", s))
	}
	return json.RawMessage(s)
}

// Event returns a signed delivery of a new event of type typ (a fresh id),
// whose data is the JSON dataJSON ({"id": a fresh object id} when empty):
// for Stripe and Standard Webhooks the body is the sender's envelope
// around it, for GitHub and Shopify the body is dataJSON itself. Give
// GitHub and Shopify events different data, as real ones have: their
// presets take a body delivered before under another id for a copy.
func (s *Sender) Event(typ, dataJSON string) *Delivery {
	id := s.newID()
	body, h := s.event(id, typ, data(dataJSON))
	d := &Delivery{Sender: s.name, ID: id, Type: typ, Body: body, Header: h}
	s.mustSign(d, id)
	if s.query != nil {
		d.Query = s.query(d.Body)
	}
	if s.idOf != nil {
		d.ID = s.idOf(id, d.Body)
	}
	return d
}

// Redeliver returns the sender's retry of d: the same event, body and
// ids, signed again now (a fresh timestamp where the scheme has one). A
// receiver must answer it as a duplicate.
func (s *Sender) Redeliver(d *Delivery) *Delivery {
	r := &Delivery{Sender: d.Sender, ID: d.ID, Type: d.Type, Body: d.Body, Header: d.Header.Clone(), Query: d.Query, Method: d.Method}
	deliveryID := d.ID
	if s.deliveryHeader != "" {
		deliveryID = r.Header.Get(s.deliveryHeader)
	}
	s.mustSign(r, deliveryID)
	return r
}

// Resend returns d's body, genuinely signed, under a fresh delivery id:
// a captured delivery replayed with a new id (for GitHub and Shopify,
// whose signatures cover the body only, anyone holding one delivery can
// do it), which their presets answer as a duplicate (the replay guard).
// For Stripe, whose id is inside the signed body, it is Redeliver. For
// Standard Webhooks, whose signature covers the id, it is a new message
// only the sender can make, and the preset runs it as a new event. Twilio
// (under a fresh I-Twilio-Idempotency-Token) and WooCommerce's deleted and
// custom topics send one signed content as distinct events, told apart by
// that unsigned id alone: their presets run it as a new event too.
func (s *Sender) Resend(d *Delivery) *Delivery {
	if s.deliveryHeader == "" {
		return s.Redeliver(d)
	}
	r := &Delivery{Sender: d.Sender, Type: d.Type, Body: d.Body, Header: d.Header.Clone(), Query: d.Query, Method: d.Method}
	if s.resend != nil {
		// The body as it was signed: whoever re-sends a captured delivery
		// cannot sign a fresh timestamp into it.
		r.ID = s.resend(r.Header)
		s.stampless().mustSign(r, r.ID)
		return r
	}
	id := s.newID()
	switch s.name {
	case "github":
		r.Header.Set("X-GitHub-Delivery", id)
	case "shopify":
		r.Header.Set("X-Shopify-Event-Id", id)
		r.Header.Set("X-Shopify-Webhook-Id", uuid())
	default:
		r.Header.Set("webhook-id", id)
	}
	r.ID = id
	s.mustSign(r, id)
	return r
}

// Forge returns d signed with another secret: a receiver must refuse it
// (idemhttp answers 401) and run nothing.
func (s *Sender) Forge(d *Delivery) *Delivery {
	var wrong Sender
	switch {
	case s.forge != nil:
		wrong = *s.forge()
	case s.name == "stripe":
		wrong = *Stripe("whsec_idemtest_forger")
	case s.name == "github":
		wrong = *GitHub("idemtest forger")
	case s.name == "shopify":
		wrong = *Shopify("idemtest forger")
	default:
		wrong = *StandardWebhooks("whsec_" + base64.StdEncoding.EncodeToString([]byte("idemtest forger's key")))
	}
	return wrong.Redeliver(d)
}

// stampless is s without its body's own timestamp.
func (s *Sender) stampless() *Sender {
	c := *s
	c.stamp = nil
	return &c
}

func (s *Sender) mustSign(d *Delivery, deliveryID string) {
	s.mustSignAt(d, deliveryID, time.Now())
}

func (s *Sender) mustSignAt(d *Delivery, deliveryID string, at time.Time) {
	if s.stamp != nil {
		d.Body = s.stamp(d.Body, at)
	}
	if err := s.sign(d.Header, deliveryID, d.Body, at); err != nil {
		panic("idemtest: " + err.Error()) // a secret the sender's library refused: checked by the constructor
	}
}

// Stripe signs as Stripe does (Stripe-Signature, with stripe-go's
// webhook package), for idemhttp.Stripe(secret). The body is a Stripe
// event: {"id":"evt_...","object":"event","type":typ,"data":{"object":data}}.
func Stripe(secret string) *Sender {
	return &Sender{
		name:  "stripe",
		newID: func() string { return "evt_test_" + randomHex(12) },
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			body, _ := json.Marshal(map[string]any{"id": id, "object": "event", "type": typ, "api_version": "2024-06-20",
				"created": time.Now().Unix(), "livemode": false, "data": map[string]any{"object": data}})
			return body, http.Header{"Content-Type": {"application/json; charset=utf-8"}, "User-Agent": {"Stripe/1.0 (+https://stripe.com/docs/webhooks)"}}
		},
		sign: func(h http.Header, _ string, body []byte, at time.Time) error {
			p := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: body, Secret: secret, Timestamp: at})
			h.Set("Stripe-Signature", p.Header)
			return nil
		},
	}
}

func hmacOf(secret string, body []byte) []byte {
	m := hmac.New(sha256.New, []byte(secret))
	m.Write(body)
	return m.Sum(nil)
}

// GitHub signs as GitHub does (X-Hub-Signature-256), for
// idemhttp.GitHub(secret): the event type in X-GitHub-Event, the id in
// X-GitHub-Delivery, the body the payload itself.
func GitHub(secret string) *Sender {
	return &Sender{
		name: "github", deliveryHeader: "X-GitHub-Delivery", newID: uuid,
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			return data, http.Header{"Content-Type": {"application/json"}, "User-Agent": {"GitHub-Hookshot/idemtest"},
				"X-Github-Event": {typ}, "X-Github-Delivery": {id}, "X-Github-Hook-Id": {"1"}}
		},
		sign: func(h http.Header, _ string, body []byte, _ time.Time) error {
			h.Set("X-Hub-Signature-256", "sha256="+hex.EncodeToString(hmacOf(secret, body)))
			return nil
		},
	}
}

// Shopify signs as Shopify does (X-Shopify-Hmac-Sha256), for
// idemhttp.Shopify(secret): the topic in X-Shopify-Topic, the id in
// X-Shopify-Event-Id (and a delivery's own X-Shopify-Webhook-Id), the
// body the payload itself.
func Shopify(secret string) *Sender {
	return &Sender{
		name: "shopify", deliveryHeader: "X-Shopify-Event-Id", newID: uuid,
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			return data, http.Header{"Content-Type": {"application/json"}, "X-Shopify-Topic": {typ},
				"X-Shopify-Event-Id": {id}, "X-Shopify-Webhook-Id": {uuid()}, "X-Shopify-Shop-Domain": {"idemtest.myshopify.com"},
				"X-Shopify-Triggered-At": {time.Now().UTC().Format(time.RFC3339Nano)}}
		},
		sign: func(h http.Header, _ string, body []byte, _ time.Time) error {
			h.Set("X-Shopify-Hmac-Sha256", base64.StdEncoding.EncodeToString(hmacOf(secret, body)))
			return nil
		},
	}
}

// StandardWebhooks signs as Standard Webhooks senders do (webhook-id,
// webhook-timestamp, webhook-signature, with the standard-webhooks
// library), for idemhttp.StandardWebhooks(secret); secret is
// "whsec_<base64>" (any other panics at the first Event, as a test's own
// mistake).
// The body is {"type":typ,"timestamp":...,"data":data}.
func StandardWebhooks(secret string) *Sender {
	return &Sender{
		name: "webhooks", deliveryHeader: "webhook-id", newID: func() string { return "msg_" + randomHex(12) },
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			body, _ := json.Marshal(map[string]any{"type": typ, "timestamp": time.Now().UTC().Format(time.RFC3339), "data": data})
			return body, http.Header{"Content-Type": {"application/json"}, "Webhook-Id": {id}}
		},
		sign: func(h http.Header, id string, body []byte, at time.Time) error {
			wh, err := standardwebhooks.NewWebhook(secret)
			if err != nil {
				return fmt.Errorf("the Standard Webhooks secret is not whsec_<base64>: %w", err)
			}
			sig, err := wh.Sign(id, at, body)
			if err != nil {
				return err
			}
			h.Set("webhook-id", id)
			h.Set("webhook-timestamp", strconv.FormatInt(at.Unix(), 10))
			h.Set("webhook-signature", sig)
			return nil
		},
	}
}
