package cli

import (
	"context"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/testdb"
)

// TestDemo runs the README's quick start: once against a given database
// (twice: it changes nothing there and leaves no scratch database on the
// server), once with nothing configured (it starts its own throwaway
// PostgreSQL).
func TestDemo(t *testing.T) {
	t.Parallel()
	for name, env := range map[string]map[string]string{
		"given database":    {"DATABASE_URL": testdb.NewEmpty(t)},
		"throwaway cluster": {},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			runs := 1
			var before string
			snapshot := func() string { return "" }
			if url := env["DATABASE_URL"]; url != "" {
				// An existing database with tables (and an idem install)
				// of its own: run twice, and nothing in it may change.
				runs = 2
				pool := testdb.Pool(t, url, 1)
				for _, q := range []string{`CREATE TABLE payments (id int); INSERT INTO payments VALUES (42)`,
					`CREATE SCHEMA idem_demo; CREATE TABLE idem_demo.mine (x int)`} {
					if _, err := pool.Exec(context.Background(), q); err != nil {
						t.Fatal(err)
					}
				}
				if r := idemctl(t, context.Background(), env, "migrate", "up"); r.code != 0 {
					t.Fatalf("migrate up: %s", r.errout)
				}
				snapshot = func() string {
					var out string
					if err := pool.QueryRow(context.Background(), `
						SELECT string_agg(x, E'\n' ORDER BY x) FROM (
						  SELECT format('%I.%I %s', n.nspname, c.relname,
						         (xpath('/row/n/text()', query_to_xml(format('SELECT count(*) AS n FROM %I.%I', n.nspname, c.relname), false, true, '')))[1]::text) AS x
						    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
						   WHERE c.relkind IN ('r', 'p') AND n.nspname NOT IN ('pg_catalog', 'information_schema')
						  UNION ALL SELECT format('setting %s', s.setconfig) FROM pg_db_role_setting s
						  UNION ALL SELECT format('schema %s', nspname) FROM pg_namespace) y`).Scan(&out); err != nil {
						t.Fatal(err)
					}
					return out
				}
				before = snapshot()
			}
			for range runs {
				r := idemctl(t, context.Background(), env, "demo", "--events", "120", "--deliveries", "4")
				if r.code != 0 || !strings.Contains(r.out, "\nall checks passed\n") {
					t.Fatalf("demo: exit %d\n%s\n%s", r.code, r.out, r.errout)
				}
				for _, want := range []string{"[PASS] one email per event, none twice (120 sent, 0 duplicates)", "[PASS] one payment per invoice",
					"[PASS] forged, stale and unsigned deliveries refused before any claim (80 of 80 refused, 0 forged payments booked",
					"[PASS] customer balances are exact", "partitions rotate:", "prune:", "DUP RATE",
					"[PASS] reconciliation: timeouts-async: accepted",
					"[PASS] a key first seen last month is recognized this month"} {
					if !strings.Contains(r.out, want) {
						t.Errorf("demo output lacks %q", want)
					}
				}
				// The stats read River's jobs too: a balanced line, no error.
				if strings.Contains(r.out, "\ninbox: ") || !regexpLine(r.out, `^timeouts-async\s+(\d+)\s+\d+\s+0\s+0\s+0\s+0\s+0\s+true\s*$`) {
					t.Errorf("demo's inbox reconciliation is not complete:\n%s", r.out)
				}
			}
			if after := snapshot(); after != before {
				t.Fatalf("the demo changed the given database:\nbefore:\n%s\nafter:\n%s", before, after)
			}
			if url := env["DATABASE_URL"]; url != "" {
				// Nor did it leave a scratch database on the server.
				var left int
				if err := testdb.Pool(t, url, 1).QueryRow(context.Background(), `SELECT count(*) FROM pg_database WHERE datname LIKE 'idem\_demo\_%'`).Scan(&left); err != nil || left != 0 {
					t.Fatalf("%d scratch databases left on the server (%v)", left, err)
				}
			}
		})
	}
}
