package idemhttp

import (
	"fmt"
	"net/http"
	"strings"
	"time"
)

// PaddleRetention is how long the Paddle preset keeps keys: Paddle Billing
// retries a live notification up to 60 times over 3 days
// (developer.paddle.com/webhooks/respond-to-webhooks, "Retry policy");
// a week is more than twice that.
const PaddleRetention = 7 * 24 * time.Hour

// PaddleVerifier verifies Paddle Billing's Paddle-Signature header,
// "ts=<unix>;h1=<hex>": h1 is the HMAC-SHA256, under the notification
// destination's secret key, of ts + ":" + the body. Every h1 in the header
// is tried (Paddle signs with both keys while one is rotated), and ts must
// be within tolerance either way.
func PaddleVerifier(tolerance time.Duration, secrets ...string) (Verifier, error) {
	if err := checkSecrets("Paddle", secrets); err != nil {
		return nil, err
	}
	if tolerance <= 0 {
		return nil, fmt.Errorf("idemhttp: Paddle: tolerance %v must be positive", tolerance)
	}
	secrets = append([]string(nil), secrets...)
	return func(r *http.Request, body []byte) error {
		v, err := oneHeader(r, "Paddle", "Paddle-Signature")
		if err != nil {
			return err
		}
		ts, sigs, err := stampedSigs("Paddle", "Paddle-Signature", v, ";", "ts", "h1")
		if err != nil {
			return err
		}
		at, err := unixStamp("Paddle", "Paddle-Signature ts", ts, false)
		if err != nil {
			return err
		}
		for _, sig := range sigs {
			if anySecret(sha256New, secrets, sig, []byte(ts+":"), body) {
				return checkStamp("Paddle", at, tolerance)
			}
		}
		return fmt.Errorf("%w: Paddle: Paddle-Signature does not match", ErrSignatureInvalid)
	}, nil
}

// stampedSigs parses a "t=..,v1=..,v1=.." style header: the single
// timestamp under tsName and every hex SHA-256 signature under sigName.
func stampedSigs(sender, header, v, sep, tsName, sigName string) (string, [][]byte, error) {
	var ts string
	var sigs [][]byte
	for _, part := range strings.Split(v, sep) {
		k, val, ok := strings.Cut(strings.TrimSpace(part), "=")
		if !ok {
			continue
		}
		switch k {
		case tsName:
			if ts != "" {
				return "", nil, fmt.Errorf("%w: %s: %s holds two timestamps", ErrSignatureMissing, sender, header)
			}
			ts = val
		case sigName:
			if b, err := hexDecode(val); err == nil && len(b) == 32 {
				sigs = append(sigs, b)
			}
		}
	}
	if ts == "" || len(sigs) == 0 {
		return "", nil, fmt.Errorf("%w: %s: %s has no %s= and %s= pair", ErrSignatureMissing, sender, header, tsName, sigName)
	}
	return ts, sigs, nil
}

// Paddle (Billing) keys by the notification's event_id ("evt_..."),
// inside the signed body, with its event_type, and verifies
// Paddle-Signature first (PaddleVerifier, 5 minutes). The event id is
// signed: it is the identity (NoFingerprint).
func Paddle(secrets ...string) Preset {
	return preset(senderPreset{source: "paddle", name: "Paddle", key: bodyKey("event_id", "event_type"), fingerprint: NoFingerprint,
		ttl: PaddleRetention, secrets: secrets,
		verifier: func(s ...string) (Verifier, error) { return PaddleVerifier(DefaultTolerance, s...) },
		headers:  []string{"Paddle-Signature"}})
}
