package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
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
	runbooks := map[string]string{}
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			if r.Record != "" {
				recorded[r.Record] = r.Expr
			} else {
				alerts[r.Alert] = r.Expr
				runbooks[r.Alert] = r.Annotations["runbook"]
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
		// create makes the condition and returns the metric's value before
		// and after, and follow: it follows the alert's runbook and fails
		// the test unless the metric falls back (a gauge to its healthy
		// value, a counter's rate to 0), returning what it saw.
		create func(t *testing.T) (before, after float64, follow func(t *testing.T) string)
	}
	// sender delivers events to a receiver behind idemhttp as a webhook
	// sender does: it gives up on an answer after its timeout (2s) and
	// redelivers until it gets a 2xx. redelivered is told of each
	// redelivery.
	sender := func(t *testing.T, url string, events []string, redelivered func()) {
		t.Helper()
		client := &http.Client{Timeout: 2 * time.Second}
		for _, evt := range events {
			for try := 0; ; try++ {
				if try == 100 {
					t.Fatalf("%s: no 2xx after 100 deliveries", evt)
				}
				if try > 0 {
					redelivered()
				}
				req, _ := http.NewRequest("POST", url, strings.NewReader(`{"id":"`+evt+`"}`))
				req.Header.Set("Idempotency-Key", evt)
				resp, err := client.Do(req)
				if err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode < 300 {
						break
					}
				}
				time.Sleep(50 * time.Millisecond)
			}
		}
	}
	claims := func(reg prometheus.Gatherer, outcome string) float64 {
		return value(t, reg, "idem_claims_total", map[string]string{"source": "stripe", "outcome": outcome})
	}
	duplicates := func(reg prometheus.Gatherer) float64 {
		return claims(reg, "completed") + claims(reg, "in_progress")
	}
	conditions := map[string]condition{
		"IdemDuplicateRateSpike": {"idem_claims_total", map[string]string{"source": "stripe", "outcome": "in_progress"},
			func(t *testing.T) (float64, float64, func(t *testing.T) string) {
				pool := testdb.Pool(t, testdb.New(t), 8)
				reg := prometheus.NewRegistry()
				obs, err := idemprom.New(reg)
				if err != nil {
					t.Fatal(err)
				}
				c, err := idem.New(pool, &idem.Config{Observer: obs})
				if err != nil {
					t.Fatal(err)
				}
				// A slow dependency: the handler answers only once the sender
				// has given up on it and redelivered five times (the
				// redeliveries answered 409, in progress), whatever the
				// machine's speed.
				var slow atomic.Bool
				slow.Store(true)
				var redeliveries atomic.Int32
				unblock := make(chan struct{})
				mw, err := idemhttp.New(idemhttp.Config{Client: c, Source: "stripe", Scope: idemhttp.Unscoped})
				if err != nil {
					t.Fatal(err)
				}
				srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					if slow.Load() {
						<-unblock
					}
					w.WriteHeader(http.StatusOK)
				})))
				t.Cleanup(srv.Close)
				before := claims(reg, "in_progress")
				sender(t, srv.URL, []string{"evt_1"}, func() {
					if redeliveries.Add(1) == 5 {
						close(unblock)
					}
				})
				acquired, dupes := claims(reg, "acquired"), duplicates(reg)
				if ratio := dupes / (dupes + acquired); ratio <= 0.2 {
					t.Errorf("duplicate ratio %.2f (%v of %v), want above the alert's 0.2", ratio, dupes, dupes+acquired)
				}
				return before, claims(reg, "in_progress"), func(t *testing.T) string {
					// The runbook: answer within the sender's timeout.
					slow.Store(false)
					a0, d0 := claims(reg, "acquired"), duplicates(reg)
					sender(t, srv.URL, []string{"evt_4", "evt_5", "evt_6", "evt_7"}, func() {})
					a, d := claims(reg, "acquired")-a0, duplicates(reg)-d0
					if a != 4 || d != 0 {
						t.Fatalf("after the handler was sped up: %v acquired, %v duplicates of 4 new events, want 4 and 0", a, d)
					}
					return fmt.Sprintf("4 new events, %v duplicates: the ratio falls to 0", d)
				}
			}},
		"IdemClaimErrors": {"idem_claims_total", map[string]string{"source": "stripe", "outcome": "error"},
			func(t *testing.T) (float64, float64, func(t *testing.T) string) {
				pool := testdb.Pool(t, testdb.New(t), 2)
				reg := prometheus.NewRegistry()
				obs, _ := idemprom.New(reg)
				c, err := idem.New(pool, &idem.Config{Observer: obs})
				if err != nil {
					t.Fatal(err)
				}
				before := claims(reg, "error")
				// The key is read from the wrong header: blank.
				if _, err := c.Claim(ctx, "stripe", "   "); !errors.Is(err, idem.ErrInvalidInput) {
					t.Fatalf("a blank key: %v, want ErrInvalidInput, as the runbook says", err)
				}
				return before, claims(reg, "error"), func(t *testing.T) string {
					// The runbook: fix how the key is read.
					e0 := claims(reg, "error")
					for i := range 5 {
						if _, err := c.Claim(ctx, "stripe", fmt.Sprint("evt_", i)); err != nil {
							t.Fatal(err)
						}
					}
					if n := claims(reg, "error") - e0; n != 0 {
						t.Fatalf("%v errors after the keys were fixed", n)
					}
					return "5 claims, 0 errors: the error rate falls to 0"
				}
			}},
		"IdemStuckLeases": {"idem_stuck_leases", nil, func(t *testing.T) (float64, float64, func(t *testing.T) string) {
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
			return before, value(t, m.reg, "idem_stuck_leases", nil), func(t *testing.T) string {
				url := dbURL(t, pool)
				r := idemctl(t, ctx, nil, "check", "--database-url", url)
				if !strings.Contains(r.errout, "queue/orphan") {
					t.Fatalf("check does not name the stuck key: %+v", r)
				}
				if r := idemctl(t, ctx, nil, "release", "--database-url", url, "--source", "queue", "--key", "orphan"); r.code != 0 {
					t.Fatalf("release: %+v", r)
				}
				if _, err := job(ctx); err != nil {
					t.Fatal(err)
				}
				if v := value(t, m.reg, "idem_stuck_leases", nil); v != before {
					t.Fatalf("idem_stuck_leases %v after release and a prune run, want %v", v, before)
				}
				return "check named queue/orphan; released; the next prune run counts 0"
			}
		}},
		"IdemDefaultPartitionRows": {"idem_default_partition_rows", nil, func(t *testing.T) (float64, float64, func(t *testing.T) string) {
			pool, m := daemon(t)
			before := value(t, m.reg, "idem_default_partition_rows", nil)
			seedRows(t, pool, "far-", monthStart(time.Now(), 9), 5, false, false) // no partition that far ahead
			return before, value(t, m.reg, "idem_default_partition_rows", nil), func(t *testing.T) string {
				if r := idemctl(t, ctx, nil, "partitions", "rotate", "--move-default", "--database-url", dbURL(t, pool)); r.code != 0 {
					t.Fatalf("rotate --move-default: %+v", r)
				}
				if v := value(t, m.reg, "idem_default_partition_rows", nil); v != before {
					t.Fatalf("idem_default_partition_rows %v after the runbook, want %v", v, before)
				}
				return "rotate --move-default moved the rows; the gauge reads 0"
			}
		}},
		"IdemPartitionsAheadLow": {"idem_partitions_ahead", nil, func(t *testing.T) (float64, float64, func(t *testing.T) string) {
			pool, m := daemon(t)
			before := value(t, m.reg, "idem_partitions_ahead", nil)
			dropFutureMonths(t, pool) // rotation stopped running for months
			return before, value(t, m.reg, "idem_partitions_ahead", nil), func(t *testing.T) string {
				if r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", dbURL(t, pool)); r.code != 0 {
					t.Fatalf("rotate: %+v", r)
				}
				if v := value(t, m.reg, "idem_partitions_ahead", nil); v < 2 {
					t.Fatalf("idem_partitions_ahead %v after the runbook, want at least 2", v)
				}
				return "rotate premade the months"
			}
		}},
		"IdemPruneFallingBehind": {"idem_job_runs_total", map[string]string{"job": "prune", "result": "error"},
			func(t *testing.T) (float64, float64, func(t *testing.T) string) {
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
				if lastOK == 0 || value(t, m.reg, "idem_job_last_success_timestamp_seconds", map[string]string{"job": "prune"}) != lastOK {
					t.Errorf("the last success moved while prune failed (or never was set: %v)", lastOK)
				}
				return before, read(), func(t *testing.T) string {
					// The runbook: end the transaction that holds the table,
					// then the next run succeeds.
					_ = tx.Rollback(ctx)
					time.Sleep(1100 * time.Millisecond) // the timestamp's resolution is a second
					m.job(ctx, quiet, "prune", m.pruneJob(pool, cfg, quiet)).Run()
					if v := value(t, m.reg, "idem_job_last_success_timestamp_seconds", map[string]string{"job": "prune"}); v <= lastOK {
						t.Fatalf("the last success is still %v after the blocking transaction ended", v)
					}
					return "the blocking transaction ended; the next run succeeded, so time() - last success falls"
				}
			}},
		"IdemDatabaseDown": {"idem_database_up", nil, func(t *testing.T) (float64, float64, func(t *testing.T) string) {
			pool, m := daemon(t)
			url := dbURL(t, pool)
			before := value(t, m.reg, "idem_database_up", nil)
			// The database stops accepting connections (an outage as the
			// daemon sees it: its connections gone, new ones refused).
			var db string
			if err := pool.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
				t.Fatal(err)
			}
			admin := testdb.Pool(t, testdb.URLFor(t, "postgres"), 1)
			if _, err := admin.Exec(ctx, `ALTER DATABASE `+pgx.Identifier{db}.Sanitize()+` ALLOW_CONNECTIONS false`); err != nil {
				t.Fatal(err)
			}
			if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()`, db); err != nil {
				t.Fatal(err)
			}
			pool.Reset()
			after := value(t, m.reg, "idem_database_up", nil)
			return before, after, func(t *testing.T) string {
				r := idemctl(t, ctx, nil, "check", "--database-url", url)
				if r.code == 0 || !strings.Contains(r.errout, "not currently accepting connections") {
					t.Fatalf("check during the outage does not say what fails: %+v", r)
				}
				if _, err := admin.Exec(ctx, `ALTER DATABASE `+pgx.Identifier{db}.Sanitize()+` ALLOW_CONNECTIONS true`); err != nil {
					t.Fatal(err)
				}
				if v := value(t, m.reg, "idem_database_up", nil); v != 1 {
					t.Fatalf("idem_database_up %v once the database answers again", v)
				}
				return "check said the database refuses connections; once it answers the gauge reads 1"
			}
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
		// Each idemctl command a runbook names is one idemctl takes.
		if runbooks[name] == "" {
			t.Errorf("alert %s has no runbook annotation", name)
		}
		for _, m := range regexp.MustCompile("`idemctl ([^`]*)`").FindAllStringSubmatch(runbooks[name], -1) {
			args := strings.Fields(strings.NewReplacer(" S ", " s ", " K", " k").Replace(" " + m[1] + " "))
			if r := idemctl(t, ctx, nil, append(args, "--help")...); r.code != 0 {
				t.Errorf("alert %s's runbook names `idemctl %s`, which idemctl refuses: %+v", name, m[1], r)
			}
		}
	}
	for name, cond := range conditions {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			if _, ok := alerts[name]; !ok {
				t.Fatalf("no alert %s in docs/alerts.yml", name)
			}
			before, after, follow := cond.create(t)
			if before == after {
				t.Fatalf("%s%v stayed at %v when the condition was created", cond.metric, cond.labels, before)
			}
			t.Logf("%s%v: %v -> %v; runbook: %s", cond.metric, cond.labels, before, after, follow(t))
		})
	}
}

// dbURL is the connection string of pool's database, for idemctl.
func dbURL(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	return pool.Config().ConnString()
}

// TestScrapeCountsDefaultRowsUpToABound: the scrape counts the default
// partition's rows up to defaultRowsCap + 1, and the database reads as up
// whatever the count.
func TestScrapeCountsDefaultRowsUpToABound(t *testing.T) {
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 2)
	defer func(c int64) { defaultRowsCap = c }(defaultRowsCap)
	defaultRowsCap = 10
	seedRows(t, pool, "far-", monthStart(time.Now(), 9), 25, false, false)
	m := newMetrics(pool)
	if v := value(t, m.reg, "idem_default_partition_rows", nil); v != 11 {
		t.Fatalf("idem_default_partition_rows %v with 25 rows and a bound of 10, want 11", v)
	}
	if v := value(t, m.reg, "idem_database_up", nil); v != 1 {
		t.Fatalf("idem_database_up %v", v)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events_default`).Scan(&n); err != nil || n != 25 {
		t.Fatal(n, err)
	}
}
