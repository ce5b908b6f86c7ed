package idemhttp

import (
	"fmt"
	"net/http"
	"strings"
	"time"
)

// PagerDutyRetention is how long the PagerDuty preset keeps keys. A v3
// webhook that fails is retried with backoff for a limited number of
// attempts within minutes to hours (developer.pagerduty.com/docs/webhooks/v3-overview,
// "Retries"); a week covers it and a replay by hand.
const PagerDutyRetention = 7 * 24 * time.Hour

// PagerDutyVerifier verifies X-PagerDuty-Signature (v3 webhooks): a
// comma-separated list of "v1=" and the hex HMAC-SHA256 of the body under
// a subscription's secret; PagerDuty lists one per active secret while a
// secret is rotated, and any one that matches is enough.
func PagerDutyVerifier(secrets ...string) (Verifier, error) {
	if err := checkSecrets("PagerDuty", secrets); err != nil {
		return nil, err
	}
	secrets = append([]string(nil), secrets...)
	return func(r *http.Request, body []byte) error {
		v, err := oneHeader(r, "PagerDuty", "X-PagerDuty-Signature")
		if err != nil {
			return err
		}
		found := false
		for _, part := range strings.Split(v, ",") {
			hexSig, ok := strings.CutPrefix(strings.TrimSpace(part), "v1=")
			sig, err := hexDecode(hexSig)
			if !ok || err != nil || len(sig) != 32 {
				continue
			}
			found = true
			if anySecret(sha256New, secrets, sig, body) {
				return nil
			}
		}
		if !found {
			return fmt.Errorf("%w: PagerDuty: X-PagerDuty-Signature holds no v1= signature", ErrSignatureMissing)
		}
		return fmt.Errorf("%w: PagerDuty: X-PagerDuty-Signature does not match", ErrSignatureInvalid)
	}, nil
}

// PagerDuty receives v3 webhooks: it verifies X-PagerDuty-Signature first
// and keys by event.id, inside the signed body, with event.event_type.
// The signature covers no timestamp, but it covers the event id: a copy
// is the same key (NoFingerprint), absorbed while the key is kept.
func PagerDuty(secrets ...string) Preset {
	return preset(senderPreset{source: "pagerduty", name: "PagerDuty", key: bodyKey("event.id", "event.event_type"), fingerprint: NoFingerprint,
		ttl: PagerDutyRetention, secrets: secrets, verifier: PagerDutyVerifier,
		headers: []string{"X-PagerDuty-Signature", "X-Webhook-Id", "X-Webhook-Subscription"}})
}
