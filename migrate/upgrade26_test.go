package migrate_test

import (
	"context"
	"testing"
)

// TestUpgradeTo26: from version 25 holding data, the upgrade to 26 keeps
// every answer; a month detached to be dropped whose DROP did not happen
// (the rotation stopped between the two) is listed by
// idem.detached_months() as a drop pending, and CALL idem.rotate() drops
// it; a month CALL idem.rotate(keep_detached => true) detached is kept, and
// never taken for one. Down to 25 and up again keep every answer.
func TestUpgradeTo26(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 25); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	lastMonth := func() string {
		t.Helper()
		var name string
		if err := db.QueryRowContext(ctx, `SELECT 'idem.' || idem.create_partition((date_trunc('month', now() AT TIME ZONE 'UTC') - interval '1 month')::date)::text`).Scan(&name); err != nil {
			t.Fatal(err)
		}
		return name
	}
	if _, err := p.UpTo(ctx, 26); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 26")

	// A rotation detached last month to drop it, and stopped there.
	part := lastMonth()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	var out string
	if err := tx.QueryRowContext(ctx, `SELECT idem.retire_partition($1::regclass, true)`, part).Scan(&out); err != nil || out != "detached" {
		t.Fatalf("retire: %q %v", out, err)
	}
	if _, err := tx.ExecContext(ctx, `SELECT idem.mark_for_drop($1::regclass)`, part); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	var pending bool
	if err := db.QueryRowContext(ctx, `SELECT drop_pending FROM idem.detached_months() WHERE part = $1::regclass`, part).Scan(&pending); err != nil || !pending {
		t.Fatalf("detached_months: %s pending %v (%v)", part, pending, err)
	}
	if _, err := db.ExecContext(ctx, `CALL idem.rotate()`); err != nil {
		t.Fatal(err)
	}
	var left bool
	if err := db.QueryRowContext(ctx, `SELECT to_regclass($1) IS NOT NULL`, part).Scan(&left); err != nil || left {
		t.Fatalf("CALL idem.rotate() left %s (%v)", part, err)
	}

	// Kept on purpose: detached, not pending, and a later rotation keeps it.
	kept := lastMonth()
	if _, err := db.ExecContext(ctx, `CALL idem.rotate(keep_detached => true)`); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRowContext(ctx, `SELECT drop_pending FROM idem.detached_months() WHERE part = $1::regclass`, kept).Scan(&pending); err != nil || pending {
		t.Fatalf("a month detached to be kept: pending %v (%v)", pending, err)
	}
	if _, err := db.ExecContext(ctx, `CALL idem.rotate()`); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRowContext(ctx, `SELECT to_regclass($1) IS NOT NULL`, kept).Scan(&left); err != nil || !left {
		t.Fatalf("the kept month was dropped (%v)", err)
	}
	seededAnswered(t, db, "after the rotations")

	if _, err := p.DownTo(ctx, 25); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down at 25")
	if _, err := p.UpTo(ctx, 26); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up at 26 again")
}
