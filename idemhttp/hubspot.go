package idemhttp

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// HubSpotTolerance: HubSpot's guide says to refuse a request whose
// X-HubSpot-Request-Timestamp is more than 5 minutes old
// (developers.hubspot.com/docs/api/webhooks/validating-requests).
const HubSpotTolerance = 5 * time.Minute

// HubSpotRetention is how long the HubSpot preset keeps each event's key:
// HubSpot retries a failed notification batch up to 10 times over the
// next 24 hours (developers.hubspot.com/docs/api/webhooks, "Retries"); a
// week covers it.
const HubSpotRetention = 7 * 24 * time.Hour

// hubspotURIDecode are the characters HubSpot's v3 signature reads
// decoded in the request URI (validating-requests, "Validate the v3
// request signature").
var hubspotURIDecode = strings.NewReplacer("%3A", ":", "%2F", "/", "%3F", "?", "%40", "@", "%21", "!", "%24", "$",
	"%27", "'", "%28", "(", "%29", ")", "%2A", "*", "%2C", ",", "%3B", ";",
	"%3a", ":", "%2f", "/", "%3f", "?", "%2a", "*", "%2c", ",", "%3b", ";")

// HubSpotVerifier verifies X-HubSpot-Signature-v3: the base64
// HMAC-SHA256, under the app's client secret, of the method, the full
// public URL (PublicURL; HubSpot decodes a few characters of it, as
// above), the body and X-HubSpot-Request-Timestamp (milliseconds), which
// must be within tolerance either way. A signature that matches another
// URL the request could stand for is refused with a *URLMismatchError
// naming both.
func HubSpotVerifier(u PublicURL, tolerance time.Duration, clientSecrets ...string) (Verifier, error) {
	if err := checkSecrets("HubSpot", clientSecrets); err != nil {
		return nil, err
	}
	if err := u.check("HubSpot"); err != nil {
		return nil, err
	}
	if tolerance <= 0 {
		return nil, fmt.Errorf("idemhttp: HubSpot: tolerance %v must be positive", tolerance)
	}
	secrets := append([]string(nil), clientSecrets...)
	return func(r *http.Request, body []byte) error {
		ts, err := oneHeader(r, "HubSpot", "X-HubSpot-Request-Timestamp")
		if err != nil {
			return err
		}
		v, err := oneHeader(r, "HubSpot", "X-HubSpot-Signature-v3")
		if err != nil {
			return err
		}
		sig, err := decodeSig("HubSpot", "X-HubSpot-Signature-v3", v, "", b64Decode, 32)
		if err != nil {
			return err
		}
		at, err := unixStamp("HubSpot", "X-HubSpot-Request-Timestamp", ts, true)
		if err != nil {
			return err
		}
		if err := urlVerify("HubSpot", u, r, false, func(full string) bool {
			return anySecret(sha256New, secrets, sig, []byte(r.Method+hubspotURIDecode.Replace(full)), body, []byte(ts))
		}); err != nil {
			return err
		}
		return checkStamp("HubSpot", at, tolerance)
	}, nil
}

// HubSpot receives webhook subscriptions (a JSON array of up to 100
// events per request): it verifies X-HubSpot-Signature-v3 first
// (HubSpotVerifier, over the public URL u, 5 minutes), then deduplicates
// each event on its own key, the subscription id, event id and occurredAt
// from the signed body (HubSpot's eventId alone is not guaranteed
// unique), with subscriptionType as the type. The handler gets a JSON
// array of the events not processed before (docs/senders.md, "Deliveries
// of many events"); asynchronous mode is not supported.
func HubSpot(u PublicURL, clientSecrets ...string) Preset {
	return preset(senderPreset{source: "hubspot", name: "HubSpot", key: batchOnly, fingerprint: NoFingerprint,
		ttl: HubSpotRetention, secrets: clientSecrets,
		verifier: func(s ...string) (Verifier, error) { return HubSpotVerifier(u, HubSpotTolerance, s...) },
		headers:  []string{"X-HubSpot-Signature-v3", "X-HubSpot-Request-Timestamp"},
		batch: &batchSpec{event: func(raw json.RawMessage) (string, string) {
			f, err := jsonFields(raw, "subscriptionId", "eventId", "occurredAt", "subscriptionType")
			if err != nil || f[1] == "" {
				return "", ""
			}
			return idem.JoinKey(f[0], f[1], f[2]), f[3]
		}}})
}

// batchOnly is the key of a batch preset: never called, every delivery
// goes through serveBatch.
func batchOnly(*http.Request, []byte) (string, string, error) {
	return "", "", fmt.Errorf("idemhttp: a multi-event delivery has a key per event")
}
