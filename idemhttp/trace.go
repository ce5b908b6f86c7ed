package idemhttp

import (
	"net/http"

	"github.com/idemkit/idem"
)

// The middleware's decisions, as reported to the Client's tracer
// (idem.OpDecision, TraceStartData.Name). Package idemotel turns each
// into an event and attributes on the request's own server span.
const (
	DecisionVerified = "verified" // the signature checked out
	DecisionRefused  = "refused"  // the signature did not; Detail says why
	DecisionReplayed = "replayed" // a replayed answer; Detail: Replay.Why
	DecisionAnswered = "answered" // the final answer; Detail: the Answer
)

// Why a delivery was refused (the Detail of DecisionRefused): fixed
// words, never the verifier's message, which may quote what was sent.
const (
	RefusedSignatureMissing = "signature_missing"
	RefusedSignatureInvalid = "signature_invalid"
)

// decided reports one decision through the Client's tracer, under the
// request's context, so that it lands on the request's span: the one hook
// of every decision point. Nothing when the Client has no tracer.
func (m *middleware) decided(r *http.Request, key, decision, detail string) {
	tr := m.cfg.Client.Tracer()
	if tr == nil {
		return
	}
	ctx := tr.TraceStart(r.Context(), idem.TraceStartData{Op: idem.OpDecision, Source: m.cfg.Source, Key: key, Name: decision})
	tr.TraceEnd(ctx, idem.TraceEndData{Op: idem.OpDecision, Source: m.cfg.Source, Key: key, Name: decision, Detail: detail})
}
