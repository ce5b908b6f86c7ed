package idemhttp

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// MailgunTolerance is how far the signed timestamp of a Mailgun webhook
// may be from the receiver's clock, either way. Mailgun retries a
// delivery for about 8 hours (10 min, 10 min, 15 min, 30 min, 1 h, 2 h,
// 4 h: mailgun/documentation, source/user_manual.rst) and does not say
// whether a retry is signed afresh; its guide warns that "there can be
// delays in webhook processing" and asks for no aggressive check. A day
// accepts every retry even if it keeps the first timestamp, and stays far
// below the keys' retention, so a copy is never accepted after its key is
// gone (docs/senders.md, "Mailgun").
const MailgunTolerance = 24 * time.Hour

// MailgunRetention is how long the Mailgun preset keeps keys: a week,
// more than the retry window plus twice the tolerance.
const MailgunRetention = 7 * 24 * time.Hour

// mailgunSignature is the "signature" object of a Mailgun webhook body.
// Mailgun signs timestamp + token, nothing else (mailgun-go's
// VerifyWebhookSignature); parent-signature is the same HMAC under the
// primary account's key, sent for a subaccount's events.
type mailgunSignature struct {
	Timestamp       json.RawMessage `json:"timestamp"`
	Token           string          `json:"token"`
	Signature       string          `json:"signature"`
	ParentSignature string          `json:"parent-signature"`
}

// mailgunBody reads a Mailgun webhook body: its signature object (the
// timestamp as written, digits only) and its event-data's "event".
func mailgunBody(body []byte) (sig mailgunSignature, ts, event string, err error) {
	var b struct {
		Signature *mailgunSignature `json:"signature"`
		EventData struct {
			Event string `json:"event"`
		} `json:"event-data"`
	}
	if err := json.Unmarshal(body, &b); err != nil {
		return sig, "", "", fmt.Errorf("the body is not a Mailgun webhook (JSON with signature and event-data): %w", err)
	}
	if b.Signature == nil {
		return sig, "", "", fmt.Errorf("the body has no signature object")
	}
	sig = *b.Signature
	ts = scalar(sig.Timestamp)
	if ts == "" || strings.TrimLeft(ts, "0123456789") != "" || ts[0] == '0' {
		return sig, "", "", fmt.Errorf("signature.timestamp %s is not a Unix timestamp", sig.Timestamp)
	}
	if sig.Token == "" || len(sig.Token) > 512 {
		return sig, "", "", fmt.Errorf("signature.token is empty or longer than 512 bytes")
	}
	return sig, ts, b.EventData.Event, nil
}

// MailgunVerifier verifies a Mailgun webhook (the JSON body Mailgun posts
// for its current, "v3" webhooks): signature.signature, or
// signature.parent-signature, is the hex HMAC-SHA256 of signature.timestamp
// followed by signature.token (no separator) under the webhook signing
// key, and the timestamp is within tolerance either way. The tolerance is
// also what makes the unseparated concatenation unambiguous: moving a
// digit between the timestamp and the token changes the timestamp tenfold.
// Mailgun signs nothing of event-data (see Mailgun).
func MailgunVerifier(tolerance time.Duration, signingKeys ...string) (Verifier, error) {
	if err := checkSecrets("Mailgun", signingKeys); err != nil {
		return nil, err
	}
	if tolerance <= 0 {
		return nil, fmt.Errorf("idemhttp: Mailgun: tolerance %v must be positive", tolerance)
	}
	keys := append([]string(nil), signingKeys...)
	return func(_ *http.Request, body []byte) error {
		sig, ts, _, err := mailgunBody(body)
		if err != nil {
			return fmt.Errorf("%w: Mailgun: %v", ErrSignatureMissing, err)
		}
		signed := []byte(ts + sig.Token)
		for _, v := range []string{sig.Signature, sig.ParentSignature} {
			mac, err := hexDecode(v)
			if err != nil || len(mac) != 32 {
				continue
			}
			if anySecret(sha256New, keys, mac, signed) {
				at, err := unixStamp("Mailgun", "signature.timestamp", ts, false)
				if err != nil {
					return err
				}
				return checkStamp("Mailgun", at, tolerance)
			}
		}
		if sig.Signature == "" && sig.ParentSignature == "" {
			return fmt.Errorf("%w: Mailgun: signature.signature is missing", ErrSignatureMissing)
		}
		return fmt.Errorf("%w: Mailgun: signature.signature does not match", ErrSignatureInvalid)
	}, nil
}

// mailgunKey keys a Mailgun webhook by its signed token, with
// event-data.event as the type.
func mailgunKey(_ *http.Request, body []byte) (string, string, error) {
	if len(body) == 0 {
		return "", "", nil
	}
	sig, _, event, err := mailgunBody(body)
	if err != nil {
		return "", "", err
	}
	return sig.Token, event, nil
}

// mailgunFingerprint is the fingerprint of a Mailgun webhook's
// event-data, as delivered: what the signature does not cover, bound to
// the signed token by the first delivery under it. The signature object
// is left out, so a retry under the same token signed at another time is
// the same delivery.
func mailgunFingerprint(_ *http.Request, body []byte) string {
	var b struct {
		EventData json.RawMessage `json:"event-data"`
	}
	if json.Unmarshal(body, &b) != nil {
		return idem.Fingerprint(body)
	}
	return idem.Fingerprint(b.EventData)
}

// Mailgun receives Mailgun's webhooks (JSON: a signature object and
// event-data) and verifies them first (MailgunVerifier, MailgunTolerance).
// Mailgun signs the timestamp and a random 50-character token and nothing
// else: event-data, its id included, is not signed, and anyone holding one
// delivery can attach its signature to other event-data. So the key is the
// signed token, which only Mailgun can make (Mailgun's guide: a token
// seen before is a replay), and the fingerprint is event-data as delivered: the
// first delivery under a token fixes the event-data it stands for, and a copy of
// the signature with other event-data is a mismatch (422) and runs
// nothing, also after a failed first attempt. A retry that carries the
// same token and body is the same delivery; one signed afresh (a new
// token) is a new key, so after a 2xx Mailgun did not receive the event
// runs again: read event-data.id (unsigned, "unique within a day") in the
// handler where that matters. The type is event-data.event.
func Mailgun(signingKeys ...string) Preset {
	return preset(senderPreset{source: "mailgun", name: "Mailgun", key: mailgunKey, fingerprint: mailgunFingerprint,
		ttl: MailgunRetention, secrets: signingKeys,
		verifier: func(s ...string) (Verifier, error) { return MailgunVerifier(MailgunTolerance, s...) }})
}
