package idemhttp

import (
	"fmt"
	"net/http"
	"time"
)

// LinearTolerance is how far Linear's signed webhookTimestamp may be from
// the receiver's clock: one minute, as Linear's guide says
// (linear.app/developers/webhooks, "Securing webhooks").
const LinearTolerance = time.Minute

// LinearRetention is how long the Linear preset keeps keys: Linear retries
// a failed delivery 3 times, after 1 minute, 1 hour and 6 hours (same
// guide, "Retries"); a week covers it.
const LinearRetention = 7 * 24 * time.Hour

// LinearVerifier verifies Linear-Signature, the hex HMAC-SHA256 of the
// body under the webhook's signing secret, and the body's webhookTimestamp
// (milliseconds) within tolerance either way.
func LinearVerifier(tolerance time.Duration, secrets ...string) (Verifier, error) {
	body, err := hmacBodyVerifier("Linear", "Linear-Signature", "", sha256New, hexDecode)(secrets...)
	if err != nil {
		return nil, err
	}
	if tolerance <= 0 {
		return nil, fmt.Errorf("idemhttp: Linear: tolerance %v must be positive", tolerance)
	}
	return func(r *http.Request, b []byte) error {
		if err := body(r, b); err != nil {
			return err
		}
		f, err := jsonFields(b, "webhookTimestamp")
		if err != nil || f[0] == "" {
			return fmt.Errorf("%w: Linear: the signed body has no webhookTimestamp", ErrSignatureMissing)
		}
		at, err := unixStamp("Linear", "webhookTimestamp", f[0], true)
		if err != nil {
			return err
		}
		return checkStamp("Linear", at, tolerance)
	}, nil
}

// Linear keys by Linear-Delivery (the delivery's UUID, kept on retry),
// with the signed body's "type" as the type, and verifies
// Linear-Signature and the signed webhookTimestamp (1 minute) first. The
// delivery id is not signed and a retry is signed again with a fresh
// webhookTimestamp, so the key is the delivery id alone (NoFingerprint)
// and the signed body is deduplicated (the replay guard): a captured
// delivery re-sent under a fresh id within the minute runs nothing, and
// after it is refused as stale.
func Linear(secrets ...string) Preset {
	return preset(senderPreset{source: "linear", name: "Linear", key: linearKey, fingerprint: NoFingerprint,
		ttl: LinearRetention, secrets: secrets,
		verifier: func(s ...string) (Verifier, error) { return LinearVerifier(LinearTolerance, s...) },
		headers:  []string{"Linear-Delivery", "Linear-Event", "Linear-Signature"}, guardBody: true})
}

func linearKey(r *http.Request, body []byte) (string, string, error) {
	id := r.Header.Get("Linear-Delivery")
	if id == "" {
		return "", "", nil
	}
	f, err := jsonFields(body, "type")
	if err != nil {
		return "", "", err
	}
	return id, f[0], nil
}
