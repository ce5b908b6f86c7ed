package idemhttp

import (
	"net/http"
	"regexp"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// WooCommerceRetention is how long the WooCommerce preset keeps keys.
// WooCommerce does not retry a failed delivery: it counts the failure and
// disables the webhook after more than 5 in a row (class-wc-webhook.php,
// log_delivery and failed_delivery; docs/senders.md). A week covers a
// re-send by hand.
const WooCommerceRetention = 7 * 24 * time.Hour

// wooBound are the unsigned WooCommerce headers that say what a delivery
// means (fingerprinted with the body).
var wooBound = []string{"X-WC-Webhook-Topic", "X-WC-Webhook-Source", "X-WC-Webhook-ID"}

// WooCommerceVerifier verifies X-WC-Webhook-Signature: the base64
// HMAC-SHA256 of the body under the webhook's secret.
func WooCommerceVerifier(secrets ...string) (Verifier, error) {
	return hmacBodyVerifier("WooCommerce", "X-WC-Webhook-Signature", "", sha256New, b64Decode)(secrets...)
}

// WooCommerce verifies X-WC-Webhook-Signature first, and keys by what
// WooCommerce's own code makes of an event (WC_Webhook in
// class-wc-webhook.php; docs/senders.md cites the lines):
//
//   - X-WC-Webhook-Delivery-ID is wp_hash(webhook id . strtotime('now')):
//     every delivery of a webhook within one second has the same id (a
//     bulk edit, an import, a batch of scheduled actions), and a delivery
//     made again gets a new one. It is no event's identity.
//   - The body is built when the delivery is made: for the created,
//     updated and restored events of orders, products, coupons and
//     customers it is the resource as the REST API shows it, with its
//     date_modified, so two events never carry the same body and the same
//     body is the same state. These are keyed by the SHA-256 of the topic
//     and the signed body: a copy under a fresh delivery id is the same
//     key, and needs no replay guard.
//   - A deleted event's body is {"id": N}, a custom action's
//     {"action": hook, "arg": arg}: identical bodies are distinct events
//     (an order trashed, restored and trashed again). These are keyed by
//     the SHA-256 of the topic, the delivery id and the body: two events
//     of one second differ by body, two identical bodies by second.
//
// The type is X-WC-Webhook-Topic. The signature covers the body only: the
// fingerprint binds the topic, the store (X-WC-Webhook-Source) and the
// webhook id to it. WooCommerce's activation ping (a form body
// "webhook_id=N", unsigned, sent when a webhook is saved active) is
// answered 200 without being verified, claimed or handed to the handler
// (wooPing).
func WooCommerce(secrets ...string) Preset {
	return preset(senderPreset{source: "woocommerce", name: "WooCommerce",
		key: wooKey, fingerprint: headersFingerprint(wooBound...), ping: wooPing,
		ttl: WooCommerceRetention, secrets: secrets, verifier: WooCommerceVerifier,
		headers: append([]string{"X-WC-Webhook-Delivery-ID", "X-WC-Webhook-Signature", "X-WC-Webhook-Resource", "X-WC-Webhook-Event"}, wooBound...)})
}

// wooSnapshots are the resources whose created, updated and restored
// deliveries carry the resource itself, with its date_modified
// (WC_Webhook::get_wp_api_payload).
var wooSnapshots = map[string]bool{"coupon": true, "customer": true, "order": true, "product": true}

// wooKey is the WooCommerce preset's key (see WooCommerce): the topic and
// the body for a resource's snapshot, with the delivery id besides for
// every other topic. A delivery without a topic or a delivery id has no
// key (400).
func wooKey(r *http.Request, body []byte) (string, string, error) {
	topic := strings.TrimSpace(r.Header.Get("X-WC-Webhook-Topic"))
	id := strings.TrimSpace(r.Header.Get("X-WC-Webhook-Delivery-ID"))
	if topic == "" || id == "" {
		return "", "", nil
	}
	resource, event, _ := strings.Cut(topic, ".")
	if wooSnapshots[resource] && (event == "created" || event == "updated" || event == "restored") {
		return "sha256:" + idem.Fingerprint([]byte("snapshot"), []byte(topic), body), topic, nil
	}
	return "sha256:" + idem.Fingerprint([]byte("event"), []byte(topic), []byte(id), body), topic, nil
}

// wooPingBody is the body of WooCommerce's activation ping
// (WC_Webhook::deliver_ping).
var wooPingBody = regexp.MustCompile(`^webhook_id=[0-9]{1,20}$`)

// wooPing answers WooCommerce's activation ping: a POST whose whole body
// is "webhook_id=N", with no signature and none of WooCommerce's delivery
// headers. WooCommerce reports the webhook's URL as failing unless it is
// answered 200. It is not signed, so it proves nothing: it is answered
// before verification and never claimed, stored or handed to the handler;
// anyone who sends one learns only that the endpoint answers. A request
// with any X-WC-Webhook-* header is a delivery, verified as one.
func wooPing(w http.ResponseWriter, r *http.Request, body []byte) bool {
	if r.Method != http.MethodPost || !wooPingBody.Match(body) {
		return false
	}
	for name := range r.Header {
		if strings.HasPrefix(strings.ToLower(name), "x-wc-webhook-") {
			return false
		}
	}
	writeJSON(w, map[string]bool{"ping": true})
	return true
}
