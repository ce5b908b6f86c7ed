package idemtest

import (
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/hmac"
	"crypto/md5"
	"crypto/rand"
	"crypto/sha1"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// The senders of the second set of presets. Each signs as its sender
// documents it; the test module idemhttp/internal/sendersigned checks
// these signatures against the senders' own libraries where they publish
// one (docs/senders.md names them per row).

// VerificationKey is what the receiver's preset is given for this sender:
// the secret the sender was made with, or, for SendGrid and Discord, the
// public key of the key pair the sender made.
func (s *Sender) VerificationKey(secret string) string {
	if s.key != "" {
		return s.key
	}
	return secret
}

// SignsTime reports whether the sender's signature covers a timestamp, so
// that Stale deliveries are refused.
func (s *Sender) SignsTime() bool { return s.stamped || s.name == "stripe" || s.name == "webhooks" }

// Stale returns d signed again as of age ago (its own timestamp where the
// body carries one): a receiver refuses it when age is past its tolerance
// and the sender signs a timestamp (SignsTime).
func (s *Sender) Stale(d *Delivery, age time.Duration) *Delivery {
	r := &Delivery{Sender: d.Sender, ID: d.ID, Type: d.Type, Body: d.Body, Header: d.Header.Clone(), Query: d.Query}
	id := d.ID
	if s.deliveryHeader != "" {
		id = r.Header.Get(s.deliveryHeader)
	}
	s.mustSignAt(r, id, time.Now().Add(-age))
	return r
}

// Handshake returns the sender's signed handshake request (Slack's
// url_verification, Zoom's endpoint.url_validation, Twitch's
// webhook_callback_verification, Discord's PING), or nil when the sender
// has none. The preset answers it; the handler never sees it.
func (s *Sender) Handshake() *Delivery {
	if s.handshake == nil {
		return nil
	}
	return s.handshake()
}

// Batch returns one signed delivery holding every event of ds, in order
// (SendGrid, HubSpot: a JSON array of events per request). Its ID is "".
func (s *Sender) Batch(ds ...*Delivery) *Delivery {
	if s.join != nil {
		bodies := make([][]byte, len(ds))
		for i, d := range ds {
			bodies[i] = d.Body
		}
		b := &Delivery{Sender: s.name, Type: "batch", Body: s.join(bodies), Header: ds[0].Header.Clone()}
		s.mustSign(b, "")
		return b
	}
	var all []json.RawMessage
	for _, d := range ds {
		var evs []json.RawMessage
		if err := json.Unmarshal(d.Body, &evs); err != nil {
			panic("idemtest: Batch of a delivery that is not a batch: " + err.Error())
		}
		all = append(all, evs...)
	}
	body, _ := json.Marshal(all)
	b := &Delivery{Sender: s.name, Type: "batch", Body: body, Header: ds[0].Header.Clone()}
	s.mustSign(b, "")
	return b
}

// IsBatch reports whether the sender's deliveries are arrays of events.
func (s *Sender) IsBatch() bool { return s.batch }

func hmac256(secret string, parts ...string) []byte {
	m := hmac.New(sha256.New, []byte(secret))
	for _, p := range parts {
		m.Write([]byte(p))
	}
	return m.Sum(nil)
}

func hmac1(secret string, parts ...string) []byte {
	m := hmac.New(sha1.New, []byte(secret))
	for _, p := range parts {
		m.Write([]byte(p))
	}
	return m.Sum(nil)
}

func marshal(v any) []byte {
	b, _ := json.Marshal(v)
	return b
}

func now() int64 { return time.Now().Unix() }

// Slack signs as Slack's request signing does (X-Slack-Signature, v0), for
// idemhttp.Slack(secret): Events API event_callback bodies keyed by
// event_id; its Handshake is url_verification.
func Slack(secret string) *Sender {
	s := &Sender{name: "slack", stamped: true, newID: func() string { return "Ev" + strings.ToUpper(randomHex(5)) },
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			return marshal(map[string]any{"token": "idemtest", "team_id": "T0001", "api_app_id": "A0001",
					"event": map[string]any{"type": typ, "item": data}, "type": "event_callback", "event_id": id, "event_time": now()}),
				http.Header{"Content-Type": {"application/json"}, "User-Agent": {"Slackbot 1.0 (+https://api.slack.com/robots)"}}
		},
		sign: func(h http.Header, _ string, body []byte, at time.Time) error {
			ts := strconv.FormatInt(at.Unix(), 10)
			h.Set("X-Slack-Request-Timestamp", ts)
			h.Set("X-Slack-Signature", "v0="+hex.EncodeToString(hmac256(secret, "v0:", ts, ":", string(body))))
			return nil
		},
		forge: func() *Sender { return Slack("idemtest forger") }}
	s.handshake = func() *Delivery {
		d := &Delivery{Sender: "slack", Type: "url_verification", Header: http.Header{"Content-Type": {"application/json"}},
			Body: marshal(map[string]string{"token": "idemtest", "challenge": "challenge-" + randomHex(8), "type": "url_verification"})}
		s.mustSign(d, "")
		return d
	}
	return s
}

