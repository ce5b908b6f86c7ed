package cli

import (
	"context"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/testdb"
)

// TestDemo runs the README's quick start: once against a given database,
// once with nothing configured (it starts its own throwaway PostgreSQL).
func TestDemo(t *testing.T) {
	t.Parallel()
	for name, env := range map[string]map[string]string{
		"given database":    {"DATABASE_URL": testdb.NewEmpty(t)},
		"throwaway cluster": {},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			if url := env["DATABASE_URL"]; url != "" {
				// An existing database with a payments table of its own.
				pool := testdb.Pool(t, url, 1)
				if _, err := pool.Exec(context.Background(), `CREATE TABLE payments (id int); INSERT INTO payments VALUES (42)`); err != nil {
					t.Fatal(err)
				}
				defer func() {
					var id int
					if err := pool.QueryRow(context.Background(), `SELECT id FROM public.payments`).Scan(&id); err != nil || id != 42 {
						t.Errorf("the demo touched the database's own payments table: %d %v", id, err)
					}
				}()
			}
			r := idemctl(t, context.Background(), env, "demo", "--events", "120", "--deliveries", "4")
			if r.code != 0 || !strings.Contains(r.out, "\nall checks passed\n") {
				t.Fatalf("demo: exit %d\n%s\n%s", r.code, r.out, r.errout)
			}
			wants := []string{"[PASS] one email per event, none twice (120 sent, 0 duplicates)", "[PASS] one payment per invoice",
				"[PASS] forged, stale and unsigned deliveries refused before any claim (80 of 80 refused, 0 forged payments booked",
				"[PASS] customer balances are exact", "partitions rotate:", "prune:", "DUP RATE",
				"[PASS] reconciliation: timeouts-async: accepted"}
			if name == "throwaway cluster" {
				wants = append(wants, "[PASS] a key first seen last month is recognized this month")
			}
			for _, want := range wants {
				if !strings.Contains(r.out, want) {
					t.Errorf("demo output lacks %q", want)
				}
			}
		})
	}
}
