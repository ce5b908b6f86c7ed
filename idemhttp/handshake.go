package idemhttp

import (
	"encoding/json"
	"net/http"
)

// A handshake is a verified request from the sender that is not an event:
// Slack's url_verification, Zoom's endpoint.url_validation, Twitch's
// webhook_callback_verification, Discord's PING. The preset answers it
// the way the sender expects, after the signature was verified and before
// anything is claimed: a handshake is never stored, never reaches the
// handler, and is answered the same every time. A ping is an unsigned
// handshake (WooCommerce's activation ping, "webhook_id=N"): it proves
// nothing, so it is answered before verification, and it too never claims,
// stores or runs anything (Config.ping).
type handshakeFunc func(w http.ResponseWriter, r *http.Request, body []byte) bool

// AnswerHandshake: the delivery was the sender's handshake (verified; or
// an unsigned ping), answered by the preset; nothing was claimed and the
// handler did not run.
const AnswerHandshake Answer = "handshake"

// writeJSON answers 200 with v as JSON.
func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	_ = json.NewEncoder(w).Encode(v)
}
