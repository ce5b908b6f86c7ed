// Package idemotel reports what idem, idemhttp and the inbox do as
// OpenTelemetry spans and metrics, on the application's own
// TracerProvider and MeterProvider, so that idem's spans sit in the traces
// otelhttp, otelpgx and otelriver already make:
//
//	tel, err := idemotel.New(&idemotel.Config{TracerProvider: tp, MeterProvider: mp})
//	client, err := idem.New(pool, &idem.Config{Tracer: tel})
//
// It implements idem.Tracer, the core's seam; idemhttp and the inbox report
// through the client's tracer, so one Tracer on the client covers them.
// docs/observability.md shows the span trees and lists every attribute
// and instrument.
//
// Keys can be personal data (an email address, an order number): spans
// carry a key's hash (idem.key.hash) unless Config.Keys says otherwise,
// and metrics never carry a key.
package idemotel

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
)

// ScopeName is the instrumentation scope of idem's spans and metrics: this
// package's import path.
const ScopeName = "github.com/idemkit/idem/idemotel"

// KeyMode says what spans record of a key.
type KeyMode int

const (
	// KeyHash records idem.key.hash: the first 16 bytes of the SHA-256 of
	// the source and the key, in hex, to find a key's spans again (it is
	// not anonymous for a key that can be guessed: use KeyOmit). Default.
	KeyHash KeyMode = iota
	// KeyOmit records nothing of the key.
	KeyOmit
	// KeyPlain records the key itself (idem.key), and errors' messages
	// (which may quote it) as the spans' status: opt in only where keys
	// are not personal data.
	KeyPlain
)

// Config configures a Tracer. The zero value (or nil) is valid.
type Config struct {
	// TracerProvider makes the spans. Default: otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
	// MeterProvider makes the instruments. Default: otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
	// Keys says what spans record of a key. Default: KeyHash.
	Keys KeyMode
	// Propagator writes the trace context of an accepted inbox delivery
	// into its job's metadata and reads it back in the worker. Default:
	// W3C trace context (propagation.TraceContext) alone, whatever the
	// global propagator is: baggage, which may hold anything, is not
	// stored with jobs unless given here.
	Propagator propagation.TextMapPropagator
}

// Tracer implements idem.Tracer with OpenTelemetry. Set it as
// idem.Config.Tracer.
type Tracer struct {
	tracer trace.Tracer
	keys   KeyMode
	prop   propagation.TextMapPropagator
	m      instruments
}

var _ idem.Tracer = (*Tracer)(nil)

// ErrInvalidConfig: New was given a Config field out of range.
var ErrInvalidConfig = errors.New("idemotel: invalid config")

// New returns a Tracer on cfg's providers. It fails only when an
// instrument cannot be created, or for a KeyMode it does not know.
func New(cfg *Config) (*Tracer, error) {
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if c.Keys < KeyHash || c.Keys > KeyPlain {
		return nil, fmt.Errorf("%w: Keys %d is not a KeyMode (KeyHash, KeyOmit or KeyPlain)", ErrInvalidConfig, c.Keys)
	}
	if c.TracerProvider == nil {
		c.TracerProvider = otel.GetTracerProvider()
	}
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	if c.Propagator == nil {
		c.Propagator = propagation.TraceContext{}
	}
	m, err := newInstruments(c.MeterProvider.Meter(ScopeName))
	if err != nil {
		return nil, err
	}
	return &Tracer{tracer: c.TracerProvider.Tracer(ScopeName), keys: c.Keys, prop: c.Propagator, m: m}, nil
}

// outerKey holds, in the context of idem's outermost operation, the span
// it started under (the request's server span): decisions found deeper
// (a wait) are told there too.
type outerKey struct{}

// TraceStart implements idem.Tracer.
func (t *Tracer) TraceStart(ctx context.Context, d idem.TraceStartData) context.Context {
	switch d.Op {
	case idem.OpDecision, idem.OpCache:
		return ctx // an event on the span ctx carries, at TraceEnd
	case idem.OpEnqueue:
		ctx, _ = t.tracer.Start(ctx, "send "+d.Queue, trace.WithSpanKind(trace.SpanKindProducer),
			trace.WithAttributes(t.messaging("send", d)...))
		if d.Carrier != nil {
			t.prop.Inject(ctx, propagation.MapCarrier(d.Carrier))
		}
		return ctx
	case idem.OpProcess:
		return t.startProcess(ctx, d)
	}
	parent := trace.SpanFromContext(ctx)
	ctx, span := t.tracer.Start(ctx, spanNames[d.Op])
	if !span.IsRecording() {
		return ctx // not sampled, or a no-op provider: nothing to compute
	}
	if ctx.Value(outerKey{}) == nil {
		// The span the application started this under (the request's).
		ctx = context.WithValue(ctx, outerKey{}, parent)
	}
	attrs := make([]attribute.KeyValue, 0, 3)
	attrs = append(attrs, attrSource.String(clean(d.Source)))
	attrs = t.key(attrs, d.Source, d.Key)
	if d.Op == idem.OpEffect {
		attrs = append(attrs, attrEffect.String(clean(d.Name)))
	}
	span.SetAttributes(attrs...)
	return ctx
}

