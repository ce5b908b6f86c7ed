package idemhttp

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// IdempotencyKeyHeader reads the IETF Idempotency-Key header. Its value is
// a structured-field string ("8e03978e-..."), quotes and escapes per RFC
// 8941; a bare token is accepted too, since many clients send one. The
// field is an Item: sent on several header lines (or as a list a proxy
// combined, "a", "b"), it does not parse, and the request is answered 400
// rather than keyed by one of them.
func IdempotencyKeyHeader(r *http.Request, _ []byte) (string, string, error) {
	vs := r.Header.Values("Idempotency-Key")
	if len(vs) > 1 {
		return "", "", &KeyHeaderError{Problem: fmt.Sprintf("Idempotency-Key was sent %d times; send it once", len(vs))}
	}
	if len(vs) == 0 {
		return "", "", nil
	}
	v := strings.TrimSpace(vs[0])
	if v == "" {
		return "", "", nil
	}
	if strings.HasPrefix(v, `"`) {
		return parseSFString(v)
	}
	if strings.IndexByte(v, ',') >= 0 {
		return "", "", &KeyHeaderError{Problem: "Idempotency-Key holds a list (a comma); send one key, as a structured-field string"}
	}
	return v, "", nil
}

// KeyHeaderError: the Idempotency-Key header does not parse. Its text is
// what the client is told (400).
type KeyHeaderError struct{ Problem string }

func (e *KeyHeaderError) Error() string { return e.Problem }

// parseSFString parses an RFC 8941 sf-string: "..." with \" and \\ escapes,
// printable ASCII only.
func parseSFString(v string) (string, string, error) {
	bad := func(problem string) (string, string, error) { return "", "", &KeyHeaderError{Problem: problem} }
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		c := v[i]
		switch {
		case c == '\\':
			i++
			if i >= len(v) || (v[i] != '"' && v[i] != '\\') {
				return bad(`Idempotency-Key: bad escape in structured-field string`)
			}
			b.WriteByte(v[i])
		case c == '"':
			if rest := strings.TrimSpace(v[i+1:]); rest != "" && !strings.HasPrefix(rest, ";") {
				return bad("Idempotency-Key: text after the closing quote (one key per request)")
			}
			if b.Len() == 0 {
				return bad("Idempotency-Key is an empty string")
			}
			return b.String(), "", nil
		case c < 0x20 || c > 0x7e:
			return bad("Idempotency-Key: structured-field strings are printable ASCII")
		default:
			b.WriteByte(c)
		}
	}
	return bad("Idempotency-Key: unterminated structured-field string")
}

// HeaderKey reads the key from the first of the named headers present, and
// the event type from typeHeader (may be empty).
func HeaderKey(typeHeader string, names ...string) KeyFunc {
	return func(r *http.Request, _ []byte) (string, string, error) {
		for _, n := range names {
			if v := strings.TrimSpace(r.Header.Get(n)); v != "" {
				t := ""
				if typeHeader != "" {
					t = r.Header.Get(typeHeader)
				}
				return v, t, nil
			}
		}
		return "", "", nil
	}
}

// bodyIDKey reads the event id from the JSON body's "id" and the type from
// its "type".
func bodyIDKey(r *http.Request, body []byte) (string, string, error) {
	var ev struct {
		ID   string `json:"id"`
		Type string `json:"type"`
	}
	if len(body) == 0 {
		return "", "", nil
	}
	if err := json.Unmarshal(body, &ev); err != nil {
		return "", "", fmt.Errorf("the body is not a JSON event: %w", err)
	}
	return ev.ID, ev.Type, nil
}

// RequestFingerprint is SHA-256 over method, path, body and query
// string: the same key with ?amount=1000 after ?amount=1 is a mismatch
// (422). A request without a query fingerprints as before the query was
// covered; on a mismatch the middleware also tries that form (method,
// path and body), so a retry of a request stored by an earlier version
// still matches.
func RequestFingerprint(r *http.Request, body []byte) string {
	if r.URL.RawQuery == "" || r.Context().Value(legacyFingerprintKey{}) != nil {
		return idem.Fingerprint([]byte(r.Method), []byte(r.URL.Path), body)
	}
	return idem.Fingerprint([]byte(r.Method), []byte(r.URL.Path), body, []byte("?"+r.URL.RawQuery))
}

// BodyFingerprint is SHA-256 of the body alone (senders redeliver to the
// same URL; some vary the query string).
func BodyFingerprint(_ *http.Request, body []byte) string { return idem.Fingerprint(body) }

