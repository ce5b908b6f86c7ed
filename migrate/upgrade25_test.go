package migrate_test

import (
	"context"
	"testing"

	"github.com/idemkit/idem/internal/sqlstate"
)

// TestUpgradeTo25: from version 24 holding data, every key of it stranded
// in the default partition (the current month's partition is gone), the
// upgrade to 25 keeps every answer, and idem.move_default_month moves the
// stranded keys (completed ones and one in progress) into the month's new
// partition, where they answer as before. Down to 24 removes the
// functions and keeps the moved rows in place; up again works.
func TestUpgradeTo25(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 24); err != nil {
		t.Fatal(err)
	}
	// The current month's partition is gone (rotation was not running
	// when the month began): its keys land in the default partition, and
	// make_month keeps the month without one.
	if _, err := db.ExecContext(ctx, `DO $$ BEGIN
		EXECUTE format('DROP TABLE idem.%I', idem.partition_name(idem.utc_month(now())));
	END $$`); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	const month = `idem.utc_month(now())`
	var made string
	if err := db.QueryRowContext(ctx, `SELECT idem.make_month(`+month+`)`).Scan(&made); err != nil || made[:5] != "kept:" {
		t.Fatalf("version 24: make_month of the stranded month: %q %v", made, err)
	}

	if _, err := p.UpTo(ctx, 25); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 25")
	var months, rows int
	if err := db.QueryRowContext(ctx, `SELECT count(*), sum(row_count) FROM idem.default_months()`).Scan(&months, &rows); err != nil || months != 1 || rows != 101 {
		t.Fatalf("default_months: %d months, %d rows (%v), want 1, 101", months, rows, err)
	}
	if _, err := db.ExecContext(ctx, `SELECT idem.move_default_month(`+month+`, 100)`); sqlstate.Of(err) != sqlstate.TooManyDefaultRows {
		t.Fatalf("a move over max_rows: %v, want ID010", err)
	}
	var moved int
	if err := db.QueryRowContext(ctx, `SELECT idem.move_default_month(`+month+`, 101)`).Scan(&moved); err != nil || moved != 101 {
		t.Fatalf("move_default_month: %d, %v", moved, err)
	}
	var inDefault int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem.processed_events_default`).Scan(&inDefault); err != nil || inDefault != 0 {
		t.Fatalf("%d rows left in the default partition (%v)", inDefault, err)
	}
	var part string
	if err := db.QueryRowContext(ctx, `SELECT tableoid::regclass::text FROM idem.processed_events WHERE source = 'up' AND key = 'done-7'`).Scan(&part); err != nil || part == "idem.processed_events_default" {
		t.Fatalf("done-7 is in %q (%v)", part, err)
	}
	seededAnswered(t, db, "after the move")

	if _, err := p.DownTo(ctx, 24); err != nil {
		t.Fatal(err)
	}
	var gone bool
	if err := db.QueryRowContext(ctx, `SELECT to_regprocedure('idem.move_default_month(date, bigint)') IS NULL`).Scan(&gone); err != nil || !gone {
		t.Fatalf("down to 24 left idem.move_default_month (%v)", err)
	}
	seededAnswered(t, db, "down at 24")
	if _, err := p.UpTo(ctx, 25); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up at 25 again")
}
