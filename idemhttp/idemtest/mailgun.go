package idemtest

import (
	"encoding/hex"
	"encoding/json"
	"net/http"
	"strconv"
	"time"

	"github.com/idemkit/idem"
)

// Mailgun signs as Mailgun documents it, for idemhttp.Mailgun(signingKey):
// the body is {"signature": {"timestamp", "token", "signature"},
// "event-data": {...}}, where signature is the hex HMAC-SHA256 of the
// timestamp followed by the token (Mailgun publishes no signer; mailgun-go's
// VerifyWebhookSignature checks these in internal/sendersigned). The
// delivery's ID is the token, a fresh 50-character one per event; a
// redelivery keeps it and is signed at a new timestamp. Only the
// signature object is signed: event-data is not.
func Mailgun(signingKey string) *Sender {
	return &Sender{name: "mailgun", newID: func() string { return randomHex(25) },
		event: func(token, typ string, data json.RawMessage) ([]byte, http.Header) {
			return marshal(map[string]any{
				"signature": map[string]any{"token": token},
				"event-data": map[string]any{"event": typ, "id": randomHex(11), "timestamp": float64(time.Now().UnixMicro()) / 1e6,
					"recipient": "alice@example.com", "user-variables": data},
			}), http.Header{"Content-Type": {"application/json"}, "User-Agent": {"mailgun/treq-16.12.0"}}
		},
		stamp: func(body []byte, at time.Time) []byte { return MailgunSign(signingKey, body, at) },
		sign:  func(http.Header, string, []byte, time.Time) error { return nil },
		forge: func() *Sender { return Mailgun("idemtest forger") }}
}

// MailgunSign returns body with its signature object's timestamp set to
// at and its signature computed under signingKey, as Mailgun signs: the
// token and event-data are kept as they are.
func MailgunSign(signingKey string, body []byte, at time.Time) []byte {
	var m map[string]json.RawMessage
	if json.Unmarshal(body, &m) != nil {
		return body
	}
	var sig map[string]any
	if json.Unmarshal(m["signature"], &sig) != nil || sig == nil {
		sig = map[string]any{}
	}
	token, _ := sig["token"].(string)
	ts := strconv.FormatInt(at.Unix(), 10)
	sig["timestamp"] = ts
	sig["signature"] = hex.EncodeToString(hmac256(signingKey, ts, token))
	m["signature"] = marshal(sig)
	return marshal(m)
}

// Calendly signs as Calendly documents it (Calendly-Webhook-Signature:
// t=<unix>,v1=<hex HMAC-SHA256 of t + "." + body>), for
// idemhttp.Calendly(signingKey). The body is {"event": typ, "created_at",
// "created_by", "payload": data with the invitee's uri}; the delivery's ID
// is the preset's key (event, created_at, payload.uri). Calendly
// publishes no signer or verifier.
func Calendly(signingKey string) *Sender {
	return &Sender{name: "calendly", newID: uuid,
		event: func(id, typ string, data json.RawMessage) ([]byte, http.Header) {
			var payload map[string]any
			if json.Unmarshal(data, &payload) != nil || payload == nil {
				payload = map[string]any{"data": data}
			}
			payload["uri"] = "https://api.calendly.com/scheduled_events/" + uuid() + "/invitees/" + id
			return marshal(map[string]any{"event": typ, "created_at": time.Now().UTC().Format("2006-01-02T15:04:05.000000Z"),
				"created_by": "https://api.calendly.com/users/" + uuid(), "payload": payload}), http.Header{"Content-Type": {"application/json"}}
		},
		idOf: func(_ string, body []byte) string {
			var b struct {
				Event     string `json:"event"`
				CreatedAt string `json:"created_at"`
				Payload   struct {
					URI string `json:"uri"`
				} `json:"payload"`
			}
			_ = json.Unmarshal(body, &b)
			return idem.JoinKey(b.Event, b.CreatedAt, b.Payload.URI)
		},
		sign: func(h http.Header, _ string, body []byte, at time.Time) error {
			ts := strconv.FormatInt(at.Unix(), 10)
			h.Set("Calendly-Webhook-Signature", "t="+ts+",v1="+hex.EncodeToString(hmac256(signingKey, ts, ".", string(body))))
			return nil
		},
		forge: func() *Sender { return Calendly("idemtest forger") }}
}
