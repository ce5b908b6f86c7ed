package idemhttp

import "time"

// BitbucketRetention is how long the Bitbucket preset keeps keys:
// Bitbucket Cloud retries a delivery that gets a 5xx or no answer up to
// twice, within minutes, under the same X-Request-UUID
// (support.atlassian.com/bitbucket-cloud/docs/manage-webhooks,
// "Webhook retries"); a week covers a replay by hand too.
const BitbucketRetention = 7 * 24 * time.Hour

var bitbucketBound = []string{"X-Event-Key", "X-Hook-UUID"}

// BitbucketVerifier verifies X-Hub-Signature: "sha256=" and the hex
// HMAC-SHA256 of the body under the webhook's secret (GitHub's scheme
// under GitHub's older header name).
func BitbucketVerifier(secrets ...string) (Verifier, error) {
	return hmacBodyVerifier("Bitbucket", "X-Hub-Signature", "sha256=", sha256New, hexDecode)(secrets...)
}

// Bitbucket (Cloud) keys by X-Request-UUID with X-Event-Key as the type,
// and verifies X-Hub-Signature first. As for GitHub, the signature covers
// the body only: the fingerprint binds X-Event-Key and X-Hook-UUID to the
// body, and the signed body is deduplicated too (the replay guard).
func Bitbucket(secrets ...string) Preset {
	return preset(senderPreset{source: "bitbucket", name: "Bitbucket",
		key: HeaderKey("X-Event-Key", "X-Request-UUID"), fingerprint: headersFingerprint(bitbucketBound...),
		ttl: BitbucketRetention, secrets: secrets, verifier: BitbucketVerifier,
		headers:   append([]string{"X-Request-UUID", "X-Hub-Signature", "X-Attempt-Number"}, bitbucketBound...),
		guardBody: true})
}
