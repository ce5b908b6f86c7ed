package migrate_test

import (
	"context"
	"testing"
)

// TestUpgradeTo18: from version 17 holding data, the upgrade to 18 (the
// batch functions) keeps every answer, and a batch answers the stored keys
// as idem.claim does (completed, in progress) and acquires a new one; down
// to 17 drops the batch functions and their rights rows (the single path
// answers as before), and up again.
func TestUpgradeTo18(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 17); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	batch := func() (string, error) {
		var got string
		err := db.QueryRowContext(ctx, `SELECT string_agg(outcome, ',' ORDER BY ord)
			FROM idem.claim_batch('up', ARRAY['running', 'new-18', 'running'])`).Scan(&got)
		return got, err
	}
	if _, err := batch(); !isCode(err, "42883") {
		t.Fatalf("version 17: %v, want 42883 (no idem.claim_batch)", err)
	}

	if _, err := p.UpTo(ctx, 18); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 18")
	if got, err := batch(); err != nil || got != "in_progress,acquired,in_progress" {
		t.Fatalf("version 18: %q %v", got, err)
	}
	var rights int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem.rights WHERE object IN ('idem.claim_batch(text, text[], text[], interval, interval, text[], interval)', 'idem.complete_batch(text, text[], bigint[], jsonb[])', 'idem.fail_batch(text, text[], bigint[], text[], boolean[])')`).Scan(&rights); err != nil || rights != 3 {
		t.Fatalf("version 18: %d rights rows for the batch functions (%v), want 3", rights, err)
	}

	if _, err := p.DownTo(ctx, 17); err != nil {
		t.Fatal(err)
	}
	if _, err := batch(); !isCode(err, "42883") {
		t.Fatalf("down to 17: %v, want 42883", err)
	}
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem.rights WHERE object IN ('idem.claim_batch(text, text[], text[], interval, interval, text[], interval)', 'idem.complete_batch(text, text[], bigint[], jsonb[])', 'idem.fail_batch(text, text[], bigint[], text[], boolean[])')`).Scan(&rights); err != nil || rights != 0 {
		t.Fatalf("down to 17: %d rights rows left (%v)", rights, err)
	}
	seededAnswered(t, db, "down to 17")
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	if got, err := batch(); err != nil || got != "in_progress,in_progress,in_progress" {
		t.Fatalf("up again: %q %v", got, err)
	}
}