// Zoom signs as Zoom does (x-zm-signature, v0), for idemhttp.Zoom(secret):
// events carry no id, so a Delivery's ID is the preset's key, the SHA-256
// of the body; its Handshake is endpoint.url_validation.
func Zoom(secret string) *Sender {
	s := &Sender{name: "zoom", stamped: true, newID: func() string { return randomHex(8) },
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			return marshal(map[string]any{"event": typ, "event_ts": time.Now().UnixMilli(),
				"payload": map[string]any{"account_id": "idemtest-" + id, "object": data}}), http.Header{"Content-Type": {"application/json"}}
		},
		sign: func(h http.Header, _ string, body []byte, at time.Time) error {
			ts := strconv.FormatInt(at.Unix(), 10)
			h.Set("x-zm-request-timestamp", ts)
			h.Set("x-zm-signature", "v0="+hex.EncodeToString(hmac256(secret, "v0:", ts, ":", string(body))))
			return nil
		},
		idOf: func(_ string, body []byte) string {
			d := sha256.Sum256(body)
			return "sha256:" + hex.EncodeToString(d[:])
		},
		forge: func() *Sender { return Zoom("idemtest forger") }}
	s.handshake = func() *Delivery {
		d := &Delivery{Sender: "zoom", Type: "endpoint.url_validation", Header: http.Header{"Content-Type": {"application/json"}},
			Body: marshal(map[string]any{"event": "endpoint.url_validation", "event_ts": time.Now().UnixMilli(),
				"payload": map[string]string{"plainToken": "plain-" + randomHex(8)}})}
		s.mustSign(d, "")
		return d
	}
	return s
}

// ZoomEncryptedToken is the answer Zoom expects to an endpoint validation
// with plainToken: the hex HMAC-SHA256 of it under the secret token.
func ZoomEncryptedToken(secret, plainToken string) string {
	return hex.EncodeToString(hmac256(secret, plainToken))
}

// Twitch signs EventSub notifications as Twitch does
// (Twitch-Eventsub-Message-Signature over the message id, timestamp and
// body), for idemhttp.Twitch(secret); its Handshake is the
// webhook_callback_verification.
func Twitch(secret string) *Sender {
	s := &Sender{name: "twitch", stamped: true, deliveryHeader: "Twitch-Eventsub-Message-Id", newID: uuid,
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			return marshal(map[string]any{"subscription": twitchSub(typ), "event": data}), http.Header{"Content-Type": {"application/json"},
				"Twitch-Eventsub-Message-Id": {id}, "Twitch-Eventsub-Message-Type": {"notification"},
				"Twitch-Eventsub-Subscription-Type": {typ}, "Twitch-Eventsub-Subscription-Version": {"1"}}
		},
		sign: func(h http.Header, id string, body []byte, at time.Time) error {
			ts := at.UTC().Format(time.RFC3339Nano)
			h.Set("Twitch-Eventsub-Message-Id", id)
			h.Set("Twitch-Eventsub-Message-Timestamp", ts)
			h.Set("Twitch-Eventsub-Message-Signature", "sha256="+hex.EncodeToString(hmac256(secret, id, ts, string(body))))
			return nil
		},
		resend: func(h http.Header) string {
			id := uuid()
			h.Set("Twitch-Eventsub-Message-Id", id)
			return id
		},
		forge: func() *Sender { return Twitch("idemtest forger") }}
	s.handshake = func() *Delivery {
		id := uuid()
		d := &Delivery{Sender: "twitch", ID: id, Type: "webhook_callback_verification",
			Header: http.Header{"Content-Type": {"application/json"}, "Twitch-Eventsub-Message-Type": {"webhook_callback_verification"}},
			Body:   marshal(map[string]any{"challenge": "challenge-" + randomHex(8), "subscription": twitchSub("channel.follow")})}
		s.mustSign(d, id)
		return d
	}
	return s
}

