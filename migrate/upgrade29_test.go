package migrate_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
)

// TestUpgradeTo29: from version 28 holding data (100 completed keys and
// one in flight), the upgrade to 29 (idem.claim_batch's short path) keeps
// every answer of a single claim and of a batch (a redelivery, its first
// key completed; a batch of new keys with the key in flight and a
// completed key among them; each in a transaction rolled back, field by
// field against version 28's), a batch of new keys is acquired and then
// answered completed; down to 28 (version 23's idem.claim_batch again) and
// up again keep every answer.
func TestUpgradeTo29(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 28); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	batches := [][]string{
		{"done-1", "done-2", "running", "new-a", "done-3", "done-1"},
		{"new-b", "done-4", "running", "new-c", "new-b", "done-5"},
	}
	// Each batch's answers, as text, at the current version (rolled back).
	answers := func(stage string) string {
		t.Helper()
		var all []string
		for _, keys := range batches {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			var got string
			err = tx.QueryRowContext(ctx, `SELECT string_agg(concat_ws(' ', ord, outcome, token IS NOT NULL, attempt, result,
				error, first_seen IS NOT NULL, expires_at IS NOT NULL, lease_remaining IS NOT NULL), '; ' ORDER BY ord)
				FROM idem.claim_batch('up', $1)`, keys).Scan(&got)
			_ = tx.Rollback()
			if err != nil {
				t.Fatalf("%s: batch %v: %v", stage, keys, err)
			}
			all = append(all, got)
		}
		return strings.Join(all, "\n")
	}
	at28 := answers("version 28")
	if !strings.Contains(at28, "1 completed f 1 {\"v\": 1}") || !strings.Contains(at28, "4 acquired t 1") {
		t.Fatalf("version 28's answers are not what the test expects:\n%s", at28)
	}
	shortPath := func() bool {
		t.Helper()
		var src string
		if err := db.QueryRowContext(ctx, `SELECT prosrc FROM pg_proc WHERE oid = 'idem.claim_batch(text, text[], text[], interval, interval, text[], interval)'::regprocedure`).Scan(&src); err != nil {
			t.Fatal(err)
		}
		return strings.Contains(src, "v_lean")
	}
	check := func(stage string, short bool) {
		t.Helper()
		seededAnswered(t, db, stage)
		if got := answers(stage); got != at28 {
			t.Errorf("%s: the batches answer\n%s\nat version 28\n%s", stage, got, at28)
		}
		if shortPath() != short {
			t.Errorf("%s: idem.claim_batch has the short path: %v, want %v", stage, !short, short)
		}
	}
	if _, err := p.UpTo(ctx, 29); err != nil {
		t.Fatal(err)
	}
	check("after the upgrade to 29", true)
	batchAcquiredThenCompleted(t, db, "at 29", "new-at-29")
	if _, err := p.DownTo(ctx, 28); err != nil {
		t.Fatal(err)
	}
	check("down at 28", false)
	if _, err := p.UpTo(ctx, 29); err != nil {
		t.Fatal(err)
	}
	check("up at 29 again", true)
	batchAcquiredThenCompleted(t, db, "up at 29 again", "new-again")
}

// batchAcquiredThenCompleted claims a batch of 10 new keys of source 'up'
// (each must be acquired with a token), completes them with
// idem.complete_batch, and claims them again (each must answer completed).
func batchAcquiredThenCompleted(t *testing.T, db *sql.DB, stage, prefix string) {
	t.Helper()
	ctx := context.Background()
	var n, done int
	if err := db.QueryRowContext(ctx, `
		WITH c AS MATERIALIZED (SELECT * FROM idem.claim_batch('up', ARRAY(SELECT $1 || '-' || g FROM generate_series(1, 10) g))),
		     a AS (SELECT array_agg($1 || '-' || c.ord ORDER BY c.ord) AS keys, array_agg(c.token ORDER BY c.ord) AS tokens
		             FROM c WHERE c.outcome = 'acquired' AND c.token IS NOT NULL)
		SELECT (SELECT cardinality(a.keys) FROM a),
		       (SELECT count(*) FROM a, idem.complete_batch('up', a.keys, a.tokens, NULL) d WHERE d.outcome = 'completed')`,
		prefix).Scan(&n, &done); err != nil || n != 10 || done != 10 {
		t.Fatalf("%s: %d of 10 new keys acquired, %d completed (%v)", stage, n, done, err)
	}
	var n2 int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem.claim_batch('up', ARRAY(SELECT $1 || '-' || g FROM generate_series(1, 10) g))
		WHERE outcome = 'completed'`, prefix).Scan(&n2); err != nil || n2 != 10 {
		t.Fatalf("%s: %d of 10 completed keys answered completed (%v)", stage, n2, err)
	}
}
