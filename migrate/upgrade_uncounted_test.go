package migrate_test

import (
	"context"
	"testing"
)

// uncountedMarkVersion is the migration whose idem.count_duplicate takes
// the transaction's start time as the idem.uncounted mark.
const uncountedMarkVersion = 29

// TestUpgradeToUncountedMark: from the version before, holding data, the
// upgrade gives idem.count_duplicate the transaction's start time as its
// idem.uncounted mark and keeps every answer; down restores 'on' as the
// mark and keeps every answer; up again. The behaviour:
// idem_test.TestSessionSettingsCarriedOver.
func TestUpgradeToUncountedMark(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, uncountedMarkVersion-1); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	pinned := func(stage string, want int) {
		t.Helper()
		var marked bool
		if err := db.QueryRowContext(ctx, `SELECT prosrc LIKE '%pg_catalog.now()::pg_catalog.text%' FROM pg_proc
			WHERE oid = 'idem.count_duplicate(text, text, date, integer, boolean, timestamptz)'::regprocedure`).Scan(&marked); err != nil || marked != (want > 0) {
			t.Fatalf("%s: idem.count_duplicate takes the transaction's start time as the mark: %v, want %v (%v)", stage, marked, want > 0, err)
		}
	}
	if _, err := p.UpTo(ctx, uncountedMarkVersion); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade")
	pinned("after the upgrade", 2)
	if _, err := p.DownTo(ctx, uncountedMarkVersion-1); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down")
	pinned("down", 0)
	if _, err := p.UpTo(ctx, uncountedMarkVersion); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up again")
	pinned("up again", 2)
}
