package idemhttp

import (
	"encoding/json"
	"fmt"
	"net/http"
	"time"
)

// Twitch EventSub's headers.
const (
	twitchID   = "Twitch-Eventsub-Message-Id"
	twitchTS   = "Twitch-Eventsub-Message-Timestamp"
	twitchSig  = "Twitch-Eventsub-Message-Signature"
	twitchType = "Twitch-Eventsub-Message-Type"
)

// TwitchTolerance is the age past which Twitch's EventSub guide says to
// refuse a message: 10 minutes (dev.twitch.tv/docs/eventsub/handling-webhook-events,
// "Guarding against replay attacks").
const TwitchTolerance = 10 * time.Minute

// TwitchRetention is how long the Twitch preset keeps keys. Twitch resends
// a notification that is not answered 2xx within a few seconds, under the
// same message id, "for a reasonable time" and then revokes the
// subscription (same guide, "Handling duplicates"); a week covers it.
const TwitchRetention = 7 * 24 * time.Hour

// TwitchVerifier verifies Twitch-Eventsub-Message-Signature: "sha256="
// and the hex HMAC-SHA256, under the subscription's secret, of the
// message id, the message timestamp (RFC 3339) and the body, with the
// timestamp within tolerance either way.
func TwitchVerifier(tolerance time.Duration, secrets ...string) (Verifier, error) {
	if err := checkSecrets("Twitch", secrets); err != nil {
		return nil, err
	}
	if tolerance <= 0 {
		return nil, fmt.Errorf("idemhttp: Twitch: tolerance %v must be positive", tolerance)
	}
	secrets = append([]string(nil), secrets...)
	return func(r *http.Request, body []byte) error {
		id, err := oneHeader(r, "Twitch", twitchID)
		if err != nil {
			return err
		}
		ts, err := oneHeader(r, "Twitch", twitchTS)
		if err != nil {
			return err
		}
		v, err := oneHeader(r, "Twitch", twitchSig)
		if err != nil {
			return err
		}
		sig, err := decodeSig("Twitch", twitchSig, v, "sha256=", hexDecode, 32)
		if err != nil {
			return err
		}
		at, err := time.Parse(time.RFC3339Nano, ts)
		if err != nil {
			return fmt.Errorf("%w: Twitch: %s is not an RFC 3339 time", ErrSignatureMissing, twitchTS)
		}
		if !anySecret(sha256New, secrets, sig, []byte(id), []byte(ts), body) {
			return fmt.Errorf("%w: Twitch: %s does not match", ErrSignatureInvalid, twitchSig)
		}
		return checkStamp("Twitch", at, tolerance)
	}, nil
}

// Twitch receives EventSub webhooks: it verifies the signature first
// (TwitchVerifier, 10 minutes), answers webhook_callback_verification
// with the challenge as text/plain (never claimed), and keys
// notifications and revocations by Twitch-Eventsub-Message-Id, which the
// signature covers and Twitch keeps when it resends, with the
// subscription's type from the signed body.
func Twitch(secrets ...string) Preset {
	return preset(senderPreset{source: "twitch", name: "Twitch", key: twitchKey, fingerprint: NoFingerprint,
		ttl: TwitchRetention, secrets: secrets,
		verifier: func(s ...string) (Verifier, error) { return TwitchVerifier(TwitchTolerance, s...) },
		headers:  []string{twitchID, twitchTS, twitchSig, twitchType, "Twitch-Eventsub-Subscription-Type", "Twitch-Eventsub-Subscription-Version"},
		handshake: func([]string) handshakeFunc {
			return func(w http.ResponseWriter, r *http.Request, body []byte) bool {
				if r.Header.Get(twitchType) != "webhook_callback_verification" {
					return false
				}
				var hs struct{ Challenge string }
				if json.Unmarshal(body, &hs) != nil || hs.Challenge == "" {
					problem(w, http.StatusBadRequest, "Malformed Twitch verification", "The callback verification carries no challenge.", nil)
					return true
				}
				w.Header().Set("Content-Type", "text/plain")
				w.WriteHeader(http.StatusOK)
				_, _ = w.Write([]byte(hs.Challenge))
				return true
			}
		}})
}

func twitchKey(r *http.Request, body []byte) (string, string, error) {
	id := r.Header.Get(twitchID) // exactly the value signed
	if id == "" {
		return "", "", nil
	}
	f, err := jsonFields(body, "subscription.type")
	if err != nil {
		return "", "", err
	}
	return id, f[0], nil
}
