package migrate_test

import (
	"context"
	"database/sql"
	"testing"
)

// serializableCostVersion is the migration that keeps a SERIALIZABLE new
// key on idem.claim's short path, with idem.serializable_placeholders.
const serializableCostVersion = 30

// TestUpgradeToSerializableCost: from the version before, holding data,
// the upgrade keeps every answer; a new key claimed in a SERIALIZABLE
// transaction is acquired and leaves no placeholder row, its duplicate is
// answered in progress; down and up again keep every answer, with the
// same behaviour at each stage. The guarantee itself:
// idem_test.TestSerializableClaimsAcrossMonths and its negative control.
func TestUpgradeToSerializableCost(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, serializableCostVersion-1); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	serializable := func(stage, key string) {
		t.Helper()
		for i, want := range []string{"acquired", "in_progress"} {
			tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelSerializable})
			if err != nil {
				t.Fatal(err)
			}
			var outcome string
			if err := tx.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('up', $1, ttl => '400 days')`, key).Scan(&outcome); err != nil || outcome != want {
				_ = tx.Rollback()
				t.Fatalf("%s: SERIALIZABLE claim %d of %s: %q %v, want %s", stage, i+1, key, outcome, err, want)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
		}
		var placeholders int
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem.processed_events WHERE token = 0`).Scan(&placeholders); err != nil || placeholders != 0 {
			t.Fatalf("%s: %d placeholder rows left (%v)", stage, placeholders, err)
		}
	}
	serializable("before the upgrade", "ser-before")
	if _, err := p.UpTo(ctx, serializableCostVersion); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade")
	serializable("after the upgrade", "ser-after")
	if _, err := p.DownTo(ctx, serializableCostVersion-1); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down")
	serializable("down", "ser-down")
	var left int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_proc WHERE proname = 'serializable_placeholders'`).Scan(&left); err != nil || left != 0 {
		t.Fatalf("down: %d idem.serializable_placeholders left (%v)", left, err)
	}
	if _, err := p.UpTo(ctx, serializableCostVersion); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up again")
	serializable("up again", "ser-again")
}
