package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/pgcluster"
)

// TestSerializableRowsSmoke runs the claim section's SERIALIZABLE rows
// once, tiny (one client, 20 transactions a side): the scripts run, pgbench
// retries, and the rows are filled with the share retried. It measures
// nothing.
func TestSerializableRowsSmoke(t *testing.T) {
	t.Chdir("..")
	ctx := context.Background()
	c, err := pgcluster.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	s := server{"smoke", c.URL("postgres"), c.BinDir}
	u, err := claimDatabase(ctx, s.url, "idem_smoke_serializable", 0, 5, 0)
	if err != nil {
		t.Fatal(err)
	}
	tab := &v2table{servers: []string{"smoke"}}
	if err := serializableRows(ctx, s, options{rounds: 1, duration: 50 * time.Millisecond}, tab, u, 1); err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	tab.write(&b)
	for _, want := range []string{"SERIALIZABLE transactions vs the same in READ COMMITTED, the default policy, 1 clients",
		"a 400-day ttl, 1 clients", "transactions retried: 0.0%", "<= 5% retried"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("no %q in\n%s", want, b.String())
		}
	}
	// Each ttl's claims went into their own source; the 400-day one raised
	// its lookback.
	conn, err := pgx.Connect(ctx, u)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var n int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM idem.lookbacks WHERE source = 'pgbench-iso-400' AND lookback >= interval '400 days'`).Scan(&n); err != nil || n != 1 {
		t.Errorf("the 400-day source's lookback: %d rows, %v", n, err)
	}
}
