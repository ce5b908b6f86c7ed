package migrate_test

import (
	"context"
	"testing"
)

// TestUpgradeTo9: from version 8 holding data (completed keys, a key in
// progress), the upgrade to 9 keeps every answer; an adoption started at 9
// makes claims answer a legacy event as completed (adopted on the spot)
// while it copies; down to 8 removes the adoptions and claim version 9,
// keeping every answer; up again works.
func TestUpgradeTo9(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 8); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `
		SELECT idem.claim('up', 'running', lease => '1 hour');
		CREATE TABLE public.legacy_events (id text PRIMARY KEY, at timestamptz NOT NULL);
		INSERT INTO public.legacy_events VALUES ('evt_old', now() - interval '1 day')`); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 9")
	var outcome string
	if err := db.QueryRowContext(ctx, `SELECT idem.adopt_start('up', 'public.legacy_events', 'id', 'at')`).Scan(new(int64)); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('up', 'evt_old')`).Scan(&outcome); err != nil || outcome != "completed" {
		t.Fatalf("a legacy event while adopting: %s %v", outcome, err)
	}
	if err := db.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('up', 'evt_new')`).Scan(&outcome); err != nil || outcome != "acquired" {
		t.Fatalf("a new event while adopting: %s %v", outcome, err)
	}
	if _, err := p.DownTo(ctx, 8); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down to 8")
	var gone bool
	if err := db.QueryRowContext(ctx, `SELECT to_regclass('idem.adoptions') IS NULL AND to_regprocedure('idem.adopt_key(bigint, text, timestamptz, date, date)') IS NULL`).Scan(&gone); err != nil || !gone {
		t.Fatalf("version 9's objects left after down: %v", err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up to 9 again")
}
