package idem

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/idemkit/idem/internal/sqlstate"
)

// Effects. Some work cannot roll back with a transaction: an email sent, a
// card charged, a call to another company's API. Inside the work of an
// event (Do's fn, an idemhttp handler, an inbox worker), Client.Effect
// runs such a named side effect at most once per event, however often the
// event's work runs: the effect has a key of its own, derived from the
// event's key and its name, with its own lease, fencing token and stored
// result, replayed when the work runs again. It is recorded on its own,
// never inside the event's transaction, since the email cannot be taken
// back when that transaction rolls back. docs/effects.md says what
// commits when, and which window remains at-least-once: between the side
// effect and its record. An outbound call closes that window with the
// effect's deterministic OutboundKey, which idemhttp.Transport sends as
// Idempotency-Key.

// EffectsSuffix is appended to an event's source to name the source of its
// effects' keys: the effects of the events of "stripe" are keys of
// "stripe/effects" (stats and metrics count them there, and a policy row
// for that source sets their lease and retries). Do not name a source of
// your own with this suffix.
const EffectsSuffix = "/effects"

var (
	// ErrNoEvent: Effect was called with a context that carries no event:
	// call it inside Do's work or an idemhttp handler, or attach a claim
	// with WithEvent.
	ErrNoEvent = errors.New("idem: no event in the context")
	// ErrEffectNeedsPool: Effect was called on a Client bound to a
	// transaction. An effect is recorded on its own, the moment it has
	// run, so it must not roll back with a transaction: call Effect on a
	// pool-backed Client (New(pool), NewSQL(*sql.DB)).
	ErrEffectNeedsPool = errors.New("idem: effects are recorded on their own; call Effect on a pool-backed Client, not one bound to a transaction")
	// ErrInDoubt: an AtMostOnce effect whose earlier attempt started and
	// never recorded an outcome (the process died, or its record was lost).
	// It may or may not have happened; it is not run again. The effect is
	// failed for good with this reason, for a person or a reconciliation
	// job to settle.
	ErrInDoubt = errors.New("idem: effect in doubt")
)

// Effect describes the effect whose function is running; EffectFrom reads
// it from the function's context.
type Effect struct {
	// Name is the effect's name, unique within its event.
	Name string
	// EventSource and EventKey identify the event.
	EventSource, EventKey string
	// Source and Key are the effect's own key in idem.processed_events.
	Source, Key string
	// Attempt is 1 the first time the effect runs. Above 1, an earlier
	// attempt started and did not complete: it failed, or died. Either way
	// it may have had its effect (a timed-out charge may have gone
	// through), which is what OutboundKey is for.
	Attempt int
	// PreviousError is the error an earlier attempt recorded, if any.
	PreviousError string
}

