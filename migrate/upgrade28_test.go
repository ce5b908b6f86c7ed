package migrate_test

import (
	"context"
	"testing"
)

// TestUpgradeTo28: from version 27 holding data, the upgrade to 28 (the
// claim's copies on Citus' shards) keeps every answer on a single node,
// where idem.claim_general runs no Citus code and idem.citus_shard_claims()
// makes nothing; down to 27 and up again keep every answer. (On Citus:
// TestCitusUpgradeFrom13 and the opt-in suite, docs/citus.md.)
func TestUpgradeTo28(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 27); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, 28); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 28")
	var made int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem.citus_shard_claims()`).Scan(&made); err != nil || made != 0 {
		t.Fatalf("idem.citus_shard_claims() on a single node: %d rows, %v", made, err)
	}
	var outcome string
	if err := db.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('up', 'new-at-28')`).Scan(&outcome); err != nil || outcome != "acquired" {
		t.Fatalf("a new key at 28: %q %v", outcome, err)
	}
	if _, err := p.DownTo(ctx, 27); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down at 27")
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_proc WHERE proname IN ('citus_shard_claim', 'citus_shard_claims')`).Scan(&made); err != nil || made != 0 {
		t.Fatalf("after down to 27: %d of the new functions left (%v)", made, err)
	}
	if _, err := p.UpTo(ctx, 28); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up at 28 again")
}
