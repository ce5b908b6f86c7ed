package idemhttp

import "time"

// WooCommerceRetention is how long the WooCommerce preset keeps keys.
// WooCommerce does not retry a failed delivery on a schedule (it counts
// failures and disables the webhook after 5; woocommerce.com/document/webhooks,
// "Delivery"); a re-send is by hand or by the store's queue, and a week
// covers it.
const WooCommerceRetention = 7 * 24 * time.Hour

// wooBound are the unsigned WooCommerce headers that say what a delivery
// means (fingerprinted with the body).
var wooBound = []string{"X-WC-Webhook-Topic", "X-WC-Webhook-Source", "X-WC-Webhook-ID"}

// WooCommerceVerifier verifies X-WC-Webhook-Signature: the base64
// HMAC-SHA256 of the body under the webhook's secret.
func WooCommerceVerifier(secrets ...string) (Verifier, error) {
	return hmacBodyVerifier("WooCommerce", "X-WC-Webhook-Signature", "", sha256New, b64Decode)(secrets...)
}

// WooCommerce keys by X-WC-Webhook-Delivery-ID with X-WC-Webhook-Topic as
// the type, and verifies X-WC-Webhook-Signature first. The signature
// covers the body only, so, as for GitHub, the fingerprint binds the
// topic, the store (X-WC-Webhook-Source) and the webhook id to the body,
// and the signed body is deduplicated too (the replay guard).
func WooCommerce(secrets ...string) Preset {
	return preset(senderPreset{source: "woocommerce", name: "WooCommerce",
		key: HeaderKey("X-WC-Webhook-Topic", "X-WC-Webhook-Delivery-ID"), fingerprint: headersFingerprint(wooBound...),
		ttl: WooCommerceRetention, secrets: secrets, verifier: WooCommerceVerifier,
		headers:   append([]string{"X-WC-Webhook-Delivery-ID", "X-WC-Webhook-Signature", "X-WC-Webhook-Resource", "X-WC-Webhook-Event"}, wooBound...),
		guardBody: true})
}
