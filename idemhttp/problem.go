package idemhttp

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"strings"
)

// RequestIDHeader carries the request id of a problem answer, which is
// also its "request_id" member and the "request_id" attribute of the log
// line that says what happened inside.
const RequestIDHeader = "X-Request-Id"

// problemAnswer is an RFC 9457 problem answer: what the client can act on
// (status, title, detail, headers), and what goes to the log only (msg,
// key, cause, at level).
type problemAnswer struct {
	status        int
	title, detail string
	headers       map[string]string

	level slog.Level  // of the log line; Debug when msg is ""
	msg   string      // the log line; "" for "idemhttp: answered a problem"
	key   string      // the key, when one was made
	cause error       // the internals: never sent to the client
	attrs []slog.Attr // more of them for the log line (the URLs a signature covered)
}

// problem writes p as application/problem+json with a fresh request id,
// and logs its internals under the same id: a client quotes the id, an
// operator finds the cause. SQL error texts, source names, scopes and
// keys never reach the client.
func (m *middleware) problem(w http.ResponseWriter, r *http.Request, p problemAnswer) {
	id := newRequestID()
	msg, level := p.msg, p.level
	if msg == "" {
		msg = "idemhttp: answered a problem"
		if p.cause == nil {
			level = slog.LevelDebug
		}
	}
	attrs := []slog.Attr{slog.String("request_id", id), slog.String("source", m.cfg.Source),
		slog.Int("status", p.status), slog.String("title", p.title)}
	if p.key != "" {
		attrs = append(attrs, slog.String("key", p.key))
	}
	if p.cause != nil {
		attrs = append(attrs, slog.Any("error", p.cause))
	}
	attrs = append(attrs, p.attrs...)
	m.cfg.Logger.LogAttrs(r.Context(), level, msg, attrs...)
	writeProblem(w, id, p.status, p.title, p.detail, p.headers)
}

// writeProblem writes an RFC 9457 problem+json response.
func writeProblem(w http.ResponseWriter, id string, status int, title, detail string, headers map[string]string) {
	for k, v := range headers {
		w.Header().Set(k, v)
	}
	w.Header().Set("Content-Type", "application/problem+json")
	w.Header().Set(RequestIDHeader, id)
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{
		"type":       "about:blank",
		"title":      title,
		"status":     status,
		"detail":     detail,
		"request_id": id,
	})
}

// newRequestID is 16 random bytes, hex.
func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// keyErrorDetail is what a client is told of a KeyFunc's error: the
// problem with the key it sent (a *KeyFieldError, an Idempotency-Key
// header that does not parse), or, for any other error (a custom
// KeyFunc's, which may say anything), that the key could not be read.
func keyErrorDetail(err error) string {
	var kf *KeyFieldError
	var kh *KeyHeaderError
	switch {
	case errors.As(err, &kf):
		return strings.TrimPrefix(kf.Error(), "idemhttp: ")
	case errors.As(err, &kh):
		return kh.Error()
	}
	return "The request's idempotency key could not be read."
}

// problem writes a problem that has no internals to log (a sender's
// handshake or batch the client got wrong, told in its own terms), with a
// request id like every other.
func problem(w http.ResponseWriter, status int, title, detail string, headers map[string]string) {
	writeProblem(w, newRequestID(), status, title, detail, headers)
}
