package migrate_test

import (
	"context"
	"testing"
)

// TestUpgradeTo10: from version 9 holding data (completed keys, a key in
// progress) and a maintainer role, the upgrade to 10 keeps every answer;
// claims and duplicates are counted per minute in idem.activity (sampling 1
// here: exact); the maintainer takes a snapshot, records a run and reads
// the dashboard's tables; CALL idem.prune() records its run; down to 9
// removes version 10's objects, keeping every answer; up again works.
func TestUpgradeTo10(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 9); err != nil {
		t.Fatal(err)
	}
	_, maint := appAndMaintainer(t, db, "idem_up10")
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 10")

	if _, err := db.ExecContext(ctx, `
		INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling) VALUES ('act', '1 day', '1 minute', 1);
		SELECT idem.claim('act', 'k' || g) FROM generate_series(1, 30) g;
		SELECT idem.complete('act', 'k' || g, (SELECT token FROM idem.processed_events WHERE source = 'act' AND key = 'k' || g), '{}') FROM generate_series(1, 30) g;
		SELECT idem.claim('act', 'k' || (g % 10 + 1)) FROM generate_series(1, 20) g`); err != nil {
		t.Fatal(err)
	}
	var acquired, dups int64
	if err := db.QueryRowContext(ctx, `SELECT coalesce(sum(acquired), 0), coalesce(sum(duplicates), 0) FROM idem.activity WHERE source = 'act'`).Scan(&acquired, &dups); err != nil || acquired != 30 || dups != 20 {
		t.Fatalf("activity after 30 new keys and 20 duplicates: %d acquired, %d duplicates (%v)", acquired, dups, err)
	}

	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, `SET ROLE `+maint); err != nil {
		t.Fatal(err)
	}
	var sources int
	if err := conn.QueryRowContext(ctx, `SELECT idem.snapshot_stats()`).Scan(&sources); err != nil || sources != 2 {
		t.Fatalf("snapshot_stats as the maintainer: %d sources (%v)", sources, err)
	}
	var keys, processing int64
	if err := conn.QueryRowContext(ctx, `SELECT keys, processing FROM idem.source_snapshots WHERE source = 'up'`).Scan(&keys, &processing); err != nil || keys != 101 || processing != 1 {
		t.Fatalf("the snapshot of source up: %d keys, %d processing (%v)", keys, processing, err)
	}
	if _, err := conn.ExecContext(ctx, `CALL idem.prune()`); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.ExecContext(ctx, `CALL idem.rotate()`); err != nil {
		t.Fatal(err)
	}
	var runs int
	if err := conn.QueryRowContext(ctx, `SELECT count(*) FROM idem.runs WHERE outcome = 'ok' AND figures ? CASE job WHEN 'prune' THEN 'deleted' ELSE 'created' END`).Scan(&runs); err != nil || runs != 2 {
		t.Fatalf("runs recorded by CALL idem.prune() and idem.rotate(): %d (%v)", runs, err)
	}
	// Prune folded the activity of finished minutes; the counts are kept.
	if err := conn.QueryRowContext(ctx, `SELECT coalesce(sum(acquired), 0), coalesce(sum(duplicates), 0) FROM idem.activity WHERE source = 'act'`).Scan(&acquired, &dups); err != nil || acquired != 30 || dups != 20 {
		t.Fatalf("activity after prune: %d acquired, %d duplicates (%v)", acquired, dups, err)
	}
	if _, err := conn.ExecContext(ctx, `RESET ROLE`); err != nil {
		t.Fatal(err)
	}

	if _, err := p.DownTo(ctx, 9); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down to 9")
	var gone bool
	if err := db.QueryRowContext(ctx, `SELECT to_regclass('idem.activity') IS NULL AND to_regclass('idem.runs') IS NULL
		AND to_regclass('idem.source_snapshots') IS NULL AND to_regprocedure('idem.count_activity(text, timestamptz, integer, integer)') IS NULL`).Scan(&gone); err != nil || !gone {
		t.Fatalf("version 10's objects left after down: %v", err)
	}
	if _, err := db.ExecContext(ctx, `CALL idem.prune()`); err != nil {
		t.Fatalf("CALL idem.prune() at 9 again: %v", err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up to 10 again")
}