func twitchSub(typ string) map[string]any {
	return map[string]any{"id": uuid(), "status": "enabled", "type": typ, "version": "1", "cost": 0,
		"condition": map[string]string{"broadcaster_user_id": "1337"}, "transport": map[string]string{"method": "webhook", "callback": "https://example.com/webhooks/twitch"},
		"created_at": time.Now().UTC().Format(time.RFC3339Nano)}
}

// Discord signs interactions as Discord does (Ed25519 over
// X-Signature-Timestamp and the body) with a key pair of its own; give
// idemhttp.Discord its VerificationKey (the hex public key). Its
// Handshake is a PING.
func Discord() *Sender {
	pub, priv, _ := ed25519.GenerateKey(rand.Reader)
	s := &Sender{name: "discord", stamped: true, key: hex.EncodeToString(pub), newID: func() string { return strconv.FormatUint(uint64(time.Now().UnixNano())>>1, 10) + randomDigits(3) },
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			return marshal(map[string]any{"id": id, "application_id": "1000000000000000001", "type": 2, "token": "tok-" + randomHex(8),
				"version": 1, "data": map[string]any{"name": typ, "options": data}}), http.Header{"Content-Type": {"application/json"}}
		},
		sign: func(h http.Header, _ string, body []byte, at time.Time) error {
			ts := strconv.FormatInt(at.Unix(), 10)
			h.Set("X-Signature-Timestamp", ts)
			h.Set("X-Signature-Ed25519", hex.EncodeToString(ed25519.Sign(priv, append([]byte(ts), body...))))
			return nil
		},
		forge: Discord}
	s.handshake = func() *Delivery {
		d := &Delivery{Sender: "discord", Type: "1", Header: http.Header{"Content-Type": {"application/json"}},
			Body: marshal(map[string]any{"id": s.newID(), "application_id": "1000000000000000001", "type": 1, "token": "tok", "version": 1})}
		s.mustSign(d, "")
		return d
	}
	return s
}

func randomDigits(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	for i := range b {
		b[i] = '0' + b[i]%10
	}
	return string(b)
}

// Paddle signs as Paddle Billing does (Paddle-Signature: ts and h1), for
// idemhttp.Paddle(secret).
func Paddle(secret string) *Sender {
	return &Sender{name: "paddle", stamped: true, newID: func() string { return "evt_" + randomHex(13) },
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			return marshal(map[string]any{"event_id": id, "event_type": typ, "occurred_at": time.Now().UTC().Format(time.RFC3339Nano),
				"notification_id": "ntf_" + randomHex(13), "data": data}), http.Header{"Content-Type": {"application/json"}}
		},
		sign: func(h http.Header, _ string, body []byte, at time.Time) error {
			ts := strconv.FormatInt(at.Unix(), 10)
			h.Set("Paddle-Signature", "ts="+ts+";h1="+hex.EncodeToString(hmac256(secret, ts, ":", string(body))))
			return nil
		},
		forge: func() *Sender { return Paddle("pdl_ntfset_idemtest_forger") }}
}

