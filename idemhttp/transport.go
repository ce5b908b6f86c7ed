package idemhttp

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/idemkit/idem"
)

// Outbound calls. A write to another company's API (a charge, a transfer,
// an email through a mail API) made inside an idem effect is sent with the
// effect's deterministic key, so the other side deduplicates our own
// retries: the same event and effect send the same Idempotency-Key on
// every attempt, also after a crash between their call and our record of
// it (the window an effect alone cannot close; docs/effects.md).

// Defaults of TransportConfig.
const DefaultKeyHeader = "Idempotency-Key"

// DefaultKeyMethods are the methods keyed by default: the non-idempotent
// ones of the IETF Idempotency-Key draft.
var DefaultKeyMethods = []string{http.MethodPost, http.MethodPatch}

var (
	// ErrNoEffect: a write (a keyed method) was sent with a context that
	// carries no idem effect, whatever key it carries: a key set by a
	// client library (stripe-go's random one) or by hand is not the same
	// on the event's next run, so it deduplicates nothing. Make the call
	// inside Client.Effect with the SDK's context passed through, or opt
	// this client out with TransportConfig.AllowUnkeyed.
	ErrNoEffect = errors.New("idemhttp: outbound write outside an idem effect")
	// ErrInvalidTransport: a TransportConfig field is out of range.
	ErrInvalidTransport = errors.New("idemhttp: invalid transport config")
)

// TransportConfig configures NewTransport. The zero value is valid.
type TransportConfig struct {
	// Header is the request header that carries the key. Default
	// "Idempotency-Key" (Stripe, Adyen, the IETF draft); PayPal reads
	// "PayPal-Request-Id". Inside an effect the effect's key replaces any
	// value the request already carries under it (stripe-go sets a random
	// one on every write), under any spelling of the name. Outside an
	// effect a write is refused (ErrNoEffect), whether it carries a key or
	// not, unless AllowUnkeyed.
	Header string
	// Methods are the methods keyed, matched case-insensitively (net/http
	// sends a method as it is written). Default POST and PATCH.
	Methods []string
	// Namespace is mixed into every key: set it when two applications (or
	// environments) run effects of the same name for the same events
	// against one account of the same provider. Default none.
	Namespace string
	// AllowUnkeyed opts this client out of the guard: a write outside any
	// effect is sent as it is (with the key its caller or its client
	// library set, or none), instead of failing with ErrNoEffect. Writes
	// inside an effect are keyed all the same. Default false: a write
	// meant to be keyed by an effect that is not (the Effect wrapper
	// forgotten, an SDK that drops the caller's context) is a bug worth
	// hearing about, and a random key an SDK sets would hide it. Set it
	// on a client whose writes are not meant to be keyed by an effect: an
	// SDK that never passes the caller's context on (twilio-go), under an
	// AtMostOnce effect; an API that takes no key.
	AllowUnkeyed bool
}

// Transport is an http.RoundTripper that sets the idempotency key of
// outbound writes from the idem effect in the request's context
// (idem.EffectFrom: the innermost effect of the innermost event):
// Effect.OutboundKey of the call's label, which is its method and URL path
// unless WithOutboundLabel gives another. A write is keyed by the effect
// it belongs to or it is refused: inside an effect the effect's key always
// wins (a key the request already carries, such as a client library's
// own random one, is replaced, so every attempt of the effect sends the
// same key); outside one the write fails with ErrNoEffect, whatever key it
// carries, unless TransportConfig.AllowUnkeyed. It never modifies the
// caller's request.
type Transport struct {
	base      http.RoundTripper
	header    string
	methods   []string
	namespace string
	unkeyed   bool
}

