package migrate_test

import (
	"context"
	"database/sql"
	"fmt"
	"regexp"
	"strings"
	"testing"
)

// TestUpgradeTo19: from version 18 holding data, the upgrade to 19 keeps
// every answer; a source under the default sampling (1 in 8) with two keys
// and 18 duplicates is counted exactly (2 acquired, 18 duplicates in
// idem.activity and idem.duplicate_counts), and the keys list's order
// (expires_at, source, key) is read from an index with no Sort. Down to 18
// restores the index on expires_at alone and the sampled counter, and up
// again.
func TestUpgradeTo19(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 18); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, 19); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 19")
	twoKeys(t, db, "low")
	if plan := keysPlan(t, db); sortNode.MatchString(plan) || !strings.Contains(plan, "expires_at_source_key_idx") {
		t.Errorf("version 19: the keys list is not read in order from the index:\n%s", plan)
	}

	if _, err := p.DownTo(ctx, 18); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down to 18")
	var n int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_catalog.pg_proc WHERE proname IN ('claim_weight', 'exact_counting_rate')`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("down to 18: %d of version 19's functions left (%v)", n, err)
	}
	if plan := keysPlan(t, db); !sortNode.MatchString(plan) {
		t.Errorf("down to 18: the keys list's plan has no Sort over the expires_at index:\n%s", plan)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	twoKeys(t, db, "again")
}

// sortNode is a Sort or Incremental Sort node of an EXPLAIN (not a Merge
// Append's "Sort Key").
var sortNode = regexp.MustCompile(`(?m)^\s*(->\s+)?(Incremental )?Sort\s*$`)

// twoKeys claims two keys of a new source with the default policy
// (duplicate_sampling 8), then each 9 times more, and checks that the
// counts are exact: 2 acquired and 18 duplicates.
func twoKeys(t *testing.T, db *sql.DB, source string) {
	t.Helper()
	ctx := context.Background()
	for i := range 20 {
		if _, err := db.ExecContext(ctx, `SELECT idem.claim($1, $2, lease => '1 hour')`, source, fmt.Sprintf("k%d", i%2)); err != nil {
			t.Fatal(err)
		}
	}
	var acquired, duplicates, counted int64
	if err := db.QueryRowContext(ctx, `SELECT coalesce(sum(acquired), 0), coalesce(sum(duplicates), 0) FROM idem.activity WHERE source = $1`, source).Scan(&acquired, &duplicates); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRowContext(ctx, `SELECT coalesce(sum(duplicates), 0) FROM idem.duplicate_counts WHERE source = $1`, source).Scan(&counted); err != nil {
		t.Fatal(err)
	}
	if acquired != 2 || duplicates != 18 || counted != 18 {
		t.Errorf("%s: two keys claimed 10 times each counted as %d acquired, %d duplicates (idem.duplicate_counts: %d); want 2, 18, 18",
			source, acquired, duplicates, counted)
	}
}

// keysPlan is the plan of the dashboard's keys list (its inner scan, as
// sql/queries/dashboard.sql's DashKeys has it).
func keysPlan(t *testing.T, db *sql.DB) string {
	t.Helper()
	ctx := context.Background()
	// The tables are small here: the planner is told to avoid a sequential
	// scan and a sort where it can, so a Sort left in the plan is one no
	// index can spare.
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, `SET LOCAL enable_seqscan = off; SET LOCAL enable_sort = off`); err != nil {
		t.Fatal(err)
	}
	rows, err := tx.QueryContext(ctx, `EXPLAIN (COSTS OFF)
		SELECT x.* FROM idem.processed_events x
		 WHERE (x.expires_at, x.source, x.key) < ('infinity'::timestamptz, '', '')
		 ORDER BY x.expires_at DESC, x.source DESC, x.key DESC LIMIT 20000`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var b strings.Builder
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			t.Fatal(err)
		}
		b.WriteString(line + "\n")
	}
	return b.String()
}
