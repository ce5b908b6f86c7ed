package idemhttp

import (
	"crypto/ecdsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"
)

// SendGridRetention is how long the SendGrid preset keeps each event's
// key: SendGrid retries an Event Webhook POST that is not answered 2xx
// for up to 24 hours (www.twilio.com/docs/sendgrid/for-developers/tracking-events/event,
// "Event Webhook retries"); a week covers it.
const SendGridRetention = 7 * 24 * time.Hour

// SendGrid's signed Event Webhook headers.
const (
	sendgridSig = "X-Twilio-Email-Event-Webhook-Signature"
	sendgridTS  = "X-Twilio-Email-Event-Webhook-Timestamp"
)

// SendGridVerifier verifies the signed Event Webhook: X-Twilio-Email-
// Event-Webhook-Signature is the base64 ASN.1 ECDSA (P-256, SHA-256)
// signature of X-Twilio-Email-Event-Webhook-Timestamp followed by the
// body, under the verification key SendGrid shows (base64 DER public
// key). Several keys may be given. Verification is crypto/ecdsa's.
// SendGrid publishes no tolerance and its own libraries check none; the
// events' keys are inside the signed body, so a replay is absorbed.
func SendGridVerifier(publicKeys ...string) (Verifier, error) {
	if err := checkSecrets("SendGrid", publicKeys); err != nil {
		return nil, err
	}
	keys := make([]*ecdsa.PublicKey, len(publicKeys))
	for i, k := range publicKeys {
		der, err := base64.StdEncoding.DecodeString(strings.TrimSpace(k))
		if err != nil {
			return nil, fmt.Errorf("%w: SendGrid: verification key %d of %d is not base64: %v", ErrInvalidSecret, i+1, len(publicKeys), err)
		}
		pub, err := x509.ParsePKIXPublicKey(der)
		if err != nil {
			return nil, fmt.Errorf("%w: SendGrid: verification key %d of %d: %v", ErrInvalidSecret, i+1, len(publicKeys), err)
		}
		ec, ok := pub.(*ecdsa.PublicKey)
		if !ok {
			return nil, fmt.Errorf("%w: SendGrid: verification key %d of %d is not an ECDSA key", ErrInvalidSecret, i+1, len(publicKeys))
		}
		keys[i] = ec
	}
	return func(r *http.Request, body []byte) error {
		ts, err := oneHeader(r, "SendGrid", sendgridTS)
		if err != nil {
			return err
		}
		v, err := oneHeader(r, "SendGrid", sendgridSig)
		if err != nil {
			return err
		}
		sig, err := base64.StdEncoding.DecodeString(v)
		if err != nil || len(sig) == 0 {
			return fmt.Errorf("%w: SendGrid: %s is not base64", ErrSignatureMissing, sendgridSig)
		}
		h := sha256.New()
		h.Write([]byte(ts))
		h.Write(body)
		digest := h.Sum(nil)
		for _, k := range keys {
			if ecdsa.VerifyASN1(k, digest, sig) {
				return nil
			}
		}
		return fmt.Errorf("%w: SendGrid: %s does not verify", ErrSignatureInvalid, sendgridSig)
	}, nil
}

// SendGrid receives the signed Event Webhook (a JSON array of events per
// POST): it verifies the ECDSA signature first (SendGridVerifier), then
// deduplicates each event on its sg_event_id, inside the signed body,
// with "event" (delivered, open, bounce, ...) as the type. The handler
// gets a JSON array of the events not processed before (docs/senders.md,
// "Deliveries of many events"); asynchronous mode is not supported.
func SendGrid(publicKeys ...string) Preset {
	return preset(senderPreset{source: "sendgrid", name: "SendGrid", key: batchOnly, fingerprint: NoFingerprint,
		ttl: SendGridRetention, secrets: publicKeys, verifier: SendGridVerifier,
		headers: []string{sendgridSig, sendgridTS},
		batch: &batchSpec{event: func(raw json.RawMessage) (string, string) {
			f, err := jsonFields(raw, "sg_event_id", "event")
			if err != nil {
				return "", ""
			}
			return f[0], f[1]
		}}})
}