// PagerDuty signs v3 webhooks as PagerDuty does (X-PagerDuty-Signature:
// v1=), for idemhttp.PagerDuty(secret).
func PagerDuty(secret string) *Sender {
	return &Sender{name: "pagerduty", newID: func() string { return "01" + strings.ToUpper(randomHex(12)) },
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			return marshal(map[string]any{"event": map[string]any{"id": id, "event_type": typ, "resource_type": "incident",
					"occurred_at": time.Now().UTC().Format(time.RFC3339), "agent": nil, "client": nil, "data": data}}),
				http.Header{"Content-Type": {"application/json"}, "X-Webhook-Id": {uuid()}, "X-Webhook-Subscription": {"PSUB001"}}
		},
		sign: func(h http.Header, _ string, body []byte, _ time.Time) error {
			h.Set("X-PagerDuty-Signature", "v1="+hex.EncodeToString(hmac256(secret, string(body))))
			return nil
		},
		forge: func() *Sender { return PagerDuty("idemtest forger") }}
}

// Typeform signs as Typeform does (Typeform-Signature: sha256=base64),
// for idemhttp.Typeform(secret).
func Typeform(secret string) *Sender {
	return &Sender{name: "typeform", newID: func() string { return strings.ToUpper(randomHex(13)) },
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			return marshal(map[string]any{"event_id": id, "event_type": typ, "form_response": data}), http.Header{"Content-Type": {"application/json"}}
		},
		sign: func(h http.Header, _ string, body []byte, _ time.Time) error {
			h.Set("Typeform-Signature", "sha256="+base64.StdEncoding.EncodeToString(hmac256(secret, string(body))))
			return nil
		},
		forge: func() *Sender { return Typeform("idemtest forger") }}
}

// Intercom signs as Intercom does (X-Hub-Signature: sha1=hex), for
// idemhttp.Intercom(clientSecret).
func Intercom(clientSecret string) *Sender {
	return &Sender{name: "intercom", newID: func() string { return "notif_" + uuid() },
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			return marshal(map[string]any{"type": "notification_event", "app_id": "idemtest", "id": id, "topic": typ,
					"data": map[string]any{"type": "notification_event_data", "item": data}, "created_at": now()}),
				http.Header{"Content-Type": {"application/json"}}
		},
		sign: func(h http.Header, _ string, body []byte, _ time.Time) error {
			h.Set("X-Hub-Signature", "sha1="+hex.EncodeToString(hmac1(clientSecret, string(body))))
			return nil
		},
		forge: func() *Sender { return Intercom("idemtest forger") }}
}

// WooCommerce signs as WooCommerce does (X-WC-Webhook-Signature), for
// idemhttp.WooCommerce(secret): the topic in X-WC-Webhook-Topic, the body
// the resource itself, and X-WC-Webhook-Delivery-ID made as WooCommerce
// makes it, wp_hash(webhook id . the current second)
// (WooCommerceDeliveryID): every event of one second has the same one.
func WooCommerce(secret string) *Sender {
	salt := randomHex(32) // the store's wp_salt('auth')
	return &Sender{name: "woocommerce", deliveryHeader: "X-WC-Webhook-Delivery-ID",
		newID: func() string { return WooCommerceDeliveryID(salt, "7", time.Now()) },
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			res, ev, _ := strings.Cut(typ, ".")
			return data, http.Header{"Content-Type": {"application/json"}, "X-Wc-Webhook-Topic": {typ}, "X-Wc-Webhook-Resource": {res},
				"X-Wc-Webhook-Event": {ev}, "X-Wc-Webhook-Source": {"https://shop.example.com/"}, "X-Wc-Webhook-Id": {"7"}, "X-Wc-Webhook-Delivery-Id": {id}}
		},
		sign: func(h http.Header, _ string, body []byte, _ time.Time) error {
			h.Set("X-WC-Webhook-Signature", WooCommerceSignature(secret, body))
			return nil
		},
		resend: func(h http.Header) string {
			id := randomHex(16)
			h.Set("X-WC-Webhook-Delivery-ID", id)
			return id
		},
		forge: func() *Sender { return WooCommerce("idemtest forger") }}
}

// WooCommerceSignature is X-WC-Webhook-Signature of body, as
// WC_Webhook::generate_signature makes it: the base64 HMAC-SHA256 of the
// body under the webhook's secret.
func WooCommerceSignature(secret string, body []byte) string {
	return base64.StdEncoding.EncodeToString(hmac256(secret, string(body)))
}

