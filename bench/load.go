package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// op is one operation of a workload; client and seq make keys unique.
type op func(ctx context.Context, client int, seq int64) error

// sample is one timed run of a workload.
type sample struct {
	ops       int64
	elapsed   time.Duration
	latencies []time.Duration // sorted
	pairs     []timed         // each operation's start and latency, for within
}

type timed struct {
	start time.Time
	d     time.Duration
}

func (s sample) throughput() float64 { return float64(s.ops) / s.elapsed.Seconds() }

func (s sample) pct(p float64) time.Duration {
	if len(s.latencies) == 0 {
		return 0
	}
	i := int(p * float64(len(s.latencies)-1))
	return s.latencies[i]
}

// within returns the latencies of operations that overlapped [from, to].
func (s sample) within(from, to time.Time) sample {
	var out sample
	for _, t := range s.pairs {
		if t.start.Before(to) && t.start.Add(t.d).After(from) {
			out.latencies = append(out.latencies, t.d)
		}
	}
	slices.Sort(out.latencies)
	out.ops = int64(len(out.latencies))
	return out
}

// measure runs fn from clients goroutines for d and records every latency.
func measure(ctx context.Context, clients int, d time.Duration, fn op) (sample, error) {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		pairs []timed
		ops   atomic.Int64
		first error
		once  sync.Once
	)
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	start := time.Now()
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			local := make([]timed, 0, 4096)
			for seq := int64(0); ctx.Err() == nil; seq++ {
				t0 := time.Now()
				err := fn(ctx, c, seq)
				if err != nil {
					if ctx.Err() != nil {
						break // cut off by the deadline: not a failure
					}
					once.Do(func() { first = fmt.Errorf("client %d: %w", c, err) })
					cancel()
					break
				}
				local = append(local, timed{t0, time.Since(t0)})
				ops.Add(1)
			}
			mu.Lock()
			pairs = append(pairs, local...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	s := sample{ops: ops.Load(), elapsed: time.Since(start), pairs: pairs}
	s.latencies = make([]time.Duration, len(pairs))
	for i, p := range pairs {
		s.latencies[i] = p.d
	}
	slices.Sort(s.latencies)
	return s, first
}

// comparison is A (idem) against B (the baseline), interleaved.
type comparison struct {
	a, b []sample
}

// interleave runs A and B alternately, rounds times each, swapping which
// goes first every round.
func interleave(ctx context.Context, rounds, clients int, d time.Duration, a, b op) (comparison, error) {
	var c comparison
	for r := range rounds {
		order := []bool{true, false}
		if r%2 == 1 {
			order = []bool{false, true}
		}
		for _, isA := range order {
			fn := b
			if isA {
				fn = a
			}
			s, err := measure(ctx, clients, d, fn)
			if err != nil {
				return c, err
			}
			if isA {
				c.a = append(c.a, s)
			} else {
				c.b = append(c.b, s)
			}
		}
	}
	return c, nil
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	sort.Float64s(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// row is one line of the results table.
type row struct {
	section, metric string
	idem, baseline  string
	ratio           float64
	spread          string
	target          string
	note            string
}

type table struct{ rows []row }

func (t *table) add(r row) { t.rows = append(t.rows, r) }

// throughputRow adds the median throughput ratio A/B with its spread.
func (t *table) throughputRow(section, metric string, c comparison, target string) {
	var ratios, ta, tb []float64
	for i := range c.a {
		ratios = append(ratios, c.a[i].throughput()/c.b[i].throughput())
		ta = append(ta, c.a[i].throughput())
		tb = append(tb, c.b[i].throughput())
	}
	t.add(row{section: section, metric: metric,
		idem:     fmt.Sprintf("%.0f ops/s", median(ta)),
		baseline: fmt.Sprintf("%.0f ops/s", median(tb)),
		ratio:    median(ratios), spread: spread(ratios), target: target})
}

// latencyRow adds p50 and p99 of A and B (medians over rounds).
func (t *table) latencyRow(section, metric string, c comparison, target string) {
	var p50a, p50b, p99a, p99b, r99 []float64
	for i := range c.a {
		p50a = append(p50a, ms(c.a[i].pct(0.5)))
		p50b = append(p50b, ms(c.b[i].pct(0.5)))
		p99a = append(p99a, ms(c.a[i].pct(0.99)))
		p99b = append(p99b, ms(c.b[i].pct(0.99)))
		r99 = append(r99, ms(c.a[i].pct(0.99))/ms(c.b[i].pct(0.99)))
	}
	t.add(row{section: section, metric: metric,
		idem:     fmt.Sprintf("p50 %.2f ms, p99 %.2f ms", median(p50a), median(p99a)),
		baseline: fmt.Sprintf("p50 %.2f ms, p99 %.2f ms", median(p50b), median(p99b)),
		ratio:    median(r99), spread: spread(r99), target: target, note: "ratio of p99"})
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func spread(xs []float64) string {
	if len(xs) == 0 {
		return ""
	}
	return fmt.Sprintf("%.2f..%.2f", slices.Min(xs), slices.Max(xs))
}

func (t *table) write(w io.Writer) {
	fmt.Fprintln(w, "| section | metric | idem | baseline | ratio | spread | target |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|")
	for _, r := range t.rows {
		ratio := fmt.Sprintf("%.2fx", r.ratio)
		if r.note != "" {
			ratio += " (" + r.note + ")"
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s |\n", r.section, r.metric, r.idem, r.baseline, ratio, r.spread, r.target)
	}
}
