package idemhttp

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/idemkit/idem"
)

// CalendlyTolerance is how far the t= timestamp of
// Calendly-Webhook-Signature may be from the receiver's clock, either way.
// Calendly retries a failing delivery for 24 hours with an exponential
// back-off (developer.calendly.com, "Webhook Errors") and does not say
// whether a retry is signed afresh: two days accepts every retry even if
// it keeps the first timestamp. A copy within the tolerance meets its
// signed key, kept far longer (CalendlyRetention), and runs nothing.
const CalendlyTolerance = 48 * time.Hour

// CalendlyRetention is how long the Calendly preset keeps keys: a week,
// more than the retry window plus twice the tolerance.
const CalendlyRetention = 7 * 24 * time.Hour

// CalendlyVerifier verifies Calendly-Webhook-Signature,
// "t=<unix>,v1=<hex>": v1 is the HMAC-SHA256, under the webhook
// subscription's signing key, of t + "." + the body. Every v1 is tried,
// and t must be within tolerance either way.
func CalendlyVerifier(tolerance time.Duration, signingKeys ...string) (Verifier, error) {
	if err := checkSecrets("Calendly", signingKeys); err != nil {
		return nil, err
	}
	if tolerance <= 0 {
		return nil, fmt.Errorf("idemhttp: Calendly: tolerance %v must be positive", tolerance)
	}
	keys := append([]string(nil), signingKeys...)
	return func(r *http.Request, body []byte) error {
		v, err := oneHeader(r, "Calendly", "Calendly-Webhook-Signature")
		if err != nil {
			return err
		}
		ts, sigs, err := stampedSigs("Calendly", "Calendly-Webhook-Signature", v, ",", "t", "v1")
		if err != nil {
			return err
		}
		at, err := unixStamp("Calendly", "Calendly-Webhook-Signature t", ts, false)
		if err != nil {
			return err
		}
		for _, sig := range sigs {
			if anySecret(sha256New, keys, sig, []byte(ts+"."), body) {
				return checkStamp("Calendly", at, tolerance)
			}
		}
		return fmt.Errorf("%w: Calendly: Calendly-Webhook-Signature does not match", ErrSignatureInvalid)
	}, nil
}

// calendlyKey keys a Calendly webhook by what its signed body says the
// event is: the event name, the body's created_at (when the webhook event
// was created) and the payload's resource (payload.uri: the invitee, the
// no-show, the routing form submission). A rescheduling is two events on
// two invitees (invitee.canceled on the old one, invitee.created on the
// new one), so none of the three alone would do. A payload without a uri
// is identified by the SHA-256 of its bytes instead.
func calendlyKey(_ *http.Request, body []byte) (string, string, error) {
	if len(body) == 0 {
		return "", "", nil
	}
	var b struct {
		Event     string          `json:"event"`
		CreatedAt string          `json:"created_at"`
		Payload   json.RawMessage `json:"payload"`
	}
	if err := json.Unmarshal(body, &b); err != nil {
		return "", "", fmt.Errorf("the body is not a Calendly webhook: %w", err)
	}
	if b.Event == "" || b.CreatedAt == "" || len(b.Payload) == 0 {
		return "", b.Event, nil
	}
	var p struct {
		URI string `json:"uri"`
	}
	resource := ""
	if json.Unmarshal(b.Payload, &p) == nil && p.URI != "" {
		resource = p.URI
	} else {
		d := sha256.Sum256(b.Payload)
		resource = "sha256:" + hex.EncodeToString(d[:])
	}
	return idem.JoinKey(b.Event, b.CreatedAt, resource), b.Event, nil
}

// Calendly verifies Calendly-Webhook-Signature first (CalendlyVerifier,
// CalendlyTolerance) and keys each event by its event name, created_at
// and payload.uri, all inside the signed body (Calendly's webhooks carry
// no event id), with the event name as the type. The key is signed: a
// retry whose bytes differ is the same event (NoFingerprint), and a copy
// of a delivery meets its key and runs nothing.
func Calendly(signingKeys ...string) Preset {
	return preset(senderPreset{source: "calendly", name: "Calendly", key: calendlyKey, fingerprint: NoFingerprint,
		ttl: CalendlyRetention, secrets: signingKeys,
		verifier: func(s ...string) (Verifier, error) { return CalendlyVerifier(CalendlyTolerance, s...) },
		headers:  []string{"Calendly-Webhook-Signature"}})
}
