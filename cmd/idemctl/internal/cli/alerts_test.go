package cli

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemprom"
	"github.com/idemkit/idem/internal/prune"
	"github.com/idemkit/idem/internal/testdb"
)

// value reads one sample of a gathered metric family by name and labels;
// a counter or gauge never written reads 0.
func value(t *testing.T, g prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	metrics:
		for _, m := range f.GetMetric() {
			for k, v := range labels {
				if !slices.ContainsFunc(m.GetLabel(), func(l *dto.LabelPair) bool {
					return l.GetName() == k && l.GetValue() == v
				}) {
					continue metrics
				}
			}
			switch {
			case m.Counter != nil:
				return m.GetCounter().GetValue()
			case m.Gauge != nil:
				return m.GetGauge().GetValue()
			}
		}
	}
	return 0
}

// selectors returns the metric names an expression reads, through the
// recording rules it uses.
func selectors(t *testing.T, expr string, recorded map[string]string) []string {
	t.Helper()
	e, err := parser.NewParser(parser.Options{}).ParseExpr(expr)
	if err != nil {
		t.Fatalf("%s: %v", expr, err)
	}
	var names []string
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			if rec, ok := recorded[vs.Name]; ok {
				names = append(names, selectors(t, rec, recorded)...)
			} else {
				names = append(names, vs.Name)
			}
		}
		return nil
	})
	return names
}