// WooCommerceDeliveryID is X-WC-Webhook-Delivery-ID as
// WC_Webhook::get_new_delivery_id makes it: wp_hash($this->get_id() .
// strtotime('now')), WordPress's hash_hmac('md5', data, wp_salt('auth')),
// over the webhook id and the Unix second at. Deliveries of one webhook
// within one second share it.
func WooCommerceDeliveryID(salt, webhookID string, at time.Time) string {
	m := hmac.New(md5.New, []byte(salt))
	m.Write([]byte(webhookID + strconv.FormatInt(at.Unix(), 10)))
	return hex.EncodeToString(m.Sum(nil))
}

// Bitbucket signs as Bitbucket Cloud does (X-Hub-Signature: sha256=hex),
// for idemhttp.Bitbucket(secret).
func Bitbucket(secret string) *Sender {
	return &Sender{name: "bitbucket", deliveryHeader: "X-Request-UUID", newID: uuid,
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			return data, http.Header{"Content-Type": {"application/json"}, "X-Event-Key": {typ}, "X-Request-Uuid": {id},
				"X-Hook-Uuid": {"{" + uuid() + "}"}, "User-Agent": {"Bitbucket-Webhooks/2.0"}}
		},
		sign: func(h http.Header, _ string, body []byte, _ time.Time) error {
			h.Set("X-Hub-Signature", "sha256="+hex.EncodeToString(hmac256(secret, string(body))))
			return nil
		},
		resend: func(h http.Header) string {
			id := uuid()
			h.Set("X-Request-UUID", id)
			return id
		},
		forge: func() *Sender { return Bitbucket("idemtest forger") }}
}

// GitLab sends as GitLab does (X-Gitlab-Token, Idempotency-Key), for
// idemhttp.GitLab(token).
func GitLab(token string) *Sender {
	return &Sender{name: "gitlab", deliveryHeader: "Idempotency-Key", newID: uuid,
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			return data, http.Header{"Content-Type": {"application/json"}, "X-Gitlab-Event": {typ}, "Idempotency-Key": {id},
				"X-Gitlab-Event-Uuid": {uuid()}, "X-Gitlab-Webhook-Uuid": {uuid()}, "X-Gitlab-Instance": {"https://gitlab.example.com"}, "User-Agent": {"GitLab/17.6.0"}}
		},
		sign: func(h http.Header, _ string, _ []byte, _ time.Time) error {
			h.Set("X-Gitlab-Token", token)
			return nil
		},
		resend: func(h http.Header) string {
			id := uuid()
			h.Set("Idempotency-Key", id)
			h.Set("X-Gitlab-Event-UUID", uuid())
			return id
		},
		forge: func() *Sender { return GitLab("idemtest forger") }}
}

// Linear signs as Linear does (Linear-Signature over the body, which holds
// webhookTimestamp), for idemhttp.Linear(secret): a redelivery carries a
// fresh webhookTimestamp, as Linear's retries do.
func Linear(secret string) *Sender {
	return &Sender{name: "linear", stamped: true, deliveryHeader: "Linear-Delivery", newID: uuid,
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			return marshal(map[string]any{"action": "create", "type": typ, "data": data, "createdAt": time.Now().UTC().Format(time.RFC3339Nano),
					"url": "https://linear.app/idemtest/issue/IDE-1", "webhookTimestamp": time.Now().UnixMilli(), "webhookId": "idemtest-hook"}),
				http.Header{"Content-Type": {"application/json"}, "Linear-Delivery": {id}, "Linear-Event": {typ}}
		},
		stamp: func(body []byte, at time.Time) []byte {
			var m map[string]json.RawMessage
			if json.Unmarshal(body, &m) != nil {
				return body
			}
			m["webhookTimestamp"] = json.RawMessage(strconv.FormatInt(at.UnixMilli(), 10))
			return marshal(m)
		},
		sign: func(h http.Header, _ string, body []byte, _ time.Time) error {
			h.Set("Linear-Signature", hex.EncodeToString(hmac256(secret, string(body))))
			return nil
		},
		resend: func(h http.Header) string {
			id := uuid()
			h.Set("Linear-Delivery", id)
			return id
		},
		forge: func() *Sender { return Linear("idemtest forger") }}
}