// TraceEnd implements idem.Tracer.
func (t *Tracer) TraceEnd(ctx context.Context, d idem.TraceEndData) {
	span := trace.SpanFromContext(ctx)
	switch d.Op {
	case idem.OpDecision:
		t.decision(ctx, span, d)
		return
	case idem.OpCache:
		span.AddEvent("idem.cache.hit")
		span.SetAttributes(attrCached.Bool(true))
		return
	case idem.OpClaim:
		t.m.claim(ctx, d)
	case idem.OpClaimBatch:
		// Each item counts as a claim, with the batch's duration.
		for i := range d.Batch {
			item := idem.TraceEndData{Op: idem.OpClaim, Source: d.Source, Err: d.Err, Duration: d.Duration}
			if i < len(d.Claims) {
				item.Claim = d.Claims[i]
			}
			t.m.claim(ctx, item)
		}
		span.SetAttributes(attrBatch.Int(d.Batch))
	case idem.OpWait:
		if outer, ok := ctx.Value(outerKey{}).(trace.Span); ok {
			attrs := []attribute.KeyValue{attrWaitMS.Int64(d.Duration.Milliseconds())}
			if d.Claim != nil {
				attrs = append(attrs, attrOutcome.String(string(d.Claim.Outcome)))
			}
			outer.AddEvent("idem.waited", trace.WithAttributes(attrs...))
		}
	case idem.OpEnqueue:
		if d.Err == nil {
			t.m.accepted.Add(ctx, 1, metric.WithAttributeSet(t.m.sets.get(d.Source, "", "")))
			span.SetAttributes(semMessageID.String(fmt.Sprint(d.JobID)))
		}
	case idem.OpProcess:
		t.m.process(ctx, d)
		span.SetAttributes(attrInboxOutcome.String(clean(d.Detail)))
	}
	if d.Claim != nil {
		span.SetAttributes(attrOutcome.String(string(d.Claim.Outcome)))
		if d.Claim.Attempt > 0 {
			span.SetAttributes(attrAttempt.Int(d.Claim.Attempt))
		}
	}
	if d.Op == idem.OpDo || d.Op == idem.OpEffect {
		span.SetAttributes(attrReplayed.Bool(d.Replayed))
	}
	t.status(span, d.Err)
	span.End()
}

// startProcess starts an inbox worker's span: a consumer span, a child of
// the worker's own context (River's span, when otelriver runs), linked to
// the span that accepted the delivery (whose trace context came with the
// job), in whichever process and however long after that ran.
func (t *Tracer) startProcess(ctx context.Context, d idem.TraceStartData) context.Context {
	opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(t.messaging("process", d)...)}
	if d.Carrier != nil {
		if sc := trace.SpanContextFromContext(t.prop.Extract(context.Background(), propagation.MapCarrier(d.Carrier))); sc.IsValid() {
			opts = append(opts, trace.WithLinks(trace.Link{SpanContext: sc}))
		}
	}
	if d.Attempt == 1 && !d.AcceptedAt.IsZero() {
		t.m.lag.Record(ctx, max(0, time.Since(d.AcceptedAt).Seconds()),
			metric.WithAttributeSet(t.m.sets.get(d.Source, "", "")))
	}
	ctx = context.WithValue(ctx, outerKey{}, trace.SpanFromContext(ctx))
	ctx, _ = t.tracer.Start(ctx, "process "+d.Queue, opts...)
	return ctx
}

// messaging are an inbox span's attributes (semantic conventions for
// messaging, and idem's own).
func (t *Tracer) messaging(op string, d idem.TraceStartData) []attribute.KeyValue {
	attrs := []attribute.KeyValue{semMessagingSystem.String("river"), semOperationType.String(op),
		semOperationName.String(op), semDestination.String(d.Queue), attrSource.String(clean(d.Source))}
	if d.JobID != 0 {
		attrs = append(attrs, semMessageID.String(fmt.Sprint(d.JobID)))
	}
	if d.Attempt > 0 {
		attrs = append(attrs, attrAttempt.Int(d.Attempt))
	}
	return t.key(attrs, d.Source, d.Key)
}