// TestAlertRules: docs/alerts.yml is valid for Prometheus' own rule parser
// (PromQL and templates included), and for each alert a test creates the
// condition it names against a real database and shows the metric its
// expression reads move.
func TestAlertRules(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	raw, err := os.ReadFile("../../../../docs/alerts.yml")
	if err != nil {
		t.Fatal(err)
	}
	groups, errs := rulefmt.Parse(raw, false, model.UTF8Validation, parser.NewParser(parser.Options{}), nil)
	if len(errs) > 0 {
		t.Fatalf("docs/alerts.yml: %v", errs)
	}
	recorded := map[string]string{}
	alerts := map[string]string{}
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			if r.Record != "" {
				recorded[r.Record] = r.Expr
			} else {
				alerts[r.Alert] = r.Expr
			}
		}
	}

	// daemon is idemctl run's metrics on a fresh database.
	daemon := func(t *testing.T) (*pgxpool.Pool, *metrics) {
		url := testdb.New(t)
		pool := testdb.Pool(t, url, 4)
		return pool, newMetrics(pool)
	}
	quiet := slog.New(slog.DiscardHandler)
	type condition struct {
		metric string
		labels map[string]string
		// create makes the condition and returns the gatherer to read and
		// the metric's value before and after.
		create func(t *testing.T) (before, after float64)
	}
	conditions := map[string]condition{
		"IdemDuplicateRateSpike": {"idem_claims_total", map[string]string{"source": "stripe", "outcome": "completed"},
			func(t *testing.T) (float64, float64) {
				pool := testdb.Pool(t, testdb.New(t), 4)
				reg := prometheus.NewRegistry()
				obs, err := idemprom.New(reg)
				if err != nil {
					t.Fatal(err)
				}
				c, err := idem.New(pool, &idem.Config{Observer: obs})
				if err != nil {
					t.Fatal(err)
				}
				work := func(context.Context) (any, error) { return "ok", nil }
				for i := range 5 {
					_, _ = c.Do(ctx, "stripe", fmt.Sprint("evt_", i), work)
				}
				read := func() float64 {
					return value(t, reg, "idem_claims_total", map[string]string{"source": "stripe", "outcome": "completed"})
				}
				before := read()
				// The sender starts redelivering everything, three times.
				for range 3 {
					for i := range 5 {
						_, _ = c.Do(ctx, "stripe", fmt.Sprint("evt_", i), work)
					}
				}
				first := value(t, reg, "idem_claims_total", map[string]string{"source": "stripe", "outcome": "acquired"})
				after := read()
				if ratio := after / (after + first); ratio <= 0.2 {
					t.Errorf("duplicate ratio %.2f, want above the alert's 0.2", ratio)
				}
				return before, after
			}},
		"IdemClaimErrors": {"idem_claims_total", map[string]string{"source": "stripe", "outcome": "error"},
			func(t *testing.T) (float64, float64) {
				pool := testdb.Pool(t, testdb.New(t), 2)
				reg := prometheus.NewRegistry()
				obs, _ := idemprom.New(reg)
				c, err := idem.New(pool, &idem.Config{Observer: obs})
				if err != nil {
					t.Fatal(err)
				}
				read := func() float64 {
					return value(t, reg, "idem_claims_total", map[string]string{"source": "stripe", "outcome": "error"})
				}
				before := read()
				if _, err := c.Claim(ctx, "stripe", "   "); err == nil {
					t.Fatal("a blank key was accepted")
				}
				return before, read()
			}},
		"IdemStuckLeases": {"idem_stuck_leases", nil, func(t *testing.T) (float64, float64) {
			pool, m := daemon(t)
			job := m.pruneJob(pool, prune.Config{}, quiet)
			if _, err := job(ctx); err != nil {
				t.Fatal(err)
			}
			before := value(t, m.reg, "idem_stuck_leases", nil)
			// A worker died an hour ago holding a key; nobody redelivered.
			if _, err := pool.Exec(ctx, `
				INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, lease_expires_at, first_seen, updated_at, expires_at)
				VALUES ('queue', 'orphan', idem.utc_month(now()), 'processing', 7, now() - interval '1 hour', now() - interval '2 hours', now(), now() + interval '1 day')`); err != nil {
				t.Fatal(err)
			}
			if _, err := job(ctx); err != nil {
				t.Fatal(err)
			}
			return before, value(t, m.reg, "idem_stuck_leases", nil)
		}},
		"IdemDefaultPartitionRows": {"idem_default_partition_rows", nil, func(t *testing.T) (float64, float64) {
			pool, m := daemon(t)
			before := value(t, m.reg, "idem_default_partition_rows", nil)
			seedRows(t, pool, "far-", monthStart(time.Now(), 9), 5, false, false) // no partition that far ahead
			return before, value(t, m.reg, "idem_default_partition_rows", nil)
		}},
		"IdemPartitionsAheadLow": {"idem_partitions_ahead", nil, func(t *testing.T) (float64, float64) {
			pool, m := daemon(t)
			before := value(t, m.reg, "idem_partitions_ahead", nil)
			dropFutureMonths(t, pool) // rotation stopped running for months
			return before, value(t, m.reg, "idem_partitions_ahead", nil)
		}},
		"IdemPruneFallingBehind": {"idem_job_runs_total", map[string]string{"job": "prune", "result": "error"},
			func(t *testing.T) (float64, float64) {
				pool, m := daemon(t)
				cfg := prune.Config{LockTimeout: new(50 * time.Millisecond), Retries: new(0)}
				m.job(ctx, quiet, "prune", m.pruneJob(pool, cfg, quiet)).Run()
				lastOK := value(t, m.reg, "idem_job_last_success_timestamp_seconds", map[string]string{"job": "prune"})
				read := func() float64 {
					return value(t, m.reg, "idem_job_runs_total", map[string]string{"job": "prune", "result": "error"})
				}
				before := read()
				// A transaction holds the table: every prune run fails.
				tx, err := pool.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := tx.Exec(ctx, `LOCK TABLE idem.processed_events IN ACCESS EXCLUSIVE MODE`); err != nil {
					t.Fatal(err)
				}
				for range 2 {
					m.job(ctx, quiet, "prune", m.pruneJob(pool, cfg, quiet)).Run()
				}
				_ = tx.Rollback(ctx)
				if lastOK == 0 || value(t, m.reg, "idem_job_last_success_timestamp_seconds", map[string]string{"job": "prune"}) != lastOK {
					t.Errorf("the last success moved while prune failed (or never was set: %v)", lastOK)
				}
				return before, read()
			}},
		"IdemDatabaseDown": {"idem_database_up", nil, func(t *testing.T) (float64, float64) {
			_, up := daemon(t)
			cfg, err := pgxpool.ParseConfig("postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
			if err != nil {
				t.Fatal(err)
			}
			down, err := pgxpool.NewWithConfig(ctx, cfg) // connects lazily: the scrape finds it down
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(down.Close)
			return value(t, up.reg, "idem_database_up", nil), value(t, newMetrics(down).reg, "idem_database_up", nil)
		}},
	}

	for name, expr := range alerts {
		cond, ok := conditions[name]
		if !ok {
			t.Errorf("alert %s has no test creating its condition", name)
			continue
		}
		if !slices.Contains(selectors(t, expr, recorded), cond.metric) {
			t.Errorf("alert %s does not read %s: %s", name, cond.metric, expr)
		}
	}
	for name, cond := range conditions {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			if _, ok := alerts[name]; !ok {
				t.Fatalf("no alert %s in docs/alerts.yml", name)
			}
			before, after := cond.create(t)
			if before == after {
				t.Fatalf("%s%v stayed at %v when the condition was created", cond.metric, cond.labels, before)
			}
			t.Logf("%s%v: %v -> %v", cond.metric, cond.labels, before, after)
		})
	}
}
