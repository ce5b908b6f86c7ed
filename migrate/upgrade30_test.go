package migrate_test

import (
	"context"
	"testing"
)

// TestUpgradeTo30: from version 28 holding data, the upgrade to 30 (a
// batch's keys claimed on their Citus node as one batch) keeps every
// answer on a single node, where it changes only functions that Citus
// calls (idem.citus_shard_claims() makes nothing; idem.claim_batch is not
// touched); a batch claims there as before; down to 28 removes the new
// helper and up again keeps every answer. (On Citus: TestCitusBatchByNode
// and the opt-in suite, docs/citus.md.)
func TestUpgradeTo30(t *testing.T) {
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
	// (idem.claim_batch as migration 29 leaves it.)
	if _, err := p.UpTo(ctx, 29); err != nil {
		t.Fatal(err)
	}
	var before string
	if err := db.QueryRowContext(ctx, `SELECT md5(pg_get_functiondef('idem.claim_batch(text, text[], text[], interval, interval, text[], interval)'::regprocedure))`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, 30); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 30")
	var after string
	if err := db.QueryRowContext(ctx, `SELECT md5(pg_get_functiondef('idem.claim_batch(text, text[], text[], interval, interval, text[], interval)'::regprocedure))`).Scan(&after); err != nil || after != before {
		t.Fatalf("idem.claim_batch changed by the upgrade to 30 (%v)", err)
	}
	var made int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem.citus_shard_claims()`).Scan(&made); err != nil || made != 0 {
		t.Fatalf("idem.citus_shard_claims() on a single node: %d rows, %v", made, err)
	}
	var acquired int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem.claim_batch('up', ARRAY['b1', 'b2', 'done-1']) WHERE outcome = 'acquired'`).Scan(&acquired); err != nil || acquired != 2 {
		t.Fatalf("a batch at 30: %d acquired (%v), want 2", acquired, err)
	}
	if _, err := p.DownTo(ctx, 28); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down at 28")
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_proc WHERE proname = 'citus_on_shard'`).Scan(&made); err != nil || made != 0 {
		t.Fatalf("after down to 28: idem.citus_on_shard left (%d, %v)", made, err)
	}
	if _, err := p.UpTo(ctx, 30); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up at 30 again")
}
