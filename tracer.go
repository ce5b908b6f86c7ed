package idem

import (
	"context"
	"time"
)

// Tracer is told when each of idem's operations starts and ends, in the
// shape of pgx's QueryTracer: TraceStart returns the context the
// operation runs under (and TraceEnd receives), so an implementation can
// open a span there and close it at the end; operations started under
// that context (a claim inside Do, the work, an effect inside the work)
// are its children. Package idemotel implements it with OpenTelemetry;
// Config.Observer is reported through it too (one mechanism: the claims
// an Observer counts are the OpClaim operations a Tracer sees).
//
// Both methods are called synchronously on the operation's path, from
// many goroutines: they must be cheap, safe for concurrent use, and must
// not block. Keys are personal data in many applications: an
// implementation decides what of TraceStartData.Key it records.
//
// A batch operation is reported as one operation of its own whose
// per-item operations (an OpClaim per key) run under the context it
// returned, so a Tracer sees the batch and each item.
type Tracer interface {
	TraceStart(ctx context.Context, data TraceStartData) context.Context
	TraceEnd(ctx context.Context, data TraceEndData)
}

// Op names an operation a Tracer is told of.
type Op string

// The operations. Packages built on idem (idemhttp, inbox) report theirs
// through the same Tracer (Client.Tracer).
const (
	// OpDo: Client.Do, around its claim, work and recording.
	OpDo Op = "do"
	// OpClaim: one claim (Client.Claim, and the claims of Do, Effect,
	// idemhttp and the inbox), including its wait (OpWait) and a cache
	// answer (OpCache).
	OpClaim Op = "claim"
	// OpClaimBatch: one batch claim (Client.ClaimBatch, and DoBatch's):
	// TraceStartData.Batch is its size, TraceEndData.Claims its answers,
	// item by item (nil when the batch failed). Items answered by the
	// cache are also reported as OpCache, under its context.
	OpClaimBatch Op = "claim_batch"
	// OpWait: a claim that found its key in progress waits for the
	// original (WithWait); TraceEndData.Claim is the answer after the wait.
	OpWait Op = "wait"
	// OpCache: a claim answered from Config.Cache, without a round trip
	// (reported only when the cache answers).
	OpCache Op = "cache"
	// OpWork: the work Do runs for an acquired key (TraceStartData.Name:
	// "work"), or an effect's function.
	OpWork Op = "work"
	// OpEffect: Client.Effect (TraceStartData.Name: the effect's name;
	// Source and Key: the event's).
	OpEffect Op = "effect"
	// OpComplete and OpFail: the recording of the work's outcome
	// (Complete, CompleteUnstored, Fail, and Do's own recording, one per
	// attempt).
	OpComplete Op = "complete"
	OpFail     Op = "fail"
	// OpDecision: a decision of a package built on idem, with nothing
	// run between start and end (idemhttp: "verified", "refused",
	// "answered"; TraceEndData.Detail says which answer or why).
	OpDecision Op = "decision"
	// OpEnqueue: the inbox inserts the job of an accepted delivery. A
	// Tracer may write TraceStartData.Carrier: the inbox stores it with
	// the job (its River metadata) and hands it back to OpProcess.
	OpEnqueue Op = "enqueue"
	// OpProcess: an inbox worker's attempt at a job; TraceStartData.Carrier
	// is what OpEnqueue's Tracer wrote, TraceEndData.Detail the attempt's
	// outcome (processed, skipped, retried, dead_lettered).
	OpProcess Op = "process"
)

// TraceStartData describes an operation that starts.
type TraceStartData struct {
	Op          Op
	Source, Key string
	// Name: the effect's name (OpEffect), the decision (OpDecision).
	Name string
	// Carrier is a text map the trace context travels in between
	// processes (OpEnqueue writes it, OpProcess reads it); nil otherwise.
	Carrier map[string]string
	// Queue, JobID and Attempt describe an inbox job (OpEnqueue, OpProcess).
	Queue   string
	JobID   int64
	Attempt int
	// AcceptedAt: when the job's delivery was accepted (OpProcess).
	AcceptedAt time.Time
	// Batch: the number of items of an OpClaimBatch.
	Batch int
}

// TraceEndData describes how an operation ended.
type TraceEndData struct {
	Op          Op
	Source, Key string
	// Name is TraceStartData's Name, repeated (OpEffect, OpDecision).
	Name string
	// Claim is the claim's answer (OpClaim, OpWait, OpCache, OpDo), nil
	// when it failed.
	Claim *Claim
	// Claims are an OpClaimBatch's answers, in the items' order (nil when
	// it failed); Batch is its size.
	Claims []*Claim
	Batch  int
	// Replayed: OpDo and OpEffect answered from a stored result.
	Replayed bool
	// Detail: OpDecision's answer or reason, OpProcess's outcome.
	Detail string
	// JobID: the job OpEnqueue inserted.
	JobID int64
	// Err is the operation's error, nil when it succeeded.
	Err error
	// Duration is the operation's wall time in this process.
	Duration time.Duration
}

// Tracer returns the client's tracer (Config.Tracer and Config.Observer
// together), nil when it has none: packages built on idem (idemhttp, the
// inbox) report their operations through it.
func (c *Client) Tracer() Tracer { return c.tr }

// newTracer is the client's one tracer: Config.Tracer and the Observer
// reported through it.
func newTracer(cfg Config) Tracer {
	switch {
	case cfg.Observer == nil:
		return cfg.Tracer
	case cfg.Tracer == nil:
		return observerTracer{cfg.Observer}
	}
	return tracers{cfg.Tracer, observerTracer{cfg.Observer}}
}

// traceStart starts op under c's tracer; the time is zero when c has none.
func (c *Client) traceStart(ctx context.Context, d TraceStartData) (context.Context, time.Time) {
	if c.tr == nil {
		return ctx, time.Time{}
	}
	return c.tr.TraceStart(ctx, d), time.Now()
}

// traceEnd ends what traceStart started at start.
func (c *Client) traceEnd(ctx context.Context, start time.Time, d TraceEndData) {
	if c.tr == nil {
		return
	}
	d.Duration = time.Since(start)
	c.tr.TraceEnd(ctx, d)
}

// observerTracer reports the claims a Tracer sees to an Observer.
type observerTracer struct{ o Observer }

func (t observerTracer) TraceStart(ctx context.Context, _ TraceStartData) context.Context { return ctx }

func (t observerTracer) TraceEnd(_ context.Context, d TraceEndData) {
	if d.Op == OpClaimBatch {
		// Each item is one claim, with its batch's size.
		for i := range d.Batch {
			o := ClaimObservation{Source: d.Source, Err: d.Err, Duration: d.Duration, Batch: d.Batch}
			if d.Err == nil && i < len(d.Claims) && d.Claims[i] != nil {
				o.Outcome = d.Claims[i].Outcome
			}
			t.o.ObserveClaim(o)
		}
		return
	}
	if d.Op != OpClaim {
		return
	}
	o := ClaimObservation{Source: d.Source, Err: d.Err, Duration: d.Duration}
	if d.Claim != nil {
		o.Outcome = d.Claim.Outcome
	}
	t.o.ObserveClaim(o)
}

// tracers calls two tracers in turn; both end under the context their
// starts returned, in the reverse order.
type tracers [2]Tracer

func (t tracers) TraceStart(ctx context.Context, d TraceStartData) context.Context {
	return t[1].TraceStart(t[0].TraceStart(ctx, d), d)
}

func (t tracers) TraceEnd(ctx context.Context, d TraceEndData) {
	t[1].TraceEnd(ctx, d)
	t[0].TraceEnd(ctx, d)
}
