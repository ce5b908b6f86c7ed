package main

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	metricnoop "go.opentelemetry.io/otel/metric/noop"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemotel"
)

// benchOTel: the cost of idem.Config.Tracer with idemotel on no-op
// providers (an application that links OpenTelemetry but samples nothing
// and exports no metrics) against no tracer at all, for Claim and Do of
// new keys through the Go API, interleaved; and the hooks' own time per
// Do without a database.
func benchOTel(ctx context.Context, e *env, o options, t *table) error {
	tel, err := idemotel.New(&idemotel.Config{TracerProvider: tracenoop.NewTracerProvider(), MeterProvider: metricnoop.NewMeterProvider()})
	if err != nil {
		return err
	}
	plain, err := idem.New(e.pool, nil)
	if err != nil {
		return err
	}
	traced, err := idem.New(e.pool, &idem.Config{Tracer: tel})
	if err != nil {
		return err
	}
	run := time.Now().UnixNano()
	var n atomic.Int64 // a new key per call, across rounds
	claim := func(c *idem.Client, side string) op {
		return func(ctx context.Context, _ int, _ int64) error {
			_, err := c.Claim(ctx, "bench-otel", fmt.Sprintf("claim-%s-%d-%d", side, run, n.Add(1)))
			return err
		}
	}
	work := func(context.Context) (any, error) { return "ok", nil }
	do := func(c *idem.Client, side string) op {
		return func(ctx context.Context, _ int, _ int64) error {
			_, err := c.Do(ctx, "bench-otel", fmt.Sprintf("do-%s-%d-%d", side, run, n.Add(1)), work)
			return err
		}
	}
	for _, clients := range o.clients {
		cmp, err := interleave(ctx, o.rounds, clients, o.duration, claim(traced, "t"), claim(plain, "p"))
		if err != nil {
			return err
		}
		t.throughputRow("otel", fmt.Sprintf("Claim of a new key with idemotel on no-op providers vs no tracer, %d clients", clients), cmp, "within noise (~1.0x)")
		cmp, err = interleave(ctx, o.rounds, clients, o.duration, do(traced, "t"), do(plain, "p"))
		if err != nil {
			return err
		}
		t.throughputRow("otel", fmt.Sprintf("Do of a new key with idemotel on no-op providers vs no tracer, %d clients", clients), cmp, "within noise (~1.0x)")
	}
	// The hooks alone: the operations one Do of a new key reports (Do,
	// its claim, work and completion), called as the client calls them.
	const calls = 200000
	start := cpuTime()
	for i := range calls {
		key := "k" + strconv.Itoa(i)
		dctx := tel.TraceStart(ctx, idem.TraceStartData{Op: idem.OpDo, Source: "s", Key: key})
		for _, op := range []idem.Op{idem.OpClaim, idem.OpWork, idem.OpComplete} {
			c := tel.TraceStart(dctx, idem.TraceStartData{Op: op, Source: "s", Key: key})
			tel.TraceEnd(c, idem.TraceEndData{Op: op, Source: "s", Key: key, Claim: &idem.Claim{Outcome: idem.Acquired}})
		}
		tel.TraceEnd(dctx, idem.TraceEndData{Op: idem.OpDo, Source: "s", Key: key})
	}
	per := (cpuTime() - start) / calls
	t.add(row{section: "otel", metric: "idemotel's hooks on no-op providers, CPU time per Do of a new key (4 operations, no database)",
		idem: per.String(), baseline: "0", ratio: 1, note: "no ratio: the time itself", target: "information"})
	return nil
}

// cpuTime is the CPU time this process has used (user and system): on a
// shared machine the wall time of a tight loop is mostly waiting for a
// core.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
