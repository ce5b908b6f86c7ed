package idemhttp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/idemkit/idem"
)

// Delivery is a verified, keyed delivery handed to an Acceptor.
type Delivery struct {
	Source, Key, EventType, Fingerprint string
	Body                                []byte
	Header                              http.Header
	// TTL and Lease are Config.TTL and Config.Lease (a preset's, or 0 for
	// the source's policy): the retention of the accepted key, and the
	// lease of each attempt to process it, as in synchronous mode.
	TTL, Lease time.Duration
	// GuardSource and GuardKey, when set, are the replay guard's claim of
	// the signed body (see GuardKey): claim it in the same transaction as
	// the key, with Key as its fingerprint, and treat a mismatch as a
	// duplicate (a copy of the delivery under another delivery id).
	GuardSource, GuardKey string
	// Method is the request's method; Target the request target the
	// delivery arrived at, its path and query (RequestTarget); Host its
	// Host; Pattern the http.ServeMux pattern that routed it ("" under
	// another router). The inbox replays the delivery to its handler as
	// the same method at the same target, through the same pattern, so
	// the handler reads the same method, URL, query and r.PathValue.
	Method, Target, Host, Pattern string
	// Principal is what Config.Scope named for the request ("" none):
	// kept with the delivery and handed to the handler (Principal).
	Principal string
}

// RequestTarget returns r's path and query as a storable text: the path
// escaped as it arrived (r.URL.EscapedPath), and the raw query with each
// byte that is not valid UTF-8 percent-encoded, which decodes to the same
// values (r.URL.Query), while PostgreSQL's text could not hold the byte.
func RequestTarget(r *http.Request) string {
	target := r.URL.EscapedPath()
	if target == "" {
		target = "/"
	}
	q := r.URL.RawQuery
	if q == "" && !r.URL.ForceQuery {
		return target
	}
	var b strings.Builder
	b.Grow(len(target) + 1 + len(q))
	b.WriteString(target)
	b.WriteByte('?')
	for i := 0; i < len(q); {
		c, size := utf8.DecodeRuneInString(q[i:])
		if c == utf8.RuneError && size <= 1 || q[i] < 0x20 || q[i] == 0x7f {
			fmt.Fprintf(&b, "%%%02X", q[i])
			i++
			continue
		}
		b.WriteString(q[i : i+size])
		i += size
	}
	return b.String()
}

// Acceptor accepts deliveries for later processing (Config.Async). Package
// inbox implements it on River; idemhttp does not import it, so River stays
// out of the programs that do not use it.
type Acceptor interface {
	// AcceptDelivery makes the delivery durable and returns whether it
	// was accepted before (a duplicate). It returns an error matching
	// idem.ErrMismatch for a key seen with another fingerprint.
	AcceptDelivery(ctx context.Context, d *Delivery) (duplicate bool, err error)
}

// accept is the asynchronous mode: accept, answer 202.
func (m *middleware) accept(w http.ResponseWriter, r *http.Request, d *Delivery) Answer {
	dup, err := m.cfg.Async.AcceptDelivery(r.Context(), d)
	if errors.Is(err, idem.ErrMismatch) {
		// Stored by an earlier version's JSONFingerprint (numbers as
		// written): the same payload matches that form.
		if old := legacyFingerprint(m.cfg.Fingerprint, r, d.Body, d.Fingerprint); old != "" {
			d.Fingerprint = old
			dup, err = m.cfg.Async.AcceptDelivery(r.Context(), d)
		}
	}
	switch {
	case err == nil:
		w.Header().Set("Content-Type", "application/json")
		answer := AnswerAccepted
		if dup {
			m.replayed(w, r, d.Key, http.StatusAccepted, ReplayAccepted)
			answer = AnswerReplayed
		}
		w.WriteHeader(http.StatusAccepted)
		if dup {
			w.Write([]byte(`{"accepted":true,"duplicate":true}` + "\n"))
		} else {
			w.Write([]byte(`{"accepted":true}` + "\n"))
		}
		return answer
	case errors.Is(err, idem.ErrMismatch):
		m.problem(w, r, problemAnswer{status: http.StatusUnprocessableEntity, title: "Idempotency key reused",
			detail: "This idempotency key was used with a different request payload."})
		return AnswerMismatch
	case errors.Is(err, idem.ErrInvalidInput):
		m.problem(w, r, problemAnswer{status: http.StatusBadRequest, title: "Invalid delivery",
			detail: "The delivery's key or request cannot be stored: keys are at most 512 bytes of UTF-8 text without NUL characters.",
			level:  slog.LevelInfo, msg: "idemhttp: the inbox refused the delivery", key: d.Key, cause: err})
		return AnswerBadRequest
	}
	m.problem(w, r, problemAnswer{status: http.StatusServiceUnavailable, title: "Inbox unavailable",
		detail: "The delivery was not accepted; retry later.", headers: map[string]string{"Retry-After": "5"},
		level: slog.LevelError, msg: "idemhttp: could not accept the delivery", key: d.Key, cause: err})
	return AnswerUnavailable
}
