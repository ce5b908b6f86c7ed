package idemhttp

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"log/slog"
	"net/http"
	"strings"

	"github.com/idemkit/idem"
)

// The replay guard. GitHub (X-Hub-Signature-256), Shopify
// (X-Shopify-Hmac-Sha256), Bitbucket, GitLab and Linear sign the body only
// (GitLab signs nothing): the delivery id the presets key by is not
// signed, so a captured delivery re-sent with a fresh id verifies and
// would be a new key. For these senders what the signature covers is
// deduplicated too: the signed body (with the event type: two topics may
// carry the same body) is claimed under Source+GuardSuffix with the
// delivery's key as fingerprint. A copy under another id meets the body's
// claim with another fingerprint and is answered as a duplicate without
// running anything; the genuine redelivery (same id, same body) passes
// the guard and is answered from its stored result, as before. Two
// genuine deliveries of the same event type with byte-identical bodies
// are one event. The other direction, the key to what it stands for, is
// the preset's fingerprint (headersFingerprint): the body and the
// unsigned headers a handler acts on. docs/senders.md.
//
// The guard is only for senders that sign the body alone and never send
// one signed body as two events: it would drop a genuine delivery whose
// signed identity differs in what it does not cover (a Twilio GET, whose
// parameters are its signed query and whose body is empty), or that the
// sender legitimately repeats (Twilio's looping <Gather>, WooCommerce's
// deleted events). Those presets key by what the sender keeps across
// retries and changes across events, and have no guard (twilio.go,
// woocommerce.go).

// GuardSuffix is appended to a source to name the source of its replay
// guard's keys ("github/bodies").
const GuardSuffix = "/bodies"

// GuardKey is the replay guard's key for a signed body of an event type:
// the hex SHA-256 of the event type, a newline and the body. An event type
// holding a newline (never one from a header, where the presets read it)
// is hashed instead from a NUL byte and the hex SHA-256 of
// idem.JoinKey(eventType, body): an input with no newline at all, which no
// event type without one gives, so two (event type, body) pairs never
// give one input.
func GuardKey(eventType string, body []byte) string {
	h := sha256.New()
	if strings.IndexByte(eventType, '\n') >= 0 {
		inner := sha256.Sum256([]byte(idem.JoinKey(eventType, string(body))))
		h.Write([]byte{0})
		h.Write([]byte(hex.EncodeToString(inner[:])))
		return hex.EncodeToString(h.Sum(nil))
	}
	h.Write([]byte(eventType))
	h.Write([]byte{'\n'})
	h.Write(body)
	return hex.EncodeToString(h.Sum(nil))
}

// guard claims the signed body for key (synchronous mode). It returns
// replay = true when the body was claimed for another key (a copy under a
// fresh delivery id: answer as a duplicate, run nothing), and otherwise a
// function to call once the delivery is answered, which completes the
// body's claim if this delivery made it.
func (m *middleware) guard(ctx context.Context, key, eventType string, body []byte) (replay bool, done func(), err error) {
	source := m.cfg.Source + GuardSuffix
	gk := GuardKey(eventType, body)
	opts := []idem.ClaimOption{idem.WithFingerprint(key)}
	if m.cfg.TTL > 0 {
		opts = append(opts, idem.WithTTL(m.cfg.TTL))
	}
	cl, err := m.cfg.Client.Claim(ctx, source, gk, opts...)
	switch {
	case err != nil:
		return false, nil, err
	case cl.Outcome == idem.Mismatch:
		return true, nil, nil
	case cl.Outcome != idem.Acquired:
		return false, func() {}, nil
	}
	return false, func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), idem.DefaultRecordTimeout)
		defer cancel()
		if err := m.cfg.Client.Complete(rctx, source, gk, cl.Token, nil); err != nil && !errors.Is(err, idem.ErrStaleToken) {
			// The guard's lease runs out and the next delivery of the body
			// under this key claims it again: nothing is lost.
			m.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idemhttp: could not complete the replay guard's claim",
				slog.String("source", source), slog.String("key", key), slog.Any("error", err))
		}
	}, nil
}

// replayedCopy answers a copy of a delivery under another delivery id: as
// a duplicate, with nothing run.
func (m *middleware) replayedCopy(w http.ResponseWriter, r *http.Request, key string) Answer {
	w.Header().Set("Content-Type", "application/json")
	m.replayed(w, r, key, http.StatusOK, ReplayCopy)
	w.WriteHeader(http.StatusOK)
	w.Write([]byte(`{"duplicate":true}` + "\n"))
	return AnswerReplayed
}

// baseHeaders are kept with every delivery in asynchronous mode.
var baseHeaders = []string{"Content-Type", "User-Agent"}

// keep returns the request headers a delivery keeps in asynchronous mode
// (stored with its job, handed to the worker's handler): Content-Type,
// User-Agent, the sender's own event, delivery and signature headers (a
// preset's), and Config.KeepHeaders. Nothing else: credentials, cookies,
// API keys and tokens of any name never reach the database.
func (m *middleware) keep(h http.Header) http.Header {
	out := http.Header{}
	for _, list := range [][]string{baseHeaders, m.cfg.senderHeaders, m.cfg.KeepHeaders} {
		for _, name := range list {
			if v := h.Values(name); len(v) > 0 {
				out[http.CanonicalHeaderKey(name)] = append([]string(nil), v...)
			}
		}
	}
	return out
}