// NoFingerprint gives no fingerprint: the key alone is the request's
// identity, and a request with a known key is never a mismatch (422). The
// presets of senders whose signature covers the key (Stripe, Standard
// Webhooks) use it: a delivery with a signed event id is that event,
// whatever its bytes (the sender may re-serialize a retry, or change a
// field such as Stripe's pending_webhooks between attempts).
func NoFingerprint(*http.Request, []byte) string { return "" }

// headersFingerprint is SHA-256 over the named headers (every value, in
// order; an absent header differs from an empty one) and the body. The
// presets of senders whose signature covers the body only (GitHub,
// Shopify) bind the unsigned headers a handler acts on (event type, shop,
// hook, API version) to the delivery's key with it: a copy of a delivery
// under its key with one of them changed, added or removed is a mismatch
// (422), stores nothing, and the genuine event keeps its key.
func headersFingerprint(names ...string) FingerprintFunc {
	return func(r *http.Request, body []byte) string {
		parts := make([][]byte, 0, len(names)+1)
		for _, n := range names {
			vs := r.Header.Values(n)
			p := []byte(http.CanonicalHeaderKey(n) + ":" + strconv.Itoa(len(vs)))
			for _, v := range vs {
				p = append(p, 0)
				p = append(p, v...)
			}
			parts = append(parts, p)
		}
		return idem.Fingerprint(append(parts, body)...)
	}
}

// Preset fills Source, Key and Fingerprint (and, where the sender has a
// long retry window, TTL) for a known sender; fields already set are kept.
type Preset func(*Config)

// Apply applies presets to cfg and returns it.
func (c Config) Apply(presets ...Preset) Config {
	for _, p := range presets {
		p(&c)
	}
	return c
}

// senderPreset describes a webhook sender for preset.
type senderPreset struct {
	source, name string
	key          KeyFunc
	fingerprint  FingerprintFunc
	ttl          time.Duration
	secrets      []string
	verifier     func(secrets ...string) (Verifier, error)
	headers      []string // the sender's event, delivery and signature headers
	guardBody    bool     // the replay guard: the signature covers the body only and the sender never sends one body as two events (guard.go)
	// legacyFingerprint: what an earlier version stored (Config.legacyFingerprint).
	legacyFingerprint FingerprintFunc
	// handshake answers the sender's verified handshake (handshake.go),
	// made from the endpoint's secrets; batch: a multi-event delivery.
	handshake func(secrets []string) handshakeFunc
	batch     *batchSpec
	// ping answers the sender's unsigned ping before verification
	// (WooCommerce's activation ping; Config.ping).
	ping handshakeFunc
}

func preset(p senderPreset) Preset {
	return func(c *Config) {
		c.senderHeaders = p.headers
		c.guardBody = p.guardBody
		if c.Source == "" {
			c.Source = p.source
			c.defaultSource = true
		}
		if c.Key == nil {
			c.Key = p.key
		}
		if c.Fingerprint == nil {
			c.Fingerprint = p.fingerprint
			c.legacyFingerprint = p.legacyFingerprint
		}
		if c.TTL == 0 {
			c.TTL = p.ttl
		}
		c.sender = p.name
		c.batch = p.batch
		c.ping = p.ping
		if p.handshake != nil {
			c.handshake = p.handshake(append([]string(nil), p.secrets...))
		}
		if c.Verify == nil && len(p.secrets) > 0 {
			// Without secrets New asks for them, or for VerifiedUpstream.
			v, err := p.verifier(p.secrets...)
			if err != nil {
				c.presetErr = err
			}
			c.Verify = v
			c.secrets = p.secrets
		}
	}
}

// StripeRetryWindow is how long Stripe retries a webhook delivery in live mode.
const StripeRetryWindow = 3 * 24 * time.Hour

// Stripe keys by the event id ("evt_...") in the JSON body, with the event
// type from "type", and keeps keys for twice Stripe's 3-day retry window plus
// a day (7 days), so no retry outlives its key. Deliveries are verified
// first (StripeVerifier: Stripe-Signature, with stripe-go's webhook
// package, and a timestamp within 5 minutes either way) against the
// endpoint's signing secrets ("whsec_..."; two while one is rolled). The
// signature covers the body, which holds the key: the event id is the
// delivery's identity (NoFingerprint), so a retry whose bytes differ is
// the same event, answered from its stored answer, or run if the first
// attempt failed.
func Stripe(secrets ...string) Preset {
	return preset(senderPreset{source: "stripe", name: "Stripe", key: bodyIDKey, fingerprint: NoFingerprint,
		ttl: 2*StripeRetryWindow + 24*time.Hour, secrets: secrets,
		verifier: func(s ...string) (Verifier, error) { return StripeVerifier(DefaultTolerance, s...) },
		headers:  []string{"Stripe-Signature"}})
}

