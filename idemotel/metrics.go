package idemotel

import (
	"context"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/idemkit/idem"
)

// outcomeError is the idem.outcome of a claim that returned an error.
const outcomeError = "error"

// instruments are idemprom's metrics as OpenTelemetry instruments. Their
// attributes are low-cardinality: a source, an outcome, an answer; never
// a key.
type instruments struct {
	claims        metric.Int64Counter
	claimDuration metric.Float64Histogram
	answers       metric.Int64Counter
	accepted      metric.Int64Counter
	processed     metric.Int64Counter
	retried       metric.Int64Counter
	deadLettered  metric.Int64Counter
	lag           metric.Float64Histogram
	sets          *attrSets
}

// attrSets keeps the attribute sets of the data points, made once per
// source and value: a data point's attributes are a handful of sources
// and outcomes, and building a set sorts and allocates.
type attrSets struct{ m sync.Map }

type setKey struct {
	source string
	key    attribute.Key
	value  string
}

// get returns the set {idem.source: source} (and {key: value} when key is
// not empty).
func (a *attrSets) get(source string, key attribute.Key, value string) attribute.Set {
	k := setKey{source, key, value}
	if s, ok := a.m.Load(k); ok {
		return s.(attribute.Set)
	}
	kvs := []attribute.KeyValue{attrSource.String(clean(source))}
	if key != "" {
		kvs = append(kvs, key.String(clean(value)))
	}
	s, _ := a.m.LoadOrStore(k, attribute.NewSet(kvs...))
	return s.(attribute.Set)
}

func newInstruments(m metric.Meter) (instruments, error) {
	in := instruments{sets: &attrSets{}}
	var err error
	counter := func(name, unit, desc string) metric.Int64Counter {
		var c metric.Int64Counter
		if err == nil {
			c, err = m.Int64Counter(name, metric.WithUnit(unit), metric.WithDescription(desc))
		}
		return c
	}
	histogram := func(name, desc string, buckets ...float64) metric.Float64Histogram {
		var h metric.Float64Histogram
		if err == nil {
			h, err = m.Float64Histogram(name, metric.WithUnit("s"), metric.WithDescription(desc),
				metric.WithExplicitBucketBoundaries(buckets...))
		}
		return h
	}
	in.claims = counter("idem.claims", "{claim}", "Claims by source and outcome (acquired, completed, in_progress, mismatch, failed, error). Every outcome but acquired and error is a duplicate delivery.")
	in.claimDuration = histogram("idem.claim.duration", "Claim latency by source and outcome, measured in this process.",
		.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 5)
	in.answers = counter("idem.http.answers", "{request}", "Requests idemhttp answered, by source and answer.")
	in.accepted = counter("idem.inbox.accepted", "{event}", "Deliveries the inbox accepted (a job inserted), by source.")
	in.processed = counter("idem.inbox.processed", "{event}", "Inbox events whose handler ran and completed, by source.")
	in.retried = counter("idem.inbox.retried", "{attempt}", "Inbox attempts that failed and will be retried, by source.")
	in.deadLettered = counter("idem.inbox.dead_lettered", "{event}", "Inbox events dead-lettered (failed for good, or out of attempts), by source.")
	in.lag = histogram("idem.inbox.lag", "Time from a delivery's acceptance to its first attempt, by source.",
		.01, .05, .1, .5, 1, 5, 10, 30, 60, 300, 900, 3600)
	return in, err
}

// claim counts one claim and its duration.
func (in instruments) claim(ctx context.Context, d idem.TraceEndData) {
	outcome := outcomeError
	if d.Err == nil && d.Claim != nil {
		outcome = string(d.Claim.Outcome)
	}
	set := metric.WithAttributeSet(in.sets.get(d.Source, attrOutcome, outcome))
	in.claims.Add(ctx, 1, set)
	in.claimDuration.Record(ctx, d.Duration.Seconds(), set)
}

// process counts one inbox attempt by its outcome.
func (in instruments) process(ctx context.Context, d idem.TraceEndData) {
	set := metric.WithAttributeSet(in.sets.get(d.Source, "", ""))
	switch d.Detail {
	case "processed":
		in.processed.Add(ctx, 1, set)
	case "retried":
		in.retried.Add(ctx, 1, set)
	case "dead_lettered":
		in.deadLettered.Add(ctx, 1, set)
	}
}
