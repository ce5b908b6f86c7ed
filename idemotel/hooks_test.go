package idemotel_test

import (
	"context"
	"testing"

	metricnoop "go.opentelemetry.io/otel/metric/noop"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemotel"
)

// BenchmarkHooksNoop: the operations one Do of a new key reports, on
// no-op providers (make bench measures the same through the database).
func BenchmarkHooksNoop(b *testing.B) {
	tel, err := idemotel.New(&idemotel.Config{TracerProvider: tracenoop.NewTracerProvider(), MeterProvider: metricnoop.NewMeterProvider()})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	cl := &idem.Claim{Outcome: idem.Acquired, Attempt: 1}
	b.ReportAllocs()
	for b.Loop() {
		dctx := tel.TraceStart(ctx, idem.TraceStartData{Op: idem.OpDo, Source: "stripe", Key: "evt_1"})
		for _, op := range [...]idem.Op{idem.OpClaim, idem.OpWork, idem.OpComplete} {
			c := tel.TraceStart(dctx, idem.TraceStartData{Op: op, Source: "stripe", Key: "evt_1"})
			tel.TraceEnd(c, idem.TraceEndData{Op: op, Source: "stripe", Key: "evt_1", Claim: cl})
		}
		tel.TraceEnd(dctx, idem.TraceEndData{Op: idem.OpDo, Source: "stripe", Key: "evt_1", Claim: cl})
	}
}
