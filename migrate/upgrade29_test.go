package migrate_test

import (
	"context"
	"testing"
)

// TestUpgradeTo29: from version 26 holding data, the upgrade to 29 (the
// claim's copies on Citus' shards) keeps every answer on a single node,
// where idem.claim version 29 runs no Citus code and
// idem.citus_shard_claims() makes nothing; down to 26 and up again keep
// every answer. (On Citus: TestCitusUpgradeFrom13 and the opt-in suite,
// docs/citus.md.)
func TestUpgradeTo29(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 26); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, 29); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 29")
	var made int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem.citus_shard_claims()`).Scan(&made); err != nil || made != 0 {
		t.Fatalf("idem.citus_shard_claims() on a single node: %d rows, %v", made, err)
	}
	var outcome string
	if err := db.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('up', 'new-at-29')`).Scan(&outcome); err != nil || outcome != "acquired" {
		t.Fatalf("a new key at 29: %q %v", outcome, err)
	}
	if _, err := p.DownTo(ctx, 26); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down at 26")
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_proc WHERE proname IN ('citus_shard_claim', 'citus_shard_claims')`).Scan(&made); err != nil || made != 0 {
		t.Fatalf("after down to 26: %d of the new functions left (%v)", made, err)
	}
	if _, err := p.UpTo(ctx, 29); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up at 29 again")
}