// Twilio signs as Twilio does (X-Twilio-Signature: HMAC-SHA1 over the URL
// and the sorted form parameters), for idemhttp.Twilio with the same
// public URL: publicURL is the URL Twilio is configured to call (the one
// behind any proxy is the receiver's business). Events are status
// callbacks (MessageSid, MessageStatus = the type).
func Twilio(authToken, publicURL string) *Sender {
	return &Sender{name: "twilio", deliveryHeader: "I-Twilio-Idempotency-Token", newID: func() string { return randomHex(16) + "-" + randomHex(8) },
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			form := url.Values{"AccountSid": {"AC" + randomHex(16)}, "MessageSid": {"SM" + randomHex(16)}, "MessageStatus": {typ},
				"To": {"+15005550006"}, "From": {"+15005550001"}, "ApiVersion": {"2010-04-01"}, "Payload": {string(data)}}
			return []byte(form.Encode()), http.Header{"Content-Type": {"application/x-www-form-urlencoded"},
				"I-Twilio-Idempotency-Token": {id}, "User-Agent": {"TwilioProxy/1.1"}}
		},
		sign: func(h http.Header, _ string, body []byte, _ time.Time) error {
			form, err := url.ParseQuery(string(body))
			if err != nil {
				return err
			}
			h.Set("X-Twilio-Signature", TwilioSignature(authToken, publicURL, form))
			return nil
		},
		resend: func(h http.Header) string {
			id := randomHex(16) + "-" + randomHex(8)
			h.Set("I-Twilio-Idempotency-Token", id)
			return id
		},
		forge: func() *Sender { return Twilio("idemtest forger", publicURL) }}
}

// TwilioJSON signs JSON callbacks as Twilio does: the delivery goes to
// publicURL with bodySHA256 (the hex SHA-256 of the body) added to its
// query, and the signature covers that URL alone.
func TwilioJSON(authToken, publicURL string) *Sender {
	s := Twilio(authToken, publicURL)
	s.event = func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
		return marshal(map[string]any{"type": typ, "id": id, "data": data}), http.Header{"Content-Type": {"application/json"},
			"I-Twilio-Idempotency-Token": {id}, "User-Agent": {"TwilioProxy/1.1"}}
	}
	s.sign = func(h http.Header, _ string, body []byte, _ time.Time) error {
		d := sha256.Sum256(body)
		h.Set("X-Twilio-Signature", TwilioSignature(authToken, publicURL+twilioQuerySep(publicURL)+"bodySHA256="+hex.EncodeToString(d[:]), nil))
		return nil
	}
	s.query = func(body []byte) string {
		d := sha256.Sum256(body)
		return "bodySHA256=" + hex.EncodeToString(d[:])
	}
	s.forge = func() *Sender { return TwilioJSON("idemtest forger", publicURL) }
	return s
}

func twilioQuerySep(u string) string {
	if strings.Contains(u, "?") {
		return "&"
	}
	return "?"
}

// TwilioSignature is X-Twilio-Signature for a request to fullURL with the
// form parameters params (nil for a JSON body, whose URL carries
// bodySHA256).
func TwilioSignature(authToken, fullURL string, params url.Values) string {
	var b strings.Builder
	b.WriteString(fullURL)
	for _, k := range slices.Sorted(maps.Keys(params)) {
		vs := slices.Clone(params[k])
		slices.Sort(vs)
		for _, v := range vs {
			b.WriteString(k + v)
		}
	}
	return base64.StdEncoding.EncodeToString(hmac1(authToken, b.String()))
}

// Square signs as Square does (x-square-hmacsha256-signature over the
// notification URL and the body), for idemhttp.Square with the same
// public URL.
func Square(signatureKey, notificationURL string) *Sender {
	return &Sender{name: "square", newID: uuid,
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			return marshal(map[string]any{"merchant_id": "ML" + strings.ToUpper(randomHex(6)), "type": typ, "event_id": id,
					"created_at": time.Now().UTC().Format(time.RFC3339Nano), "data": map[string]any{"type": strings.Split(typ, ".")[0], "id": randomHex(8), "object": data}}),
				http.Header{"Content-Type": {"application/json"}, "Square-Version": {"2024-10-17"}}
		},
		sign: func(h http.Header, _ string, body []byte, _ time.Time) error {
			h.Set("X-Square-Hmacsha256-Signature", base64.StdEncoding.EncodeToString(hmac256(signatureKey, notificationURL, string(body))))
			return nil
		},
		forge: func() *Sender { return Square("idemtest forger", notificationURL) }}
}

