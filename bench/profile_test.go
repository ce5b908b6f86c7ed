package main

import (
	"context"
	"strings"
	"testing"
)

// TestProfileSectionSmoke runs the profile section, tiny (20 operations a
// phase), on a cluster of its own: pg_stat_statements is loaded, counts
// the statements inside the functions, and every phase's table is written
// with the call and its nested statements, the functions called, and the
// completion's updates with the share of them HOT. It measures nothing.
func TestProfileSectionSmoke(t *testing.T) {
	t.Chdir("..")
	ctx := context.Background()
	c, err := profileCluster(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	var w strings.Builder
	if err := profileOn(ctx, c.URL("postgres"), 20, &w); err != nil {
		t.Fatal(err)
	}
	out := w.String()
	t.Log(out)
	for _, want := range []string{"### idem.claim of a new key\n", "### idem.complete_stored of the key claimed", "### idem.claim of a duplicate",
		"### idem.claim of a new key in a SERIALIZABLE transaction, the default policy", "### idem.claim of a new key in a SERIALIZABLE transaction, a 400-day ttl", "### bench_floor_claim of a new key",
		"| **call** | 1.00 |", "INSERT INTO idem.processed_events", "% of them HOT (n_tup_hot_upd)",
		"| `idem.claim` | 1.00 |", "| `idem.complete` | 1.00 |", "Outside every statement counted", "UPDATE idem.processed_events", "| nested |"} {
		if !strings.Contains(out, want) {
			t.Errorf("no %q in\n%s", want, out)
		}
	}
}
