package idemprom_test

import (
	"context"
	"fmt"
	"log"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemprom"
	"github.com/idemkit/idem/internal/testdb"
)

// Per-source claim outcomes as Prometheus counters, on the application's
// registry: one delivery and two duplicates of it.
func ExampleNew() {
	ctx := context.Background()
	pool, done := testdb.ExamplePool() // in an application: pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	defer done()

	reg := prometheus.NewRegistry() // or prometheus.DefaultRegisterer
	metrics, err := idemprom.New(reg)
	if err != nil {
		log.Fatal(err)
	}
	c, err := idem.New(pool, &idem.Config{Observer: metrics})
	if err != nil {
		log.Fatal(err)
	}
	for range 3 {
		if _, err := c.Do(ctx, "stripe", "evt_1", func(ctx context.Context) (any, error) { return "ok", nil }); err != nil {
			log.Fatal(err)
		}
	}

	families, err := reg.Gather()
	if err != nil {
		log.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "idem_claims_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			fmt.Printf("idem_claims_total{source=%q, outcome=%q} %v\n", labels["source"], labels["outcome"], m.GetCounter().GetValue())
		}
	}
	// Output:
	// idem_claims_total{source="stripe", outcome="acquired"} 1
	// idem_claims_total{source="stripe", outcome="completed"} 2
}
