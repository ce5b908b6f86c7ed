package idemhttp

import (
	"net/http"
	"time"
)

// SquareRetention is how long the Square preset keeps keys: Square
// retries a notification that is not answered 2xx for up to 24 hours
// (developer.squareup.com/docs/webhooks/step3validate and "Webhook event
// retries"); a week covers it.
const SquareRetention = 7 * 24 * time.Hour

// SquareVerifier verifies x-square-hmacsha256-signature: the base64
// HMAC-SHA256, under the subscription's signature key, of the
// notification URL (PublicURL: exactly as the subscription names it)
// followed by the body. A signature that matches another URL the request
// could stand for is refused with a *URLMismatchError naming both.
func SquareVerifier(u PublicURL, signatureKeys ...string) (Verifier, error) {
	if err := checkSecrets("Square", signatureKeys); err != nil {
		return nil, err
	}
	if err := u.check("Square"); err != nil {
		return nil, err
	}
	keys := append([]string(nil), signatureKeys...)
	return func(r *http.Request, body []byte) error {
		v, err := oneHeader(r, "Square", "X-Square-Hmacsha256-Signature")
		if err != nil {
			return err
		}
		sig, err := decodeSig("Square", "x-square-hmacsha256-signature", v, "", b64Decode, 32)
		if err != nil {
			return err
		}
		return urlVerify("Square", u, r, false, func(full string) bool {
			return anySecret(sha256New, keys, sig, []byte(full), body)
		})
	}, nil
}

// Square verifies x-square-hmacsha256-signature first (SquareVerifier,
// over the public URL u) and keys by event_id, inside the signed body and
// the same on every retry, with "type". The id is signed: NoFingerprint.
func Square(u PublicURL, signatureKeys ...string) Preset {
	return preset(senderPreset{source: "square", name: "Square", key: bodyKey("event_id", "type"), fingerprint: NoFingerprint,
		ttl: SquareRetention, secrets: signatureKeys,
		verifier: func(s ...string) (Verifier, error) { return SquareVerifier(u, s...) },
		headers:  []string{"X-Square-Hmacsha256-Signature", "Square-Version", "Square-Initial-Delivery-Timestamp", "Square-Retry-Number", "Square-Retry-Reason"}})
}
