package dashboard_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dashboard"
	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/internal/maintlock"
	"github.com/idemkit/idem/internal/testdb"
)

// captureTracer keeps the SQL and arguments of the queries that match.
type captureTracer struct {
	match string
	mu    sync.Mutex
	sql   string
	args  []any
}

func (c *captureTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, c.match) {
		c.mu.Lock()
		c.sql, c.args = d.SQL, d.Args
		c.mu.Unlock()
	}
	return ctx
}

func (c *captureTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// sortNode is a Sort or Incremental Sort node of an EXPLAIN (not a Merge
// Append's "Sort Key").
var sortNode = regexp.MustCompile(`(?m)^\s*(->\s+)?(Incremental )?Sort\s*$`)

// TestKeysOrderFromIndex: 100,000 keys sharing one expiry (as adopted from
// a date column), analyzed; the keys list's query, as the page runs it
// (first page and the Next page's cursor inside the tied group), is read
// in its order from the (expires_at, source, key) index: the plan, with
// enable_sort off as the page sets it, has an index scan on it and no Sort
// node (with the index on expires_at alone, no plan could spare the Sort). With the index on expires_at alone
// (before migration 19), every page sorted the whole tied group.
func TestKeysOrderFromIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	u := testdb.New(t)
	tr := &captureTracer{match: "ORDER BY x.expires_at DESC"}
	cfg, err := pgxpool.ParseConfig(u)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Tracer = tr
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if _, err := pool.Exec(ctx, `
		INSERT INTO idem.processed_events (source, key, first_seen_month, status, attempts, token, first_seen, updated_at, expires_at, completed_at)
		SELECT 'adopted', 'order-' || g, idem.utc_month(idem.clock()), 'completed', 1, g, idem.clock(), idem.clock(), '2100-01-01', idem.clock()
		  FROM generate_series(1, 100000) g;
		ANALYZE idem.processed_events`); err != nil {
		t.Fatal(err)
	}
	srv := serve(t, dashboard.Config{Pool: pool})
	for _, page := range []string{"/keys", "/keys?source=adopted&before=2100-01-01T00:00:00Z&before_source=adopted&before_key=order-5"} {
		if code, body := get(t, srv.URL+page); code != 200 {
			t.Fatalf("%s: %d %s", page, code, body)
		}
		tr.mu.Lock()
		sql, args := tr.sql, tr.args
		tr.mu.Unlock()
		if sql == "" {
			t.Fatal("the keys list's query was not seen")
		}
		// As the page runs it: in a transaction with enable_sort off.
		var plan strings.Builder
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, "SET LOCAL enable_sort = off"); err != nil {
			t.Fatal(err)
		}
		rows, err := tx.Query(ctx, "EXPLAIN (COSTS OFF) "+sql, args...)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var line string
			if err := rows.Scan(&line); err != nil {
				t.Fatal(err)
			}
			plan.WriteString(line + "\n")
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		_ = tx.Rollback(ctx)
		if sortNode.MatchString(plan.String()) || !strings.Contains(plan.String(), "expires_at_source_key_idx") {
			t.Errorf("%s: the keys list's order is not read from the (expires_at, source, key) index:\n%s", page, plan.String())
		}
	}
}

