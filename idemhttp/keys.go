package idemhttp

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// IdempotencyKeyHeader reads the IETF Idempotency-Key header. Its value is
// a structured-field string ("8e03978e-..."), quotes and escapes per RFC
// 8941; a bare token is accepted too, since many clients send one.
func IdempotencyKeyHeader(r *http.Request, _ []byte) (string, string, error) {
	v := strings.TrimSpace(r.Header.Get("Idempotency-Key"))
	if v == "" {
		return "", "", nil
	}
	if strings.HasPrefix(v, `"`) {
		return parseSFString(v)
	}
	return v, "", nil
}

// parseSFString parses an RFC 8941 sf-string: "..." with \" and \\ escapes,
// printable ASCII only.
func parseSFString(v string) (string, string, error) {
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		c := v[i]
		switch {
		case c == '\\':
			i++
			if i >= len(v) || (v[i] != '"' && v[i] != '\\') {
				return "", "", errors.New(`Idempotency-Key: bad escape in structured-field string`)
			}
			b.WriteByte(v[i])
		case c == '"':
			if rest := strings.TrimSpace(v[i+1:]); rest != "" && !strings.HasPrefix(rest, ";") {
				return "", "", errors.New("Idempotency-Key: text after the closing quote")
			}
			if b.Len() == 0 {
				return "", "", errors.New("Idempotency-Key is an empty string")
			}
			return b.String(), "", nil
		case c < 0x20 || c > 0x7e:
			return "", "", errors.New("Idempotency-Key: structured-field strings are printable ASCII")
		default:
			b.WriteByte(c)
		}
	}
	return "", "", errors.New("Idempotency-Key: unterminated structured-field string")
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

// RequestFingerprint is SHA-256 over method, path and body.
func RequestFingerprint(r *http.Request, body []byte) string {
	return idem.Fingerprint([]byte(r.Method), []byte(r.URL.Path), body)
}

// BodyFingerprint is SHA-256 of the body alone (senders redeliver to the
// same URL; some vary the query string).
func BodyFingerprint(_ *http.Request, body []byte) string { return idem.Fingerprint(body) }

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

func preset(source, sender string, key KeyFunc, ttl time.Duration, verify func() (Verifier, error), headers ...string) Preset {
	return func(c *Config) {
		c.senderHeaders = headers
		if c.Source == "" {
			c.Source = source
		}
		if c.Key == nil {
			c.Key = key
		}
		if c.Fingerprint == nil {
			c.Fingerprint = BodyFingerprint
		}
		if c.TTL == 0 {
			c.TTL = ttl
		}
		c.sender = sender
		if c.Verify == nil && verify != nil {
			v, err := verify()
			if err != nil {
				c.presetErr = err
			}
			c.Verify = v
		}
	}
}

// verifier is nil without secrets: New then asks for them or for
// Config.VerifiedUpstream.
func verifier(secrets []string, make func(...string) Verifier) func() (Verifier, error) {
	if len(secrets) == 0 {
		return nil
	}
	return func() (Verifier, error) {
		for i, s := range secrets {
			if s == "" {
				return nil, fmt.Errorf("idemhttp: signing secret %d is empty", i+1)
			}
		}
		return make(secrets...), nil
	}
}

// StripeRetryWindow is how long Stripe retries a webhook delivery in live mode.
const StripeRetryWindow = 3 * 24 * time.Hour

// Stripe keys by the event id ("evt_...") in the JSON body, with the event
// type from "type", and keeps keys for twice Stripe's 3-day retry window plus
// a day (7 days), so no retry outlives its key. Deliveries are verified
// first (Stripe-Signature, with stripe-go's webhook package and a 5-minute
// tolerance) against the endpoint's signing secrets ("whsec_..."; two while
// one is rolled).
func Stripe(secrets ...string) Preset {
	return preset("stripe", "Stripe", bodyIDKey, 2*StripeRetryWindow+24*time.Hour,
		verifier(secrets, func(s ...string) Verifier { return StripeVerifier(DefaultTolerance, s...) }), "Stripe-Signature")
}

// GitHub keys by X-GitHub-Delivery (a GUID per delivery, kept on
// redelivery), with the event type from X-GitHub-Event, and verifies
// X-Hub-Signature-256 against the webhook's secrets first. The signature
// covers the body only, so the signed body is deduplicated too (the replay
// guard, GuardKey): a copy re-sent under a fresh delivery id runs nothing.
func GitHub(secrets ...string) Preset {
	p := preset("github", "GitHub", HeaderKey("X-GitHub-Event", "X-GitHub-Delivery"), 0, verifier(secrets, GitHubVerifier),
		"X-GitHub-Event", "X-GitHub-Delivery", "X-Hub-Signature-256", "X-GitHub-Hook-Id",
		"X-GitHub-Hook-Installation-Target-Id", "X-GitHub-Hook-Installation-Target-Type")
	return func(c *Config) { p(c); c.guardBody = true }
}

// Shopify keys by X-Shopify-Event-Id (the same for every delivery of an
// event), falling back to X-Shopify-Webhook-Id, with the topic as type,
// and verifies X-Shopify-Hmac-Sha256 against the app's client secrets
// first. Shopify retries for 48 hours. The signature covers the body only,
// so the signed body is deduplicated too (the replay guard, GuardKey).
func Shopify(secrets ...string) Preset {
	p := preset("shopify", "Shopify", HeaderKey("X-Shopify-Topic", "X-Shopify-Event-Id", "X-Shopify-Webhook-Id"), 0,
		verifier(secrets, ShopifyVerifier),
		"X-Shopify-Topic", "X-Shopify-Event-Id", "X-Shopify-Webhook-Id", "X-Shopify-Hmac-Sha256",
		"X-Shopify-Shop-Domain", "X-Shopify-Api-Version", "X-Shopify-Triggered-At")
	return func(c *Config) { p(c); c.guardBody = true }
}

// StandardWebhooks keys by webhook-id (Standard Webhooks), falling back to
// svix-id (Svix's own headers), with the event type from the body's "type",
// and verifies the signature with the standard-webhooks library first
// (secrets "whsec_<base64>").
func StandardWebhooks(secrets ...string) Preset {
	key := HeaderKey("", "webhook-id", "svix-id")
	var verify func() (Verifier, error)
	if len(secrets) > 0 {
		verify = func() (Verifier, error) { return StandardWebhooksVerifier(secrets...) }
	}
	return preset("webhooks", "StandardWebhooks", func(r *http.Request, body []byte) (string, string, error) {
		k, _, err := key(r, body)
		if k == "" || err != nil {
			return k, "", err
		}
		var ev struct {
			Type string `json:"type"`
		}
		_ = json.Unmarshal(body, &ev)
		return k, ev.Type, nil
	}, 0, verify, "webhook-id", "webhook-timestamp", "webhook-signature", "svix-id", "svix-timestamp", "svix-signature")
}