// NewTransport returns a Transport over base (http.DefaultTransport when
// nil), or an error matching ErrInvalidTransport.
func NewTransport(base http.RoundTripper, cfg *TransportConfig) (*Transport, error) {
	var c TransportConfig
	if cfg != nil {
		c = *cfg
	}
	if base == nil {
		base = http.DefaultTransport
	}
	t := &Transport{base: base, header: DefaultKeyHeader, methods: DefaultKeyMethods, namespace: c.Namespace, unkeyed: c.AllowUnkeyed}
	if c.Header != "" {
		if !isToken(c.Header) {
			return nil, fmt.Errorf("%w: Header %q is not an HTTP header name", ErrInvalidTransport, c.Header)
		}
		t.header = http.CanonicalHeaderKey(c.Header)
	}
	if c.Methods != nil {
		if len(c.Methods) == 0 {
			return nil, fmt.Errorf("%w: Methods is empty (nil for the default POST, PATCH)", ErrInvalidTransport)
		}
		for _, m := range c.Methods {
			if !isToken(m) || m != strings.ToUpper(m) {
				return nil, fmt.Errorf("%w: method %q is not an upper-case HTTP method", ErrInvalidTransport, m)
			}
		}
		t.methods = slices.Clone(c.Methods)
	}
	return t, nil
}

type labelCtxKey struct{}

// WithOutboundLabel labels the outbound calls made with ctx, for their
// key: two writes to the same path inside one effect need two labels.
func WithOutboundLabel(ctx context.Context, label string) context.Context {
	return context.WithValue(ctx, labelCtxKey{}, label)
}

// RoundTrip implements http.RoundTripper.
func (t *Transport) RoundTrip(r *http.Request) (*http.Response, error) {
	if !slices.ContainsFunc(t.methods, func(m string) bool { return strings.EqualFold(m, r.Method) }) {
		return t.base.RoundTrip(r)
	}
	eff, ok := idem.EffectFrom(r.Context())
	if !ok {
		if t.unkeyed {
			return t.base.RoundTrip(r)
		}
		closeBody(r)
		if t.callerKeyed(r.Header) {
			// stripe-go (and any SDK with a key of its own) sets a new
			// random key on every call: it would pass a check for "some
			// key" and charge once per run of the event.
			return nil, fmt.Errorf("%w: %s %s carries an %s of its own, which the event's next run would not send again "+
				"(call it inside Client.Effect, passing the effect's context to the client library)",
				ErrNoEffect, r.Method, r.URL.Redacted(), t.header)
		}
		return nil, fmt.Errorf("%w: %s %s (call it inside Client.Effect, passing the effect's context to the client library)",
			ErrNoEffect, r.Method, r.URL.Redacted())
	}
	label, ok := r.Context().Value(labelCtxKey{}).(string)
	if !ok {
		label = strings.ToUpper(r.Method) + " " + r.URL.EscapedPath()
	}
	if t.namespace != "" {
		label = t.namespace + "\x00" + label
	}
	r2 := r.Clone(r.Context())
	for _, name := range t.keyHeaders(r2.Header) {
		delete(r2.Header, name)
	}
	r2.Header.Set(t.header, eff.OutboundKey(label))
	return t.base.RoundTrip(r2)
}

// keyHeaders returns the names under which h holds the key header, in
// any spelling (a caller may set h["idempotency-key"] directly).
func (t *Transport) keyHeaders(h http.Header) []string {
	var names []string
	for name := range h {
		if strings.EqualFold(name, t.header) {
			names = append(names, name)
		}
	}
	return names
}

// callerKeyed reports whether h carries a non-empty key, in any spelling.
func (t *Transport) callerKeyed(h http.Header) bool {
	for _, name := range t.keyHeaders(h) {
		if slices.ContainsFunc(h[name], func(v string) bool { return strings.TrimSpace(v) != "" }) {
			return true
		}
	}
	return false
}

// closeBody honours RoundTrip's contract: the body is closed, even on error.
func closeBody(r *http.Request) {
	if r.Body != nil {
		_ = r.Body.Close()
	}
}

// isToken reports whether s is an RFC 9110 token (a header or method name).
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		ch := s[i]
		if ch >= 'a' && ch <= 'z' || ch >= 'A' && ch <= 'Z' || ch >= '0' && ch <= '9' {
			continue
		}
		if !strings.ContainsRune("!#$%&'*+-.^_`|~", rune(ch)) {
			return false
		}
	}
	return true
}