// OutboundKey returns the deterministic idempotency key for an outbound
// call this effect makes: the same event, effect and label give the same
// key on every attempt, in every process, after every restart; any other
// combination a different one. It is 64 hex characters (SHA-256). Give
// each distinct call in one effect its own label; idemhttp.Transport
// labels a call with its method and path.
func (e Effect) OutboundKey(label string) string {
	h := sha256.New()
	for _, part := range [...]string{"idem.outbound.v1", e.EventSource, e.EventKey, e.Name, label} {
		fmt.Fprintf(h, "%d:%s", len(part), part)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// scopeCtxKey holds a context's *eventScope.
type scopeCtxKey struct{}

// eventScope is what a context says about the event it works for: the
// event's claim and, inside the function of one of its effects, that
// effect. The two are one value, so that starting the work of an event
// (Do, DoBatch, WithEvent, the inbox) replaces both: an effect never
// reaches the calls of another event's work, however deeply nested (a Do
// started inside an effect has no effect until it calls Effect itself).
type eventScope struct {
	claim  *Claim
	effect *Effect
}

func withScope(ctx context.Context, cl *Claim, eff *Effect) context.Context {
	return context.WithValue(ctx, scopeCtxKey{}, &eventScope{claim: cl, effect: eff})
}

// WithEvent returns ctx carrying the claim of an event, so that Effect
// calls under ctx belong to that event. Do, idemhttp and the inbox attach
// their claim themselves; call it when you claim by hand (a DoBatch item).
// It starts a new scope: under the returned context, no effect of an
// enclosing event is in force (EffectFrom reports none).
func WithEvent(ctx context.Context, cl *Claim) context.Context {
	if cl == nil {
		return ctx
	}
	c := *cl
	return withScope(ctx, &c, nil)
}

// EventFrom returns the claim of the event ctx belongs to.
func EventFrom(ctx context.Context) (*Claim, bool) {
	s, _ := ctx.Value(scopeCtxKey{}).(*eventScope)
	if s == nil || s.claim == nil {
		return nil, false
	}
	return s.claim, true
}

// EffectFrom returns the effect whose function ctx was given to: the
// innermost effect of the innermost event. Inside a Do (or DoBatch, or
// under WithEvent) started in an effect's function, there is none until
// that event's work calls Effect itself.
func EffectFrom(ctx context.Context) (Effect, bool) {
	s, _ := ctx.Value(scopeCtxKey{}).(*eventScope)
	if s == nil || s.effect == nil {
		return Effect{}, false
	}
	return *s.effect, true
}

// EffectOption adjusts one Effect call.
type EffectOption func(*effectArgs)

type effectArgs struct {
	atMostOnce bool
	lease      time.Duration
}

// AtMostOnce: the effect's function is called at most once, ever. By
// default an attempt that died before recording its outcome is run again
// after its lease (at-least-once in that window; pair it with OutboundKey
// so the other side deduplicates). Under AtMostOnce such an effect is
// instead failed for good as ErrInDoubt, and an error from the function
// fails it for good at once (as if wrapped with Permanent): use it where
// doing something twice is worse than not at all.
func AtMostOnce() EffectOption { return func(a *effectArgs) { a.atMostOnce = true } }

// EffectLease sets the effect's lease (1 second to 7 days), extended while
// the function runs, as Do does. Default: the policy of the effects'
// source (EffectsSuffix), else the default policy's.
func EffectLease(d time.Duration) EffectOption { return func(a *effectArgs) { a.lease = d } }

// EffectError is an error from Effect: it names the effect and its event,
// and unwraps to the cause (ErrInProgress, ErrInDoubt, *FailedError, the
// function's own error, an *Error from PostgreSQL, ...).
type EffectError struct {
	Name, EventSource, EventKey string
	Err                         error
	inDoubt                     bool
}

func (e *EffectError) Error() string {
	if e.EventSource == "" && e.EventKey == "" {
		return fmt.Sprintf("idem: effect %q: %v", e.Name, e.Err)
	}
	return fmt.Sprintf("idem: effect %q of %q/%q: %v", e.Name, e.EventSource, e.EventKey, e.Err)
}

// Unwrap lets errors.Is/As reach the cause (and ErrInDoubt).
func (e *EffectError) Unwrap() []error {
	if e.inDoubt {
		return []error{ErrInDoubt, e.Err}
	}
	return []error{e.Err}
}

// Effect runs fn at most once for the event ctx belongs to (see EventFrom),
// under the effect's own key (see EffectsSuffix): the first call runs fn
// and records its result the moment it returns, on its own, outside any
// transaction; later calls for the same event and name return the stored
// result with Replayed set, without running fn. It is Do on that key, with
// Do's heartbeat, recording, panics, Permanent and lease loss, and its
// retention is the event's (at least its EffectLease; when the effects'
// policy lease is longer than the event's retention, the effect's lease is
// that retention). Call it on a pool-backed Client.
//
// Errors are *EffectError. While another run of the same event holds the
// effect, it returns ErrInProgress: fail the event's work, and its retry
// replays the effect. An error from fn releases the effect for the next
// run (unless Permanent or AtMostOnce); fn's context carries the Effect
// (EffectFrom), whose OutboundKey keys the calls it makes.
func (c *Client) Effect(ctx context.Context, name string, fn func(ctx context.Context) (any, error), opts ...EffectOption) (*Result, error) {
	ev, ok := EventFrom(ctx)
	if !ok {
		return nil, &EffectError{Name: name, Err: ErrNoEvent}
	}
	fail := func(err error) *EffectError {
		return &EffectError{Name: name, EventSource: ev.Source, EventKey: ev.Key, Err: err}
	}
	if !c.d.concurrent() {
		return nil, fail(ErrEffectNeedsPool)
	}
	source, key, err := EffectKey(ev.Source, ev.Key, name)
	if err != nil {
		return nil, fail(err)
	}
	var a effectArgs
	for _, o := range opts {
		o(&a)
	}
	copts := []ClaimOption{func(a *claimArgs) { a.acquireWait = c.cfg.EffectAcquireWait }}
	var ttl time.Duration
	if t := ev.ExpiresAt.Sub(ev.FirstSeen); !ev.FirstSeen.IsZero() && t > 0 {
		// The effect outlives its event: both retentions are counted by
		// the database's clock, the effect's from a later first sight. It
		// is kept at least as long as its own lease (a lease longer than
		// the retention is refused).
		ttl = min(max(t, time.Minute, a.lease), 10*365*24*time.Hour)
		copts = append(copts, WithTTL(ttl))
	}
	if a.lease != 0 {
		copts = append(copts, WithLease(a.lease))
	}
	work := func(ctx context.Context) (any, error) {
		cl, _ := EventFrom(ctx) // Do attached the effect's own claim
		eff := &Effect{Name: name, EventSource: ev.Source, EventKey: ev.Key, Source: source, Key: key,
			Attempt: cl.Attempt, PreviousError: cl.Error}
		if a.atMostOnce && cl.Attempt > 1 {
			msg := fmt.Sprintf("attempt %d started and recorded no outcome; not run again (AtMostOnce)", cl.Attempt-1)
			if cl.Error != "" {
				msg += "; its last recorded error: " + cl.Error
			}
			return nil, Permanent(fmt.Errorf("%w: %s", ErrInDoubt, msg))
		}
		ctx = withScope(ctx, ev, eff)
		v, err := fn(ctx)
		if err != nil && a.atMostOnce {
			err = Permanent(err)
		}
		return v, err
	}
	ctx, start := c.traceStart(ctx, TraceStartData{Op: OpEffect, Source: ev.Source, Key: ev.Key, Name: name})
	res, err := c.do(ctx, source, key, work, copts)
	if a.lease == 0 && ttl > 0 && leaseOverTTL(err) {
		// The effects' policy lease is longer than the event's retention,
		// which the effect takes (an event with a TTL of a minute, the
		// default lease of two): the claim refused the pair before
		// anything ran. The effect's lease is its retention instead.
		res, err = c.do(ctx, source, key, work, append(copts, WithLease(ttl)))
	}
	if c.tr != nil {
		end := TraceEndData{Op: OpEffect, Source: ev.Source, Key: ev.Key, Name: name, Err: err}
		if res != nil {
			end.Claim, end.Replayed = res.Claim, res.Replayed
		}
		c.traceEnd(ctx, start, end)
	}
	if err != nil {
		var f *FailedError
		switch {
		case errors.Is(err, ErrInDoubt):
			// Found in doubt just now, and so recorded: answer as every
			// later run will be answered.
			f = &FailedError{Message: err.Error()}
			err = f
		case !errors.As(err, &f):
			return res, fail(err)
		}
		e := fail(err)
		e.inDoubt = strings.HasPrefix(f.Message, ErrInDoubt.Error()+":")
		return res, e
	}
	return res, nil
}

// leaseOverTTL reports idem.claim's refusal of a lease longer than the
// retention (22023, "lease ... is longer than ttl ...").
func leaseOverTTL(err error) bool {
	return errors.Is(err, ErrInvalidInput) && sqlstate.Of(err) == sqlstate.InvalidParameterValue &&
		strings.Contains(err.Error(), " is longer than ttl ")
}

// EffectKey returns the key of the effect name of the event (source, key):
// source+EffectsSuffix, and name+"/"+key, except that a key which would
// make that longer than idem's 512 bytes, or which has the hashed form's
// own shape ("sha256:" and 64 lowercase hex digits), is replaced by
// "sha256:" and the hex SHA-256 of the key. So a hashed effect key can
// never equal a plain one: the plain form of a key shaped like a digest is
// itself hashed. Names are 1 to 64 bytes of ASCII letters, digits and
// "_.:-" (no "/", which ends the name). It is exported for queries and
// tooling; Effect derives it by itself.
func EffectKey(source, key, name string) (effectSource, effectKey string, err error) {
	if err := checkEffectName(name); err != nil {
		return "", "", err
	}
	if err := checkText("effect", source, key); err != nil {
		return "", "", err
	}
	effectSource = source + EffectsSuffix
	if len(effectSource) > 64 {
		return "", "", &Error{Op: "effect", Source: source, Key: key, Kind: ErrInvalidInput,
			Err: fmt.Errorf("source is %d bytes; an event with effects needs a source of at most %d, to name its effects' source %q",
				len(source), 64-len(EffectsSuffix), effectSource)}
	}
	effectKey = name + "/" + key
	if len(effectKey) > 512 || digestShaped(key) {
		sum := sha256.Sum256([]byte(key))
		effectKey = name + "/" + digestPrefix + hex.EncodeToString(sum[:])
	}
	return effectSource, effectKey, nil
}

// digestPrefix starts a hashed effect key's part after the name.
const digestPrefix = "sha256:"

// digestShaped: s has the shape of a hashed key part (digestPrefix and 64
// lowercase hex digits).
func digestShaped(s string) bool {
	if len(s) != len(digestPrefix)+64 || s[:len(digestPrefix)] != digestPrefix {
		return false
	}
	for i := len(digestPrefix); i < len(s); i++ {
		if c := s[i]; !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

func checkEffectName(name string) error {
	bad := len(name) == 0 || len(name) > 64
	for i := 0; i < len(name) && !bad; i++ {
		ch := name[i]
		bad = !(ch >= 'a' && ch <= 'z' || ch >= 'A' && ch <= 'Z' || ch >= '0' && ch <= '9' ||
			ch == '_' || ch == '.' || ch == ':' || ch == '-')
	}
	if bad {
		return &Error{Op: "effect", Kind: ErrInvalidInput,
			Err: fmt.Errorf("effect name %q must be 1 to 64 ASCII letters, digits or _.:- (e.g. send_receipt)", name)}
	}
	return nil
}