// TestPagesShowNoConnection: a run that failed to connect (recorded as
// idemctl records it) and one stored word for word with a driver's text
// (as before SafeError) name a user, a database, a host and a port; no
// page shows any of them.
func TestPagesShowNoConnection(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := setup(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := fmt.Sprint(l.Addr().(*net.TCPAddr).Port)
	l.Close() // nothing listens there now
	bad := fmt.Sprintf("postgres://secret_user:pw@127.0.0.1:%s/secret_db?connect_timeout=5", port)
	_, connErr := pgx.Connect(ctx, bad)
	if connErr == nil {
		t.Fatal("connected to a closed port")
	}
	var logs testdb.Buffer
	maintlock.Record(ctx, pgxdb.New(f.pool), slog.New(slog.NewTextHandler(&logs, nil)), maintlock.Run{Job: "prune", Outcome: "error", Err: connErr, Holder: "test"})
	if !strings.Contains(logs.String(), "secret_user") {
		t.Errorf("the log does not have the driver's error: %s", logs.String())
	}
	raw := fmt.Sprintf("failed to connect to `user=secret_user database=secret_db`: 127.0.0.1:%s (db.internal.example): dial error: dial tcp 10.1.2.3:%s: connect: connection refused; host=db.internal.example port=%s; role \"secret_user\" does not exist; /var/run/postgresql/.s.PGSQL.%s", port, port, port, port)
	if _, err := f.pool.Exec(ctx, `SELECT idem.record_run('rotate', now(), 'error', '{}', $1, 'old idemctl')`, raw); err != nil {
		t.Fatal(err)
	}
	srv := serve(t, dashboard.Config{Pool: f.pool, Inbox: f.in})
	for _, page := range []string{"/", "/maintenance", "/keys", "/keys?source=web&key=k1", "/dead", "/jobs"} {
		code, body := get(t, srv.URL+page)
		if code != 200 && code != 404 {
			t.Fatalf("%s: %d", page, code)
		}
		for _, leak := range []string{"secret_user", "secret_db", "127.0.0.1:" + port, "10.1.2.3", "db.internal.example", ":" + port, ".s.PGSQL"} {
			if strings.Contains(body, leak) {
				t.Errorf("%s shows %q", page, leak)
			}
		}
	}
	if _, body := get(t, srv.URL+"/maintenance"); !strings.Contains(body, "could not connect to the database") {
		t.Errorf("/maintenance does not say what failed:\n%s", body)
	}
}

// TestBusyShed: with MaxPages 1 and the pool's only connection held by
// the test, three pages asked for at once: one waits for the connection,
// the two others are answered 503 with Retry-After at once, without a
// query; the one that waited is served when the connection comes back.
func TestBusyShed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 1)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	srv := serve(t, dashboard.Config{Pool: pool, MaxPages: 1, QueryTimeout: 2 * time.Minute})
	type answer struct {
		code  int
		retry string
	}
	answers := make(chan answer, 3)
	for range 3 {
		go func() {
			resp, err := http.Get(srv.URL + "/maintenance")
			if err != nil {
				answers <- answer{code: -1}
				return
			}
			resp.Body.Close()
			answers <- answer{resp.StatusCode, resp.Header.Get("Retry-After")}
		}()
	}
	for range 2 {
		if a := <-answers; a.code != http.StatusServiceUnavailable || a.retry == "" {
			t.Errorf("a page past MaxPages: %d, Retry-After %q; want 503 with Retry-After", a.code, a.retry)
		}
	}
	if code, _ := get(t, srv.URL+"/static/idem.css"); code != 200 {
		t.Errorf("the stylesheet while busy: %d (static files are not pages)", code)
	}
	conn.Release()
	if a := <-answers; a.code != 200 {
		t.Errorf("the page that waited for the connection: %d", a.code)
	}
	if _, err := dashboard.New(dashboard.Config{Pool: pool, MaxPages: -1}); !errors.Is(err, dashboard.ErrInvalidConfig) {
		t.Errorf("MaxPages -1: %v", err)
	}
}

// TestOverviewExactBelowRate: a source under the default policy (1 in 8
// sampled) with two keys claimed 10 times each is shown exactly: 18
// duplicates of 20 claims, 90.0%, no "~" (before migration 19: acquired
// 0 and 18 duplicates as ~56, or whatever the sample drew). ExactRate is
// idem.exact_counting_rate().
func TestOverviewExactBelowRate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 4)
	var rate int
	if err := pool.QueryRow(ctx, `SELECT idem.exact_counting_rate()`).Scan(&rate); err != nil || rate != dashboard.ExactRate {
		t.Fatalf("idem.exact_counting_rate() = %d (%v), dashboard.ExactRate = %d", rate, err, dashboard.ExactRate)
	}
	if _, err := pool.Exec(ctx, `SELECT idem.claim('two', 'k' || (g % 2), lease => '1 hour') FROM generate_series(1, 20) g`); err != nil {
		t.Fatal(err)
	}
	srv := serve(t, dashboard.Config{Pool: pool})
	code, body := get(t, srv.URL+"/")
	if code != 200 {
		t.Fatalf("/: %d", code)
	}
	contains(t, "/", body, `data-figure="rate-24h">90.0%</span>`, "18 of 20")
	if strings.Contains(body, "~") {
		t.Errorf("the overview marks an estimate below the rate:\n%s", body)
	}
}