// decision puts one of idemhttp's decisions on the request's span.
func (t *Tracer) decision(ctx context.Context, span trace.Span, d idem.TraceEndData) {
	attrs := []attribute.KeyValue{attrSource.String(clean(d.Source))}
	switch d.Name {
	case "answered":
		attrs = append(attrs, attrAnswer.String(clean(d.Detail)))
		span.SetAttributes(attrSource.String(clean(d.Source)), attrAnswer.String(clean(d.Detail)))
		t.m.answers.Add(ctx, 1, metric.WithAttributeSet(t.m.sets.get(d.Source, attrAnswer, d.Detail)))
	case "refused":
		attrs = append(attrs, attrReason.String(clean(d.Detail)))
	case "replayed":
		attrs = append(attrs, attrReason.String(clean(d.Detail)))
		span.SetAttributes(attrReplayed.Bool(true))
	}
	span.AddEvent("idem.http."+d.Name, trace.WithAttributes(attrs...))
}

// key appends what spans record of a key.
func (t *Tracer) key(attrs []attribute.KeyValue, source, key string) []attribute.KeyValue {
	if key == "" {
		return attrs
	}
	switch t.keys {
	case KeyPlain:
		return append(attrs, attrKey.String(clean(key)))
	case KeyHash:
		return append(attrs, attrKeyHash.String(KeyHashOf(source, key)))
	}
	return attrs
}

// KeyHashOf is the idem.key.hash of a key: the first 16 bytes of the
// SHA-256 of its source, a 0x1F and the key, in hex (a source holds no
// control character, so the pair is unambiguous). Use it to find a key's
// spans.
func KeyHashOf(source, key string) string {
	h := sha256.New()
	h.Write([]byte(source))
	h.Write([]byte{0x1f})
	h.Write([]byte(key))
	return hex.EncodeToString(h.Sum(nil)[:16])
}

// status sets a span's status from an operation's error: error.type is
// the idem sentinel it matches (or the Go type), and the description is
// the sentinel's own text, which quotes no key, unless Config.Keys is
// KeyPlain (then the error's message).
func (t *Tracer) status(span trace.Span, err error) {
	if err == nil {
		return
	}
	kind, msg := errorKind(err)
	span.SetAttributes(semErrorType.String(kind))
	if t.keys == KeyPlain {
		msg = err.Error()
	}
	span.SetStatus(codes.Error, msg)
}

// sentinels are the errors a span's error.type names.
var sentinels = []struct {
	err  error
	kind string
}{
	{idem.ErrInProgress, "in_progress"}, {idem.ErrMismatch, "mismatch"}, {idem.ErrFailed, "failed"},
	{idem.ErrLeaseLost, "lease_lost"}, {idem.ErrResultNotStored, "result_not_stored"},
	{idem.ErrStaleToken, "stale_token"}, {idem.ErrInvalidInput, "invalid_input"},
	{idem.ErrResultTooLarge, "result_too_large"}, {idem.ErrNotMigrated, "not_migrated"},
	{idem.ErrSerialization, "serialization"}, {idem.ErrNotFound, "not_found"},
	{idem.ErrNoEvent, "no_event"}, {idem.ErrInDoubt, "in_doubt"},
	{context.Canceled, "canceled"}, {context.DeadlineExceeded, "deadline_exceeded"},
}

func errorKind(err error) (kind, msg string) {
	for _, s := range sentinels {
		if errors.Is(err, s.err) {
			return s.kind, s.err.Error()
		}
	}
	var p *idem.PanicError
	if errors.As(err, &p) {
		return "panic", "the work panicked"
	}
	return fmt.Sprintf("%T", err), "the operation failed (its message may quote the key: Config.Keys KeyPlain records it)"
}

// spanNames are the names of idem's own spans.
var spanNames = map[idem.Op]string{idem.OpDo: "idem.do", idem.OpClaim: "idem.claim", idem.OpClaimBatch: "idem.claim_batch", idem.OpWait: "idem.wait",
	idem.OpWork: "idem.work", idem.OpEffect: "idem.effect", idem.OpComplete: "idem.complete", idem.OpFail: "idem.fail"}

// maxText caps a text attribute: idem's own limit on a key.
const maxText = 512

// clean makes a text an attribute can carry: valid UTF-8 (an exporter
// that encodes protobuf strings refuses anything else, and would drop the
// whole batch with it) of at most maxText bytes. A source, key or name
// idem refuses is still reported, as the claim that refused it starts its
// span before it checks its arguments.
func clean(s string) string {
	if len(s) <= maxText && utf8.ValidString(s) {
		return s
	}
	s = strings.ToValidUTF8(s, "\uFFFD")
	if len(s) > maxText {
		s = strings.ToValidUTF8(s[:maxText], "")
	}
	return s
}
