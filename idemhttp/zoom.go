package idemhttp

import (
	"crypto/hmac"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"strings"
	"time"
)

// ZoomRetention is how long the Zoom preset keeps keys: Zoom retries a
// delivery that is not answered 200 or 204 within 3 seconds three times,
// 5, 30 and 90 minutes later (developers.zoom.us/docs/api/webhooks,
// "Notification delivery"); a week covers that and a replay by hand.
const ZoomRetention = 7 * 24 * time.Hour

// ZoomVerifier verifies x-zm-signature: "v0=" and the hex HMAC-SHA256,
// under the app's secret token, of "v0:" + x-zm-request-timestamp + ":" +
// the body (Slack's scheme), with the timestamp within tolerance.
func ZoomVerifier(tolerance time.Duration, secretTokens ...string) (Verifier, error) {
	return v0Verifier("Zoom", "x-zm-signature", "x-zm-request-timestamp", tolerance, secretTokens)
}

// Zoom verifies x-zm-signature first (ZoomVerifier, 5 minutes), answers
// the endpoint.url_validation handshake ({"plainToken", "encryptedToken":
// the hex HMAC-SHA256 of plainToken under the secret token that verified
// the request}), and keys every other event by the SHA-256 of its signed
// body (Zoom's events carry no id; a retry carries the same bytes, and
// each event holds its own event_ts), with the type from "event".
func Zoom(secretTokens ...string) Preset {
	return preset(senderPreset{source: "zoom", name: "Zoom", key: bodyDigestKey("event"), fingerprint: NoFingerprint,
		ttl: ZoomRetention, secrets: secretTokens,
		verifier: func(s ...string) (Verifier, error) { return ZoomVerifier(DefaultTolerance, s...) },
		headers:  []string{"x-zm-signature", "x-zm-request-timestamp", "x-zm-trackingid"},
		handshake: func(secrets []string) handshakeFunc {
			return func(w http.ResponseWriter, r *http.Request, body []byte) bool {
				var hs struct {
					Event   string `json:"event"`
					Payload struct {
						PlainToken string `json:"plainToken"`
					} `json:"payload"`
				}
				if json.Unmarshal(body, &hs) != nil || hs.Event != "endpoint.url_validation" {
					return false
				}
				// The secret that signed this request answers it.
				ts, sig := r.Header.Get("x-zm-request-timestamp"), r.Header.Get("x-zm-signature")
				want, _ := hex.DecodeString(strings.TrimPrefix(sig, "v0="))
				for _, s := range secrets {
					if hmac.Equal(macOf(sha256New, s, []byte("v0:"+ts+":"), body), want) {
						writeJSON(w, map[string]string{"plainToken": hs.Payload.PlainToken,
							"encryptedToken": hex.EncodeToString(macOf(sha256New, s, []byte(hs.Payload.PlainToken)))})
						return true
					}
				}
				problem(w, http.StatusInternalServerError, "Zoom validation needs the secret token",
					"The endpoint validation is answered with the app's secret token: give it to idemhttp.Zoom.", nil)
				return true
			}
		}})
}
