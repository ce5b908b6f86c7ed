package idemhttp

import (
	"crypto/ed25519"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"
)

// DiscordRetention is how long the Discord preset keeps keys. Discord does
// not retry an interaction (it must be answered within 3 seconds; docs:
// discord.com/developers/docs/interactions/receiving-and-responding); the
// keys stop a captured interaction replayed within the timestamp
// tolerance, and a day is far past it.
const DiscordRetention = 24 * time.Hour

// DiscordVerifier verifies X-Signature-Ed25519: the hex Ed25519
// signature, under the application's public key (hex, from the developer
// portal), of X-Signature-Timestamp followed by the body; the timestamp
// must be within tolerance either way. Several keys may be given.
// Verification is crypto/ed25519's.
func DiscordVerifier(tolerance time.Duration, publicKeys ...string) (Verifier, error) {
	if err := checkSecrets("Discord", publicKeys); err != nil {
		return nil, err
	}
	if tolerance <= 0 {
		return nil, fmt.Errorf("idemhttp: Discord: tolerance %v must be positive", tolerance)
	}
	keys := make([]ed25519.PublicKey, len(publicKeys))
	for i, k := range publicKeys {
		b, err := hex.DecodeString(strings.TrimSpace(k))
		if err != nil || len(b) != ed25519.PublicKeySize {
			return nil, fmt.Errorf("%w: Discord: public key %d of %d is not %d hex-encoded bytes", ErrInvalidSecret, i+1, len(publicKeys), ed25519.PublicKeySize)
		}
		keys[i] = b
	}
	return func(r *http.Request, body []byte) error {
		ts, err := oneHeader(r, "Discord", "X-Signature-Timestamp")
		if err != nil {
			return err
		}
		v, err := oneHeader(r, "Discord", "X-Signature-Ed25519")
		if err != nil {
			return err
		}
		sig, err := decodeSig("Discord", "X-Signature-Ed25519", v, "", hexDecode, ed25519.SignatureSize)
		if err != nil {
			return err
		}
		at, err := unixStamp("Discord", "X-Signature-Timestamp", ts, false)
		if err != nil {
			return err
		}
		msg := append([]byte(ts), body...)
		for _, k := range keys {
			if ed25519.Verify(k, msg, sig) {
				return checkStamp("Discord", at, tolerance)
			}
		}
		return fmt.Errorf("%w: Discord: X-Signature-Ed25519 does not verify", ErrSignatureInvalid)
	}, nil
}

// Discord receives interactions at an application's Interactions
// Endpoint URL: it verifies X-Signature-Ed25519 with the application's
// public key first (DiscordVerifier, 5 minutes), answers PING (type 1)
// with {"type":1} (never claimed), and keys every other interaction by
// its id, inside the signed body, with its type (a number) as the event
// type. The handler's answer is the interaction response; a copy is
// answered with it.
func Discord(publicKeys ...string) Preset {
	return preset(senderPreset{source: "discord", name: "Discord", key: bodyKey("id", "type"), fingerprint: NoFingerprint,
		ttl: DiscordRetention, secrets: publicKeys,
		verifier: func(s ...string) (Verifier, error) { return DiscordVerifier(DefaultTolerance, s...) },
		headers:  []string{"X-Signature-Ed25519", "X-Signature-Timestamp"},
		handshake: func([]string) handshakeFunc {
			return func(w http.ResponseWriter, _ *http.Request, body []byte) bool {
				var hs struct {
					Type json.Number `json:"type"`
				}
				if json.Unmarshal(body, &hs) != nil || hs.Type != "1" {
					return false
				}
				writeJSON(w, map[string]int{"type": 1})
				return true
			}
		}})
}
