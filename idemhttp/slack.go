package idemhttp

import (
	"encoding/json"
	"fmt"
	"net/http"
	"time"
)

// SlackRetention is how long the Slack preset keeps keys: the Events API
// retries a delivery three times within about 5 minutes (immediately,
// after 1 minute, after 5 minutes; api.slack.com/apis/events-api, "Retries");
// a week also covers a replay by hand.
const SlackRetention = 7 * 24 * time.Hour

// SlackVerifier verifies Slack's request signing: X-Slack-Signature is
// "v0=" and the hex HMAC-SHA256, under the app's signing secret, of
// "v0:" + X-Slack-Request-Timestamp + ":" + the body; the timestamp must
// be within tolerance of the receiver's clock either way (Slack's own
// SDKs use 5 minutes). Several secrets may be given while one is rotated.
func SlackVerifier(tolerance time.Duration, secrets ...string) (Verifier, error) {
	return v0Verifier("Slack", "X-Slack-Signature", "X-Slack-Request-Timestamp", tolerance, secrets)
}

// v0Verifier is the scheme Slack and Zoom share: "v0=" + hex HMAC-SHA256
// of "v0:" + timestamp + ":" + body.
func v0Verifier(sender, sigHeader, tsHeader string, tolerance time.Duration, secrets []string) (Verifier, error) {
	if err := checkSecrets(sender, secrets); err != nil {
		return nil, err
	}
	if tolerance <= 0 {
		return nil, fmt.Errorf("idemhttp: %s: tolerance %v must be positive", sender, tolerance)
	}
	secrets = append([]string(nil), secrets...)
	return func(r *http.Request, body []byte) error {
		ts, err := oneHeader(r, sender, tsHeader)
		if err != nil {
			return err
		}
		v, err := oneHeader(r, sender, sigHeader)
		if err != nil {
			return err
		}
		sig, err := decodeSig(sender, sigHeader, v, "v0=", hexDecode, 32)
		if err != nil {
			return err
		}
		at, err := unixStamp(sender, tsHeader, ts, false)
		if err != nil {
			return err
		}
		if !anySecret(sha256New, secrets, sig, []byte("v0:"+ts+":"), body) {
			return fmt.Errorf("%w: %s: %s does not match", ErrSignatureInvalid, sender, sigHeader)
		}
		return checkStamp(sender, at, tolerance)
	}, nil
}

// Slack receives the Events API: it verifies X-Slack-Signature first
// (SlackVerifier, 5 minutes), answers the url_verification handshake with
// its challenge (never claimed, never passed to the handler), and keys
// every event_callback by its event_id, inside the signed body, with the
// inner event's type. A retry (X-Slack-Retry-Num) carries the same
// event_id; the id is signed, so the event id is the identity
// (NoFingerprint).
func Slack(signingSecrets ...string) Preset {
	return preset(senderPreset{source: "slack", name: "Slack", key: bodyKey("event_id", "event.type"), fingerprint: NoFingerprint,
		ttl: SlackRetention, secrets: signingSecrets,
		verifier: func(s ...string) (Verifier, error) { return SlackVerifier(DefaultTolerance, s...) },
		headers:  []string{"X-Slack-Signature", "X-Slack-Request-Timestamp", "X-Slack-Retry-Num", "X-Slack-Retry-Reason"},
		handshake: func([]string) handshakeFunc {
			return func(w http.ResponseWriter, _ *http.Request, body []byte) bool {
				var hs struct{ Type, Challenge string }
				if json.Unmarshal(body, &hs) != nil || hs.Type != "url_verification" {
					return false
				}
				writeJSON(w, map[string]string{"challenge": hs.Challenge})
				return true
			}
		}})
}