// HubSpot signs as HubSpot's v3 request signature does (over the method,
// the URL, the body and X-HubSpot-Request-Timestamp), for idemhttp.HubSpot
// with the same public URL. An Event is a batch of one event
// (subscriptionType = the type); Batch joins several.
func HubSpot(clientSecret, publicURL string) *Sender {
	return &Sender{name: "hubspot", stamped: true, batch: true, newID: func() string { return strconv.Itoa(100000 + int(randomUint()%900000000)) },
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			return marshal([]map[string]any{{"eventId": json.Number(id), "subscriptionId": 4242, "portalId": 62515, "appId": 1160452,
					"occurredAt": time.Now().UnixMilli(), "subscriptionType": typ, "attemptNumber": 0, "objectId": 123,
					"propertyName": "idemtest", "propertyValue": string(data), "changeSource": "CRM"}}),
				http.Header{"Content-Type": {"application/json"}, "User-Agent": {"HubSpot Connect 2.0 (http://dev.hubspot.com/)"}}
		},
		idOf: func(id string, body []byte) string {
			var evs []struct {
				SubscriptionID json.Number `json:"subscriptionId"`
				OccurredAt     json.Number `json:"occurredAt"`
			}
			if json.Unmarshal(body, &evs) != nil || len(evs) != 1 {
				return id
			}
			return idem.JoinKey(evs[0].SubscriptionID.String(), id, evs[0].OccurredAt.String())
		},
		sign: func(h http.Header, _ string, body []byte, at time.Time) error {
			ts := strconv.FormatInt(at.UnixMilli(), 10)
			h.Set("X-HubSpot-Request-Timestamp", ts)
			h.Set("X-HubSpot-Signature-v3", base64.StdEncoding.EncodeToString(hmac256(clientSecret, "POST", publicURL, string(body), ts)))
			return nil
		},
		forge: func() *Sender { return HubSpot("idemtest forger", publicURL) }}
}

func randomUint() uint64 {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	var n uint64
	for _, c := range b {
		n = n<<8 | uint64(c)
	}
	return n
}

// SendGrid signs the Event Webhook as SendGrid does (ECDSA P-256 over
// X-Twilio-Email-Event-Webhook-Timestamp and the body) with a key pair of
// its own; give idemhttp.SendGrid its VerificationKey (base64 DER). An
// Event is a batch of one event (event = the type); Batch joins several.
func SendGrid() *Sender {
	priv, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	der, _ := x509.MarshalPKIXPublicKey(&priv.PublicKey)
	return &Sender{name: "sendgrid", batch: true, key: base64.StdEncoding.EncodeToString(der),
		newID: func() string { return base64.RawURLEncoding.EncodeToString([]byte(randomHex(12))) },
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			return marshal([]map[string]any{{"email": "user@example.com", "timestamp": now(), "event": typ, "sg_event_id": id,
					"sg_message_id": randomHex(11) + ".filter0001", "smtp-id": "<" + randomHex(8) + "@example.com>", "unique_args": data}}),
				http.Header{"Content-Type": {"application/json"}, "User-Agent": {"SendGrid Event API"}}
		},
		sign: func(h http.Header, _ string, body []byte, at time.Time) error {
			ts := strconv.FormatInt(at.Unix(), 10)
			digest := sha256.Sum256(append([]byte(ts), body...))
			sig, err := ecdsa.SignASN1(rand.Reader, priv, digest[:])
			if err != nil {
				return err
			}
			h.Set("X-Twilio-Email-Event-Webhook-Timestamp", ts)
			h.Set("X-Twilio-Email-Event-Webhook-Signature", base64.StdEncoding.EncodeToString(sig))
			return nil
		},
		forge: SendGrid}
}

