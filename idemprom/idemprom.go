// Package idemprom exports what idem's Go client and idemhttp see as
// Prometheus metrics, on a registry the application owns (no global
// state):
//
//	m, err := idemprom.New(prometheus.DefaultRegisterer) // or your registry
//	client, err := idem.New(pool, &idem.Config{Observer: m})
//	mw, err := idemhttp.New(idemhttp.Config{Client: client, Observer: m, ...})
//
// Metrics (docs/operations.md has alerting rules built on them):
//
//	idem_claims_total{source, outcome}      claims by what they decided:
//	                                        acquired, completed, in_progress,
//	                                        mismatch, failed, or error
//	idem_claim_duration_seconds{source}     claim latency in this process
//	idem_http_answers_total{source, answer} how idemhttp answered requests
//
// A duplicate is a claim with any outcome but acquired or error, so the
// duplicate rate of a source is
//
//	sum by (source) (rate(idem_claims_total{outcome!~"acquired|error"}[5m]))
//
// The database keeps its own per-source duplicate counts (idemctl stats);
// these metrics add the per-process view, every claim counted.
package idemprom

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
)

// Metrics implements idem.Observer and idemhttp.Observer.
type Metrics struct {
	claims   *prometheus.CounterVec
	duration *prometheus.HistogramVec
	answers  *prometheus.CounterVec
}

var (
	_ idem.Observer     = (*Metrics)(nil)
	_ idemhttp.Observer = (*Metrics)(nil)
)

// OutcomeError is the outcome label of a claim that returned an error.
const OutcomeError = "error"

// New creates the metrics and registers them on reg. It fails when reg
// already holds metrics of these names (one Metrics per registry; share
// it between clients and middlewares).
func New(reg prometheus.Registerer) (*Metrics, error) {
	if reg == nil {
		return nil, errors.New("idemprom: New needs a prometheus.Registerer (prometheus.NewRegistry() or prometheus.DefaultRegisterer)")
	}
	m := &Metrics{
		claims: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_claims_total",
			Help: "Claims by source and outcome (acquired, completed, in_progress, mismatch, failed, error). Every outcome but acquired and error is a duplicate delivery.",
		}, []string{"source", "outcome"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idem_claim_duration_seconds",
			Help:    "Claim latency by source, measured in this process.",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 5},
		}, []string{"source"}),
		answers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_http_answers_total",
			Help: "Requests idemhttp answered, by source and answer (ran, replayed, in_progress, mismatch, failed, refused, bad_request, passed_through, panicked, lease_lost, unavailable).",
		}, []string{"source", "answer"}),
	}
	for _, c := range []prometheus.Collector{m.claims, m.duration, m.answers} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// ObserveClaim counts one claim.
func (m *Metrics) ObserveClaim(o idem.ClaimObservation) {
	outcome := string(o.Outcome)
	if o.Err != nil || outcome == "" {
		outcome = OutcomeError
	}
	m.claims.WithLabelValues(o.Source, outcome).Inc()
	m.duration.WithLabelValues(o.Source).Observe(o.Duration.Seconds())
}

// ObserveAnswer counts one request idemhttp answered.
func (m *Metrics) ObserveAnswer(source string, a idemhttp.Answer) {
	m.answers.WithLabelValues(source, string(a)).Inc()
}
