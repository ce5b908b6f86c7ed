package idemhttp

import "time"

// IntercomRetention is how long the Intercom preset keeps keys: Intercom
// retries a notification that fails or times out once, after a minute,
// and suspends the subscription after repeated failures
// (developers.intercom.com, "Webhooks: handling notifications"); a week
// covers it.
const IntercomRetention = 7 * 24 * time.Hour

// IntercomVerifier verifies X-Hub-Signature: "sha1=" and the hex
// HMAC-SHA1 of the body under the app's client secret (Intercom's scheme;
// SHA-1 is what Intercom signs with).
func IntercomVerifier(clientSecrets ...string) (Verifier, error) {
	return hmacBodyVerifier("Intercom", "X-Hub-Signature", "sha1=", sha1New, hexDecode)(clientSecrets...)
}

// Intercom keys by the notification's id ("notif_..."), inside the signed
// body, with its topic as the type, and verifies X-Hub-Signature first.
// The id is signed: NoFingerprint.
func Intercom(clientSecrets ...string) Preset {
	return preset(senderPreset{source: "intercom", name: "Intercom", key: bodyKey("id", "topic"), fingerprint: NoFingerprint,
		ttl: IntercomRetention, secrets: clientSecrets, verifier: IntercomVerifier, headers: []string{"X-Hub-Signature"}})
}