// GitHub's headers: githubBound are the unsigned headers that say what a
// delivery means (fingerprinted with the body).
var githubBound = []string{"X-GitHub-Event", "X-GitHub-Hook-Id", "X-GitHub-Hook-Installation-Target-Id", "X-GitHub-Hook-Installation-Target-Type"}

// GitHub keys by X-GitHub-Delivery (a GUID per delivery, kept on
// redelivery), with the event type from X-GitHub-Event, and verifies
// X-Hub-Signature-256 against the webhook's secrets first. The signature
// covers the body only, so what the key stands for is bound to it: the
// fingerprint covers the body and X-GitHub-Event, X-GitHub-Hook-Id and
// the installation target headers (a copy under the key with any of them
// changed is 422 and stores nothing), and the signed body is deduplicated
// too (the replay guard, GuardKey): a copy re-sent under a fresh delivery
// id runs nothing.
func GitHub(secrets ...string) Preset {
	return preset(senderPreset{source: "github", name: "GitHub", key: HeaderKey("X-GitHub-Event", "X-GitHub-Delivery"),
		fingerprint: headersFingerprint(githubBound...), legacyFingerprint: BodyFingerprint, secrets: secrets, verifier: GitHubVerifier,
		headers: append([]string{"X-GitHub-Delivery", "X-Hub-Signature-256"}, githubBound...), guardBody: true})
}

// shopifyBound are the unsigned Shopify headers that say what a delivery
// means (fingerprinted with the body).
var shopifyBound = []string{"X-Shopify-Topic", "X-Shopify-Shop-Domain", "X-Shopify-Api-Version"}

// Shopify keys by X-Shopify-Event-Id (the same for every delivery of an
// event), falling back to X-Shopify-Webhook-Id, with the topic as type,
// and verifies X-Shopify-Hmac-Sha256 against the app's client secrets
// first. Shopify retries for 48 hours. The signature covers the body only,
// so the fingerprint covers the body with the topic, the shop's domain
// and the API version (a copy under the key with any of them changed is
// 422 and stores nothing), and the signed body is deduplicated too (the
// replay guard, GuardKey).
func Shopify(secrets ...string) Preset {
	return preset(senderPreset{source: "shopify", name: "Shopify",
		key:         HeaderKey("X-Shopify-Topic", "X-Shopify-Event-Id", "X-Shopify-Webhook-Id"),
		fingerprint: headersFingerprint(shopifyBound...), legacyFingerprint: BodyFingerprint, secrets: secrets, verifier: ShopifyVerifier,
		headers:   append([]string{"X-Shopify-Event-Id", "X-Shopify-Webhook-Id", "X-Shopify-Hmac-Sha256", "X-Shopify-Triggered-At"}, shopifyBound...),
		guardBody: true})
}

// StandardWebhooks keys by the message id the signature covers: webhook-id
// (Standard Webhooks), or svix-id when the delivery is signed with Svix's
// headers (no webhook-signature), never an id from the other scheme's
// headers. The event type is the body's "type". The signature (checked
// first, with the standard-webhooks library; secrets "whsec_<base64>")
// covers the id, a timestamp and the body: the id is the delivery's
// identity (NoFingerprint), as for Stripe.
func StandardWebhooks(secrets ...string) Preset {
	return preset(senderPreset{source: "webhooks", name: "StandardWebhooks", key: standardKey, fingerprint: NoFingerprint,
		secrets: secrets, verifier: StandardWebhooksVerifier,
		headers: []string{"webhook-id", "webhook-timestamp", "webhook-signature", "svix-id", "svix-timestamp", "svix-signature"}})
}

// standardKey is the StandardWebhooks preset's key: the id of the scheme
// the delivery is verified by (standardScheme), and the body's "type".
func standardKey(r *http.Request, body []byte) (string, string, error) {
	id, _, _ := standardScheme(r.Header)
	k := r.Header.Get(id) // exactly the value signed
	if k == "" {
		return "", "", nil
	}
	var ev struct {
		Type string `json:"type"`
	}
	_ = json.Unmarshal(body, &ev)
	return k, ev.Type, nil
}
