package idemhttp

import "time"

// TypeformRetention is how long the Typeform preset keeps keys: Typeform
// retries a failed delivery for up to 10 hours before it disables the
// webhook (www.typeform.com/developers/webhooks, "Retries"); a week
// covers it.
const TypeformRetention = 7 * 24 * time.Hour

// TypeformVerifier verifies Typeform-Signature: "sha256=" and the base64
// HMAC-SHA256 of the body under the webhook's secret.
func TypeformVerifier(secrets ...string) (Verifier, error) {
	return hmacBodyVerifier("Typeform", "Typeform-Signature", "sha256=", sha256New, b64Decode)(secrets...)
}

// Typeform keys by event_id, inside the signed body (the same on every
// retry), with event_type ("form_response"), and verifies
// Typeform-Signature first. The id is signed: NoFingerprint.
func Typeform(secrets ...string) Preset {
	return preset(senderPreset{source: "typeform", name: "Typeform", key: bodyKey("event_id", "event_type"), fingerprint: NoFingerprint,
		ttl: TypeformRetention, secrets: secrets, verifier: TypeformVerifier, headers: []string{"Typeform-Signature"}})
}