// Adyen signs standard webhooks as Adyen does: every
// NotificationRequestItem carries additionalData.hmacSignature, the base64
// HMAC-SHA256 under the HMAC key (hex) of its pspReference,
// originalReference, merchantAccountCode, merchantReference, amount,
// currency, eventCode and success; for idemhttp.Adyen(hmacKey). An Event is
// a notification of one item (eventCode = the type, a fresh
// pspReference); Batch joins several.
func Adyen(hmacKey string) *Sender {
	key, err := hex.DecodeString(hmacKey)
	if err != nil {
		panic("idemtest: the Adyen HMAC key is not hex")
	}
	return &Sender{name: "adyen", batch: true, newID: func() string { return strconv.FormatUint(randomUint()%9e15+1e15, 10) },
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			item := map[string]any{"pspReference": id, "merchantAccountCode": "IdemtestMerchant", "merchantReference": "order-" + randomHex(6),
				"amount": map[string]any{"value": 1130, "currency": "EUR"}, "eventCode": typ, "success": "true",
				"eventDate": time.Now().UTC().Format(time.RFC3339), "paymentMethod": "visa", "operations": []string{"CANCEL", "CAPTURE", "REFUND"},
				"additionalData": map[string]string{"note": string(data)}}
			return adyenNotification([]json.RawMessage{marshal(item)}), http.Header{"Content-Type": {"application/json"}}
		},
		idOf: func(id string, body []byte) string {
			var it struct{ EventCode, Success string }
			items := adyenRaw(body)
			if len(items) != 1 || json.Unmarshal(items[0], &it) != nil {
				return id
			}
			return idem.JoinKey(it.EventCode, id, it.Success)
		},
		join: func(bodies [][]byte) []byte {
			var all []json.RawMessage
			for _, b := range bodies {
				all = append(all, adyenRaw(b)...)
			}
			return adyenNotification(all)
		},
		stamp: func(body []byte, _ time.Time) []byte {
			items := adyenRaw(body)
			for i, raw := range items {
				var it map[string]json.RawMessage
				if json.Unmarshal(raw, &it) != nil {
					continue
				}
				var ad map[string]string
				_ = json.Unmarshal(it["additionalData"], &ad)
				if ad == nil {
					ad = map[string]string{}
				}
				ad["hmacSignature"] = base64.StdEncoding.EncodeToString(hmac256(string(key), AdyenSigningString(raw)))
				it["additionalData"] = marshal(ad)
				items[i] = marshal(it)
			}
			return adyenNotification(items)
		},
		sign:  func(http.Header, string, []byte, time.Time) error { return nil },
		forge: func() *Sender { return Adyen("00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff") }}
}

// AdyenSigningString is the data an Adyen NotificationRequestItem's HMAC
// covers: its eight signed fields joined by ":".
func AdyenSigningString(item []byte) string {
	var it struct {
		PspReference, OriginalReference, MerchantAccountCode, MerchantReference string
		Amount                                                                  struct {
			Value    json.Number
			Currency string
		}
		EventCode, Success string
	}
	_ = json.Unmarshal(item, &it)
	return strings.Join([]string{it.PspReference, it.OriginalReference, it.MerchantAccountCode, it.MerchantReference,
		it.Amount.Value.String(), it.Amount.Currency, it.EventCode, it.Success}, ":")
}

func adyenNotification(items []json.RawMessage) []byte {
	wrapped := make([]map[string]json.RawMessage, len(items))
	for i, it := range items {
		wrapped[i] = map[string]json.RawMessage{"NotificationRequestItem": it}
	}
	return marshal(map[string]any{"live": json.RawMessage(`"false"`), "notificationItems": wrapped})
}

func adyenRaw(body []byte) []json.RawMessage {
	var n struct {
		NotificationItems []struct {
			Item json.RawMessage `json:"NotificationRequestItem"`
		} `json:"notificationItems"`
	}
	_ = json.Unmarshal(body, &n)
	out := make([]json.RawMessage, len(n.NotificationItems))
	for i, it := range n.NotificationItems {
		out[i] = it.Item
	}
	return out
}
